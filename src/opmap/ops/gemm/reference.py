"""Plain-PyTorch linear, the oracle of the family: ``x[M, K] @ w[N, K]^T (+ bias)`` in fp32,
returned in x.dtype. fp8-e4m3 / int8 weights are dequantised with their per-output-channel
fp32 scale (``w_scale[N]``) first; int4 weights (opmap.ops.gemm.quant's packed layout) with their
group scales and zero codes; block-wise fp8 with its scale per block."""
from __future__ import annotations

import torch

from opmap.core.contract import expect
from opmap.ops.activation.reference import gelu_tanh_mul, silu_mul
from opmap.ops.gemm.quant import dequantize_fp8_block, dequantize_int4
from opmap.ops.gemm.validate import INT4_PACKED, check_addend, check_linear


def linear(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None) -> torch.Tensor:
    return _linear32(x, w, bias, w_scale, w_zero).to(x.dtype)


def linear_add(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor, bias=None, w_scale=None,
               w_zero=None) -> torch.Tensor:
    """``add + x @ w.T (+ bias)`` rounded once to x's dtype (a residual or another branch's output
    summed into the GEMM's fp32 result): [M, N]."""
    y = _linear32(x, w, bias, w_scale, w_zero)
    check_addend(add, x, y.shape[1])
    return (y + add.float()).to(x.dtype)


def _linear32(x, w, bias, w_scale, w_zero) -> torch.Tensor:
    check_linear(x, w, bias, w_scale, w_zero, int4=True, block=True)
    if w.dtype == INT4_PACKED:
        wf = dequantize_int4(w, w_scale, w_zero)
    elif w_scale is not None and w_scale.dim() == 2:
        wf = dequantize_fp8_block(w, w_scale)
    else:
        wf = w.float()
        if w_scale is not None:
            wf = wf * w_scale[:, None]
    y = x.float() @ wf.t()
    if bias is not None:
        y = y + bias.float()
    return y


def linear_act(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None, *, act: str = "silu"):
    """The gate/up GEMM then its gated activation (``w`` [2I, K], gate rows first): linear, rounded
    to x's dtype, then silu_mul / gelu_tanh_mul. -> [M, I]."""
    expect(act in ("silu", "gelu_tanh"), "act", repr(act), "one of ['gelu_tanh', 'silu']")
    expect(w.shape[0] % 2 == 0, "w", f"shape {tuple(w.shape)}", "an even number of rows: the gate half, then the up half")
    return (silu_mul if act == "silu" else gelu_tanh_mul)(linear(x, w, bias, w_scale, w_zero))
