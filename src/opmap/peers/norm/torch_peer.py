"""Peer: torch.nn.functional.rms_norm, same entry signatures as ours."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opmap.ops.norm.validate import check_norm, check_qk_norm


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out=None) -> torch.Tensor:
    check_norm(x, weight, eps, out=out)
    y = F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)
    if out is not None:
        out.copy_(y)
        return out
    return y


def add_rmsnorm(x, residual, weight, eps: float = 1e-6, *, out=None) -> torch.Tensor:
    check_norm(x, weight, eps, residual=residual, out=out)
    residual.add_(x)
    return rmsnorm(residual, weight, eps, out=out)


def qk_rmsnorm(qk, w_q, w_k, num_q_heads: int, eps: float = 1e-6) -> torch.Tensor:
    check_qk_norm(qk, w_q, w_k, num_q_heads, eps)
    D = qk.shape[-1]
    qk[:, :num_q_heads] = F.rms_norm(qk[:, :num_q_heads], (D,), w_q.to(qk.dtype), eps)
    qk[:, num_q_heads:] = F.rms_norm(qk[:, num_q_heads:], (D,), w_k.to(qk.dtype), eps)
    return qk
