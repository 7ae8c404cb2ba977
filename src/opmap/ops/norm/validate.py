"""Input checks shared by every rmsnorm backend, so that all of them reject the same inputs
with the same InputError before anything runs."""
from __future__ import annotations

import torch

from opmap.core.contract import expect, expect_same_device, expect_tensor, expect_writable

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _weight_dtypes(x) -> tuple:
    """x's dtype or fp32 (each named once in an error)."""
    return (x.dtype,) if x.dtype == torch.float32 else (x.dtype, torch.float32)


def check_norm(x, weight, eps, residual=None, out=None) -> int:
    """Validate the arguments of rmsnorm / add_rmsnorm; returns the hidden size."""
    expect_tensor("x", x, dtype=FLOAT_DTYPES, last_dim_contiguous=True)
    expect(x.dim() >= 1, "x", f"{x.dim()} dims", ">= 1 dims [..., H]")
    hidden = x.shape[-1]
    expect(hidden > 0, "x", f"hidden size {hidden}", "hidden size > 0")
    # The weight may be kept in fp32 even when activations are half precision.
    expect_tensor("weight", weight, dtype=_weight_dtypes(x), ndim=1, contiguous=True)
    expect(weight.shape[0] == hidden, "weight", f"shape {tuple(weight.shape)}",
           f"shape ({hidden},) (the hidden size of x)")
    expect(isinstance(eps, (float, int)) and eps >= 0, "eps", repr(eps), "a float >= 0")
    if residual is not None:
        expect_tensor("residual", residual, dtype=x.dtype, shape=tuple(x.shape), last_dim_contiguous=True)
        expect_writable("residual", residual)
    if out is not None:
        expect_tensor("out", out, dtype=x.dtype, shape=tuple(x.shape), last_dim_contiguous=True)
        expect_writable("out", out)
    expect_same_device(x=x, weight=weight, residual=residual, out=out)
    return hidden


def check_qk_norm(qk, w_q, w_k, num_q_heads, eps) -> tuple:
    """Validate qk_rmsnorm's arguments; returns (tokens, heads, head_dim)."""
    expect_tensor("qk", qk, dtype=FLOAT_DTYPES, ndim=3, last_dim_contiguous=True)
    expect_writable("qk", qk)
    T, NH, D = qk.shape
    expect(D > 0, "qk", f"head_dim {D}", "head_dim > 0")
    expect(isinstance(num_q_heads, int) and 0 <= num_q_heads <= NH, "num_q_heads", repr(num_q_heads),
           f"an int in [0, {NH}] (the heads of qk)")
    for name, w in (("w_q", w_q), ("w_k", w_k)):
        expect_tensor(name, w, dtype=_weight_dtypes(qk), ndim=1, contiguous=True)
        expect(w.shape[0] == D, name, f"shape {tuple(w.shape)}", f"shape ({D},) (the head_dim of qk)")
    expect(isinstance(eps, (float, int)) and eps >= 0, "eps", repr(eps), "a float >= 0")
    expect_same_device(qk=qk, w_q=w_q, w_k=w_k)
    return T, NH, D
