"""Fused MoE routing in one Triton launch (the torch version in routing.py takes ~7 launches,
which at decode cost more than reading a Qwen3-30B-A3B layer's routed weights).

One program per token row: scores (softmax or sigmoid), optional bias for the choice, optional
group limiting (DeepSeek-V2: a group's best score; DeepSeek-V3: sum of its two best biased
scores), top-k by repeated arg-max (descending, lowest index first among equal scores), weights
from the unbiased scores, optional renormalisation and routed scaling. Same contract and
results as ``routing.route``.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl

from opmap.kernels.moe.common import next_pow2
from opmap.ops.moe.routing import check_route_args

NEG = tl.constexpr(float("-inf"))


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, stride_l, routed_scaling,
                  TOP_K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr, SIGMOID: tl.constexpr,
                  HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, G_POW2: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  RENORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, E_POW2)
    ok = idx < E
    x = tl.load(logits_ptr + t * stride_l + idx, mask=ok, other=NEG).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
    scores = tl.where(ok, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, NEG)
    if N_GROUP > 1:
        gs = E // N_GROUP
        group = idx // gs
        gidx = tl.arange(0, G_POW2)
        gscore = tl.full([G_POW2], NEG, tl.float32)
        for g in tl.static_range(N_GROUP):
            mine = tl.where(group == g, choice, NEG)
            best = tl.max(mine, axis=0)
            if SIGMOID:  # sum of the two best (one, for groups of one expert)
                first = tl.argmax(mine, axis=0)
                second = tl.max(tl.where(idx == first, NEG, mine), axis=0)
                best = best + tl.where(gs > 1, second, 0.0)
            gscore = tl.where(gidx == g, best, gscore)
        keep = tl.zeros([E_POW2], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(gscore, axis=0)
            keep = keep | (group == g)
            gscore = tl.where(gidx == g, NEG, gscore)
        choice = tl.where(keep & ok, choice, NEG)
    kidx = tl.arange(0, K_POW2)
    ws = tl.zeros([K_POW2], dtype=tl.float32)
    ids = tl.zeros([K_POW2], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        # NaN logits compare false everywhere: argmax may land on a padding lane; clamped, an id
        # never leaves [0, E) (the weights stay NaN, so the output says so)
        i = tl.minimum(tl.argmax(choice, axis=0), E - 1)
        ws = tl.where(kidx == j, tl.sum(tl.where(idx == i, scores, 0.0), axis=0), ws)
        ids = tl.where(kidx == j, i.to(tl.int32), ids)
        choice = tl.where(idx == i, NEG, choice)
    if RENORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    ws = ws * routed_scaling
    tl.store(w_ptr + t * TOP_K + kidx, ws, mask=kidx < TOP_K)
    tl.store(ids_ptr + t * TOP_K + kidx, ids, mask=kidx < TOP_K)


def route(router_logits: torch.Tensor, top_k: int, *, router: str = "softmax", renormalize: bool = True,
          n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
          score_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (topk_weights [T, k] fp32, topk_ids [T, k] int32), as routing.route, in one launch."""
    check_route_args(router_logits, top_k, router, n_group, topk_group, score_bias)
    return launch(router_logits, top_k, router, renormalize, n_group, topk_group, routed_scaling, score_bias)


def launch(router_logits, top_k, router, renormalize, n_group, topk_group, routed_scaling, score_bias):
    """``route`` without the argument checks, for callers that already ran them (triton_moe.moe
    runs check_moe_args, which includes check_route_args: checking twice cost host time at decode)."""
    T, E = router_logits.shape
    dev = router_logits.device
    w = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    if T == 0:
        return w, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    bias = score_bias.contiguous() if score_bias is not None else w
    e_pow2, k_pow2, g_pow2 = _pow2s(E, top_k, n_group)
    _route_kernel[(T,)](logits, bias, w, ids, E, logits.stride(0), float(routed_scaling), TOP_K=top_k,
                        K_POW2=k_pow2, E_POW2=e_pow2,
                        SIGMOID=router != "softmax", HAS_BIAS=score_bias is not None,
                        N_GROUP=n_group, G_POW2=g_pow2,
                        TOPK_GROUP=topk_group, RENORM=bool(renormalize),
                        num_warps=4 if e_pow2 <= 256 else 8)
    return w, ids


@lru_cache(maxsize=64)
def _pow2s(E: int, top_k: int, n_group: int) -> tuple[int, int, int]:
    return max(16, next_pow2(E)), max(2, next_pow2(top_k)), max(2, next_pow2(n_group))
