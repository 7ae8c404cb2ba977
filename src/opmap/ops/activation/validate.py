"""Input checks shared by every activation backend."""
from __future__ import annotations

import torch

from opmap.core.contract import expect, expect_same_device, expect_tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_act(x, out=None) -> int:
    """Validate ``x[..., 2H]`` (gate then up); returns H."""
    expect_tensor("x", x, dtype=FLOAT_DTYPES, last_dim_contiguous=True)
    expect(x.dim() >= 1, "x", f"{x.dim()} dims", ">= 1 dims [..., 2H]")
    two_h = x.shape[-1]
    expect(two_h > 0 and two_h % 2 == 0, "x", f"last dim {two_h}", "an even last dim 2H (gate | up)")
    h = two_h // 2
    if out is not None:
        expect_tensor("out", out, dtype=x.dtype, shape=(*x.shape[:-1], h), last_dim_contiguous=True)
        expect_same_device(x=x, out=out)
    return h
