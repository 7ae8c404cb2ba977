"""Varlen paged prefill, warp-specialized on Hopper: the TMA prefill (prefill_tma.py) rewritten into
the one loop shape that Triton 3.6's Hopper warp specialization takes (``tl.range(...,
warp_specialize=True)``). Its sm90 build then splits each program into a producer warpgroup that
issues the TMA copies and two consumer warpgroups of 64 query rows each, synchronized by
mbarriers, instead of one program of 8 warps that issues its own copies ahead in software.
An explicit config (``{"WS": 1}``), not a default: built on the CPU machine in the thirteenth
session, not yet timed.

What the pass takes and what it aborts on (scripts/probes/hopper_ws.py, and docs/attention.md):
it needs 4 warps (at 8 it leaves the loop as it is), q loaded by a descriptor (q by pointer aborts
the compiler), the output stored by pointer (a descriptor store of the split rows aborts), no
other loop in the kernel (a second loop of dots aborts), no early return and no ``while`` (the
sequence search of ``prefill._locate`` is unrolled here), and no reshape of q (so no GQA packing:
a program serves one query head, its KV head's tiles shared with the group through L2).

So, against the TMA prefill: every tile goes through the masked path (one loop: the causal /
window / length mask on every tile instead of only on the tail), and a program whose query block
lies past its sequence runs an empty loop instead of returning.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...contract import expect
from .prefill import _kv_range
from .prefill_tma import _page_of, _tile_tma
from .tma import descriptors

SEARCH_STEPS = 16  # the unrolled sequence search covers up to 2**16 sequences a call


def usable(q: torch.Tensor) -> str | None:
    """None when q can be read through the kernel's descriptor (the cache: prefill_tma.usable)."""
    T, hq, d = q.shape  # d is a power of two from 16 to 256 (check_attention)
    if q.stride(2) != 1 or q.stride(1) != d:
        return "the warp-specialized prefill reads q as [tokens, heads * head_dim]: heads adjacent, dims contiguous"
    if (q.stride(0) * q.element_size()) % 16 or q.data_ptr() % 16:
        return "the warp-specialized prefill needs q's rows 16-byte aligned (a TMA descriptor)"
    return None


@triton.jit
def _locate_unrolled(cu_ptr, B, pid, BLOCK_Q: tl.constexpr, STEPS: tl.constexpr):
    """prefill._locate without its ``while`` loop (the warp specialization pass aborts on it):
    the same binary search, STEPS rounds unrolled, idle once the range is one sequence."""
    lo = pid * 0
    hi = pid * 0 + B - 1
    for _ in tl.static_range(STEPS):
        mid = (lo + hi + 1) // 2
        busy = lo < hi
        go = busy & (tl.load(cu_ptr + mid) // BLOCK_Q + mid <= pid)
        lo = tl.where(go, mid, lo)
        hi = tl.where(busy & ~go, mid - 1, hi)
    b = lo
    q0 = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q0
    return b, q0, q_len, pid - (q0 // BLOCK_Q + b)


@triton.jit(do_not_specialize=["B"])  # per step (prefill._prefill_kernel)
def _prefill_ws_kernel(Q_DESC, K_DESC, V_DESC, o_ptr, lse_ptr, cu_ptr, sl_ptr, bt_ptr,
                       scale, soft_cap, window, B, s_ot, s_oh, s_bt,
                       GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                       HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, RETURN_LSE: tl.constexpr,
                       STEPS: tl.constexpr):
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) query blocks first
    head = tl.program_id(1)
    kvh = head // GROUP
    b, q0, q_len, local = _locate_unrolled(cu_ptr, B, pid, BLOCK_M, STEPS)
    L = tl.load(sl_ptr + b)
    tok = local * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = tok < q_len
    qpos = L - q_len + tok
    # rows past the sequence read the next one's queries (or zeros past the tensor): never stored
    q = Q_DESC.load([q0 + local * BLOCK_M, head * D])
    qk_scale = scale * 1.4426950408889634
    kv_lo, _, kv_hi = _kv_range(L, q_len, local, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    kv_hi = tl.where(local * BLOCK_M < q_len, kv_hi, kv_lo)  # a block past the sequence: no tiles
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    last_page = tl.maximum(kv_hi - 1, 0) // PAGE
    # the page id in the tile's own iteration: the producer loads it before the tile's copies
    # (carried one tile ahead, as the TMA prefill does, the pass aborts)
    for start in tl.range(kv_lo, kv_hi, BLOCK_N, warp_specialize=True):
        pg = _page_of(bt_row, start, last_page, PAGE)
        acc, l_i, m_i = _tile_tma(acc, l_i, m_i, q, K_DESC, V_DESC, pg, start, kv_hi, qpos, kvh, qk_scale,
                                  scale, soft_cap, window, D, DV, PAGE, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_CAP, True)
    t64 = (q0 + tok).to(tl.int64)
    inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
    tl.store(o_ptr + (t64 * s_ot + head * s_oh)[:, None] + tl.arange(0, DV)[None, :],
             (acc * inv[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    if RETURN_LSE:
        lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + t64 * tl.num_programs(1) + head, lse, mask=row_ok)


def launch(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, lse, cfg, *, scale, causal, window,
           soft_cap, return_lse):
    """Launch on validated inputs that prefill_tma.usable and ``usable`` accepted. On a GPU the
    build is 4 warps (the pass's producer warpgroup comes on top) and 128-row blocks (two consumer
    warpgroups of 64 rows); the interpreter keeps cfg's small tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    T, hq, d = q.shape
    B, hk, page = seq_lens.shape[0], k_cache.shape[2], k_cache.shape[1]
    expect(B <= 2 ** SEARCH_STEPS, "seq_lens", f"{B} sequences", f"at most {2 ** SEARCH_STEPS} in one call")
    gpu = q.device.type == "cuda"
    bm = 128 if gpu else cfg["BLOCK_M"]
    bn = cfg["BLOCK_N"]
    qd = TensorDescriptor(q, [T, hq * d], [q.stride(0), 1], [bm, d])
    kd, vd = descriptors(k_cache, v_cache, bn)
    _prefill_ws_kernel[(T // bm + B, hq)](
        qd, kd, vd, out, lse, cu_seqlens_q, seq_lens, block_tables,
        float(scale), float(soft_cap or 1.0), int(window or 0), B,
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=hq // hk, D=d, DV=v_cache.shape[3], PAGE=page, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=bool(causal),
        HAS_WINDOW=window is not None, HAS_CAP=soft_cap is not None, RETURN_LSE=return_lse, STEPS=SEARCH_STEPS,
        num_warps=4 if gpu else cfg["num_warps"], num_stages=cfg["num_stages"] if gpu else 1)
