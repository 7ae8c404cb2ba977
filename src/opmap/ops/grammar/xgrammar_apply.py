"""XGrammar's own bitmask apply as a peer (provider "xgrammar"), same entry as ours.

``xgrammar.apply_token_bitmask_inplace`` picks its CUDA/Triton kernel for GPU tensors and its
C++ loop for CPU tensors. It takes row indices as a Python list, so a ``rows`` tensor is read on
the host here (a sync: declared in the benchmark notes); xgrammar is imported on first use.
"""
from __future__ import annotations

from .validate import check_bitmask_args

__all__ = ["apply_bitmask"]


def apply_bitmask(logits, bitmask, rows=None) -> None:
    import xgrammar

    check_bitmask_args(logits, bitmask, rows)
    if rows is not None and rows.numel() == 0:
        return
    indices = None if rows is None else [int(r) for r in rows.tolist()]
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=indices)
