"""Grouped GEMM over expert-aligned row blocks (see align.py), and the weighted combine.

One kernel, two uses:
- gate/up (GATED=True): rows of x gathered by token (pair // top_k), two accumulators (gate
  columns n and up columns I + n of w13[e]) sharing each A tile; the epilogue writes
  SiLU(gate) * up to ``inter[pair, n]`` so the [T*k, 2I] intermediate never exists.
- down (GATED=False, WEIGHTED=True): rows of ``inter`` by pair, w2[e]; the epilogue multiplies
  by the pair's routing weight in fp32 and writes ``y[pair, :]``.
The combine sums the k rows of each token in fp32 (deterministic: no atomics).

Each program owns one BM-row block (all rows of one expert) and one BN column tile; blocks past
the padded total exit at once. Weights are read as [BK, BN] tiles of the row-major [N, K]
expert matrix (K contiguous). Offsets into x / w / outputs are int64.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, total_ptr,
    n_pairs, N, K, a_row_div,
    stride_am, stride_we, stride_wn, stride_om,
    GATED: tl.constexpr, WEIGHTED: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    num_m = tl.num_programs(0) // num_n
    # Grouped ordering: GROUP_M consecutive row blocks (mostly one expert) walk the column
    # tiles together, so each weight tile is read from HBM once and from L2 after.
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    total = tl.load(total_ptr)
    if pid_m * BM >= total:
        return
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < n_pairs
    a_row = tl.where(valid, pair // a_row_div, 0).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    w_base = w_ptr + expert * stride_we
    g_ptrs = w_base + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if GATED:
        u_ptrs = g_ptrs + N * stride_wn
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - kk * BK
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, g, acc)
        if GATED:
            if EVEN_K:
                u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_u = tl.dot(a, u, acc_u)
            u_ptrs += BK
        a_ptrs += BK
        g_ptrs += BK
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_u  # SiLU(gate) * up, in fp32
    if WEIGHTED:
        w = tl.load(weights_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0)
        acc = acc * w[:, None]
    o_ptrs = out_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(y_ptr, out_ptr, H, top_k, stride_y, stride_o, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = offs < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for j in range(0, top_k):
        acc += tl.load(y_ptr + (t * top_k + j) * stride_y + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def pick_bm(n_pairs: int, num_experts: int) -> int:
    """Row-block height from the expected rows per expert (known on the host: no sync).
    Decode (a few rows per expert) wants the smallest tile tl.dot takes; prefill wants tall
    tiles to reuse each weight tile across many rows."""
    if _interpreting():
        return 16
    per_expert = n_pairs / num_experts
    if per_expert <= 16:
        return 16
    if per_expert <= 48:
        return 32
    if per_expert <= 96:
        return 64
    return 128


def _config(bm: int, gated: bool, N: int, K: int, elem: int) -> dict:
    if _interpreting():  # small tiles keep the interpreter fast; speed is not measured there
        return dict(BN=32, BK=32, GROUP_M=4, num_warps=4, num_stages=1)
    if bm <= 32:  # weight-bandwidth bound: many narrow column tiles, deep pipelining
        bn = 64 if (gated or N >= 8192) else 32
        return dict(BN=bn, BK=128 if elem == 2 else 64, GROUP_M=1, num_warps=4,
                    num_stages=3 if gated else 4)
    bn = 64 if gated else 128  # gated: two accumulators, so half-width tiles
    return dict(BN=bn, BK=64 if elem == 2 else 32, GROUP_M=8, num_warps=8 if bm >= 128 else 4,
                num_stages=4 if bm <= 64 else 3)


def grouped_gemm(a, w, out, sorted_ids, block_expert, total, n_pairs, a_row_div, bm, *, gated, weights=None):
    """out[pair] = f(a[pair // a_row_div] @ w[e].T) for every pair of every expert block."""
    E, n_rows, K = w.shape
    N = n_rows // 2 if gated else n_rows
    cfg = _config(bm, gated, N, K, a.element_size())
    nblocks = block_expert.numel()
    grid = (nblocks * triton.cdiv(N, cfg["BN"]),)
    _grouped_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out, sorted_ids, block_expert, total,
        n_pairs, N, K, a_row_div, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        GATED=gated, WEIGHTED=weights is not None, EVEN_K=K % cfg["BK"] == 0, BM=bm, BN=cfg["BN"],
        BK=cfg["BK"], GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def combine(y: torch.Tensor, T: int, top_k: int, out: torch.Tensor) -> torch.Tensor:
    H = y.shape[1]
    bh = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, bh))](y, out, H, top_k, y.stride(0), out.stride(0), BH=bh)
    return out
