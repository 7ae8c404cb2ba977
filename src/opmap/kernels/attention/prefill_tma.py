"""Varlen paged prefill with the K/V tiles loaded through TMA (tensor descriptors): the ``triton-tma``
backend's prefill, for caches whose page holds whole key tiles (page % BLOCK_N == 0: pages of 64 and
128 at BLOCK_N 64), bf16/fp16 K/V of q's dtype.

Same grid, sequence lookup, GQA packing, causal / window / soft-cap semantics and outputs as
``prefill._prefill_kernel``; what differs is how a key tile reaches shared memory. The gather
kernel issues one cp.async per 16 bytes of every row, with the row's address computed from its
page id; here a tile is one box [1, BLOCK_N, 1, D] of the 4-D cache [pages, page, kv_heads, D],
one TMA copy per tile for K and one for V, its page id one scalar load. That frees the registers
and issue slots the address arithmetic took (the gather kernel reaches 0.64-0.69x cuDNN at
S >= 8192 on the H200; docs/attention.md).

A tile never reads rows past a sequence's length (they may hold anything, NaN included, and
0 * NaN poisons the output): the masked tail's tiles are read *ending* at the tile's upper bound
``hi``, the rows before ``start`` (done already) masked, rows before the page read as zeros (a
negative row is outside the descriptor).
Page ids outside the cache read as zeros too (the descriptor's bounds), never other memory.
What the backend declares (ops/attention/backends.py) the entry checks again on the tensors
(``check_inputs``: an InputError, never another kernel).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect
from opmap.kernels.attention.common import check_attention, kernel_config
from opmap.kernels.attention.tiles import _allowed, _kv_range, _locate, _rows, _scaled, _update
from opmap.kernels.attention.tma import cache_problem, descriptors, fit_stages


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int, config=None) -> None:
    """What this kernel needs beyond the common attention contract (common.check_attention), at the
    key tile ``block_n`` it will launch: an InputError naming the argument, before any launch."""
    expect(q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
           "k_cache", f"dtype {k_cache.dtype} with q {q.dtype}",
           "bf16/fp16 K/V of q's dtype (the TMA prefill; fp8 and fp32 caches: the triton backend)")
    page = k_cache.shape[1]
    expect(page % block_n == 0, "config" if config and "BLOCK_N" in config else "k_cache",
           f"page size {page} is not a multiple of BLOCK_N {block_n}", "pages that hold whole key tiles")
    why = cache_problem(k_cache, v_cache)
    expect(why is None, "k_cache", f"strides {tuple(k_cache.stride())} / {tuple(v_cache.stride())}", why)


@triton.jit
def _page_of(bt_row, start, last_page, PAGE: tl.constexpr):
    """The page id of the tile at ``start`` (clamped to the sequence's last page: the loops load it
    one tile ahead and carry it, so that no TMA copy's coordinate comes from a load in its own
    iteration; with it there, Triton 3.6 issued each tile's copies one iteration ahead, with it
    carried two, as in the decode: docs/attention.md)."""
    return tl.load(bt_row + tl.minimum(start // PAGE, last_page))


@triton.jit
def _tile_tma(acc, l_i, m_i, q, K_DESC, V_DESC, page, start, hi, qpos, kvh, qk_scale, scale, soft_cap, window,
              D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, MASK: tl.constexpr):
    """The key tile at ``start`` (a multiple of BLOCK_N, so inside one page ``page``). MASK: a tile of
    the masked tail, read ending at ``hi`` when it is partial (see the module docstring)."""
    pidx = start // PAGE
    r0 = start % PAGE
    if MASK:
        r0 = tl.minimum(r0, hi - BLOCK_N - pidx * PAGE)  # may be negative: those rows read as zeros
    k = K_DESC.load([page, r0, kvh, 0]).reshape(BLOCK_N, D)
    v = V_DESC.load([page, r0, kvh, 0]).reshape(BLOCK_N, DV)
    s = _scaled(tl.dot(q, tl.trans(k)), qk_scale, scale, soft_cap, HAS_CAP)
    if MASK:
        j = pidx * PAGE + r0 + tl.arange(0, BLOCK_N)
        s = tl.where(_allowed((j >= start) & (j < hi), j, qpos, window, CAUSAL, HAS_WINDOW), s, float("-inf"))
    return _update(acc, l_i, m_i, s, v, False)


@triton.jit(do_not_specialize=["B"])  # per step (prefill._prefill_kernel)
def _prefill_tma_kernel(q_ptr, K_DESC, V_DESC, o_ptr, lse_ptr, cu_ptr, sl_ptr, bt_ptr,
                        scale, soft_cap, window, B, s_qt, s_qh, s_ot, s_oh, s_bt,
                        GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, RETURN_LSE: tl.constexpr):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) query blocks first
    kvh = tl.program_id(1)
    b, q0, q_len, local = _locate(cu_ptr, B, pid, BLOCK_Q)
    if local * BLOCK_Q >= q_len:
        return
    L = tl.load(sl_ptr + b)
    tok, head, row_ok, qpos = _rows(L, q_len, local, kvh, GROUP, BLOCK_M)
    t64 = (q0 + tok).to(tl.int64)
    q = tl.load(q_ptr + (t64 * s_qt + head * s_qh)[:, None] + tl.arange(0, D)[None, :], mask=row_ok[:, None],
                other=0.0)
    qk_scale = scale * 1.4426950408889634
    kv_lo, full_end, kv_hi = _kv_range(L, q_len, local, window, BLOCK_Q, BLOCK_N, CAUSAL, HAS_WINDOW)
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    last_page = tl.maximum(kv_hi - 1, 0) // PAGE
    pg_next = _page_of(bt_row, kv_lo, last_page, PAGE)
    for start in range(kv_lo, full_end, BLOCK_N):
        pg = pg_next
        pg_next = _page_of(bt_row, start + BLOCK_N, last_page, PAGE)
        acc, l_i, m_i = _tile_tma(acc, l_i, m_i, q, K_DESC, V_DESC, pg, start, kv_hi, qpos, kvh, qk_scale,
                                  scale, soft_cap, window, D, DV, PAGE, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_CAP, False)
    for start in range(full_end, kv_hi, BLOCK_N):
        pg = pg_next
        pg_next = _page_of(bt_row, start + BLOCK_N, last_page, PAGE)
        acc, l_i, m_i = _tile_tma(acc, l_i, m_i, q, K_DESC, V_DESC, pg, start, kv_hi, qpos, kvh, qk_scale,
                                  scale, soft_cap, window, D, DV, PAGE, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_CAP, True)
    inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
    tl.store(o_ptr + (t64 * s_ot + head * s_oh)[:, None] + tl.arange(0, DV)[None, :],
             (acc * inv[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    if RETURN_LSE:
        lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + t64 * (GROUP * tl.num_programs(1)) + head, lse, mask=row_ok)


def launch(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, lse, cfg, *, scale, causal, window,
           soft_cap, return_lse):
    """Launch on inputs ``check_inputs`` accepted, with ``cfg`` from common.kernel_config."""
    T, hq, d = q.shape
    B, hk, page = seq_lens.shape[0], k_cache.shape[2], k_cache.shape[1]
    if T == 0 or B == 0:
        return
    group = hq // hk
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    kd, vd = descriptors(k_cache, v_cache, bn)
    stages = fit_stages(cfg["num_stages"], bn * (d + v_cache.shape[3]) * k_cache.element_size(),
                        bm * d * q.element_size(), 0)
    _prefill_tma_kernel[(T // (bm // group) + B, hk)](
        q, kd, vd, out, lse, cu_seqlens_q, seq_lens, block_tables,
        float(scale), float(soft_cap or 1.0), int(window or 0), B,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, D=d, DV=v_cache.shape[3], PAGE=page, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=bool(causal),
        HAS_WINDOW=window is not None, HAS_CAP=soft_cap is not None, RETURN_LSE=return_lse,
        num_warps=cfg["num_warps"], num_stages=stages)


def prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, *, scale: float, causal: bool = True,
            window=None, soft_cap=None, k_scale=None, v_scale=None, return_lse: bool = False, config=None):
    """The entry of prefill.prefill's signature. ``config``: optional tile override (BLOCK_M,
    BLOCK_N, num_warps, num_stages), for tuning; BLOCK_N must divide the page size."""
    P, page, hk, d, dv, B = check_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap,
                                            k_scale, v_scale, cu_seqlens_q=cu_seqlens_q)
    T, hq, _ = q.shape
    cfg = kernel_config("prefill_tma", d, hq // hk, q.device, config)
    check_inputs(q, k_cache, v_cache, cfg["BLOCK_N"], config)
    out = torch.empty(T, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, hq, dtype=torch.float32, device=q.device) if return_lse else out
    launch(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, lse, cfg, scale=scale, causal=causal,
           window=window, soft_cap=soft_cap, return_lse=return_lse)
    return (out, lse) if return_lse else out
