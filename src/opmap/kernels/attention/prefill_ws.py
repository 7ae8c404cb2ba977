"""Varlen paged prefill in Gluon with FlashAttention-3's Hopper structure: backend ``gluon-ws``.

Same grid, sequence lookup, GQA packing, causal / window / soft-cap semantics and outputs as
``prefill_tma._prefill_tma_kernel``; what differs is who waits for what:

- a producer warp (its own partition, few registers) walks the program's key tiles and issues
  the TMA copies of K and V into a ring of ``STAGES`` shared-memory stages, K and V each behind a
  "full" barrier (the copies' bytes) and an "empty" one (the consumers are done with it: a K tile
  once its scores are computed, a V tile a tile later, once its P @ V is); a tile of BLOCK_N keys
  is BLOCK_N / BOX boxes, BOX = min(BLOCK_N, page) rows of one page, so pages of 16 and 32 keys
  are read by TMA too;
- the consumers (two warpgroups, 64 query rows each) run the MMAs as warpgroup MMAs with Q and
  the K / V tiles straight from shared memory, and overlap each tile's softmax with the previous
  tile's P @ V: S_t = Q K_t^T and O += P_{t-1} V_{t-1} are issued together, the wait lets only
  S_t finish (warpgroup MMAs complete in order), and the exponentials of tile t run while the
  tensor cores still multiply tile t-1.

The triton-tma kernel leaves that ordering to Triton's pipeliner, which waits for each tile's
MMAs before the next softmax: in its Nsight Compute profile the MMAs and the softmax of the one
block take turns (docs/attention.md, What limits speed).

Rows past a sequence's length in its last page may hold anything, NaN included (0 * NaN would
poison the output), so no box reads them: the box that holds the length is read ending at it (its
rows before the box are keys done already, masked; rows before the page read as zeros: a negative
row is outside the descriptor), and a box past the length reads zeros. Page ids outside the cache
read as zeros too (the descriptor's bounds), never other memory.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from opmap.core.contract import expect
from opmap.kernels.attention.common import check_attention
from opmap.kernels.attention.tiles import box_positions, box_row, _kv_range, _locate
from opmap.kernels.attention.tma import SMEM_BUDGET, cache_problem
from opmap.kernels.gluon_util import hopper

# Tiles: FA3's for head dim <= 128 on sm90 (128 query rows over two consumer warpgroups, 128-key
# tiles, two stages); CONFIG names what ``config=`` may set. PINGPONG 1: each consumer warpgroup a
# partition of its own with half the rows, the two taking turns to issue their MMAs (FA3's
# inter-warpgroup schedule: one's MMAs run while the other computes its softmax).
DEFAULTS = {"BLOCK_N": 128, "STAGES": 2, "PINGPONG": 0}
CONFIG = {"BLOCK_N": (64, 128), "STAGES": (2, 3), "PINGPONG": (0, 1)}
BLOCK_M = 128
CONSUMER_WARPS = 8


def tile_config(config, d: int) -> dict:
    """The tiles of a launch: DEFAULTS updated by ``config`` (an InputError for a key or value
    outside CONFIG, or stages that do not fit in shared memory at head dim ``d``)."""
    cfg = dict(DEFAULTS)
    for k, v in (config or {}).items():
        expect(k in CONFIG, "config", f"key {k!r}", f"one of {sorted(CONFIG)}")
        expect(v in CONFIG[k], "config", f"{k}={v!r}", f"{k} in {CONFIG[k]}")
        cfg[k] = v
    need = smem_bytes(cfg, d)
    expect(need <= SMEM_BUDGET, "config", f"{cfg} at head_dim {d} needs {need} bytes of shared memory",
           f"at most {SMEM_BUDGET} (fewer STAGES or a smaller BLOCK_N)")
    return cfg


def smem_bytes(cfg: dict, d: int) -> int:
    """Shared memory of a launch: Q, and K + V per stage (16-bit), the barriers aside."""
    return 2 * d * (BLOCK_M + 2 * cfg["STAGES"] * cfg["BLOCK_N"])


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """What this kernel needs beyond the common attention contract: an InputError naming the
    argument, before any launch."""
    expect(q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
           "k_cache", f"dtype {k_cache.dtype} with q {q.dtype}", "bf16/fp16 K/V of q's dtype")
    d, page = q.shape[2], k_cache.shape[1]
    expect(d in (64, 128) and v_cache.shape[3] == d, "q", f"head_dim {d} (values {v_cache.shape[3]})",
           "head_dim 64 or 128, values of the same width")
    # pages are powers of two (check_attention): from 16 keys on, a page holds whole key tiles or
    # a tile holds whole pages, and a TMA box of min(page, BLOCK_N) rows stays inside one page
    expect(page >= 16, "k_cache", f"page size {page}", "pages of 16 keys or more (one TMA box of a page)")
    why = cache_problem(k_cache, v_cache)
    expect(why is None, "k_cache", f"strides {tuple(k_cache.stride())} / {tuple(v_cache.stride())}", why)
    expect(q.is_cuda and hopper(q.device), "q", f"device {q.device}", "a CUDA sm90 device (warpgroup MMAs, TMA)")


@gluon.jit
def _tile_pages(bt_row, start, last_page, ii, PAGE: gl.constexpr, BOX: gl.constexpr):
    """The page ids of the boxes of the tile at ``start`` (``ii``: the box indices), clamped to the
    sequence's last page: one vector load, issued a tile ahead of its copies."""
    return gl.load(bt_row + gl.minimum((start + ii * BOX) // PAGE, last_page))


@gluon.jit
def _issue(DESC, dst, pages, ii, start, L, last_page, kvh, bar, PAGE: gl.constexpr, BOX: gl.constexpr,
           NB: gl.constexpr, D: gl.constexpr, W: gl.constexpr, CH_L: gl.constexpr):
    """The boxes of one tile of K or V into a stage ``dst`` [BLOCK_N, D]: under the 128-byte swizzle
    the stage is D / W column chunks one after another, each [BLOCK_N, W]; box i of chunk h
    ([BOX, W]: keys i * BOX of the tile, columns W h) lands at chunk h's offset plus i * BOX rows."""
    BOX_L: gl.constexpr = DESC.layout
    dt: gl.constexpr = DESC.dtype
    st = dst._reinterpret(dt, [D // W * NB, BOX, W], CH_L)
    for i in gl.static_range(NB):
        j = start + i * BOX
        pidx = gl.minimum(j // PAGE, last_page)
        page = gl.sum(gl.where(ii == i, pages, 0), axis=0)
        row = box_row(j, L, pidx, PAGE, BOX)
        for h in gl.static_range(D // W):
            tma.async_copy_global_to_shared(DESC, [page, row, kvh, h * W], bar,
                                            st.index(h * NB + i)._reinterpret(dt, [1, BOX, 1, W], BOX_L))


@gluon.jit
def _producer(K_DESC, V_DESC, k_smem, v_smem, k_full, v_full, k_empty, v_empty, bt_ptr, b, s_bt, kv_lo, kv_hi, L,
              kvh, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, BOX: gl.constexpr, STAGES: gl.constexpr):
    """Issue the K and V boxes of every key tile of the program into the stage ring, K and V each
    behind barriers of their own: a K tile is released once its scores are computed, a V tile once
    its P @ V is, a tile later, so the copies of the next K tiles never wait for a V tile's use.
    The page ids of a tile are loaded a tile ahead, before the wait for its stage.

    No box reads a row past the sequence's length L (it may hold anything): the box holding L is
    read ending at L (``box_row``), a box past L reads zeros."""
    W: gl.constexpr = K_DESC.block_type.shape[3]  # 64: one swizzle span of 16-bit elements
    D: gl.constexpr = k_smem.type.shape[2]
    NB: gl.constexpr = BLOCK_N // BOX
    CH_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    BYTES: gl.constexpr = BLOCK_N * D * K_DESC.dtype.primitive_bitwidth // 8
    ii = gl.arange(0, NB, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    bt_row = bt_ptr + b.to(gl.int64) * s_bt
    last_page = (L - 1) // PAGE  # L >= 1 in a program with work
    n = gl.cdiv(kv_hi - kv_lo, BLOCK_N)
    pages = _tile_pages(bt_row, kv_lo, last_page, ii, PAGE, BOX)
    for t in range(n):
        s = t % STAGES
        ph = ((t // STAGES) & 1) ^ 1
        start = kv_lo + t * BLOCK_N
        cur = pages
        pages = _tile_pages(bt_row, start + BLOCK_N, last_page, ii, PAGE, BOX)
        mbarrier.wait(k_empty.index(s), ph)
        mbarrier.expect(k_full.index(s), BYTES)
        _issue(K_DESC, k_smem.index(s), cur, ii, start, L, last_page, kvh, k_full.index(s), PAGE, BOX, NB, D, W, CH_L)
        mbarrier.wait(v_empty.index(s), ph)
        mbarrier.expect(v_full.index(s), BYTES)
        _issue(V_DESC, v_smem.index(s), cur, ii, start, L, last_page, kvh, v_full.index(s), PAGE, BOX, NB, D, W, CH_L)


@gluon.jit
def _scores(sc, start, cols, qpos, full_end, kv_hi, L, qk_scale, scale, soft_cap, window, BOX: gl.constexpr,
            CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_CAP: gl.constexpr):
    """Raw scores of the tile at ``start`` to the exp2 domain, masked where the tile needs it."""
    if HAS_CAP:
        x = sc * (scale / soft_cap)
        e = gl.exp(-2.0 * gl.abs(x))
        th = (1.0 - e) / (1.0 + e)
        sc = soft_cap * gl.where(x >= 0, th, -th) * 1.4426950408889634
    else:
        sc = sc * qk_scale
    if start >= full_end:  # tiles below full_end lie inside L: plain positions, no mask
        j, new_key = box_positions(start, cols, L, BOX)
        ok = ((j < kv_hi) & new_key)[None, :]
        if CAUSAL:
            ok = ok & (j[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            ok = ok & (j[None, :] > qpos[:, None] - window)
        sc = gl.where(ok, sc, float("-inf"))
    return sc


@gluon.jit
def _turn(turn, k, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait until the other consumer has issued its MMAs of event k - 1 (consumer 0 goes
    first), so that one consumer's MMAs run while the other one computes its softmax."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), (k + 1 + WG) & 1)


@gluon.jit
def _pass(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: this consumer's MMAs of the event are issued; the other one's turn."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _consumer(q_ptr, o_ptr, lse_ptr, q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, turn, q0, q_len,
              local, L, kvh,
              kv_lo, full_end, kv_hi, scale, soft_cap, window, s_qt, s_qh, s_ot, s_oh, n_heads,
              GROUP: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, BOX: gl.constexpr, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
              HAS_CAP: gl.constexpr, RETURN_LSE: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """The program's query rows (all BLOCK_M of them; with PINGPONG, half of them: consumer WG's,
    each consumer a warpgroup of its own partition, taking turns to issue their MMAs)."""
    NW: gl.constexpr = gl.num_warps()
    BLOCK_Q: gl.constexpr = BLOCK_M // GROUP
    ROWS: gl.constexpr = BLOCK_M // 2 if PINGPONG else BLOCK_M
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, D, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(0, O_L, 2)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [NW, 1], [1, 0])
    dt: gl.constexpr = q_ptr.dtype.element_ty
    q_smem = q_smem.index(WG)

    # Q: this program's BLOCK_Q tokens times the GROUP query heads of kv head kvh, token-major
    r = WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, QL))
    tok = local * BLOCK_Q + r // GROUP
    ok = (r < BLOCK_Q * GROUP) & (tok < q_len)
    t64 = (q0 + tok).to(gl.int64)
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
    q = gl.load(q_ptr + (t64 * s_qt + (kvh * GROUP + r % GROUP) * s_qh)[:, None] + dq[None, :], mask=ok[:, None],
                other=0.0)
    q_smem.store(q)
    fence_async_shared()
    gl.thread_barrier()

    rs = WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, S_L))
    qpos = L - q_len + local * BLOCK_Q + rs // GROUP
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    qk_scale = scale * 1.4426950408889634
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, S_L))
    acc = gl.zeros([ROWS, D], gl.float32, O_L)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, S_L)
    n = gl.cdiv(kv_hi - kv_lo, BLOCK_N)
    if n > 0:
        # tile 0: its scores alone (event 0)
        mbarrier.wait(k_full.index(0), 0)
        _turn(turn, 0, WG, PINGPONG)
        tok0 = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        _pass(turn, WG, PINGPONG)
        sc = warpgroup_mma_wait(0, deps=[tok0])
        mbarrier.arrive(k_empty.index(0), count=1)
        sc = _scores(sc, kv_lo, cols, qpos, full_end, kv_hi, L, qk_scale, scale, soft_cap, window, BOX, CAUSAL,
                     HAS_WINDOW, HAS_CAP)
        m_i = gl.max(sc, 1)
        m_ref = gl.where(m_i == float("-inf"), 0.0, m_i)
        p = gl.exp2(sc - m_ref[:, None])
        l_i = gl.sum(p, 1)
        p16 = gl.convert_layout(p.to(dt), P_L)
        for t in range(1, n):
            s = t % STAGES
            prev = (t - 1) % STAGES
            start = kv_lo + t * BLOCK_N
            mbarrier.wait(k_full.index(s), (t // STAGES) & 1)
            mbarrier.wait(v_full.index(prev), ((t - 1) // STAGES) & 1)
            _turn(turn, t, WG, PINGPONG)
            s_tok = warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            o_tok = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
            _pass(turn, WG, PINGPONG)
            # MMAs retire in order: this lets S_t finish while P_{t-1} V_{t-1} runs on
            sc = warpgroup_mma_wait(1, deps=[s_tok])
            mbarrier.arrive(k_empty.index(s), count=1)
            sc = _scores(sc, start, cols, qpos, full_end, kv_hi, L, qk_scale, scale, soft_cap, window, BOX, CAUSAL,
                         HAS_WINDOW, HAS_CAP)
            m_new = gl.maximum(m_i, gl.max(sc, 1))
            m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_ref)
            p = gl.exp2(sc - m_ref[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            p16 = gl.convert_layout(p.to(dt), P_L)
        last = (n - 1) % STAGES
        mbarrier.wait(v_full.index(last), ((n - 1) // STAGES) & 1)
        _turn(turn, n, WG, PINGPONG)
        o_tok = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
        _pass(turn, WG, PINGPONG)
        acc = warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(v_empty.index(last), count=1)

    RO: gl.constexpr = gl.SliceLayout(1, O_L)
    l_o = gl.convert_layout(l_i, RO)
    inv = gl.where(l_o > 0, 1.0 / gl.where(l_o > 0, l_o, 1.0), 0.0)
    ro = WG * ROWS + gl.arange(0, ROWS, layout=RO)
    tok_o = local * BLOCK_Q + ro // GROUP
    ok_o = (ro < BLOCK_Q * GROUP) & (tok_o < q_len)
    t64o = (q0 + tok_o).to(gl.int64)
    head_o = kvh * GROUP + ro % GROUP
    do = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
    gl.store(o_ptr + (t64o * s_ot + head_o * s_oh)[:, None] + do[None, :],
             (acc * inv[:, None]).to(o_ptr.dtype.element_ty), mask=ok_o[:, None])
    if RETURN_LSE:
        m_o = gl.convert_layout(m_i, RO)
        lse = gl.where(l_o > 0, (m_o + gl.log2(gl.where(l_o > 0, l_o, 1.0))) * 0.6931471805599453, float("-inf"))
        gl.store(lse_ptr + t64o * n_heads + head_o, lse, mask=ok_o)


@gluon.jit(do_not_specialize=["B"])  # per step (prefill._prefill_kernel)
def _prefill_ws_kernel(q_ptr, K_DESC, V_DESC, o_ptr, lse_ptr, cu_ptr, sl_ptr, bt_ptr,
                       scale, soft_cap, window, B, s_qt, s_qh, s_ot, s_oh, s_bt,
                       GROUP: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
                       HAS_CAP: gl.constexpr, RETURN_LSE: gl.constexpr, HEAD_DIM: gl.constexpr,
                       SKIP_SINGLE: gl.constexpr, PINGPONG: gl.constexpr):
    BLOCK_Q: gl.constexpr = BLOCK_M // GROUP
    D: gl.constexpr = HEAD_DIM
    BOX: gl.constexpr = BLOCK_N if BLOCK_N < PAGE else PAGE
    NC: gl.constexpr = 2 if PINGPONG else 1  # consumer partitions
    pid = gl.num_programs(0) - 1 - gl.program_id(0)  # the longest (last) query blocks first
    kvh = gl.program_id(1)
    b, q0, q_len, local = _locate(cu_ptr, B, pid, BLOCK_Q)
    work = local * BLOCK_Q < q_len
    if SKIP_SINGLE:  # mixed steps: the decode kernel serves the one-token sequences
        work = work & (q_len != 1)
    if work:
        L = gl.load(sl_ptr + b)
        kv_lo, full_end, kv_hi = _kv_range(L, q_len, local, window, BLOCK_Q, BLOCK_N, CAUSAL, HAS_WINDOW)
        TILE: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_smem = gl.allocate_shared_memory(K_DESC.dtype, [NC, BLOCK_M // NC, D], TILE)
        k_smem = gl.allocate_shared_memory(K_DESC.dtype, [STAGES, BLOCK_N, D], TILE)
        v_smem = gl.allocate_shared_memory(V_DESC.dtype, [STAGES, BLOCK_N, D], TILE)
        k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NC)  # every consumer releases a stage
            mbarrier.init(v_empty.index(i), count=NC)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        hq = GROUP * gl.num_programs(1)
        if PINGPONG:  # two consumer partitions of a warpgroup each (this one and a worker)
            gl.warp_specialize([
                (_consumer, (q_ptr, o_ptr, lse_ptr, q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, turn, q0,
                             q_len, local, L,
                             kvh, kv_lo, full_end, kv_hi, scale, soft_cap, window, s_qt, s_qh, s_ot, s_oh, hq, GROUP,
                             D, BLOCK_M, BLOCK_N, STAGES, BOX, CAUSAL, HAS_WINDOW, HAS_CAP, RETURN_LSE, 0, True)),
                (_consumer, (q_ptr, o_ptr, lse_ptr, q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, turn, q0,
                             q_len, local, L,
                             kvh, kv_lo, full_end, kv_hi, scale, soft_cap, window, s_qt, s_qh, s_ot, s_oh, hq, GROUP,
                             D, BLOCK_M, BLOCK_N, STAGES, BOX, CAUSAL, HAS_WINDOW, HAS_CAP, RETURN_LSE, 1, True)),
                (_producer, (K_DESC, V_DESC, k_smem, v_smem, k_full, v_full, k_empty, v_empty, bt_ptr, b, s_bt, kv_lo,
                             kv_hi, L, kvh, PAGE, BLOCK_N, BOX, STAGES)),
            ], [4, 1], [240, 24])
        else:  # one consumer partition of two warpgroups
            gl.warp_specialize([
                (_consumer, (q_ptr, o_ptr, lse_ptr, q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, turn, q0,
                             q_len, local, L,
                             kvh, kv_lo, full_end, kv_hi, scale, soft_cap, window, s_qt, s_qh, s_ot, s_oh, hq, GROUP,
                             D, BLOCK_M, BLOCK_N, STAGES, BOX, CAUSAL, HAS_WINDOW, HAS_CAP, RETURN_LSE, 0, False)),
                (_producer, (K_DESC, V_DESC, k_smem, v_smem, k_full, v_full, k_empty, v_empty, bt_ptr, b, s_bt, kv_lo,
                             kv_hi, L, kvh, PAGE, BLOCK_N, BOX, STAGES)),
            ], [1], [24])


SPAN = 64  # 16-bit elements in one 128-byte swizzle span: a box's width


def descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, box: int):
    """[pages, page, kv_heads, D] Gluon descriptors whose box is ``box`` rows of one kv head in one
    page, SPAN columns wide (a head of 128 is two boxes side by side)."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    return tuple(TensorDescriptor(c, list(c.shape), list(c.stride()), [1, box, 1, SPAN], layout)
                 for c in (k_cache, v_cache))


def launch(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, lse, cfg, *, scale, causal, window,
           soft_cap, return_lse, skip_single=False):
    """Launch on inputs ``check_inputs`` accepted, with ``cfg`` from tile_config. ``skip_single``:
    leave the one-token sequences to a decode kernel (mixed steps)."""
    T, hq, _ = q.shape
    B, hk, page = seq_lens.shape[0], k_cache.shape[2], k_cache.shape[1]
    if T == 0 or B == 0:
        return
    group = hq // hk
    bn = cfg["BLOCK_N"]
    kd, vd = descriptors(k_cache, v_cache, min(bn, page))
    _prefill_ws_kernel[(T // (BLOCK_M // group) + B, hk)](
        q, kd, vd, out, lse, cu_seqlens_q, seq_lens, block_tables,
        float(scale), float(soft_cap or 1.0), int(window or 0), B,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, PAGE=page, BLOCK_M=BLOCK_M, BLOCK_N=bn, STAGES=cfg["STAGES"], CAUSAL=bool(causal),
        HAS_WINDOW=window is not None, HAS_CAP=soft_cap is not None, RETURN_LSE=return_lse,
        HEAD_DIM=q.shape[2], SKIP_SINGLE=skip_single, PINGPONG=bool(cfg["PINGPONG"]),
        num_warps=CONSUMER_WARPS // 2 if cfg["PINGPONG"] else CONSUMER_WARPS)


def checked_config(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window, soft_cap, k_scale,
                   v_scale, config) -> dict:
    """Every check of the entry (the attention contract, then this kernel's): its tiles, or an
    InputError naming the argument."""
    check_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap, k_scale, v_scale,
                    cu_seqlens_q=cu_seqlens_q)
    hq, hk, d = q.shape[1], k_cache.shape[2], q.shape[2]
    expect(hq // hk <= BLOCK_M, "q", f"{hq // hk} query heads per kv head", f"at most {BLOCK_M}")
    cfg = tile_config(config, d)
    check_inputs(q, k_cache, v_cache)
    return cfg


def prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, *, scale: float, causal: bool = True,
            window=None, soft_cap=None, k_scale=None, v_scale=None, return_lse: bool = False, config=None):
    """The entry of prefill.prefill's signature. ``config``: BLOCK_N (64, 128) and STAGES (2, 3)."""
    cfg = checked_config(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window, soft_cap, k_scale,
                         v_scale, config)
    T, hq, dv = q.shape[0], q.shape[1], v_cache.shape[3]
    out = torch.empty(T, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, hq, dtype=torch.float32, device=q.device) if return_lse else out
    launch(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, lse, cfg, scale=scale, causal=causal,
           window=window, soft_cap=soft_cap, return_lse=return_lse)
    return (out, lse) if return_lse else out
