"""Triton grammar bitmask apply: ``apply_bitmask(logits[B, V], bitmask[B, ceil(V/32)] int32, rows=None)``.

Contract in ``opmap.ops.grammar.reference``. The kernel never reads the logits: it reads the
packed words and writes -inf only where a bit is clear, so an almost-all-allowed row costs the
bitmask read alone (V/8 bytes) and a tightly constrained one about one write per token. With
``rows`` the grid covers those rows only: unconstrained rows cost nothing. A row index outside
[0, B) is skipped (checked up front for CPU tensors; on the GPU that check would sync).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.ops.grammar.validate import check_bitmask_args

__all__ = ["apply_bitmask"]


# B (the logits rows) changes from step to step as requests finish: one binary for every B. With
# B specialised, the first step at B = 16 or 32 compiled a second one inside a timed decode step
# (a step of the JSON e2e case carried that compile).
@triton.jit(do_not_specialize=["B"])
def _bitmask_kernel(logits_ptr, stride_l, bitmask_ptr, stride_b, rows_ptr, B, V,
                    HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if HAS_ROWS:
        r = tl.load(rows_ptr + pid).to(tl.int64)
    else:
        r = pid.to(tl.int64)
    ok_row = (r >= 0) & (r < B)
    r = tl.where(ok_row, r, 0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inb = (offs < V) & ok_row
    words = tl.load(bitmask_ptr + r * stride_b + offs // 32, mask=inb, other=-1)
    allowed = ((words >> (offs % 32)) & 1) != 0
    tl.store(logits_ptr + r * stride_l + offs, float("-inf"), mask=inb & (allowed == 0))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows=None) -> None:
    check_bitmask_args(logits, bitmask, rows)
    B, V = logits.shape
    R = B if rows is None else rows.shape[0]
    if R == 0:
        return
    block = 1024 if logits.is_cuda else 8192
    grid = (R, triton.cdiv(V, block))
    _bitmask_kernel[grid](logits, logits.stride(0), bitmask, bitmask.stride(0),
                          rows if rows is not None else bitmask, B, V,
                          HAS_ROWS=rows is not None, BLOCK=block, num_warps=4)
