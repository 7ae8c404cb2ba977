"""Input checks shared by every backend of the ``logits`` and ``sampling`` ops (raised before
anything launches, each naming the argument)."""
from __future__ import annotations

import torch

from opmap.core.contract import (InputError, expect_same_device, expect_tensor, expect_writable, value_check_passed,
                                 value_check_seen, values_wanted)

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# The smallest normal fp32 value. A GPU kernel flushes subnormal parameters to zero, so they get one
# meaning in every backend (reference.py: ``greedy_rows``, ``support_mask``): a temperature below it
# is greedy (the limit T -> 0; its reciprocal may overflow), a min_p below it is off, a top_p below
# it keeps the first token (as FLT_MIN does), and a repetition penalty below it is refused.
FLT_MIN = 2.0 ** -126
INTS = (torch.int32, torch.int64)


def check_logits(logits, arg="logits", written: bool = False):
    """``written``: the op writes the logits in place, so an expanded view is refused."""
    expect_tensor(arg, logits, dtype=FLOATS, ndim=2, last_dim_contiguous=True)
    if written:
        expect_writable(arg, logits)
    return logits.shape


# The values each per-row parameter may take (the contract of ``reference``'s docstring), as a test
# on the tensor and the words of the error. ``seeds`` and ``positions`` take any int64: their bits
# key the random stream.
VALUE_RANGES = {
    "temperature": (lambda t: torch.isfinite(t) & (t >= 0), "finite values >= 0 (0 = greedy)"),
    "top_k": (lambda t: t >= 0, "values >= 0 (0 = off; >= the vocabulary = off)"),
    "top_p": (lambda t: (t > 0) & (t <= 1), "values in (0, 1] (1 = off)"),
    "min_p": (lambda t: (t >= 0) & (t <= 1), "values in [0, 1] (0 = off)"),
    "repetition": (lambda t: torch.isfinite(t) & (t >= FLT_MIN), "finite values >= 2**-126 (1 = off)"),
    "frequency": (lambda t: torch.isfinite(t), "finite values (0 = off)"),
    "presence": (lambda t: torch.isfinite(t), "finite values (0 = off)"),
}


def check_row_params(B, device, **params):
    """Per-row parameter tensors: shape [B] on the logits' device, values in ``VALUE_RANGES``
    (NaN refused). Reading the values of a CUDA tensor is a host synchronisation, so, as for
    attention's step metadata (``opmap.core.contract.values_wanted``), the value checks are
    skipped inside a CUDA-graph capture, for a trusted caller (the engine, whose requests were
    validated when they were made) and with ``OPMAP_CHECK_VALUES=0``, and done once per
    (tensor, version)."""
    for name, (t, dtypes) in params.items():
        # contiguous: the kernels read element b at b (a stride-0 or strided view would be read wrong)
        expect_tensor(name, t, dtype=dtypes, shape=(B,), contiguous=True)
        expect_same_device(logits=torch.empty(0, device=device), **{name: t})
    check_row_values(**{name: t for name, (t, _) in params.items() if name in VALUE_RANGES})


def check_row_values(**rows) -> None:
    """Every value of each named [B] tensor within its ``VALUE_RANGES`` entry; else an InputError
    naming the argument and the first row out of range."""
    tensors = list(rows.values())
    if not tensors or tensors[0].numel() == 0 or not values_wanted(*tensors):
        return
    memo = ("sampling-rows", *rows, *tensors)  # the memo remembers nothing of inference tensors
    if value_check_seen(*memo):
        return
    bad = torch.stack([~VALUE_RANGES[name][0](t) for name, t in rows.items()]).cpu()  # one read back
    if bad.any():
        i, b = (int(v) for v in bad.nonzero()[0])
        name = list(rows)[i]
        value = rows[name][b].item()
        raise InputError(name, f"{name}[{b}]={value!r}", VALUE_RANGES[name][1])
    if tensors[0].is_cuda:
        value_check_passed(*memo)


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
