"""Triton logits processors: ``apply_penalties`` and ``apply_temperature`` (in place).

Contract in ``opmap.ops.sampling.reference``. Both are elementwise over [B, V] with per-row
parameters, one program per (row, block of the vocabulary); they read and write each logit once
(plus the penalty state: prompt mask 1 byte and output counts 4 bytes per token).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.ops.sampling.validate import FLT_MIN as FLT_MIN_F32, check_logits, check_penalty_args, check_row_params

__all__ = ["apply_penalties", "apply_temperature"]

FLT_MIN = tl.constexpr(FLT_MIN_F32)  # the smallest normal fp32 (validate.FLT_MIN)


@triton.jit
def _penalty_kernel(logits_ptr, stride_l, mask_ptr, stride_m, counts_ptr, stride_c, rep_ptr, freq_ptr, pres_ptr,
                    V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < V
    lp = logits_ptr + row * stride_l + offs
    x = tl.load(lp, mask=inb, other=0.0).to(tl.float32)
    in_prompt = tl.load(mask_ptr + row * stride_m + offs, mask=inb, other=0) != 0
    cnt = tl.load(counts_ptr + row * stride_c + offs, mask=inb, other=0).to(tl.float32)
    r = tl.load(rep_ptr + row)
    f = tl.load(freq_ptr + row)
    pr = tl.load(pres_ptr + row)
    seen = in_prompt | (cnt > 0)
    y = tl.where(seen, tl.where(x > 0, x / r, x * r), x)
    y = y - f * cnt - pr * (cnt > 0).to(tl.float32)
    tl.store(lp, y, mask=inb)


@triton.jit
def _temperature_kernel(logits_ptr, stride_l, temp_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    t = tl.load(temp_ptr + row)
    lp = logits_ptr + row * stride_l + offs
    inb = offs < V
    x = tl.load(lp, mask=inb, other=0.0).to(tl.float32)
    # greedy rows (a temperature below FLT_MIN, 0 included: the reference's greedy_rows) are
    # divided by 1: left as they are
    tl.store(lp, x / tl.where(t >= FLT_MIN, t, 1.0), mask=inb)


def _block(t: torch.Tensor) -> int:
    return 1024 if t.is_cuda else 8192


def apply_penalties(logits, prompt_mask, output_counts, repetition, frequency, presence) -> None:
    B, V = check_penalty_args(logits, prompt_mask, output_counts, repetition, frequency, presence)
    if B == 0:
        return
    blk = _block(logits)
    _penalty_kernel[(B, triton.cdiv(V, blk))](
        logits, logits.stride(0), prompt_mask.view(torch.uint8), prompt_mask.stride(0), output_counts,
        output_counts.stride(0), repetition, frequency, presence, V, BLOCK=blk, num_warps=4)


def apply_temperature(logits, temperature) -> None:
    B, V = check_logits(logits, written=True)
    check_row_params(B, logits.device, temperature=(temperature, torch.float32))
    if B == 0:
        return
    blk = _block(logits)
    _temperature_kernel[(B, triton.cdiv(V, blk))](logits, logits.stride(0), temperature, V, BLOCK=blk,
                                                  num_warps=4)
