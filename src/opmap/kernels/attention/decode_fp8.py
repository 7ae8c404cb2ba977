"""Paged decode on an fp8 (e4m3) KV cache, in Gluon (Triton's explicit-layout dialect), for sm89+:
the ``gluon-fp8`` backend's decode, at head dim 128 with 16-bit queries.

Why a second kernel: the Triton decode (decode.py, the ``triton`` backend) moves each fp8 tile
through shared memory four times (the copy in, a read back, the fp16 tile written after
conversion, ldmatrix into the dots), about 6 bytes of L1 traffic per byte of DRAM, and is bound by
that pipe at half the DRAM rate (docs/attention.md). Here each tile crosses shared memory once
each way, as bf16's does: the async copy writes the e4m3 bytes, and every thread reads back, 16
bytes at a time, exactly the bytes its tensor-core fragments hold, converting them in registers.

- **Warps are independent.** A program (sequence, KV head, split) walks 64-key tiles; warp w takes
  keys [16w, 16w + 16) of each tile with its own running max, sum and accumulator (a batched 3-D
  MMA layout, one batch per warp), so nothing crosses warps until the end, when the four states
  merge by their maxima.
- **Scores as S^T = K q^T, the output as O^T = V^T P^T.** S^T [16 keys, 8 heads (16 above 8)] has
  K as its A operand and q^T as its B operand; its accumulator moves (within each warp) into P^T's
  B operand [keys, heads], so the output accumulator is [head dim, 8 heads], a quarter of a [16
  padded heads, 128] one: 123 registers, four programs an SM.
- **K is read in the MMA's order.** With ``k_width=16`` (the same for q), thread t of a quad holds
  head-dim elements 16t..16t+15 of a key: contiguous bytes, one 128-bit shared load a fragment. The
  dot's sum is over the same pairs in either order.
- **V's head dim is permuted.** An A-operand thread holds rows m = g + 8h + 16i of V^T for four
  keys; giving row m the head-dim element 16g + 2i + h makes them 16 contiguous bytes per key. The
  loaded tile is relabelled (reshape and permute: register moves only) into the operand, and the
  output is stored through the same permutation (fp8_mma.py, shared with the MLA fp8 decode).
- **Two stages, one barrier a tile.** The tiles alternate between two buffers (separate
  allocations, so that Triton's barrier pass sees that the copy into one and the reads of the other
  do not overlap); the barrier after each wait orders both the copy's data and the buffer's reuse.
- Shared-memory swizzles make both reads conflict-free (K: 64-byte halves swapped on odd rows;
  V: 16-byte chunks XORed with the row).

Scales, the split plan, soft cap, window, mixed batches, the workspace and the merge of partials
are those of the Triton decode (splitkv.py); the tiles are fixed by the layouts, so ``config=``
takes no key. What the backend declares (ops/attention/backends.py) the launcher checks again on
the tensors (an InputError, never another kernel): an fp8 cache with 16-bit queries at head dim
128, at most 16 query heads per KV head, 16-byte aligned cache rows, a compiled sm89+ device.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from opmap.core.contract import InputError, expect
from opmap.core.tiles import tile_config
from opmap.kernels import pdl
from opmap.kernels.attention import splitkv, tiles
from opmap.kernels.attention.common import check_attention, interpreted, prepare_scales
from opmap.kernels.attention.fp8_mma import (A_K, B_P, B_Q, HD, KEYS_PER_WARP, KW, MMA, NUM_WARPS, NW, V_LOAD,
                                             row_col, vt_operand)
from opmap.kernels.gluon_util import e4m3_to_f16, enter, sm89_or_newer

_plan = gluon.jit(tiles._plan.fn)  # the split plan of decode._decode_kernel, the same source

BLOCK_N = NUM_WARPS * KEYS_PER_WARP
HEAD_DIM = 128
MAX_GROUP = 16  # query heads per KV head: one 16-row tile of them
MAX_REGISTERS = 128  # four programs of 128 threads an SM, for groups of up to 8 heads (16 would spill)

# The async copy: 16 bytes a thread, 8 threads a 128-byte row, each warp its own 16 keys.
COPY = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 16], threads_per_warp=[1, 4, 8],
                                     warps_per_cta=[NUM_WARPS, 1, 1], order=[2, 1, 0]))
Q_ROWS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[NUM_WARPS, 1],
                                       order=[1, 0]))
K_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=64, per_phase=1, max_phase=2, order=[2, 1, 0]))
V_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[2, 1, 0]))
BN = gl.constexpr(BLOCK_N)


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """What this kernel needs beyond the common attention contract (common.check_attention): an
    InputError naming the argument, before any launch."""
    expect(k_cache.dtype == torch.float8_e4m3fn, "k_cache", f"dtype {k_cache.dtype}",
           "float8_e4m3fn (the gluon-fp8 backend decodes fp8 caches; 16-bit ones: the triton backend)")
    expect(q.dtype in (torch.float16, torch.bfloat16), "q", f"dtype {q.dtype}", "float16 or bfloat16")
    expect(q.shape[-1] == HEAD_DIM and v_cache.shape[-1] == HEAD_DIM, "q", f"head dims {q.shape[-1]} / "
           f"{v_cache.shape[-1]}", f"{HEAD_DIM} (K and V: the kernel's layouts)")
    group = q.shape[1] // k_cache.shape[2]
    expect(group <= MAX_GROUP, "q", f"{group} query heads per KV head", f"at most {MAX_GROUP}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        expect(c.data_ptr() % 16 == 0 and c.stride(3) == 1 and not any(st % 16 for st in c.stride()[:3]), name,
               f"strides {tuple(c.stride())}", "16-byte aligned rows (16-byte async copies)")
    if interpreted(q.device) or not sm89_or_newer(q.device):
        raise InputError("q", f"device {q.device}" + (" under TRITON_INTERPRET=1" if q.device.type == "cuda" else ""),
                         "a compiled CUDA device of sm89 or newer (Gluon kernels do not run in the interpreter)")


def launch_decode(q, k_cache, v_cache, seq_lens, block_tables, out, lse, *, scale, window, soft_cap, k_scale,
                  v_scale, return_lse, workspace=None, cu_seqlens_q=None):
    """Launch on inputs ``check_inputs`` accepted, with the Triton decode's grid (B, Hk, splits),
    plan and merge (splitkv.py); ``cu_seqlens_q`` as in decode.launch_decode (mixed batches)."""
    B, hq, hk = seq_lens.shape[0], q.shape[1], k_cache.shape[2]
    if B == 0:
        return
    group = hq // hk
    p = splitkv.plan(workspace, out, B, hq, v_cache.shape[3], hk, k_cache.shape[1], block_tables, q.device)
    ks, vs = prepare_scales(k_cache, k_scale, v_scale)
    cu = cu_seqlens_q if cu_seqlens_q is not None else seq_lens
    cap = {"maxnreg": MAX_REGISTERS} if group <= 8 else {}
    _fp8_decode_kernel[(B, hk, p.splits)](
        q, k_cache, v_cache, out, lse, p.po, p.pl, seq_lens, block_tables, ks, vs, cu,
        float(scale), float(soft_cap or 1.0), int(window or 0), p.split_tokens, p.splits, p.min_chunk,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), p.po.stride(0), p.po.stride(1), p.po.stride(2), p.pl.stride(0), p.pl.stride(1),
        GROUP=group, PAGE=k_cache.shape[1], BLOCK_H=8 if group <= 8 else 16, HAS_WINDOW=window is not None,
        HAS_CAP=soft_cap is not None, RETURN_LSE=return_lse, Q_FROM_CU=cu_seqlens_q is not None,
        num_warps=NUM_WARPS, **cap, **pdl.launch(q.device))
    splitkv.combine(p, out, lse, seq_lens, cu, window=window, block_n=BLOCK_N, return_lse=return_lse,
                    q_from_cu=cu_seqlens_q is not None)


def decode(q, k_cache, v_cache, seq_lens, block_tables, *, scale: float, window=None, soft_cap=None,
           k_scale=None, v_scale=None, return_lse: bool = False, workspace=None, config=None):
    """The entry of decode.decode's signature; ``config`` takes no key (the layouts fix the tiles)."""
    tile_config({}, config)
    P, page, hk, d, dv, B = check_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap,
                                            k_scale, v_scale)
    check_inputs(q, k_cache, v_cache)
    out = torch.empty(B, q.shape[1], dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, q.shape[1], dtype=torch.float32, device=q.device) if return_lse else out
    launch_decode(q, k_cache, v_cache, seq_lens, block_tables, out, lse, scale=scale, window=window,
                  soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse, workspace=workspace)
    return (out, lse) if return_lse else out


@gluon.jit
def _program(sl_ptr, cu_ptr, window, split_tokens, max_splits, min_chunk, HAS_WINDOW: gl.constexpr,
             Q_FROM_CU: gl.constexpr):
    """(skip, b, kvh, sp, row, start0, end, n): decode._split_of's plan for this program."""
    b = gl.program_id(0).to(gl.int64)
    kvh = gl.program_id(1).to(gl.int64)
    sp = gl.program_id(2)
    L = gl.load(sl_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = gl.maximum(L - window, 0)
    chunk, n = _plan(L - lo, split_tokens, max_splits, min_chunk, BN)
    skip = sp >= gl.maximum(n, 1)
    row = b
    if Q_FROM_CU:
        r0 = gl.load(cu_ptr + b)
        skip = skip | (gl.load(cu_ptr + b + 1) - r0 != 1)
        row = r0.to(gl.int64)
    start0 = lo + sp * chunk
    return skip, b, kvh, sp, row, start0, gl.minimum(start0 + chunk, L), n


@gluon.jit
def _q_factor(q_ptr, row, kvh, s_qb, s_qh, GROUP: gl.constexpr):
    """The power of two that brings q's largest finite magnitude into fp16 (fp8.f16_factor)."""
    h = gl.arange(0, 16, layout=gl.SliceLayout(1, Q_ROWS))
    d = gl.arange(0, HD, layout=gl.SliceLayout(0, Q_ROWS))
    q = gl.load(q_ptr + row * s_qb + (kvh * GROUP + h)[:, None] * s_qh + d[None, :], mask=(h < GROUP)[:, None],
                other=0.0)
    a = gl.abs(q.to(gl.float32))
    big = gl.max(gl.max(gl.where(a < float("inf"), a, 0.0), 1), 0)
    return gl.exp2(gl.maximum(gl.ceil(gl.log2(gl.maximum(big, 1.0) / 32768.0)), 0.0))


@gluon.jit
def _q_half(q_ptr, row, kvh, s_qb, s_qh, half: gl.constexpr, qf, GROUP: gl.constexpr, BLOCK_H: gl.constexpr):
    """Half ``half`` of q's head dim as the score dot's B operand q^T [warps, 64, BLOCK_H heads], fp16
    after / qf (two dots of half the depth: twice the independent MMA chains)."""
    dq = half * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, B_Q)))
    hq = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, gl.SliceLayout(1, B_Q)))
    wq = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, B_Q)))
    ok = (hq < GROUP)[None, None, :] & (wq >= 0)[:, None, None]
    q = gl.load(q_ptr + row * s_qb + (kvh * GROUP + hq)[None, None, :] * s_qh + dq[None, :, None], mask=ok, other=0.0)
    return (q.to(gl.float32) / qf).to(gl.float16)


@gluon.jit
def _page_ids(bt_row, start, end, PAGE: gl.constexpr):
    """Page ids of the tile at ``start``, [warps, keys] (0 past ``end``: those copies are masked)."""
    w = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, COPY)))
    i = gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(2, COPY)))
    j = start + w[:, None] * KW + i[None, :]
    return gl.load(bt_row + j // PAGE, mask=j < end, other=0)


@gluon.jit
def _issue(k_buf, v_buf, kc_ptr, vc_ptr, pg, start, end, kvh, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh,
           PAGE: gl.constexpr):
    """Async copies of the tile at ``start`` (page ids ``pg``) into one stage, then commit."""
    w = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, COPY)))
    i = gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(2, COPY)))
    d = gl.arange(0, HD, layout=gl.SliceLayout(0, gl.SliceLayout(1, COPY)))
    j = start + w[:, None] * KW + i[None, :]
    ok = (j < end)[:, :, None]
    slot = (j % PAGE).to(gl.int64)
    pg = pg.to(gl.int64)
    d3 = d[None, None, :]
    k_row = gl.multiple_of(pg * s_kp + slot * s_ks + kvh * s_kh, [16, 16])
    v_row = gl.multiple_of(pg * s_vp + slot * s_vs + kvh * s_vh, [16, 16])
    cp.async_copy_global_to_shared(k_buf, kc_ptr + k_row[:, :, None] + d3, mask=ok)
    cp.async_copy_global_to_shared(v_buf, vc_ptr + v_row[:, :, None] + d3, mask=ok)
    cp.commit_group()


@gluon.jit
def _tile(k_buf, v_buf, start, end, q0, q1, m_i, l_i, acc, scale, k_mul, qk_scale, soft_cap,
          BLOCK_H: gl.constexpr, HAS_CAP: gl.constexpr):
    """One 64-key tile of the online softmax (exp2 domain), each warp on its own 16 keys: scores
    S^T [keys, heads], weights P^T moved into the B operand's lanes, O^T += V^T P^T."""
    z = gl.zeros([NW, KW, BLOCK_H], gl.float32, MMA)
    s = mma_v2(e4m3_to_f16(k_buf.slice(0, 64, dim=2).load(A_K)), q0, z)
    s = s + mma_v2(e4m3_to_f16(k_buf.slice(64, 64, dim=2).load(A_K)), q1, z)
    if HAS_CAP:
        t = s * (scale * k_mul / soft_cap)
        e = gl.exp(-2.0 * gl.abs(t))
        th = (1.0 - e) / (1.0 + e)
        s = soft_cap * gl.where(t >= 0, th, -th) * 1.4426950408889634
    else:
        s = s * qk_scale
    w = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
    i = gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
    j = start + (w[:, None] * KW + i[None, :])[:, :, None]
    s = gl.where(j < end, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # a warp whose keys are all masked so far
    alpha = gl.exp2(m_i - m_ref)
    p = gl.exp2(s - m_ref[:, None, :])
    l_i = l_i * alpha + gl.sum(p, 1)
    vt = vt_operand(v_buf.load(V_LOAD))
    acc = mma_v2(vt, gl.convert_layout(p.to(gl.float16), B_P), acc * alpha[:, None, :])
    return m_new, l_i, acc


@gluon.jit(do_not_specialize=["max_splits", "min_chunk"])
def _fp8_decode_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, lse_ptr, po_ptr, pl_ptr, sl_ptr, bt_ptr, ks_ptr, vs_ptr,
                       cu_ptr, scale, soft_cap, window, split_tokens, max_splits, min_chunk,
                       s_qb, s_qh, s_ob, s_oh, s_bt, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh,
                       s_pob, s_poh, s_pos, s_plb, s_plh,
                       GROUP: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr,
                       HAS_WINDOW: gl.constexpr, HAS_CAP: gl.constexpr, RETURN_LSE: gl.constexpr,
                       Q_FROM_CU: gl.constexpr, PDL: gl.constexpr):
    enter(PDL)
    skip, b, kvh, sp, row, start0, end, n = _program(sl_ptr, cu_ptr, window, split_tokens, max_splits, min_chunk,
                                                     HAS_WINDOW, Q_FROM_CU)
    if skip:
        return
    k_a = gl.allocate_shared_memory(gl.float8e4nv, [NW, KW, HD], K_SMEM)
    v_a = gl.allocate_shared_memory(gl.float8e4nv, [NW, KW, HD], V_SMEM)
    k_b = gl.allocate_shared_memory(gl.float8e4nv, [NW, KW, HD], K_SMEM)
    v_b = gl.allocate_shared_memory(gl.float8e4nv, [NW, KW, HD], V_SMEM)
    bt_row = bt_ptr + b * s_bt
    # the first tile's copies go out before q is read: their latency covers q's
    _issue(k_a, v_a, kc_ptr, vc_ptr, _page_ids(bt_row, start0, end, PAGE), start0, end, kvh,
           s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, PAGE)
    pg = _page_ids(bt_row, start0 + BN, end, PAGE)  # page ids one tile ahead of the copies
    qf = _q_factor(q_ptr, row, kvh, s_qb, s_qh, GROUP)
    q0 = _q_half(q_ptr, row, kvh, s_qb, s_qh, 0, qf, GROUP, BLOCK_H)
    q1 = _q_half(q_ptr, row, kvh, s_qb, s_qh, 1, qf, GROUP, BLOCK_H)
    k_mul = gl.load(ks_ptr + kvh) * qf  # the scores' scale; v_mul (the output's) is q-free
    v_mul = gl.load(vs_ptr + kvh)
    qk_scale = scale * k_mul * 1.4426950408889634

    m_i = gl.full([NW, BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, MMA))
    l_i = gl.zeros([NW, BLOCK_H], gl.float32, gl.SliceLayout(1, MMA))
    acc = gl.zeros([NW, HD, BLOCK_H], gl.float32, MMA)
    for start in range(start0, end, 2 * BN):
        # the tile at start is in (k_a, v_a); the next one goes into (k_b, v_b)
        cp.wait_group(0)
        gl.thread_barrier()
        _issue(k_b, v_b, kc_ptr, vc_ptr, pg, start + BN, end, kvh, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, PAGE)
        pg = _page_ids(bt_row, start + 2 * BN, end, PAGE)
        m_i, l_i, acc = _tile(k_a, v_a, start, end, q0, q1, m_i, l_i, acc, scale, k_mul, qk_scale, soft_cap,
                              BLOCK_H, HAS_CAP)
        cp.wait_group(0)
        gl.thread_barrier()
        _issue(k_a, v_a, kc_ptr, vc_ptr, pg, start + 2 * BN, end, kvh, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, PAGE)
        pg = _page_ids(bt_row, start + 3 * BN, end, PAGE)
        if start + BN < end:
            m_i, l_i, acc = _tile(k_b, v_b, start + BN, end, q0, q1, m_i, l_i, acc, scale, k_mul, qk_scale,
                                  soft_cap, BLOCK_H, HAS_CAP)
    cp.wait_group(0)

    # the warps' states merged by their maxima; the division folded into the same factor
    m = gl.max(m_i, 0)
    m_ref = gl.where(m == float("-inf"), 0.0, m)
    f = gl.exp2(m_i - m_ref[None, :])
    l = gl.sum(l_i * f, 0)
    # l == 0: an empty range (zeros, LSE -inf); a NaN in the scores leaves l NaN, and the output
    # and LSE NaN with it, as in the reference and the Triton decode
    empty = l == 0
    inv = gl.where(empty, 0.0, v_mul / gl.where(empty, 1.0, l))
    lse2 = gl.where(empty, float("-inf"), m + gl.log2(gl.where(empty, 1.0, l)))
    o = gl.sum(acc * (f * inv[None, :])[:, None, :], 0)
    OUT: gl.constexpr = gl.SliceLayout(0, MMA)
    col = row_col(gl.arange(0, HD, layout=gl.SliceLayout(1, OUT)))
    h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, OUT))
    head = kvh * GROUP + h
    o_ok = (h < GROUP)[None, :]
    hl = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
    if n <= 1:
        gl.store(o_ptr + row * s_ob + head[None, :] * s_oh + col[:, None], o.to(o_ptr.dtype.element_ty), mask=o_ok)
        if RETURN_LSE:
            gl.store(lse_ptr + row * (GROUP * gl.num_programs(1)) + kvh * GROUP + hl, lse2 * 0.6931471805599453,
                     mask=hl < GROUP)
    else:
        gl.store(po_ptr + b * s_pob + sp * s_pos + head[None, :] * s_poh + col[:, None], o, mask=o_ok)
        gl.store(pl_ptr + b * s_plb + (kvh * GROUP + hl) * s_plh + sp, lse2, mask=hl < GROUP)
