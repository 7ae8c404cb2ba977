"""MLA decode in Triton, the pointer kernel: absorbed form, split-KV with an LSE merge, dense or
top-k sparse; the ``mla-triton`` backend's decode (any page size, any cache dtype it declares).

Entries (signatures in reference.py): ``mla_decode``, ``mla_sparse_decode``, ``make_workspace``.

Every head attends to the same latent rows, so one program takes a block of BLOCK_H heads and
loads each [BLOCK_N, R + Dr] tile of the cache once for all of them, computing its rows' addresses
from the block table: the scores are two dots (q_nope . ckv + q_pe . kpe) and the value dot reuses
the ckv tile already in registers/SMEM. The split plan, the workspace and the merge are common.py's
(shared with the TMA kernel, decode_tma.py, and the Gluon fp8 kernel, decode_fp8.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect
from opmap.core.tiles import tile_config
from opmap.kernels.attention.fp8 import absmax, dot_flags, e4m3_to_f16, f16_factor, scaled_f16
from opmap.kernels.attention.merge import softmax_step
from opmap.kernels.mla import common
from opmap.kernels.mla.common import Workspace, _cache_scale, _split_range, scale_args
from opmap.ops.mla.validate import check_decode, check_sparse_indices

LOG2E = 1.4426950408889634


def default_config(H: int, R: int, B: int) -> dict:
    """The pointer kernel's tiles for H heads, latent rank R and batch B."""
    if H >= 64 and B >= 64:
        # Compute-bound (128 heads share each latent row): 64-head blocks read each KV tile for
        # twice as many heads; at B=16 they lose.
        return dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1)
    # 16 heads x 32 tokens x 512 keeps the fp32 accumulator at 64 registers per thread (4 warps);
    # larger head blocks re-read less KV from L2 but spill on R = 512.
    return dict(BLOCK_H=16, BLOCK_N=32 if R >= 256 else 64, num_warps=4, num_stages=2)


def decode_config(H: int, R: int, B: int, override: Optional[dict] = None) -> dict:
    """The launch config of one decode: ``default_config`` with the keys of ``override`` replaced
    (core/tiles.py)."""
    return tile_config(default_config(H, R, B), override)


def make_workspace(max_batch: int, num_heads: int, rank: int, device, *, num_splits: Optional[int] = None,
                   split_min: int = 256, config: Optional[dict] = None) -> Workspace:
    """Split-KV buffers for this kernel's decodes of up to ``max_batch`` sequences; ``config``: the
    decode config the workspace is for (default: this kernel's at ``max_batch``), which sets the
    split plan (one wave of its programs)."""
    c = decode_config(num_heads, rank, max_batch, config)
    s = num_splits or common.plan_splits(max_batch, num_heads, device, c["BLOCK_H"], c["num_warps"])
    return common.workspace(max_batch, num_heads, rank, device, s, split_min)


@triton.jit
def _f16_queries(qn, qp):
    """q in fp16 for the fp8 cache's fp16 dots (attention/fp8.py), both parts divided by the one
    power of two their largest magnitude needs; returns the factor the scores are scaled back by."""
    f = f16_factor(tl.maximum(absmax(qn), absmax(qp)))
    return scaled_f16(qn, f), scaled_f16(qp, f), f


@triton.jit
def _rows(INDICES, TABLES, b, s_ib, s_tb, s_cp, s_cr, n0, end, seq_len, MAXP, NPAGES,
          BLOCK_N: tl.constexpr, SPARSE: tl.constexpr, PAGE: tl.constexpr):
    """Cache row offsets of the key tile at ``n0`` and which of them are valid (in range, a
    position below the length, a page id inside the cache)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    valid = offs_n < end
    if SPARSE:
        pos = tl.load(INDICES + b * s_ib + offs_n, mask=valid, other=-1)
        valid = valid & (pos >= 0) & (pos < seq_len)
    else:
        pos = offs_n
    pidx = pos // PAGE
    valid = valid & (pidx < MAXP)
    page_id = tl.load(TABLES + b * s_tb + pidx, mask=valid, other=0)
    valid = valid & (page_id >= 0) & (page_id < NPAGES)
    row = page_id.to(tl.int64) * s_cp + (pos % PAGE).to(tl.int64) * s_cr
    return row, valid


@triton.jit
def _mla_decode_kernel(QN, QP, CACHE, SEQ_LENS, TABLES, INDICES, SCALE_PTR, O, LSE, PO, PLSE,
                   sm_scale, kv_scale, H, R, DR, MAXP, NPAGES, K_SPARSE, SPLIT_MIN,
                   s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cr, s_tb, s_ib, s_ob, s_oh,
                   s_pob, s_poh, s_pos, s_plb, s_plh,
                   BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SPARSE: tl.constexpr,
                   FP8: tl.constexpr, SCALE_FROM_PTR: tl.constexpr, IEEE: tl.constexpr,
                   PAGE: tl.constexpr,  # constexpr: // and % by a power of two are shifts
                   F16: tl.constexpr = False,  # fp8 cache: fp16 dots (q in fp16 by _f16_queries)
                   ASM: tl.constexpr = False):  # ... on tiles converted by fp8.e4m3_to_f16 (not interpreted)
    hb = tl.program_id(0)  # fastest: head blocks of one (b, split) run together and share KV in L2
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    seq_len, used, start, end = _split_range(SEQ_LENS, b, split, K_SPARSE, SPLIT_MIN, NUM_SPLITS, BLOCK_N, SPARSE)
    if split >= used:
        return

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_DR)
    mh, mr, md = offs_h < H, offs_r < R, offs_d < DR
    qn = tl.load(QN + b * s_qnb + offs_h[:, None] * s_qnh + offs_r[None, :],
                 mask=mh[:, None] & mr[None, :], other=0.0)
    qp = tl.load(QP + b * s_qpb + offs_h[:, None] * s_qph + offs_d[None, :],
                 mask=mh[:, None] & md[None, :], other=0.0)
    ks = _cache_scale(SCALE_PTR, kv_scale, FP8, SCALE_FROM_PTR)
    qk_scale = sm_scale * ks * 1.4426950408889634  # exp2 domain; the fp8 scale folds in here
    if F16:
        qn, qp, qf = _f16_queries(qn, qp)
        qk_scale = qk_scale * qf

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite, so fully masked tiles give no NaN
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        row, valid = _rows(INDICES, TABLES, b, s_ib, s_tb, s_cp, s_cr, n0, end, seq_len, MAXP, NPAGES,
                           BLOCK_N, SPARSE, PAGE)
        kv = tl.load(CACHE + row[:, None] + offs_r[None, :], mask=valid[:, None] & mr[None, :], other=0.0)
        kpe = tl.load(CACHE + row[:, None] + R + offs_d[None, :], mask=valid[:, None] & md[None, :],
                      other=0.0)
        if ASM:
            kv = e4m3_to_f16(kv)
            kpe = e4m3_to_f16(kpe)
        elif FP8:  # e4m3 -> q dtype is exact; the scale is applied to scores and output instead
            kv = kv.to(qn.dtype)
            kpe = kpe.to(qn.dtype)
        if IEEE:
            s = tl.dot(qn, tl.trans(kv), input_precision="ieee")
            s += tl.dot(qp, tl.trans(kpe), input_precision="ieee")
        else:
            s = tl.dot(qn, tl.trans(kv))
            s += tl.dot(qp, tl.trans(kpe))
        m_i, alpha, p, l_i = softmax_step(tl.where(valid[None, :], s * qk_scale, float("-inf")), m_i, l_i, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision="ieee" if IEEE else None)

    # natural-log LSE of the scores (sm_scale * q.k); -inf where nothing was attended; a NaN in the
    # scores leaves l_i NaN (!= 0), so the output and the LSE are NaN, as in the reference
    l_safe = tl.where(l_i != 0, l_i, 1.0)
    lse = tl.where(l_i != 0, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    acc = acc * (ks / l_safe)[:, None]
    if NUM_SPLITS == 1:
        tl.store(O + b * s_ob + offs_h[:, None] * s_oh + offs_r[None, :], acc.to(O.dtype.element_ty),
                 mask=mh[:, None] & mr[None, :])
        tl.store(LSE + b * H + offs_h, lse, mask=mh)
    else:
        tl.store(PO + b * s_pob + offs_h[:, None] * s_poh + split * s_pos + offs_r[None, :], acc,
                 mask=mh[:, None] & mr[None, :])
        tl.store(PLSE + b * s_plb + offs_h * s_plh + split, lse, mask=mh)


def _launch(q_nope, q_pe, cache, seq_lens, block_tables, indices, scale, kv_scale, return_lse,
            workspace, config=None):
    B, H, R = q_nope.shape
    Dr = q_pe.shape[2]
    expect(cache.dtype in (q_nope.dtype, torch.float8_e4m3fn), "cache", f"dtype {cache.dtype}",
           f"{q_nope.dtype} (as q) or float8_e4m3fn")
    cfg = decode_config(H, R, B, config)
    bh, bn, warps, stages = cfg["BLOCK_H"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]
    out = torch.empty(B, H, R, dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty(B, H, dtype=torch.float32, device=q_nope.device)
    if workspace is None:
        workspace = make_workspace(B, H, R, q_nope.device, config=cfg)
    common.check_workspace(workspace, B, H, R, q_nope.device)
    if B == 0:
        return (out, lse) if return_lse else out
    S = workspace.num_splits
    split_min = max(workspace.split_min, bn)
    sparse = indices is not None
    fp8, from_ptr, scale_ptr, ks_value = scale_args(cache, kv_scale, seq_lens)
    # fp8: fp16 dots, on a GPU on tiles converted by inline PTX (attention/fp8.py; the interpreter
    # runs no PTX and casts); 64-head blocks keep Triton's cast and dots in q's dtype, which
    # measured faster there (docs/mla.md, Decisions).
    dots = dot_flags(cache.dtype, q_nope, bh < 64)
    po, pl = workspace.part_o, workspace.part_lse
    k_sparse = indices.shape[1] if sparse else 0
    _mla_decode_kernel[(triton.cdiv(H, bh), S, B)](
        q_nope, q_pe, cache, seq_lens, block_tables, indices if sparse else seq_lens, scale_ptr,
        out, lse, po, pl, float(scale), ks_value,
        H, R, Dr, block_tables.shape[1], cache.shape[0], k_sparse, split_min,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0),
        cache.stride(1), block_tables.stride(0), indices.stride(0) if sparse else 0,
        out.stride(0), out.stride(1), po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        BLOCK_H=bh, BLOCK_R=triton.next_power_of_2(R), BLOCK_DR=max(16, triton.next_power_of_2(Dr)),
        BLOCK_N=bn, NUM_SPLITS=S, SPARSE=sparse, FP8=fp8, SCALE_FROM_PTR=from_ptr,
        IEEE=q_nope.dtype == torch.float32, PAGE=cache.shape[1], **dots, num_warps=warps,
        num_stages=stages)
    common.merge(workspace, out, lse, seq_lens, k_sparse, split_min, sparse)
    return (out, lse) if return_lse else out


def mla_decode(q_nope, q_pe, cache, seq_lens, block_tables, *, scale: float, kv_scale=None,
               return_lse: bool = False, workspace: Optional[Workspace] = None, config=None):
    check_decode(q_nope, q_pe, cache, seq_lens, block_tables, kv_scale, scale)
    return _launch(q_nope, q_pe, cache, seq_lens, block_tables, None, scale, kv_scale, return_lse,
                   workspace, config)


def mla_sparse_decode(q_nope, q_pe, cache, seq_lens, block_tables, indices, *, scale: float,
                      kv_scale=None, return_lse: bool = False, workspace: Optional[Workspace] = None,
                      config=None):
    check_decode(q_nope, q_pe, cache, seq_lens, block_tables, kv_scale, scale)
    check_sparse_indices(indices, seq_lens)
    return _launch(q_nope, q_pe, cache, seq_lens, block_tables, indices, scale, kv_scale, return_lse,
                   workspace, config)
