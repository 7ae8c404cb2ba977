"""Weight-only fp8 / int8 linear at decode sizes (M <= 32 on sm89+, M <= 64 on sm90), in Gluon.

``linear(x[M, K], w[N, K] fp8-e4m3 or int8, bias, w_scale[N]) -> [M, N]`` in x.dtype, as
``triton_gemm.linear``. At M <= 64 the weight is the traffic, so the kernel is built to keep
weight bytes in flight and to touch each byte as few times as it can:

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

At 32 < M <= 64 on sm90 the tokens are too many for mma.sync; wo_wgmma.py's kernel runs instead
(warpgroup MMAs, the same pipeline). This module plans and launches both.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from opmap.core.contract import expect
from opmap.kernels.gluon_util import enter, hopper, sm89_or_newer, sm_figures
from opmap.kernels.gemm.wo_common import finish, issue, operand
from opmap.kernels.gemm.wo_wgmma import _wo_wgmma_kernel

NUM_WARPS = 4
NW = gl.constexpr(NUM_WARPS)


def usable(x: torch.Tensor, w: torch.Tensor, interpreted: bool) -> bool:
    """fp8 / int8 weights, bf16 / fp16 activations, M <= MAX_M (WGMMA_MAX_M on sm90), rows 16-byte
    aligned, sm89+."""
    if w.dtype not in (torch.float8_e4m3fn, torch.int8) or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    M, K = x.shape
    if K % 16 or w.stride(0) % 16 or x.stride(0) % 8 or w.data_ptr() % 16 or x.data_ptr() % 16:
        return False
    return takes(M, x.device, interpreted)


def takes(M: int, device: torch.device, interpreted: bool) -> bool:
    """Whether a weight-only call of M rows on ``device`` runs here (its tensors permitting)."""
    if interpreted or not sm89_or_newer(device):
        return False
    return M <= MAX_M or (M <= WGMMA_MAX_M and hopper(device))


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

    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    n0 = pid_n * BLOCK_N
    m0 = pid_m * BLOCK_M
    k0 = pid_k * K_PER_SPLIT
    k_end = gl.minimum(k0 + K_PER_SPLIT, K)
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
WGMMA_MAX_M = 64
DEFAULTS = {"BLOCK_N": 64, "per_sm": 4}
# wgmma: one warpgroup of 64 output channels a program, four programs an SM; two warpgroups (128
# channels, two programs an SM) on the LM heads, whose many waves favour the longer tiles
# (H200, M=64: docs/dense.md, Decisions).
WGMMA_LONG_N = 65536
# (BLOCK_K, STAGES) in order of preference: the deepest pipeline whose programs all fit on the GPU
# at once (one wave), else the first (many waves: the LM heads).
SHAPES = ((256, 3), (256, 2), (128, 3), (128, 2))
WGMMA_SHAPES = {64: ((128, 4), (128, 3), (128, 2)), 128: ((128, 3), (128, 2))}


def config_of(config) -> dict | None:
    """The tuning dict of a call (BLOCK_N, per_sm, BLOCK_K, STAGES; GLUON: 0 for the Triton kernel),
    checked; None when the call asks for the Triton kernel."""
    from opmap.core.tiles import tile_config

    if config is None:
        return {}  # plan()'s defaults: no checks on the path of every call
    cfg = tile_config({"BLOCK_N": 0, "per_sm": 0, "BLOCK_K": 0, "STAGES": 0, "GLUON": 1}, config)
    if not cfg.pop("GLUON"):
        return None
    expect(cfg["STAGES"] in (0, 2, 3, 4), "config", f"STAGES={cfg['STAGES']}", "2, 3 or 4")
    expect(cfg["BLOCK_K"] in (0, 64, 128, 256), "config", f"BLOCK_K={cfg['BLOCK_K']}", "64, 128 or 256")
    expect(cfg["BLOCK_N"] in (0, 64, 128), "config", f"BLOCK_N={cfg['BLOCK_N']}", "64 or 128")
    expect(cfg["per_sm"] >= 0, "config", f"per_sm={cfg['per_sm']}", ">= 1")
    return {k: v for k, v in cfg.items() if v}


def plan(M: int, N: int, K: int, sms: int, smem_per_sm: int = 228 * 1024, config=None,
         wgmma: bool = False) -> dict:
    """Tiles, stages and K splits of a call. The weight tile is BLOCK_N x BLOCK_K bytes (x's,
    BLOCK_M x BLOCK_K elements, rides in the same stage); K is split until the programs number
    about ``per_sm`` an SM, each split keeping >= 4 tiles of K. BLOCK_K and STAGES: the first of
    SHAPES whose programs fit on the GPU in one wave (measured on the H200: a second wave of a few
    programs cost more than a shallower pipeline, docs/dense.md), unless ``config`` fixes them.
    ``wgmma``: the plan of the sm90 kernel for M > MAX_M (WGMMA: True in the result)."""
    wgmma = wgmma and M > MAX_M
    bm = max(64 if wgmma else 8, triton.next_power_of_2(M))
    if wgmma:
        bn = (config or {}).get("BLOCK_N") or (128 if N >= WGMMA_LONG_N else 64)
        cfg = {"BLOCK_N": bn, "per_sm": 4 if bn == 64 else 2, **(config or {})}
    else:
        cfg = {**DEFAULTS, **(config or {})}
        bn = cfg["BLOCK_N"]
    tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
    shapes = [(bk, st) for bk, st in (WGMMA_SHAPES[bn] if wgmma else SHAPES)
              if cfg.get("BLOCK_K", bk) == bk and cfg.get("STAGES", st) == st] or [(cfg.get("BLOCK_K", 256),
                                                                                      cfg.get("STAGES", 3))]
    choice = None
    for bk, st in shapes:
        split = max(1, min(cfg["per_sm"] * sms // tiles, triton.cdiv(K, bk) // 4))
        smem = st * bk * (bn + 2 * bm) + 1024  # the weight and x stages, and what the SM keeps a program
        fits = (smem_per_sm // smem) * sms >= tiles * split
        if choice is None or fits:
            choice = (bk, st, split)
        if fits:
            break
    bk, st, split = choice
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=st, SPLIT=split, WGMMA=wgmma)


def describe(M: int, N: int, K: int, device, config=None) -> str:
    dev = torch.device(device)
    p = plan(M, N, K, *sm_figures(dev), config=config, wgmma=hopper(dev))
    return (f"Gluon{' wgmma' if p['WGMMA'] else ''}: BLOCK_N {p['BLOCK_N']}, BLOCK_M {p['BLOCK_M']}, "
            f"BLOCK_K {p['BLOCK_K']}, {p['STAGES']} stages, {p['SPLIT']} K split{'s' if p['SPLIT'] > 1 else ''}")


def launch(x, w, bias, w_scale, out, *, counters, pdl_args, config=None):
    M, K = x.shape
    N = w.shape[0]
    p = plan(M, N, K, *sm_figures(x.device), config=config, wgmma=hopper(x.device))
    bk = p["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(K, bk), p["SPLIT"]) * bk
    split = triton.cdiv(K, k_per_split)
    grid = (triton.cdiv(N, p["BLOCK_N"]), triton.cdiv(M, p["BLOCK_M"]), split)
    if split > 1:
        ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        cnt = counters(grid[0] * grid[1], x.device)
    else:
        ws = cnt = out
    kernel, warps = (_wo_wgmma_kernel, p["BLOCK_N"] // 16) if p["WGMMA"] else (_wo_kernel, NUM_WARPS)
    kernel[grid](x, w, w_scale, bias if bias is not None else out, out, ws, cnt, M, N, K, x.stride(0), w.stride(0),
                 out.stride(0), k_per_split, W_INT8=w.dtype == torch.int8, HAS_SCALE=w_scale is not None,
                 HAS_BIAS=bias is not None, SPLIT=split, BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_K=bk,
                 STAGES=p["STAGES"], num_warps=warps, **pdl_args)
