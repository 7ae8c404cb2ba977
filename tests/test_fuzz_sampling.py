"""Fuzzing the sampler pipeline's launchers: SamplingParams (NaN, inf, negative, out of range,
wrong types), the logits processors, sampling (rows with NaN / inf / no finite logit, greedy,
filters) and the grammar bitmask (harness: test_fuzz_harness.py)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opmap.core.contract import InputError
from test_fuzz_harness import Case, close, fuzz, gen, launchers, randn

F = (torch.float32, torch.float16)


def _n(name):
    return 20 if "triton" in name else 30


# ---- SamplingParams ---------------------------------------------------------------------------

BAD_REALS = [math.nan, math.inf, -math.inf, -1.0, "0.5", None, True]
FIELDS = {  # field -> (valid values, how a value is judged valid: an oracle written from the docs)
    "max_tokens": ([1, 7, 4096], lambda v: type(v) is int and v >= 1),
    "temperature": ([0.0, 0.7, 1, 2.5], lambda v: type(v) in (int, float) and math.isfinite(v) and v >= 0),
    "top_k": ([0, 1, 50], lambda v: type(v) is int and v >= 0),
    "top_p": ([1.0, 0.9, 0.01], lambda v: type(v) in (int, float) and not math.isnan(v) and 0 < v <= 1),
    "min_p": ([0.0, 0.05, 1.0], lambda v: type(v) in (int, float) and not math.isnan(v) and 0 <= v <= 1),
    "repetition_penalty": ([1.0, 1.3, 0.5], lambda v: type(v) in (int, float) and math.isfinite(v) and v > 0),
    "frequency_penalty": ([0.0, 0.5, -0.5], lambda v: type(v) in (int, float) and math.isfinite(v)),
    "presence_penalty": ([0.0, 1.0, -2.0], lambda v: type(v) in (int, float) and math.isfinite(v)),
    "seed": ([None, 0, 2**63 - 1], lambda v: v is None or (type(v) is int and 0 <= v < 2**63)),
}


def test_fuzz_sampling_params():
    import collections
    import warnings

    from opmap.engine.params import SamplingParams
    from test_fuzz_harness import FuzzReport

    stats = collections.Counter()

    @settings(max_examples=150, deadline=None, derandomize=True, database=None)
    @given(st.data())
    def run(data):
        kw = {f: data.draw(st.sampled_from(ok)) for f, (ok, _) in FIELDS.items()}
        bad_field = data.draw(st.sampled_from([None] + list(FIELDS)))
        if bad_field:
            kw[bad_field] = data.draw(st.sampled_from(BAD_REALS + [0, 1.5, 2**63, -3, 0.0]))
        valid = all(FIELDS[f][1](v) for f, v in kw.items())
        try:
            SamplingParams(**kw)
        except InputError as e:
            assert not valid, f"valid {kw} rejected: {e}"
            assert e.arg == bad_field, f"{kw}: InputError names {e.arg!r}, the bad field is {bad_field!r}"
            stats["broken: rejected"] += 1
            return
        assert valid, f"{bad_field}={kw[bad_field]!r} accepted"
        stats["valid: accepted"] += 1

    run()
    warnings.warn(FuzzReport(f"fuzz SamplingParams: {sum(stats.values())} generated cases ("
                             + ", ".join(f"{k} {v}" for k, v in sorted(stats.items())) + ")"))
    assert stats["broken: rejected"] and stats["valid: accepted"], stats


# ---- sample -------------------------------------------------------------------------------------

# Per-row values outside the contract (ops/sampling/reference.py): (argument, value).
BAD_VALUES = {"temp_neg": ("temperature", -1.0), "temp_nan": ("temperature", math.nan),
              "temp_inf": ("temperature", math.inf), "topk_neg": ("top_k", -5), "topp_big": ("top_p", 5.0),
              "topp_nan": ("top_p", math.nan), "topp_zero": ("top_p", 0.0), "minp_neg": ("min_p", -2.0),
              "minp_nan": ("min_p", math.nan)}

@st.composite
def sample_cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    B, V = draw(st.integers(0, 4)), draw(st.integers(1, 300))
    dtype = draw(st.sampled_from(F))
    rows = [draw(st.sampled_from(["ok", "ok", "ok", "nan", "inf", "neginf", "ties"])) for _ in range(B)]
    temps = [draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])) for _ in range(B)]
    topk = [draw(st.sampled_from([0, 1, 3, V, V + 5])) for _ in range(B)]
    topp = [draw(st.sampled_from([1.0, 0.9, 0.3, 1e-6])) for _ in range(B)]
    minp = [draw(st.sampled_from([0.0, 0.1, 1.0])) for _ in range(B)]
    brk = draw(st.sampled_from(("none",) * 6 + ("rows", "lastdim", "logits_1d", "logits_int", "temp_fp16",
                                                  "topk_float", "seeds_int32", "pos_len", "minp_len",
                                                  "seeds_device") + tuple(BAD_VALUES)))
    if brk in ("temp_fp16", "topk_float", "seeds_int32", "pos_len", "minp_len", "lastdim", "seeds_device",
               *BAD_VALUES) and B == 0:
        B, rows, temps, topk, topp, minp = 1, ["ok"], [1.0], [0], [1.0], [0.0]
    if brk in BAD_VALUES:  # one row's value out of its range (NaN included)
        at = draw(st.integers(0, B - 1))
        which, bad = BAD_VALUES[brk]
        lists = dict(temperature=temps, top_k=topk, top_p=topp, min_p=minp)
        lists[which] = lists[which][:at] + [bad] + lists[which][at + 1:]
        temps, topk, topp, minp = lists["temperature"], lists["top_k"], lists["top_p"], lists["min_p"]

    def build():
        g = gen(seed)
        x = randn((B, V), dtype, g, scale=3.0, row_stride_pad=7 if brk == "rows" else 0,
                  last_dim_step=2 if brk == "lastdim" else 1)
        for b, kind in enumerate(rows):
            if kind == "nan":
                x[b, V // 2] = math.nan
            elif kind == "inf":
                x[b, 0] = math.inf
            elif kind == "neginf":
                x[b] = -math.inf
            elif kind == "ties":
                x[b] = 1.0
        if brk == "logits_1d":
            x = x.reshape(-1)
        if brk == "logits_int":
            x = x.nan_to_num(0, 0, 0).to(torch.int32)
        t = torch.tensor(temps, dtype=torch.float16 if brk == "temp_fp16" else torch.float32)
        k = torch.tensor(topk, dtype=torch.float32 if brk == "topk_float" else torch.int32)
        p = torch.tensor(topp, dtype=torch.float32)
        m = torch.tensor(minp + ([0.0] if brk == "minp_len" else []), dtype=torch.float32)
        s = torch.randint(0, 2**62, (B,), generator=g, dtype=torch.int64)
        s = s.to(torch.int32) if brk == "seeds_int32" else s
        s = s.to("meta") if brk == "seeds_device" else s
        pos = torch.randint(0, 10**6, (B + (1 if brk == "pos_len" else 0),), generator=g, dtype=torch.int64)
        return (x, t, k, p, m, s, pos), {}

    arg = {"lastdim": "logits", "logits_1d": "logits", "logits_int": "logits", "temp_fp16": "temperature",
           "topk_float": "top_k", "seeds_int32": "seeds", "pos_len": "positions", "minp_len": "min_p",
           "seeds_device": "seeds", **{k: v[0] for k, v in BAD_VALUES.items()}}
    broken = frozenset({arg[brk]}) if brk in arg and not (brk == "lastdim" and V == 1) else frozenset()
    return Case(build, broken,
                what=f"{brk} B={B} V={V} {dtype} rows={rows} t={temps} k={topk} p={topp} min_p={minp}")


def _cmp_sample(case, got, exp):
    from opmap.ops.sampling.reference import filtered_probs

    (ids, invalid), (rids, rinvalid) = got[0][:2], exp[0]
    x, t, k, p, m = got[1][:5]
    assert ids.dtype == torch.int64 and invalid.dtype == torch.bool
    assert torch.equal(invalid, rinvalid), f"invalid rows {invalid.tolist()} vs reference {rinvalid.tolist()}"
    assert (ids[invalid] == 0).all(), "an invalid row's id must be 0"
    greedy = (t == 0) | (k == 1)
    ok = ~invalid
    assert torch.equal(ids[greedy & ok], rids[greedy & ok]), "greedy rows differ from the reference's argmax"
    probs = filtered_probs(x, t, k, p, m)
    for b in torch.nonzero(ok & ~greedy).flatten().tolist():
        i = int(ids[b])
        assert 0 <= i < x.shape[1] and probs[b, i] > 0, f"row {b}: token {i} is outside the support"


@pytest.mark.parametrize("name", launchers("sampling", "sample"))
def test_fuzz_sample(name):
    fuzz("sampling", name, "sample", sample_cases(), _cmp_sample, _n(name))


# ---- logits processors ----------------------------------------------------------------------

@st.composite
def penalty_cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    B, V = draw(st.integers(0, 4)), draw(st.integers(1, 200))
    dtype = draw(st.sampled_from(F))
    brk = draw(st.sampled_from(("none",) * 5 + ("rows", "mask_u8", "counts_float", "counts_shape", "rep_len",
                                                  "freq_fp64", "logits_int", "rep_zero", "rep_nan", "freq_inf",
                                                  "pres_nan")))
    if brk in ("rep_len", "freq_fp64", "counts_shape", "rep_zero", "rep_nan", "freq_inf", "pres_nan") and B == 0:
        B = 2

    def build():
        g = gen(seed)
        x = randn((B, V), dtype, g, scale=3.0, row_stride_pad=3 if brk == "rows" else 0)
        if brk == "logits_int":
            x = x.to(torch.int32)
        mask = torch.rand(B, V, generator=g) < 0.3
        counts = torch.randint(0, 4, (B, V + (1 if brk == "counts_shape" else 0)), generator=g, dtype=torch.int32)
        rep = torch.rand(B + (1 if brk == "rep_len" else 0), generator=g) + 0.5
        freq = torch.rand(B, generator=g, dtype=torch.float64 if brk == "freq_fp64" else torch.float32) - 0.5
        pres = torch.rand(B, generator=g) - 0.5
        bad = {"rep_zero": (rep, 0.0), "rep_nan": (rep, math.nan), "freq_inf": (freq, math.inf),
               "pres_nan": (pres, math.nan)}
        if brk in bad:  # the last row's value out of its range
            bad[brk][0][-1] = bad[brk][1]
        return (x, mask.to(torch.uint8) if brk == "mask_u8" else mask,
                counts.float() if brk == "counts_float" else counts, rep, freq, pres), {}

    arg = {"mask_u8": "prompt_mask", "counts_float": "output_counts", "counts_shape": "output_counts",
           "rep_len": "repetition", "freq_fp64": "frequency", "logits_int": "logits", "rep_zero": "repetition",
           "rep_nan": "repetition", "freq_inf": "frequency", "pres_nan": "presence"}
    return Case(build, frozenset({arg[brk]}) if brk in arg else frozenset(), what=f"{brk} B={B} V={V} {dtype}")


@pytest.mark.parametrize("name", launchers("logits", "apply_penalties"))
def test_fuzz_apply_penalties(name):
    fuzz("logits", name, "apply_penalties", penalty_cases(),
         lambda c, g, e: close(g[1][0], e[1][0], what="logits"), _n(name))


# ---- grammar bitmask --------------------------------------------------------------------------

@st.composite
def bitmask_cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    B, V = draw(st.integers(0, 4)), draw(st.integers(1, 150))
    dtype = draw(st.sampled_from(F))
    use_rows = draw(st.booleans())
    brk = draw(st.sampled_from(("none",) * 5 + ("rows_dup", "bm_int64", "bm_width", "rows_high", "rows_neg",
                                                  "rows_float", "logits_1d", "lastdim")))
    if brk in ("rows_dup", "rows_high", "rows_neg", "rows_float") or B == 0 and brk != "none":
        B, use_rows = max(B, 2), brk in ("rows_dup", "rows_high", "rows_neg", "rows_float") or use_rows

    def build():
        g = gen(seed)
        x = randn((B, V), dtype, g, scale=2.0, last_dim_step=2 if brk == "lastdim" else 1)
        W = (V + 31) // 32 + (1 if brk == "bm_width" else 0)
        bm = torch.randint(-2**31, 2**31, (B, W), generator=g, dtype=torch.int64)
        bm = bm if brk == "bm_int64" else bm.to(torch.int32)
        rows = None
        if use_rows:
            rows = torch.randperm(B, generator=g)[: max(1, B - 1)]
            if brk == "rows_dup":  # a row listed twice: masked twice, same result
                rows = torch.cat([rows, rows[:1]])
            if brk == "rows_high":
                rows[0] = B
            if brk == "rows_neg":
                rows[-1] = -1
            if brk == "rows_float":
                rows = rows.float()
        if brk == "logits_1d":
            x = x.reshape(-1)
        return (x, bm, rows), {}

    arg = {"bm_int64": "bitmask", "bm_width": "bitmask", "rows_high": "rows", "rows_neg": "rows",
           "rows_float": "rows", "logits_1d": "logits", "lastdim": "logits"}
    broken = frozenset({arg[brk]}) if brk in arg and not (brk == "lastdim" and V == 1) else frozenset()
    return Case(build, broken, what=f"{brk} B={B} V={V} rows={use_rows} {dtype}")


@pytest.mark.parametrize("name", launchers("grammar_mask", "apply_bitmask"))
def test_fuzz_apply_bitmask(name):
    fuzz("grammar_mask", name, "apply_bitmask", bitmask_cases(),
         lambda c, g, e: close(g[1][0], e[1][0], what="logits"), _n(name))


# xgrammar's CPU apply wrote -inf past the end of a row whose vocabulary is not a multiple of 32
# (found by the fuzzing above; its adapter now sets the padding bits): every launcher is held to it.
@pytest.mark.parametrize("name", launchers("grammar_mask", "apply_bitmask"))
def test_bitmask_writes_only_inside_the_row(name):
    from opmap.core import registry

    fn = registry.get("grammar_mask", name).fn("apply_bitmask")
    for word in (1, 2**31 - 1, -2105894115):
        for V in (1, 2, 5, 31):
            # The logits are the first V floats of a 96-float buffer: anything written past them
            # is an out-of-bounds write, caught inside memory this test owns.
            buf = torch.zeros(96)
            logits = buf[:V].view(1, V)
            fn(logits, torch.tensor([[word]], dtype=torch.int32))
            assert logits[0, 0] == 0  # bit 0 is set in every word above
            assert (buf[V:] == 0).all(), f"{name} wrote outside a row of {V} at {(buf[V:] != 0).nonzero()[:4]}"
