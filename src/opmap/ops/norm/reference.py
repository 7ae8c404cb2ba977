"""Plain-PyTorch RMSNorm, the oracle of the family.

HF numerics (LlamaRMSNorm): normalise in fp32, cast to the input dtype, then multiply by the
weight. The product is formed in fp32 from the two rounded operands and rounded once to
x.dtype, which is what PyTorch does for a bf16 x bf16 multiply, so it equals HF bit for bit
when weight.dtype == x.dtype.
"""
from __future__ import annotations

import torch

from opmap.ops.norm.validate import check_norm, check_qk_norm


def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    y = (xf * torch.rsqrt(var + eps)).to(x.dtype)
    return (y.float() * weight.float()).to(x.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out=None) -> torch.Tensor:
    check_norm(x, weight, eps, out=out)
    y = rmsnorm_rows(x, weight, eps)
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


def qk_rmsnorm(qk: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, num_q_heads: int,
               eps: float = 1e-6) -> torch.Tensor:
    """Per-head RMSNorm of q and k in place (Qwen3's q_norm / k_norm): ``qk`` is [T, Hq + Hk, D]
    (a view of the fused qkv projection), heads < num_q_heads use ``w_q``, the rest ``w_k``."""
    check_qk_norm(qk, w_q, w_k, num_q_heads, eps)
    qk[:, :num_q_heads] = rmsnorm_rows(qk[:, :num_q_heads], w_q, eps)
    qk[:, num_q_heads:] = rmsnorm_rows(qk[:, num_q_heads:], w_k, eps)
    return qk
