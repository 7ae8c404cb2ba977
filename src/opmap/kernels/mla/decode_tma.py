"""MLA decode with the latent tiles loaded by TMA (tensor descriptors), dense 16-bit or fp8 caches:
the ``mla-tma`` backend's decode (pages holding whole key tiles; sparse decode is ``mla-triton``'s).

Why: on sm90 the pointer kernel (decode.py) at 16 heads computes a [BLOCK_N, 576] pointer tile per
key tile; its build has 255 registers and a stack frame, and it waits for every copy it issues
(``async_wait 0``), so one program streams one tile at a time and the 16-head decode reached 0.16
(B=1) to 0.55 (B=64) of the read ceiling. A TMA load takes one row coordinate: no address
registers, the tile lands in shared memory, and the pipeliner can keep ``num_stages`` tiles in
flight.

What changes against the pointer kernel: a key tile lies inside one page (PAGE % BLOCK_N == 0 and
tiles start at multiples of BLOCK_N), so it is one TMA box of a [pages, page, R] view of the cache
(one descriptor for the latent, whose shape stops at R so columns past R read as zeros, one for the
RoPE part). TMA boxes are at most 256 wide, so R = 512 is read as two halves with an accumulator
each. The dots run transposed (keys as rows), on wgmma from shared memory. A split's partial last
tile is read so that it ends at the length (see _step): rows past the length are never read, since
they may hold anything and 0 * NaN would poison the output. A page id outside the cache (never in
a valid table; a captured graph skips the host checks) moves the box out of the descriptor's
pages, which reads zeros, and its scores are masked to -inf, as the pointer kernel does.

fp8 caches: the e4m3 tiles land in shared memory at half the bytes and are converted in registers
before the dots (fp16 dots on PTX-converted tiles at 16-head blocks, Triton's cast to q's dtype at
64-head blocks, as in the pointer kernel: attention/fp8.py); the cache scale multiplies the
scores and the output. Sparse decode (rows from an index list) runs on the pointer kernel.

The split plan, the workspace and the merge are common.py's; this backend's ``make_workspace`` plans
for its own programs (``per_sm``). What the backend declares (ops/mla/backends.py) the entry checks
again on the tensors (``check_inputs``: an InputError, never another kernel).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from opmap.core.contract import expect
from opmap.core.tiles import tile_config
from opmap.kernels.attention.fp8 import absmax, dot_flags, e4m3_to_f16, f16_factor, scaled_f16
from opmap.kernels.attention.merge import softmax_step
from opmap.kernels.attention.tma import MAX_BOX
from opmap.kernels.mla import common
from opmap.kernels.mla.common import Workspace, _cache_scale, _split_range, scale_args
from opmap.ops.mla.validate import check_decode


def default_config(H: int) -> dict:
    """The TMA kernel's tiles. 64 heads or more: 64-head blocks as the rows of wgmma dots, three
    stages so that a tile is in flight during the dots. Fewer: 16-head blocks with the keys as the
    rows of the dots, 32-token tiles at three stages, two programs per SM (``per_sm``). Why these:
    docs/mla.md, Decisions."""
    if H >= 64:
        return dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=3)
    return dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=3)


def decode_config(H: int, override: Optional[dict] = None) -> dict:
    """``default_config`` with the keys of ``override`` replaced (core/tiles.py)."""
    return tile_config(default_config(H), override)


def per_sm(cfg: dict, rank: int = 512, rope_dim: int = 64) -> int:
    """Programs per SM the split plan counts for a config: two 4-warp programs where their stages of
    bf16 tiles fit beside each other in the H200's 228 KB of shared memory (32-token tiles at 2 or
    3 stages), else one."""
    stage = cfg["BLOCK_N"] * (rank + rope_dim) * 2
    return 2 if cfg["num_warps"] <= 4 and 2 * cfg["num_stages"] * stage <= 224 * 1024 else 1


# Fewest keys a split: two 32-key tiles, so that a short context at batch 1 still spreads over many
# programs (docs/mla.md, Decisions: the TMA decode's 64-key minimum split).
SPLIT_MIN = 64


def make_workspace(max_batch: int, num_heads: int, rank: int, device, *, num_splits: Optional[int] = None,
                   split_min: int = SPLIT_MIN, config: Optional[dict] = None) -> Workspace:
    """Split-KV buffers for this kernel's decodes of up to ``max_batch`` sequences, the splits
    planned for the programs of ``config`` (default: this kernel's tiles)."""
    c = decode_config(num_heads, config)
    s = num_splits or common.plan_splits(max_batch, num_heads, device, c["BLOCK_H"], c["num_warps"],
                                         per_sm(c, rank))
    return common.workspace(max_batch, num_heads, rank, device, s, split_min)


def check_inputs(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_n: int, config=None) -> None:
    """What this kernel needs beyond the decode contract (validate.check_decode), at the key tile
    ``block_n`` it will launch: an InputError naming the argument, before any launch."""
    R, Dr = q_nope.shape[2], q_pe.shape[2]
    elt = cache.element_size()
    page = cache.shape[1]
    expect(q_nope.dtype in (torch.bfloat16, torch.float16), "q_nope", f"dtype {q_nope.dtype}",
           "bf16/fp16 (the TMA decode; fp32: the mla-triton backend)")
    expect(cache.dtype in (q_nope.dtype, torch.float8_e4m3fn), "cache", f"dtype {cache.dtype}",
           f"{q_nope.dtype} (as q) or float8_e4m3fn")
    expect(page % block_n == 0, "config" if config and "BLOCK_N" in config else "cache",
           f"page size {page} is not a multiple of BLOCK_N {block_n}", "pages that hold whole key tiles")
    expect(cache.stride(2) == 1 and cache.stride(1) == R + Dr and cache.stride(0) == page * (R + Dr), "cache",
           f"strides {tuple(cache.stride())}", "a contiguous cache (tensor descriptors)")
    expect(((R + Dr) * elt) % 16 == 0 and (R * elt) % 16 == 0 and (Dr * elt) % 16 == 0 and cache.data_ptr() % 16 == 0,
           "cache", f"rows of {R} + {Dr} elements of {elt} bytes", "16-byte aligned rows, latent and RoPE parts (TMA)")
    expect(R <= 2 * MAX_BOX, "q_nope", f"latent rank {R}", f"<= {2 * MAX_BOX} (two TMA boxes)")


def descriptors(cache: torch.Tensor, R: int, Dr: int, block_n: int, block_rh: int, block_dr: int):
    """[pages, page, R] and [pages, page, Dr] views of the cache: a box is one page's rows, so rows
    before the page (negative) or past it read as zeros."""
    P, page, _ = cache.shape
    strides = [page * (R + Dr), R + Dr, 1]
    kv = TensorDescriptor(cache, [P, page, R], strides, [1, block_n, block_rh])
    pe = TensorDescriptor(cache[:, :, R:], [P, page, Dr], strides, [1, block_n, block_dr])
    return kv, pe


@triton.jit
def _page_id(TABLES, b, s_tb, n0, MAXP, PAGE: tl.constexpr):
    """The block-table entry of the tile at n0 (the table's last column past its width: _step
    checks the id). The loops load it one tile ahead and carry it: with the load in the tile's own
    iteration, the sm90 build issued it, waited for it, and only then the tile's TMA copies, at the
    end of the iteration before, so no copy overlapped a tile's dots."""
    return tl.load(TABLES + b * s_tb + tl.minimum(n0 // PAGE, MAXP - 1))


@triton.jit
def _dot_tile(t, dt, FP8: tl.constexpr, ASM: tl.constexpr):
    """A cache tile as the dots take it: an fp8 one converted (exactly) to fp16 by PTX (q was
    brought to fp16, _f16_q) or cast to q's dtype ``dt``; a 16-bit one as it is."""
    if ASM:
        t = e4m3_to_f16(t)
    elif FP8:
        t = t.to(dt)
    return t


@triton.jit
def _step(KV_DESC, PE_DESC, raw, n0, end, MAXP, NPAGES, q0, q1, qp, qk_scale, m_i, l_i, acc0, acc1,
          BLOCK_RH: tl.constexpr, R_CHUNKS: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr,
          PAGE: tl.constexpr, KEYS_ROWS: tl.constexpr, TAIL: tl.constexpr, FP8: tl.constexpr,
          ASM: tl.constexpr):
    """The key tile at n0 (inside one page) through TMA, folded into the online softmax.

    Every dot must have an M side of >= 64 rows to run on wgmma from shared memory (with 16 rows
    it is mma.sync and every tile passes through registers). KEYS_ROWS (head blocks of 16): keys
    as rows, scores^T = K q^T and out^T += V^T p^T, whose M sides are the 64-key tile and the
    latent; q and the accumulators come transposed. Else (head blocks of 64, two warpgroups) heads
    are the rows, as FlashMLA does.

    TAIL 1: n0 is the split's partial last tile, [n0, end) with end - n0 < BLOCK_N. The tile is then
    read ending at ``end`` instead of starting at n0: its rows are the tokens before ``end`` in the
    same page, the ones before the page read as zeros (negative rows are outside the descriptor),
    and the ones before n0 (done already) are masked. Every row is a written token or zero, never
    the unwritten rows past the length, which may hold NaN (0 * NaN would poison the output),
    and no tile passes through registers to be cleaned.

    TAIL 2: any tile of a loop that runs to ``end`` (keys as rows): a whole tile is read from n0,
    a partial one as in TAIL 1. On the H200 the keys-as-rows build with 64-token
    tiles got TAIL 1's separate step after the loop wrong (0.042 off at length 65; whole tiles, 32-
    token tiles and heads as rows right). The cause is not
    known. A guess: that build's shared memory (168 KB) is less than two pipeline stages plus the
    step's own tiles (216 KB), so the step's tiles reuse the loop's buffers; one loop has one set
    of buffers and nothing to reuse. TAIL 0: a whole tile."""
    pidx = n0 // PAGE
    ok = (pidx < MAXP) & (raw >= 0) & (raw < NPAGES)
    page = tl.where(ok, raw, NPAGES)  # a bad page id reads past the descriptor's pages: zeros, masked below
    if TAIL == 2:  # any tile of the one loop: from n0 when whole, else ending at end
        r0 = tl.minimum(n0 % PAGE, end - BLOCK_N - pidx * PAGE)
    elif TAIL == 1:
        r0 = end - BLOCK_N - pidx * PAGE  # may be negative
    else:
        r0 = n0 % PAGE
    kv0 = KV_DESC.load([page, r0, 0]).reshape(BLOCK_N, BLOCK_RH)
    kv1 = kv0
    if R_CHUNKS == 2:
        kv1 = KV_DESC.load([page, r0, BLOCK_RH]).reshape(BLOCK_N, BLOCK_RH)
    kpe = PE_DESC.load([page, r0, 0]).reshape(BLOCK_N, BLOCK_DR)
    # converted after all three copies are issued (the order the sm90 builds were measured in)
    kv0 = _dot_tile(kv0, qp.dtype, FP8, ASM)
    if R_CHUNKS == 2:
        kv1 = _dot_tile(kv1, qp.dtype, FP8, ASM)
    else:
        kv1 = kv0
    kpe = _dot_tile(kpe, qp.dtype, FP8, ASM)
    live = (pidx * PAGE + r0 + tl.arange(0, BLOCK_N)) >= n0  # rows done already (TAIL > 0 only)
    if KEYS_ROWS:
        if TAIL > 0:
            ok = ok & live[:, None]
        st = tl.dot(kv0, q0)  # [BLOCK_N, BLOCK_H]
        if R_CHUNKS == 2:
            st += tl.dot(kv1, q1)
        st += tl.dot(kpe, qp)
        m_i, alpha, pt, l_i = softmax_step(tl.where(ok, st * qk_scale, float("-inf")), m_i, l_i, 0)
        pt = pt.to(kv0.dtype)
        acc0 = acc0 * alpha[None, :] + tl.dot(tl.trans(kv0), pt)  # [BLOCK_RH, BLOCK_H]
        if R_CHUNKS == 2:
            acc1 = acc1 * alpha[None, :] + tl.dot(tl.trans(kv1), pt)
    else:
        if TAIL > 0:
            ok = ok & live[None, :]
        s = tl.dot(q0, tl.trans(kv0))  # [BLOCK_H, BLOCK_N]
        if R_CHUNKS == 2:
            s += tl.dot(q1, tl.trans(kv1))
        s += tl.dot(qp, tl.trans(kpe))
        m_i, alpha, p, l_i = softmax_step(tl.where(ok, s * qk_scale, float("-inf")), m_i, l_i, 1)
        p = p.to(kv0.dtype)
        acc0 = acc0 * alpha[:, None] + tl.dot(p, kv0)  # [BLOCK_H, BLOCK_RH]
        if R_CHUNKS == 2:
            acc1 = acc1 * alpha[:, None] + tl.dot(p, kv1)
    return m_i, l_i, acc0, acc1


@triton.jit
def _f16_q(q0, q1, qp):
    """The query parts in fp16 for the fp8 cache's fp16 dots, divided by the one power of two
    their largest magnitude needs (attention/fp8.py); returns the factor the scores get back."""
    f = f16_factor(tl.maximum(tl.maximum(absmax(q0), absmax(q1)), absmax(qp)))
    return scaled_f16(q0, f), scaled_f16(q1, f), scaled_f16(qp, f), f


@triton.jit
def _mla_decode_tma_kernel(QN, QP, KV_DESC, PE_DESC, SEQ_LENS, TABLES, SCALE_PTR, O, LSE, PO, PLSE,
                           sm_scale, kv_scale, H, R, DR, MAXP, NPAGES, SPLIT_MIN,
                           s_qnb, s_qnh, s_qpb, s_qph, s_tb, s_ob, s_oh,
                           s_pob, s_poh, s_pos, s_plb, s_plh,
                           BLOCK_H: tl.constexpr, BLOCK_RH: tl.constexpr, R_CHUNKS: tl.constexpr,
                           BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           PAGE: tl.constexpr, KEYS_ROWS: tl.constexpr, FP8: tl.constexpr = False,
                           SCALE_FROM_PTR: tl.constexpr = False, ASM: tl.constexpr = False):
    hb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    _, used, start, end = _split_range(SEQ_LENS, b, split, 0, SPLIT_MIN, NUM_SPLITS, BLOCK_N, False)
    if split >= used:
        return
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_RH)
    offs_d = tl.arange(0, BLOCK_DR)
    mh, md = offs_h < H, offs_d < DR
    mr0 = offs_r < R
    mr1 = (offs_r + BLOCK_RH) < R
    if KEYS_ROWS:  # q and the accumulators transposed: [latent, heads]
        qcol = QN + b * s_qnb + offs_h[None, :] * s_qnh
        q0 = tl.load(qcol + offs_r[:, None], mask=mr0[:, None] & mh[None, :], other=0.0)
        q1 = q0
        if R_CHUNKS == 2:
            q1 = tl.load(qcol + BLOCK_RH + offs_r[:, None], mask=mr1[:, None] & mh[None, :], other=0.0)
        qp = tl.load(QP + b * s_qpb + offs_h[None, :] * s_qph + offs_d[:, None], mask=md[:, None] & mh[None, :],
                     other=0.0)
        acc0 = tl.zeros([BLOCK_RH, BLOCK_H], tl.float32)
    else:
        qrow = QN + b * s_qnb + offs_h[:, None] * s_qnh
        q0 = tl.load(qrow + offs_r[None, :], mask=mh[:, None] & mr0[None, :], other=0.0)
        q1 = q0
        if R_CHUNKS == 2:
            q1 = tl.load(qrow + BLOCK_RH + offs_r[None, :], mask=mh[:, None] & mr1[None, :], other=0.0)
        qp = tl.load(QP + b * s_qpb + offs_h[:, None] * s_qph + offs_d[None, :], mask=mh[:, None] & md[None, :],
                     other=0.0)
        acc0 = tl.zeros([BLOCK_H, BLOCK_RH], tl.float32)
    acc1 = acc0
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    ks = 1.0
    if FP8:  # the cache scale folds into the scores here and into the output's divisor below
        ks = _cache_scale(SCALE_PTR, kv_scale, FP8, SCALE_FROM_PTR)
        qk_scale = qk_scale * ks
    if ASM:
        q0, q1, qp, qf = _f16_q(q0, q1, qp)
        qk_scale = qk_scale * qf

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite, so fully masked tiles give no NaN
    l_i = tl.zeros([BLOCK_H], tl.float32)
    # Keys as rows: one loop, the partial last tile in it (read ending at the length; _step's TAIL
    # 2), no second set of tiles after the loop. Heads as rows: the whole tiles, then the partial one.
    loop_end = end
    if not KEYS_ROWS:
        loop_end = start + (end - start) // BLOCK_N * BLOCK_N
    raw_next = _page_id(TABLES, b, s_tb, start, MAXP, PAGE)
    for n0 in range(start, loop_end, BLOCK_N):
        raw = raw_next
        raw_next = _page_id(TABLES, b, s_tb, n0 + BLOCK_N, MAXP, PAGE)
        m_i, l_i, acc0, acc1 = _step(KV_DESC, PE_DESC, raw, n0, end, MAXP, NPAGES, q0, q1, qp, qk_scale, m_i, l_i,
                                     acc0, acc1, BLOCK_RH, R_CHUNKS, BLOCK_DR, BLOCK_N, PAGE, KEYS_ROWS, 2 * KEYS_ROWS,
                                     FP8, ASM)
    if loop_end < end:  # heads as rows: the split's partial last tile, whose page id raw_next holds
        m_i, l_i, acc0, acc1 = _step(KV_DESC, PE_DESC, raw_next, loop_end, end, MAXP, NPAGES, q0, q1, qp, qk_scale,
                                     m_i, l_i, acc0, acc1, BLOCK_RH, R_CHUNKS, BLOCK_DR, BLOCK_N, PAGE, KEYS_ROWS, 1,
                                     FP8, ASM)

    # l_i == 0: nothing attended (-inf); NaN (a NaN score) stays NaN in the output and the LSE
    l_safe = tl.where(l_i != 0, l_i, 1.0)
    lse = tl.where(l_i != 0, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    if FP8:
        l_safe = l_safe / ks
    if KEYS_ROWS:  # [latent, heads]
        acc0 = acc0 / l_safe[None, :]
        acc1 = acc1 / l_safe[None, :]
        off0 = offs_h[None, :] * s_oh + offs_r[:, None]
        poff0 = offs_h[None, :] * s_poh + offs_r[:, None]
        ok0 = mr0[:, None] & mh[None, :]
        ok1 = mr1[:, None] & mh[None, :]
    else:  # [heads, latent]
        acc0 = acc0 / l_safe[:, None]
        acc1 = acc1 / l_safe[:, None]
        off0 = offs_h[:, None] * s_oh + offs_r[None, :]
        poff0 = offs_h[:, None] * s_poh + offs_r[None, :]
        ok0 = mh[:, None] & mr0[None, :]
        ok1 = mh[:, None] & mr1[None, :]
    if NUM_SPLITS == 1:
        o = O + b * s_ob + off0
        tl.store(o, acc0.to(O.dtype.element_ty), mask=ok0)
        if R_CHUNKS == 2:
            tl.store(o + BLOCK_RH, acc1.to(O.dtype.element_ty), mask=ok1)
        tl.store(LSE + b * H + offs_h, lse, mask=mh)
    else:
        o = PO + b * s_pob + split * s_pos + poff0
        tl.store(o, acc0, mask=ok0)
        if R_CHUNKS == 2:
            tl.store(o + BLOCK_RH, acc1, mask=ok1)
        tl.store(PLSE + b * s_plb + offs_h * s_plh + split, lse, mask=mh)


def launch(q_nope, q_pe, cache, seq_lens, block_tables, scale, scales, asm, out, lse, workspace, bh, bn, warps,
           stages):
    """The kernel on inputs ``check_inputs`` accepted, with ``scales`` (common.scale_args' tuple)
    and ``asm`` (the PTX conversion flag of attention/fp8.dot_flags)."""
    B, H, R = q_nope.shape
    Dr = q_pe.shape[2]
    block_r = triton.next_power_of_2(R)
    chunks = 2 if block_r > MAX_BOX else 1
    block_rh = block_r // chunks
    block_dr = max(16, triton.next_power_of_2(Dr))
    kv_desc, pe_desc = descriptors(cache, R, Dr, bn, block_rh, block_dr)
    S = workspace.num_splits
    po, pl = workspace.part_o, workspace.part_lse
    fp8, from_ptr, scale_ptr, ks_value = scales
    _mla_decode_tma_kernel[(triton.cdiv(H, bh), S, B)](
        q_nope, q_pe, kv_desc, pe_desc, seq_lens, block_tables, scale_ptr, out, lse, po, pl, float(scale),
        ks_value, H, R, Dr, block_tables.shape[1], cache.shape[0], max(workspace.split_min, bn),
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), block_tables.stride(0), out.stride(0),
        out.stride(1), po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        BLOCK_H=bh, BLOCK_RH=block_rh, R_CHUNKS=chunks, BLOCK_DR=block_dr, BLOCK_N=bn, NUM_SPLITS=S,
        PAGE=cache.shape[1], KEYS_ROWS=bh < 64, FP8=fp8, SCALE_FROM_PTR=from_ptr, ASM=asm, num_warps=warps,
        num_stages=stages)


def mla_decode(q_nope, q_pe, cache, seq_lens, block_tables, *, scale: float, kv_scale=None,
               return_lse: bool = False, workspace: Optional[Workspace] = None, config=None):
    """The entry of decode.mla_decode's signature (dense decode only); ``config``: tile keys replacing
    ``default_config``'s (BLOCK_H, BLOCK_N, num_warps, num_stages), for tuning."""
    check_decode(q_nope, q_pe, cache, seq_lens, block_tables, kv_scale, scale)
    B, H, R = q_nope.shape
    cfg = decode_config(H, config)
    bh, bn = cfg["BLOCK_H"], cfg["BLOCK_N"]
    check_inputs(q_nope, q_pe, cache, bn, config)
    out = torch.empty(B, H, R, dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty(B, H, dtype=torch.float32, device=q_nope.device)
    if workspace is None:
        workspace = make_workspace(B, H, R, q_nope.device, config=cfg)
    common.check_workspace(workspace, B, H, R, q_nope.device)
    if B > 0:
        scales = scale_args(cache, kv_scale, seq_lens)
        # fp8: fp16 dots on PTX-converted tiles at 16-head blocks, Triton's cast at 64 (attention/fp8.py)
        asm = dot_flags(cache.dtype, q_nope, bh < 64)["ASM"]
        launch(q_nope, q_pe, cache, seq_lens, block_tables, scale, scales, asm, out, lse, workspace, bh, bn,
               cfg["num_warps"], cfg["num_stages"])
        common.merge(workspace, out, lse, seq_lens, 0, max(workspace.split_min, bn), False)
    return (out, lse) if return_lse else out
