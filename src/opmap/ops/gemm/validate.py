"""Input checks shared by every gemm (linear) backend."""
from __future__ import annotations

import torch

from opmap.core.contract import expect, expect_same_device, expect_tensor, dtype_name

ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8)


def check_linear(x, w, bias=None, w_scale=None) -> tuple[int, int, int]:
    """Validate linear's arguments; returns (M, N, K).

    Dense weights have x's dtype and no scale; fp8-e4m3 / int8 weights need ``w_scale[N]`` fp32.
    """
    expect_tensor("x", x, dtype=ACT_DTYPES, ndim=2, last_dim_contiguous=True)
    M, K = x.shape
    expect_tensor("w", w, dtype=(x.dtype, *QUANT_DTYPES), ndim=2, last_dim_contiguous=True)
    N = w.shape[0]
    expect(w.shape[1] == K, "w", f"shape {tuple(w.shape)}", f"shape (N, {K}) (K = x.shape[1])")
    if w.dtype in QUANT_DTYPES:
        expect(w_scale is not None, "w_scale", "None",
               f"an fp32 tensor of shape ({N},) for {dtype_name(w.dtype)} weights")
        expect_tensor("w_scale", w_scale, dtype=torch.float32, shape=(N,), contiguous=True)
    else:
        expect(w_scale is None, "w_scale", "a tensor", f"None for {dtype_name(w.dtype)} (unquantised) weights")
    if bias is not None:
        expect_tensor("bias", bias, dtype=(x.dtype, torch.float32), shape=(N,), contiguous=True)
    expect_same_device(x=x, w=w, bias=bias, w_scale=w_scale)
    return M, N, K
