"""MLA decode in Triton: absorbed form, split-KV with an LSE merge, dense or top-k sparse.

Entries (signatures in reference.py): ``mla_decode``, ``mla_sparse_decode``, ``make_workspace``.

Every head attends to the same latent rows, so one program takes a block of BLOCK_H heads and
loads each [BLOCK_N, R + Dr] tile of the cache once for all of them: the scores are two dots
(q_nope . ckv + q_pe . kpe) and the value dot reuses the ckv tile already in registers/SMEM.

Split-KV plan, device-side: the grid is fixed by (batch, head blocks, ``num_splits``) so that a
captured CUDA graph replays for any lengths; each program derives from ``seq_lens[b]`` (read on
the device) how many splits this sequence uses (one per ``split_min`` tokens, at most
``num_splits``) and which token range is its own. Programs past the used splits exit at once.
With one split the kernel writes the output directly; otherwise partial outputs and LSEs go to the
persistent workspace and ``_mla_merge_kernel`` combines them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect
from opmap.kernels.attention.fp8 import absmax, dot_flags, e4m3_to_f16, f16_factor, scaled_f16
from opmap.kernels.attention.merge import _softmax_step, _split_sum
from opmap.core.tiles import tile_config
from opmap.kernels.attention.common import interpreted
from opmap.kernels.mla import decode_fp8
from opmap.kernels.mla import decode_tma
from opmap.kernels.mla.common import _cache_scale, _split_range, scale_args
from opmap.ops.mla.validate import check_decode, check_sparse_indices

LOG2E = 1.4426950408889634


@dataclass
class Workspace:
    """Persistent split-KV buffers: allocate once (per batch bucket) and reuse across steps."""

    part_o: torch.Tensor  # [max_batch, H, num_splits, R] fp32
    part_lse: torch.Tensor  # [max_batch, H, num_splits] fp32
    num_splits: int
    split_min: int  # fewest tokens per split (the device-side plan never cuts finer)

    @property
    def max_batch(self) -> int:
        return self.part_o.shape[0]


def _sm_count(device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: any small number exercises the split path


def plan_splits(batch: int, num_heads: int, device, block_h: int = 16, warps: int = 4, per_sm: int = 0) -> int:
    """Splits per sequence: as many as fit in one wave (floor, so that a partial second wave does
    not double the time), at most 128. A wave is two 4-warp programs per SM, or one 8-warp program
    (the 64-head blocks: on the H200 at B=64, 128 heads, two splits of them took 626 us and one 568),
    or ``per_sm`` where given (the TMA kernel's two 72 KB stages leave room for one per SM)."""
    progs = max(batch, 1) * triton.cdiv(num_heads, block_h)
    per_sm = per_sm or (2 if warps <= 4 else 1)
    return max(1, min(128, per_sm * _sm_count(device) // progs))


def _per_sm(cfg: dict, rank: int = 512, rope_dim: int = 64, gluon: bool = False) -> int:
    """Programs per SM the split plan counts for a config: by warps for the pointer kernel; for the
    TMA kernel two 4-warp programs where their stages of bf16 tiles fit beside each other in the
    H200's 228 KB of shared memory (32-token tiles at 2 or 3 stages), else one; two for the Gluon
    fp8 kernel (``gluon``: 106 KB of shared memory a program)."""
    if gluon:
        return 2
    if cfg["TMA"]:
        stage = cfg["BLOCK_N"] * (rank + rope_dim) * 2
        return 2 if cfg["num_warps"] <= 4 and 2 * cfg["num_stages"] * stage <= 224 * 1024 else 1
    return 1 if cfg["num_warps"] > 4 else 2


def make_workspace(max_batch: int, num_heads: int, rank: int, device, *,
                   num_splits: Optional[int] = None, split_min: int = 256, config: Optional[dict] = None,
                   kv_dtype: Optional[torch.dtype] = None) -> Workspace:
    """``config``: the decode config the workspace is for (a dict as ``mla_decode`` takes; default:
    the dense 16-bit default), which sets the split plan; ``kv_dtype``: the cache's dtype where it
    is not q's (an fp8 cache at R = 512 runs the Gluon kernel, decode_fp8.py, planned for its
    16-head programs)."""
    c = tile_config(_tma_config(num_heads), config)
    gluon = bool(c["GLUON"]) and kv_dtype == torch.float8_e4m3fn and rank == decode_fp8.RANK
    bh, warps = (decode_fp8.BLOCK_H, decode_fp8.NUM_WARPS) if gluon else (c["BLOCK_H"], c["num_warps"])
    s = num_splits or plan_splits(max_batch, num_heads, device, bh, warps, _per_sm(c, rank, gluon=gluon))
    expect(s >= 1, "num_splits", s, ">= 1")
    expect(split_min >= 1, "split_min", split_min, ">= 1")
    return Workspace(torch.empty(max_batch, num_heads, s, rank, dtype=torch.float32, device=device),
                     torch.empty(max_batch, num_heads, s, dtype=torch.float32, device=device), s, split_min)


def _tma_config(H: int) -> dict:
    """The TMA kernel's tiles, the default for dense 16-bit caches on pages of 64 or more.
    64 heads or more: 64-head blocks as the rows of wgmma dots, three stages so that a tile is in
    flight during the dots. Fewer: 16-head blocks with the keys as the rows of the dots, 32-token
    tiles at three stages, two programs per SM (_per_sm). Figures: docs/mla.md, Decisions."""
    if H >= 64:
        return dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=3, TMA=1, GLUON=1)
    return dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=3, TMA=1, GLUON=1)


def _pointer_config(H: int, R: int, B: int) -> dict:
    """The pointer kernel's tiles (fp8 and sparse decode, pages the TMA kernel cannot tile)."""
    if H >= 64 and B >= 64:
        # Compute-bound (128 heads share each latent row): 64-head blocks read each KV tile for
        # twice as many heads; at B=16 they lose.
        return dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1, TMA=0, GLUON=1)
    # 16 heads x 32 tokens x 512 keeps the fp32 accumulator at 64 registers per thread (4 warps);
    # larger head blocks re-read less KV from L2 but spill on R = 512.
    return dict(BLOCK_H=16, BLOCK_N=32 if R >= 256 else 64, num_warps=4, num_stages=2, TMA=0, GLUON=1)


def decode_config(q_nope, q_pe, cache, sparse: bool, override: Optional[dict] = None) -> dict:
    """The launch config of one decode: the TMA kernel's where it can read the cache (dense,
    16-bit, pages a multiple of 64: the pages its GPU tests cover), else the pointer kernel's;
    ``override`` replaces keys (core/tiles.py). An override asking for TMA where the TMA kernel
    cannot read the cache is an InputError."""
    B, H, R = q_nope.shape
    tma = _tma_config(H)
    # fp8 caches: the TMA kernel from 64 heads (128 heads B=64/4096 660.9 vs 766.8 us on the
    # pointer kernel, B=1/32k 105.8 vs 135.3); at 16 heads the pointer kernel (B=64/4096 135.3 vs
    # 142.2; docs/mla.md, Decisions)
    default_ok = (not sparse and (cache.dtype != torch.float8_e4m3fn or H >= 64) and cache.shape[1] % 64 == 0
                  and decode_tma.usable(cache, q_nope, R, q_pe.shape[2], tma["BLOCK_N"]) is None)
    cfg = tile_config(tma if default_ok else _pointer_config(H, R, B), override)
    if cfg["TMA"]:
        why = "sparse decode reads rows by index" if sparse else decode_tma.usable(
            cache, q_nope, R, q_pe.shape[2], cfg["BLOCK_N"])
        expect(why is None, "config", f"TMA=1 {override}", f"a cache the TMA path can read ({why})")
    return cfg


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
        m_i, alpha, p, l_i = _softmax_step(tl.where(valid[None, :], s * qk_scale, float("-inf")), m_i, l_i, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision="ieee" if IEEE else None)

    # natural-log LSE of the scores (sm_scale * q.k); -inf where nothing was attended
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    acc = acc * (ks / l_safe)[:, None]
    if NUM_SPLITS == 1:
        tl.store(O + b * s_ob + offs_h[:, None] * s_oh + offs_r[None, :], acc.to(O.dtype.element_ty),
                 mask=mh[:, None] & mr[None, :])
        tl.store(LSE + b * H + offs_h, lse, mask=mh)
    else:
        tl.store(PO + b * s_pob + offs_h[:, None] * s_poh + split * s_pos + offs_r[None, :], acc,
                 mask=mh[:, None] & mr[None, :])
        tl.store(PLSE + b * s_plb + offs_h * s_plh + split, lse, mask=mh)


@triton.jit
def _mla_merge_kernel(SEQ_LENS, PO, PLSE, O, LSE, H, R, K_SPARSE, SPLIT_MIN,
                      s_pob, s_poh, s_pos, s_plb, s_plh, s_ob, s_oh,
                      BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, S_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      SPARSE: tl.constexpr):
    """out[b, h, r-block] = the LSE-weighted mean of the used splits' partials (the attention
    package's merge._split_sum; the loop before it made one latency-bound load per split, 128 at
    B=1), over a grid that also splits R."""
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rb = tl.program_id(2)
    if SPARSE:
        total = tl.load(SEQ_LENS + b) * 0 + K_SPARSE
    else:
        total = tl.load(SEQ_LENS + b)
    used = tl.maximum(tl.minimum(tl.cdiv(total, SPLIT_MIN), NUM_SPLITS), 1)  # the decode's plan
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    mr = offs_r < R
    acc, m, l = _split_sum(PLSE + b * s_plb + h * s_plh, PO + b * s_pob + h * s_poh, s_pos, used, offs_r, mr,
                           S_P, BLOCK_S, False)
    l_safe = tl.where(l > 0, l, 1.0)
    tl.store(O + b * s_ob + h * s_oh + offs_r, (acc / l_safe).to(O.dtype.element_ty), mask=mr)
    if rb == 0:
        tl.store(LSE + b * H + h, tl.where(l > 0, m + tl.log(l_safe), float("-inf")))


def _merge_block_r(B: int, H: int, R: int, device) -> int:
    """The merge's latent block: the whole row (one program per head and sequence) when those
    programs fill the GPU, else blocks of 128 for more programs. Split at B=1 with 16 heads, 64
    programs instead of 16 took the decode from 62.4 to 42.4 us on the H200. Split at B=64,
    4096 programs of 128 lanes where 1024 whole rows had filled the GPU, it went from 129.4 to
    139.6 us. Whole rows there restore the earlier grid shape; not yet timed."""
    r = triton.next_power_of_2(R)
    return r if B * H >= 4 * _sm_count(device) else min(128, r)


def _launch(q_nope, q_pe, cache, seq_lens, block_tables, indices, scale, kv_scale, return_lse,
            workspace, config=None):
    B, H, R = q_nope.shape
    Dr = q_pe.shape[2]
    expect(cache.dtype in (q_nope.dtype, torch.float8_e4m3fn), "cache", f"dtype {cache.dtype}",
           f"{q_nope.dtype} (as q) or float8_e4m3fn")
    cfg = decode_config(q_nope, q_pe, cache, indices is not None, config)
    bh, bn, warps, stages, tma = cfg["BLOCK_H"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"], cfg["TMA"]
    out = torch.empty(B, H, R, dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty(B, H, dtype=torch.float32, device=q_nope.device)
    if workspace is None:
        workspace = make_workspace(B, H, R, q_nope.device, config=cfg, kv_dtype=cache.dtype)
    expect(workspace.max_batch >= B and workspace.part_o.shape[1] == H and workspace.part_o.shape[3] == R,
           "workspace", f"buffers {tuple(workspace.part_o.shape)}", f"at least ({B}, {H}, splits, {R})")
    expect(workspace.part_o.device == q_nope.device, "workspace", str(workspace.part_o.device),
           str(q_nope.device))
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
    grid = (triton.cdiv(H, bh), S, B)
    if cfg["GLUON"] and decode_fp8.usable(q_nope, q_pe, cache, sparse, interpreted(q_nope.device)):
        # fp8 caches at DeepSeek's dims: each tile converted in registers from one shared-memory read
        # (decode_fp8.py); GLUON=0 keeps the Triton kernels
        decode_fp8.launch(q_nope, q_pe, cache, seq_lens, block_tables, scale_ptr, ks_value, from_ptr, scale, out, lse,
                          po, pl, S, split_min)
    elif tma:
        decode_tma.launch(q_nope, q_pe, cache, seq_lens, block_tables, scale, (fp8, from_ptr, scale_ptr, ks_value),
                          dots["ASM"], out, lse, workspace, bh, bn, warps, stages)
    else:
        _mla_decode_kernel[grid](
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
    if S > 1:
        br = _merge_block_r(B, H, R, q_nope.device)
        s_p = triton.next_power_of_2(S)
        _mla_merge_kernel[(H, B, triton.cdiv(R, br))](
            seq_lens, po, pl, out, lse, H, R, k_sparse, split_min, po.stride(0), po.stride(1), po.stride(2),
            pl.stride(0), pl.stride(1), out.stride(0), out.stride(1), BLOCK_R=br, BLOCK_S=min(s_p, 4096 // br),
            S_P=s_p, NUM_SPLITS=S, SPARSE=sparse, num_warps=4)
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
