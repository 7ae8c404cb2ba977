"""Plain-PyTorch RMSNorm, the oracle of the family.

HF numerics (LlamaRMSNorm): normalise in fp32, cast to the input dtype, then multiply by the
weight. The product is formed in fp32 from the two rounded operands and rounded once to
x.dtype, which is what PyTorch does for a bf16 x bf16 multiply, so it equals HF bit for bit
when weight.dtype == x.dtype.
"""
from __future__ import annotations

import torch

from .validate import check_norm


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    y = (xf * torch.rsqrt(var + eps)).to(x.dtype)
    return (y.float() * weight.float()).to(x.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out=None) -> torch.Tensor:
    check_norm(x, weight, eps, out=out)
    y = _rmsnorm(x, weight, eps)
    if out is not None:
        out.copy_(y)
        return out
    return y


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                *, out=None) -> torch.Tensor:
    """``residual += x`` in place (rounded to residual.dtype), then rmsnorm(residual)."""
    check_norm(x, weight, eps, residual=residual, out=out)
    residual.copy_((residual.float() + x.float()).to(residual.dtype))
    return rmsnorm(residual, weight, eps, out=out)
