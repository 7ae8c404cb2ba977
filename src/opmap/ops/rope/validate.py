"""Input checks shared by every rope backend."""
from __future__ import annotations


import torch

from opmap.core.contract import expect, expect_in, expect_same_device, expect_tensor, expect_writable

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
STYLES = ("neox", "gptj")


def check_rope(q, k, positions, cos_sin, style, check_values: bool = False) -> int:
    """Validate rope's arguments; returns rotary_dim.

    Position values are range-checked when ``check_values`` is set or the tensors are on the
    CPU; on a GPU that check would synchronise with the host, so there it runs only when asked
    (an out-of-range position is the caller's contract to keep).
    """
    expect_in("style", style, STYLES)
    expect_tensor("q", q, dtype=FLOAT_DTYPES, ndim=3, last_dim_contiguous=True)
    T, _, D = q.shape
    expect_tensor("k", k, dtype=q.dtype, ndim=3, last_dim_contiguous=True)
    expect_writable("q", q)
    expect_writable("k", k)
    expect(k.shape[0] == T and k.shape[2] == D, "k", f"shape {tuple(k.shape)}",
           f"shape ({T}, Hk, {D}) (tokens and head_dim of q)")
    expect_tensor("positions", positions, dtype=(torch.int64, torch.int32), shape=(T,), contiguous=True)
    expect_tensor("cos_sin", cos_sin, dtype=torch.float32, ndim=2, contiguous=True)
    r = cos_sin.shape[1]
    expect(r > 0 and r % 2 == 0 and r <= D, "cos_sin", f"shape {tuple(cos_sin.shape)}",
           f"shape (max_pos, rotary_dim) with rotary_dim even and <= head_dim {D}")
    expect(cos_sin.shape[0] > 0, "cos_sin", f"shape {tuple(cos_sin.shape)}", "max_pos > 0")
    expect_same_device(q=q, k=k, positions=positions, cos_sin=cos_sin)
    if T and (check_values or positions.device.type == "cpu"):
        lo, hi = int(positions.min()), int(positions.max())
        expect(lo >= 0 and hi < cos_sin.shape[0], "positions", f"values in [{lo}, {hi}]",
               f"values in [0, {cos_sin.shape[0] - 1}] (rows of cos_sin)")
    return r
