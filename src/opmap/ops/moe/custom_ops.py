"""``torch.library`` registrations of the public MoE ops (namespace ``opmap``), with fake
implementations so that they compose with torch.compile and CUDA graphs:

- ``opmap::moe_route(router_logits, top_k, router, renormalize, n_group, topk_group,
  routed_scaling, score_bias) -> (topk_weights fp32, topk_ids int32)``
- ``opmap::moe(x, router_logits, w13, w2, top_k, router, renormalize, n_group, topk_group,
  routed_scaling, score_bias) -> out`` (our Triton implementation)
"""
from __future__ import annotations

from typing import Optional

import torch


@torch.library.custom_op("opmap::moe_route", mutates_args=())
def moe_route(router_logits: torch.Tensor, top_k: int, router: str = "softmax", renormalize: bool = True,
              n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
              score_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    from .routing import route

    return route(router_logits, top_k, router=router, renormalize=renormalize, n_group=n_group,
                 topk_group=topk_group, routed_scaling=routed_scaling, score_bias=score_bias)


@moe_route.register_fake
def _(router_logits, top_k, router="softmax", renormalize=True, n_group=1, topk_group=1, routed_scaling=1.0,
      score_bias=None):
    T = router_logits.shape[0]
    return (router_logits.new_empty(T, top_k, dtype=torch.float32),
            router_logits.new_empty(T, top_k, dtype=torch.int32))


@torch.library.custom_op("opmap::moe", mutates_args=())
def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
        router: str = "softmax", renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
        routed_scaling: float = 1.0, score_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    from .triton_moe import moe as triton_moe

    return triton_moe(x, router_logits, w13, w2, top_k, router=router, renormalize=renormalize,
                      n_group=n_group, topk_group=topk_group, routed_scaling=routed_scaling,
                      score_bias=score_bias)


@moe.register_fake
def _(x, router_logits, w13, w2, top_k, router="softmax", renormalize=True, n_group=1, topk_group=1,
      routed_scaling=1.0, score_bias=None):
    return torch.empty_like(x)
