"""torch.library registration (namespace opmap) of the Triton RoPE op (in place on q, k)."""
from __future__ import annotations

import torch


@torch.library.custom_op("opmap::rope", mutates_args=("q", "k"))
def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, style: str) -> None:
    from .triton_rope import rope as impl

    impl(q, k, positions, cos_sin, style)


@rope.register_fake
def _(q, k, positions, cos_sin, style):
    return None
