"""Input checks of ``apply_bitmask`` shared by every backend (raised before anything launches)."""
from __future__ import annotations

import torch

from opmap.core.contract import expect, expect_same_device, expect_tensor, expect_writable


def check_bitmask_args(logits, bitmask, rows) -> None:
    expect_tensor("logits", logits, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=2,
                  last_dim_contiguous=True)
    B, V = logits.shape
    expect_writable("logits", logits)
    W = (V + 31) // 32
    expect_tensor("bitmask", bitmask, dtype=torch.int32, shape=(B, W), last_dim_contiguous=True)
    if rows is not None:
        expect_tensor("rows", rows, dtype=(torch.int32, torch.int64), ndim=1, contiguous=True)
        expect_same_device(logits=logits, bitmask=bitmask, rows=rows)
        # Checking the range of a GPU tensor would synchronise with the host: there the kernels
        # skip an out-of-range row instead (never an out-of-bounds access); on the CPU it is free.
        if rows.device.type == "cpu" and rows.numel():
            lo, hi = int(rows.min()), int(rows.max())
            expect(lo >= 0 and hi < B, "rows", f"values in [{lo}, {hi}]", f"row indices in [0, {B})")
    else:
        expect_same_device(logits=logits, bitmask=bitmask)
    expect(V > 0, "logits", f"shape {tuple(logits.shape)}", "a vocabulary of at least 1")
