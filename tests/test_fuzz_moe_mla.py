"""Fuzzing the MoE launchers (route, moe) and the MLA ones (latent KV append, absorbed decode):
expert counts, top-k and grouping parameters in and out of range, weight shapes, page tables and
lengths of the latent cache, fp8 latents (harness: test_fuzz_harness.py)."""
import math

import pytest
import torch
from hypothesis import strategies as st

from test_fuzz_harness import Case, close, fuzz, gen, launchers, randn

F = (torch.float32, torch.float16)


def _n(name):
    return 15 if "triton" in name else 25


# ---- MoE ----------------------------------------------------------------------------------------

MOE_BREAKS = ("topk0", "topk_big", "router", "n_group", "topk_group", "w13_odd", "w2_shape", "logits_shape",
              "x_int", "w13_dtype", "bias_shape", "topk_float")
MOE_ARG = {"topk0": "top_k", "topk_big": "top_k", "router": "router", "n_group": "n_group",
           "topk_group": "topk_group", "w13_odd": "w13", "w2_shape": "w2", "logits_shape": "router_logits",
           "x_int": "x", "w13_dtype": "w13", "bias_shape": "score_bias", "topk_float": "top_k"}


@st.composite
def moe_cases(draw, entry):
    seed = draw(st.integers(0, 2**31 - 1))
    T, H, inter = draw(st.integers(0, 6)), draw(st.sampled_from([8, 16, 24])), draw(st.sampled_from([4, 8, 12]))
    E = draw(st.sampled_from([2, 4, 6, 8]))
    router = draw(st.sampled_from(["softmax", "softmax", "sigmoid", "sigmoid_grouped"]))
    n_group = draw(st.sampled_from([g for g in (1, 2) if E % g == 0])) if router == "sigmoid_grouped" else 1
    topk_group = draw(st.integers(1, n_group))
    top_k = draw(st.integers(1, max(1, topk_group * (E // n_group))))
    renorm = draw(st.booleans())
    scaling = draw(st.sampled_from([1.0, 2.5]))
    bias = draw(st.booleans()) and router != "softmax"
    dtype = draw(st.sampled_from(F))
    breaks = MOE_BREAKS if entry == "moe" else MOE_BREAKS[:5] + ("logits_1d", "bias_shape", "topk_float")
    brk = draw(st.sampled_from(("none",) * 6 + breaks))

    def build():
        g = gen(seed)
        logits = torch.randn(T, E + (1 if brk == "logits_shape" else 0), generator=g)
        if brk == "logits_1d":
            logits = logits.reshape(-1)
        kw = dict(router="top2" if brk == "router" else router, renormalize=renorm,
                  n_group=3 if brk == "n_group" and E % 3 else (E + 1 if brk == "n_group" else n_group),
                  topk_group=n_group + 1 if brk == "topk_group" else topk_group, routed_scaling=scaling,
                  score_bias=(torch.randn(E + (1 if brk == "bias_shape" else 0), generator=g) * 0.1
                              if bias or brk == "bias_shape" else None))
        k = {"topk0": 0, "topk_big": E + 1, "topk_float": float(top_k)}.get(brk, top_k)
        if entry == "route":
            return (logits, k), kw
        x = randn((T, H), dtype, g)
        if brk == "x_int":
            x = x.to(torch.int32)
        w13 = randn((E, 2 * inter + (1 if brk == "w13_odd" else 0), H), dtype, g, scale=H ** -0.5)
        if brk == "w13_dtype":
            w13 = w13.to(torch.float64)
        w2 = randn((E, H, inter + (2 if brk == "w2_shape" else 0)), dtype, g, scale=inter ** -0.5)
        return (x, logits, w13, w2, k), kw

    broken = frozenset({MOE_ARG.get(brk, "router_logits")}) if brk != "none" else frozenset()
    if brk == "w13_odd":
        broken = frozenset({"w13", "w2"})
    spec = dict(num_experts=E, top_k=top_k, hidden=H, intermediate=inter, dtype="fp32" if dtype == F[0] else "fp16",
                weight_dtype="fp32" if dtype == F[0] else "fp16",
                router="sigmoid_grouped" if router == "sigmoid_grouped" else router, tokens=T)
    return Case(build, broken, what=f"{brk} T={T} H={H} I={inter} E={E} k={top_k} {router} g={n_group}/"
                                    f"{topk_group} bias={bias} {dtype}", spec=spec if entry == "moe" else None)


def _cmp_route(case, got, exp):
    (w, ids), (rw, rids) = got[0], exp[0]
    assert ids.dtype == torch.int32 and torch.equal(ids, rids), "expert ids differ from the reference's"
    close(w, rw, dtype=torch.float32, what="topk_weights")


@pytest.mark.parametrize("name", launchers("moe", "route"))
def test_fuzz_route(name):
    fuzz("moe", name, "route", moe_cases("route"), _cmp_route, _n(name))


@pytest.mark.parametrize("name", launchers("moe", "moe"))
def test_fuzz_moe(name):
    fuzz("moe", name, "moe", moe_cases("moe"), lambda c, g, e: close(g[0], e[0], scale=4.0), _n(name))


# ---- MLA ------------------------------------------------------------------------------------

@st.composite
def mla_decode_cases(draw, pages=(1, 4, 16)):
    from opmap.harness.fixtures.mla import make_cache

    seed = draw(st.integers(0, 2**31 - 1))
    B, H = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))
    R, Dr, page = draw(st.sampled_from([16, 32])), draw(st.sampled_from([8, 16])), draw(st.sampled_from(pages))
    lens = draw(st.lists(st.sampled_from([0, 1, page - 1, page, page + 1, 2 * page + 3]), min_size=B, max_size=B))
    lens = [max(0, n) for n in lens]
    fp8 = draw(st.sampled_from([False, False, True]))
    dtype = draw(st.sampled_from(F))
    lse = draw(st.booleans())
    brk = draw(st.sampled_from(("none",) * 6 + ("bt_high", "len_over", "len_neg", "qpe_shape", "width",
                                                  "sl_float", "fp8_noscale", "bt_rows")))
    if brk in ("bt_high", "len_over") and max(lens) == 0:
        lens[0] = page + 1

    def build():
        g = gen(seed)
        p = make_cache(lens, R, Dr, page, dtype=dtype, fp8=fp8, gen=g)
        cache, sl, bt = p.cache, p.seq_lens, p.block_tables
        b = int(torch.tensor(lens).argmax())
        if brk == "bt_high":
            bt[b, 0] = cache.shape[0]
        if brk == "len_over":
            sl[b] = bt.shape[1] * page + 1
        if brk == "len_neg":
            sl[0] = -2
        if brk == "sl_float":
            sl = sl.float()
        if brk == "bt_rows":
            bt = torch.cat([bt, bt[:1]])
        if brk == "width":
            cache = cache[..., :-1].contiguous()
        qn = torch.randn(B, H, R, generator=g).to(dtype)
        qp = torch.randn(B, H + (1 if brk == "qpe_shape" else 0), Dr, generator=g).to(dtype)
        kw = dict(scale=1 / math.sqrt(R + Dr), return_lse=lse)
        if fp8 and brk != "fp8_noscale":
            kw["kv_scale"] = p.kv_scale
        return (qn, qp, cache, sl, bt), kw

    arg = {"bt_high": "block_tables", "len_over": "seq_lens", "len_neg": "seq_lens", "qpe_shape": "q_pe",
           "width": "cache", "sl_float": "seq_lens", "fp8_noscale": "kv_scale", "bt_rows": "block_tables"}
    broken = frozenset({arg[brk]}) if brk in arg else frozenset()
    if brk == "fp8_noscale" and not fp8:
        broken = frozenset()
    spec = dict(phase="decode", kind="mla", num_heads=H, num_kv_heads=1, head_dim=R + Dr, head_dim_v=R,
                page_size=page, dtype="fp32" if dtype == F[0] else "fp16",
                kv_dtype="fp8" if fp8 else ("fp32" if dtype == F[0] else "fp16"), return_lse=lse)
    return Case(build, broken, what=f"{brk} lens={lens} H={H} R={R} Dr={Dr} page={page} fp8={fp8} {dtype}",
                spec=spec)


def _cmp_mla(case, got, exp):
    o, e = got[0], exp[0]
    if isinstance(o, tuple):
        close(o[0], e[0], scale=4.0, what="out")
        close(o[1], e[1], dtype=torch.float32, scale=20.0, what="lse")
    else:
        close(o, e, scale=4.0, what="out")


# The TMA decode serves pages of 64 (whole key tiles; its declaration): it is fuzzed on those.
MLA_PAGES = {"mla-tma": (64,)}


@pytest.mark.parametrize("name", [n for n in launchers("attention", "mla_decode") if n != "mla-reference"])
def test_fuzz_mla_decode(name):
    fuzz("attention", name, "mla_decode", mla_decode_cases(**({"pages": MLA_PAGES[name]} if name in MLA_PAGES else {})),
         _cmp_mla, _n(name), ref="mla-reference")


@st.composite
def mla_append_cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    T, P, page = draw(st.integers(0, 8)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 16]))
    R, Dr = draw(st.sampled_from([16, 32])), draw(st.sampled_from([8, 16]))
    dtype = draw(st.sampled_from(F))
    brk = draw(st.sampled_from(("none",) * 5 + ("slot_high", "slot_neg2", "kpe_rows", "width", "kpe_dtype",
                                                  "slot_len")))
    T = min(T, P * page)
    if brk in ("slot_high", "slot_neg2", "kpe_rows", "slot_len") and T == 0:
        T = 1

    def build():
        g = gen(seed)
        ckv = torch.randn(T, R, generator=g).to(dtype)
        kpe = torch.randn(T + (1 if brk == "kpe_rows" else 0), Dr, generator=g).to(
            torch.float64 if brk == "kpe_dtype" else dtype)
        cache = torch.randn(P, page, R + Dr + (1 if brk == "width" else 0), generator=g).to(dtype)
        slots = torch.randperm(P * page, generator=g)[:T]
        slots[torch.rand(T, generator=g) < 0.3] = -1
        if brk == "slot_high":
            slots[0] = P * page
        if brk == "slot_neg2":
            slots[-1] = -2
        if brk == "slot_len":
            slots = torch.cat([slots, slots[:1]])
        return (ckv, kpe, cache, slots), {}

    arg = {"slot_high": "slot_mapping", "slot_neg2": "slot_mapping", "kpe_rows": "kpe", "width": "cache",
           "kpe_dtype": "kpe", "slot_len": "slot_mapping"}
    return Case(build, frozenset({arg[brk]}) if brk in arg else frozenset(),
                what=f"{brk} T={T} P={P} page={page} R={R} Dr={Dr} {dtype}")


@pytest.mark.parametrize("name", [n for n in launchers("kv_append", "append_mla") if n != "mla-reference"])
def test_fuzz_append_mla(name):
    fuzz("kv_append", name, "append_mla", mla_append_cases(),
         lambda c, g, e: close(g[1][2], e[1][2], scale=1.0, what="cache"), _n(name), ref="mla-reference")
