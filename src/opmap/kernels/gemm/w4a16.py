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
from opmap.kernels.gemm.splitk import finish, sm_count
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


# lop3.b32 d, word, mask, 2^23's bits, (a & b) | c: code at of a word into fp32's mantissa in one
# instruction (ptxas split the same expression written in Triton into two)
_LOP = tl.constexpr(tuple(f"lop3.b32 $0, $1, {0xF << (4 * a)}, 1258291200, 0xea;" for a in range(5)))


@triton.jit
def _in_mantissa(word, at: tl.constexpr, ASM: tl.constexpr):
    """The bits of (word & 0xF << 4 at) | 2^23's as fp32: 2^23 + code * 16^at."""
    if ASM:
        b = tl.inline_asm_elementwise(_LOP[at], "=r,r", [word], dtype=tl.int32, is_pure=True, pack=1)
    else:
        b = (word & (0xF << (4 * at))) | 0x4B000000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _plane(t, word, zf, x_ptrs, j: tl.constexpr, at: tl.constexpr, ASM: tl.constexpr):
    """t + plane j's codes minus the zero, times x's elements 8 i + j, in fp32. The code sits at bits
    4 at .. 4 at + 3 of ``word`` (at <= 4: inside fp32's 23-bit mantissa): OR'd into the mantissa of
    2^23 (one LOP3 with the mask) it makes 2^23 + code * 16^at exactly, one subtract of 2^23 + zero * 16^at leaves (code - zero) * 16^at,
    and x's elements scaled by 16^-at (exact) undo the power: three instructions a code."""
    p: tl.constexpr = float(16 ** at)
    v = _in_mantissa(word, at, ASM) - (8388608.0 + zf * p)
    xj = tl.load(x_ptrs + j).to(tl.float32) * (1.0 / p)
    return t + v * xj[None, :]


# M is always 1 here: Triton would make it a constant, and splitk.finish takes it as a tensor
@triton.jit(do_not_specialize=["M"])
def _w4a16_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, o_ptr, ws_ptr, cnt_ptr, M, N, K, stride_wn, stride_sn,
                       stride_om, K_PER_SPLIT, G: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SPLIT: tl.constexpr, SYM_ZERO: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """One row of x (M = 1) on CUDA cores, no MMA and no shared memory for the weight: each K tile's
    codes, taken as eight planes (code j of every word meets x's element 8 i + j), are turned into
    fp32 in place (``_plane``), multiplied by x and summed elementwise in fp32 into a
    [BLOCK_N, BLOCK_K / 8] partial (the group scale on each tile's sum), reduced along K once at the
    end. The config GEMV=1 of triton-w4a16."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_K // 8)
    n_mask = offs_n < N
    k0 = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k0 + K_PER_SPLIT, K)
    rows = offs_n.to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + (k0 // 8 + offs_w)[None, :]
    x_ptrs = x_ptr + k0 + 8 * offs_w  # x's elements 8 i of the tile; plane j adds j
    part = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        s, z = _group_of(s_ptr, z_ptr, rows, stride_sn, k, True, n_mask, G, HAS_ZERO, SYM_ZERO, BLOCK_N)
        zf = z.to(tl.float32)  # [BLOCK_N, 1]
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0)  # K is a whole number of tiles: no K mask
        # fp32's mantissa holds bits 0..22: codes 0..4 in place, codes 5..7 moved down to positions
        # 2..4 (bits 8..19; what the shift brings in above is masked off)
        hi = w >> 12
        t = _plane(tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32), w, zf, x_ptrs, 0, 0, ASM)
        t = _plane(t, w, zf, x_ptrs, 1, 1, ASM)
        t = _plane(t, w, zf, x_ptrs, 2, 2, ASM)
        t = _plane(t, w, zf, x_ptrs, 3, 3, ASM)
        t = _plane(t, w, zf, x_ptrs, 4, 4, ASM)
        t = _plane(t, hi, zf, x_ptrs, 5, 2, ASM)
        t = _plane(t, hi, zf, x_ptrs, 6, 3, ASM)
        t = _plane(t, hi, zf, x_ptrs, 7, 4, ASM)
        part += t * s[:, None]
        w_ptrs += BLOCK_K // 8
        x_ptrs += BLOCK_K
    acc = tl.sum(part, axis=1)[:, None]  # [BLOCK_N, 1]
    finish(acc, b_ptr, o_ptr, ws_ptr, cnt_ptr, offs_n, tl.arange(0, 1), M, N, stride_om, 0, pid_k, HAS_BIAS, SPLIT,
           BLOCK_N, 1)


CONFIG = scaled_tiles.CONFIG  # config= keys (scaled_tiles.config_of); BLOCK_K divides the group


def _planned(M, N, K, G, device, config) -> dict:
    cfg = scaled_tiles.config_of(config)
    p = scaled_tiles.planned(M, N, K, G, device, cfg, 256, False, "the group size")
    if not p["GEMV"]:
        return p
    expect(M == 1, "config", f"GEMV=1 with M={M}", "M = 1 (the CUDA-core kernel takes one row of x)")
    p["BLOCK_M"] = 1
    if not scaled_tiles.INTERP:
        # its own tile: 128 channels over 8 warps (64 over 4 spilled in the sm90 build), and K splits
        # for about four programs an SM (each keeps >= 4 K tiles)
        p["BLOCK_N"] = cfg["BLOCK_N"] or 128
        p["num_warps"] = cfg["num_warps"] or scaled_tiles.warps_for(p["BLOCK_N"])
        p["num_stages"] = cfg["num_stages"] or 3
        tiles = triton.cdiv(N, p["BLOCK_N"])
        p["SPLIT"] = cfg["SPLIT"] or max(1, min(triton.cdiv(4 * sm_count(device), tiles), K // (4 * p["BLOCK_K"])))
    return scaled_tiles.split_k(p, K)


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
    if p["GEMV"]:
        ws, cnt = scaled_tiles.workspace(p, M, N, out)
        _w4a16_gemv_kernel[scaled_tiles.grid(p, M, N)](
            x, w, w_scale, w_zero if w_zero is not None else w_scale, bias if bias is not None else out, out, ws, cnt,
            M, N, K, w.stride(0), w_scale.stride(0), out.stride(0), p["K_PER_SPLIT"], G=G, HAS_ZERO=w_zero is not None,
            HAS_BIAS=bias is not None, SPLIT=p["SPLIT"], SYM_ZERO=INT4_SYM_ZERO, ASM=not scaled_tiles.INTERP,
            BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"], num_warps=p["num_warps"], num_stages=p["num_stages"])
        return out
    ws, cnt = scaled_tiles.workspace(p, M, N, out)
    _w4a16_kernel[scaled_tiles.grid(p, M, N)](
        x, w, w_scale, w_zero if w_zero is not None else w_scale, bias if bias is not None else out, out, ws, cnt,
        M, N, K, x.stride(0), w.stride(0), w_scale.stride(0), out.stride(0), p["K_PER_SPLIT"], G=G,
        HAS_ZERO=w_zero is not None, HAS_BIAS=bias is not None, SPLIT=p["SPLIT"], SYM_ZERO=INT4_SYM_ZERO,
        ASM=not scaled_tiles.INTERP, SUB=p["SUB"], FOLD=p["FOLD"],
        BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"], num_warps=p["num_warps"],
        num_stages=p["num_stages"])
    return out
