"""torch.library registrations (namespace opmap) of the Triton RMSNorm ops, with fake
implementations so they trace under torch.compile and capture in CUDA graphs."""
from __future__ import annotations

import torch


@torch.library.custom_op("opmap::rmsnorm", mutates_args=())
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from .triton_norm import rmsnorm as impl

    return impl(x, weight, eps)


@rmsnorm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("opmap::add_rmsnorm", mutates_args=("residual",))
def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from .triton_norm import add_rmsnorm as impl

    return impl(x, residual, weight, eps)


@add_rmsnorm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x)
