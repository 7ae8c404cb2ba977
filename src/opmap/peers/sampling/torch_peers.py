"""Peers in plain PyTorch, with the same entry as ours: ``sample(logits, temperature, top_k, top_p,
min_p, seeds, positions) -> (ids, invalid)``.

- ``sample_sort`` (provider "torch-sort"): what engines fall back to: sort the row, cumsum for
  top-p, mask, renormalise, ``torch.multinomial``.
- ``sample_race`` (provider "torch-race"): the exponential race: argmax(p / q), q ~ Exp(1)
  (``Tensor.exponential_``), over the support; the support needs the sort only when a row of the
  batch has a filter (a host check, like the engines that use it).

Both draw from the process-wide generator: ``seeds`` and ``positions`` are ignored, so a row's
token depends on the batch (declared: ``seeded`` and ``batch_invariant`` unsupported). Support
and greedy / invalid handling follow the reference exactly.
"""
from __future__ import annotations

import math

import torch

from opmap.ops.sampling.validate import check_sample_args

__all__ = ["sample_sort", "sample_race"]


def _prepare(logits, temperature, top_k):
    x = logits.float()
    invalid = torch.isnan(x).any(-1) | torch.isposinf(x).any(-1) | ~torch.isfinite(x).any(-1)
    x = torch.where(invalid[:, None], 0.0, x)
    greedy = (temperature == 0) | (top_k == 1)
    z = x / torch.where(temperature > 0, temperature, 1.0)[:, None]
    return x, z, invalid, greedy


def _sorted_support(zs, top_k, top_p, min_p):
    """Keep mask over the sorted (descending, stable) row: min-p, top-k, then top-p renormalised."""
    V = zs.shape[-1]
    rank = torch.arange(V, device=zs.device)[None, :]
    k = top_k.to(torch.int64)[:, None]
    k = torch.where((k <= 0) | (k > V), V, k)
    cut = torch.where(min_p[:, None] > 0, zs[:, :1] + torch.log(min_p.clamp_min(1e-30))[:, None], -math.inf)
    keep = (rank < k) & (zs >= cut) & (zs > -math.inf)
    w = torch.where(keep, torch.exp(zs - zs[:, :1]), 0.0)
    w = w / w.sum(-1, keepdim=True)
    before = torch.cumsum(w, -1) - w
    keep = keep & ((top_p[:, None] >= 1) | (before < top_p[:, None]))
    return keep


def _finish(x, sampled, invalid, greedy):
    ids = torch.where(greedy, torch.argmax(x, -1), sampled)
    return torch.where(invalid, 0, ids), invalid


def sample_sort(logits, temperature, top_k, top_p, min_p, seeds, positions):
    check_sample_args(logits, temperature, top_k, top_p, min_p, seeds, positions)
    x, z, invalid, greedy = _prepare(logits, temperature, top_k)
    zs, order = torch.sort(z, dim=-1, descending=True, stable=True)
    keep = _sorted_support(zs, top_k, top_p, min_p)
    probs = torch.where(keep, torch.exp(zs - zs[:, :1]), 0.0)
    j = torch.multinomial(probs, 1)
    return _finish(x, order.gather(1, j)[:, 0], invalid, greedy)


def sample_race(logits, temperature, top_k, top_p, min_p, seeds, positions):
    check_sample_args(logits, temperature, top_k, top_p, min_p, seeds, positions)
    x, z, invalid, greedy = _prepare(logits, temperature, top_k)
    V = z.shape[-1]
    filtered = bool((((top_k > 1) & (top_k < V)) | (top_p < 1) | (min_p > 0)).any())  # host sync
    if filtered:
        zs, order = torch.sort(z, dim=-1, descending=True, stable=True)
        keep = torch.zeros_like(z, dtype=torch.bool).scatter_(1, order, _sorted_support(zs, top_k, top_p, min_p))
        z = z.masked_fill(~keep, -math.inf)
    probs = torch.softmax(z, -1)
    q = torch.empty_like(probs).exponential_()
    return _finish(x, torch.argmax(probs / q, -1), invalid, greedy)
