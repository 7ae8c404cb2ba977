"""Input checks shared by every backend of the ``logits`` and ``sampling`` ops (raised before
anything launches, each naming the argument)."""
from __future__ import annotations

import torch

from opmap.core.contract import expect_same_device, expect_tensor, expect_writable

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)


def check_logits(logits, arg="logits", written: bool = False):
    """``written``: the op writes the logits in place, so an expanded view is refused."""
    expect_tensor(arg, logits, dtype=FLOATS, ndim=2, last_dim_contiguous=True)
    if written:
        expect_writable(arg, logits)
    return logits.shape


def check_row_params(B, device, **params):
    """Per-row parameter tensors: shape [B] on the logits' device. Values are not read (that
    would synchronise with the host); SamplingParams validated them when they were built."""
    for name, (t, dtypes) in params.items():
        # contiguous: the kernels read element b at b (a stride-0 or strided view would be read wrong)
        expect_tensor(name, t, dtype=dtypes, shape=(B,), contiguous=True)
        expect_same_device(logits=torch.empty(0, device=device), **{name: t})


def check_sample_args(logits, temperature, top_k, top_p, min_p, seeds, positions):
    B, V = check_logits(logits)
    check_row_params(B, logits.device, temperature=(temperature, torch.float32), top_k=(top_k, INTS),
                     top_p=(top_p, torch.float32), min_p=(min_p, torch.float32),
                     seeds=(seeds, torch.int64), positions=(positions, torch.int64))
    return B, V


def check_penalty_args(logits, prompt_mask, output_counts, repetition, frequency, presence):
    B, V = check_logits(logits, written=True)
    expect_tensor("prompt_mask", prompt_mask, dtype=torch.bool, shape=(B, V), last_dim_contiguous=True)
    expect_tensor("output_counts", output_counts, dtype=INTS, shape=(B, V), last_dim_contiguous=True)
    expect_same_device(logits=logits, prompt_mask=prompt_mask, output_counts=output_counts)
    check_row_params(B, logits.device, repetition=(repetition, torch.float32),
                     frequency=(frequency, torch.float32), presence=(presence, torch.float32))
    return B, V
