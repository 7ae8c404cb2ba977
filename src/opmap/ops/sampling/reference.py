"""Plain-PyTorch reference (the oracle) of the logits processors and of sampling.

Contract (shared by every backend of the ``logits`` and ``sampling`` ops; parameter meaning in
``opmap.ops.sampling.params``). Per-row parameters are tensors of shape [B] on the logits' device:
``temperature`` fp32 (0 = greedy), ``top_k`` int32/int64 (0 or >= V = off), ``top_p`` fp32
(>= 1 = off), ``min_p`` fp32 (0 = off), ``seeds`` int64, ``positions`` int64.

logits op:
- ``apply_penalties(logits[B, V], prompt_mask[B, V] bool, output_counts[B, V] int32,
  repetition[B], frequency[B], presence[B]) -> None`` in place.
- ``apply_temperature(logits, temperature) -> None`` in place; rows with temperature 0 untouched.
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

from ...contract import expect, expect_tensor
from .validate import INTS, check_logits, check_penalty_args, check_row_params, check_sample_args

__all__ = ["apply_penalties", "apply_temperature", "apply_filters", "logprobs", "filtered_probs",
           "support_mask", "invalid_rows", "sample", "mix_seed"]


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
    B, _ = check_logits(logits)
    check_row_params(B, logits.device, temperature=(temperature, torch.float32))
    t = temperature.float()[:, None]
    l = logits.float()
    logits.copy_(torch.where(t > 0, l / torch.where(t > 0, t, 1.0), l).to(logits.dtype))


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
    cut = torch.where(mp > 0, zmax + torch.log(mp.clamp_min(1e-300)), torch.full_like(mp, -math.inf))
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


def filtered_probs(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """The exact distribution (fp64 [B, V]) a sampler must draw each row from. Greedy rows
    (temperature 0 or top_k 1) are one-hot at the greedy id; invalid rows are all zero."""
    l = logits.double()
    B, V = l.shape
    t = temperature.double()[:, None]
    greedy = (t[:, 0] == 0) | (top_k.to(torch.int64) == 1)
    z = l / torch.where(t > 0, t, 1.0)
    keep = support_mask(z, top_k, top_p, min_p)
    zmax = torch.where(keep, z, -math.inf).amax(-1, keepdim=True)
    w = torch.where(keep, torch.exp(z - zmax), 0.0)
    p = w / w.sum(-1, keepdim=True)
    onehot = torch.zeros_like(p).scatter_(1, greedy_ids(l)[:, None], 1.0)
    p = torch.where(greedy[:, None], onehot, p)
    return torch.where(invalid_rows(logits)[:, None], 0.0, p)


_M64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): the per-(request, step) seed of the reference's generator."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    x ^= x >> 31
    return x & ((1 << 63) - 1)


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions):
    """Row by row: a generator seeded from (seed, position) draws from ``filtered_probs``. Slow
    (host loop): it is the oracle, not a fast path."""
    check_sample_args(logits, temperature, top_k, top_p, min_p, seeds, positions)
    probs = filtered_probs(logits, temperature, top_k, top_p, min_p)
    invalid = invalid_rows(logits)
    greedy = (temperature == 0) | (top_k.to(torch.int64) == 1)
    ids = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    gid = greedy_ids(logits)
    for b in range(logits.shape[0]):
        if bool(invalid[b]):
            continue
        if bool(greedy[b]):
            ids[b] = gid[b]
            continue
        g = torch.Generator(device="cpu").manual_seed(mix_seed(int(seeds[b]), int(positions[b])))
        ids[b] = torch.multinomial(probs[b].cpu(), 1, generator=g)[0].to(ids.device)
    return ids, invalid


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
