"""Varlen paged prefill in Triton (FlashAttention-2 style), MHA / GQA / MQA: the ``triton``
backend's prefill, its K/V rows gathered through the block table (any page size; prefill_tma.py,
the ``triton-tma`` backend, reads pages that hold whole key tiles through TMA instead).

Grid: (T // BLOCK_Q + B, Hk), static from the shapes (no host synchronisation, CUDA-graph safe).
Each program finds its sequence by a binary search over cu_seqlens (sequence b owns programs
[cu[b] // BLOCK_Q + b, ...)), and takes BLOCK_Q query tokens x all GROUP query heads of one KV
head: BLOCK_M = BLOCK_Q * GROUP rows share every K/V tile, so GQA reads each tile once per
group. K/V tiles are gathered token by token through the block table (any page size). Scores
use exp2 with log2(e) folded into the scale; fp8 K/V are converted in the inner loop and their
per-kv-head scales folded into the score scale (K) and the output (V). Causal is bottom-right
aligned: the query of sequence b sits at the last q_len positions of its seq_lens[b] keys, so a
cached prefix is attended to (chunked prefill, prefix reuse). Tiles wholly below the diagonal
run without masks.

fp8 caches with many query rows a sequence (``_convert_once``) are converted to q's dtype once,
page by page into a scratch cache, and this kernel runs on the 16-bit copy: the prefill reads each
key tile once per query block, and converting it in every program cost more than the conversion
(docs/attention.md, Decisions).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.kernels.attention.common import check_attention, kernel_config, prepare_scales
from opmap.kernels.attention.tiles import _allowed, _kv_range, _kv_scales, _locate, _pages, _rows, _scaled, _update


@triton.jit
def _tile(acc, l_i, m_i, q, kc_ptr, vc_ptr, pg, start, hi, qpos, kv_off_k, kv_off_v, s_kp, s_ks,
          s_vp, s_vs, qk_scale, scale, soft_cap, window, d, dv,
          PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
          HAS_CAP: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr):
    """One key tile at ``start`` whose page ids ``pg`` (from _pages) the caller loaded."""
    j = start + tl.arange(0, BLOCK_N)
    mj = j < hi
    pg = pg.to(tl.int64)
    slot = j % PAGE
    k = tl.load(kc_ptr + (pg * s_kp + slot * s_ks + kv_off_k)[:, None] + d[None, :], mask=mj[:, None], other=0.0)
    v = tl.load(vc_ptr + (pg * s_vp + slot * s_vs + kv_off_v)[:, None] + dv[None, :], mask=mj[:, None], other=0.0)
    k = k.to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = _scaled(s, qk_scale, scale, soft_cap, HAS_CAP)
    if MASK:
        s = tl.where(_allowed(mj, j, qpos, window, CAUSAL, HAS_WINDOW), s, float("-inf"))
    return _update(acc, l_i, m_i, s, v.to(q.dtype), IEEE)


@triton.jit
def _walk(acc, l_i, m_i, pg, q, kc_ptr, vc_ptr, bt_row, lo, end, hi, qpos, kv_off_k, kv_off_v, s_kp, s_ks,
          s_vp, s_vs, qk_scale, scale, soft_cap, window, d, dv,
          PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
          HAS_CAP: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr):
    """The key tiles [lo, end) of keys below ``hi``; ``pg`` holds the page ids of the tile at
    ``lo`` when PREFETCH (returned for the tile at ``end``)."""
    for start in range(lo, end, BLOCK_N):
        if PREFETCH:
            pg_next = _pages(bt_row, start + BLOCK_N, hi, PAGE, BLOCK_N)
        else:
            pg = _pages(bt_row, start, hi, PAGE, BLOCK_N)
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, kc_ptr, vc_ptr, pg, start, hi, qpos, kv_off_k, kv_off_v, s_kp, s_ks,
                              s_vp, s_vs, qk_scale, scale, soft_cap, window, d, dv,
                              PAGE, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_CAP, MASK, IEEE)
        if PREFETCH:
            pg = pg_next
    return acc, l_i, m_i, pg


# B (sequences in the step) varies per step: not specialized (see decode._decode_kernel)
@triton.jit(do_not_specialize=["B"])
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, lse_ptr, cu_ptr, sl_ptr, bt_ptr, ks_ptr, vs_ptr,
                    scale, soft_cap, window, B,
                    s_qt, s_qh, s_ot, s_oh, s_bt, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh,
                    GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, FP8: tl.constexpr,
                    RETURN_LSE: tl.constexpr, IEEE: tl.constexpr, SKIP_SINGLE: tl.constexpr,
                    PREFETCH: tl.constexpr = 1):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    # Reversed order: under causal masking the last query blocks of a sequence carry the most
    # keys; starting them first shortens the tail of the grid.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    b, q0, q_len, local = _locate(cu_ptr, B, pid, BLOCK_Q)
    skip = local * BLOCK_Q >= q_len
    if SKIP_SINGLE:  # mixed batches: the decode kernel serves the one-token sequences
        skip = skip | (q_len == 1)
    if skip:
        return
    L = tl.load(sl_ptr + b)
    tok, head, row_ok, qpos = _rows(L, q_len, local, kvh, GROUP, BLOCK_M)
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    t64 = (q0 + tok).to(tl.int64)
    q = tl.load(q_ptr + (t64 * s_qt + head * s_qh)[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    k_mul, v_mul = _kv_scales(ks_ptr, vs_ptr, kvh, FP8)
    qk_scale = scale * k_mul * 1.4426950408889634
    sc = scale * k_mul
    kv_lo, full_end, kv_hi = _kv_range(L, q_len, local, window, BLOCK_Q, BLOCK_N, CAUSAL, HAS_WINDOW)
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    # Unmasked tiles, then the masked tail. PREFETCH (common._default_config): page ids one tile
    # ahead, carried across both loops (the first ends having loaded the ids of the tile at full_end).
    pg = _pages(bt_row, kv_lo, kv_hi, PAGE, BLOCK_N)
    acc, l_i, m_i, pg = _walk(acc, l_i, m_i, pg, q, kc_ptr, vc_ptr, bt_row, kv_lo, full_end, kv_hi, qpos,
                              kvh * s_kh, kvh * s_vh, s_kp, s_ks, s_vp, s_vs, qk_scale, sc, soft_cap, window, d, dv,
                              PAGE, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_CAP, False, IEEE, PREFETCH)
    acc, l_i, m_i, pg = _walk(acc, l_i, m_i, pg, q, kc_ptr, vc_ptr, bt_row, full_end, kv_hi, kv_hi, qpos,
                              kvh * s_kh, kvh * s_vh, s_kp, s_ks, s_vp, s_vs, qk_scale, sc, soft_cap, window, d, dv,
                              PAGE, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_CAP, True, IEEE, PREFETCH)
    inv = tl.where(l_i > 0, v_mul / tl.where(l_i > 0, l_i, 1.0), 0.0)
    out = acc * inv[:, None]
    tl.store(o_ptr + (t64 * s_ot + head * s_oh)[:, None] + dv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    if RETURN_LSE:
        lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + t64 * (GROUP * tl.num_programs(1)) + head, lse, mask=row_ok)


CONVERT_MIN_ROWS = 128  # mean query rows a sequence from which an fp8 prefill converts its pages once
CONVERT_MAX_BYTES = 512 * 2**20  # the largest 16-bit scratch (K and V) a call converts into


@triton.jit
def _page_convert_kernel(src_ptr, dst_ptr, bt_ptr, s_ptr, P, ROW: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                         BLOCK: tl.constexpr):
    """dst[i] = src[block_tables.flat[i]] * scale[kv head], one page (``ROW`` elements) a program
    row; a page id outside the cache reads page 0 (such entries lie past every length and are
    never read by the kernels)."""
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < ROW
    pg = tl.load(bt_ptr + i)
    pg = tl.where((pg >= 0) & (pg < P), pg, 0).to(tl.int64)
    x = tl.load(src_ptr + pg * ROW + offs, mask=ok, other=0.0).to(tl.float32)
    sc = tl.load(s_ptr + (offs // D) % HK, mask=ok, other=1.0)  # a page row is [slot, kv head, D]
    tl.store(dst_ptr + i * ROW + offs, (x * sc).to(dst_ptr.dtype.element_ty), mask=ok)


def _convert_once(q, k_cache, v_cache, block_tables, T: int, skip_single: bool) -> bool:
    """Whether an fp8 prefill converts its pages once (many query rows a sequence, contiguous pages,
    a scratch within CONVERT_MAX_BYTES)."""
    B, maxp = block_tables.shape
    if k_cache.dtype != torch.float8_e4m3fn or q.dtype == torch.float32 or skip_single or T < CONVERT_MIN_ROWS * B:
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()):
        return False
    page_elems = k_cache[0].numel() + v_cache[0].numel()
    return B * maxp * page_elems * q.element_size() <= CONVERT_MAX_BYTES


def _converted(cache, block_tables, scale, dtype):
    """[B * maxp, page, Hk, D] in ``dtype``: the pages of ``block_tables`` times the per-KV-head scale."""
    n = block_tables.numel()
    row = cache[0].numel()
    out = torch.empty((n, *cache.shape[1:]), dtype=dtype, device=cache.device)
    if n:
        block = min(4096, triton.next_power_of_2(row))
        _page_convert_kernel[(n, triton.cdiv(row, block))](cache, out, block_tables, scale, cache.shape[0],
                                                         ROW=row, HK=cache.shape[2], D=cache.shape[3], BLOCK=block)
    return out


def launch_prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, lse, *, scale, causal, window,
                   soft_cap, k_scale, v_scale, return_lse, config=None, skip_single=False):
    """Launch on validated inputs into ``out`` / ``lse`` (the caller owns the contract)."""
    T, hq, d = q.shape
    B, hk, page = seq_lens.shape[0], k_cache.shape[2], k_cache.shape[1]
    if T == 0 or B == 0:
        return
    if _convert_once(q, k_cache, v_cache, block_tables, T, skip_single):
        kc = _converted(k_cache, block_tables, k_scale, q.dtype)
        vc = _converted(v_cache, block_tables, v_scale, q.dtype)
        tables = torch.arange(block_tables.numel(), dtype=torch.int32, device=q.device).view(block_tables.shape)
        launch_prefill(q, kc, vc, cu_seqlens_q, seq_lens, tables, out, lse, scale=scale, causal=causal, window=window,
                       soft_cap=soft_cap, k_scale=None, v_scale=None, return_lse=return_lse, config=config)
        return
    group = hq // hk
    cfg = kernel_config("prefill", d, group, q.device, config, ieee=q.dtype == torch.float32)
    bm = cfg["BLOCK_M"]
    grid = (T // (bm // group) + B, hk)
    ks, vs = prepare_scales(k_cache, k_scale, v_scale)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, lse, cu_seqlens_q, seq_lens, block_tables, ks, vs,
        float(scale), float(soft_cap or 1.0), int(window or 0), B,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=group, D=d, DV=v_cache.shape[3], PAGE=page, BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], CAUSAL=bool(causal),
        HAS_WINDOW=window is not None, HAS_CAP=soft_cap is not None, FP8=k_cache.dtype == torch.float8_e4m3fn,
        RETURN_LSE=return_lse, IEEE=q.dtype == torch.float32, SKIP_SINGLE=skip_single, PREFETCH=cfg["PREFETCH"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, *, scale: float, causal: bool = True,
            window=None, soft_cap=None, k_scale=None, v_scale=None, return_lse: bool = False, config=None):
    """``config``: optional tile override (BLOCK_M, BLOCK_N, num_warps, num_stages, PREFETCH: see
    common._default_config), for tuning."""
    P, page, hk, d, dv, B = check_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap,
                                            k_scale, v_scale, cu_seqlens_q=cu_seqlens_q)
    T, hq, _ = q.shape
    out = torch.empty(T, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, hq, dtype=torch.float32, device=q.device) if return_lse else out
    launch_prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, lse, scale=scale, causal=causal,
                   window=window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
                   config=config)
    return (out, lse) if return_lse else out
