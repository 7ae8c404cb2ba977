"""Fuzzing the paged-attention launchers: KV append, decode, prefill, merge. Random batch sizes,
lengths (0, page boundaries, beyond the pages owned), head counts (divisible or not), page
sizes, page tables (shuffled, shared, duplicated, ids out of range, negative), fp8 KV, window,
soft-cap, LSE, strides, dtypes. Unused cache slots hold NaN, so a read outside what a sequence
owns poisons the result (harness: test_fuzz_harness.py)."""
import math

import pytest
import torch
from hypothesis import strategies as st

from opmap.harness.fixtures.attention import make_paged, make_query
from test_fuzz_harness import Case, close, fuzz, gen, launchers

N = {"triton": 18, "flex": 10}  # FlexAttention on the CPU compiles per shape: a few cases only
DT = {torch.float32: "fp32", torch.float16: "fp16"}


def _n(name):
    return N.get(name, 30)


COMMON_BREAKS = ("bt_high", "bt_neg", "len_over", "len_neg", "heads", "q_dim", "sl_int64", "bt_int64",
                 "kc_strided", "v_dtype", "scale0", "scale_nan", "window0", "softcap_neg", "fp8_noscale",
                 "q_dtype", "bt_device")
ARG = {"bt_device": "block_tables", "bt_high": "block_tables", "bt_neg": "block_tables", "len_over": "seq_lens", "len_neg": "seq_lens",
       "heads": "q", "q_dim": "q", "sl_int64": "seq_lens", "bt_int64": "block_tables", "kc_strided": "k_cache",
       "v_dtype": "v_cache", "scale0": "scale", "scale_nan": "scale", "window0": "window",
       "softcap_neg": "soft_cap", "fp8_noscale": "k_scale", "q_dtype": "k_cache", "q_rows": "q",
       "cu_end": "cu_seqlens_q", "cu_dec": "cu_seqlens_q", "cu_int64": "cu_seqlens_q", "qlen_over": "seq_lens",
       "batch": "seq_lens", "dup_pages": "block_tables"}


@st.composite
def attn_cases(draw, phase, poison=True, dups=True, pages=(1, 4, 16)):
    seed = draw(st.integers(0, 2**31 - 1))
    B = draw(st.integers(1, 3))
    page = draw(st.sampled_from(pages))
    hk = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    D = draw(st.sampled_from([64, 64, 16]))
    dtype = draw(st.sampled_from([torch.float16, torch.float32]))
    fp8 = draw(st.sampled_from([False, False, False, True])) and dtype == torch.float16
    lens = draw(st.lists(st.sampled_from([0, 1, page - 1, page, page + 1, 2 * page + 3, 37]), min_size=B, max_size=B))
    lens = [max(0, L) for L in lens]
    shared = draw(st.booleans()) and B > 1 and lens[0] >= page and all(L >= page for L in lens)
    window = draw(st.sampled_from([None, None, 1, 5]))
    soft_cap = draw(st.sampled_from([None, None, 30.0]))
    lse = draw(st.booleans())
    extra = ("cu_end", "cu_dec", "cu_int64", "qlen_over") if phase == "prefill" else ("batch",)
    brk = draw(st.sampled_from(("none",) * 8 + ("dup_pages",) * dups + ("q_rows",) + COMMON_BREAKS + extra))
    if brk in ("len_over", "bt_high", "bt_neg", "dup_pages", "qlen_over", "cu_dec") and max(lens) < 2:
        lens[0] = page + 1
    if phase == "prefill":
        qlens = [draw(st.integers(0, L)) for L in lens]
        if brk in ("qlen_over", "cu_dec"):
            qlens[int(lens.index(max(lens)))] = max(lens)
    hq = hk * group + (1 if brk == "heads" and hk > 1 else 0)
    if brk == "heads" and hk == 1:
        brk = "none"  # every head count divides 1

    def build():
        g = gen(seed)
        p = make_paged(lens, hk, D, page, dtype=dtype, fp8=fp8, shared=shared, poison=poison, generator=g)
        kc, vc, sl, bt = p.k_cache, p.v_cache, p.seq_lens, p.block_tables
        b_long = int(torch.tensor(lens).argmax())
        if brk == "dup_pages":  # one page listed twice by a sequence: allowed, it is read twice
            bt[b_long, 1] = bt[b_long, 0]
        if brk == "bt_high":
            bt[b_long, 0] = kc.shape[0]
        if brk == "bt_neg":
            bt[b_long, (lens[b_long] - 1) // page] = -3
        if brk == "len_over":
            sl[b_long] = bt.shape[1] * page + 1
        if brk == "len_neg":
            sl[0] = -1
        if brk == "sl_int64":
            sl = sl.long()
        if brk == "bt_int64":
            bt = bt.long()
        if brk == "bt_device":
            bt = bt.to("meta")
        if brk == "kc_strided":
            kc = torch.cat([kc, kc], dim=3)[..., :D]
        if brk == "v_dtype":
            vc = vc.to(torch.float32 if vc.dtype != torch.float32 else torch.float16)
        qd = D + (8 if brk == "q_dim" else 0)
        qdt = dtype if brk != "q_dtype" else (torch.float32 if dtype == torch.float16 else torch.float16)
        if phase == "decode":
            q = torch.randn(B, hq, qd, generator=g).to(qdt)
            if brk == "q_rows":  # rows strided (a slice of a fused QKV output): may be accepted
                q = torch.randn(B, hq + 2, qd, generator=g).to(qdt)[:, :hq]
            if brk == "batch":
                sl = torch.cat([sl, sl[:1]])
            args = [q, kc, vc, sl, bt]
        else:
            q, cu = make_query(qlens, hq, qd, dtype=qdt, generator=g)
            if brk == "q_rows":
                q = torch.cat([q, q], dim=1)[:, :hq]
            if brk == "cu_end":
                cu[-1] += 1
            if brk == "cu_dec":
                cu[1] = -1  # offsets no longer non-decreasing from 0
            if brk == "cu_int64":
                cu = cu.long()
            args = [q, kc, vc, cu, sl, bt]
        kw = dict(scale={"scale0": 0.0, "scale_nan": math.nan}.get(brk, 1 / math.sqrt(D)),
                  window=0 if brk == "window0" else window, soft_cap=-1.0 if brk == "softcap_neg" else soft_cap,
                  return_lse=lse)
        if fp8 and brk != "fp8_noscale":
            kw.update(k_scale=p.k_scale, v_scale=p.v_scale)
        return tuple(args), kw

    broken = frozenset() if brk == "none" else frozenset({ARG[brk]})
    if brk == "fp8_noscale" and not fp8:
        broken = frozenset()
    if brk == "q_dtype":  # reported on the cache or on the query, depending on which is checked first
        broken = frozenset({"k_cache", "q"})
    if brk == "kc_strided":
        broken = frozenset({"k_cache"})
    spec = dict(phase=phase, num_heads=hq, num_kv_heads=hk, head_dim=D, page_size=page, dtype=DT[dtype],
                kv_dtype="fp8" if fp8 else DT[dtype], sliding_window=window is not None,
                soft_cap=soft_cap is not None, return_lse=lse)
    if brk == "heads" or brk == "q_dim":
        spec.update(num_heads=hk * group, head_dim=D)
    # A row-strided query and a page listed twice in one table may be served (then the result must
    # match) or refused by name.
    return Case(build, broken, must_raise=brk not in ("q_rows", "dup_pages"),
                what=f"{phase} {brk} lens={lens} page={page} h={hq}/{hk} D={D} {dtype} fp8={fp8} "
                     f"window={window} cap={soft_cap}", spec=spec)


def _cmp_attn(case, got, exp):
    o, e = got[0], exp[0]
    if isinstance(o, tuple):
        close(o[0], e[0], scale=4.0, what="out")
        close(o[1], e[1], dtype=torch.float32, scale=20.0, what="lse")
    else:
        close(o, e, scale=4.0, what="out")


# The flex adapter attends over the whole cache under a block mask, so a NaN in a slot no
# sequence owns reaches the output (0 * NaN). It is fuzzed on finite unused slots;
# test_flex_reads_only_owned_slots records the NaN case. The TMA prefill serves pages holding whole
# 64-key tiles only (its declaration): it is fuzzed on those.
LIMITS = {"flex": dict(poison=False), "triton-tma": dict(pages=(64,))}


@pytest.mark.parametrize("name", launchers("attention", "decode"))
def test_fuzz_decode(name):
    fuzz("attention", name, "decode", attn_cases("decode", **LIMITS.get(name, {})), _cmp_attn, _n(name))


@pytest.mark.parametrize("name", launchers("attention", "prefill"))
def test_fuzz_prefill(name):
    fuzz("attention", name, "prefill", attn_cases("prefill", **LIMITS.get(name, {})), _cmp_attn, _n(name))


@pytest.mark.xfail(reason="flex adapter: NaN in cache slots outside a sequence's tokens poisons its output "
                          "(found by this fuzzer; Triton and reference read only owned slots)", strict=False)
@pytest.mark.skipif("flex" not in launchers("attention", "decode"), reason="flex cannot run here")
def test_flex_reads_only_owned_slots():
    from opmap.core import registry

    p = make_paged([1, 7], 1, 64, 4, dtype=torch.float16, poison=True)
    q = torch.randn(2, 2, 64, generator=gen(0)).half()
    out = registry.get("attention", "flex").fn("decode")(q, p.k_cache, p.v_cache, p.seq_lens, p.block_tables,
                                                         scale=0.125)
    assert not out.isnan().any()


@pytest.mark.skipif("flex" not in launchers("attention", "decode"), reason="flex cannot run here")
def test_flex_duplicate_pages():
    """A page listed twice in one sequence's table: the flex adapter attended it once (found by the
    fuzzer); now it must refuse it by name or match the reference."""
    from opmap.core import registry
    from opmap.core.contract import InputError

    p = make_paged([9], 1, 64, 4, dtype=torch.float32, generator=gen(1))
    p.block_tables[0, 1] = p.block_tables[0, 0]
    q = torch.randn(1, 2, 64, generator=gen(2))
    args = (q, p.k_cache, p.v_cache, p.seq_lens, p.block_tables)
    try:
        out = registry.get("attention", "flex").fn("decode")(*args, scale=0.125)
    except InputError as e:
        assert e.arg == "block_tables", e
        return
    ref = registry.get("attention", "reference").fn("decode")(*args, scale=0.125)
    close(out, ref, what="flex vs reference with a duplicated page")


# ---- KV append --------------------------------------------------------------------------------

@st.composite
def append_cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    T = draw(st.integers(0, 9))
    P, page, hk = draw(st.integers(1, 4)), draw(st.sampled_from([1, 4, 16])), draw(st.sampled_from([1, 2]))
    D = draw(st.sampled_from([8, 64]))
    dtype = draw(st.sampled_from([torch.float16, torch.float32]))
    fp8 = draw(st.sampled_from([False, False, True])) and dtype == torch.float16
    brk = draw(st.sampled_from(("none",) * 5 + ("k_rows", "slot_high", "slot_neg2", "slot_float", "slot_len",
                                                  "k_heads", "v_dtype", "kc_strided", "fp8_noscale", "scale_len")))
    if brk in ("slot_high", "slot_neg2", "slot_len") and T == 0:
        T = 1
    T = min(T, P * page)  # distinct slots: one write per slot (duplicates would race)

    def build():
        g = gen(seed)
        k = torch.randn(T, hk + (1 if brk == "k_heads" else 0), D, generator=g).to(dtype)
        if brk == "k_rows":  # a slice of a fused QKV output: token stride free
            k = torch.randn(T, 3 * hk, D, generator=g).to(dtype)[:, hk:2 * hk]
        v = torch.randn(T, hk, D, generator=g).to(torch.float32 if brk == "v_dtype" and dtype != torch.float32
                                                    else torch.float64 if brk == "v_dtype" else dtype)
        cdt = torch.float8_e4m3fn if fp8 else dtype
        kc = torch.randn(P, page, hk, D, generator=g).to(cdt)
        vc = torch.randn(P, page, hk, D, generator=g).to(cdt)
        if brk == "kc_strided":
            kc = torch.cat([kc, kc], dim=3)[..., :D]
        slots = torch.randperm(P * page, generator=g)[:T]
        skip = torch.rand(T, generator=g) < 0.3
        slots[skip] = -1  # -1 = skip (CUDA-graph padding)
        if brk == "slot_high":
            slots[0] = P * page
        if brk == "slot_neg2":
            slots[-1] = -2
        if brk == "slot_float":
            slots = slots.float()
        if brk == "slot_len":
            slots = torch.cat([slots, slots[:1]])
        kw = {}
        if fp8 and brk != "fp8_noscale":
            n = hk + (1 if brk == "scale_len" else 0)
            kw = dict(k_scale=torch.rand(n, generator=g) + 0.5, v_scale=torch.rand(n, generator=g) + 0.5)
        return (k, v, kc, vc, slots), kw

    arg = {"slot_high": "slot_mapping", "slot_neg2": "slot_mapping", "slot_float": "slot_mapping",
           "slot_len": "slot_mapping", "k_heads": "k", "v_dtype": "v", "kc_strided": "k_cache",
           "fp8_noscale": "k_scale", "scale_len": "k_scale"}
    broken = frozenset({arg[brk]}) if brk in arg else frozenset()
    if brk in ("fp8_noscale", "scale_len") and not fp8:
        broken = frozenset()
    if brk == "k_heads":
        broken = frozenset({"k", "v"})
    return Case(build, broken, what=f"{brk} T={T} P={P} page={page} hk={hk} D={D} {dtype} fp8={fp8}",
                spec=dict(num_kv_heads=hk, head_dim=D, page_size=page, dtype=DT[dtype],
                          kv_dtype="fp8" if fp8 else DT[dtype]))


def _cmp_append(case, got, exp):
    assert got[0] is None and exp[0] is None
    for i, what in ((2, "k_cache"), (3, "v_cache")):
        a, b = got[1][i], exp[1][i]
        if a.dtype == torch.float8_e4m3fn:
            # Bitwise, except what the Triton 3.6 interpreter's fp32 -> e4m3 conversion gets wrong
            # (a value rounding up across a power of two comes out halved; some subnormals round
            # one step differently); tests/gpu and test_kv_append.py document the same excuse.
            a, b = a.float(), b.float()
            same = (a == b) | (a.isnan() & b.isnan())
            if torch.cuda.is_available() is False:
                same |= (b != 0) & (b.abs().log2().frac() == 0) & (a == b / 2)
                same |= (b.abs() < 2 ** -6) & ((a - b).abs() <= 2 ** -9)
            assert same.all(), f"{what}: fp8 pages differ at {int((~same).sum())} values"
        else:
            assert torch.equal(a, b), f"{what}: pages differ (a copy must be exact)"


@pytest.mark.parametrize("name", launchers("kv_append", "append"))
def test_fuzz_kv_append(name):
    fuzz("kv_append", name, "append", append_cases(), _cmp_append, _n(name))


# ---- RoPE + KV append (one launch) -------------------------------------------------------------

@st.composite
def rope_append_cases(draw):
    """An append case (its breaks included) with q, positions, cos/sin and style added, and
    breaks of its own: a position past the cos/sin rows, an odd rotary dim, a bad style, q of
    another dtype."""
    base = draw(append_cases())
    seed = draw(st.integers(0, 2**31 - 1))
    hq_mult = draw(st.sampled_from([1, 2, 4]))
    style = draw(st.sampled_from(["neox", "gptj"]))
    frac = draw(st.sampled_from([1, 2]))  # rotary dim D or D/2
    brk = "none" if base.broken else draw(st.sampled_from(("none",) * 6 + ("pos_high", "rot_odd", "style",
                                                                             "q_dtype")))

    def build():
        (k, v, kc, vc, slots), kw = base.build()
        g = gen(seed)
        T, hk, D = k.shape
        q = torch.randn(T, hk * hq_mult, D, generator=g).to(torch.float32 if brk == "q_dtype" and
                                                            k.dtype != torch.float32 else
                                                            torch.float64 if brk == "q_dtype" else k.dtype)
        rot = max(2, D // frac) - (1 if brk == "rot_odd" else 0)
        cs = torch.randn(64, rot, generator=g)
        pos = torch.randint(0, 64, (T,), generator=g)
        if brk == "pos_high" and T:
            pos[0] = 64
        return (q, k, v, pos, cs, "llama" if brk == "style" else style, kc, vc, slots), kw

    arg = {"pos_high": "positions", "rot_odd": "cos_sin", "style": "style", "q_dtype": "k"}
    broken = base.broken | (frozenset({arg[brk]}) if brk in arg else frozenset())
    if brk == "pos_high" and "T=0 " in base.what:
        broken = base.broken
    if brk == "q_dtype":
        broken = frozenset({"k", "q"})
    return Case(build, broken, what=f"{base.what} hq={hq_mult}x style={style} rot=D/{frac} {brk}", spec=base.spec)


def _cmp_rope_append(case, got, exp):
    assert got[0] is None and exp[0] is None
    for i, what in ((0, "q"), (1, "k")):
        close(got[1][i], exp[1][i], got[1][i].dtype, what=what)
    pick = lambda a: (a[1], a[2], a[6], a[7])  # noqa: E731  (k, v, k_cache, v_cache): append's order
    _cmp_append(case, (None, pick(got[1])), (None, pick(exp[1])))


@pytest.mark.parametrize("name", launchers("kv_append", "rope_append"))
def test_fuzz_rope_append(name):
    fuzz("kv_append", name, "rope_append", rope_append_cases(), _cmp_rope_append, _n(name))


# ---- merge --------------------------------------------------------------------------------

@st.composite
def merge_cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    T, H, D = draw(st.integers(0, 5)), draw(st.integers(1, 4)), draw(st.sampled_from([8, 24, 64]))
    dtype = draw(st.sampled_from([torch.float16, torch.float32]))
    brk = draw(st.sampled_from(("none",) * 4 + ("inf", "strided", "shape", "lse_dtype", "ob_dtype", "ndim")))

    def build():
        g = gen(seed)
        oa = torch.randn(T, H, D, generator=g).to(dtype)
        ob = torch.randn(T, H, D + (1 if brk == "shape" else 0), generator=g).to(
            torch.float32 if brk == "ob_dtype" and dtype == torch.float16 else
            torch.float16 if brk == "ob_dtype" else dtype)
        la, lb = torch.randn(T, H, generator=g) * 3, torch.randn(T, H, generator=g) * 3
        if brk == "inf" and T:  # an empty partial state (no keys) on either or both sides
            la[0, 0] = -math.inf
            lb[-1, -1] = -math.inf
            la[-1, -1] = -math.inf
        if brk == "strided":
            oa = torch.randn(T, H, 2 * D, generator=g).to(dtype)[..., :D]
        if brk == "lse_dtype":
            lb = lb.half()
        if brk == "ndim":
            oa = oa.reshape(T, H * D)
        return (oa, la, ob, lb), {}

    arg = {"shape": "o_b", "lse_dtype": "lse_b", "ob_dtype": "o_b", "ndim": "o_a", "strided": "o_a"}
    return Case(build, frozenset({arg[brk]}) if brk in arg else frozenset(), must_raise=brk != "strided",
                what=f"{brk} T={T} H={H} D={D} {dtype}")


@pytest.mark.parametrize("name", launchers("attention_merge", "merge"))
def test_fuzz_merge(name):
    fuzz("attention_merge", name, "merge", merge_cases(),
         lambda c, g, e: (close(g[0][0], e[0][0], what="o"), close(g[0][1], e[0][1], scale=10.0, what="lse")),
         _n(name))
