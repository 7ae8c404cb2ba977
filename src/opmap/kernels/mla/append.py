"""Latent KV append in Triton: ``append_mla(ckv[T, R], kpe[T, Dr], cache[P, page, R + Dr],
slot_mapping[T], kv_scale=None)`` (contract in reference.py).

One program per token writes its [ckv, kpe] row at ``slot_mapping[t]``; slot -1 (CUDA-graph
padding) and, when values were not checkable (graph capture), any slot past the cache are
skipped so that no write lands outside it. An fp8 cache stores value / scale clamped to +-448,
the same as the reference's ``quantize``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.ops.mla.validate import check_append, scale_alias


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
    if FP8:
        if SCALE_FROM_PTR:
            ks = tl.load(SCALE_PTR)
        else:
            ks = kv_scale
        # a correctly rounded division (not x * (1/s)), so that the stored bytes equal torch's
        ckv = tl.clamp(tl.math.div_rn(ckv.to(tl.float32), ks), -448.0, 448.0)
        kpe = tl.clamp(tl.math.div_rn(kpe.to(tl.float32), ks), -448.0, 448.0)
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
