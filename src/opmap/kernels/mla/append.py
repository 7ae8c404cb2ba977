"""Latent KV append in Triton: ``append_mla(ckv[T, R], kpe[T, Dr], cache[P, page, R + Dr],
slot_mapping[T], kv_scale=None)`` (contract in reference.py), and ``norm_rope_append_mla``: the
latent RMSNorm, the RoPE of q_pe and kpe, and that append in one launch (an MLA layer ran them as
three launches, plus nothing between them: each costs its launch latency at decode). It uses the
norm's and the rope's own row helpers: q_pe and kpe are theirs bit for bit; the latent row's sum of
squares runs over another layout than the norm kernel's, so on a GPU it may differ by one rounding
of the normalised value (bitwise equal in the interpreter).

One program per token writes its [ckv, kpe] row at ``slot_mapping[t]``; slot -1 (CUDA-graph
padding) and, when values were not checkable (graph capture), any slot past the cache are
skipped so that no write lands outside it. An fp8 cache stores value / scale clamped to +-448,
the same as the reference's ``quantize``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.kernels.norm.triton_norm import norm_rows
from opmap.kernels.rope.triton_rope import pair_index, rotate_heads, rotate_pairs
from opmap.ops.mla.validate import check_append, check_norm_rope_append, scale_alias


@triton.jit
def _scale(SCALE_PTR, kv_scale, FP8: tl.constexpr, SCALE_FROM_PTR: tl.constexpr):
    """The fp8 cache's scale (from its tensor or the float argument); 1.0 for a 16-bit cache."""
    if FP8:
        if SCALE_FROM_PTR:
            return tl.load(SCALE_PTR)
        return kv_scale
    return 1.0


@triton.jit
def _fp8_of(x, FP8: tl.constexpr, ks):
    """What an fp8 cache stores for x: a correctly rounded division (not x * (1/s)), so that the
    stored bytes equal torch's, clamped to +-448; x as is for a 16-bit cache."""
    y = x
    if FP8:  # one return: Triton types every return of a function, so two of fp32 and bf16 do not compile
        y = tl.clamp(tl.math.div_rn(x.to(tl.float32), ks), -448.0, 448.0)
    return y


@triton.jit
def _mla_append_kernel(CKV, KPE, CACHE, SLOTS, SCALE_PTR, kv_scale, R, DR, NSLOTS, s_ckv, s_kpe, s_row,
                   BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, FP8: tl.constexpr,
                   SCALE_FROM_PTR: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if (slot < 0) | (slot >= NSLOTS):
        return
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_DR)
    ckv = tl.load(CKV + t * s_ckv + offs_r, mask=offs_r < R, other=0.0)
    kpe = tl.load(KPE + t * s_kpe + offs_d, mask=offs_d < DR, other=0.0)
    ks = _scale(SCALE_PTR, kv_scale, FP8, SCALE_FROM_PTR)
    ckv = _fp8_of(ckv, FP8, ks)
    kpe = _fp8_of(kpe, FP8, ks)
    dst = CACHE + slot * s_row
    tl.store(dst + offs_r, ckv.to(CACHE.dtype.element_ty), mask=offs_r < R)
    tl.store(dst + R + offs_d, kpe.to(CACHE.dtype.element_ty), mask=offs_d < DR)


def append_mla(ckv, kpe, cache, slot_mapping, kv_scale=None, *, scale=None) -> None:
    kv_scale = scale_alias(kv_scale, scale)
    check_append(ckv, kpe, cache, slot_mapping, kv_scale)
    T, R = ckv.shape
    if T == 0:
        return
    fp8 = cache.dtype == torch.float8_e4m3fn
    from_ptr = fp8 and isinstance(kv_scale, torch.Tensor)
    _mla_append_kernel[(T,)](
        ckv, kpe, cache, slot_mapping, kv_scale if from_ptr else slot_mapping,
        float(kv_scale) if fp8 and not from_ptr else 1.0, R, kpe.shape[1],
        cache.shape[0] * cache.shape[1], ckv.stride(0), kpe.stride(0), cache.stride(1),
        BLOCK_R=triton.next_power_of_2(R), BLOCK_DR=triton.next_power_of_2(kpe.shape[1]), FP8=fp8,
        SCALE_FROM_PTR=from_ptr, num_warps=4)


@triton.jit
def _norm_rope_append_kernel(Q, KVA, W, POS, CS, CACHE, SLOTS, SCALE_PTR, kv_scale, eps, HQ, R, HALF, NSLOTS, s_qt,
                             s_qh, s_kva, s_row, IS_NEOX: tl.constexpr, BLOCK_QH: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, FP8: tl.constexpr,
                             SCALE_FROM_PTR: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    dh = tl.arange(0, BLOCK_HALF)
    cs_row = CS + pos * (2 * HALF)
    c = tl.load(cs_row + dh, mask=dh < HALF, other=0.0)[None, :]
    s = tl.load(cs_row + HALF + dh, mask=dh < HALF, other=0.0)[None, :]
    for h0 in range(0, HQ, BLOCK_QH):  # q_pe of every head, in place (rope's helper: its bits)
        rotate_heads(Q + t * s_qt, s_qh, h0, HQ, c, s, HALF, IS_NEOX, BLOCK_QH, BLOCK_HALF)
    # kpe in place and, from the same registers, into the cache row (as rope_append does for k)
    i1, i2 = pair_index(dh[None, :], HALF, IS_NEOX)
    okr = dh[None, :] < HALF
    row = KVA + t * s_kva
    y1, y2 = rotate_pairs(row + R, i1, i2, okr, c, s)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if (slot >= 0) & (slot < NSLOTS):
        ks = _scale(SCALE_PTR, kv_scale, FP8, SCALE_FROM_PTR)
        dt = KVA.dtype.element_ty
        offs = tl.arange(0, BLOCK_R)[None, :]
        v = tl.load(row + offs, mask=offs < R, other=0.0).to(tl.float32)
        w = tl.load(W + offs, mask=offs < R, other=0.0).to(tl.float32)
        ckv = norm_rows(v, w, R, eps, dt).to(dt)  # the norm's rounding, then the cache's
        dst = CACHE + slot * s_row
        ct = CACHE.dtype.element_ty
        tl.store(dst + offs, _fp8_of(ckv, FP8, ks).to(ct), mask=offs < R)
        tl.store(dst + R + i1, _fp8_of(y1, FP8, ks).to(ct), mask=okr)
        tl.store(dst + R + i2, _fp8_of(y2, FP8, ks).to(ct), mask=okr)


def norm_rope_append_mla(q_pe, kva, norm_weight, eps, positions, cos_sin, style, cache, slot_mapping,
                         kv_scale=None) -> None:
    """reference.norm_rope_append_mla in one launch, one program a token."""
    T, R, Dr = check_norm_rope_append(q_pe, kva, norm_weight, eps, positions, cos_sin, style, cache, slot_mapping,
                                      kv_scale)
    if T == 0:
        return
    HQ, half = q_pe.shape[1], Dr // 2
    block_half = triton.next_power_of_2(half)
    fp8 = cache.dtype == torch.float8_e4m3fn
    from_ptr = fp8 and isinstance(kv_scale, torch.Tensor)
    _norm_rope_append_kernel[(T,)](
        q_pe, kva, norm_weight, positions, cos_sin, cache, slot_mapping, kv_scale if from_ptr else slot_mapping,
        float(kv_scale) if fp8 and not from_ptr else 1.0, float(eps), HQ, R, half, cache.shape[0] * cache.shape[1],
        q_pe.stride(0), q_pe.stride(1), kva.stride(0), cache.stride(1), IS_NEOX=style == "neox",
        BLOCK_QH=max(1, min(triton.next_power_of_2(HQ), 2048 // block_half)), BLOCK_R=triton.next_power_of_2(R),
        BLOCK_HALF=block_half, FP8=fp8, SCALE_FROM_PTR=from_ptr, num_warps=4)
