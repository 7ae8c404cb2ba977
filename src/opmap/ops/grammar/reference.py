"""Plain-PyTorch reference of the grammar bitmask apply (the ``grammar_mask`` op).

Contract (every backend): ``apply_bitmask(logits[B, V], bitmask[B, ceil(V/32)] int32, rows=None)
-> None``, in place. Token j of row b is allowed when bit ``j % 32`` of word ``bitmask[b, j // 32]``
is set (the layout xgrammar fills); a disallowed token's logit becomes -inf. ``rows`` (int32/int64
[R], optional) lists the rows to mask; the other rows are left untouched and cost nothing. The
logits may be fp32, fp16 or bf16 with any row stride (last-dim stride 1).
"""
from __future__ import annotations

import math

import torch

from opmap.ops.grammar.validate import check_bitmask_args

__all__ = ["apply_bitmask", "unpack_bitmask", "pack_bitmask"]


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [B, vocab]: True where allowed."""
    bits = (bitmask[:, :, None] >> torch.arange(32, device=bitmask.device, dtype=torch.int32)) & 1
    return bits.reshape(bitmask.shape[0], bitmask.shape[1] * 32)[:, :vocab].bool()


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """Inverse of unpack_bitmask: bool [B, V] -> int32 [B, ceil(V/32)] (padding bits cleared)."""
    B, V = allowed.shape
    W = (V + 31) // 32
    a = torch.zeros((B, W * 32), dtype=torch.int64, device=allowed.device)
    a[:, :V] = allowed.to(torch.int64)
    words = (a.view(B, W, 32) << torch.arange(32, device=allowed.device)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows=None) -> None:
    check_bitmask_args(logits, bitmask, rows)
    V = logits.shape[1]
    allowed = unpack_bitmask(bitmask, V)
    if rows is None:
        logits.masked_fill_(~allowed, -math.inf)
        return
    r = rows.to(torch.int64)
    sub = logits[r].masked_fill(~allowed[r], -math.inf)
    logits[r] = sub
