"""torch.library registrations (namespace opmap) of the Triton gated activations."""
from __future__ import annotations

import torch


def _fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op("opmap::silu_mul", mutates_args=())
def silu_mul(x: torch.Tensor) -> torch.Tensor:
    from .triton_act import silu_mul as impl

    return impl(x)


@torch.library.custom_op("opmap::gelu_tanh_mul", mutates_args=())
def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    from .triton_act import gelu_tanh_mul as impl

    return impl(x)


silu_mul.register_fake(_fake)
gelu_tanh_mul.register_fake(_fake)
