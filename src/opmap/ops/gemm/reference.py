"""Plain-PyTorch linear, the oracle of the family: ``x[M, K] @ w[N, K]^T (+ bias)`` in fp32,
returned in x.dtype. fp8-e4m3 / int8 weights are dequantised with their per-output-channel
fp32 scale (``w_scale[N]``) first."""
from __future__ import annotations

import torch

from opmap.ops.gemm.validate import check_linear


def linear(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None) -> torch.Tensor:
    check_linear(x, w, bias, w_scale)
    wf = w.float()
    if w_scale is not None:
        wf = wf * w_scale[:, None]
    y = x.float() @ wf.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
