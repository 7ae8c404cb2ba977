"""Per-token dynamic fp8-e4m3 quantisation of activations in one Triton launch: for each row of
x[M, K], scale = max|x_row| / 448 (floored so a zero row stays zero) and xq = x / scale.

Why a kernel: the same thing in PyTorch ops (``quant.quantize_act_fp8``) is five passes over x and
its fp32 copy; before a fp8 GEMM of prefill size they cost more than the GEMM (gemm.md).
One program a row. Rows up to ``ONE_PASS_K`` are held in registers: one read of x, one write of
xq (at M = 128 the call is a single DRAM round trip, not one per chunk of the row). Wider rows take
two loops over ``BLOCK_K`` chunks: the max, then (the row is in L1 / L2 by then) the quantised row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect, expect_tensor

from opmap.ops.gemm.quant import FP8, FP8_MAX, MIN_SCALE

ONE_PASS_K = 16384  # the widest activation of the supported models (14336 for Llama-3-8B's down)
BLOCK_K = 4096


@triton.jit
def _store_codes(q_ptrs, x, scale, mask, QMAX: tl.constexpr):
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, MIN_SCALE: tl.constexpr,
                      QMAX: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    if ONE_PASS:
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / QMAX, MIN_SCALE)
        tl.store(s_ptr + row, scale)
        _store_codes(q_row + offs, x, scale, offs < K, QMAX)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = tl.load(x_row + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0) / QMAX, MIN_SCALE)
        tl.store(s_ptr + row, scale)
        for k in range(0, K, BLOCK_K):
            x = tl.load(x_row + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
            _store_codes(q_row + k + offs, x, scale, k + offs < K, QMAX)


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq[M, K] fp8-e4m3, scale[M, 1] fp32) with x ~= xq * scale: ``quant.quantize_act_fp8`` bit for
    bit on the GPU. The division is IEEE-rounded (``div_rn``): x * (1 / scale) (and Triton's ``/``,
    ``div.full``) can be an ulp off, which flips a code at an e4m3 rounding boundary (the GPU test at
    300 x 14336 found such codes)."""
    expect_tensor("x", x, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=2, last_dim_contiguous=True)
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M and K:
        one_pass = K <= ONE_PASS_K
        block = triton.next_power_of_2(K) if one_pass else BLOCK_K
        # 16-32 fp32 elements a thread: 8 warps at 4096, 16 at 8192 and wider.
        warps = max(1, min(16, block // 512))
        _act_quant_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), MIN_SCALE=MIN_SCALE, QMAX=FP8_MAX,
                                BLOCK_K=block, ONE_PASS=one_pass, num_warps=warps)
    elif M:
        s.fill_(MIN_SCALE)
    return q, s


@triton.jit
def _act_quant_group_kernel(x_ptr, q_ptr, s_ptr, M, MP, NG, stride_xm, stride_qm, MIN_SCALE: tl.constexpr,
                            QMAX: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """GROUPS consecutive groups of one row a program; the scale of group g of row m at s[g * MP + m]
    (rows M..MP-1: padding, zero codes and the least scale)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (g < NG)[:, None]
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask & (row < M), other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / QMAX, MIN_SCALE)
    tl.store(s_ptr + g.to(tl.int64) * MP + row, scale, mask=g < NG)
    _store_codes(q_ptr + row * stride_qm + cols, x, scale[:, None], mask, QMAX)


def quantize_act_fp8_group(x: torch.Tensor, group: int, pad: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq[M', K] fp8-e4m3, scale[M', K / group] fp32) with a scale per ``group`` input channels of a
    token: ``quant.quantize_act_fp8_group`` bit for bit on the GPU. The scale is returned
    outer-dim-major (stride (1, M')), the layout cuBLASLt's 1 x 128 block scaling reads. M' is M
    rounded up to a multiple of ``pad``; the rows past M are zero codes with the least scale."""
    expect_tensor("x", x, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=2, last_dim_contiguous=True)
    M, K = x.shape
    expect(group > 0 and group & (group - 1) == 0 and K % group == 0, "group", group,
           f"a power of two dividing K={K}")
    ng = K // group
    mp = -(-M // pad) * pad
    q = torch.empty((mp, K), dtype=FP8, device=x.device)
    s = torch.empty((ng, mp), dtype=torch.float32, device=x.device)
    if mp and ng:
        groups = max(1, min(triton.next_power_of_2(ng), 4096 // group))  # up to 4096 columns a program
        _act_quant_group_kernel[(mp, triton.cdiv(ng, groups))](
            x, q, s, M, mp, ng, x.stride(0), q.stride(0), MIN_SCALE=MIN_SCALE, QMAX=FP8_MAX, GROUP=group,
            GROUPS=groups, num_warps=max(1, min(8, groups * group // 512)))
    return q, s.t()
