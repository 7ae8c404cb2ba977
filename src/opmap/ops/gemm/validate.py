"""Input checks shared by every gemm (linear) backend."""
from __future__ import annotations

import torch

from opmap.core.contract import expect, expect_same_device, expect_tensor, dtype_name
from opmap.ops.gemm.quant import block_of

ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8)
INT4_PACKED = torch.int32  # eight 4-bit codes a word along K (opmap.ops.gemm.quant)
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_linear(x, w, bias=None, w_scale=None, w_zero=None, int4: bool = False,
                 block: bool = False) -> tuple[int, int, int]:
    """Validate linear's arguments; returns (M, N, K).

    Dense weights have x's dtype and no scale; fp8-e4m3 / int8 weights need ``w_scale[N]`` fp32;
    int4 weights (int32 ``w[N, K // 8]``, the layout of opmap.ops.gemm.quant) need
    ``w_scale[N, K // G]`` (a scale per group of G input channels, G dividing K) and take
    ``w_zero`` uint8 codes of the same shape where the format is asymmetric (0 to 16, as every int4
    format stores them: the kernels' 16-bit conversion is exact below 128, and the values are not
    checked here, which would synchronise every call; the loaders make them); only where the
    caller reads int4 (``int4``: the reference, triton-w4a16, dequant-cublas). fp8 weights with a
    scale per b x b block (``w_scale[ceil(N / b), ceil(K / b)]``, b a power of two from 16) where the
    caller reads block scales (``block``: the reference, triton-fp8-block, dequant-cublas).
    """
    expect_tensor("x", x, dtype=ACT_DTYPES, ndim=2, last_dim_contiguous=True)
    M, K = x.shape
    expect_tensor("w", w, dtype=(x.dtype, *QUANT_DTYPES) + ((INT4_PACKED,) if int4 else ()), ndim=2,
                  last_dim_contiguous=True)
    N = w.shape[0]
    if w.dtype == INT4_PACKED:
        expect(w.shape[1] * 8 == K, "w", f"shape {tuple(w.shape)} (int32 words of eight 4-bit codes)",
               f"shape (N, {K} / 8) (K = x.shape[1], a multiple of 8)")
        expect(w_scale is not None, "w_scale", "None", "a scale per group: (N, K / group_size)")
        expect_tensor("w_scale", w_scale, dtype=SCALE_DTYPES, ndim=2, contiguous=True)
        groups = w_scale.shape[1]
        expect(w_scale.shape[0] == N and groups > 0 and K % groups == 0, "w_scale", f"shape {tuple(w_scale.shape)}",
               f"({N}, K / group_size) with the group size dividing K={K}")
        if w_zero is not None:
            expect_tensor("w_zero", w_zero, dtype=(torch.uint8,), shape=tuple(w_scale.shape), contiguous=True)
    else:
        expect(w.shape[1] == K, "w", f"shape {tuple(w.shape)}", f"shape (N, {K}) (K = x.shape[1])")
        expect(w_zero is None, "w_zero", "a tensor", "None (zero points are for int4 weights)")
        if block and w.dtype == torch.float8_e4m3fn and w_scale is not None and w_scale.dim() == 2:
            expect_tensor("w_scale", w_scale, dtype=torch.float32, ndim=2, contiguous=True)
            expect(block_of(N, K, w_scale) > 0, "w_scale", f"shape {tuple(w_scale.shape)}",
                   f"one scale per b x b block of ({N}, {K}): (ceil({N} / b), ceil({K} / b)), b a power of two >= 16")
        elif w.dtype in QUANT_DTYPES:
            expect(w_scale is not None, "w_scale", "None",
                   f"an fp32 tensor of shape ({N},) for {dtype_name(w.dtype)} weights")
            expect_tensor("w_scale", w_scale, dtype=torch.float32, shape=(N,), contiguous=True)
        else:
            expect(w_scale is None, "w_scale", "a tensor", f"None for {dtype_name(w.dtype)} (unquantised) weights")
    if bias is not None:
        expect_tensor("bias", bias, dtype=(x.dtype, torch.float32), shape=(N,), contiguous=True)
    expect_same_device(x=x, w=w, bias=bias, w_scale=w_scale, w_zero=w_zero)
    return M, N, K


def check_addend(add, x, N: int) -> None:
    """linear_add's ``add``: [M, N] in x's dtype on x's device, rows contiguous."""
    expect_tensor("add", add, dtype=(x.dtype,), shape=(x.shape[0], N), last_dim_contiguous=True)
    expect_same_device(x=x, add=add)

