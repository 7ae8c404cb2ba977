"""RoPE in Triton, in place on q and k (NeoX or GPT-J layout, partial rotary, any positions).

Grid (tokens, head blocks): a program loads the cos/sin row of its token's position once and
rotates a block of q heads and the same block of k heads, so cos/sin are read once per token
rather than once per head. Only the first ``rotary_dim`` dims of a head are read and written;
the rest (partial rotary) are not touched. Math in fp32, one rounding to the tensor's dtype.
q and k may be strided views (e.g. slices of a fused qkv output) as long as head_dim is
contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.kernels import pdl
from opmap.kernels.pdl import enter
from opmap.ops.rope.validate import check_rope


@triton.jit
def rotate_pairs(p, i1, i2, mask, c, s):
    """Rotates the pairs (p[i1], p[i2]) in place and returns them: fp32 math, one rounding to the
    tensor's dtype. Each thread loads both elements of the pairs it stores, so rotating in place
    needs no barrier (a thread never reads a value another thread writes)."""
    x1 = tl.load(p + i1, mask=mask, other=0.0)
    x2 = tl.load(p + i2, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    y1 = (a * c - b * s).to(x1.dtype)
    y2 = (b * c + a * s).to(x2.dtype)
    tl.store(p + i1, y1, mask=mask)
    tl.store(p + i2, y2, mask=mask)
    return y1, y2


@triton.jit
def pair_index(d, HALF, IS_NEOX: tl.constexpr):
    """The two dims of pair d: NeoX (d, d + R/2), GPT-J (2d, 2d + 1)."""
    if IS_NEOX:
        return d, d + HALF
    else:
        return 2 * d, 2 * d + 1


@triton.jit
def rotate_heads(base, stride_h, h0, nheads, c, s, HALF, IS_NEOX: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < nheads) & (d[None, :] < HALF)
    i1, i2 = pair_index(d, HALF, IS_NEOX)
    p = base + heads[:, None].to(tl.int64) * stride_h
    rotate_pairs(p, i1[None, :], i2[None, :], mask, c, s)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                 HQ, HK, HALF, IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 PDL: tl.constexpr = False):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BLOCK_H
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    cs_row = cs_ptr + pos * (2 * HALF)
    c = tl.load(cs_row + d, mask=d < HALF, other=0.0)[None, :]
    s = tl.load(cs_row + HALF + d, mask=d < HALF, other=0.0)[None, :]
    if h0 < HQ:
        rotate_heads(q_ptr + t * stride_qt, stride_qh, h0, HQ, c, s, HALF, IS_NEOX, BLOCK_H, BLOCK_D)
    if h0 < HK:
        rotate_heads(k_ptr + t * stride_kt, stride_kh, h0, HK, c, s, HALF, IS_NEOX, BLOCK_H, BLOCK_D)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
         style: str = "neox") -> None:
    r = check_rope(q, k, positions, cos_sin, style)
    T, HQ, _ = q.shape
    HK = k.shape[1]
    if T == 0:
        return None
    half = r // 2
    block_d = triton.next_power_of_2(half)
    # About 2048 elements per half-tile: all heads of a token in one program for common
    # shapes (32 x 64), fewer heads when head_dim is large.
    block_h = max(1, min(triton.next_power_of_2(max(HQ, HK)), 2048 // block_d))
    grid = (T, triton.cdiv(max(HQ, HK), block_h))
    num_warps = 4 if block_h * block_d >= 1024 else 2
    _rope_kernel[grid](q, k, positions, cos_sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                       HQ, HK, half, IS_NEOX=style == "neox", BLOCK_H=block_h, BLOCK_D=block_d,
                       num_warps=num_warps, **pdl.launch(q.device))
    return None
