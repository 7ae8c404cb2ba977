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
from triton.tools.tensor_descriptor import TensorDescriptor

from .decode import _plan
from .merge import _softmax_step
from .prefill import _tanh
from ..pdl import enter

MAX_BOX = 256  # a TMA box is at most 256 elements along each dimension


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
    for c in (k_cache, v_cache):
        if c.stride(3) != 1 or any((st * c.element_size()) % 16 for st in c.stride()[:3]) or c.data_ptr() % 16:
            return "TMA needs the cache's last dimension contiguous and 16-byte aligned rows"
        if c.shape[3] > MAX_BOX or c.shape[3] * c.element_size() < 16:
            return f"head_dim {c.shape[3]}: a TMA box row is 16 bytes to {MAX_BOX} elements"
    return None


def descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, sub: int):
    """[pages, page, kv_heads, D] descriptors whose box is one kv head's ``sub`` rows of one page."""
    return tuple(TensorDescriptor(c, list(c.shape), list(c.stride()), [1, sub, 1, c.shape[3]])
                 for c in (k_cache, v_cache))


@triton.jit
def _box(K_DESC, V_DESC, bt_row, s0, start0, end, kvh, PAGE: tl.constexpr, SUB: tl.constexpr, D: tl.constexpr,
         DV: tl.constexpr):
    """The box of SUB keys at ``s0`` (a multiple of SUB): (k, v, valid rows), read ending at
    ``end`` where it would pass it (see the module docstring)."""
    e = tl.minimum(s0 + SUB, end)
    pidx = (e - 1) // PAGE
    r0 = e - SUB - pidx * PAGE  # < 0 only for a partial box: those rows read as zeros, masked
    page = tl.load(bt_row + pidx)
    k = K_DESC.load([page, r0, kvh, 0]).reshape(SUB, D)
    v = V_DESC.load([page, r0, kvh, 0]).reshape(SUB, DV)
    j = e - SUB + tl.arange(0, SUB)
    return k, v, (j >= tl.maximum(s0, start0)) & (j < e)


@triton.jit
def _decode_tma_kernel(q_ptr, K_DESC, V_DESC, o_ptr, lse_ptr, po_ptr, pl_ptr, sl_ptr, bt_ptr, ks_ptr, vs_ptr, cu_ptr,
                       scale, soft_cap, window, split_tokens, max_splits, min_chunk,
                       s_qb, s_qh, s_ob, s_oh, s_bt, s_pob, s_poh, s_pos, s_plb, s_plh,
                       GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, HAS_WINDOW: tl.constexpr,
                       HAS_CAP: tl.constexpr, FP8: tl.constexpr, RETURN_LSE: tl.constexpr, IEEE: tl.constexpr,
                       Q_FROM_CU: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    L = tl.load(sl_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(L - window, 0)
    chunk, n = _plan(L - lo, split_tokens, max_splits, min_chunk, BLOCK_N)
    skip = sp >= tl.maximum(n, 1)
    row = b
    if Q_FROM_CU:  # mixed batches: the sequences with exactly one query token, at row cu[b]
        r0 = tl.load(cu_ptr + b)
        skip = skip | (tl.load(cu_ptr + b + 1) - r0 != 1)
        row = r0.to(tl.int64)
    if skip:
        return
    start0 = lo + sp * chunk
    end = tl.minimum(start0 + chunk, L)
    r = tl.arange(0, BLOCK_H)
    head = kvh * GROUP + r
    row_ok = r < GROUP
    q = tl.load(q_ptr + row * s_qb + head[:, None] * s_qh + tl.arange(0, D)[None, :], mask=row_ok[:, None], other=0.0)
    k_mul = 1.0
    v_mul = 1.0
    if FP8:
        k_mul = tl.load(ks_ptr + kvh)
        v_mul = tl.load(vs_ptr + kvh)
    qk_scale = scale * k_mul * 1.4426950408889634
    acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # finite: an all-masked box adds nothing
    bt_row = bt_ptr + b * s_bt
    for start in range(start0 // SUB * SUB, end, BLOCK_N):
        for i in tl.static_range(BLOCK_N // SUB):
            k, v, ok = _box(K_DESC, V_DESC, bt_row, start + i * SUB, start0, end, kvh, PAGE, SUB, D, DV)
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
    out = acc * inv[:, None]
    dv = tl.arange(0, DV)
    if n <= 1:
        tl.store(o_ptr + row * s_ob + head[:, None] * s_oh + dv[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
        if RETURN_LSE:
            tl.store(lse_ptr + row * (GROUP * tl.num_programs(1)) + head, lse2 * 0.6931471805599453, mask=row_ok)
    else:
        tl.store(po_ptr + b * s_pob + sp * s_pos + head[:, None] * s_poh + dv[None, :], out, mask=row_ok[:, None])
        tl.store(pl_ptr + b * s_plb + head * s_plh + sp, lse2, mask=row_ok)


def launch(q, k_cache, v_cache, seq_lens, block_tables, out, lse, po4, pl3, ks, vs, cu, cfg, grid, *, scale, window,
           soft_cap, fixed, splits, min_chunk, return_lse, q_from_cu, pdl_kw):
    """Launch on validated inputs that ``usable`` accepted (decode.launch_decode's arguments)."""
    hq, d = q.shape[1], q.shape[2]
    hk, page, dv = k_cache.shape[2], k_cache.shape[1], v_cache.shape[3]
    sub = sub_rows(page, cfg["BLOCK_N"])
    kd, vd = descriptors(k_cache, v_cache, sub)
    _decode_tma_kernel[grid](
        q, kd, vd, out, lse, po4, pl3, seq_lens, block_tables, ks, vs, cu,
        float(scale), float(soft_cap or 1.0), int(window or 0), fixed, splits, min_chunk,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        po4.stride(0), po4.stride(1), po4.stride(2), pl3.stride(0), pl3.stride(1),
        GROUP=hq // hk, D=d, DV=dv, PAGE=page, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], SUB=sub,
        HAS_WINDOW=window is not None, HAS_CAP=soft_cap is not None, FP8=k_cache.dtype == torch.float8_e4m3fn,
        RETURN_LSE=return_lse, IEEE=q.dtype == torch.float32, Q_FROM_CU=q_from_cu,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_kw)
