"""Weight-only fp8 / int8 linear at 32 < M <= 64 on Hopper (sm90), in Gluon, on warpgroup MMAs:
backend ``gluon-wo-wgmma``.

``linear(x[M, K], w[N, K] fp8-e4m3 or int8, bias, w_scale[N], *, config=None) -> [M, N]`` in
x.dtype, as ``triton_gemm.linear`` (any M <= 64; the registry selects it above M = 32, where the
mma.sync kernel of wo_gluon.py lost: docs/dense.md, Decisions). At M = 64 mma.sync spends more
time on tensor-core instructions than the weight takes to stream. Here each warpgroup owns 64
output channels and runs ``wgmma`` m64nMk16 with the weight tile as the A operand *from
registers* and x^T (the tokens) as the B operand from shared memory, so the converted weight
never goes back to shared memory:

- weight and x tiles arrive by 16-byte async copies in a pipeline of ``STAGES`` tiles; the
  weight tile sits under the 128-byte NVMMA swizzle, so the A-fragment reads (two bytes a
  thread a row, the register layout wgmma wants for 16-bit A) are free of bank conflicts;
- the fragment is converted exactly in registers (two elements a 16-bit read), and the
  per-output-channel scale multiplies the fp32 accumulator in the epilogue;
- split K and the PDL overlap as in wo_gluon.py (wo_common.py holds what the two share).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from opmap.kernels import pdl
from opmap.kernels.gemm import wo_common as common
from opmap.kernels.gemm.wo_common import finish, issue, pipeline
from opmap.kernels.gluon_util import enter, hopper


def _pair_asm(head: str, pack: str) -> gl.constexpr:
    """Two weight bytes (one 16-bit register) -> two 16-bit values packed in 32 bits: ``head``
    leaves them in fp32 registers a (low) and b (high); ``pack`` converts the pair, exactly."""
    return gl.constexpr("{ .reg .b32 t, h; .reg .b16 lo, hi; .reg .f32 a, b;\n" + head + pack + " $0, b, a; }")


# int8: each byte (offset by 128) under 2^23's exponent, minus 2^23 + 128; e4m3: through fp16
_I8 = ("cvt.u32.u16 t, $1;\nxor.b32 t, t, 0x8080;\nprmt.b32 h, t, 0x4B000000, 0x7540;\n"
       "sub.f32 a, h, 0f4B000080;\nprmt.b32 h, t, 0x4B000000, 0x7541;\nsub.f32 b, h, 0f4B000080;\n")
_F8 = "cvt.rn.f16x2.e4m3x2 h, $1;\nmov.b32 {lo, hi}, h;\ncvt.f32.f16 a, lo;\ncvt.f32.f16 b, hi;\n"
I8_BF16 = _pair_asm(_I8, "cvt.rn.bf16x2.f32")
I8_F16 = _pair_asm(_I8, "cvt.rn.f16x2.f32")
F8_BF16 = _pair_asm(_F8, "cvt.rn.bf16x2.f32")


@gluon.jit
def _pair_operand(w, xdt: gl.constexpr, W_INT8: gl.constexpr):
    """A weight fragment in x's dtype, exactly, two elements (one 16-bit read) at a time: the
    register layout of a 16-bit A operand holds K in pairs, and four-element conversions would
    make ptxas unpack and repack the bytes of two reads."""
    if W_INT8:
        if xdt == gl.float16:
            return gl.inline_asm_elementwise(I8_F16, "=r,h", [w], dtype=gl.float16, is_pure=True, pack=2)
        else:
            return gl.inline_asm_elementwise(I8_BF16, "=r,h", [w], dtype=gl.bfloat16, is_pure=True, pack=2)
    elif xdt == gl.float16:
        return gl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [w], dtype=gl.float16,
                                         is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise(F8_BF16, "=r,h", [w], dtype=gl.bfloat16, is_pure=True, pack=2)


@gluon.jit(do_not_specialize=["M"])
def _wo_wgmma_kernel(x_ptr, w_ptr, s_ptr, b_ptr, o_ptr, ws_ptr, cnt_ptr, M, N, K, s_xm, s_wn, s_om, K_PER_SPLIT,
                     W_INT8: gl.constexpr, HAS_SCALE: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                     PDL: gl.constexpr):
    NW: gl.constexpr = gl.num_warps()
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    A_W: gl.constexpr = gl.DotOperandLayout(0, ACC, 2)
    TPR: gl.constexpr = BLOCK_K // 16  # threads a weight row (16 bytes each)
    COPY_W: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPR, TPR], [NW, 1], [1, 0])
    XPR: gl.constexpr = BLOCK_K // 8  # threads an x row (8 elements each)
    COPY_X: gl.constexpr = gl.BlockedLayout([1, 8], [32 // XPR, XPR], [NW, 1], [1, 0])
    xdt: gl.constexpr = x_ptr.dtype.element_ty
    W_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    X_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    pid_n, pid_m, pid_k, n0, m0, k0, k_end = common.origin(K, K_PER_SPLIT, BLOCK_N, BLOCK_M)
    w_smem = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [STAGES, BLOCK_N, BLOCK_K], W_SMEM)
    x_smem = gl.allocate_shared_memory(xdt, [STAGES, BLOCK_M, BLOCK_K], X_SMEM)
    # The weights do not depend on the previous kernel: their first copies overlap its tail.
    for i in gl.static_range(STAGES - 1):
        issue(w_smem.index(i), w_ptr, n0, k0 + i * BLOCK_K, N, k_end, s_wn, BLOCK_N, BLOCK_K, COPY_W, 16, False)
    enter(PDL)
    for i in gl.static_range(STAGES - 1):
        issue(x_smem.index(i), x_ptr, m0, k0 + i * BLOCK_K, M, k_end, s_xm, BLOCK_M, BLOCK_K, COPY_X, 8, True)

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
    it = 0
    for k in range(k0, k_end, BLOCK_K):
        cp.wait_group(STAGES - 2)
        fence_async_shared()  # the copies of x are read by the tensor cores (the async proxy)
        gl.thread_barrier()
        nxt = (it + STAGES - 1) % STAGES
        ka = k + (STAGES - 1) * BLOCK_K
        issue(w_smem.index(nxt), w_ptr, n0, ka, N, k_end, s_wn, BLOCK_N, BLOCK_K, COPY_W, 16, False)
        issue(x_smem.index(nxt), x_ptr, m0, ka, M, k_end, s_xm, BLOCK_M, BLOCK_K, COPY_X, 8, True)
        cur = it % STAGES
        wf = _pair_operand(w_smem.index(cur).load(A_W), xdt, W_INT8)
        # synchronous: the other warpgroups of the SM convert while this one's MMA runs (an
        # asynchronous MMA keeps two fragments live: 167 registers, one program an SM, slower)
        acc = warpgroup_mma(wf, x_smem.index(cur).permute((1, 0)), acc)
        it += 1
    cp.wait_group(0)

    finish(acc, s_ptr, b_ptr, o_ptr, ws_ptr, cnt_ptr, M, N, s_om, n0, m0, pid_n, pid_m, pid_k, HAS_SCALE, HAS_BIAS,
           SPLIT, BLOCK_N, BLOCK_M, ACC)


MAX_M = 64  # one 64-token B operand
# One warpgroup of 64 output channels a program, four programs an SM; two warpgroups (128
# channels, two programs an SM) on the LM heads, whose many waves favour the longer tiles
# (H200, M=64: docs/dense.md, Decisions).
LONG_N = 65536
# (BLOCK_K, STAGES) by BLOCK_N, deepest first (wo_common.pipeline)
SHAPES = {64: ((128, 4), (128, 3), (128, 2)), 128: ((128, 3), (128, 2))}


def plan(M: int, N: int, K: int, sms: int, smem_per_sm: int = 228 * 1024, config=None) -> dict:
    """Tiles, stages and K splits of a call (``config``: the fields ``config_of`` fixed): 64-row x
    tiles, 64 output channels a program (128 on N >= LONG_N), about four programs an SM (two at
    128), the deepest of SHAPES that fits one wave."""
    bm = max(64, triton.next_power_of_2(M))
    bn = (config or {}).get("BLOCK_N") or (128 if N >= LONG_N else 64)
    cfg = {"BLOCK_N": bn, "per_sm": 4 if bn == 64 else 2, **(config or {})}
    tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
    bk, st, split = pipeline(SHAPES[bn], cfg, bn, bm, tiles, K, sms, smem_per_sm, cfg["per_sm"])
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=st, SPLIT=split)


def describe(M: int, N: int, K: int, device, config=None) -> str:
    return common.describe("Gluon wgmma", plan, M, N, K, device, config)


def linear(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None, *, config=None) -> torch.Tensor:
    """``config``: BLOCK_N, per_sm, BLOCK_K, STAGES (wo_common.CONFIG) fix those of the plan."""
    out, grid, args, consts, p = common.prepare(plan, x, w, bias, w_scale, config, MAX_M,
                                                "an sm90 GPU (warpgroup MMAs)", hopper, w_zero)
    if grid is not None:
        _wo_wgmma_kernel[grid](*args, **consts, num_warps=p["BLOCK_N"] // 16, **pdl.launch(x.device))
    return out
