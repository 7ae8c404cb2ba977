"""``torch.ops.opmap.apply_bitmask(logits, bitmask, rows=None)`` (mutates ``logits``): the grammar
bitmask apply as a ``torch.library`` op. Runs the Triton kernel where Triton can run (a GPU, or
the interpreter), else the reference; same contract (``opmap.ops.grammar.reference``)."""
from __future__ import annotations

from typing import Optional

import torch

from ... import registry

__all__ = ["apply_bitmask"]


@torch.library.custom_op("opmap::apply_bitmask", mutates_args=("logits",))
def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[torch.Tensor] = None) -> None:
    if registry.triton_available() is None:
        from .bitmask import apply_bitmask as fn
    else:
        from .reference import apply_bitmask as fn
    fn(logits, bitmask, rows)


@apply_bitmask.register_fake
def _(logits, bitmask, rows=None):
    return None
