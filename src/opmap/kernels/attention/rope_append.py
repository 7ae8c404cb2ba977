"""RoPE and the paged KV append in one launch: the entry ``rope_append`` of the kv_append op.

The engine's attention step ran ``rope(q, k)`` then ``append(k, v)``: two launches per layer
whose work at decode is a few KB, so each costs its launch latency, once per layer and step
(docs/attention.md, Decisions: RoPE + KV append in one launch). This kernel does both for
one token per program: q and k rotated in place (exactly as ``rope``: fp32 math, one rounding to
the tensor's dtype), the rotated k row and the v row written to slot ``slot_mapping[t]`` of the
NHD caches (exactly as ``append``: -1 skips, fp8 caches store value / scale saturated to +-448).
Same formulas in the same order as the two kernels: the results are bitwise equal to the two
launches on the interpreter (tests/test_rope_append.py) and on the GPU (tests/gpu, compared
bitwise as well; a compiler contracting the products differently would show there).

A k row is rotated pair by pair as rope does it, and the rotated pairs go from the same registers
to the cache; dims at or above the rotary dim (partial rotary) are copied to the cache unrotated.
"""
from __future__ import annotations

import triton
import triton.language as tl

from opmap.core.tiles import tile_config
from opmap.kernels import pdl
from opmap.kernels.pdl import enter
from opmap.kernels.norm.triton_norm import norm_rows
from opmap.kernels.rope.triton_rope import pair_index, rotate_heads, rotate_pairs
from opmap.ops.rope.validate import check_rope
from opmap.kernels.attention import kv_append as A
from opmap.ops.attention import validate as V


@triton.jit
def _rope_kv_append_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
                           wq_ptr, wk_ptr, eps, stride_qt, stride_qh, stride_kt, stride_vt, HQ, HALF,
                           HK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, IS_NEOX: tl.constexpr,
                           BLOCK_QH: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_DV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, FP8: tl.constexpr,
                           QK_NORM: tl.constexpr = False, BLOCK_QN: tl.constexpr = 1, Q_HEADS: tl.constexpr = 0,
                           PDL: tl.constexpr = False):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    # Q_HEADS 0: program (t, 0) does the whole token; else program (t, 0) does k and v and program
    # (t, g > 0) q heads [(g - 1) Q_HEADS, g Q_HEADS), each head's math unchanged (the same bits).
    g = tl.program_id(1)
    if Q_HEADS == 0:
        q_lo = 0
        q_hi = HQ
        do_kv = g >= 0
    else:
        q_lo = tl.maximum(g - 1, 0) * Q_HEADS
        q_hi = tl.minimum(q_lo + Q_HEADS, HQ) * (g > 0)
        do_kv = g == 0
    if QK_NORM:
        # Qwen3's per-head q_norm / k_norm first, in place, with qk_rmsnorm's row helper (HF
        # numerics); the barrier makes every thread's normalised values visible to the loads below.
        dt = q_ptr.dtype.element_ty
        dn = tl.arange(0, BLOCK_D)[None, :]
        wq = tl.load(wq_ptr + dn, mask=dn < D, other=0.0).to(tl.float32)
        wk = tl.load(wk_ptr + dn, mask=dn < D, other=0.0).to(tl.float32)
        for h0 in range(q_lo, q_hi, BLOCK_QN):
            hq = (h0 + tl.arange(0, BLOCK_QN))[:, None]
            mq = (hq < q_hi) & (dn < D)
            pq = q_ptr + t * stride_qt + hq.to(tl.int64) * stride_qh + dn
            vq = tl.load(pq, mask=mq, other=0.0).to(tl.float32)
            tl.store(pq, norm_rows(vq, wq, D, eps, dt).to(dt), mask=mq)
        hk = tl.arange(0, BLOCK_HK)[:, None]
        mk = (hk < HK) & (dn < D) & do_kv
        pk = k_ptr + t * stride_kt + hk * D + dn
        vk = tl.load(pk, mask=mk, other=0.0).to(tl.float32)
        tl.store(pk, norm_rows(vk, wk, D, eps, dt).to(dt), mask=mk)
        tl.debug_barrier()
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cs_row = cs_ptr + pos * (2 * HALF)
    # q: all heads of the token, in place (the rope kernel's own helper, so the bits match).
    dh = tl.arange(0, BLOCK_HALF)
    c = tl.load(cs_row + dh, mask=dh < HALF, other=0.0)[None, :]
    s = tl.load(cs_row + HALF + dh, mask=dh < HALF, other=0.0)[None, :]
    for h0 in range(q_lo, q_hi, BLOCK_QH):
        rotate_heads(q_ptr + t * stride_qt, stride_qh, h0, q_hi, c, s, HALF, IS_NEOX, BLOCK_QH, BLOCK_HALF)
    # k: its rotary pairs in place with the same helper (so the bits match rope's) and, from the
    # same registers, into the cache row; dims at or above the rotary dim are copied unrotated.
    # Each thread stores only values it loaded itself: an earlier version loaded each element's
    # partner through a second, permuted load and raced with the in-place store of another warp
    # (caught on the H200 by the bitwise GPU test, not by the interpreter, which runs one thread).
    h = tl.arange(0, BLOCK_HK)[:, None]
    i1, i2 = pair_index(dh[None, :], HALF, IS_NEOX)
    okr = (h < HK) & (dh[None, :] < HALF) & do_kv
    kp = k_ptr + t * stride_kt + h * D
    y1, y2 = rotate_pairs(kp, i1, i2, okr, c, s)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & do_kv:
        crow = kc_ptr + slot * (HK * D) + h * D
        _store_row(crow + i1, y1, ks_ptr, h, HK, okr, FP8)
        _store_row(crow + i2, y2, ks_ptr, h, HK, okr, FP8)
        if BLOCK_PASS > 0:
            dp = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
            okp = (h < HK) & (dp < D)
            _store_row(crow + dp, tl.load(kp + dp, mask=okp, other=0.0), ks_ptr, h, HK, okp, FP8)
        dv = tl.arange(0, BLOCK_DV)[None, :]
        okv = (h < HK) & (dv < DV)
        vv = tl.load(v_ptr + t * stride_vt + h * DV + dv, mask=okv, other=0.0)
        _store_row(vc_ptr + slot * (HK * DV) + h * DV + dv, vv, vs_ptr, h, HK, okv, FP8)


@triton.jit
def _store_row(ptr, x, scale_ptr, h, HK, mask, FP8: tl.constexpr):
    """One token's [Hk, D] cache row, as the append kernel writes it (fp8: value / the kv head's
    scale, IEEE division, saturated to +-448)."""
    if FP8:
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr + h, mask=h < HK, other=1.0)), -448.0, 448.0)
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


# Up to DECODE_TOKENS tokens a call (decode steps) a token is spread over programs of DECODE_Q_HEADS q
# heads each (docs/attention.md, Decisions: RoPE + append's q heads a program at decode); above,
# one program a token.
DECODE_TOKENS, DECODE_Q_HEADS = 64, 4


def rope_append(q, k, v, positions, cos_sin, style, k_cache, v_cache, slot_mapping, k_scale=None,
                v_scale=None, qk_norm=None, config=None) -> None:
    """``rope(q, k, positions, cos_sin, style)`` then ``append(k, v, k_cache, v_cache, slot_mapping,
    k_scale, v_scale)`` in one launch, with both entries' checks and results. ``qk_norm=(w_q, w_k,
    eps)``: Qwen3's per-head RMSNorm of q and k first (``qk_rmsnorm``), in the same launch.
    ``config={"Q_HEADS": n}``: n > 0 spreads a token over programs, one for k and v and one for each
    n q heads (a decode step's few tokens as several short programs instead of one long one); 0,
    one program a token; by default DECODE_Q_HEADS up to DECODE_TOKENS tokens, else 0."""
    default = {"Q_HEADS": DECODE_Q_HEADS if q.shape[0] <= DECODE_TOKENS else 0}
    qh = (default if config is None else tile_config(default, config))["Q_HEADS"]
    r = check_rope(q, k, positions, cos_sin, style)
    norm = V.check_qk_norm_arg(qk_norm, q)
    _, _, hk, d, dv = A.check_append(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    T, HQ, _ = q.shape
    if T == 0:
        return None
    half = r // 2
    block_half = triton.next_power_of_2(half)
    qh = min(qh, HQ)
    block_qh = max(1, min(triton.next_power_of_2(qh or HQ), 2048 // block_half))
    fp8 = k_cache.dtype == V.FP8
    block_d = triton.next_power_of_2(d)
    w_q, w_k, eps = norm if norm is not None else (q, q, 0.0)
    _rope_kv_append_kernel[(T, 1 + triton.cdiv(HQ, qh) if qh else 1)](
        q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, k_scale if fp8 else k_cache,
        v_scale if fp8 else v_cache, w_q, w_k, eps, q.stride(0), q.stride(1), k.stride(0), v.stride(0), HQ, half,
        HK=hk, D=d, DV=dv, IS_NEOX=style == "neox", BLOCK_QH=block_qh, BLOCK_HK=triton.next_power_of_2(hk),
        BLOCK_D=block_d, BLOCK_DV=triton.next_power_of_2(dv), BLOCK_HALF=block_half,
        BLOCK_PASS=triton.next_power_of_2(d - 2 * half) if d > 2 * half else 0, FP8=fp8,
        QK_NORM=norm is not None, BLOCK_QN=max(1, min(triton.next_power_of_2(qh or HQ), 2048 // block_d)),
        Q_HEADS=qh, num_warps=4, **pdl.launch(q.device))
    return None
