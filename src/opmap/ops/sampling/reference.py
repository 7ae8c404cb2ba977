"""Plain-PyTorch reference (the oracle) of the logits processors and of sampling.

Contract (shared by every backend of the ``logits`` and ``sampling`` ops; parameter meaning in
``opmap.engine.params``). Per-row parameters are tensors of shape [B] on the logits' device:
``temperature`` fp32, finite and >= 0 (0 = greedy, as is any temperature below the smallest normal
fp32, ``validate.FLT_MIN``), ``top_k`` int32/int64 >= 0 (0 or >= V = off), ``top_p`` fp32 in (0, 1]
(1 = off), ``min_p`` fp32 in [0, 1] (0 = off, as is any min_p below FLT_MIN), ``seeds`` int64,
``positions`` int64 (any values: their bits key the random stream); penalties: ``repetition`` finite
>= FLT_MIN, ``frequency`` and ``presence`` finite. A value outside its range (NaN included) is an
InputError naming the argument (``validate.check_row_params``: read on the host, so skipped inside a
CUDA-graph capture, for a trusted caller and with OPMAP_CHECK_VALUES=0).

logits op:
- ``apply_penalties(logits[B, V], prompt_mask[B, V] bool, output_counts[B, V] int32,
  repetition[B], frequency[B], presence[B]) -> None`` in place.
- ``apply_temperature(logits, temperature) -> None`` in place; greedy rows (temperature below
  ``FLT_MIN``, 0 included) untouched.
- ``apply_filters(logits, top_k, top_p, min_p) -> Tensor``: a copy with -inf outside the support
  (the support is computed on the logits as given, i.e. after temperature).
- ``logprobs(logits, token_ids[B], n) -> (chosen[B] fp32, top_values[B, n] fp32, top_ids[B, n] int64)``:
  log-softmax of the raw logits.

sampling op:
- ``sample(logits, temperature, top_k, top_p, min_p, seeds, positions) -> (ids[B] int64, invalid[B] bool)``.
  A row holding a NaN or +inf, or no finite logit at all, is *invalid*: its id is 0 and
  ``invalid`` is True there; the other rows are sampled normally. The engine ends an invalid
  row's request with an error state and goes on with the rest.

``filtered_probs`` gives the exact target distribution (fp64) that every sampler must draw from;
the distribution tests compare against it.
"""
from __future__ import annotations

import math

import torch

from opmap.core.contract import expect, expect_tensor
from opmap.ops.sampling.philox import gumbel
from opmap.ops.sampling.validate import (FLT_MIN, INTS, check_logits, check_penalty_args, check_row_params,
                                         check_sample_args)

__all__ = ["apply_penalties", "apply_temperature", "apply_filters", "logprobs", "filtered_probs",
           "support_mask", "invalid_rows", "sample", "race", "kernel_z", "greedy_ids", "greedy_rows"]


def apply_penalties(logits, prompt_mask, output_counts, repetition, frequency, presence) -> None:
    check_penalty_args(logits, prompt_mask, output_counts, repetition, frequency, presence)
    l = logits.float()
    counts = output_counts.to(torch.float32)
    seen = prompt_mask | (output_counts > 0)
    r = repetition.float()[:, None]
    l = torch.where(seen, torch.where(l > 0, l / r, l * r), l)
    l = l - frequency.float()[:, None] * counts - presence.float()[:, None] * (output_counts > 0).float()
    logits.copy_(l.to(logits.dtype))


def apply_temperature(logits, temperature) -> None:
    B, _ = check_logits(logits, written=True)
    check_row_params(B, logits.device, temperature=(temperature, torch.float32))
    t = temperature.float()[:, None]
    l = logits.float()
    greedy = t < FLT_MIN  # left as they are (greedy_rows)
    logits.copy_(torch.where(greedy, l, l / torch.where(greedy, 1.0, t)).to(logits.dtype))


def invalid_rows(logits) -> torch.Tensor:
    l = logits.float()
    bad = torch.isnan(l).any(-1) | torch.isposinf(l).any(-1)
    return bad | ~torch.isfinite(l).any(-1)


def support_mask(z, top_k, top_p, min_p) -> torch.Tensor:
    """Bool [B, V]: the support after min-p, top-k, then top-p (renormalised over the first two),
    as a prefix of the order (z descending, id ascending). ``z`` is already temperature-scaled."""
    z = z.double()
    B, V = z.shape
    zs, order = torch.sort(z, dim=-1, descending=True, stable=True)  # stable: ties keep id order
    rank = torch.arange(V, device=z.device)[None, :]
    k = top_k.to(torch.int64)[:, None]
    k = torch.where((k <= 0) | (k > V), V, k)
    zmax = zs[:, :1]
    mp = min_p.double()[:, None]
    cut = torch.where(mp >= FLT_MIN, zmax + torch.log(mp.clamp_min(FLT_MIN)), torch.full_like(mp, -math.inf))
    keep = (rank < k) & (zs >= cut) & torch.isfinite(zs)
    w = torch.where(keep, torch.exp(zs - zmax), 0.0)
    w = w / w.sum(-1, keepdim=True)
    before = torch.cumsum(w, -1) - w  # mass of the tokens ranked before this one
    tp = top_p.double()[:, None]
    keep = keep & ((tp >= 1) | (before < tp))
    out = torch.zeros_like(keep)
    out.scatter_(1, order, keep)
    return out


def apply_filters(logits, top_k, top_p, min_p) -> torch.Tensor:
    B, _ = check_logits(logits)
    check_row_params(B, logits.device, top_k=(top_k, INTS), top_p=(top_p, torch.float32),
                     min_p=(min_p, torch.float32))
    keep = support_mask(logits.float(), top_k, top_p, min_p)
    return logits.masked_fill(~keep, -math.inf)


def greedy_ids(logits) -> torch.Tensor:
    # torch.argmax returns the first maximal index: the lowest id wins a tie.
    return torch.argmax(torch.nan_to_num(logits.float(), nan=-math.inf), dim=-1)


def greedy_rows(temperature, top_k) -> torch.Tensor:
    """Bool [B]: the rows drawn greedily: temperature below FLT_MIN (0 included) or top_k 1."""
    return (temperature.float() < FLT_MIN) | (top_k.to(torch.int64) == 1)


def filtered_probs(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """The exact distribution (fp64 [B, V]) a sampler must draw each row from. Greedy rows
    (``greedy_rows``) are one-hot at the greedy id; invalid rows are all zero."""
    l = logits.double()
    B, V = l.shape
    t = temperature.double()[:, None]
    greedy = greedy_rows(temperature, top_k)
    z = l / torch.where(t > 0, t, 1.0)
    keep = support_mask(z, top_k, top_p, min_p)
    zmax = torch.where(keep, z, -math.inf).amax(-1, keepdim=True)
    w = torch.where(keep, torch.exp(z - zmax), 0.0)
    p = w / w.sum(-1, keepdim=True)
    onehot = torch.zeros_like(p).scatter_(1, greedy_ids(l)[:, None], 1.0)
    p = torch.where(greedy[:, None], onehot, p)
    return torch.where(invalid_rows(logits)[:, None], 0.0, p)


def kernel_z(logits, temperature) -> torch.Tensor:
    """z = (x - max) / T in fp32, rounded exactly as the Triton sampler rounds it."""
    x = logits.float()
    m = torch.nan_to_num(x, nan=-math.inf).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    t = temperature.float()[:, None]
    inv_t = torch.where(t > 0, 1.0 / torch.where(t > 0, t, 1.0), 1.0)
    return (x - m) * inv_t + 0.0


def race(z, keep, seeds, positions, ids=None) -> torch.Tensor:
    """Exponential race (Gumbel-max) over ``keep``: argmax of z + Gumbel(seed, position, id), the
    lowest id winning a tie. ``ids[B, n]`` names the columns of z when it is a subset of the
    vocabulary. Returns the winning token ids [B]."""
    if ids is None:
        ids = torch.arange(z.shape[-1], device=z.device).expand(z.shape[0], -1)
    key = torch.where(keep, z + gumbel(seeds, positions, ids), -math.inf)
    return ids.gather(1, torch.argmax(key, -1, keepdim=True))[:, 0]


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions):
    """The exact support (sort, fp64) and an exponential race with the counter-based stream of
    ``philox.py``: no host loop, no host sync; draws the same tokens as the Triton sampler."""
    check_sample_args(logits, temperature, top_k, top_p, min_p, seeds, positions)
    invalid = invalid_rows(logits)
    greedy = greedy_rows(temperature, top_k)
    l = logits.double()
    t = temperature.double()[:, None]
    keep = support_mask(l / torch.where(t > 0, t, 1.0), top_k, top_p, min_p)
    ids = race(kernel_z(logits, temperature), keep, seeds, positions)
    ids = torch.where(greedy, greedy_ids(logits), ids)
    return torch.where(invalid, 0, ids), invalid


def logprobs(logits, token_ids, n: int):
    B, V = check_logits(logits)
    expect_tensor("token_ids", token_ids, dtype=INTS, shape=(B,))
    expect(isinstance(n, int) and 0 <= n <= V, "n", repr(n), f"an int in [0, {V}]")
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.to(torch.int64)[:, None])[:, 0]
    if n > 0:
        top_values, top_ids = torch.topk(lp, n, dim=-1)
    else:
        top_values = lp.new_empty((lp.shape[0], 0))
        top_ids = torch.empty((lp.shape[0], 0), dtype=torch.int64, device=lp.device)
    return chosen, top_values, top_ids
