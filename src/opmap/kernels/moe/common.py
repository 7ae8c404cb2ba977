"""What the MoE routing kernels share (align.py, route_align.py, route_triton.py, grouped_gemm.py): the
@triton.jit steps of the align by expert (each expert's segment of the sorted pairs, its padding and
its blocks' expert ids) and the host arithmetic of their launches (plain-int powers of two, the
padded capacity, one int32 allocation for the align's outputs)."""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl


@triton.jit
def segment(counts, e, total_ptr, BM: tl.constexpr, E_POW2: tl.constexpr):
    """From every expert's pair count: (start, count, padded length) of expert e's segment of
    sorted_ids; expert 0 also writes the padded total."""
    experts = tl.arange(0, E_POW2)
    padded = (counts + BM - 1) // BM * BM
    start = tl.sum(tl.where(experts < e, padded, 0), axis=0)
    mine = tl.sum(tl.where(experts == e, counts, 0), axis=0)
    my_padded = tl.sum(tl.where(experts == e, padded, 0), axis=0)
    if e == 0:
        tl.store(total_ptr, tl.sum(padded, axis=0))
    return start, mine, my_padded


@triton.jit
def pad_segment(sorted_ptr, block_expert_ptr, e, start, mine, my_padded, n_pairs, BM: tl.constexpr,
                 CHUNK: tl.constexpr):
    """Padding rows (the sentinel n_pairs) of expert e's last block, and its blocks' expert ids."""
    pad = start + mine + tl.arange(0, BM)
    tl.store(sorted_ptr + pad, tl.zeros([BM], dtype=tl.int32) + n_pairs, mask=pad < start + my_padded)
    for b in range(0, my_padded // BM, CHUNK):
        blk = b + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + start // BM + blk, tl.zeros([CHUNK], dtype=tl.int32) + e,
                 mask=blk < my_padded // BM)


def max_padded(n_pairs: int, num_experts: int, bm: int) -> int:
    return n_pairs + min(num_experts, n_pairs) * (bm - 1)


def next_pow2(n: int) -> int:
    """Plain-int next power of two. ``triton.next_power_of_2`` / ``triton.cdiv`` are
    ConstexprFunction objects in Triton 3.6, slow on the host through their constexpr-unwrapping
    wrapper, and the launchers called them about a dozen times per MoE call."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@lru_cache(maxsize=256)
def align_plan(n_pairs: int, num_experts: int, bm: int) -> tuple[int, int, int, int, int]:
    """(padded capacity, blocks, CHUNK, E_POW2, warps): host arithmetic of one shape, done once."""
    cap = max_padded(n_pairs, num_experts, bm)
    nblocks = -(-cap // bm)
    # Prefill (tens of thousands of pairs): wide chunks and 8 warps cut the serial iterations of
    # each program's two scans; decode fits in one chunk.
    chunk = min(4096, max(16, next_pow2(n_pairs)))
    return cap, nblocks, chunk, max(2, next_pow2(num_experts)), 8 if chunk >= 2048 else 4


def outputs(n_pairs: int, nblocks: int, bm: int, device, extra: int = 0):
    """((sorted_ids, block_expert, total), tail of ``extra`` ints) in one int32 allocation (one
    caching-allocator call instead of several). Each part starts on a 64-byte boundary, so the
    kernels' pointer-alignment specialisation is the same as with separate allocations."""
    rows = nblocks * bm
    at_total = -(-rows // 16) * 16
    at_blocks = at_total + 16
    at_extra = -(-(at_blocks + nblocks) // 16) * 16
    buf = torch.empty(at_extra + extra, dtype=torch.int32, device=device)
    return (buf[:rows], buf[at_blocks:at_blocks + nblocks], buf[at_total:at_total + 1]), buf[at_extra:]
