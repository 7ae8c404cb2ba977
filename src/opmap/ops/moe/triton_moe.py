"""Our MoE: fused routing (route_triton.py), device-side align by expert, grouped GEMM gate/up
with fused SiLU-and-mul, grouped GEMM down with the routing weight in its epilogue, combine.

Five launches, no host synchronisation (the grids are sized by static bounds, see align.py),
so the whole op can be captured in a CUDA graph. First calls for a new shape autotune the
GEMMs (grouped_gemm.py): warm up before capturing a graph.
"""
from __future__ import annotations

from typing import Optional

import torch

from .align import align
from .grouped_gemm import combine, grouped_gemm, pick_bm
from .route_triton import route
from .routing import check_moe_args


def experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor, bm: Optional[int] = None) -> torch.Tensor:
    """The expert part for a given routing: -> [T, H] in x.dtype. ``bm`` overrides the row tile
    (tests use it to cover the prefill tiles in the interpreter)."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    # The kernels step K by +BK along the last dimension: they need it contiguous.
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    n_pairs = T * top_k
    bm = bm or pick_bm(n_pairs, E)
    sorted_ids, block_expert, total = align(topk_ids, E, bm)
    inter = torch.empty(n_pairs, two_i // 2, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, inter, sorted_ids, block_expert, total, n_pairs, top_k, bm, gated=True)
    y = torch.empty(n_pairs, H, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    grouped_gemm(inter, w2, y, sorted_ids, block_expert, total, n_pairs, 1, bm, gated=False, weights=weights)
    return combine(y, T, top_k, out)


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, *,
        router: str = "softmax", renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
        routed_scaling: float = 1.0, score_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    check_moe_args(x, router_logits, w13, w2, top_k, router, n_group, topk_group, score_bias)
    weights, ids = route(router_logits, top_k, router=router, renormalize=renormalize, n_group=n_group,
                         topk_group=topk_group, routed_scaling=routed_scaling, score_bias=score_bias)
    return experts(x, weights, ids, w13, w2)
