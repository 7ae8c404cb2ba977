"""Paged KV append in Triton: k[t], v[t] -> slot ``slot_mapping[t]`` of the NHD caches.

One program per (token, chunk of the Hk*D row): a token's row is contiguous in the cache
(one page slot holds all KV heads), so each program is one contiguous read and one contiguous
write. Slot -1 means skip (CUDA-graph padding needs no special case). fp8 caches store
value / scale per kv head (IEEE division, as torch's, so the bytes match the reference),
saturated to +-448 (the reference does the same).
"""
from __future__ import annotations

import triton
import triton.language as tl

from opmap.core.contract import expect, expect_tensor
from opmap.kernels import pdl
from opmap.kernels.pdl import enter
from opmap.ops.attention import validate as V


@triton.jit
def _append_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
                   stride_kt, stride_vt, ROW_K: tl.constexpr, ROW_V: tl.constexpr, D: tl.constexpr,
                   DV: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mk = offs < ROW_K
    x = tl.load(k_ptr + t * stride_kt + offs, mask=mk, other=0.0)
    if FP8:
        s = tl.load(ks_ptr + offs // D, mask=mk, other=1.0)
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), s), -448.0, 448.0)
    tl.store(kc_ptr + slot * ROW_K + offs, x.to(kc_ptr.dtype.element_ty), mask=mk)
    mv = offs < ROW_V
    y = tl.load(v_ptr + t * stride_vt + offs, mask=mv, other=0.0)
    if FP8:
        s = tl.load(vs_ptr + offs // DV, mask=mv, other=1.0)
        y = tl.clamp(tl.math.div_rn(y.to(tl.float32), s), -448.0, 448.0)
    tl.store(vc_ptr + slot * ROW_V + offs, y.to(vc_ptr.dtype.element_ty), mask=mv)


def _check_rows(name, x, hk, d, device, n=None):
    expect_tensor(name, x, ndim=3, dtype=V.Q_DTYPES, shape=(n, hk, d), device=device)
    # The (head, dim) part of a row must be dense; the token stride is free (a slice of a fused
    # QKV projection output is fine).
    expect(x.stride(2) == 1 and (hk == 1 or x.stride(1) == d), name, f"strides {x.stride()}",
           f"(*, {d}, 1): heads and dims dense")


def check_append(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> tuple:
    """append's argument checks (rope_append runs them too); returns (P, page, Hk, D, Dv)."""
    P, page, hk, d, dv = V.check_cache(k_cache, v_cache)
    _check_rows("k", k, hk, d, k_cache.device)
    _check_rows("v", v, hk, dv, k_cache.device, k.shape[0])
    expect(v.dtype == k.dtype, "v", f"dtype {v.dtype}", f"{k.dtype} (k's)")
    if k_cache.dtype != V.FP8:
        expect(k_cache.dtype == k.dtype, "k_cache", f"dtype {k_cache.dtype}", f"{k.dtype} (k's) or fp8")
    V.check_scales(k_scale, v_scale, k_cache, hk)
    expect(slot_mapping.device == k_cache.device, "slot_mapping", f"device {slot_mapping.device}",
           f"device {k_cache.device}")
    V.check_slots(slot_mapping, k.shape[0], P * page)
    return P, page, hk, d, dv


def append(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    P, page, hk, d, dv = check_append(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    T = k.shape[0]
    if T == 0:
        return
    row = max(hk * d, hk * dv)
    block = min(triton.next_power_of_2(row), 4096)
    fp8 = k_cache.dtype == V.FP8
    grid = (T, triton.cdiv(row, block))
    _append_kernel[grid](k, v, k_cache, v_cache, slot_mapping, k_scale if fp8 else k_cache,
                         v_scale if fp8 else v_cache, k.stride(0), v.stride(0), hk * d, hk * dv, d, dv,
                         BLOCK=block, FP8=fp8, num_warps=4, **pdl.launch(k.device))
