"""torch.library registration (namespace opmap) of the Triton linear (dense or weight-only
fp8 / int8 with per-output-channel scales)."""
from __future__ import annotations

from typing import Optional

import torch


@torch.library.custom_op("opmap::linear", mutates_args=())
def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
           w_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    from .triton_gemm import linear as impl

    return impl(x, w, bias, w_scale)


@linear.register_fake
def _(x, w, bias=None, w_scale=None):
    return x.new_empty((x.shape[0], w.shape[0]))
