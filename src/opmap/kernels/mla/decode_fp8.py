"""MLA decode on an fp8 (e4m3) latent cache, in Gluon, for sm89+ (DeepSeek's dims: R = 512, Dr = 64):
the ``mla-gluon-fp8`` backend's decode.

Why a third kernel: the Triton kernels convert each fp8 tile through shared memory (a read back,
the fp16 tile written, ldmatrix into the dots) and carry a [16 heads, 512] accumulator beside the
converted tile; at 16 heads they took 1.4x the bf16 time for half the bytes (docs/mla.md). Here each
tile crosses shared memory once each way, as in the GQA fp8 decode (attention/decode_fp8.py): 16-byte
async copies in, and every thread reads back exactly the bytes its tensor-core fragments hold,
converting them in registers.

- **Warps split the latent.** A program (sequence, 16-head block, split) walks 64-key tiles; warp w
  owns latent columns [128w, 128w + 128) and RoPE columns [16w, 16w + 16). Its output accumulator is
  O^T [128, 16 heads] (64 registers), a quarter of the program's, so no warp holds 512 columns.
- **Scores are summed across warps.** Warp w's dots give S^T [64 keys, 16 heads] over its 144
  columns (its q slice stays in registers: 36 of them); the four partials meet in shared memory
  (16 KB), and every warp reads all four back and adds them, so each has the whole tile's scores
  and runs the same online softmax: no other exchange, two barriers a tile.
- **One tile buffer for both dots.** The value dot O^T += V^T P^T reads the same latent bytes as
  the score dot, in its own fragment order (keys along K), as attention/decode_fp8's V: 16 bytes a
  key a thread, the latent columns permuted inside each warp's 128 and un-permuted at the store.
  The buffer's swizzle serves both reads without bank conflicts (``LAT_SMEM``).
- The cache scale multiplies the scores and the output (e4m3 -> fp16 is exact); q goes to fp16
  divided by the power of two its largest magnitude needs, as in the Triton kernels.

Split plan, workspace and merge are common.py's (one split writes the output, more write the
workspace for common._mla_merge_kernel); this backend's ``make_workspace`` plans for its 16-head
programs, two an SM. The tiles are fixed by the layouts, so ``config=`` takes no key. What the
backend declares (ops/mla/backends.py) the entry checks again on the tensors (``check_inputs``:
an InputError, never another kernel): dense decode of an fp8 cache at R = 512, Dr = 64 with 16-bit
queries, 16-byte aligned rows, a compiled sm89+ device.
"""
from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from opmap.core.contract import InputError, expect
from opmap.core.tiles import tile_config
from opmap.kernels.attention.common import interpreted
from opmap.kernels.attention.fp8_mma import A_K, B_P, B_Q, MMA, V_LOAD, row_col, vt_operand
from opmap.kernels.gluon_util import e4m3_to_f16, sm89_or_newer
from opmap.kernels.mla import common
from opmap.kernels.mla.common import Workspace, scale_args
from opmap.ops.mla.validate import check_decode

_split_range = gluon.jit(common._split_range.fn)  # the Triton kernels' split plan, the same source

NUM_WARPS = 4
BLOCK_H = 16  # heads a program
RANK, ROPE = 512, 64
NW = gl.constexpr(NUM_WARPS)
BH = gl.constexpr(BLOCK_H)
GW = gl.constexpr(RANK // NUM_WARPS)  # latent columns a warp
RW = gl.constexpr(ROPE // NUM_WARPS)  # RoPE columns a warp
R_ = gl.constexpr(RANK)

A_R = gl.constexpr(gl.DotOperandLayout(0, MMA.value, 4))  # the RoPE part: 16 columns, 4 bytes a thread
B_R = gl.constexpr(gl.DotOperandLayout(1, MMA.value, 4))
S2 = gl.constexpr(gl.SliceLayout(0, MMA.value))  # one warp's [keys, heads], the same in every warp
PART_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
ROPE_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]))
# Async copies: a thread takes one key's 16-byte chunk in each column group of the latent.
LAT_COPY = gl.constexpr(gl.BlockedLayout(size_per_thread=[NUM_WARPS, 1, 16], threads_per_warp=[1, 4, 8],
                                         warps_per_cta=[1, NUM_WARPS, 1], order=[2, 1, 0]))


BLOCK_N = 64  # keys a tile
BN = gl.constexpr(BLOCK_N)
# The latent tile [warp's column group, 64 keys, 128 columns]; row r's 16-byte chunk c sits at
# c ^ f(r), f(r) = 2 b1 ^ 4 (b0 ^ b2) (b = the bits of r): the score dot's reads (keys r, r + 1, 64
# bytes each) land in opposite halves of the banks, the value dot's (keys 0, 2, 4, 6, 32 bytes
# each) in four different quarters.
LAT_SMEM = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16], [0, 0, 32], [0, 0, 64],
    [0, 1, 64], [0, 2, 32], [0, 4, 64], [0, 8, 0], [0, 16, 0], [0, 32, 0], [1, 0, 0], [2, 0, 0]]))
# The RoPE part's async copies [group, keys, 16 bytes]: one key's bytes of two groups a thread.
ROPE_COPY = gl.constexpr(gl.BlockedLayout(size_per_thread=[2, 1, 16], threads_per_warp=[2, 16, 1],
                                          warps_per_cta=[1, NUM_WARPS, 1], order=[2, 1, 0]))
Q_COPY = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[1, 2, 16],
                                       warps_per_cta=[NUM_WARPS, 1, 1], order=[2, 1, 0]))
QP_COPY = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[1, 16, 2],
                                        warps_per_cta=[NUM_WARPS, 1, 1], order=[2, 1, 0]))
Q_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0]))
QP_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=2, order=[2, 1, 0]))


def check_inputs(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor) -> None:
    """What this kernel needs beyond the decode contract (validate.check_decode): an InputError
    naming the argument, before any launch."""
    expect(cache.dtype == torch.float8_e4m3fn, "cache", f"dtype {cache.dtype}",
           "float8_e4m3fn (the mla-gluon-fp8 backend; 16-bit caches: mla-tma or mla-triton)")
    expect(q_nope.dtype in (torch.float16, torch.bfloat16), "q_nope", f"dtype {q_nope.dtype}", "float16 or bfloat16")
    expect(q_nope.shape[2] == RANK and q_pe.shape[2] == ROPE and cache.shape[2] == RANK + ROPE, "cache",
           f"latent rank {q_nope.shape[2]}, RoPE dim {q_pe.shape[2]}", f"R = {RANK}, Dr = {ROPE} (the kernel's layouts)")
    expect(q_nope.stride(2) == 1 and q_pe.stride(2) == 1 and cache.stride(2) == 1 and cache.data_ptr() % 16 == 0
           and cache.stride(0) % 16 == 0 and cache.stride(1) % 16 == 0, "cache", f"strides {tuple(cache.stride())}",
           "16-byte aligned rows (16-byte async copies)")
    if interpreted(q_nope.device) or not sm89_or_newer(q_nope.device):
        raise InputError("q_nope", f"device {q_nope.device}"
                         + (" under TRITON_INTERPRET=1" if q_nope.device.type == "cuda" else ""),
                         "a compiled CUDA device of sm89 or newer (Gluon kernels do not run in the interpreter)")


def make_workspace(max_batch: int, num_heads: int, rank: int, device, *, num_splits: Optional[int] = None,
                   split_min: int = 256, config: Optional[dict] = None) -> Workspace:
    """Split-KV buffers for this kernel's decodes of up to ``max_batch`` sequences, the splits planned
    for its 16-head programs, two an SM (106 KB of shared memory each); ``config`` takes no key."""
    tile_config({}, config)
    s = num_splits or common.plan_splits(max_batch, num_heads, device, BLOCK_H, NUM_WARPS, 2)
    return common.workspace(max_batch, num_heads, rank, device, s, split_min)


def launch(q_nope, q_pe, cache, seq_lens, block_tables, scale_ptr, ks_value, from_ptr, scale, out, lse, po, pl,
           num_splits, split_min):
    """The kernel on inputs ``check_inputs`` accepted (its grid: head blocks, splits, batch)."""
    B, H, _ = q_nope.shape
    _mla_fp8_kernel[(-(-H // BLOCK_H), num_splits, B)](
        q_nope, q_pe, cache, seq_lens, block_tables, scale_ptr, out, lse, po, pl,
        float(scale), float(ks_value), H, block_tables.shape[1], cache.shape[0], split_min,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0), cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), po.stride(0), po.stride(1), po.stride(2),
        pl.stride(0), pl.stride(1),
        NUM_SPLITS=num_splits, PAGE=cache.shape[1], SCALE_FROM_PTR=from_ptr, num_warps=NUM_WARPS)


def mla_decode(q_nope, q_pe, cache, seq_lens, block_tables, *, scale: float, kv_scale=None,
               return_lse: bool = False, workspace: Optional[Workspace] = None, config=None):
    """The entry of decode.mla_decode's signature (dense decode of an fp8 cache)."""
    tile_config({}, config)
    check_decode(q_nope, q_pe, cache, seq_lens, block_tables, kv_scale, scale)
    check_inputs(q_nope, q_pe, cache)
    out, lse, workspace = common.decode_outputs(q_nope, workspace, make_workspace)
    if q_nope.shape[0] > 0:
        split_min = max(workspace.split_min, BLOCK_N)
        fp8, from_ptr, scale_ptr, ks_value = scale_args(cache, kv_scale, seq_lens)
        launch(q_nope, q_pe, cache, seq_lens, block_tables, scale_ptr, ks_value, from_ptr, scale, out, lse,
               workspace.part_o, workspace.part_lse, workspace.num_splits, split_min)
        common.merge(workspace, out, lse, seq_lens, 0, split_min, False)
    return (out, lse) if return_lse else out


@gluon.jit
def _q_load(q_row, h0, H, s_qh, COLS: gl.constexpr, LAYOUT: gl.constexpr):
    """q's columns as [warp's column group, heads, COLS] in fp32 (0 for heads past H)."""
    w = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, LAYOUT)))
    h = gl.arange(0, BH, layout=gl.SliceLayout(0, gl.SliceLayout(2, LAYOUT)))
    d = gl.arange(0, COLS, layout=gl.SliceLayout(0, gl.SliceLayout(1, LAYOUT)))
    ptr = q_row + (h0 + h)[None, :, None] * s_qh + (w * COLS)[:, None, None] + d[None, None, :]
    return gl.load(ptr, mask=((h0 + h) < H)[None, :, None], other=0.0).to(gl.float32)


@gluon.jit
def _finite_max(x):
    """The largest finite magnitude of x (3-D)."""
    a = gl.abs(x)
    return gl.max(gl.max(gl.max(gl.where(a < float("inf"), a, 0.0), 2), 1), 0)


@gluon.jit
def _rows(bt_row, start, end, MAXP, NPAGES, s_cp, s_cr, PAGE: gl.constexpr, LAYOUT: gl.constexpr):
    """Cache row offsets [keys] of the tile at ``start`` in LAYOUT's key slice, and which are valid
    (below ``end``, a page index inside the table, a page id inside the cache)."""
    j = start + gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, LAYOUT)))
    ok = (j < end) & (j // PAGE < MAXP)
    pg = gl.load(bt_row + j // PAGE, mask=ok, other=0)
    ok = ok & (pg >= 0) & (pg < NPAGES)
    return gl.multiple_of(pg.to(gl.int64) * s_cp + (j % PAGE).to(gl.int64) * s_cr, [16]), ok


@gluon.jit
def _issue(lat, rope, c_ptr, bt_row, start, end, MAXP, NPAGES, s_cp, s_cr, PAGE: gl.constexpr):
    """Async copies of the tile at ``start`` into one stage (latent and RoPE parts), then commit."""
    row, ok = _rows(bt_row, start, end, MAXP, NPAGES, s_cp, s_cr, PAGE, LAT_COPY)
    g = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, LAT_COPY)))
    d = gl.arange(0, GW, layout=gl.SliceLayout(0, gl.SliceLayout(1, LAT_COPY)))
    cp.async_copy_global_to_shared(lat, c_ptr + row[None, :, None] + (g * GW)[:, None, None] + d[None, None, :],
                                   mask=ok[None, :, None])
    row, ok = _rows(bt_row, start, end, MAXP, NPAGES, s_cp, s_cr, PAGE, ROPE_COPY)
    g = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, ROPE_COPY)))
    d = gl.arange(0, RW, layout=gl.SliceLayout(0, gl.SliceLayout(1, ROPE_COPY)))
    cp.async_copy_global_to_shared(rope, c_ptr + row[None, :, None] + (R_ + g * RW)[:, None, None] + d[None, None, :],
                                   mask=ok[None, :, None])
    cp.commit_group()


@gluon.jit
def _partial(lat, rope, part, c: gl.constexpr, qn0, qn1, qp):
    """Warp w's scores of keys [16c, 16c + 16) over its columns into ``part`` (rows [16w, 16w + 16))."""
    z = gl.zeros([NW, 16, BH], gl.float32, MMA)
    keys = lat.slice(16 * c, 16, dim=1)
    s = mma_v2(e4m3_to_f16(keys.slice(0, 64, dim=2).load(A_K)), qn0, z)
    s = mma_v2(e4m3_to_f16(keys.slice(64, 64, dim=2).load(A_K)), qn1, s)
    s = mma_v2(e4m3_to_f16(rope.slice(16 * c, 16, dim=1).load(A_R)), qp, s)
    part.reshape([NW, 16, BH]).store(s)


@gluon.jit
def _tile(lat, rope, part0, part1, part2, part3, start, end, qn_s, qp_s, m_i, l_i, acc, qk_scale):
    """One 64-key tile: each warp's partial scores over its columns (a buffer for each
    16 keys, so that their stores need no barrier between them), a barrier, the summed scores'
    online-softmax step (exp2 domain) in every warp, then O^T += V^T P^T on the warp's 128 latent
    columns, 16 keys at a time. ``l_i`` stays a [keys, heads] sum of lanes until the end. Warp w's
    q slice is read from shared memory for each tile: held across the tile, its 36 registers
    would cost the program count an SM holds."""
    qn_t = qn_s.permute([0, 2, 1])
    qn0 = qn_t.slice(0, 64, dim=1).load(B_Q)
    qn1 = qn_t.slice(64, 64, dim=1).load(B_Q)
    qp = qp_s.permute([0, 2, 1]).load(B_R)
    _partial(lat, rope, part0, 0, qn0, qn1, qp)
    _partial(lat, rope, part1, 1, qn0, qn1, qp)
    _partial(lat, rope, part2, 2, qn0, qn1, qp)
    _partial(lat, rope, part3, 3, qn0, qn1, qp)
    gl.thread_barrier()
    i = gl.arange(0, 16, layout=gl.SliceLayout(1, S2))
    s0 = _scores(part0, start, end, i, qk_scale)
    s1 = _scores(part1, start + 16, end, i, qk_scale)
    s2 = _scores(part2, start + 32, end, i, qk_scale)
    s3 = _scores(part3, start + 48, end, i, qk_scale)
    m_new = gl.maximum(m_i, gl.max(gl.maximum(gl.maximum(s0, s1), gl.maximum(s2, s3)), 0))
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # nothing attended yet
    alpha = gl.exp2(m_i - m_ref)
    acc = acc * gl.expand_dims(gl.expand_dims(alpha, 0), 0)
    l_i = l_i * alpha[None, :]
    l_i, acc = _values(lat, 0, s0, m_ref, l_i, acc)
    l_i, acc = _values(lat, 1, s1, m_ref, l_i, acc)
    l_i, acc = _values(lat, 2, s2, m_ref, l_i, acc)
    l_i, acc = _values(lat, 3, s3, m_ref, l_i, acc)
    return m_new, l_i, acc


@gluon.jit
def _scores(part, start, end, i, qk_scale):
    """16 keys from ``start``: the four warps' partial scores summed, scaled to the exp2 domain,
    -inf past ``end``; [keys, heads] in S2."""
    s = part.slice(0, 16, dim=0).load(S2)
    s += part.slice(16, 16, dim=0).load(S2)
    s += part.slice(32, 16, dim=0).load(S2)
    s += part.slice(48, 16, dim=0).load(S2)
    return gl.where((start + i < end)[:, None], s * qk_scale, float("-inf"))


@gluon.jit
def _values(lat, c: gl.constexpr, s, m_ref, l_i, acc):
    """The weights of keys [16c, 16c + 16) and their values into every warp's O^T."""
    p = gl.exp2(s - m_ref[None, :])
    l_i = l_i + p
    p3 = gl.expand_dims(p.to(gl.float16), 0) + gl.zeros([NW, 16, BH], gl.float16, MMA)  # the same in every warp
    vt = vt_operand(lat.slice(16 * c, 16, dim=1).load(V_LOAD))
    return l_i, mma_v2(vt, gl.convert_layout(p3, B_P), acc)


@gluon.jit
def _mla_fp8_kernel(qn_ptr, qp_ptr, c_ptr, sl_ptr, bt_ptr, ks_ptr, o_ptr, lse_ptr, po_ptr, pl_ptr,
                    sm_scale, kv_scale, H, MAXP, NPAGES, SPLIT_MIN,
                    s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cr, s_bt, s_ob, s_oh, s_pob, s_poh, s_pos, s_plb, s_plh,
                    NUM_SPLITS: gl.constexpr, PAGE: gl.constexpr, SCALE_FROM_PTR: gl.constexpr):
    hb = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    seq_len, used, start0, end = _split_range(sl_ptr, b, split, 0, SPLIT_MIN, NUM_SPLITS, BN, False)
    if split >= used:
        return
    lat_a = gl.allocate_shared_memory(gl.float8e4nv, [NW, BN, GW], LAT_SMEM)
    rope_a = gl.allocate_shared_memory(gl.float8e4nv, [NW, BN, RW], ROPE_SMEM)
    lat_b = gl.allocate_shared_memory(gl.float8e4nv, [NW, BN, GW], LAT_SMEM)
    rope_b = gl.allocate_shared_memory(gl.float8e4nv, [NW, BN, RW], ROPE_SMEM)
    # partial scores, [warp, 16 keys] rows, one buffer for each 16 keys of a tile
    part0 = gl.allocate_shared_memory(gl.float32, [NW * 16, BH], PART_SMEM)
    part1 = gl.allocate_shared_memory(gl.float32, [NW * 16, BH], PART_SMEM)
    part2 = gl.allocate_shared_memory(gl.float32, [NW * 16, BH], PART_SMEM)
    part3 = gl.allocate_shared_memory(gl.float32, [NW * 16, BH], PART_SMEM)
    bt_row = bt_ptr + b * s_bt
    # the first tile's copies go out before q is read: their latency covers q's
    _issue(lat_a, rope_a, c_ptr, bt_row, start0, end, MAXP, NPAGES, s_cp, s_cr, PAGE)
    h0 = hb * BH
    qn_row = qn_ptr + b * s_qnb
    qp_row = qp_ptr + b * s_qpb
    # q read once: its largest finite magnitude sets the power of two that brings it into fp16
    # (attention/fp8.f16_factor), and it is stored divided by that factor, in fp16
    qn = _q_load(qn_row, h0, H, s_qnh, GW, Q_COPY)
    qp = _q_load(qp_row, h0, H, s_qph, RW, QP_COPY)
    big = gl.maximum(_finite_max(qn), _finite_max(qp))
    qf = gl.exp2(gl.maximum(gl.ceil(gl.log2(gl.maximum(big, 1.0) / 32768.0)), 0.0))
    qn_s = gl.allocate_shared_memory(gl.float16, [NW, BH, GW], Q_SMEM)  # [column group, head, column]
    qp_s = gl.allocate_shared_memory(gl.float16, [NW, BH, RW], QP_SMEM)
    qn_s.store((qn / qf).to(gl.float16))
    qp_s.store((qp / qf).to(gl.float16))
    if SCALE_FROM_PTR:
        ks = gl.load(ks_ptr)
    else:
        ks = kv_scale
    qk_scale = sm_scale * ks * qf * 1.4426950408889634

    m_i = gl.full([BH], float("-inf"), gl.float32, gl.SliceLayout(0, S2))
    l_i = gl.zeros([16, BH], gl.float32, S2)
    acc = gl.zeros([NW, GW, BH], gl.float32, MMA)
    for start in range(start0, end, 2 * BN):
        # the tile at start is in (lat_a, rope_a); the next one goes into (lat_b, rope_b)
        cp.wait_group(0)
        gl.thread_barrier()
        _issue(lat_b, rope_b, c_ptr, bt_row, start + BN, end, MAXP, NPAGES, s_cp, s_cr, PAGE)
        m_i, l_i, acc = _tile(lat_a, rope_a, part0, part1, part2, part3, start, end, qn_s, qp_s, m_i, l_i, acc, qk_scale)
        cp.wait_group(0)
        gl.thread_barrier()
        _issue(lat_a, rope_a, c_ptr, bt_row, start + 2 * BN, end, MAXP, NPAGES, s_cp, s_cr, PAGE)
        if start + BN < end:
            m_i, l_i, acc = _tile(lat_b, rope_b, part0, part1, part2, part3, start + BN, end, qn_s, qp_s, m_i, l_i,
                                  acc, qk_scale)
    cp.wait_group(0)

    l_i = gl.sum(l_i, 0)
    pos = l_i != 0  # 0: nothing attended; NaN (a NaN score) stays NaN in the output and the LSE
    inv = gl.where(pos, ks / gl.where(pos, l_i, 1.0), 0.0)
    lse = gl.where(pos, (m_i + gl.log2(gl.where(pos, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o = acc * gl.expand_dims(gl.expand_dims(inv, 0), 0)
    w = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
    m = gl.arange(0, GW, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
    h = gl.arange(0, BH, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
    col = (w * GW)[:, None, None] + row_col(m)[None, :, None]
    head = (h0 + h)[None, None, :]
    ok = head < H
    hl = h0 + gl.arange(0, BH, layout=gl.SliceLayout(0, S2))
    if NUM_SPLITS == 1:
        gl.store(o_ptr + b * s_ob + head * s_oh + col, o.to(o_ptr.dtype.element_ty), mask=ok)
        gl.store(lse_ptr + b * H + hl, lse, mask=hl < H)
    else:
        gl.store(po_ptr + b * s_pob + head * s_poh + split * s_pos + col, o, mask=ok)
        gl.store(pl_ptr + b * s_plb + hl * s_plh + split, lse, mask=hl < H)
