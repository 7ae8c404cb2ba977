"""Token sort / align by expert with padding to the GEMM tile, on the device, one launch.

Input: the routing ids ``topk_ids[T, k]`` (pair p = t * k + j). Output, for a tile height BM:
- ``sorted_ids[max_padded]`` int32: pair indices grouped by expert, each expert's segment padded
  to a multiple of BM with the sentinel ``T * k`` (a padding row the GEMMs skip);
- ``block_expert[max_blocks]`` int32: the expert of each BM-row block;
- ``total[1]`` int32: the padded length actually used. Blocks at or past it are empty: the
  GEMM grid is sized by the static bound below and those programs exit at once, so nothing
  here needs the host to read a count (no synchronisation, CUDA-graph safe).

Static bound (common.max_padded): at most min(E, T*k) experts are hit, each wastes at most BM - 1
padding rows.
The kernel runs one program per expert; each scans the ids twice (a histogram of all experts
to find its own start, then a cumulative sum of its own matches to place them in order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.kernels.moe.common import align_plan, outputs, pad_segment, segment


@triton.jit(do_not_specialize=["n_pairs"])
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, total_ptr, n_pairs, E,
                  BM: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    e = tl.program_id(0)
    # Pass 1: per-expert counts (every program computes all of them: E is small and this
    # avoids a second launch and a global barrier).
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for c in range(0, n_pairs, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < n_pairs, other=0)
        counts += tl.histogram(ids, E_POW2, mask=offs < n_pairs)
    start, mine, my_padded = segment(counts, e, total_ptr, BM, E_POW2)
    # Pass 2: place this expert's pairs in token order.
    placed = 0
    for c in range(0, n_pairs, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < n_pairs, other=-1)
        hit = (ids == e).to(tl.int32)
        pos = start + placed + tl.cumsum(hit, axis=0) - 1
        tl.store(sorted_ptr + pos, offs, mask=hit != 0)
        placed += tl.sum(hit, axis=0)
    pad_segment(sorted_ptr, block_expert_ptr, e, start, mine, my_padded, n_pairs, BM, CHUNK)


def align(topk_ids: torch.Tensor, num_experts: int, bm: int):
    """-> (sorted_ids [max_padded] int32, block_expert [max_blocks] int32, total [1] int32)."""
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    n = ids.numel()
    _, nblocks, chunk, e_pow2, warps = align_plan(n, num_experts, bm)
    (sorted_ids, block_expert, total), _ = outputs(n, nblocks, bm, ids.device)
    _align_kernel[(num_experts,)](ids, sorted_ids, block_expert, total, n, num_experts, BM=bm,
                                  E_POW2=e_pow2, CHUNK=chunk, num_warps=warps)
    return sorted_ids, block_expert, total
