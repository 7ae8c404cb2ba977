"""Peer: PyTorch eager gated activations in x.dtype (what an HF MLP runs: two kernels)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opmap.ops.activation.validate import check_act


def silu_mul(x: torch.Tensor, *, out=None) -> torch.Tensor:
    h = check_act(x, out)
    y = F.silu(x[..., :h]) * x[..., h:]
    return out.copy_(y) if out is not None else y


def gelu_tanh_mul(x: torch.Tensor, *, out=None) -> torch.Tensor:
    h = check_act(x, out)
    y = F.gelu(x[..., :h], approximate="tanh") * x[..., h:]
    return out.copy_(y) if out is not None else y
