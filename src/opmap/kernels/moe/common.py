"""What the MoE routing kernels share (align.py, route_align.py, route_triton.py, grouped_gemm.py):
the routing of a tile of tokens (route_rows), the @triton.jit steps of the align by
expert (each expert's segment of the sorted pairs, its padding and its blocks' expert ids) and the
host arithmetic of their launches (plain-int powers of two, the
padded capacity, one int32 allocation for the align's outputs)."""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

NEG = tl.constexpr(float("-inf"))


@triton.jit
def route_rows(logits_ptr, bias_ptr, t, row_ok, E, stride_l, routed_scaling, TOP_K: tl.constexpr,
               K_POW2: tl.constexpr, E_POW2: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
               RENORM: tl.constexpr):
    """route_triton's math for the token rows ``t`` ([rows, 1], ``row_ok`` where a row is a token),
    along the tile's axis 1: softmax or sigmoid, bias for the choice, top-k by repeated arg-max with
    the lowest index first among equal scores, weights from the unbiased scores, renormalisation,
    routed scaling. -> (weights [rows, K_POW2] fp32, ids [rows, K_POW2] int32, the slot index
    [1, K_POW2]); slots from TOP_K hold zeros."""
    idx = tl.arange(0, E_POW2)[None, :]
    ok = idx < E
    x = tl.load(logits_ptr + t.to(tl.int64) * stride_l + idx, mask=row_ok & ok, other=NEG).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        m = tl.max(x, axis=1)
        m = tl.where(m == NEG, 0.0, m)  # padding rows (t >= T): all -inf, keep them NaN-free
        p = tl.exp(x - m[:, None])
        scores = p / tl.maximum(tl.sum(p, axis=1), 1e-38)[:, None]
    scores = tl.where(ok, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, NEG)
    kidx = tl.arange(0, K_POW2)[None, :]
    ws = tl.zeros([t.shape[0], K_POW2], dtype=tl.float32)
    ids = tl.zeros([t.shape[0], K_POW2], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        i = tl.minimum(tl.argmax(choice, axis=1), E - 1)[:, None]  # in [0, E) even for NaN logits
        ws = tl.where(kidx == j, tl.sum(tl.where(idx == i, scores, 0.0), axis=1)[:, None], ws)
        ids = tl.where(kidx == j, i.to(tl.int32), ids)
        choice = tl.where(idx == i, NEG, choice)
    if RENORM:
        ws = ws / (tl.sum(ws, axis=1)[:, None] + 1e-20)
    return ws * routed_scaling, ids, kidx


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
