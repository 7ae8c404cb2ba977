"""Weight quantisation: bf16/fp16/fp32 weights [N, K] to fp8-e4m3 or int8 with one fp32 scale
per output channel (row), symmetric, scale = max|w_row| / qmax. ``w ~= wq * scale[:, None]``.

Also the dynamic per-token fp8 quantisation of activations used by the scaled-mm backend.
"""
from __future__ import annotations

import torch

from opmap.core.contract import expect_in, expect_tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
INT8_MAX = 127.0
# A row of zeros would give scale 0 and 0/0 = NaN; any positive floor reproduces zeros exactly.
MIN_SCALE = 1e-12


def quantize_weight(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    expect_in("fmt", fmt, ("fp8", "int8"))
    expect_tensor("w", w, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=2)
    wf = w.float()
    qmax = FP8_MAX if fmt == "fp8" else INT8_MAX
    scale = (wf.abs().amax(dim=1) / qmax).clamp_min(MIN_SCALE)
    q = wf / scale[:, None]
    if fmt == "fp8":
        wq = q.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    else:
        wq = q.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return wq.contiguous(), scale.contiguous()


def dequantize_weight(wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K]; for references and tests only (kernels never materialise this)."""
    return wq.float() * scale.float()[:, None]


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row) dynamic fp8: returns (xq[M, K] fp8, scale[M, 1] fp32)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
