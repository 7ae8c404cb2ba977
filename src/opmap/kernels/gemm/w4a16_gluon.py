"""int4 weight-only (W4A16) linear at decode sizes in Gluon on mma.sync: backend ``gluon-w4a16``.

``linear(x[M, K], w[N, K // 8] int32, bias=None, w_scale[N, K // G], w_zero=None, *, config=None)``
-> [M, N] in x.dtype, the weight in the layout of ``opmap.ops.gemm.quant`` (eight 4-bit codes a
word along K, a scale per group of G input channels, uint8 zero codes or the symmetric 8); M <= 16,
bf16 / fp16 x, G a multiple of 128.

At decode M the packed weight is the traffic: the kernel is built to keep weight bytes in flight and
to convert each word once, in the thread that feeds it to the MMA (the Triton kernel, w4a16.py,
passes the converted tile through shared memory on its way to the MMA):
- out^T = W x^T: the weight is mma.sync's A operand (16 output channels a fragment), x^T the B
  operand (the tokens, padded to 8 or 16).
- The packed words go from global memory straight into registers in the A fragment's own layout:
  ``DotOperandLayout(0, MMA, 2)`` over the int32 words gives each thread two consecutive words, the
  16 consecutive codes of one of its fragment chunks (``DotOperandLayout(0, MMA, 16)`` over the
  codes). Each word becomes its eight 16-bit values in place (nibbles.py's LOP3 magic number), so
  the converted tile already is the fragment: no shared memory, no barrier, no layout conversion
  (the sm90 compile test checks that the build has no shared memory).
- A K tile is 128 codes inside one group: its fp32 product times the group's scale joins the
  accumulator, as the Triton kernel does (the codes reach the MMA exactly).
- At 8 rows every load runs ahead of its use: the weight words two K tiles ahead (each warp keeps
  two tiles of weight in flight while it converts a third), x, the scales and the zeros one tile
  ahead. At 16 rows the weight words run one tile ahead. The first weight load goes out before the
  PDL wait (the weight does not depend on the previous kernel).
- x is read as the B fragment straight from global memory (every program of a K range reads the
  same few hundred bytes: cache hits).
- Split K when the N tiles leave SMs idle; the family's counters sum the partials in split order.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from opmap.core.contract import expect
from opmap.core.tiles import tile_config
from opmap.kernels import pdl
from opmap.kernels.gemm import wo_common
from opmap.kernels.gemm.nibbles import ASM_BF16, ASM_F16
from opmap.kernels.gluon_util import enter, sm_figures
from opmap.ops.gemm.quant import INT4_SYM_ZERO
from opmap.ops.gemm.validate import check_linear

BLOCK_K = 128  # codes a K tile: four threads x two words x two chunks of the A fragment
MAX_M = 16


@gluon.jit
def _codes(words, zero, DT: gl.constexpr):
    """int32 words [R, W] (and their zero codes, broadcast to them) -> [R, 8 W] in DT: code - zero,
    exact, each word's eight codes in K order in the same thread."""
    if DT == gl.bfloat16:
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, zero], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, zero], dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    # a last dim of 8 in code order: the joins interleave evens and odds twice over
    p = gl.join(gl.join(o0, o4), gl.join(o2, o6))
    q = gl.join(gl.join(o1, o5), gl.join(o3, o7))
    return gl.reshape(gl.join(p, q), [words.shape[0], words.shape[1] * 8])


@gluon.jit
def _group(s_ptrs, z_ptrs, g, s_ok, z_ok, HAS_ZERO: gl.constexpr, SYM_ZERO: gl.constexpr, BLOCK_N: gl.constexpr,
           A_WORDS: gl.constexpr):
    """Group ``g``'s scales (fp32, [BLOCK_N] in the accumulator's rows) and zero codes (int32,
    [BLOCK_N, 1] in the words' rows)."""
    s = gl.load(s_ptrs + g, mask=s_ok, other=0.0).to(gl.float32)
    if HAS_ZERO:
        z = gl.load(z_ptrs + g, mask=z_ok, other=0).to(gl.int32)[:, None]
    else:
        z = gl.full([BLOCK_N, 1], SYM_ZERO, gl.int32, A_WORDS)
    return s, z


@gluon.jit
def _tile(acc, w, z, xt, s, A: gl.constexpr, MMA: gl.constexpr):
    """acc + the K tile's product (its words ``w`` with their zero codes ``z``, x's B fragment ``xt``)
    times its group scales ``s``."""
    a = gl.convert_layout(_codes(w, gl.broadcast(z, w)[0], xt.dtype), A)  # the same layout: no data moves
    part = mma_v2(a, xt, gl.zeros(acc.shape, gl.float32, MMA))
    return acc + part * s[:, None]


# M stays a runtime int (a call of one row would make it a constant): the split-K tail takes it as a tensor
@gluon.jit(do_not_specialize=["M"])
def _w4a16_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, o_ptr, ws_ptr, cnt_ptr, M, N, K, s_xm, s_wn, s_sn, s_om,
                      K_PER_SPLIT, G: gl.constexpr, HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr,
                      SPLIT: gl.constexpr, SYM_ZERO: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      WARPS: gl.constexpr, PDL: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    A_WORDS: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    A: gl.constexpr = gl.DotOperandLayout(0, MMA, 16)
    B_X: gl.constexpr = gl.DotOperandLayout(1, MMA, 16)
    BK: gl.constexpr = 128
    WORDS: gl.constexpr = BK // 8

    pid_n, pid_m, pid_k, n0, m0, k0, k_end = wo_common.origin(K, K_PER_SPLIT, BLOCK_N, BLOCK_M)

    rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, A_WORDS))
    rw = gl.arange(0, WORDS, layout=gl.SliceLayout(0, A_WORDS))
    n_ok = (rn < N)[:, None]
    w_ptrs = w_ptr + rn.to(gl.int64)[:, None] * s_wn + (k0 // 8 + rw)[None, :]
    sn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    s_ptrs = s_ptr + sn.to(gl.int64) * s_sn
    z_ptrs = z_ptr + rn.to(gl.int64) * s_sn
    rk = gl.arange(0, BK, layout=gl.SliceLayout(1, B_X))
    rm = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, B_X))
    x_ptrs = x_ptr + rm.to(gl.int64)[None, :] * s_xm + (k0 + rk)[:, None]
    m_ok = (rm < M)[None, :]

    # K is a whole number of tiles (G divides K, BK divides G), and so is K_PER_SPLIT: no K mask inside
    # a split. The weight does not depend on the previous kernel: its first load goes out before the
    # PDL wait.
    w0 = gl.load(w_ptrs, mask=n_ok, other=0)
    enter(PDL)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    if BLOCK_M == 8:
        # Every load runs ahead of its use: the weight words two tiles (DRAM latency), x and the
        # group's scale and zero one tile (a row's first scale is a DRAM read too)
        w1 = gl.load(w_ptrs + WORDS, mask=n_ok & (k0 + BK < k_end), other=0)
        xt = gl.load(x_ptrs, mask=m_ok, other=0.0)
        s, z = _group(s_ptrs, z_ptrs, k0 // G, sn < N, rn < N, HAS_ZERO, SYM_ZERO, BLOCK_N, A_WORDS)
        for k in range(k0, k_end, BK):
            more = k + BK < k_end
            w2 = gl.load(w_ptrs + 2 * WORDS, mask=n_ok & (k + 2 * BK < k_end), other=0)
            x_next = gl.load(x_ptrs + BK, mask=m_ok & more, other=0.0)
            s_next, z_next = _group(s_ptrs, z_ptrs, (k + BK) // G, (sn < N) & more, (rn < N) & more, HAS_ZERO,
                                    SYM_ZERO, BLOCK_N, A_WORDS)
            acc = _tile(acc, w0, z, xt, s, A, MMA)
            w0 = w1
            w1 = w2
            xt = x_next
            s = s_next
            z = z_next
            w_ptrs += WORDS
            x_ptrs += BK
    else:
        # 16 rows: the x tile and the accumulator take twice the registers, and loads that far
        # ahead cost more occupancy than they hide (docs/dense.md, Decisions): the weight words one
        # tile ahead, x and the group's scale and zero in their own iteration
        for k in range(k0, k_end, BK):
            w1 = gl.load(w_ptrs + WORDS, mask=n_ok & (k + BK < k_end), other=0)
            xt = gl.load(x_ptrs, mask=m_ok, other=0.0)
            s, z = _group(s_ptrs, z_ptrs, k // G, sn < N, rn < N, HAS_ZERO, SYM_ZERO, BLOCK_N, A_WORDS)
            acc = _tile(acc, w0, z, xt, s, A, MMA)
            w0 = w1
            w_ptrs += WORDS
            x_ptrs += BK
    wo_common.finish(acc, s_ptr, b_ptr, o_ptr, ws_ptr, cnt_ptr, M, N, s_om, n0, m0, pid_n, pid_m, pid_k, False,
                     HAS_BIAS, SPLIT, BLOCK_N, BLOCK_M, MMA)


# config= keys (0: the plan's choice): output channels a program (16 a warp, up to four warps; 128 gives
# each warp two fragments of rows) and the programs an SM that K splits aim for
CONFIG = {"BLOCK_N": 0, "per_sm": 0}
DEFAULTS = {"BLOCK_N": 64, "per_sm": 4}


def config_of(config) -> dict:
    if config is None:
        return dict(DEFAULTS)
    cfg = tile_config(CONFIG, config)
    expect(cfg["BLOCK_N"] in (0, 32, 64, 128), "config", f"BLOCK_N={cfg['BLOCK_N']}", "32, 64 or 128")  # 0: the plan's
    expect(0 <= cfg["per_sm"] <= 16, "config", f"per_sm={cfg['per_sm']}", "0 (planned) to 16")
    return {k: cfg[k] or DEFAULTS[k] for k in DEFAULTS}


def plan(M: int, N: int, K: int, sms: int, config=None) -> dict:
    """Tiles and K splits of a call: BLOCK_M 8 or 16, BLOCK_N 64 on four warps; K split until the
    programs number about ``per_sm`` an SM, each split keeping >= 4 K tiles."""
    return _plan(M, N, K, sms, config_of(config))


def _plan(M: int, N: int, K: int, sms: int, cfg: dict) -> dict:
    """``plan`` of a ``config_of``-checked ``cfg`` (the launcher checks its config once)."""
    bn = cfg["BLOCK_N"]
    bm = 8 if M <= 8 else 16
    tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
    split = max(1, min(cfg["per_sm"] * sms // tiles, K // BLOCK_K // 4))
    per = triton.cdiv(K // BLOCK_K, split) * BLOCK_K
    return dict(BLOCK_M=bm, BLOCK_N=bn, WARPS=min(4, bn // 16), K_PER_SPLIT=per, SPLIT=triton.cdiv(K, per))


def describe(M: int, N: int, K: int, device, config=None) -> str:
    p = plan(M, N, K, sm_figures(torch.device(device))[0], config)
    return (f"Gluon mma.sync, weight fragments from global memory: BLOCK_N {p['BLOCK_N']}, BLOCK_M {p['BLOCK_M']}, "
            f"BLOCK_K {BLOCK_K}, {p['SPLIT']} K split{'s' if p['SPLIT'] > 1 else ''}, {p['WARPS']} warps")


def linear(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None, *, config=None) -> torch.Tensor:
    """``config``: BLOCK_N and per_sm (CONFIG) fix those of the plan."""
    expect(isinstance(w, torch.Tensor) and w.dtype == torch.int32, "w",
           f"dtype {w.dtype}" if isinstance(w, torch.Tensor) else type(w).__name__,
           "int32 words of eight 4-bit codes (W4A16)")
    M, N, K = check_linear(x, w, bias, w_scale, w_zero, int4=True)
    expect(x.dtype in (torch.bfloat16, torch.float16), "x", f"dtype {x.dtype}", "bf16 or fp16")
    expect(M <= MAX_M, "x", f"{M} rows", f"at most {MAX_M} rows (triton-w4a16 serves any M)")
    G = K // w_scale.shape[1] if K else BLOCK_K
    expect(G % BLOCK_K == 0, "w_scale", f"shape {tuple(w_scale.shape)} (group size {G})",
           f"a group size that is a multiple of {BLOCK_K} (a K tile inside one group; triton-w4a16 takes 16)")
    expect(w.stride(0) % 2 == 0 and w.data_ptr() % 8 == 0, "w", f"row stride {w.stride(0)}, address {w.data_ptr()}",
           "rows 8-byte aligned (two words a load)")
    expect(x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0, "x", f"row stride {x.stride(0)}, address {x.data_ptr()}",
           "rows 16-byte aligned (row stride a multiple of 8, address of 16)")
    on_gpu = x.device.type == "cuda" and not wo_common.INTERPRETED
    expect(on_gpu, "x", f"device {x.device}{' under TRITON_INTERPRET=1' if wo_common.INTERPRETED else ''}",
           "a CUDA tensor, compiled (Gluon kernels do not run in the Triton interpreter)")
    cfg = config_of(config)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if wo_common.nothing_to_multiply(M, N, K, bias, out):
        return out
    p = _plan(M, N, K, sm_figures(x.device)[0], cfg)
    k_per_split, split, grid, ws, cnt = wo_common.geometry(M, N, K, dict(p, BLOCK_K=BLOCK_K), out)
    _w4a16_mma_kernel[grid](
        x, w, w_scale, w_zero if w_zero is not None else w_scale, bias if bias is not None else out, out, ws, cnt,
        M, N, K, x.stride(0), w.stride(0), w_scale.stride(0), out.stride(0), k_per_split, G=G,
        HAS_ZERO=w_zero is not None, HAS_BIAS=bias is not None, SPLIT=split, SYM_ZERO=INT4_SYM_ZERO,
        BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], WARPS=p["WARPS"], num_warps=p["WARPS"],
        **pdl.launch(x.device))
    return out
