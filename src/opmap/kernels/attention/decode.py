"""Paged decode in Triton with split-KV (FlashDecoding), MHA / GQA / MQA: the ``triton`` backend's
decode (fp8 caches included: their tiles converted to fp16 in registers, kernels/attention/fp8.py).

Grid: (B, Hk, max_splits), static for a given batch size, so a captured CUDA graph can be
replayed after the engine rewrites seq_lens and block_tables in place. Each program packs the
GROUP query heads of one KV head into a tile of BLOCK_H >= 16 rows (tensor cores at decode;
every K/V tile is read once per group) and walks its range of keys page by page through the
block table. The split plan, the workspace and the merge of split partials are splitkv.py's
(shared with the Gluon fp8 decode, decode_fp8.py); length 0 writes zeros (LSE -inf).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from opmap.kernels import pdl
from opmap.kernels.attention import splitkv
from opmap.kernels.attention.common import check_attention, kernel_config, prepare_scales, sm_count
from opmap.kernels.attention.fp8 import absmax, dot_flags, e4m3_to_f16, f16_factor, scaled_f16
from opmap.kernels.attention.merge import softmax_step
from opmap.kernels.attention.splitkv import DecodeWorkspace, make_workspace  # noqa: F401  (re-exported)
from opmap.kernels.attention.tiles import _kv_scales, _pages, _plan, _tanh
from opmap.kernels.pdl import enter


# max_splits and min_chunk come from the batch size (auto plan): not specialized, so that every
# batch of a run launches the one binary the start-up compiled (Triton compiles a variant per
# integer that is 1 or a multiple of 16; tests/test_engine_triton.py checks the engine's steps).
@triton.jit(do_not_specialize=["max_splits", "min_chunk"])
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, lse_ptr, po_ptr, pl_ptr, sl_ptr, bt_ptr, ks_ptr, vs_ptr, cu_ptr,
                   scale, soft_cap, window, split_tokens, max_splits, min_chunk,
                   s_qb, s_qh, s_ob, s_oh, s_bt, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh,
                   s_pob, s_poh, s_pos, s_plb, s_plh,
                   GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_CAP: tl.constexpr, FP8: tl.constexpr, RETURN_LSE: tl.constexpr, IEEE: tl.constexpr,
                   Q_FROM_CU: tl.constexpr, PREFETCH: tl.constexpr = 1,
                   PDL: tl.constexpr = False, F16: tl.constexpr = False, ASM: tl.constexpr = False):
    """F16 (fp8 caches with 16-bit queries): fp16 dots, q divided by ``fp8.f16_factor``; ASM: the
    tiles converted by ``fp8.e4m3_to_f16`` (a GPU), else cast (the interpreter)."""
    enter(PDL)
    skip, b, kvh, sp, row, start0, end, n, head, row_ok = _split_of(
        sl_ptr, cu_ptr, window, split_tokens, max_splits, min_chunk, GROUP, BLOCK_H, BLOCK_N, HAS_WINDOW, Q_FROM_CU)
    if skip:
        return
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    q = tl.load(q_ptr + row * s_qb + head[:, None] * s_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    k_mul, v_mul = _kv_scales(ks_ptr, vs_ptr, kvh, FP8)
    if F16:
        qf = f16_factor(absmax(q))
        q = scaled_f16(q, qf)
        k_mul = k_mul * qf  # the scores' scale; v_mul (the output's) is q-free
    qk_scale = scale * k_mul * 1.4426950408889634
    acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    bt_row = bt_ptr + b * s_bt
    # PREFETCH (common._default_config): the next tile's page ids are loaded one iteration ahead.
    pg_next = _pages(bt_row, start0, end, PAGE, BLOCK_N)
    for start in range(start0, end, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        mj = j < end
        if PREFETCH:
            pg = pg_next.to(tl.int64)
            pg_next = _pages(bt_row, start + BLOCK_N, end, PAGE, BLOCK_N)
        else:
            pg = _pages(bt_row, start, end, PAGE, BLOCK_N).to(tl.int64)
        slot = j % PAGE
        k = tl.load(kc_ptr + (pg * s_kp + slot * s_ks + kvh * s_kh)[:, None] + d[None, :], mask=mj[:, None],
                    other=0.0)
        v = tl.load(vc_ptr + (pg * s_vp + slot * s_vs + kvh * s_vh)[:, None] + dv[None, :], mask=mj[:, None],
                    other=0.0)
        if ASM:
            k = e4m3_to_f16(k)
            v = e4m3_to_f16(v)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee" if IEEE else None)
        if HAS_CAP:
            s = soft_cap * _tanh(s * (scale * k_mul / soft_cap)) * 1.4426950408889634
        else:
            s = s * qk_scale
        m_i, alpha, p, l_i = softmax_step(tl.where(mj[None, :], s, float("-inf")), m_i, l_i, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee" if IEEE else None)
    # Every visited tile holds >= 1 visible key, so l_i > 0 unless the range was empty (L == 0:
    # zeros, LSE -inf) or a NaN reached the scores: l_i is then NaN, and so are out and the LSE,
    # as in the reference (a test against every backend keeps it).
    empty = l_i == 0
    inv = tl.where(empty, 0.0, v_mul / tl.where(empty, 1.0, l_i))
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    out = acc * inv[:, None]
    o_off = head[:, None] * s_oh + dv[None, :]
    po_off = head[:, None] * s_poh + dv[None, :]
    o_ok = row_ok[:, None]
    _store_split(out, lse2, n, row, b, sp, head, row_ok, o_off, po_off, o_ok, o_ptr, lse_ptr, po_ptr, pl_ptr, s_ob,
                 s_pob, s_pos, s_plb, s_plh, GROUP, RETURN_LSE)


@triton.jit
def _split_of(sl_ptr, cu_ptr, window, split_tokens, max_splits, min_chunk, GROUP: tl.constexpr,
              BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, Q_FROM_CU: tl.constexpr):
    """What this program (sequence b, kv head kvh, split sp) does: (skip, b, kvh, sp, row, start0,
    end, n, head, row_ok). The split covers keys [start0, end) of the n splits of the sequence's
    plan; ``row`` is the query / output row (cu[b] in mixed batches, which serve only the sequences
    with exactly one query token; partials are indexed by b); ``head`` the BLOCK_H query heads of
    the tile, of which the first GROUP are real (``row_ok``)."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    L = tl.load(sl_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(L - window, 0)
    chunk, n = _plan(L - lo, split_tokens, max_splits, min_chunk, BLOCK_N)
    skip = sp >= tl.maximum(n, 1)
    row = b
    if Q_FROM_CU:
        r0 = tl.load(cu_ptr + b)
        skip = skip | (tl.load(cu_ptr + b + 1) - r0 != 1)
        row = r0.to(tl.int64)
    start0 = lo + sp * chunk
    r = tl.arange(0, BLOCK_H)
    return skip, b, kvh, sp, row, start0, tl.minimum(start0 + chunk, L), n, kvh * GROUP + r, r < GROUP


@triton.jit
def _store_split(out, lse2, n, row, b, sp, head, row_ok, o_off, po_off, o_ok, o_ptr, lse_ptr, po_ptr, pl_ptr, s_ob,
                 s_pob, s_pos, s_plb, s_plh, GROUP: tl.constexpr, RETURN_LSE: tl.constexpr):
    """A split's normalised output and LSE (log2): into the output when the sequence has one split,
    else into the partials that splitkv._combine_kernel merges."""
    if n <= 1:
        tl.store(o_ptr + row * s_ob + o_off, out.to(o_ptr.dtype.element_ty), mask=o_ok)
        if RETURN_LSE:
            tl.store(lse_ptr + row * (GROUP * tl.num_programs(1)) + head, lse2 * 0.6931471805599453, mask=row_ok)
    else:
        tl.store(po_ptr + b * s_pob + sp * s_pos + po_off, out, mask=o_ok)
        tl.store(pl_ptr + b * s_plb + head * s_plh + sp, lse2, mask=row_ok)


def decode_config(head_dim: int, group: int, batch: int, kv_heads: int, device, override=None) -> dict:
    """Tile configuration of one decode launch (``override``: keys to replace, for tuning)."""
    cfg = kernel_config("decode", head_dim, group, device, override)
    if not (override and "PREFETCH" in override) and batch * kv_heads > 2 * sm_count(device):
        # With more programs than two an SM, occupancy hides the page-table latency and the carried
        # ids cost more than they buy (docs/attention.md, Decisions: page ids prefetched only while
        # B x Hk <= 2 x SMs).
        cfg["PREFETCH"] = 0
    return cfg


def launch_decode(q, k_cache, v_cache, seq_lens, block_tables, out, lse, *, scale, window, soft_cap, k_scale,
                  v_scale, return_lse, workspace=None, config=None, cu_seqlens_q=None):
    """Launch on validated inputs. With ``cu_seqlens_q`` (mixed batches) the query / output row of
    sequence b is cu[b], and only sequences with exactly one query token are served."""
    B, hq, d = seq_lens.shape[0], q.shape[1], q.shape[2]
    hk, page, dv = k_cache.shape[2], k_cache.shape[1], v_cache.shape[3]
    if B == 0:
        return
    cfg = decode_config(d, hq // hk, B, hk, q.device, config)
    p = splitkv.plan(workspace, out, B, hq, dv, hk, page, block_tables, q.device)
    ks, vs = prepare_scales(k_cache, k_scale, v_scale)
    cu = cu_seqlens_q if cu_seqlens_q is not None else seq_lens
    dots = dot_flags(k_cache.dtype, q)  # fp8 caches (attention/fp8.py)
    _decode_kernel[(B, hk, p.splits)](
        q, k_cache, v_cache, out, lse, p.po, p.pl, seq_lens, block_tables, ks, vs, cu,
        float(scale), float(soft_cap or 1.0), int(window or 0), p.split_tokens, p.splits, p.min_chunk,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), p.po.stride(0), p.po.stride(1), p.po.stride(2), p.pl.stride(0), p.pl.stride(1),
        GROUP=hq // hk, D=d, DV=dv, PAGE=page, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"],
        HAS_WINDOW=window is not None, HAS_CAP=soft_cap is not None, FP8=k_cache.dtype == torch.float8_e4m3fn,
        RETURN_LSE=return_lse, IEEE=q.dtype == torch.float32, Q_FROM_CU=cu_seqlens_q is not None,
        PREFETCH=cfg["PREFETCH"], **dots,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl.launch(q.device))
    splitkv.combine(p, out, lse, seq_lens, cu, window=window, block_n=cfg["BLOCK_N"], return_lse=return_lse,
                    q_from_cu=cu_seqlens_q is not None)


def decode(q, k_cache, v_cache, seq_lens, block_tables, *, scale: float, window=None, soft_cap=None,
           k_scale=None, v_scale=None, return_lse: bool = False, workspace: Optional[DecodeWorkspace] = None,
           config=None):
    """``config``: optional override of the launch config (BLOCK_H, BLOCK_N, num_warps, num_stages,
    PREFETCH: see common._default_config), for tuning."""
    P, page, hk, d, dv, B = check_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap,
                                            k_scale, v_scale)
    out = torch.empty(B, q.shape[1], dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, q.shape[1], dtype=torch.float32, device=q.device) if return_lse else out
    launch_decode(q, k_cache, v_cache, seq_lens, block_tables, out, lse, scale=scale, window=window,
                  soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse, workspace=workspace,
                  config=config)
    return (out, lse) if return_lse else out
