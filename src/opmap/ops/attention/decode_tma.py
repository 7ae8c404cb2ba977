"""Paged split-KV decode with the K/V rows loaded through TMA (tensor descriptors): config TMA=1.

Same grid, split plan, partials and combine as ``decode._decode_kernel``; what differs is how keys
reach shared memory. The gather kernel issues one cp.async per 16 bytes of every key row, its
address computed from the row's page id: at B=1 / 32k (256 programs, two per SM) it streams at
0.6 of the read ceiling, each program seemingly limited by how fast it issues those copies
(docs/attention.md). Here a key tile of BLOCK_N rows is NSUB boxes of SUB = min(PAGE, BLOCK_N)
rows, each [1, SUB, 1, D] of the 4-D cache [pages, page, kv_heads, D]: one TMA copy and one
page-id load per box for K and for V. Pages of 16 give four 16-row boxes per 64-key tile; pages
of 64 and more, one.

Each box is folded into the online softmax on its own (scores [heads, SUB], mma.sync: the rows
are the 16 padded query heads). A box never reads rows at or past the split's end, which may be
past the sequence's length and hold anything (NaN included; 0 * NaN would poison the output):
a box that would is read *ending* at the split's end instead, and its rows before the box's own
start (done already, or before the split) are masked, as are rows before ``start0``; rows before
the page read as zeros (a negative row is outside the descriptor). The running max starts finite,
so a box whose rows are all masked adds nothing instead of a NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import enter
from .decode import _split_of, _store_split
from .merge import _softmax_step
from .prefill import _kv_scales, _tanh
from .tma import cache_problem, descriptors, fit_stages


def sub_rows(page: int, block_n: int) -> int:
    """Rows of one TMA box: a page, or the key tile where a page holds several tiles."""
    return min(page, block_n)


def usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> str | None:
    """None when the TMA decode can serve this call, else the reason."""
    page = k_cache.shape[1]
    if page < 16:
        return f"page size {page} < 16 (a box's rows are the N side of a dot)"
    if block_n % sub_rows(page, block_n):
        return f"BLOCK_N {block_n} is not a multiple of the page size {page}"
    return cache_problem(k_cache, v_cache)


@triton.jit
def _box_pages(bt_row, start, end, PAGE: tl.constexpr, SUB: tl.constexpr, NSUB: tl.constexpr):
    """The page ids of the NSUB boxes of the tile at ``start`` (each box's page is that of its last
    row, the box clamped to ``end``: see _box). Loaded one tile ahead and carried, so that no TMA
    copy's coordinate comes from a load in its own iteration (as the gather kernel's PREFETCH)."""
    s0 = start + tl.arange(0, NSUB) * SUB
    pidx = (tl.minimum(s0 + SUB, end) - 1) // PAGE
    return tl.load(bt_row + pidx, mask=start < end, other=0)


@triton.jit
def _box(K_DESC, V_DESC, page, s0, start0, end, kvh, PAGE: tl.constexpr, SUB: tl.constexpr, D: tl.constexpr,
         DV: tl.constexpr):
    """The box of SUB keys at ``s0`` (a multiple of SUB) in page ``page`` (_box_pages): (k, v, valid
    rows), read ending at ``end`` where it would pass it (see the module docstring)."""
    e = tl.minimum(s0 + SUB, end)
    r0 = e - SUB - (e - 1) // PAGE * PAGE  # < 0 only for a partial box: those rows read as zeros, masked
    k = K_DESC.load([page, r0, kvh, 0]).reshape(SUB, D)
    v = V_DESC.load([page, r0, kvh, 0]).reshape(SUB, DV)
    j = e - SUB + tl.arange(0, SUB)
    return k, v, (j >= tl.maximum(s0, start0)) & (j < e)


@triton.jit(do_not_specialize=["max_splits", "min_chunk"])  # per batch size (decode._decode_kernel)
def _decode_tma_kernel(q_ptr, K_DESC, V_DESC, o_ptr, lse_ptr, po_ptr, pl_ptr, sl_ptr, bt_ptr, ks_ptr, vs_ptr, cu_ptr,
                       scale, soft_cap, window, split_tokens, max_splits, min_chunk,
                       s_qb, s_qh, s_ob, s_oh, s_bt, s_pob, s_poh, s_pos, s_plb, s_plh,
                       GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, HAS_WINDOW: tl.constexpr,
                       HAS_CAP: tl.constexpr, FP8: tl.constexpr, RETURN_LSE: tl.constexpr, IEEE: tl.constexpr,
                       Q_FROM_CU: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    skip, b, kvh, sp, row, start0, end, n, head, row_ok = _split_of(
        sl_ptr, cu_ptr, window, split_tokens, max_splits, min_chunk, GROUP, BLOCK_H, BLOCK_N, HAS_WINDOW, Q_FROM_CU)
    if skip:
        return
    q = tl.load(q_ptr + row * s_qb + head[:, None] * s_qh + tl.arange(0, D)[None, :], mask=row_ok[:, None], other=0.0)
    k_mul, v_mul = _kv_scales(ks_ptr, vs_ptr, kvh, FP8)
    qk_scale = scale * k_mul * 1.4426950408889634
    acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # finite: an all-masked box adds nothing
    bt_row = bt_ptr + b * s_bt
    NSUB: tl.constexpr = BLOCK_N // SUB
    first = start0 // SUB * SUB
    pg_next = _box_pages(bt_row, first, end, PAGE, SUB, NSUB)
    for start in range(first, end, BLOCK_N):
        pg = pg_next
        pg_next = _box_pages(bt_row, start + BLOCK_N, end, PAGE, SUB, NSUB)
        for i in tl.static_range(NSUB):
            page = tl.sum(tl.where(tl.arange(0, NSUB) == i, pg, 0), 0)
            k, v, ok = _box(K_DESC, V_DESC, page, start + i * SUB, start0, end, kvh.to(tl.int32), PAGE, SUB, D, DV)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee" if IEEE else None)
            if HAS_CAP:
                s = soft_cap * _tanh(s * (scale * k_mul / soft_cap)) * 1.4426950408889634
            else:
                s = s * qk_scale
            m_i, alpha, p, l_i = _softmax_step(tl.where(ok[None, :], s, float("-inf")), m_i, l_i, 1)
            vq = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(vq.dtype), vq, input_precision="ieee" if IEEE else None)
    # Every split holds >= 1 visible key, so l_i > 0 unless the range was empty (L == 0).
    inv = tl.where(l_i > 0, v_mul / tl.where(l_i > 0, l_i, 1.0), 0.0)
    lse2 = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    dv = tl.arange(0, DV)
    _store_split(acc * inv[:, None], lse2, n, row, b, sp, head, row_ok, head[:, None] * s_oh + dv[None, :],
                 head[:, None] * s_poh + dv[None, :], row_ok[:, None], o_ptr, lse_ptr, po_ptr, pl_ptr, s_ob, s_pob,
                 s_pos, s_plb, s_plh, GROUP, RETURN_LSE)


def launch(q, k_cache, v_cache, seq_lens, block_tables, out, lse, po4, pl3, ks, vs, cu, cfg, grid, *, scale, window,
           soft_cap, fixed, splits, min_chunk, return_lse, q_from_cu, pdl_kw):
    """Launch on validated inputs that ``usable`` accepted (decode.launch_decode's arguments)."""
    hq, d = q.shape[1], q.shape[2]
    hk, page, dv = k_cache.shape[2], k_cache.shape[1], v_cache.shape[3]
    sub = sub_rows(page, cfg["BLOCK_N"])
    kd, vd = descriptors(k_cache, v_cache, sub)
    # d256 at 128-key tiles would take 272 KB at 3 stages: fewer stages instead of a launch failure
    stages = fit_stages(cfg["num_stages"], cfg["BLOCK_N"] * (d + dv) * k_cache.element_size(),
                        cfg["BLOCK_H"] * d * q.element_size(), 1)
    _decode_tma_kernel[grid](
        q, kd, vd, out, lse, po4, pl3, seq_lens, block_tables, ks, vs, cu,
        float(scale), float(soft_cap or 1.0), int(window or 0), fixed, splits, min_chunk,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        po4.stride(0), po4.stride(1), po4.stride(2), pl3.stride(0), pl3.stride(1),
        GROUP=hq // hk, D=d, DV=dv, PAGE=page, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], SUB=sub,
        HAS_WINDOW=window is not None, HAS_CAP=soft_cap is not None, FP8=k_cache.dtype == torch.float8_e4m3fn,
        RETURN_LSE=return_lse, IEEE=q.dtype == torch.float32, Q_FROM_CU=q_from_cu,
        num_warps=cfg["num_warps"], num_stages=stages, **pdl_kw)
