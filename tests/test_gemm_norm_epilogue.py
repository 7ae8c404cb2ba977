"""The residual add and the next RMSNorm split between two GEMM epilogues (kernels/gemm/triton_gemm.py,
NORM): linear_add_norm (the O / down projection: h = out + residual into the residual, h * g out,
each N tile's sum of h^2) and linear_normed (the next projection: its product times each row's
rsqrt(mean(h^2) + eps)), against the reference entries and against the three launches they replace
(linear, add_rmsnorm, linear), at odd widths, K splits, biases, per-channel quantised weights, the
gated consumer, strided residual rows, M = 0 and K = 0; refusals name the argument."""
import pytest
import torch

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.core.tolerance import assert_close
from opmap.ops.gemm import reference as R
from opmap.ops.gemm.quant import quantize_weight
from opmap.ops.norm.reference import add_rmsnorm

G = pytest.importorskip("opmap.kernels.gemm.triton_gemm")


def _weights(g, n, k, dtype, fmt):
    w = (torch.randn(n, k, generator=g) / max(k, 1) ** 0.5).to(dtype)
    return quantize_weight(w.float(), fmt) if fmt else (w, None)


@pytest.mark.parametrize("M,H,K,dtype,bias,split,fmt,stride", [
    (1, 64, 96, torch.float32, False, None, None, None),
    (3, 80, 64, torch.float16, True, None, None, None),  # H off the 64-row tile: two tiles, one partial
    (5, 48, 512, torch.float16, False, 3, None, None),  # K splits: the last split's epilogue
    (2, 72, 256, torch.float16, True, 2, "fp8", 100),  # per-channel scales; residual rows strided
    (17, 40, 48, torch.float32, False, None, "int8", None),  # K off the tile
])
def test_add_norm_then_normed_equal_the_reference_and_the_three_launches(M, H, K, dtype, bias, split, fmt, stride):
    g = torch.Generator().manual_seed(M * 1000 + H + K)
    x = torch.randn(M, K, generator=g).to(dtype)
    w, s = _weights(g, H, K, dtype, fmt)
    b = torch.randn(H, generator=g).to(dtype) if bias else None
    base = torch.randn(M, stride or H, generator=g).to(dtype)
    res = base[:, :H]
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    plan = {"SPLIT": split} if split else None
    r_k, r_ref = res.clone(), res.clone()
    xg, ss = G.linear_add_norm(x, w, b, s, residual=r_k, norm_weight=nw, _plan=plan)
    xg_ref, ss_ref = R.linear_add_norm(x, w, b, s, residual=r_ref, norm_weight=nw)
    # the residual and xg: the same roundings as the reference (GEMM summation order aside)
    assert xg.shape == (M, H) and xg.dtype == dtype and ss.dtype == torch.float32
    assert ss.shape == (M, -(-H // G.plan(M, H, K, 132)["BLOCK_N"]))  # one partial sum per N tile
    assert_close(r_k, r_ref, dtype, scale=2.0)
    assert_close(xg, xg_ref, dtype, scale=2.0)
    assert_close(ss.sum(1, keepdim=True), ss_ref, torch.float32, scale=1e3 if dtype != torch.float32 else 2.0)
    # the residual of the kernel is exactly the sum of its own rounded output and the old residual
    y = G.linear(x, w, b, s, _plan=plan)
    assert torch.equal(r_k, (res.float() + y.float()).to(dtype))
    # the consumer: a gate/up-shaped weight, plain and gated, against the reference and the unfused path
    for act, n2 in ((None, 56), ("silu", 2 * 40)):
        w2, s2 = _weights(g, n2, H, dtype, fmt)
        b2 = torch.randn(n2, generator=g).to(dtype) if bias else None
        out = G.linear_normed(xg, w2, b2, s2, ss=ss, eps=1e-5, act=act, _plan=plan)
        want = R.linear_normed(xg_ref, w2, b2, s2, ss=ss_ref, eps=1e-5, act=act)
        assert_close(out, want, dtype, scale=4.0)
        # the three launches it replaces: add + RMSNorm, then the GEMM (one rounding apart)
        r3 = res.clone()
        h = add_rmsnorm(R.linear(x, w, b, s), r3, nw, 1e-5)
        apart = R.linear_act(h, w2, b2, s2, act=act) if act else R.linear(h, w2, b2, s2)
        assert_close(out, apart, dtype, scale=8.0)


def test_empty_shapes():
    g = torch.Generator().manual_seed(0)
    x, w, nw = torch.randn(0, 32, generator=g), torch.randn(48, 32, generator=g), torch.ones(48)
    r = torch.randn(0, 48, generator=g)
    xg, ss = G.linear_add_norm(x, w, residual=r, norm_weight=nw)
    assert xg.shape == (0, 48) and ss.shape[0] == 0
    # K = 0: the output is the bias, added to the residual; the consumer's product is zero
    x0, w0, b = torch.randn(2, 0), torch.randn(48, 0), torch.randn(48, generator=g)
    r, r_ref = torch.randn(2, 48, generator=g), None
    r_ref = r.clone()
    xg, ss = G.linear_add_norm(x0, w0, b, residual=r, norm_weight=nw)
    xg_ref, ss_ref = R.linear_add_norm(x0, w0, b, residual=r_ref, norm_weight=nw)
    assert torch.equal(r, r_ref) and torch.equal(xg, xg_ref) and torch.allclose(ss.sum(1), ss_ref.sum(1))
    out = G.linear_normed(x0, w0, b, ss=torch.ones(2, 3), eps=1e-6)
    assert torch.equal(out, b.expand(2, 48))


def test_refusals_name_the_argument():
    x, w, nw = torch.randn(2, 32), torch.randn(48, 32), torch.ones(48)
    for name in ("triton-decode", "reference"):
        be = registry.get("gemm", name)
        with pytest.raises(InputError, match="residual"):
            be("linear_add_norm", x, w, residual=torch.randn(2, 47), norm_weight=nw)
        with pytest.raises(InputError, match="residual"):
            be("linear_add_norm", x, w, residual=torch.randn(2, 48).half(), norm_weight=nw)
        with pytest.raises(InputError, match="norm_weight"):
            be("linear_add_norm", x, w, residual=torch.randn(2, 48), norm_weight=torch.ones(32))
        with pytest.raises(InputError, match="ss"):
            be("linear_normed", x, w, ss=torch.ones(3, 1), eps=1e-6)
        with pytest.raises(InputError, match="ss"):
            be("linear_normed", x, w, ss=torch.ones(2, 1, dtype=torch.float16), eps=1e-6)
        with pytest.raises(InputError, match="eps"):
            be("linear_normed", x, w, ss=torch.ones(2, 1), eps=-1.0)
        with pytest.raises(InputError, match="act"):
            be("linear_normed", x, w, ss=torch.ones(2, 1), eps=1e-6, act="relu")
