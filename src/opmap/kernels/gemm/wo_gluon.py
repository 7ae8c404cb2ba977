"""Weight-only fp8 / int8 linear at decode sizes (M <= 32 on sm89+), in Gluon: backend ``gluon-wo``.

``linear(x[M, K], w[N, K] fp8-e4m3 or int8, bias, w_scale[N], *, config=None) -> [M, N]`` in
x.dtype, as ``triton_gemm.linear``. At small M the weight is the traffic, so the kernel is built to
keep weight bytes in flight and to touch each byte as few times as it can:

- out^T = W x^T: the weight tile is the MMA's A operand (16 output channels a fragment), x^T the
  B operand (the tokens, padded to 8), on ``mma.sync`` tensor cores (the MMA count is tiny).
- The weight tile crosses shared memory once each way: async copies (16 bytes a thread) in a
  pipeline of ``STAGES`` tiles, then each thread reads, 16 bytes at a time, exactly the bytes
  its A fragments hold (``k_width=16``: 16 consecutive K elements of a row, the same order for
  x) and converts them in registers. No dequantised copy exists anywhere.
- With bf16 activations the weight goes e4m3 -> fp16 (packed cvt) -> fp32 -> bf16 (packed), both
  exact; int8 through fp32 by the 2^23 magic number; fp16 activations take the weight as fp16.
  The per-output-channel scale multiplies the fp32 accumulator in the epilogue.
- The weight copies of the first stages go out before the PDL wait (weights do not depend on the
  previous kernel), so they overlap its tail; x is copied after it.
- Split K when the N tiles leave SMs idle; the last program of a tile (a counter) sums the
  partials in split order (deterministic) and runs the epilogue, as ``triton_gemm`` does.

Above M = 32 each warp re-reads the whole x tile from shared memory for its 16 rows: there
``gluon-wo-wgmma`` (wo_wgmma.py, sm90) or ``triton-wo`` serve (docs/dense.md, Decisions).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from opmap.kernels import pdl
from opmap.kernels.gemm import wo_common as common
from opmap.kernels.gemm.wo_common import finish, issue, operand, pipeline
from opmap.kernels.gluon_util import enter, sm89_or_newer

NUM_WARPS = 4
NW = gl.constexpr(NUM_WARPS)


@gluon.jit(do_not_specialize=["M"])
def _wo_kernel(x_ptr, w_ptr, s_ptr, b_ptr, o_ptr, ws_ptr, cnt_ptr, M, N, K, s_xm, s_wn, s_om, K_PER_SPLIT,
               W_INT8: gl.constexpr, HAS_SCALE: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
               PDL: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    A_W: gl.constexpr = gl.DotOperandLayout(0, MMA, 16)
    B_X: gl.constexpr = gl.DotOperandLayout(1, MMA, 16)
    TPR: gl.constexpr = BLOCK_K // 16  # threads a weight row (16 bytes each)
    COPY_W: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPR, TPR], [NW, 1], [1, 0])
    XPR: gl.constexpr = BLOCK_K // 8  # threads an x row (8 elements each)
    COPY_X: gl.constexpr = gl.BlockedLayout([1, 8], [32 // XPR, XPR], [NW, 1], [1, 0])
    # conflict-free 16-byte reads of the fragments: odd weight rows swap their 64-byte halves; x's
    # 16-byte chunks are XORed with the row
    W_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=64, per_phase=1, max_phase=2, order=[1, 0])
    X_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    xdt: gl.constexpr = x_ptr.dtype.element_ty

    pid_n, pid_m, pid_k, n0, m0, k0, k_end = common.origin(K, K_PER_SPLIT, BLOCK_N, BLOCK_M)
    w_smem = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [STAGES, BLOCK_N, BLOCK_K], W_SMEM)
    x_smem = gl.allocate_shared_memory(xdt, [STAGES, BLOCK_M, BLOCK_K], X_SMEM)
    # The weights do not depend on the previous kernel: their first copies overlap its tail.
    for i in gl.static_range(STAGES - 1):
        issue(w_smem.index(i), w_ptr, n0, k0 + i * BLOCK_K, N, k_end, s_wn, BLOCK_N, BLOCK_K, COPY_W, 16, False)
    enter(PDL)
    for i in gl.static_range(STAGES - 1):
        issue(x_smem.index(i), x_ptr, m0, k0 + i * BLOCK_K, M, k_end, s_xm, BLOCK_M, BLOCK_K, COPY_X, 8, True)

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    it = 0
    for k in range(k0, k_end, BLOCK_K):
        cp.wait_group(STAGES - 2)
        gl.thread_barrier()
        nxt = (it + STAGES - 1) % STAGES
        ka = k + (STAGES - 1) * BLOCK_K
        issue(w_smem.index(nxt), w_ptr, n0, ka, N, k_end, s_wn, BLOCK_N, BLOCK_K, COPY_W, 16, False)
        issue(x_smem.index(nxt), x_ptr, m0, ka, M, k_end, s_xm, BLOCK_M, BLOCK_K, COPY_X, 8, True)
        cur = it % STAGES
        wf = operand(w_smem.index(cur).load(A_W), xdt, W_INT8)
        xf = x_smem.index(cur).permute((1, 0)).load(B_X)
        acc = mma_v2(wf, xf, acc)
        it += 1
    cp.wait_group(0)

    finish(acc, s_ptr, b_ptr, o_ptr, ws_ptr, cnt_ptr, M, N, s_om, n0, m0, pid_n, pid_m, pid_k, HAS_SCALE, HAS_BIAS,
           SPLIT, BLOCK_N, BLOCK_M, MMA)


MAX_M = 32  # mma.sync; above it each warp re-reads a 64-row x tile from shared memory
DEFAULTS = {"BLOCK_N": 64, "per_sm": 4}
# (BLOCK_K, STAGES) in order of preference: the deepest pipeline whose programs all fit on the GPU
# at once (one wave), else the first (many waves: the LM heads).
SHAPES = ((256, 3), (256, 2), (128, 3), (128, 2))


def plan(M: int, N: int, K: int, sms: int, smem_per_sm: int = 228 * 1024, config=None) -> dict:
    """Tiles, stages and K splits of a call (``config``: the fields ``config_of`` fixed). The weight
    tile is BLOCK_N x BLOCK_K bytes (x's, BLOCK_M x BLOCK_K elements, rides in the same stage);
    wo_common.pipeline picks BLOCK_K, STAGES and the split (measured on the H200: docs/dense.md)."""
    bm = max(8, triton.next_power_of_2(M))
    cfg = {**DEFAULTS, **(config or {})}
    bn = cfg["BLOCK_N"]
    tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
    bk, st, split = pipeline(SHAPES, cfg, bn, bm, tiles, K, sms, smem_per_sm, cfg["per_sm"])
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=st, SPLIT=split)


def describe(M: int, N: int, K: int, device, config=None) -> str:
    return common.describe("Gluon mma.sync", plan, M, N, K, device, config)


def linear(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None, *, config=None) -> torch.Tensor:
    """``config``: BLOCK_N, per_sm, BLOCK_K, STAGES (wo_common.CONFIG) fix those of the plan."""
    out, grid, args, consts, p = common.prepare(plan, x, w, bias, w_scale, config, MAX_M, "an sm89+ GPU", sm89_or_newer,
                                                w_zero)
    if grid is not None:
        _wo_kernel[grid](*args, **consts, num_warps=NUM_WARPS, **pdl.launch(x.device))
    return out
