"""Triton sampler: exact top-k / top-p / min-p sampling without sorting the vocabulary.

Entry ``sample(logits[B, V], temperature, top_k, top_p, min_p, seeds, positions) -> (ids int64 [B],
invalid bool [B])``; the contract is the reference's (``opmap.ops.sampling.reference``).

One program per row. With z = (x - max) / T, the support is always a *prefix* of the order
(z descending, id ascending), so it is fully described by a boundary key t and the number n of
tokens equal to t that are kept (the n lowest ids): keep = z > t, or z == t and tie rank < n.

1. Pass A over the row: max, the greedy id (lowest id among maxima), NaN / +inf detection,
   the count of finite values, and, only where needed, the total mass sum(exp(z)) (top-p without
   min-p) or the whole draw (rows without any filter: an exponential race fused into this pass).
   On the GPU pass A is split over chunks of the row (``_sample_partials_kernel``), and pass B
   (``_sample_hist_kernel``, same chunks) counts z into 128 exact bins (1/32 nat near the max, wider
   below; ``sampler_jit.HIST_TIERS``): the counts bracket
   the top-k boundary exactly and bounds of the bins' mass bracket a top-p-alone boundary
   (``_sample_bracket_kernel``, one program per row), so the search below starts inside one bin; when
   at most CAND values lie above it, pass C (``_sample_gather_kernel``, same chunks) gathers them and
   this row's program reads no full row at all. A top-p-alone row with more values above the
   bracket (a flat nucleus of thousands of tokens) first gets pass B2 (``_sample_refine_kernel``):
   128 fine bins inside the bracket and the exact mass above it. Pass C then gathers the values
   inside the narrowed bracket and sums those above it (count, mass, race winner) per chunk;
   those enter the search and the draw as figures.
2. top-k (and min-p, whose cut log(min_p) is a known key): bisection over keys for the largest
   key t with count(z >= t) >= k. Each step is one pass that returns, for the midpoint, the
   count and mass above it plus the nearest keys on both sides with their multiplicities, so the
   search stops as soon as a boundary is pinned down (ties resolved exactly).
3. top-p over that support: the same search with the mass as metric and target p * mass(support).
4. The draw: Gumbel-max (exponential race) over the support, noise from Philox keyed by
   (seed; token id, position), so a row's result never depends on its batch, no host sync.
As soon as at most CAND values can still lie at or above the lower bound of the search, they are
compacted (one pass) into a per-row scratch and loaded into registers: the remaining steps and
the draw then touch no memory. A typical top-k 50 / top-p 0.9 row reads the row ~4-5 times.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect
from opmap.kernels import pdl
from opmap.kernels.pdl import enter
from opmap.kernels.sampling.sampler_jit import (HIST_NB, INT_MAX, KEY_NEG_INF, NB2, PART, _combine_parts, _fine_bin,  # noqa: F401
                          _fine_bracket, _gumbel, _hist_bins, _hist_bracket, _key, _load_z, _parts_max, _pass_a,
                          _put_candidates, _race_block, _race_lanes, _search, _unkey)
from opmap.ops.sampling.validate import FLT_MIN as FLT_MIN_F32, check_sample_args

__all__ = ["sample", "support_from_boundary"]

# Ints per row of the bracket record: mode, lo, hi, count >= lo, gathered (_sample_bracket_kernel);
# then the fine bracket of a top-p-alone row with more than CAND values above lo: state (0 none,
# 1 refined by _sample_refine_kernel, 2 its fine bracket gathered), lo2, hi2 (_sample_gather_kernel).
BR = tl.constexpr(8)
FLT_MIN = tl.constexpr(FLT_MIN_F32)  # the smallest normal fp32 value: see _row_flags


@triton.jit
def not_(x):
    return x == 0


@triton.jit
def _row_flags(temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V):
    T = tl.load(temp_ptr + row)
    k = tl.minimum(tl.load(topk_ptr + row).to(tl.int64), V).to(tl.int32)
    # Subnormal parameters: the GPU build flushes them to zero, the interpreter does not; each has
    # the one meaning validate.FLT_MIN gives it (the reference's too).
    p = tl.maximum(tl.load(topp_ptr + row), FLT_MIN)
    mp = tl.load(minp_ptr + row)
    # div_rn: the IEEE-rounded reciprocal, so that z matches PyTorch's bit for bit on the GPU too.
    inv_t = tl.where(T > 0.0, tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.where(T > 0.0, T, 1.0)), 1.0)
    greedy = (T < FLT_MIN) | (k == 1)
    use_k = (k > 1) & (k < V)
    use_p = p < 1.0
    use_mp = mp >= FLT_MIN
    unfiltered = (not_(use_k | use_p | use_mp)) & not_(greedy)
    need_s = use_p & not_(use_mp) & not_(greedy)
    return k, p, mp, greedy, inv_t, use_k, use_p, use_mp, unfiltered, need_s


@triton.jit
def _sample_partials_kernel(logits_ptr, stride_row, V, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr,
                            part_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                            AHEAD: tl.constexpr = True):
    """Pass A of one chunk of a row (grid: rows x chunks), so that a row is read by many SMs.
    AHEAD (here and in passes B and C): the next block's load in flight during the current one."""
    enter(PDL)  # under PDL: wait for the kernel before (see ops.pdl)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    k, p, mp, greedy, inv_t, use_k, use_p, use_mp, unfiltered, need_s = _row_flags(
        temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    m, gid, bad, n_fin, s, rb_x, rb_g, rb_id, xmin = _pass_a(logits_ptr + row * stride_row, lo, hi, inv_t, seed,
                                                             pos, need_s, unfiltered, BLOCK, AHEAD)
    out = part_ptr + (row * tl.num_programs(1) + c) * PART
    tl.store(out + 0, m)
    tl.store(out + 1, gid.to(tl.float32))  # ids and counts < 2**24: exact in fp32
    tl.store(out + 2, bad.to(tl.float32))
    tl.store(out + 3, n_fin.to(tl.float32))
    tl.store(out + 4, s)
    tl.store(out + 5, rb_x)
    tl.store(out + 6, rb_g)
    tl.store(out + 7, rb_id.to(tl.float32))
    tl.store(out + 8, xmin)


@triton.jit
def _chunk(logits_ptr, stride_row, row, c, part_ptr, n_parts, V, CHUNK: tl.constexpr, S_P: tl.constexpr):
    """(row pointer, row max from pass A's partials, lo, hi) of chunk c of a row, for passes B and C."""
    lo = c * CHUNK
    return (logits_ptr + row * stride_row, _parts_max(part_ptr + row * n_parts * PART, n_parts, S_P), lo,
            tl.minimum(lo + CHUNK, V))


@triton.jit
def _sample_hist_kernel(logits_ptr, stride_row, V, temp_ptr, topk_ptr, topp_ptr, minp_ptr, part_ptr, n_parts,
                        hist_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, S_P: tl.constexpr,
                        PDL: tl.constexpr = False, AHEAD: tl.constexpr = True):
    """Pass B of one chunk of a row (grid: rows x chunks): the count histogram of z, for the rows
    whose first search is top-k or top-p alone. The row max comes from pass A's partials."""
    enter(PDL)  # under PDL: wait for the kernel before (see ops.pdl)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    k, p, mp, greedy, inv_t, use_k, use_p, use_mp, unfiltered, need_s = _row_flags(
        temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
    h = tl.zeros([HIST_NB], tl.int32)
    if not_(greedy) & (use_k | (use_p & not_(use_mp))):
        row_ptr, m, lo, hi = _chunk(logits_ptr, stride_row, row, c, part_ptr, n_parts, V, CHUNK, S_P)
        if AHEAD:
            z_n = _load_z(row_ptr, lo + tl.arange(0, BLOCK), hi, m, inv_t)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            if AHEAD:
                z = z_n
                z_n = _load_z(row_ptr, offs + BLOCK, hi, m, inv_t)  # see sampler_jit's _ahead
            else:
                z = _load_z(row_ptr, offs, hi, m, inv_t)
            h += _hist_bins(z, (offs < hi) & (z > float("-inf")), HIST_NB)
    tl.store(hist_ptr + (row * n_parts + c) * HIST_NB + tl.arange(0, HIST_NB), h)


@triton.jit
def _lo0(m, xmin, n_fin, inv_t, mp, use_mp):
    """The lowest key a search needs: the min-p cut, else the smallest finite z (as _load_z
    computes it)."""
    zmin_key = _key((tl.where(n_fin > 0, xmin, m) - m) * inv_t + 0.0)
    return tl.where(use_mp, _key(tl.log(tl.where(use_mp, mp, 1.0))), tl.maximum(zmin_key, KEY_NEG_INF + 1))


@triton.jit
def _sample_bracket_kernel(temp_ptr, topk_ptr, topp_ptr, minp_ptr, V, part_ptr, n_parts, hist_ptr, br_ptr,
                           cnt_ptr, CAND: tl.constexpr, S_P: tl.constexpr, PDL: tl.constexpr = False):
    """Per row, from pass A's partials and pass B's histogram: the bracket of the first search
    (BR ints: mode 0 none / 1 top-k / 2 top-p alone, lo, hi, count at or above lo, gathered) and
    whether its candidates (at most CAND) are gathered by _sample_gather_kernel. Zeroes the row's counter."""
    enter(PDL)  # under PDL: wait for the kernel before (see ops.pdl)
    row = tl.program_id(0).to(tl.int64)
    k, p, mp, greedy, inv_t, use_k, use_p, use_mp, unfiltered, need_s = _row_flags(
        temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
    m, gid, bad, n_fin, s, rb_id, xmin = _combine_parts(part_ptr + row * n_parts * PART, n_parts, inv_t, S_P)
    lo0 = _lo0(m, xmin, n_fin, inv_t, mp, use_mp)
    first_p = use_p & not_(use_k | use_mp)
    mode = tl.zeros([], tl.int32)
    lo = lo0
    hi = tl.zeros([], tl.int32)
    c = n_fin
    if not_(greedy) & (use_k | first_p) & (bad == 0) & (m > float("-inf")):
        target = tl.where(use_k, k.to(tl.float32), p * s)
        ok, lo_h, hi_h, c_h = _hist_bracket(hist_ptr + row * n_parts * HIST_NB, n_parts, target,
                                            first_p.to(tl.int32), HIST_NB)
        if ok:
            # A higher min-p cut only tightens lo; hi >= lo keeps the search's first evaluation.
            mode = tl.where(use_k, 1, 2)
            lo = tl.maximum(lo0, lo_h)
            hi = tl.maximum(hi_h, lo)
            c = tl.minimum(n_fin, c_h)
    out = br_ptr + row * BR
    tl.store(out + 0, mode)
    tl.store(out + 1, lo)
    tl.store(out + 2, hi)
    tl.store(out + 3, c)
    tl.store(out + 4, ((mode > 0) & (c <= CAND)).to(tl.int32))
    # Min-p alone: the support is {key >= lo0}, known now; the gather races over it (state 3).
    mp_alone = use_mp & not_(use_k | use_p) & not_(greedy) & (bad == 0) & (m > float("-inf"))
    tl.store(out + 5, tl.where(mp_alone, 3, ((mode == 2) & (c > CAND)).to(tl.int32)))
    tl.store(cnt_ptr + row, 0)


@triton.jit
def _sample_refine_kernel(logits_ptr, stride_row, V, temp_ptr, topk_ptr, topp_ptr, minp_ptr, part_ptr, n_parts,
                          br_ptr, hist_ptr, agg_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, S_P: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Pass B2 of one chunk of a row (grid: rows x chunks), for top-p-alone rows whose bracket
    holds more than CAND values (flat rows: a nucleus of thousands of tokens whose boundary lies
    in a half-nat bin): NB2 fine bins of z inside the bracket [lo, hi], and the exact count and
    mass of the values above hi. _sample_gather_kernel narrows the bracket from them."""
    enter(PDL)  # under PDL: wait for the kernel before (see ops.pdl)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if tl.load(br_ptr + row * BR + 5) == 1:
        k, p, mp, greedy, inv_t, use_k, use_p, use_mp, unfiltered, need_s = _row_flags(
            temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
        lo_key = tl.load(br_ptr + row * BR + 1)
        hi_key = tl.load(br_ptr + row * BR + 2)
        z_lo = _unkey(lo_key)
        span = _unkey(hi_key) - z_lo
        inv_w = tl.where(span > 0.0, NB2 / tl.where(span > 0.0, span, 1.0), 0.0)
        row_ptr, m, lo, hi = _chunk(logits_ptr, stride_row, row, c, part_ptr, n_parts, V, CHUNK, S_P)
        h = tl.zeros([NB2], tl.int32)
        c_v = tl.zeros([BLOCK], tl.int32)
        w_v = tl.zeros([BLOCK], tl.float32)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            z = _load_z(row_ptr, offs, hi, m, inv_t)
            kz = _key(z)
            ok = offs < hi
            inr = ok & (kz >= lo_key) & (kz <= hi_key)
            h += tl.histogram(tl.where(inr, _fine_bin(z, z_lo, inv_w), 0), NB2, mask=inr)
            ab = ok & (kz > hi_key)
            c_v += ab.to(tl.int32)
            w_v += tl.where(ab, tl.exp(z), 0.0)
        tl.store(hist_ptr + (row * n_parts + c) * NB2 + tl.arange(0, NB2), h)
        tl.store(agg_ptr + (row * n_parts + c) * 2, tl.sum(c_v, 0).to(tl.float32))
        tl.store(agg_ptr + (row * n_parts + c) * 2 + 1, tl.sum(w_v, 0))


@triton.jit
def _sample_gather_kernel(logits_ptr, stride_row, V, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr,
                          part_ptr, n_parts, br_ptr, sz_ptr, si_ptr, cnt_ptr, hist_ptr, agg_ptr, agg2_ptr,
                          CAND: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, S_P: tl.constexpr,
                          PDL: tl.constexpr = False, AHEAD: tl.constexpr = True):
    """Pass C of one chunk of a row (grid: rows x chunks): copy the values at or above the
    bracket's lo to the row's candidate scratch, where _sample_bracket_kernel found at most CAND of them.
    The per-row kernel then starts from those candidates in registers and reads no full row:
    the compaction pass it would run alone on one SM is spread over the GPU here.

    A refined row (record state != 0) gets its fine bracket [lo2, hi2] from pass B2's figures
    (every chunk's program computes the same one; chunk 0 records it). When at most CAND values
    are estimated inside it, those are gathered, and the values above hi2 (surely kept) are summed
    here instead: count, mass and their race winner (z + Gumbel noise, lowest id on a tie), per
    chunk into agg2, for the per-row kernel. A min-p-alone row (state 3) gets the same figures over
    its whole support {key >= lo} and no candidates: its draw is done here, spread over the chunks,
    instead of one program racing over the whole row."""
    enter(PDL)  # under PDL: wait for the kernel before (see ops.pdl)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    go = tl.load(br_ptr + row * BR + 4) != 0
    st = tl.load(br_ptr + row * BR + 5)
    refined = (st == 1) | (st == 2)
    race_only = st == 3
    if go | refined | race_only:
        k, p, mp, greedy, inv_t, use_k, use_p, use_mp, unfiltered, need_s = _row_flags(
            temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
        lo_key = tl.load(br_ptr + row * BR + 1)
        hi_key = tl.full([], INT_MAX, tl.int32)
        if refined:
            m_row, gid, bad, n_fin, s, rb_id, xmin = _combine_parts(part_ptr + row * n_parts * PART, n_parts, inv_t, S_P)
            lo2, hi2, c_in = _fine_bracket(hist_ptr + row * n_parts * NB2, agg_ptr + row * n_parts * 2, n_parts,
                                           lo_key, tl.load(br_ptr + row * BR + 2), p * s, S_P)
            go = c_in <= CAND
            lo_key = lo2
            hi_key = hi2
            if go & (c == 0):
                tl.store(br_ptr + row * BR + 6, lo2)
                tl.store(br_ptr + row * BR + 7, hi2)
                tl.store(br_ptr + row * BR + 5, 2)  # the other programs read it as "refined" either way
        if race_only:
            hi_key = lo_key - 1  # every kept value lies "above": no candidate, only the figures
            go = go | race_only
        if go:
            row_ptr, m, lo, hi = _chunk(logits_ptr, stride_row, row, c, part_ptr, n_parts, V, CHUNK, S_P)
            if refined | race_only:
                seed = tl.load(seed_ptr + row)
                pos = tl.load(pos_ptr + row)
                c_v = tl.zeros([BLOCK // 4], tl.int32)
                w_v = tl.zeros([BLOCK // 4], tl.float32)
                gb = tl.full([BLOCK // 4], float("-inf"), tl.float32)
                gi = tl.full([BLOCK // 4], INT_MAX, tl.int32)
                # A quarter block: four per-lane vectors and the noise at BLOCK would need 192
                # registers, and the plain gather below shares this kernel's allocation.
                for start in range(lo, hi, BLOCK // 4):
                    offs = start + tl.arange(0, BLOCK // 4)
                    z = _load_z(row_ptr, offs, hi, m, inv_t)
                    kz = _key(z)
                    sel = (offs < hi) & (kz >= lo_key) & (kz <= hi_key)
                    _put_candidates(z, offs, sel, sz_ptr + row * CAND, si_ptr + row * CAND, cnt_ptr + row, CAND)
                    ab = (offs < hi) & (kz > hi_key)
                    c_v += ab.to(tl.int32)
                    w_v += tl.where(ab, tl.exp(z), 0.0)
                    g = tl.where(ab, z + _gumbel(seed, pos, offs), float("-inf"))
                    better = g > gb  # strict: within a lane the earlier (lower) id keeps a tie
                    gi = tl.where(better, offs, gi)
                    gb = tl.where(better, g, gb)
                g_max = tl.max(gb, 0)
                q = agg2_ptr + (row * n_parts + c) * 4
                tl.store(q, tl.sum(c_v, 0).to(tl.float32))
                tl.store(q + 1, tl.sum(w_v, 0))
                tl.store(q + 2, g_max)
                tl.store(q + 3, tl.min(tl.where(gb == g_max, gi, INT_MAX), 0).to(tl.float32))
            else:
                if AHEAD:
                    z_n = _load_z(row_ptr, lo + tl.arange(0, BLOCK), hi, m, inv_t)
                for start in range(lo, hi, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    if AHEAD:
                        z = z_n
                        z_n = _load_z(row_ptr, offs + BLOCK, hi, m, inv_t)  # see sampler_jit's _ahead
                    else:
                        z = _load_z(row_ptr, offs, hi, m, inv_t)
                    sel = (offs < hi) & (_key(z) >= lo_key)
                    _put_candidates(z, offs, sel, sz_ptr + row * CAND, si_ptr + row * CAND, cnt_ptr + row, CAND)


@triton.jit
def _above_fine(agg2_ptr, n_parts, S_P: tl.constexpr):
    """The values above a row's fine bracket, from the gather's per-chunk figures in a fixed order
    (so the same bits in any batch): count, mass, and the race winner (g, id; lowest id on a tie)."""
    j = tl.arange(0, S_P)
    ok = j < n_parts
    q = agg2_ptr + j * 4
    c_ab = tl.sum(tl.load(q, mask=ok, other=0.0), 0).to(tl.int32)
    w_ab = tl.sum(tl.load(q + 1, mask=ok, other=0.0), 0)
    g = tl.load(q + 2, mask=ok, other=float("-inf"))
    g_ab = tl.max(g, 0)
    id_ab = tl.min(tl.where(ok & (g == g_ab) & (g > float("-inf")),
                            tl.load(q + 3, mask=ok, other=0.0).to(tl.int32), INT_MAX), 0)
    return c_ab, w_ab, g_ab, id_ab


@triton.jit
def _sample_kernel(logits_ptr, stride_row, V, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr,
                   ids_ptr, invalid_ptr, support_ptr, sz_ptr, si_ptr, cnt_ptr, part_ptr, n_parts, br_ptr, agg2_ptr,
                   BLOCK: tl.constexpr, CAND: tl.constexpr, WRITE_SUPPORT: tl.constexpr,
                   USE_PARTS: tl.constexpr, S_P: tl.constexpr, HIST: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)  # under PDL: wait for the kernel before (see ops.pdl)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    k, p, mp, greedy, inv_t, use_k, use_p, use_mp, unfiltered, need_s = _row_flags(
        temp_ptr, topk_ptr, topp_ptr, minp_ptr, row, V)
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)

    # ---- pass A: max, greedy id, NaN/+inf, finite count, mass, unfiltered race ----
    if USE_PARTS:  # the row's chunks were scanned in parallel by _sample_partials_kernel
        m, gid, bad, n_fin, s, rb_id, xmin = _combine_parts(part_ptr + row * n_parts * PART, n_parts, inv_t, S_P)
    else:
        m, gid, bad, n_fin, s, rb_x, rb_g, rb_id, xmin = _pass_a(row_ptr, 0, V, inv_t, seed, pos, need_s,
                                                                 unfiltered, BLOCK)
    invalid = (bad > 0) | (m == float("-inf"))
    tok = gid
    t = tl.full([], KEY_NEG_INF, tl.int32)
    n = tl.zeros([], tl.int32)
    if not_(invalid) & not_(greedy):
        if unfiltered:
            tok = rb_id
        else:
            sz = sz_ptr + row * CAND
            si = si_ptr + row * CAND
            compacted = tl.zeros([], tl.int32)
            zc = tl.full([CAND], float("-inf"), tl.float32)
            ic = tl.full([CAND], V, tl.int32)
            lo0 = _lo0(m, xmin, n_fin, inv_t, mp, use_mp)
            t = lo0 - 1
            mode = tl.zeros([], tl.int32)
            lo_b = lo0
            hi_b = tl.zeros([], tl.int32)
            c_b = n_fin
            # A top-p-alone row gathered inside its fine bracket (_sample_gather_kernel): the values
            # above it are not candidates but figures (count, mass, race winner) added to the search
            # and the draw. ``restricted`` says so.
            restricted = tl.zeros([], tl.int32)
            lo_r = lo0
            hi_r = tl.zeros([], tl.int32)
            c_ab = tl.zeros([], tl.int32)
            w_ab = tl.zeros([], tl.float32)
            g_ab = tl.full([], float("-inf"), tl.float32)
            id_ab = tl.full([], INT_MAX, tl.int32)
            n_c = tl.zeros([], tl.int32)
            drawn = tl.zeros([], tl.int32)  # min-p alone: the gather's race already has the token
            if HIST:  # the first search's bracket (_sample_bracket_kernel) and its gathered candidates
                br = br_ptr + row * BR
                mode = tl.load(br + 0)
                lo_b = tl.load(br + 1)
                hi_b = tl.load(br + 2)
                c_b = tl.load(br + 3)
                n_c = tl.load(cnt_ptr + row)
                st = tl.load(br + 5)
                fine = (st == 2) & (n_c <= CAND)  # more than CAND: the estimate was off
                raced = st == 3
                drawn = raced.to(tl.int32)
                if (tl.load(br + 4) != 0) | fine:
                    jc = tl.arange(0, CAND)
                    zc = tl.load(sz + jc, mask=jc < n_c, other=float("-inf"))
                    ic = tl.load(si + jc, mask=jc < n_c, other=V)
                    compacted = tl.full([], 1, tl.int32)
                if fine:
                    restricted = tl.full([], 1, tl.int32)
                    lo_r = tl.load(br + 6)
                    hi_r = tl.load(br + 7)
                if fine | raced:
                    c_ab, w_ab, g_ab, id_ab = _above_fine(agg2_ptr + row * n_parts * 4, n_parts, S_P)
            mass1 = s
            c_lo = n_fin
            m_lo = s
            c_gt1 = n_fin
            e_t = tl.zeros([], tl.int32)  # how many values equal t
            if use_k | (use_mp & use_p):
                target1 = tl.where(use_k, k.to(tl.float32), float("inf"))
                # Top-k starts in the histogram bin that reaches k (the counts are exact, so t
                # lies in it); its candidates were gathered when few values lie above it.
                lo1 = tl.where(mode == 1, lo_b, lo0)
                hi1 = tl.where(mode == 1, hi_b, 0)
                c_lo = tl.where(mode == 1, c_b, c_lo)
                f1, t1, c1, w1, e1, lo, c_lo, m_lo, compacted, zc, ic = _search(
                    row_ptr, V, m, inv_t, lo1, hi1, c_lo, m_lo, target1, 0, use_mp.to(tl.int32),
                    compacted, zc, ic, sz, si, cnt_ptr + row, tl.zeros([], tl.int32), tl.zeros([], tl.float32),
                    CAND, BLOCK)
                if f1 != 0:
                    t = t1
                    e_t = e1
                    n = tl.minimum(e1, k - c1)
                    mass1 = w1 + n.to(tl.float32) * tl.exp(_unkey(t1))
                    c_gt1 = c1
                    m_lo = w1
                    c_lo = c1
                else:
                    mass1 = m_lo
            if use_p:
                target2 = p * mass1
                # top-p alone: bounds of the mass above each bin edge bracket t the same way.
                lo2 = tl.where(mode == 2, tl.where(restricted != 0, lo_r, lo_b), t + 1)
                hi2 = tl.where(mode == 2, tl.where(restricted != 0, hi_r, hi_b), 0)
                c_lo = tl.where(mode == 2, tl.where(restricted != 0, c_ab + n_c, c_b), c_lo)
                m_lo2 = m_lo
                f2 = tl.zeros([], tl.int32)
                t2 = t
                c2 = tl.zeros([], tl.int32)
                w2 = tl.zeros([], tl.float32)
                e2 = tl.zeros([], tl.int32)
                again = tl.full([], 1, tl.int32)
                while again != 0:  # at most twice: a fine bracket that missed t, then the whole row
                    f2, t2, c2, w2, e2, lo, c_lo, m_lo, compacted, zc, ic = _search(
                        row_ptr, V, m, inv_t, lo2, hi2, c_lo, m_lo2, target2, 1, 0,
                        compacted, zc, ic, sz, si, cnt_ptr + row, c_ab, w_ab, CAND, BLOCK)
                    again = tl.zeros([], tl.int32)
                    if (restricted != 0) & (f2 == 0):
                        restricted = tl.zeros([], tl.int32)
                        compacted = tl.zeros([], tl.int32)
                        c_ab = tl.zeros([], tl.int32)
                        w_ab = tl.zeros([], tl.float32)
                        lo2 = lo_b
                        hi2 = hi_b
                        c_lo = c_b
                        again = tl.full([], 1, tl.int32)
                if f2 != 0:
                    q2 = tl.exp(_unkey(t2))
                    n = tl.minimum(tl.ceil(tl.minimum((target2 - w2) / q2, e2.to(tl.float32))).to(tl.int32), e2)
                    t = t2
                    e_t = e2
                else:
                    if n > 0:
                        q1 = tl.exp(_unkey(t))
                        need = (target2 - (mass1 - n.to(tl.float32) * q1)) / q1
                        n = tl.minimum(tl.ceil(tl.minimum(need, n.to(tl.float32))).to(tl.int32), n)
            best = tl.full([], float("-inf"), tl.float32)
            best_id = tl.full([], INT_MAX, tl.int32)
            # The candidates are unordered and the lanes of a pass see ids out of order: fine
            # unless the boundary keeps only some of the values equal to t (the lowest ids),
            # which needs the ordered pass with a running tie rank.
            all_or_none = (n == 0) | (n >= e_t)
            if drawn != 0:
                best_id = id_ab
            elif (compacted != 0) & all_or_none:
                best, best_id, carry = _race_block(zc, ic, zc > float("-inf"), t, tl.where(n > 0, CAND, 0), 0,
                                                   seed, pos, best, best_id)
                if restricted != 0:  # the values above the fine bracket: all kept, their winner known
                    better = (g_ab > best) | ((g_ab == best) & (id_ab < best_id))
                    best_id = tl.where(better, id_ab, best_id)
                    best = tl.where(better, g_ab, best)
            elif all_or_none:
                best_id = _race_lanes(row_ptr, V, m, inv_t, t, n > 0, seed, pos, BLOCK)
            else:
                carry = tl.zeros([], tl.int32)
                for start in range(0, V, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    z = _load_z(row_ptr, offs, V, m, inv_t)
                    best, best_id, carry = _race_block(z, offs, offs < V, t, n, carry, seed, pos, best, best_id)
            tok = best_id
    invalid = invalid | (tok >= V)  # nothing kept: cannot happen for a valid row; never out of range
    tok = tl.where(invalid, 0, tok)
    tl.store(ids_ptr + row, tok.to(tl.int64))
    tl.store(invalid_ptr + row, invalid)
    if WRITE_SUPPORT:
        tl.store(support_ptr + row * 2, t)
        tl.store(support_ptr + row * 2 + 1, n)


def _config(device: torch.device) -> tuple[int, int, int, int]:
    """BLOCK, CAND, num_warps, CHUNK (0 = no split pass A)."""
    if device.type == "cuda":
        # Pass A of a row is split in chunks of 8192 logits read by separate programs: one
        # program per row alone would leave most SMs idle at small batch. The per-row kernel runs
        # 16 warps (docs/sampling.md, Decisions: the per-row kernel at 16 warps: top-p alone gains
        # most, top-k + top-p loses a little); the sm90 build has 121 registers and no stack (200 at 8).
        return 2048, 2048, 16, 8192
    return 4096, 2048, 4, 0  # the interpreter pays per block iteration: fewer, larger blocks


def _carve(dtype, device, *shapes):
    """Views of one allocation, one per shape (None -> None), each starting on a 16-element
    boundary so that the kernels' pointer-alignment specialisation is as with separate tensors."""
    sizes = [0 if sh is None else int(torch.Size(sh).numel()) for sh in shapes]
    offs, at = [], 0
    for n in sizes:
        offs.append(at)
        at += -(-n // 16) * 16
    buf = torch.empty(max(at, 1), dtype=dtype, device=device)
    return [None if sh is None else buf[o:o + n].view(sh) for sh, o, n in zip(shapes, offs, sizes)]


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions, *, return_support: bool = False,
           chunk: Optional[int] = None, config: Optional[tuple] = None, bracket: bool = True, ahead: bool = True):
    """See the module docstring. With ``return_support`` a third tensor [B, 2] int32 holds each
    row's boundary (key t, tie count n); ``support_from_boundary`` turns it into a mask (tests).
    ``chunk`` overrides the split of pass A (0 = none; tests exercise both paths); ``config``
    (BLOCK, num_warps) overrides the per-row kernel's tile (benchmark variants); ``bracket=False``
    leaves out passes B and C (the per-row kernel searches from the whole row, as before them:
    the benchmark's same-run comparison; the tokens are the same); ``ahead=False`` keeps one block
    in flight in passes A, B and C (the benchmark's same-run comparison for the loads ahead)."""
    B, V = check_sample_args(logits, temperature, top_k, top_p, min_p, seeds, positions)
    expect(V < 2**24, "logits", f"vocabulary {V}", "fewer than 2**24 columns (ids travel as fp32)")
    dev = logits.device
    ids = torch.empty(B, dtype=torch.int64, device=dev)
    invalid = torch.empty(B, dtype=torch.bool, device=dev)
    support = torch.empty((B, 2), dtype=torch.int32, device=dev) if return_support else ids
    if B > 0:
        block, cand, warps, chunk_default = _config(dev)
        if config is not None:
            block, warps = config
            expect(block >= 16 and block & (block - 1) == 0 and warps in (1, 2, 4, 8, 16, 32), "config", repr(config),
                   "(BLOCK a power of 2 >= 16, num_warps a power of 2 <= 32)")
        chunk = chunk_default if chunk is None else chunk
        expect(chunk == 0 or (chunk >= 16 and chunk & (chunk - 1) == 0), "chunk", repr(chunk), "0 or a power of 2 >= 16")
        block = max(32, min(block, triton.next_power_of_2(V)))  # pass A halves it (_pass_a_lanes)
        n_parts = triton.cdiv(V, chunk) if chunk else 1
        use_parts = n_parts >= 2
        use_hist = use_parts and bracket
        # Scratch in two allocations (per call at every decode step: one caching-allocator call
        # per dtype instead of six): candidates and pass A's partials in fp32; candidate ids,
        # compaction counters (zeroed in the kernels), brackets and histograms in int32.
        sz, part, agg, agg2 = _carve(torch.float32, dev, (B, cand), (B, n_parts, PART.value) if use_parts else None,
                                     (B, n_parts, 2) if use_hist else None, (B, n_parts, 4) if use_hist else None)
        # pass B's histogram, then (same rows, B2 overwrites it) the fine one of refined rows
        si, cnt, br, hist = _carve(torch.int32, dev, (B, cand), (B,), (B, BR.value) if use_hist else None,
                                   (B, n_parts, max(HIST_NB.value, NB2.value)) if use_hist else None)
        part, br = part if use_parts else sz, br if use_hist else cnt  # unused pointers when off
        agg, agg2 = (agg, agg2) if use_hist else (sz, sz)
        s_p = max(2, triton.next_power_of_2(n_parts))
        flags = (logits, logits.stride(0), V, temperature, top_k, top_p, min_p)
        pl = pdl.launch(dev)  # the six passes are back to back: each launches while the one before ends
        cb = dict(CHUNK=chunk, BLOCK=min(2048, chunk), num_warps=4, **pl)
        if use_parts:
            _sample_partials_kernel[(B, n_parts)](*flags, seeds, positions, part, AHEAD=ahead, **cb)
        if use_hist:
            _sample_hist_kernel[(B, n_parts)](*flags, part, n_parts, hist, S_P=s_p, AHEAD=ahead, **cb)
            _sample_bracket_kernel[(B,)](temperature, top_k, top_p, min_p, V, part, n_parts, hist, br, cnt, CAND=cand,
                                         S_P=s_p, num_warps=4, **pl)
            _sample_refine_kernel[(B, n_parts)](*flags, part, n_parts, br, hist, agg, S_P=s_p, **cb)
            _sample_gather_kernel[(B, n_parts)](*flags, seeds, positions, part, n_parts, br, sz, si, cnt, hist, agg, agg2,
                                                CAND=cand, S_P=s_p, AHEAD=ahead, **cb)
        _sample_kernel[(B,)](logits, logits.stride(0), V, temperature, top_k, top_p, min_p, seeds, positions,
                             ids, invalid, support, sz, si, cnt, part, n_parts, br, agg2, BLOCK=block, CAND=cand,
                             WRITE_SUPPORT=return_support, USE_PARTS=use_parts, S_P=s_p, HIST=use_hist,
                             num_warps=warps, **pl)
    return (ids, invalid, support) if return_support else (ids, invalid)


def support_from_boundary(logits, temperature, support) -> torch.Tensor:
    """Bool [B, V] support described by the kernel's (t, n) per row, with z computed exactly as
    the kernel does (fp32). For tests of the boundary search (rows that are not greedy/unfiltered)."""
    x = logits.float()
    m = torch.nan_to_num(x, nan=-float("inf")).amax(-1, keepdim=True)
    t32 = temperature.float()[:, None]
    inv_t = torch.where(t32 > 0, 1.0 / torch.where(t32 > 0, t32, 1.0), 1.0)
    z = (x - m) * inv_t + 0.0
    b = z.view(torch.int32)
    key = torch.where(b < 0, b ^ 0x7FFFFFFF, b)
    t, n = support[:, :1], support[:, 1:]
    tie = key == t
    rank = torch.cumsum(tie.int(), -1) - 1
    return (key > t) | (tie & (rank < n))
