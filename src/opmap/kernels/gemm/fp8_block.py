"""Linear with block-wise fp8 weights (e4m3, one fp32 scale per b x b block: DeepSeek-V3's and the
Qwen3-FP8 releases' layout) in Triton, weight-only, any M: the kernel of the backend
``triton-fp8-block``.

``linear(x[M, K], w[N, K] e4m3, bias=None, w_scale[ceil(N / b), ceil(K / b)] fp32, *, config=None)``
-> [M, N] in x.dtype.

Design, as w4a16.py: swap AB (each program a ``[BLOCK_N, BLOCK_M]`` tile of out^T, x padded to 16
columns), many narrow N tiles, split K at decode M through the family's counters. A weight tile
lies inside one block (BLOCK_N and BLOCK_K divide b), so its scale is one number: the tile is
converted to x's dtype exactly (e4m3 values are exact in fp16 and bf16), the MMA runs on it, and
the block's scale multiplies the tile's fp32 product; no dequantised weight exists.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect
from opmap.kernels.gemm import scaled_tiles
from opmap.kernels.gemm.splitk import finish
from opmap.ops.gemm.quant import block_of
from opmap.ops.gemm.validate import check_linear


@triton.jit
def _tile(acc, w_ptrs, x_ptrs, s, k, k_end, K, offs_k, n_mask, m_mask, EVEN_K: tl.constexpr, FOLD: tl.constexpr):
    """acc + the K tile at input channel k (w_ptrs, x_ptrs) times its block scale ``s`` (tiles at
    or past k_end: none); FOLD: the scale on the weight before the MMA (scaled_tiles.CONFIG)."""
    live = k < k_end
    if EVEN_K:
        w = tl.load(w_ptrs, mask=n_mask[:, None] & live, other=0.0)
        xt = tl.load(x_ptrs, mask=m_mask[None, :] & live, other=0.0)
    else:
        k_mask = ((k + offs_k) < K) & live
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xt = tl.load(x_ptrs, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
    return scaled_tiles.scaled_dot(acc, w, xt, s, FOLD)


@triton.jit(do_not_specialize=["M"])
def _fp8_block_kernel(x_ptr, w_ptr, s_ptr, b_ptr, o_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                      stride_om, K_PER_SPLIT, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                      EVEN_K: tl.constexpr, SUB: tl.constexpr, FOLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k0 = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k0 + K_PER_SPLIT, K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + (k0 + offs_k)[:, None]
    s_row = s_ptr + ((pid_n * BLOCK_N) // BLOCK).to(tl.int64) * stride_sn  # the tile's row of blocks
    last = (k_end - 1) // BLOCK
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # SUB K tiles an iteration, their block scales loaded first: the iteration waits on them once
    for k in range(k0, k_end, SUB * BLOCK_K):
        s0 = tl.load(s_row + k // BLOCK)
        if SUB > 1:
            s1 = tl.load(s_row + tl.minimum((k + BLOCK_K) // BLOCK, last))
        if SUB > 2:
            s2 = tl.load(s_row + tl.minimum((k + 2 * BLOCK_K) // BLOCK, last))
            s3 = tl.load(s_row + tl.minimum((k + 3 * BLOCK_K) // BLOCK, last))
        acc = _tile(acc, w_ptrs, x_ptrs, s0, k, k_end, K, offs_k, n_mask, m_mask, EVEN_K, FOLD)
        if SUB > 1:
            acc = _tile(acc, w_ptrs + BLOCK_K, x_ptrs + BLOCK_K, s1, k + BLOCK_K, k_end, K, offs_k, n_mask, m_mask,
                        EVEN_K, FOLD)
        if SUB > 2:
            acc = _tile(acc, w_ptrs + 2 * BLOCK_K, x_ptrs + 2 * BLOCK_K, s2, k + 2 * BLOCK_K, k_end, K, offs_k, n_mask,
                        m_mask, EVEN_K, FOLD)
            acc = _tile(acc, w_ptrs + 3 * BLOCK_K, x_ptrs + 3 * BLOCK_K, s3, k + 3 * BLOCK_K, k_end, K, offs_k, n_mask,
                        m_mask, EVEN_K, FOLD)
        w_ptrs += SUB * BLOCK_K
        x_ptrs += SUB * BLOCK_K
    finish(acc, b_ptr, o_ptr, ws_ptr, cnt_ptr, offs_n, offs_m, M, N, stride_om, pid_m, pid_k, HAS_BIAS, SPLIT,
           BLOCK_N, BLOCK_M)


CONFIG = scaled_tiles.CONFIG  # config= keys (scaled_tiles.config_of); BLOCK_N and BLOCK_K divide the block edge


def _planned(M, N, K, b, device, config) -> dict:
    cfg = scaled_tiles.config_of(config)
    return scaled_tiles.planned(M, N, K, b, device, cfg, 128, True, "the block edge")


def describe(M: int, N: int, K: int, device, b: int, config=None) -> str:
    return scaled_tiles.text(_planned(M, N, K, b, torch.device(device), config))


def linear(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None, *, config=None) -> torch.Tensor:
    """``config``: the tile of this kernel (scaled_tiles.CONFIG's keys; 0 keeps the plan's)."""
    M, N, K = check_linear(x, w, bias, w_scale, w_zero, block=True)
    expect(w.dtype == torch.float8_e4m3fn and w_scale is not None and w_scale.dim() == 2, "w_scale",
           "a scale per output channel" if w_scale is not None else "None", "a scale per block (block-wise fp8)")
    scaled_tiles.config_of(config)
    out, work = scaled_tiles.output(x, M, N, K, bias)
    if not work:
        return out
    b = block_of(N, K, w_scale)
    p = _planned(M, N, K, b, x.device, config)
    ws, cnt = scaled_tiles.workspace(p, M, N, out)
    _fp8_block_kernel[scaled_tiles.grid(p, M, N)](
        x, w, w_scale, bias if bias is not None else out, out, ws, cnt, M, N, K, x.stride(0), w.stride(0),
        w_scale.stride(0), out.stride(0), p["K_PER_SPLIT"], BLOCK=b, HAS_BIAS=bias is not None, SPLIT=p["SPLIT"],
        EVEN_K=K % p["BLOCK_K"] == 0, SUB=p["SUB"], FOLD=p["FOLD"], BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"],
        num_warps=p["num_warps"], num_stages=p["num_stages"])
    return out
