"""Paged decode in Triton with split-KV (FlashDecoding), MHA / GQA / MQA.

Grid: (B, Hk, max_splits), static for a given batch size, so a captured CUDA graph can be
replayed after the engine rewrites seq_lens and block_tables in place. Each program packs the
GROUP query heads of one KV head into a tile of BLOCK_H >= 16 rows (tensor cores at decode;
every K/V tile is read once per group) and walks its range of keys page by page through the
block table.

The split plan is a pure function of one sequence's length, evaluated *on the device* by both
kernels (no host synchronisation, nothing to rebuild when lengths change):
- auto mode: n = min(max_splits, ceil(E / min_chunk)) splits of equal size (rounded up to
  BLOCK_N) over the E keys the query sees; ``max_splits`` is chosen on the host from B, Hk and
  the SM count (one wave of ~2 programs per SM), so long contexts at small batch fill the GPU,
  and ``min_chunk`` too (64 keys when B x Hk is tiny, else 256: ``auto_min_chunk``);
- fixed mode (batch invariant): splits of exactly ``split_tokens`` keys; a sequence's result
  depends on its own length only, never on the batch it runs in.
A sequence with one split writes its output directly; with more, each split writes a
normalised partial and its LSE (log2) into the persistent workspace and ``_combine_kernel``
merges them by LSE. Length 0 writes zeros (LSE -inf).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect, expect_tensor
from opmap.kernels.attention import decode_fp8
from opmap.kernels.attention.common import check_attention, interpreted, kernel_config, prepare_scales, sm_count
from opmap.kernels.attention.fp8 import absmax, dot_flags, e4m3_to_f16, f16_factor, scaled_f16
from opmap.kernels.attention.merge import _softmax_step, _split_sum
from opmap.kernels import pdl
from opmap.kernels.pdl import enter
from opmap.kernels.attention.tiles import _kv_scales, _pages, _plan, _tanh

MAX_SPLITS_AUTO = 32
MIN_CHUNK = 256
SPLIT_TOKENS_FIXED = 1024


@dataclass
class DecodeWorkspace:
    """Persistent split-KV buffers (allocate once per batch bucket; safe to capture)."""

    part_o: torch.Tensor  # [max_batch, Hq, max_splits, Dv] fp32, normalised partial outputs
    part_lse: torch.Tensor  # [max_batch, Hq, max_splits] fp32, log2 domain
    max_splits: int
    split_tokens: int  # 0 = auto plan; > 0 = fixed split size in keys (batch invariant)
    min_chunk: int  # 0: auto_min_chunk per launch


def make_workspace(max_batch: int, num_heads: int, head_dim: int, *, device, max_seq_len: Optional[int] = None,
                   batch_invariant: bool = False, split_tokens: Optional[int] = None,
                   max_splits: Optional[int] = None, min_chunk: Optional[int] = None) -> DecodeWorkspace:
    """``min_chunk``: fewest keys per split in auto mode; None chooses per launch (auto_min_chunk)."""
    expect(max_batch >= 1, "max_batch", max_batch, ">= 1")
    expect(min_chunk is None or min_chunk >= 1, "min_chunk", min_chunk, ">= 1 or None")
    fixed = 0
    if batch_invariant or split_tokens:
        fixed = int(split_tokens or SPLIT_TOKENS_FIXED)
        expect(fixed >= 1, "split_tokens", fixed, ">= 1")
        expect(max_seq_len is not None and max_seq_len >= 1, "max_seq_len", max_seq_len,
               "the longest context (sizes the fixed-split workspace)")
        splits = triton.cdiv(max_seq_len, fixed)
    else:
        splits = int(max_splits or MAX_SPLITS_AUTO)
    expect(splits >= 1, "max_splits", splits, ">= 1")
    dev = torch.device(device)
    return DecodeWorkspace(torch.empty(max_batch, num_heads, splits, head_dim, dtype=torch.float32, device=dev),
                           torch.empty(max_batch, num_heads, splits, dtype=torch.float32, device=dev),
                           splits, fixed, int(min_chunk or 0))


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
        m_i, alpha, p, l_i = _softmax_step(tl.where(mj[None, :], s, float("-inf")), m_i, l_i, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee" if IEEE else None)
    # Every visited tile holds >= 1 visible key, so l_i > 0 unless the range was empty (L == 0).
    inv = tl.where(l_i > 0, v_mul / tl.where(l_i > 0, l_i, 1.0), 0.0)
    lse2 = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
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
    else into the partials that _combine_kernel merges."""
    if n <= 1:
        tl.store(o_ptr + row * s_ob + o_off, out.to(o_ptr.dtype.element_ty), mask=o_ok)
        if RETURN_LSE:
            tl.store(lse_ptr + row * (GROUP * tl.num_programs(1)) + head, lse2 * 0.6931471805599453, mask=row_ok)
    else:
        tl.store(po_ptr + b * s_pob + sp * s_pos + po_off, out, mask=o_ok)
        tl.store(pl_ptr + b * s_plb + head * s_plh + sp, lse2, mask=row_ok)


@triton.jit(do_not_specialize=["max_splits", "min_chunk"])
def _combine_kernel(o_ptr, lse_ptr, po_ptr, pl_ptr, sl_ptr, cu_ptr, window, split_tokens, max_splits, min_chunk,
                    s_ob, s_oh, s_pob, s_poh, s_pos, s_plb, s_plh,
                    DV: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, RETURN_LSE: tl.constexpr,
                    Q_FROM_CU: tl.constexpr, S_P: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    """out = the LSE-weighted mean of a row's split partials (merge._split_sum). The result depends
    on the row's own splits only (fixed mode stays batch invariant) and is the same on every run.
    The plan is read before the PDL wait: this kernel is launched right after _decode_kernel only,
    which releases it after its own wait for everything before it, and seq_lens and cu_seqlens are
    inputs of both that the decode kernel does not write; the partials are read after the wait."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    L = tl.load(sl_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(L - window, 0)
    chunk, n = _plan(L - lo, split_tokens, max_splits, min_chunk, BLOCK_N)
    skip = n <= 1  # the decode kernel wrote this row itself
    row = b
    if Q_FROM_CU:
        r0 = tl.load(cu_ptr + b)
        skip = skip | (tl.load(cu_ptr + b + 1) - r0 != 1)
        row = r0.to(tl.int64)
    enter(PDL)
    if skip:
        return
    dv = tl.arange(0, DV)
    # Every split holds >= 1 key: tot >= 1.
    acc, m, tot = _split_sum(pl_ptr + b * s_plb + h * s_plh, po_ptr + b * s_pob + h * s_poh, s_pos, n, dv,
                             dv < DV, S_P, BLOCK_S, True)
    tl.store(o_ptr + row * s_ob + h * s_oh + dv, (acc / tot).to(o_ptr.dtype.element_ty))
    if RETURN_LSE:
        tl.store(lse_ptr + row * tl.num_programs(1) + h, (m + tl.log2(tot)) * 0.6931471805599453)


def auto_max_splits(batch: int, num_kv_heads: int, device: torch.device, per_sm: int = 2,
                    cap: int = MAX_SPLITS_AUTO) -> int:
    """Splits per sequence so that B * Hk * splits fills one wave of about ``per_sm`` programs per
    SM (rounded down: a second, mostly empty wave would cost as much as the first)."""
    return max(1, min(cap, (per_sm * sm_count(device)) // max(1, batch * num_kv_heads)))


def auto_min_chunk(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Fewest keys per split. 64 when B x Hk is at most 1/16 of the SMs (batch 1 with 8 KV heads
    on the H200), else 256. Measured on the H200 (docs/attention.md, Decisions;
    rows [chunk=64]): B=1, 32/8 heads, kv 512: 12.4 vs 15.1 us (fp8 13.0 vs 18.1), kv 2048: 16.4
    vs 16.4 (fp8 16.1 vs 18.7); at B=8 it was mixed (bf16 4% slower, fp8 5% faster at kv 512)."""
    return 64 if batch * num_kv_heads * 16 <= sm_count(device) else MIN_CHUNK


def _splits(workspace, B, hq, dv, hk, page, block_tables, device):
    """(split_tokens, min_chunk, max_splits, part_o, part_lse) for this call."""
    if workspace is None:
        splits = auto_max_splits(B, hk, device)
        if splits == 1:
            return 0, MIN_CHUNK, 1, None, None
        # A split plan needs partial buffers; without a workspace they are allocated here, with
        # room for MAX_SPLITS_AUTO whatever this batch uses, so that their strides (kernel
        # arguments, specialized) are the same for every batch size: one binary for all of them.
        # Splits happen below ~2 programs per SM only (B * Hk < 2 * SMs): a few MB.
        room = max(splits, MAX_SPLITS_AUTO)
        return (0, auto_min_chunk(B, hk, device), splits, torch.empty(B, hq, room, dv, dtype=torch.float32, device=device),
                torch.empty(B, hq, room, dtype=torch.float32, device=device))
    expect(isinstance(workspace, DecodeWorkspace), "workspace", type(workspace).__name__,
           "a DecodeWorkspace from make_workspace")
    expect_tensor("workspace.part_o", workspace.part_o, dtype=torch.float32, ndim=4, device=device)
    expect(workspace.part_o.shape[0] >= B and workspace.part_o.shape[1] == hq and workspace.part_o.shape[3] == dv,
           "workspace", f"part_o {tuple(workspace.part_o.shape)}", f"(>= {B}, {hq}, *, {dv})")
    fixed = workspace.split_tokens
    if fixed:
        splits = triton.cdiv(block_tables.shape[1] * page, fixed)
        expect(splits <= workspace.max_splits, "workspace", f"{workspace.max_splits} splits",
               f">= {splits} for block_tables of {block_tables.shape[1]} pages at split_tokens={fixed}")
    else:
        splits = min(workspace.max_splits, auto_max_splits(B, hk, device))
    return (fixed, workspace.min_chunk or auto_min_chunk(B, hk, device), splits, workspace.part_o,
            workspace.part_lse)


def decode_config(head_dim: int, group: int, batch: int, kv_heads: int, device, override=None) -> dict:
    """Tile configuration of one decode launch (``override``: keys to replace, for tuning)."""
    cfg = kernel_config("decode", head_dim, group, device, override)
    if not (override and "PREFETCH" in override) and batch * kv_heads > 2 * sm_count(device):
        # Measured on the H200 (docs/attention.md, Decisions): the page-id
        # prefetch speeds decode up to B*kv_heads = 256 (B=32/32k: 977 vs 1211 us) and slows it
        # from 512 on (B=64/4096: 358 vs 260 us, B=128/8192: 1039 vs 990): with more programs
        # than two per SM, occupancy hides the latency and the carried ids cost more than they buy.
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
    fixed, min_chunk, splits, po, pl = _splits(workspace, B, hq, dv, hk, page, block_tables, q.device)
    po4 = po if po is not None else out.view(out.shape[0], hq, 1, dv)  # never written when splits == 1
    pl3 = pl if pl is not None else torch.empty(1, 1, 1, device=q.device)
    ks, vs = prepare_scales(k_cache, k_scale, v_scale)
    cu = cu_seqlens_q if cu_seqlens_q is not None else seq_lens
    win = int(window or 0)
    if cfg["GLUON"] and decode_fp8.usable(q, k_cache, v_cache, interpreted(q.device)):
        # fp8 caches: each tile converted in registers from one shared-memory read (decode_fp8.py)
        decode_fp8.launch(q, k_cache, v_cache, seq_lens, block_tables, out, lse, po4, pl3, ks, vs, cu, scale=scale,
                          soft_cap=soft_cap or 1.0, window=win, fixed=fixed, splits=splits, min_chunk=min_chunk,
                          return_lse=return_lse, has_window=window is not None, has_cap=soft_cap is not None,
                          q_from_cu=cu_seqlens_q is not None, pdl_args=pdl.launch(q.device))
    else:
        dots = dot_flags(k_cache.dtype, q)  # fp8 caches (attention/fp8.py)
        _decode_kernel[(B, hk, splits)](
            q, k_cache, v_cache, out, lse, po4, pl3, seq_lens, block_tables, ks, vs, cu,
            float(scale), float(soft_cap or 1.0), win, fixed, splits, min_chunk,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), po4.stride(0), po4.stride(1), po4.stride(2), pl3.stride(0), pl3.stride(1),
            GROUP=hq // hk, D=d, DV=dv, PAGE=page, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"],
            HAS_WINDOW=window is not None, HAS_CAP=soft_cap is not None, FP8=k_cache.dtype == torch.float8_e4m3fn,
            RETURN_LSE=return_lse, IEEE=q.dtype == torch.float32, Q_FROM_CU=cu_seqlens_q is not None,
            PREFETCH=cfg["PREFETCH"], **dots,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl.launch(q.device))
    if splits > 1:
        # sized by the partial buffers' most splits (the workspace's), not this batch's: one
        # binary for every batch size
        s_p = triton.next_power_of_2(po4.shape[2])
        _combine_kernel[(B, hq)](out, lse, po4, pl3, seq_lens, cu, win, fixed, splits, min_chunk,
                                 out.stride(0), out.stride(1), po4.stride(0), po4.stride(1), po4.stride(2),
                                 pl3.stride(0), pl3.stride(1), DV=dv, BLOCK_N=cfg["BLOCK_N"],
                                 HAS_WINDOW=window is not None, RETURN_LSE=return_lse,
                                 Q_FROM_CU=cu_seqlens_q is not None, S_P=s_p,
                                 BLOCK_S=max(1, min(s_p, 4096 // triton.next_power_of_2(dv))), num_warps=4,
                                 **pdl.launch(q.device))


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
