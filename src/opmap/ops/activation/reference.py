"""Plain-PyTorch gated activations, the oracle of the family (fp32 math, one rounding).

``silu_mul(x[..., 2H]) = silu(x[..., :H]) * x[..., H:]``; ``gelu_tanh_mul`` likewise with the
tanh approximation of GELU (as in Gemma / GeGLU MLPs).
"""
from __future__ import annotations

import math

import torch

from opmap.ops.activation.validate import check_act


def _split(x):
    h = x.shape[-1] // 2
    return x[..., :h].float(), x[..., h:].float()


def _finish(y, x, out):
    if out is not None:
        out.copy_(y.to(x.dtype))
        return out
    return y.to(x.dtype)


def silu_mul(x: torch.Tensor, *, out=None) -> torch.Tensor:
    check_act(x, out)
    g, u = _split(x)
    return _finish(g * torch.sigmoid(g) * u, x, out)


def gelu_tanh(g: torch.Tensor) -> torch.Tensor:
    """Written out rather than F.gelu(approximate="tanh") so that the formula is visible."""
    return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g * g * g)))


def gelu_tanh_mul(x: torch.Tensor, *, out=None) -> torch.Tensor:
    check_act(x, out)
    g, u = _split(x)
    return _finish(gelu_tanh(g) * u, x, out)
