"""Fuzzing the dense launchers: rmsnorm, add_rmsnorm, qk_rmsnorm, silu_mul, gelu_tanh_mul, rope, linear.
Every backend that can run here is called with random shapes, dtypes, strides and parameters,
valid and broken (harness: test_fuzz_harness.py)."""
import math

import pytest
import torch
from hypothesis import strategies as st

from test_fuzz_harness import Case, close, fuzz, gen, launchers, randn

F = (torch.float32, torch.float16)  # the interpreter mishandles bf16: checked on the GPU instead
N_TRITON, N_OTHER = 40, 40


def _n(name):
    return N_TRITON if "triton" in name else N_OTHER


# ---- rmsnorm / add_rmsnorm --------------------------------------------------------------------

NORM_BREAKS = ("none", "none", "none", "rows", "x_lastdim", "x_int", "w_len", "w_dtype", "eps_neg", "eps_nan",
               "x_list", "hidden0", "w_device", "res_shape", "res_dtype")


@st.composite
def norm_cases(draw, fused):
    seed = draw(st.integers(0, 2**31 - 1))
    lead = draw(st.lists(st.integers(0, 5), min_size=0, max_size=2))
    H = draw(st.integers(1, 80))
    dtype = draw(st.sampled_from(F))
    w_fp32 = draw(st.booleans())
    eps = draw(st.sampled_from([0.0, 1e-6, 1e-5, 1e-3]))
    brk = draw(st.sampled_from(NORM_BREAKS if fused else NORM_BREAKS[:-2]))
    if brk == "hidden0":
        H = 0

    def build():
        g = gen(seed)
        x = randn((*lead, H), dtype, g, row_stride_pad=3 if brk == "rows" else 0,
                  last_dim_step=2 if brk == "x_lastdim" else 1)
        if brk == "x_int":
            x = x.to(torch.int32)
        if brk == "x_list":
            x = x.tolist()
        w = randn((H + (1 if brk == "w_len" else 0),), torch.float32 if w_fp32 else dtype, g)
        if brk == "w_dtype":
            w = w.to(torch.bfloat16 if dtype == torch.float16 else torch.float16)
        if brk == "w_device":
            w = w.to("meta")
        e = {"eps_neg": -1e-6, "eps_nan": math.nan}.get(brk, eps)
        if not fused:
            return (x, w, e), {}
        r = randn((*lead, H + (2 if brk == "res_shape" else 0)), dtype, g)
        if brk == "res_dtype":
            r = r.to(torch.float32 if dtype == torch.float16 else torch.float16)
        return (x, r, w, e), {}

    arg = {"x_lastdim": "x", "x_int": "x", "x_list": "x", "hidden0": "x", "w_len": "weight", "w_dtype": "weight",
           "w_device": "weight", "eps_neg": "eps", "eps_nan": "eps", "res_shape": "residual", "res_dtype": "residual"}
    broken = frozenset() if brk in ("none", "rows") else frozenset({arg[brk]})
    if brk == "x_lastdim" and H == 1:
        broken = frozenset()  # a last dim of size 1 has no meaningful stride
    return Case(build, broken, what=f"{brk} lead={lead} H={H} {dtype}")


def _cmp_norm(case, got, exp):
    close(got[0], exp[0], what="out")
    if len(got[1]) == 4:  # add_rmsnorm updates the residual in place
        close(got[1][1], exp[1][1], what="residual")


# the fuzz feeds zero and non-finite rows on purpose
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("name", launchers("rmsnorm", "rmsnorm"))
def test_fuzz_rmsnorm(name):
    fuzz("rmsnorm", name, "rmsnorm", norm_cases(False), _cmp_norm, _n(name))


# the fuzz feeds zero and non-finite rows on purpose
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("name", launchers("rmsnorm", "add_rmsnorm"))
def test_fuzz_add_rmsnorm(name):
    fuzz("rmsnorm", name, "add_rmsnorm", norm_cases(True), _cmp_norm, _n(name))


QK_BREAKS = ("none", "none", "none", "rows", "nq_big", "nq_neg", "x_2d", "x_lastdim", "w_len", "w_dtype",
             "eps_neg", "x_int")


@st.composite
def qk_norm_cases(draw):
    """qk_rmsnorm on [T, Hq + Hk, D]; "rows": the view of a wider qkv row (strided tokens, NaN
    in the v columns a kernel must not read)."""
    seed = draw(st.integers(0, 2**31 - 1))
    T, hq, hk, D = draw(st.integers(0, 5)), draw(st.integers(0, 5)), draw(st.integers(0, 3)), draw(st.integers(1, 80))
    dtype = draw(st.sampled_from(F))
    w_fp32 = draw(st.booleans())
    brk = draw(st.sampled_from(QK_BREAKS))
    nq = {"nq_big": hq + hk + 1, "nq_neg": -1}.get(brk, hq)

    def build():
        g = gen(seed)
        x = randn((T, (hq + hk) * D), dtype, g, row_stride_pad=2 * D if brk == "rows" else 0,
                  last_dim_step=2 if brk == "x_lastdim" else 1)
        x = x.view(T, hq + hk, D) if brk not in ("x_2d", "x_lastdim") else x
        if brk == "x_lastdim":
            x = x.unflatten(1, (hq + hk, D)) if (hq + hk) else x.view(T, 0, D)
        if brk == "x_int":
            x = x.to(torch.int32)
        wd = torch.float32 if w_fp32 else dtype
        wq = randn((D,), wd, g)
        wk = randn((D + (1 if brk == "w_len" else 0),), wd, g)
        if brk == "w_dtype":
            wq = wq.to(torch.bfloat16 if dtype == torch.float16 else torch.float16)
        return (x, wq, wk, nq, -1e-6 if brk == "eps_neg" else 1e-6), {}

    arg = {"nq_big": "num_q_heads", "nq_neg": "num_q_heads", "x_2d": "qk", "x_lastdim": "qk", "w_len": "w_k",
           "w_dtype": "w_q", "eps_neg": "eps", "x_int": "qk"}
    broken = frozenset() if brk in ("none", "rows") else frozenset({arg[brk]})
    if brk == "x_lastdim" and D == 1:
        broken = frozenset()
    return Case(build, broken, what=f"{brk} T={T} hq={hq} hk={hk} D={D} {dtype}")


def _cmp_qk(case, got, exp):
    close(got[0], exp[0], what="qk (in place)")


@pytest.mark.parametrize("name", launchers("rmsnorm", "qk_rmsnorm"))
def test_fuzz_qk_rmsnorm(name):
    fuzz("rmsnorm", name, "qk_rmsnorm", qk_norm_cases(), _cmp_qk, _n(name))


# ---- silu_mul / gelu_tanh_mul -----------------------------------------------------------------

@st.composite
def act_cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    lead = draw(st.lists(st.integers(0, 4), min_size=0, max_size=2))
    H = draw(st.integers(1, 70))
    dtype = draw(st.sampled_from(F))
    brk = draw(st.sampled_from(("none", "none", "rows", "odd", "zero", "x_int", "x_lastdim", "x_none")))
    last = {"odd": 2 * H + 1, "zero": 0}.get(brk, 2 * H)

    def build():
        g = gen(seed)
        x = randn((*lead, last), dtype, g, scale=3.0, row_stride_pad=5 if brk == "rows" else 0,
                  last_dim_step=2 if brk == "x_lastdim" else 1)
        if brk == "x_int":
            x = x.to(torch.int64)
        return (None if brk == "x_none" else x,), {}

    return Case(build, frozenset() if brk in ("none", "rows") else frozenset({"x"}), what=f"{brk} {lead} H={H}")


@pytest.mark.parametrize("entry,name", [(e, n) for e in ("silu_mul", "gelu_tanh_mul")
                                        for n in launchers("activation", e)])
def test_fuzz_activation(entry, name):
    fuzz("activation", name, entry, act_cases(), lambda c, g, e: close(g[0], e[0]), _n(name))


# ---- rope ---------------------------------------------------------------------------------

@st.composite
def rope_cases(draw):
    from opmap.ops.rope.reference import cos_sin_cache

    seed = draw(st.integers(0, 2**31 - 1))
    T = draw(st.integers(0, 6))
    hq, hk = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    D = draw(st.sampled_from([8, 16, 24, 32]))
    r = draw(st.sampled_from([D, D // 2 if D // 2 % 2 == 0 else D]))
    max_pos = draw(st.integers(1, 40))
    style = draw(st.sampled_from(["neox", "gptj"]))
    dtype = draw(st.sampled_from(F))
    brk = draw(st.sampled_from(("none",) * 5 + ("qkv_view", "pos_high", "pos_neg", "style", "k_dim", "q_2d",
                                "cs_fp16", "cs_odd", "pos_float", "q_lastdim", "pos_len")))
    if brk in ("pos_high", "pos_neg", "pos_len") and T == 0:
        T = 2
    cs = cos_sin_cache(r, max_pos, 10000.0, None)
    if brk == "cs_odd":  # an odd rotary dim (the cache builder itself refuses to make one)
        cs = cs[:, :-1].contiguous()

    def build():
        g = gen(seed)
        if brk == "qkv_view":  # q and k as views of one fused QKV activation (rows strided)
            qkv = randn((T, hq + 2 * hk, D), dtype, g)
            q, k = qkv[:, :hq], qkv[:, hq:hq + hk]
        else:
            q = randn((T, hq, D), dtype, g, last_dim_step=2 if brk == "q_lastdim" else 1)
            k = randn((T, hk, D + (2 if brk == "k_dim" else 0)), dtype, g)
        if brk == "q_2d":
            q = q.reshape(T, hq * D)
        pos = torch.randint(0, max_pos, (T + (1 if brk == "pos_len" else 0),), generator=g)
        if brk == "pos_high":
            pos[-1] = max_pos
        if brk == "pos_neg":
            pos[0] = -1
        if brk == "pos_float":
            pos = pos.float()
        c = cs.to(torch.float16) if brk == "cs_fp16" else cs.clone()
        return (q, k, pos, c, "rotate" if brk == "style" else style), {}

    arg = {"pos_high": "positions", "pos_neg": "positions", "pos_float": "positions", "pos_len": "positions",
           "style": "style", "k_dim": "k", "q_2d": "q", "q_lastdim": "q", "cs_fp16": "cos_sin", "cs_odd": "cos_sin"}
    broken = frozenset() if brk in ("none", "qkv_view") else frozenset({arg[brk]})
    return Case(build, broken, what=f"{brk} T={T} h={hq}/{hk} D={D} r={r} {style} {dtype}")


def _cmp_rope(case, got, exp):
    assert got[0] is None and exp[0] is None
    close(got[1][0], exp[1][0], what="q")
    close(got[1][1], exp[1][1], what="k")


@pytest.mark.parametrize("name", launchers("rope", "rope"))
def test_fuzz_rope(name):
    fuzz("rope", name, "rope", rope_cases(), _cmp_rope, _n(name))


# ---- linear -------------------------------------------------------------------------------

@st.composite
def linear_cases(draw):
    from opmap.ops.gemm.quant import quantize_fp8_block, quantize_int4, quantize_weight

    seed = draw(st.integers(0, 2**31 - 1))
    M, N, K = draw(st.integers(1, 6)), draw(st.integers(1, 40)), draw(st.integers(1, 48))
    dtype = draw(st.sampled_from(F))
    wfmt = draw(st.sampled_from(["dense", "dense", "fp8", "int8", "int4", "fp8-block"]))
    group, zp = None, False
    if wfmt == "int4":  # whole groups of 16 (the kernel's MMA K), one or several a row, zero points or not
        K = 16 * draw(st.integers(1, 3))
        group, zp = draw(st.sampled_from([16, K])), draw(st.booleans())
    bias = draw(st.sampled_from([None, "same", "fp32"]))
    brk = draw(st.sampled_from(("none",) * 5 + ("x_rows", "w_k", "x_3d", "scale_missing", "scale_extra",
                                "scale_len", "bias_len", "w_dtype", "x_int", "w_device")))

    def build():
        g = gen(seed)
        x = randn((M, K), dtype, g, row_stride_pad=4 if brk == "x_rows" else 0)
        if brk == "x_3d":
            x = x[None]
        if brk == "x_int":
            x = x.to(torch.int32)
        w = randn((N, K + (1 if brk == "w_k" and wfmt != "int4" else 0)), dtype, g, scale=0.2)
        scale = zero = None
        if wfmt == "int4":
            w, scale, zero = quantize_int4(w, group, zp)
            w = w[:, :-1].contiguous() if brk == "w_k" else w  # words for another K
        elif wfmt == "fp8-block":  # 16 x 16 blocks, partial at the edges
            w, scale = quantize_fp8_block(w, 16)
        elif wfmt != "dense":
            w, scale = quantize_weight(w, wfmt)
        if brk == "scale_missing":
            scale = None
        if brk == "scale_extra" and scale is None:
            scale = torch.ones(N)
        if brk == "scale_len" and scale is not None:
            scale = torch.ones(N + 1) if scale.dim() == 1 else torch.ones(N + 1, scale.shape[1])
        if brk == "w_dtype":
            w = w.to(torch.float64)
        if brk == "w_device":  # the only other device a CPU machine has: a tensor without data
            w = w.to("meta")
        b = None if bias is None else randn((N + (1 if brk == "bias_len" else 0),),
                                            dtype if bias == "same" else torch.float32, g)
        return ((x, w, b, scale) + ((zero,) if zero is not None else ())), {}

    arg = {"w_k": {"w"}, "x_3d": {"x"}, "x_int": {"x"}, "w_dtype": {"w"}, "bias_len": {"bias"}, "w_device": {"w"},
           "scale_missing": {"w_scale"}, "scale_extra": {"w_scale"}, "scale_len": {"w_scale"}}
    broken = frozenset(arg.get(brk, ()))
    if (brk == "scale_missing" and wfmt == "dense") or (brk == "scale_len" and wfmt == "dense") \
            or (brk == "bias_len" and bias is None) or (brk == "scale_extra" and wfmt != "dense"):
        broken = frozenset()  # the break did not apply to this draw
    spec = dict(m=M, n=N, k=K, dtype={torch.float32: "fp32", torch.float16: "fp16"}[dtype],
                weight_dtype={"dense": None, "fp8": "fp8", "int8": "int8", "int4": "int4", "fp8-block": "fp8-block"}[wfmt],
                bias=bias is not None, group_size=16 if wfmt == "fp8-block" else group)
    spec["weight_dtype"] = spec["weight_dtype"] or spec["dtype"]
    return Case(build, broken, what=f"{brk} M={M} N={N} K={K} {wfmt} bias={bias} {dtype}", spec=spec)


@pytest.mark.parametrize("name", launchers("gemm", "linear"))
def test_fuzz_linear(name):
    # K up to 48 in fp16: accumulation order differs between kernels; the tolerance scales with it.
    fuzz("gemm", name, "linear", linear_cases(), lambda c, g, e: close(g[0], e[0], scale=4.0), _n(name))
