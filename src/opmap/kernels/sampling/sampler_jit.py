"""Triton building blocks of the sorting-free sampler (see ``sampler.py`` for the algorithm).

Values are compared through a monotone int32 *key* of the fp32 value (the float's bits with the
magnitude bits flipped when negative), so that bisection runs over keys: at most 32 halvings
reach a single representable float, whatever the spread of the logits, and ties are exact.
Row values are z = (x - max) / temperature, so z <= 0 and exp(z) never overflows.
"""
import triton
import triton.language as tl

KEY_NEG_INF = tl.constexpr(-2139095041)  # _key(-inf)
INT_MAX = tl.constexpr(2147483647)
INT_MIN = tl.constexpr(-2147483648)
PART = tl.constexpr(9)  # floats per (row, chunk) record of pass A's partials
# The count histogram of z (pass B, ``_sample_hist_kernel``) in 128 bins over u = -z >= 0, narrow
# near the max and wider below: 64 bins of 1/32 nat on [0, 2), 48 of 1/8 on [2, 8), 15 of 1/2 on
# [8, 15.5), the last bin everything below. Bin j holds u in [lo_j, hi_j), i.e.
# -hi_j < z <= -lo_j. Each index is floor(u * 2^s) plus a constant: exact, because scaling by a
# power of two is exact. Narrow bins where top-k boundaries usually lie; the top-p mass bounds
# are within 3% per value there. tl.histogram costs ~NB/32 * log2(NB) operations per value (one
# ballot per index bit, then each lane counts its NB/32 bins): 512 uniform bins cost several times
# the read of the logits. With 128 bins the sm90 PTX has a quarter of the popcounts but still the
# ballots and the tier arithmetic (docs/sampling.md, Decisions: passes B and C).
HIST_NB = tl.constexpr(128)
HIST_TIERS = ((0.0, 32.0, 0), (2.0, 8.0, 64), (8.0, 2.0, 112), (15.5, None, 127))  # (u from, bins per nat, first bin)


def hist_u_edges() -> list:
    """The lower u edge of every bin, in bin order (tests place values on them)."""
    out = []
    for (u0, per, j0), nxt in zip(HIST_TIERS, HIST_TIERS[1:] + ((None, None, 128),)):
        out += [u0 + (j - j0) / per for j in range(j0, nxt[2])] if per else [u0]
    return out


@triton.jit
def _hist_index(u):
    """Bin of u = -z (fp32, >= 0; float result, the caller converts)."""
    return tl.where(u < 2.0, tl.floor(u * 32.0),
                    tl.where(u < 8.0, 48.0 + tl.floor(u * 8.0),
                             tl.where(u < 15.5, 96.0 + tl.floor(u * 2.0), 127.0)))


@triton.jit
def _hist_u_lo(j):
    """Lower u edge of bin j (int tensor), exact: the inverse of _hist_index's tiers."""
    jf = j.to(tl.float32)
    return tl.where(j < 64, jf * 0.03125, tl.where(j < 112, (jf - 48.0) * 0.125,
                                                   tl.where(j < 127, (jf - 96.0) * 0.5, 15.5)))


@triton.jit
def _key(z):
    b = z.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _unkey(k):
    b = tl.where(k < 0, k ^ 0x7FFFFFFF, k)
    return b.to(tl.float32, bitcast=True)


# _ahead: the per-row kernel's full-row loops (_evaluate, _compact, _race_lanes) load block i+1
# before working on block i; so do the chunk passes A (_pass_a_lanes), B and C. Without it pass A
# read its rows at a third of the read ceiling (at 139 registers three 4-warp programs fit on an SM,
# ~12 KB in flight), and one program per row reading its 0.5 MB row with one 16-byte load in flight
# per thread (the sm90 build has no async copies in these loops) was bound by the load latency
# times the blocks, as Little's law predicts for ~8 KB in flight per SM. Two loads in flight halve
# the wait (docs/sampling.md, Decisions: the chunk passes load one block ahead). Same values, same
# order: the same bits.
@triton.jit
def _load_z(row_ptr, offs, V, m, inv_t):
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    # + 0.0 turns a -0.0 into +0.0 so that equal values have equal keys.
    return (x - m) * inv_t + 0.0


@triton.jit
def _gumbel(seed, pos, ids):
    """Gumbel noise from Philox keyed by (seed; token id, position): a token's noise depends on
    its request's seed and step only, never on the batch or on which pass computes it."""
    c0 = ids.to(tl.uint32)
    zero = c0 * 0
    c1 = zero + (pos & 0xFFFFFFFF).to(tl.uint32)
    c2 = zero + ((pos >> 32) & 0xFFFFFFFF).to(tl.uint32)
    r, _, _, _ = tl.philox(seed, c0, c1, c2, zero)
    # 24 random bits, centred: u in (0, 1) strictly, so both logs are finite.
    u = ((r >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _stats(z, ok, mid, c_ge, w_ge, s_up, n_up, s_dn, n_dn):
    """Fold one block into the figures of an evaluation at key ``mid``: count and mass of the
    values >= mid, the smallest such key with its multiplicity, the largest key below mid with
    its multiplicity."""
    k = _key(z)
    ge = ok & (k >= mid)
    lt = ok & (k < mid) & (k > KEY_NEG_INF)
    c_ge += tl.sum(ge.to(tl.int32), 0)
    w_ge += tl.sum(tl.where(ge, tl.exp(z), 0.0), 0)
    bu = tl.min(tl.where(ge, k, INT_MAX), 0)
    bnu = tl.sum((ge & (k == bu)).to(tl.int32), 0)
    n_up = tl.where(bu < s_up, bnu, tl.where(bu == s_up, n_up + bnu, n_up))
    s_up = tl.minimum(s_up, bu)
    bd = tl.max(tl.where(lt, k, INT_MIN), 0)
    bnd = tl.sum((lt & (k == bd)).to(tl.int32), 0)
    n_dn = tl.where(bd > s_dn, bnd, tl.where(bd == s_dn, n_dn + bnd, n_dn))
    s_dn = tl.maximum(s_dn, bd)
    return c_ge, w_ge, s_up, n_up, s_dn, n_dn


@triton.jit
def _evaluate(row_ptr, V, m, inv_t, mid, compacted, zc, c_off, w_off, BLOCK: tl.constexpr):
    """Count and mass at or above ``mid`` (+ c_off / w_off: values above the candidates' range that
    are not among them, see _fine_bracket), and the nearest keys on both sides."""
    c_ge = c_off
    w_ge = w_off
    s_up = tl.full([], INT_MAX, tl.int32)
    n_up = tl.zeros([], tl.int32)
    s_dn = tl.full([], INT_MIN, tl.int32)
    n_dn = tl.zeros([], tl.int32)
    if compacted != 0:
        c_ge, w_ge, s_up, n_up, s_dn, n_dn = _stats(zc, zc > float("-inf"), mid, c_ge, w_ge, s_up, n_up,
                                                    s_dn, n_dn)
    else:
        # Per-lane accumulators, reduced once after the loop: no barrier inside the loop, so the
        # loads of successive blocks overlap.
        c_v = tl.zeros([BLOCK], tl.int32)
        w_v = tl.zeros([BLOCK], tl.float32)
        uk = tl.full([BLOCK], INT_MAX, tl.int32)
        un = tl.zeros([BLOCK], tl.int32)
        dk = tl.full([BLOCK], INT_MIN, tl.int32)
        dn = tl.zeros([BLOCK], tl.int32)
        z_n = _load_z(row_ptr, tl.arange(0, BLOCK), V, m, inv_t)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            z = z_n
            z_n = _load_z(row_ptr, offs + BLOCK, V, m, inv_t)  # in flight during this block: see _ahead
            k = _key(z)
            ok = offs < V
            ge = ok & (k >= mid)
            lt = ok & (k < mid) & (k > KEY_NEG_INF)
            c_v += ge.to(tl.int32)
            w_v += tl.where(ge, tl.exp(z), 0.0)
            nu = tl.where(ge, k, INT_MAX)
            un = tl.where(nu < uk, 1, tl.where(ge & (nu == uk), un + 1, un))
            uk = tl.minimum(uk, nu)
            nd = tl.where(lt, k, INT_MIN)
            dn = tl.where(nd > dk, 1, tl.where(lt & (nd == dk), dn + 1, dn))
            dk = tl.maximum(dk, nd)
        c_ge = tl.sum(c_v, 0)
        w_ge = tl.sum(w_v, 0)
        s_up = tl.min(uk, 0)
        n_up = tl.sum(tl.where(uk == s_up, un, 0), 0)
        s_dn = tl.max(dk, 0)
        n_dn = tl.sum(tl.where(dk == s_dn, dn, 0), 0)
    return c_ge, w_ge, s_up, n_up, s_dn, n_dn


@triton.jit
def _put_candidates(z, offs, sel, sz_ptr, si_ptr, cnt_ptr, CAND: tl.constexpr):
    """Append the selected values and their ids to a row's candidate scratch (slots from the
    row's atomic counter, which goes on counting past CAND: the caller can tell an overflow)."""
    slot = tl.atomic_add(cnt_ptr + offs * 0, 1, mask=sel)
    ok = sel & (slot < CAND)
    tl.store(sz_ptr + slot, z, mask=ok)
    tl.store(si_ptr + slot, offs, mask=ok)


@triton.jit
def _compact(row_ptr, V, m, inv_t, lo, sz_ptr, si_ptr, cnt_ptr, CAND: tl.constexpr, BLOCK: tl.constexpr):
    """Copy the values with key >= lo (at most CAND of them) to this row's scratch and load them
    back into registers: later evaluations and the draw read no more memory. Slots come from an
    atomic counter (no scan per block), so the candidates are in no particular order: the draw
    does not depend on it, and a tie kept in part at the boundary (needing id order) is drawn by
    an ordered pass over the row instead."""
    tl.atomic_xchg(cnt_ptr, 0)  # an atomic, like the increments below: coherent at L2
    tl.debug_barrier()
    c_v = tl.zeros([BLOCK], tl.int32)
    z_n = _load_z(row_ptr, tl.arange(0, BLOCK), V, m, inv_t)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        z = z_n
        z_n = _load_z(row_ptr, offs + BLOCK, V, m, inv_t)  # see _ahead
        sel = (offs < V) & (_key(z) >= lo)
        _put_candidates(z, offs, sel, sz_ptr, si_ptr, cnt_ptr, CAND)
        c_v += sel.to(tl.int32)
    base = tl.sum(c_v, 0)
    tl.debug_barrier()  # the stores of every thread are visible to the loads below
    j = tl.arange(0, CAND)
    zc = tl.load(sz_ptr + j, mask=j < base, other=float("-inf"))
    ic = tl.load(si_ptr + j, mask=j < base, other=V)
    return zc, ic


@triton.jit
def _search(row_ptr, V, m, inv_t, lo, hi, c_lo, m_lo, target, use_mass, first_at_lo,
            compacted, zc, ic, sz_ptr, si_ptr, cnt_ptr, c_off, w_off, CAND: tl.constexpr, BLOCK: tl.constexpr):
    """Find t = the largest key in [lo, hi] whose metric_ge(t) >= target, where the metric is the
    count (use_mass == 0) or the mass exp(z) of the values with key >= t. Returns
    (found, t, count_gt(t), mass_gt(t), multiplicity of t, lo, c_lo, m_lo, compacted, zc, ic).
    c_lo / m_lo are upper bounds of the count / mass of the values with key >= lo."""
    found = tl.zeros([], tl.int32)
    done = tl.zeros([], tl.int32)
    t = lo
    c_gt = tl.zeros([], tl.int32)
    w_gt = tl.zeros([], tl.float32)
    n_eq = tl.zeros([], tl.int32)
    it = tl.zeros([], tl.int32)
    one = tl.full([], 1, tl.int32)  # flags are int32 tensors: loop-carried types must not change
    while done == 0:
        metric_lo = tl.where(use_mass != 0, m_lo, c_lo.to(tl.float32))
        at_lo = (it == 0) & (first_at_lo != 0)  # a first evaluation at lo gives exact figures there
        if ((metric_lo < target) & (at_lo == 0)) | (lo > hi) | (it >= 80):
            done = one
        else:
            if (compacted == 0) & (c_lo <= CAND):
                zc, ic = _compact(row_ptr, V, m, inv_t, lo, sz_ptr, si_ptr, cnt_ptr, CAND, BLOCK)
                compacted = one
            # Midpoint in value for the first steps (the keys of a float are logarithmic in its
            # magnitude: their midpoint would first probe absurd scales), then in key, which pins
            # any boundary down in at most 32 more steps.
            mid_k = ((lo.to(tl.int64) + hi.to(tl.int64)) >> 1).to(tl.int32)
            mid_v = _key(_unkey(lo) * 0.5 + _unkey(hi) * 0.5 + 0.0)
            use_v = (it < 12) & (mid_v > lo) & (mid_v <= hi)
            mid = tl.where(at_lo, lo, tl.where(use_v, mid_v, mid_k))
            c_ge, w_ge, s_up, n_up, s_dn, n_dn = _evaluate(row_ptr, V, m, inv_t, mid, compacted, zc, c_off, w_off,
                                                           BLOCK)
            if at_lo:
                c_lo = c_ge
                m_lo = w_ge
            w_up = tl.exp(_unkey(s_up))
            w_dn = tl.exp(_unkey(s_dn))
            met_ge = tl.where(use_mass != 0, w_ge, c_ge.to(tl.float32))
            if (met_ge >= target) & (s_up == INT_MAX):
                # Only the offsets reach the target: t lies above the candidates' range (a fine
                # bracket that missed; the caller then searches the whole row). Not found.
                done = one
            elif met_ge >= target:
                # t >= s_up; s_up is t when dropping its copies falls below the target.
                met_gt = met_ge - n_up.to(tl.float32) * tl.where(use_mass != 0, w_up, 1.0)
                if met_gt < target:
                    found = one
                    done = one
                    t = s_up
                    c_gt = c_ge - n_up
                    w_gt = w_ge - n_up.to(tl.float32) * w_up
                    n_eq = n_up
                else:
                    lo = s_up + 1
                    c_lo = c_ge - n_up
                    m_lo = w_ge - n_up.to(tl.float32) * w_up
            else:
                # t < mid, so t <= s_dn: either s_dn is t or t lies below it.
                if s_dn < lo:
                    done = one
                else:
                    met_dn = met_ge + n_dn.to(tl.float32) * tl.where(use_mass != 0, w_dn, 1.0)
                    if met_dn >= target:
                        found = one
                        done = one
                        t = s_dn
                        c_gt = c_ge
                        w_gt = w_ge
                        n_eq = n_dn
                    else:
                        hi = s_dn - 1
            it += 1
    return found, t, c_gt, w_gt, n_eq, lo, c_lo, m_lo, compacted, zc, ic


@triton.jit
def _race_lanes(row_ptr, V, m, inv_t, t, keep_ties, seed, pos, BLOCK: tl.constexpr):
    """Race over {key > t} (+ every value equal to t when keep_ties) with per-lane winners,
    reduced once: the lowest id wins a tie (within a lane the earlier block, across lanes min id)."""
    lb = tl.full([BLOCK], float("-inf"), tl.float32)
    li = tl.full([BLOCK], INT_MAX, tl.int32)
    z_n = _load_z(row_ptr, tl.arange(0, BLOCK), V, m, inv_t)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        z = z_n
        z_n = _load_z(row_ptr, offs + BLOCK, V, m, inv_t)  # see _ahead
        k = _key(z)
        keep = (offs < V) & ((k > t) | ((k == t) & keep_ties))
        g = tl.where(keep, z + _gumbel(seed, pos, offs), float("-inf"))
        better = g > lb
        li = tl.where(better, offs, li)
        lb = tl.where(better, g, lb)
    kb = tl.max(lb, 0)
    return tl.min(tl.where(lb == kb, li, INT_MAX), 0)


@triton.jit
def _race_block(z, ids, ok, t, n, carry, seed, pos, best, best_id):
    """Exponential race (Gumbel-max) over the support {key > t} + the first n ids with key == t."""
    k = _key(z)
    tie = ok & (k == t)
    rank = carry + tl.cumsum(tie.to(tl.int32), 0) - 1
    keep = ok & ((k > t) | (tie & (rank < n)))
    g = tl.where(keep, z + _gumbel(seed, pos, ids), float("-inf"))
    bk = tl.max(g, 0)
    bid = tl.min(tl.where(keep & (g == bk), ids, INT_MAX), 0)
    better = (bk > best) & (bid < INT_MAX)
    best_id = tl.where(better, bid, best_id)
    best = tl.where(better, bk, best)
    carry += tl.sum(tie.to(tl.int32), 0)
    return best, best_id, carry


@triton.jit
def _pass_a(row_ptr, lo, hi, inv_t, seed, pos, need_s, unfiltered, BLOCK: tl.constexpr, AHEAD: tl.constexpr = True):
    """One scan of row[lo:hi]: max, lowest-id argmax, NaN/+inf count, finite count, the mass
    sum(exp((x - max) / T)) when ``need_s``, and the race winner (x, noise, id) when ``unfiltered``.
    Rows without the race reduce per lane (``_pass_a_lanes``)."""
    if unfiltered:
        m, gid, bad, n_fin, s, rb_x, rb_g, rb_id, xmin = _pass_a_blocks(row_ptr, lo, hi, inv_t, seed, pos, need_s,
                                                                        unfiltered, BLOCK)
    else:
        # Half the block: six per-lane vectors of a 2048 block held 168 registers and spilled on
        # sm90 (4 warps); 1024 keeps them at 8 values per thread.
        m, gid, bad, n_fin, s, xmin = _pass_a_lanes(row_ptr, lo, hi, inv_t, need_s, BLOCK // 2, AHEAD)
        rb_x = tl.full([], float("-inf"), tl.float32)
        rb_g = tl.zeros([], tl.float32)
        rb_id = tl.full([], INT_MAX, tl.int32)
    return m, gid, bad, n_fin, s, rb_x, rb_g, rb_id, xmin


@triton.jit
def _pass_a_lanes(row_ptr, lo, hi, inv_t, need_s, BLOCK: tl.constexpr, AHEAD: tl.constexpr = True):
    """Pass A without the race, with per-lane accumulators reduced once after the loop (as
    _evaluate does): no cross-warp reduction, hence no barrier, inside the loop, so the loads of
    successive blocks overlap. The block-by-block version (_pass_a_blocks) reduces six figures
    per block. A lane sees its ids in increasing order, so a strict > keeps its lowest id of
    its max; the lowest id over the lanes holding the row max is the greedy id."""
    m_v = tl.full([BLOCK], float("-inf"), tl.float32)
    gid_v = tl.zeros([BLOCK], tl.int32)
    bad_v = tl.zeros([BLOCK], tl.int32)
    n_v = tl.zeros([BLOCK], tl.int32)
    xmin_v = tl.full([BLOCK], float("inf"), tl.float32)
    s_v = tl.zeros([BLOCK], tl.float32)
    if AHEAD:
        x_n = tl.load(row_ptr + lo + tl.arange(0, BLOCK), mask=lo + tl.arange(0, BLOCK) < hi,
                      other=float("-inf")).to(tl.float32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if AHEAD:
            x = x_n
            # the next block in flight during this one (see _ahead): pass A of a chunk is latency-bound
            x_n = tl.load(row_ptr + offs + BLOCK, mask=offs + BLOCK < hi, other=float("-inf")).to(tl.float32)
        else:  # the bench's [ahead=0] row: one block in flight
            x = tl.load(row_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        nan = x != x
        bad_v += (nan | (x == float("inf"))).to(tl.int32)
        xs = tl.where(nan, float("-inf"), x)
        fin = xs > float("-inf")
        n_v += fin.to(tl.int32)
        xmin_v = tl.minimum(xmin_v, tl.where(fin, xs, float("inf")))
        gid_v = tl.where(xs > m_v, offs, gid_v)
        m_new = tl.maximum(m_v, xs)
        if need_s:
            msafe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s_v = s_v * tl.exp((m_v - msafe) * inv_t) + tl.exp((xs - msafe) * inv_t)
        m_v = m_new
    m = tl.max(m_v, 0)
    gid = tl.min(tl.where((m_v == m) & (m_v > float("-inf")), gid_v, INT_MAX), 0)
    gid = tl.where(m > float("-inf"), gid, 0)
    msafe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.where(m_v > float("-inf"), s_v * tl.exp((m_v - msafe) * inv_t), 0.0), 0)
    return m, gid, tl.sum(bad_v, 0), tl.sum(n_v, 0), s, tl.min(xmin_v, 0)


@triton.jit
def _pass_a_blocks(row_ptr, lo, hi, inv_t, seed, pos, need_s, unfiltered, BLOCK: tl.constexpr):
    """Pass A block by block (each block's figures reduced at once): the exponential race needs a
    block's max before its keys."""
    m = tl.full([], float("-inf"), tl.float32)
    xmin = tl.full([], float("inf"), tl.float32)
    gid = tl.zeros([], tl.int32)
    bad = tl.zeros([], tl.int32)
    n_fin = tl.zeros([], tl.int32)
    s = tl.zeros([], tl.float32)
    rb_x = tl.full([], float("-inf"), tl.float32)
    rb_g = tl.zeros([], tl.float32)
    rb_id = tl.full([], INT_MAX, tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        nan = x != x
        bad += tl.sum((nan | (x == float("inf"))).to(tl.int32), 0)
        xs = tl.where(nan, float("-inf"), x)
        fin = xs > float("-inf")
        n_fin += tl.sum(fin.to(tl.int32), 0)
        xmin = tl.minimum(xmin, tl.min(tl.where(fin, xs, float("inf")), 0))
        bm = tl.max(xs, 0)
        bi = tl.min(tl.where(xs == bm, offs, INT_MAX), 0)
        gid = tl.where(bm > m, bi, gid)
        m_new = tl.maximum(m, bm)
        if need_s:
            msafe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp((m - msafe) * inv_t) + tl.sum(tl.exp((xs - msafe) * inv_t), 0)
        if unfiltered:
            # Race keys relative to the block max; blocks are compared through (x, noise) pairs
            # so that no key depends on a max that is not known yet.
            bsafe = tl.where(bm == float("-inf"), 0.0, bm)
            g = _gumbel(seed, pos, offs)
            rk = tl.where(fin, (xs - bsafe) * inv_t + g, float("-inf"))
            bk = tl.max(rk, 0)
            bj = tl.min(tl.where(fin & (rk == bk), offs, INT_MAX), 0)
            bx = tl.sum(tl.where(offs == bj, xs, 0.0), 0)
            bg = tl.sum(tl.where(offs == bj, g, 0.0), 0)
            better = (bj < INT_MAX) & ((bx - rb_x) * inv_t + (bg - rb_g) > 0.0)
            rb_id = tl.where(better, bj, rb_id)
            rb_x = tl.where(better, bx, rb_x)
            rb_g = tl.where(better, bg, rb_g)
        m = m_new
    return m, gid, bad, n_fin, s, rb_x, rb_g, rb_id, xmin


@triton.jit
def _parts_max(part_ptr, n_parts, S_P: tl.constexpr):
    """The row max from a row's pass-A partials (as _combine_parts computes it)."""
    j = tl.arange(0, S_P)
    return tl.max(tl.load(part_ptr + j * PART, mask=j < n_parts, other=float("-inf")), 0)


@triton.jit
def _combine_parts(part_ptr, n_parts, inv_t, S_P: tl.constexpr):
    """Pass A's figures of a row from the per-chunk partials of _sample_partials_kernel."""
    j = tl.arange(0, S_P)
    ok = j < n_parts
    q = part_ptr + j * PART
    mc = tl.load(q + 0, mask=ok, other=float("-inf"))
    m = tl.max(mc, 0)
    gid = tl.min(tl.where(ok & (mc == m), tl.load(q + 1, mask=ok, other=0.0).to(tl.int32), INT_MAX), 0)
    bad = tl.sum(tl.load(q + 2, mask=ok, other=0.0).to(tl.int32), 0)
    n_fin = tl.sum(tl.load(q + 3, mask=ok, other=0.0).to(tl.int32), 0)
    msafe = tl.where(m == float("-inf"), 0.0, m)
    sc = tl.load(q + 4, mask=ok, other=0.0)
    s = tl.sum(tl.where(mc > float("-inf"), sc * tl.exp((mc - msafe) * inv_t), 0.0), 0)
    rid_f = tl.load(q + 7, mask=ok, other=-1.0)
    has = ok & (rid_f >= 0.0) & (rid_f < 16777216.0)  # a chunk without a finite value has no winner
    rid = tl.where(has, rid_f, 0.0).to(tl.int32)
    key = tl.where(has, (tl.load(q + 5, mask=ok, other=0.0) - msafe) * inv_t + tl.load(q + 6, mask=ok, other=0.0),
                   float("-inf"))
    kb = tl.max(key, 0)
    rb_id = tl.min(tl.where(has & (key == kb), rid, INT_MAX), 0)
    xmin = tl.min(tl.load(q + 8, mask=ok, other=float("inf")), 0)
    return m, gid, bad, n_fin, s, rb_id, xmin


@triton.jit
def _hist_bins(z, ok, NB: tl.constexpr):
    """Counts of one block's values per histogram bin (``ok`` masks values out)."""
    b = tl.where(ok, _hist_index(-z), 0.0).to(tl.int32)
    return tl.histogram(b, NB, mask=ok)


@triton.jit
def _hist_bracket(hist_ptr, n_parts, target, use_mass, NB: tl.constexpr):
    """A bracket [lo, hi] of the boundary key t (the largest key whose metric over the values at or
    above it reaches ``target``) from a row's histogram partials, and the count at or above lo.
    Count (use_mass == 0): exact, the bins are exact. Mass: a value of bin j weighs between
    exp(-hi_j) and exp(-lo_j), so lower and upper bounds of the mass above each bin edge bracket
    t; 0.1% margins cover fp32 summation. Returns (usable, lo, hi, count >= lo); not usable when
    only the open last bin reaches the target."""
    jb = tl.arange(0, NB)
    cnt = tl.zeros([NB], tl.int32)
    for part in range(0, n_parts):  # one [NB] row at a time: a [parts, NB] tile spilled at 16 warps
        cnt += tl.load(hist_ptr + part * NB + jb)
    c_cum = tl.cumsum(cnt, 0)
    cf = cnt.to(tl.float32)
    u_lo = _hist_u_lo(jb)
    u_hi = _hist_u_lo(jb + 1)  # the open last bin's lower bound below is 0 (no lower edge)
    lb_cum = tl.cumsum(tl.where(jb < NB - 1, cf * tl.exp(-u_hi), 0.0), 0)
    ub_cum = tl.cumsum(cf * tl.exp(-u_lo), 0)
    # The first bin j whose metric above its lower edge surely reaches the target: t >= that edge.
    short_lo = tl.where(use_mass != 0, lb_cum < target * 1.001, c_cum.to(tl.float32) < target)
    j = tl.sum(short_lo.to(tl.int32), 0)  # the sums are monotone
    # The bins whose metric above their lower edge surely falls short: t <= the upper edge of bin ju.
    short_hi = tl.where(use_mass != 0, ub_cum < target * 0.999, c_cum.to(tl.float32) < target)
    ju = tl.sum(short_hi.to(tl.int32), 0)
    usable = j < NB - 1
    jj = tl.minimum(j, NB - 2)
    lo = _key(-_hist_u_lo(jj + 1)) + 1
    hi = tl.where(ju > 0, _key(-_hist_u_lo(tl.minimum(ju, NB - 1))), 0)
    c_lo = tl.sum(tl.where(jb == jj, c_cum, 0), 0)
    return usable, lo, hi, c_lo


NB2 = tl.constexpr(128)  # bins of the fine histogram inside a top-p bracket (_sample_refine_kernel)


@triton.jit
def _fine_bin(z, z_lo, inv_w):
    """Bin of z in the fine histogram over [z_lo, z_hi] (inv_w = NB2 / (z_hi - z_lo), 0 when the
    range is one value): floor of the offset in bin widths, clamped."""
    return tl.minimum(tl.maximum(tl.floor((z - z_lo) * inv_w), 0.0), NB2 - 1.0).to(tl.int32)


@triton.jit
def _fine_bracket(hist_ptr, agg_ptr, n_parts, lo, hi, target, S_P: tl.constexpr):
    """A tighter bracket [lo2, hi2] of a top-p boundary inside [lo, hi] from the fine histogram
    (NB2 bins of z over [z(lo), z(hi)], per chunk) and the exact count and mass above hi (per chunk,
    2 floats each). The mass bounds are as in _hist_bracket (0.1% margins), but a bin spans
    (z_hi - z_lo) / 128 nats. Returns (lo2, hi2, estimated count in [lo2, hi2]). A value that
    rounding put in a neighbouring bin can make the bracket miss t; the per-row kernel then finds
    no boundary in it and searches the whole row, so a miss costs time, never a wrong token."""
    jb = tl.arange(0, NB2)
    cnt = tl.zeros([NB2], tl.int32)
    for part in range(0, n_parts):
        cnt += tl.load(hist_ptr + part * NB2 + jb)
    jp = tl.arange(0, S_P)
    w_ab = tl.sum(tl.load(agg_ptr + jp * 2 + 1, mask=jp < n_parts, other=0.0), 0)
    z_lo = _unkey(lo)
    z_hi = _unkey(hi)
    wdt = (z_hi - z_lo) / NB2
    cf = cnt.to(tl.float32)
    e_lo = z_lo + jb.to(tl.float32) * wdt  # each bin's lower edge
    # Mass at or above each bin's lower edge, bounded below (every value at its bin's lower edge)
    # and above (at its upper edge), summed from the top bin down.
    lb = w_ab + tl.cumsum(cf * tl.exp(e_lo), 0, reverse=True)
    ub = w_ab + tl.cumsum(cf * tl.exp(tl.minimum(e_lo + wdt, z_hi)), 0, reverse=True)
    # t >= the lower edge of the highest bin whose lower bound surely reaches the target.
    reach = lb >= target * 1.001
    j_lo = tl.max(tl.where(reach, jb, -1), 0)
    # t < the lower edge of the lowest bin whose upper bound surely falls short: t is in a bin below.
    short = ub < target * 0.999
    j_hi = tl.min(tl.where(short, jb, NB2), 0) - 1
    lo2 = tl.where(j_lo >= 0, tl.maximum(_key(tl.sum(tl.where(jb == tl.maximum(j_lo, 0), e_lo, 0.0), 0) + 0.0), lo), lo)
    hi2 = tl.where(j_hi < NB2 - 1,
                   tl.minimum(_key(tl.sum(tl.where(jb == tl.minimum(j_hi + 1, NB2 - 1), e_lo, 0.0), 0) + 0.0), hi), hi)
    hi2 = tl.maximum(hi2, lo2)
    c_in = tl.sum(tl.where((jb >= tl.maximum(j_lo, 0)) & (jb <= j_hi), cnt, 0), 0)
    return lo2, hi2, c_in
