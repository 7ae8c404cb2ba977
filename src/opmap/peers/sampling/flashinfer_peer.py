"""FlashInfer's sampling kernels as a peer (provider "flashinfer"), same entry as ours.

Imported only when used; ``flashinfer`` is not installed on the CPU machine nor by default on the
GPU machine (scripts/flashinfer/pack.sh packs it to carry). FlashInfer samples from probabilities with
one generator for the batch, so ``seeds``/``positions`` are ignored (declared unseeded). Which
kernel runs depends on the filters present in the batch, read on the host (a sync; declared not
CUDA-graph capturable). top-k together with top-p uses ``filter_apply_order="joint"`` (the order
whose JIT build finishes), whose support is not exactly ours (ours renormalises
top-p over the top-k set): the registry declares that combination unsupported, and the benchmark
times it under its own provider name, "flashinfer-joint".
"""
from __future__ import annotations

import torch

from opmap.peers.sampling.torch_peers import _finish, _prepare
from opmap.ops.sampling.validate import check_sample_args

__all__ = ["sample", "sample_joint"]


def filtered_probs(logits, temperature, top_k):
    x, z, invalid, greedy = _prepare(logits, temperature, top_k)
    return x, torch.softmax(z, -1).contiguous(), invalid, greedy


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions):
    # optional: flashinfer
    import flashinfer.sampling as fs

    check_sample_args(logits, temperature, top_k, top_p, min_p, seeds, positions)
    x, probs, invalid, greedy = filtered_probs(logits, temperature, top_k)
    V = probs.shape[-1]
    k = torch.where((top_k <= 0) | (top_k > V), V, top_k).to(torch.int32)
    use_k, use_p, use_mp = bool((k < V).any()), bool((top_p < 1).any()), bool((min_p > 0).any())
    if use_mp and (use_k or use_p):
        raise ValueError("flashinfer peer: min_p cannot be combined with top_k/top_p in one batch")
    if use_k and use_p:
        ids = fs.top_k_top_p_sampling_from_probs(probs, k, top_p, filter_apply_order="joint")
    elif use_k:
        ids = fs.top_k_sampling_from_probs(probs, k)
    elif use_p:
        ids = fs.top_p_sampling_from_probs(probs, top_p)
    elif use_mp:
        ids = fs.min_p_sampling_from_probs(probs, min_p)
    else:
        ids = fs.sampling_from_probs(probs)
    return _finish(x, ids.to(torch.int64), invalid, greedy)


def sample_joint(logits, temperature, top_k, top_p, min_p, seeds, positions):
    """top-k + top-p with FlashInfer's joint order (benchmark line "flashinfer-joint")."""
    # optional: flashinfer
    import flashinfer.sampling as fs

    x, probs, invalid, greedy = filtered_probs(logits, temperature, top_k)
    ids = fs.top_k_top_p_sampling_from_probs(probs, top_k.to(torch.int32), top_p, filter_apply_order="joint")
    return _finish(x, ids.to(torch.int64), invalid, greedy)
