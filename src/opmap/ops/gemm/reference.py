"""Plain-PyTorch linear, the oracle of the family: ``x[M, K] @ w[N, K]^T (+ bias)`` in fp32,
returned in x.dtype. fp8-e4m3 / int8 weights are dequantised with their per-output-channel
fp32 scale (``w_scale[N]``) first; int4 weights (opmap.ops.gemm.quant's packed layout) with their
group scales and zero codes; block-wise fp8 with its scale per block."""
from __future__ import annotations

import torch

from opmap.core.contract import expect
from opmap.ops.activation.reference import gelu_tanh_mul, silu_mul
from opmap.ops.gemm.quant import dequantize_fp8_block, dequantize_int4
from opmap.ops.gemm.validate import INT4_PACKED, check_linear, check_norm_epilogue, check_normed


def linear(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None) -> torch.Tensor:
    check_linear(x, w, bias, w_scale, w_zero, int4=True, block=True)
    y = _product(x, w, w_scale, w_zero)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _product(x: torch.Tensor, w: torch.Tensor, w_scale, w_zero) -> torch.Tensor:
    """x @ w^T in fp32 on the dequantised weight."""
    if w.dtype == INT4_PACKED:
        wf = dequantize_int4(w, w_scale, w_zero)
    elif w_scale is not None and w_scale.dim() == 2:
        wf = dequantize_fp8_block(w, w_scale)
    else:
        wf = w.float()
        if w_scale is not None:
            wf = wf * w_scale[:, None]
    return x.float() @ wf.t()


def linear_act(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None, *, act: str = "silu"):
    """The gate/up GEMM then its gated activation (``w`` [2I, K], gate rows first): linear, rounded
    to x's dtype, then silu_mul / gelu_tanh_mul. -> [M, I]."""
    expect(act in ("silu", "gelu_tanh"), "act", repr(act), "one of ['gelu_tanh', 'silu']")
    expect(w.shape[0] % 2 == 0, "w", f"shape {tuple(w.shape)}", "an even number of rows: the gate half, then the up half")
    return (silu_mul if act == "silu" else gelu_tanh_mul)(linear(x, w, bias, w_scale, w_zero))


def linear_add_norm(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None, *,
                    residual: torch.Tensor, norm_weight: torch.Tensor) -> tuple:
    """A block's last GEMM (O, down) with the residual add and the elementwise half of the next
    RMSNorm: ``h = linear(...) + residual`` rounded to the residual's dtype and written into
    ``residual`` (as add_rmsnorm does), then -> ``(xg, ss)``: ``xg = h * norm_weight`` rounded to
    x's dtype [M, N] and ``ss`` [M, T] fp32, sums of h^2 whose sum over T is the row's (T = 1 here;
    a kernel writes one per N tile). ``linear_normed(xg, ..., ss=ss, eps=eps)`` completes the norm."""
    check_norm_epilogue(x, w, residual, norm_weight)
    y = linear(x, w, bias, w_scale, w_zero)
    residual.copy_((residual.float() + y.float()).to(residual.dtype))
    hf = residual.float()
    return (hf * norm_weight.float()).to(x.dtype), hf.pow(2).sum(1, keepdim=True)


def linear_normed(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None, *, ss: torch.Tensor,
                  eps: float, act=None) -> torch.Tensor:
    """The GEMM after an RMSNorm whose row scale is still to apply: ``x`` is linear_add_norm's
    ``xg`` (h * the norm's weight), ``ss`` its sums of squares; -> ``rsqrt(sum(ss) / K + eps) *
    (x @ w^T) + bias`` rounded to x's dtype, which is ``linear(rmsnorm(h), w, bias)`` up to where
    the row scale is rounded. ``act`` ("silu" / "gelu_tanh"): the gated activation after it, as
    linear_act (``w`` the gate rows, then the up rows)."""
    check_linear(x, w, bias, w_scale, w_zero, int4=True, block=True)
    check_normed(x, ss, eps)
    if act is not None:
        expect(act in ("silu", "gelu_tanh"), "act", repr(act), "one of ['gelu_tanh', 'silu'] or None")
        expect(w.shape[0] % 2 == 0, "w", f"shape {tuple(w.shape)}", "an even number of rows: the gate half, then the up half")
    rstd = torch.rsqrt(ss.float().sum(1, keepdim=True) / x.shape[1] + eps)
    y = _product(x, w, w_scale, w_zero) * rstd
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return y if act is None else (silu_mul if act == "silu" else gelu_tanh_mul)(y)
