"""XGrammar's own bitmask apply as a peer (provider "xgrammar"), same entry as ours.

``xgrammar.apply_token_bitmask_inplace`` picks its CUDA/Triton kernel for GPU tensors and its
C++ loop for CPU tensors. It takes row indices as a Python list, so a ``rows`` tensor is read on
the host here (a sync: declared in the benchmark notes); xgrammar is imported on first use.

xgrammar's CPU apply writes -inf past a row's last token when V % 32 != 0 and the padding bits
of the last word are clear (found by tests/test_fuzz_sampling.py): this adapter then passes a
copy of the mask with those padding bits set, so nothing outside the row is touched.
"""
from __future__ import annotations

from opmap.ops.grammar.validate import check_bitmask_args

__all__ = ["apply_bitmask"]


def apply_bitmask(logits, bitmask, rows=None) -> None:
    # optional: xgrammar
    import xgrammar

    check_bitmask_args(logits, bitmask, rows)
    if rows is not None and rows.numel() == 0:
        return
    V = logits.shape[1]
    if V % 32:
        pad = (~((1 << (V % 32)) - 1)) & 0xFFFFFFFF  # bits V%32..31 of the last word
        bitmask = bitmask.clone()
        bitmask[:, -1] |= pad - (1 << 32) if pad >= 1 << 31 else pad
    indices = None if rows is None else [int(r) for r in rows.tolist()]
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=indices)
