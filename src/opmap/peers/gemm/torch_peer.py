"""Peer: torch.nn.functional.linear (cuBLAS on a GPU) for dense weights in x.dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opmap.core.contract import expect

from opmap.ops.gemm.validate import QUANT_DTYPES, check_addend, check_linear


def linear(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None) -> torch.Tensor:
    check_linear(x, w, bias, w_scale, w_zero)
    expect(w.dtype not in QUANT_DTYPES, "w", f"dtype {w.dtype}",
           "dense weights in x.dtype (the cublas backend does not dequantise; the weight-only backends "
           "triton-wo, gluon-wo, gluon-wo-wgmma and dequant-cublas take fp8 / int8)")
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def linear_add(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor, bias=None, w_scale=None,
               w_zero=None) -> torch.Tensor:
    """``add + x @ w.T`` in one cuBLAS call (addmm, beta 1: the addend enters the fp32 epilogue and
    the sum is rounded once)."""
    M, N, K = check_linear(x, w, bias, w_scale, w_zero)
    expect(w.dtype not in QUANT_DTYPES, "w", f"dtype {w.dtype}", "dense weights in x.dtype")
    expect(bias is None, "bias", "a tensor", "None (addmm folds one addend: pass bias + add as add)")
    check_addend(add, x, N)
    return torch.addmm(add, x, w.t())

