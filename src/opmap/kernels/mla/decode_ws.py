"""MLA decode in Gluon with FlashMLA's Hopper structure, 16-bit caches at 64 heads or more: the
``mla-gluon-ws`` backend's decode (R = 512, Dr = 64, the DeepSeek shapes; pages of whole 64-key
tiles).

Why: at 128 heads the decode is compute bound (242 FLOP a byte), and the TMA kernel (decode_tma.py)
runs the score dots, the softmax and the value dots of a tile one after another in one 8-warp
program of 255 registers: Nsight Compute found the tensor pipe active in about a fifth of the cycles
and the long scoreboard (the latent tiles) the top stall (docs/mla.md). Here:

- a producer warp (its own partition, 24 registers) walks the split's key tiles and issues their
  TMA boxes, eight 64-column boxes of the latent and one of the RoPE part a tile, into a ring of
  ``STAGES`` stages guarded by "full" / "empty" mbarriers;
- the consumers (two warpgroups, 240 registers a thread) hold a 64-head block's scores [64, 64]
  split by keys between them and its output [64, 512] split by latent columns (256 each), as
  FlashMLA splits the value dots. q's latent part sits in shared memory, its RoPE part in
  registers. Each tile's O += P_{t-1} V_{t-1} (V is the latent part of tile t-1) is issued, then
  its scores S_t = q K_t^T: the MMAs retire in order, so the first wait frees tile t-1's stage
  while S_t still runs, and the producer's copy of tile t+1 has the rest of the tile to land (at
  128 heads the decode sits near the ridge of the H100 / H200: a load the MMAs wait for costs as
  much as the MMAs; the softmax of 64 x 64 scores is short beside them). P goes through shared
  memory (both warpgroups need all 64 keys of it).

Rows past a sequence's length may hold anything, NaN included (0 * NaN would poison the output), so
a split's partial last tile is read ending at the split's end, as the TMA kernel reads it: its rows
before the tile are keys done already (masked), rows before the page read as zeros. A page id
outside the cache (never in a valid table; a captured graph skips the host checks) reads zeros
through the descriptor and its keys are masked, as in the other MLA kernels.

The split plan, the workspace and the merge are common.py's; ``make_workspace`` plans for one program
an SM (this kernel's shared memory: q, two stages and the P buffer, about 216 KB).
"""
from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from opmap.core.contract import expect
from opmap.core.tiles import tile_config
from opmap.kernels.attention.tiles import box_positions, box_row
from opmap.kernels.gluon_util import hopper
from opmap.kernels.mla import common
from opmap.kernels.mla.common import Workspace, _split_range
from opmap.ops.mla.validate import check_decode

RANK, ROPE = 512, 64  # the latent and RoPE widths the layouts are built for (DeepSeek-V2 / V3)
BLOCK_H = 64  # heads a program: the M side of the warpgroup MMAs
BLOCK_N = 64  # keys a tile
STAGES = 2
SPAN = 64  # 16-bit elements in one 128-byte swizzle span: a TMA box's width
CONSUMER_WARPS = 8
SPLIT_MIN = 64  # fewest keys a split (one tile)


def smem_bytes() -> int:
    """Shared memory a program: q's latent part, the stages (latent + RoPE) and the P buffer."""
    return 2 * (BLOCK_H * RANK + STAGES * BLOCK_N * (RANK + ROPE) + BLOCK_H * BLOCK_N)


def make_workspace(max_batch: int, num_heads: int, rank: int, device, *, num_splits: Optional[int] = None,
                   split_min: int = SPLIT_MIN, config: Optional[dict] = None) -> Workspace:
    """Split-KV buffers for this kernel's decodes of up to ``max_batch`` sequences, the splits planned
    for its 64-head programs, one an SM; ``config`` takes no key (the layouts fix the tiles)."""
    tile_config({}, config)
    s = num_splits or common.plan_splits(max_batch, num_heads, device, BLOCK_H, CONSUMER_WARPS, 1)
    return common.workspace(max_batch, num_heads, rank, device, s, split_min)


def check_inputs(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor) -> None:
    """What this kernel needs beyond the decode contract (validate.check_decode): an InputError
    naming the argument, before any launch; the device last, so that the CPU tests reach the rest."""
    R, Dr, page = q_nope.shape[2], q_pe.shape[2], cache.shape[1]
    expect(q_nope.dtype in (torch.bfloat16, torch.float16), "q_nope", f"dtype {q_nope.dtype}", "bf16/fp16")
    expect(cache.dtype == q_nope.dtype, "cache", f"dtype {cache.dtype}",
           f"{q_nope.dtype} (as q; fp8 caches: mla-gluon-fp8)")
    expect((R, Dr) == (RANK, ROPE), "q_nope", f"latent rank {R}, rope dim {Dr}", f"{RANK} and {ROPE}")
    expect(page % BLOCK_N == 0, "cache", f"page size {page}", f"pages holding whole {BLOCK_N}-key tiles")
    expect(cache.stride(2) == 1 and cache.stride(1) == R + Dr and cache.stride(0) == page * (R + Dr)
           and cache.data_ptr() % 16 == 0, "cache", f"strides {tuple(cache.stride())}",
           "a contiguous, 16-byte aligned cache (tensor descriptors)")
    expect(q_nope.is_cuda and hopper(q_nope.device), "q_nope", f"device {q_nope.device}",
           "a CUDA sm90 device (warpgroup MMAs, TMA)")


@gluon.jit
def _producer(KV_DESC, PE_DESC, lat, rope, full, empty, bt_row, start, end, n, MAXP, NPAGES, PAGE: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Issue the boxes of the split's n tiles, STAGES tiles ahead of the MMAs. A latent stage
    [BLOCK_N, RANK] under the 128-byte swizzle is RANK / SPAN column chunks one after another, each
    [BLOCK_N, SPAN]: box c lands in chunk c. A partial last tile is read ending at the split's end
    (attention/tiles.box_row: past a sequence's length a row may hold anything, NaN included)."""
    CH_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    BOX_L: gl.constexpr = KV_DESC.layout
    dt: gl.constexpr = KV_DESC.dtype
    W: gl.constexpr = KV_DESC.block_type.shape[2]
    R: gl.constexpr = lat.type.shape[2]
    DR: gl.constexpr = rope.type.shape[2]
    raw_next = _page_id(bt_row, start, MAXP, PAGE)
    for t in range(n):
        s = t % STAGES
        n0 = start + t * BLOCK_N
        pidx = n0 // PAGE
        # the page id was loaded a tile ahead, before the wait for the stage
        raw = raw_next
        raw_next = _page_id(bt_row, n0 + BLOCK_N, MAXP, PAGE)
        ok = (pidx < MAXP) & (raw >= 0) & (raw < NPAGES)
        page = gl.where(ok, raw, NPAGES)  # past the descriptor's pages: zeros (masked by the consumers)
        row = box_row(n0, end, pidx, PAGE, BLOCK_N)  # a partial last tile read ending at the split's end
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(full.index(s), BLOCK_N * (R + DR) * dt.primitive_bitwidth // 8)
        chunks = lat.index(s)._reinterpret(dt, [R // W, BLOCK_N, W], CH_L)
        for c in gl.static_range(R // W):
            tma.async_copy_global_to_shared(KV_DESC, [page, row, c * W], full.index(s),
                                            chunks.index(c)._reinterpret(dt, [1, BLOCK_N, W], BOX_L))
        tma.async_copy_global_to_shared(PE_DESC, [page, row, 0], full.index(s),
                                        rope.index(s)._reinterpret(dt, [1, BLOCK_N, DR], BOX_L))


@gluon.jit
def _chunks(buf, dt: gl.constexpr, ROWS: gl.constexpr, R: gl.constexpr, W: gl.constexpr):
    """A [ROWS, R] buffer under the 128-byte swizzle as its R / W column chunks [ROWS, W]."""
    return buf._reinterpret(dt, [R // W, ROWS, W], gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                                       rank=2))


@gluon.jit
def _page_id(bt_row, n0, MAXP, PAGE: gl.constexpr):
    """The block-table entry of the tile at n0, its index clamped into the table (0 for a table of
    no columns, which the host checks refuse but a captured graph does not check)."""
    return gl.load(bt_row + gl.maximum(gl.minimum(n0 // PAGE, MAXP - 1), 0))


@gluon.jit
def _tile_ok(bt_row, n0, MAXP, NPAGES, PAGE: gl.constexpr):
    """Whether the tile at n0 reads a page of the sequence's table that lies inside the cache."""
    raw = _page_id(bt_row, n0, MAXP, PAGE)
    return (n0 // PAGE < MAXP) & (raw >= 0) & (raw < NPAGES)


@gluon.jit
def _scores(q_smem, qp, lat_tile, rope_tile, s_zero):
    """The async score MMAs of a tile: q's latent part (shared memory) and RoPE part (registers)."""
    tok = warpgroup_mma(q_smem, lat_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return warpgroup_mma(qp, rope_tile.permute((1, 0)), tok, is_async=True)


@gluon.jit
def _masked(s, n0, end, ok, cols, qk_scale, BLOCK_N: gl.constexpr):
    """Scores to the exp2 domain, -inf for keys past the split's end, keys done already (a partial
    tile's rows before n0) and keys of a page outside the cache."""
    pos, new_key = box_positions(n0, cols, end, BLOCK_N)
    return gl.where(((pos < end) & new_key & ok)[None, :], s * qk_scale, float("-inf"))


@gluon.jit
def _consumer(QN, QP, O, LSE, PO, PLSE, q_smem, lat, rope, p_smem, full, empty, b, hb, split, start, end, n, H,
              bt_row, MAXP, NPAGES, qk_scale, s_qnb, s_qnh, s_qpb, s_qph, s_ob, s_oh, s_pob, s_poh, s_pos, s_plb,
              s_plh, NUM_SPLITS: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    NW: gl.constexpr = gl.num_warps()
    BH: gl.constexpr = q_smem.type.shape[0]
    R: gl.constexpr = q_smem.type.shape[1]
    DR: gl.constexpr = rope.type.shape[2]
    W: gl.constexpr = 64
    dt: gl.constexpr = q_smem.dtype
    # scores [heads, keys] split by keys between the warpgroups; the output split by latent columns
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NW // 4],
                                                  instr_shape=[16, BLOCK_N // (NW // 4), 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NW // 4],
                                                  instr_shape=[16, R // (NW // 4), 16])
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (W // 8), W // 8], [NW, 1], [1, 0])

    # q: the latent part into shared memory a column chunk at a time, the RoPE part into registers
    h = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, QL))
    hm = (h < H)[:, None]
    w = gl.arange(0, W, layout=gl.SliceLayout(0, QL))
    qrow = QN + b * s_qnb + h[:, None].to(gl.int64) * s_qnh
    qch = _chunks(q_smem, dt, BH, R, W)
    for c in gl.static_range(R // W):
        qch.index(c).store(gl.load(qrow + c * W + w[None, :], mask=hm, other=0.0))
    # loaded straight in the MMA operand's layout: a layout conversion would take 8 KB of shared
    # memory beyond the program's 216 KB
    QP_A: gl.constexpr = gl.DotOperandLayout(0, S_L, 2)
    hp = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, QP_A))
    dp = gl.arange(0, DR, layout=gl.SliceLayout(0, QP_A))
    qp = gl.load(QP + b * s_qpb + hp[:, None].to(gl.int64) * s_qph + dp[None, :], mask=(hp < H)[:, None], other=0.0)
    fence_async_shared()
    gl.thread_barrier()

    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    m_i = gl.full([BH], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BH], gl.float32, gl.SliceLayout(1, S_L))
    acc = gl.zeros([BH, R], gl.float32, O_L)
    s_zero = gl.zeros([BH, BLOCK_N], gl.float32, S_L)
    if n > 0:
        mbarrier.wait(full.index(0), 0)
        s = warpgroup_mma_wait(0, deps=[_scores(q_smem, qp, lat.index(0), rope.index(0), s_zero)])
        s = _masked(s, start, end, _tile_ok(bt_row, start, MAXP, NPAGES, PAGE), cols, qk_scale, BLOCK_N)
        m_i = gl.max(s, 1)
        m_ref = gl.where(m_i == float("-inf"), 0.0, m_i)
        p = gl.exp2(s - m_ref[:, None])
        l_i = gl.sum(p, 1)
        p_smem.store(p.to(dt))
        fence_async_shared()
        gl.thread_barrier()
        for t in range(1, n):
            st = t % STAGES
            prev = (t - 1) % STAGES
            n0 = start + t * BLOCK_N
            mbarrier.wait(full.index(st), (t // STAGES) & 1)
            # P_{t-1} V_{t-1} first, then S_t: the MMAs retire in order, so the wait for the
            # first frees tile t-1's stage while S_t still runs, and the producer's copy of
            # tile t+1 into it has the rest of this tile to land
            o_tok = warpgroup_mma(p_smem, lat.index(prev), acc, is_async=True)
            s_tok = _scores(q_smem, qp, lat.index(st), rope.index(st), s_zero)
            acc = warpgroup_mma_wait(2, deps=[o_tok])
            mbarrier.arrive(empty.index(prev), count=1)
            s = warpgroup_mma_wait(0, deps=[s_tok])
            s = _masked(s, n0, end, _tile_ok(bt_row, n0, MAXP, NPAGES, PAGE), cols, qk_scale, BLOCK_N)
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_ref)
            p = gl.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            p_smem.store(p.to(dt))  # P_{t-1}'s MMA is done: one buffer
            fence_async_shared()
            gl.thread_barrier()
        last = (n - 1) % STAGES
        o_tok = warpgroup_mma(p_smem, lat.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(empty.index(last), count=1)

    RO: gl.constexpr = gl.SliceLayout(1, O_L)
    l_o = gl.convert_layout(l_i, RO)
    pos = l_o != 0  # 0: nothing attended; NaN (a NaN score) stays NaN in the output and the LSE
    inv = gl.where(pos, 1.0 / gl.where(pos, l_o, 1.0), 0.0)
    lse = gl.where(pos, (gl.convert_layout(m_i, RO) + gl.log2(gl.where(pos, l_o, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    o = acc * inv[:, None]
    ho = hb * BH + gl.arange(0, BH, layout=RO)
    hok = ho < H
    ro = gl.arange(0, R, layout=gl.SliceLayout(0, O_L))
    h64 = ho.to(gl.int64)
    if NUM_SPLITS == 1:
        gl.store(O + b * s_ob + (h64 * s_oh)[:, None] + ro[None, :], o.to(O.dtype.element_ty), mask=hok[:, None])
        gl.store(LSE + b * H + ho, lse, mask=hok)
    else:
        gl.store(PO + b * s_pob + (h64 * s_poh)[:, None] + split * s_pos + ro[None, :], o, mask=hok[:, None])
        gl.store(PLSE + b * s_plb + h64 * s_plh + split, lse, mask=hok)


@gluon.jit
def _mla_decode_ws_kernel(QN, QP, KV_DESC, PE_DESC, SEQ_LENS, TABLES, O, LSE, PO, PLSE, sm_scale, H, MAXP, NPAGES,
                   SPLIT_MIN, s_qnb, s_qnh, s_qpb, s_qph, s_tb, s_ob, s_oh, s_pob, s_poh, s_pos, s_plb, s_plh,
                   NUM_SPLITS: gl.constexpr, PAGE: gl.constexpr, BH: gl.constexpr, R: gl.constexpr,
                   DR: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    hb = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    _, used, start, end = _split_range(SEQ_LENS, b, split, 0, SPLIT_MIN, NUM_SPLITS, BLOCK_N, False)
    if split < used:
        n = gl.cdiv(end - start, BLOCK_N)
        dt: gl.constexpr = KV_DESC.dtype
        TILE: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_smem = gl.allocate_shared_memory(dt, [BH, R], TILE)
        lat = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, R], TILE)
        rope = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DR], TILE)
        p_smem = gl.allocate_shared_memory(dt, [BH, BLOCK_N], TILE)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        bt_row = TABLES + b * s_tb
        qk_scale = sm_scale * 1.4426950408889634
        gl.warp_specialize([
            (_consumer, (QN, QP, O, LSE, PO, PLSE, q_smem, lat, rope, p_smem, full, empty, b, hb, split, start, end,
                         n, H, bt_row, MAXP, NPAGES, qk_scale, s_qnb, s_qnh, s_qpb, s_qph, s_ob, s_oh, s_pob, s_poh,
                         s_pos, s_plb, s_plh, NUM_SPLITS, PAGE, BLOCK_N, STAGES)),
            (_producer, (KV_DESC, PE_DESC, lat, rope, full, empty, bt_row, start, end, n, MAXP, NPAGES, PAGE, BLOCK_N,
                         STAGES)),
        ], [1], [24])


def descriptors(cache: torch.Tensor, R: int, Dr: int):
    """[pages, page, R] and [pages, page, Dr] Gluon descriptors of the cache, boxes of BLOCK_N rows
    of one page and SPAN (latent) or Dr (RoPE) columns: rows and pages outside read as zeros."""
    P, page, _ = cache.shape
    strides = [page * (R + Dr), R + Dr, 1]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    return (TensorDescriptor(cache, [P, page, R], strides, [1, BLOCK_N, SPAN], layout),
            TensorDescriptor(cache[:, :, R:], [P, page, Dr], strides, [1, BLOCK_N, Dr], layout))


def launch(q_nope, q_pe, cache, seq_lens, block_tables, scale, out, lse, workspace) -> None:
    """The kernel on inputs ``check_inputs`` accepted."""
    B, H, R = q_nope.shape
    Dr = q_pe.shape[2]
    kv, pe = descriptors(cache, R, Dr)
    S = workspace.num_splits
    po, pl = workspace.part_o, workspace.part_lse
    _mla_decode_ws_kernel[(-(-H // BLOCK_H), S, B)](
        q_nope, q_pe, kv, pe, seq_lens, block_tables, out, lse, po, pl, float(scale), H, block_tables.shape[1],
        cache.shape[0], max(workspace.split_min, BLOCK_N), q_nope.stride(0), q_nope.stride(1), q_pe.stride(0),
        q_pe.stride(1), block_tables.stride(0), out.stride(0), out.stride(1), po.stride(0), po.stride(1),
        po.stride(2), pl.stride(0), pl.stride(1), NUM_SPLITS=S, PAGE=cache.shape[1], BH=BLOCK_H, R=R, DR=Dr,
        BLOCK_N=BLOCK_N, STAGES=STAGES, num_warps=CONSUMER_WARPS)


def mla_decode(q_nope, q_pe, cache, seq_lens, block_tables, *, scale: float, kv_scale=None,
               return_lse: bool = False, workspace: Optional[Workspace] = None, config=None):
    """The entry of decode.mla_decode's signature (dense decode of a 16-bit cache)."""
    tile_config({}, config)
    check_decode(q_nope, q_pe, cache, seq_lens, block_tables, kv_scale, scale)
    check_inputs(q_nope, q_pe, cache)
    out, lse, workspace = common.decode_outputs(q_nope, workspace, make_workspace)
    if q_nope.shape[0] > 0:
        launch(q_nope, q_pe, cache, seq_lens, block_tables, scale, out, lse, workspace)
        common.merge(workspace, out, lse, seq_lens, 0, max(workspace.split_min, BLOCK_N), False)
    return (out, lse) if return_lse else out
