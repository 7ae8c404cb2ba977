"""linear_act (the gate/up GEMM with its gated activation in the epilogue: kernels/gemm/triton_gemm.py,
GATED) against the GEMM then the activation kernel (bitwise, in the interpreter) and the reference
entry, at odd widths, K splits, biases, per-channel quantised weights, K = 0 and M = 0; its
refusals name the argument."""
import pytest
import torch

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.core.tolerance import assert_close
from opmap.kernels.activation.triton_act import gelu_tanh_mul, silu_mul
from opmap.ops.gemm.quant import quantize_weight

G = pytest.importorskip("opmap.kernels.gemm.triton_gemm")


@pytest.mark.parametrize("M,I,K,dtype,bias,act,split,fmt", [
    (1, 48, 64, torch.float16, False, "silu", None, None),
    (3, 40, 96, torch.float32, True, "gelu_tanh", None, None),
    (5, 33, 128, torch.float16, True, "silu", 3, None),  # I off the tile; K splits (3 asked, 2 of 64 run)
    (1, 70, 256, torch.float16, False, "silu", 2, "fp8"),  # per-channel scales of both halves
    (17, 24, 48, torch.float16, True, "gelu_tanh", None, "int8"),  # K off the tile
    (2, 16, 0, torch.float16, True, "silu", None, None),  # K = 0: act of the bias
    (0, 16, 32, torch.float16, False, "silu", None, None),  # no rows
])
def test_equals_the_gemm_then_the_activation(M, I, K, dtype, bias, act, split, fmt):
    g = torch.Generator().manual_seed(M * 1000 + I + K)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(2 * I, K, generator=g) / max(K, 1) ** 0.5).to(dtype)
    b = torch.randn(2 * I, generator=g).to(dtype) if bias else None
    s = None
    if fmt:
        w, s = quantize_weight(w.float(), fmt)
    plan = {"SPLIT": split} if split else None
    y = G.linear_act(x, w, b, s, act=act, _plan=plan)
    apart = (silu_mul if act == "silu" else gelu_tanh_mul)(G.linear(x, w, b, s, _plan=plan))
    assert y.shape == (M, I) and y.dtype == dtype
    assert torch.equal(y, apart)
    want = registry.get("gemm", "reference")("linear_act", x, w, b, s, act=act)
    assert_close(y, want, dtype, scale=2.0)


def test_refusals_name_the_argument():
    x, w = torch.randn(2, 32), torch.randn(33, 32)
    with pytest.raises(InputError, match="w"):
        G.linear_act(x, w)
    with pytest.raises(InputError, match="act"):
        G.linear_act(x, torch.randn(32, 32), act="relu")
    for name in ("triton-decode", "reference"):
        with pytest.raises(InputError, match="w"):
            registry.get("gemm", name)("linear_act", x, w)


def test_fixed_tiles_of_a_gated_call_fit_shared_memory(monkeypatch):
    """With config fixing the tile (or AUTOTUNE=0) a gated call takes the stages that two weight
    tiles a stage leave room for; stages asked for beyond that are refused, naming config."""
    seen = {}

    class Launch:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.update(kw)

    monkeypatch.setattr(G, "_gemm_kernel", Launch())
    monkeypatch.setattr(G, "plan", lambda M, N, K, sms, interp=False, quantised=False:
                        {"BLOCK_M": 64, "BLOCK_N": 128, "SPLIT": 1, "small": True})
    x, w = torch.randn(64, 512, dtype=torch.float16), torch.randn(256, 512, dtype=torch.float16)
    G.linear_act(x, w, config={"AUTOTUNE": 0})
    bk, ns = seen["BLOCK_K"], seen["num_stages"]
    assert ns * bk * (2 * 128 * 2 + 64 * 2) <= G.SMEM_BUDGET and ns >= 1
    G.linear(x, w, config={"AUTOTUNE": 0})
    assert seen["num_stages"] == G.DEFAULT[(True, 128)][2]  # the ungated call keeps the default
    with pytest.raises(InputError, match="config"):
        G.linear_act(x, w, config={"num_stages": 8, "BLOCK_K": 128})
