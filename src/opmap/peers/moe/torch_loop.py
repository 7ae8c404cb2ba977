"""Peer: a per-expert loop of cuBLAS GEMMs in the input dtype (what engines fall back to when
they have no grouped GEMM, e.g. HF transformers' eager experts).

Pairs (token, slot) are sorted by expert once; one host synchronisation reads the per-expert
counts so that the loop only visits experts that received tokens; each visited expert costs
two GEMMs plus the SiLU-and-mul. The weighted combine accumulates in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from opmap.ops.moe.routing import check_moe_args, route


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """-> (order [T*k] int64: pair indices sorted by expert, counts [E] int64). No host sync."""
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def combine(y_sorted: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor, T: int, top_k: int,
            dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * y[pair (t, j)], accumulated in fp32."""
    w = topk_weights.reshape(-1)[order].float()
    out = torch.zeros(T, y_sorted.shape[1], dtype=torch.float32, device=y_sorted.device)
    out.index_add_(0, order // top_k, y_sorted.float() * w[:, None])
    return out.to(dtype)


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, *,
        router: str = "softmax", renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
        routed_scaling: float = 1.0, score_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    T, H, E, inter = check_moe_args(x, router_logits, w13, w2, top_k, router, n_group, topk_group, score_bias)
    weights, ids = route(router_logits, top_k, router=router, renormalize=renormalize, n_group=n_group,
                         topk_group=topk_group, routed_scaling=routed_scaling, score_bias=score_bias)
    order, counts = sort_by_expert(ids, E)
    xs = x[order // top_k]
    ys = torch.empty(T * top_k, H, dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):  # the one host sync: which experts were hit
        if n == 0:
            continue
        h = F.linear(xs[start:start + n], w13[e])
        ys[start:start + n] = F.linear(F.silu(h[:, :inter]) * h[:, inter:], w2[e])
        start += n
    return combine(ys, order, weights, T, top_k, x.dtype)
