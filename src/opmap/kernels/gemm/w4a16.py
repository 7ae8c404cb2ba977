"""Linear with int4 weight-only weights (W4A16) in Triton, any M: the kernel of the backend
``triton-w4a16``.

``linear(x[M, K], w[N, K // 8] int32, bias=None, w_scale[N, K // G], w_zero=None, *, config=None)``
-> [M, N] in x.dtype, the weight in the layout of ``opmap.ops.gemm.quant`` (eight 4-bit codes a
word along K, a scale per group of G input channels, uint8 zero codes or the symmetric 8).

Design (at decode M the packed weight is the traffic: a quarter of bf16's bytes):
- Swap AB as in triton_gemm.py: each program computes a ``[BLOCK_N, BLOCK_M]`` tile of
  out^T = w @ x^T, x padded to 16 columns for the MMA; many narrow N tiles, split K (the family's
  split-K counters, partials summed in split order: deterministic) when the N tiles leave SMs idle.
- A K tile never straddles a group (BLOCK_K divides G), so the tile's codes minus its zero are
  small integers, exact in x's dtype: the MMA runs on them and the group scale multiplies the
  tile's fp32 product before it joins the accumulator. No dequantised weight exists, and the
  rounding of ``(u - zero) * scale`` to 16 bits that a dequantise-then-GEMM route makes never
  happens.
- The packed words of a tile are read once ([BLOCK_N, BLOCK_K // 8] int32) and turned into their
  eight 16-bit values in registers (nibbles.py: a few integer instructions a word on the GPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect
from opmap.kernels.gemm import nibbles, scaled_tiles
from opmap.kernels.gemm.splitk import finish
from opmap.ops.gemm.quant import INT4_SYM_ZERO
from opmap.ops.gemm.validate import check_linear


@triton.jit
def _group_of(s_ptr, z_ptr, rows, stride_sn, k, live, n_mask, G: tl.constexpr, HAS_ZERO: tl.constexpr,
              SYM_ZERO: tl.constexpr, BLOCK_N: tl.constexpr):
    """The scale (fp32) and zero code (int32, [BLOCK_N, 1]) of each row's group at input channel k."""
    m = n_mask & live
    s = tl.load(s_ptr + rows * stride_sn + k // G, mask=m, other=0.0).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(z_ptr + rows * stride_sn + k // G, mask=m, other=0).to(tl.int32)[:, None]
    else:
        z = tl.full([BLOCK_N, 1], SYM_ZERO, tl.int32)
    return s, z


@triton.jit
def _tile(acc, w_ptrs, x_ptrs, s, z, live, n_mask, m_mask, ASM: tl.constexpr, FOLD: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + the K tile at (w_ptrs, x_ptrs) times its group scales ``s`` (``live``: inside the split);
    FOLD: the scales on the weight before the MMA (scaled_tiles.CONFIG), else on the tile's product."""
    xdt = x_ptrs.dtype.element_ty
    words = tl.load(w_ptrs, mask=n_mask[:, None] & live, other=0)
    xt = tl.load(x_ptrs, mask=m_mask[None, :] & live, other=0.0)
    wv = tl.reshape(nibbles.unpack(words, z, xdt, ASM), [BLOCK_N, BLOCK_K])  # in [-15, 15]: exact
    return scaled_tiles.scaled_dot(acc, wv, xt, s[:, None], FOLD)


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, o_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn,
                  stride_sn, stride_om, K_PER_SPLIT, G: tl.constexpr, HAS_ZERO: tl.constexpr,
                  HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SYM_ZERO: tl.constexpr, ASM: tl.constexpr,
                  SUB: tl.constexpr, FOLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k0 = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k0 + K_PER_SPLIT, K)
    rows = offs_n.to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + (k0 // 8 + offs_w)[None, :]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + (k0 + offs_k)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # K is a multiple of BLOCK_K (the launcher's tile divides the group, the group divides K). SUB
    # K tiles an iteration, their scales loaded first, so that the iteration waits on them once.
    for k in range(k0, k_end, SUB * BLOCK_K):
        s0, z0 = _group_of(s_ptr, z_ptr, rows, stride_sn, k, True, n_mask, G, HAS_ZERO, SYM_ZERO, BLOCK_N)
        if SUB > 1:
            s1, z1 = _group_of(s_ptr, z_ptr, rows, stride_sn, k + BLOCK_K, k + BLOCK_K < k_end, n_mask, G,
                               HAS_ZERO, SYM_ZERO, BLOCK_N)
        if SUB > 2:
            s2, z2 = _group_of(s_ptr, z_ptr, rows, stride_sn, k + 2 * BLOCK_K, k + 2 * BLOCK_K < k_end, n_mask, G,
                               HAS_ZERO, SYM_ZERO, BLOCK_N)
            s3, z3 = _group_of(s_ptr, z_ptr, rows, stride_sn, k + 3 * BLOCK_K, k + 3 * BLOCK_K < k_end, n_mask, G,
                               HAS_ZERO, SYM_ZERO, BLOCK_N)
        acc = _tile(acc, w_ptrs, x_ptrs, s0, z0, True, n_mask, m_mask, ASM, FOLD, BLOCK_N, BLOCK_K)
        if SUB > 1:
            acc = _tile(acc, w_ptrs + BLOCK_K // 8, x_ptrs + BLOCK_K, s1, z1, k + BLOCK_K < k_end, n_mask, m_mask,
                        ASM, FOLD, BLOCK_N, BLOCK_K)
        if SUB > 2:
            acc = _tile(acc, w_ptrs + 2 * (BLOCK_K // 8), x_ptrs + 2 * BLOCK_K, s2, z2, k + 2 * BLOCK_K < k_end,
                        n_mask, m_mask, ASM, FOLD, BLOCK_N, BLOCK_K)
            acc = _tile(acc, w_ptrs + 3 * (BLOCK_K // 8), x_ptrs + 3 * BLOCK_K, s3, z3, k + 3 * BLOCK_K < k_end,
                        n_mask, m_mask, ASM, FOLD, BLOCK_N, BLOCK_K)
        w_ptrs += SUB * (BLOCK_K // 8)
        x_ptrs += SUB * BLOCK_K
    finish(acc, b_ptr, o_ptr, ws_ptr, cnt_ptr, offs_n, offs_m, M, N, stride_om, pid_m, pid_k, HAS_BIAS, SPLIT,
           BLOCK_N, BLOCK_M)


CONFIG = scaled_tiles.CONFIG  # config= keys (scaled_tiles.config_of); BLOCK_K divides the group


def _planned(M, N, K, G, device, config) -> dict:
    cfg = scaled_tiles.config_of(config)
    return scaled_tiles.planned(M, N, K, G, device, cfg, 256, False, "the group size")


def describe(M: int, N: int, K: int, device, G: int, config=None) -> str:
    return scaled_tiles.text(_planned(M, N, K, G, torch.device(device), config))


def linear(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None, *, config=None) -> torch.Tensor:
    """``config``: the tile of this kernel (scaled_tiles.CONFIG's keys; 0 keeps the plan's)."""
    M, N, K = check_linear(x, w, bias, w_scale, w_zero, int4=True)
    expect(w.dtype == torch.int32, "w", f"dtype {w.dtype}", "int32 words of eight 4-bit codes (W4A16)")
    scaled_tiles.config_of(config)
    out, work = scaled_tiles.output(x, M, N, K, bias)
    if not work:
        return out
    G = K // w_scale.shape[1]
    expect(G % 16 == 0, "w_scale", f"shape {tuple(w_scale.shape)} (group size {G})",
           "a group size that is a multiple of 16 (the MMA's K)")
    p = _planned(M, N, K, G, x.device, config)
    ws, cnt = scaled_tiles.workspace(p, M, N, out)
    _w4a16_kernel[scaled_tiles.grid(p, M, N)](
        x, w, w_scale, w_zero if w_zero is not None else w_scale, bias if bias is not None else out, out, ws, cnt,
        M, N, K, x.stride(0), w.stride(0), w_scale.stride(0), out.stride(0), p["K_PER_SPLIT"], G=G,
        HAS_ZERO=w_zero is not None, HAS_BIAS=bias is not None, SPLIT=p["SPLIT"], SYM_ZERO=INT4_SYM_ZERO,
        ASM=not scaled_tiles.INTERP, SUB=p["SUB"], FOLD=p["FOLD"],
        BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"], num_warps=p["num_warps"],
        num_stages=p["num_stages"])
    return out
