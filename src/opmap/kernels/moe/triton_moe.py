"""Our MoE (backend ``triton``): routing and the device-side align by expert, grouped GEMM gate/up
with fused SiLU-and-mul, grouped GEMM down with the routing weight in its epilogue, combine.

The routing and the align are one launch where route_align.py serves the call (decode sizes: at
most 64 tokens, no group-limited routing, a routing tile of at most 2048 scores) and two launches
otherwise (route_triton.py, then align.py): there is no switch between them, since the two
launches lost at decode (docs/moe.md, Decisions) and the fused kernel serves nothing else.
Four or five launches, no host synchronisation (the grids are sized by static bounds, see
align.py), so the whole op can be captured in a CUDA graph. First calls for a new shape autotune
the GEMMs (grouped_gemm.py): warm up before capturing a graph.
"""
from __future__ import annotations

from typing import Optional

import torch

from opmap.kernels.moe.align import align
from opmap.kernels.moe.grouped_gemm import combine, grouped_gemm, pick_bm, token_counts
from opmap.kernels.moe.route_align import fusable, route_align
from opmap.kernels.moe.route_triton import launch as route_launch
from opmap.ops.moe.routing import check_moe_args


def experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor, bm: Optional[int] = None, quant: Optional[dict] = None) -> torch.Tensor:
    """The expert part for a given routing: -> [T, H] in x.dtype. ``bm`` overrides the row tile
    (tests use it to cover the prefill tiles in the interpreter); ``quant``: the scales (and zeros)
    of quantised experts, by ``moe``'s argument names."""
    T = x.shape[0]
    if T == 0:
        return torch.empty_like(x)
    top_k = topk_ids.shape[1]
    bm = bm or pick_bm(T * top_k, w13.shape[0], (quant or {}).get("w13_scale") is not None)
    return _aligned(x, topk_weights, w13, w2, top_k, bm, *align(topk_ids, w13.shape[0], bm), quant=quant)


def _aligned(x, topk_weights, w13, w2, top_k, bm, sorted_ids, block_expert, total, quant=None):
    """The expert part after the align: grouped GEMM gate/up (+SiLU-and-mul), grouped GEMM down
    with the routing weight, combine."""
    T, H = x.shape
    q = quant or {}
    # The kernels step K by +BK along the last dimension: they need it contiguous.
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    n_pairs = T * top_k
    inter = torch.empty(n_pairs, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, inter, sorted_ids, block_expert, total, n_pairs, top_k, bm, gated=True,
                 scale=q.get("w13_scale"), zero=q.get("w13_zero"))
    y = torch.empty(n_pairs, H, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.to(torch.float32).contiguous()
    grouped_gemm(inter, w2, y, sorted_ids, block_expert, total, n_pairs, 1, bm, gated=False, weights=weights,
                 scale=q.get("w2_scale"), zero=q.get("w2_zero"))
    return combine(y, T, top_k, torch.empty(T, H, dtype=x.dtype, device=x.device))


# Argument signatures that passed check_moe_args. Every check there depends only on these fields
# (dtypes, shapes, strides, devices, and the routing ints / names with their types), so a call
# with a known signature skips ~15 expect() calls (host time at decode, once per layer per step).
_CHECKED: set = set()


def _signature(x, router_logits, w13, w2, top_k, router, n_group, topk_group, score_bias, quant):
    ts = (x, router_logits, w13, w2) + (() if score_bias is None else (score_bias,))
    ts += tuple(t for t in quant.values() if t is not None)
    if not all(isinstance(t, torch.Tensor) for t in ts):
        return None
    key = tuple((t.dtype, t.shape, t.stride(), t.device) for t in ts) + (
        type(top_k), top_k, router, type(n_group), n_group, type(topk_group), topk_group, score_bias is None,
        tuple(k for k, t in quant.items() if t is not None))
    try:
        hash(key)
    except TypeError:  # e.g. an unhashable router argument: the full check reports it
        return None
    return key


def check_once(x, router_logits, w13, w2, top_k, router, n_group, topk_group, score_bias, quant: dict) -> None:
    """check_moe_args, skipped for an argument signature that passed it before."""
    sig = _signature(x, router_logits, w13, w2, top_k, router, n_group, topk_group, score_bias, quant)
    if sig is None or sig not in _CHECKED:
        check_moe_args(x, router_logits, w13, w2, top_k, router, n_group, topk_group, score_bias, **quant)
        if sig is not None:
            if len(_CHECKED) > 4096:  # bounded: shapes vary with the token count
                _CHECKED.clear()
            _CHECKED.add(sig)


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, *,
        router: str = "softmax", renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
        routed_scaling: float = 1.0, score_bias: Optional[torch.Tensor] = None, w13_scale=None, w2_scale=None,
        w13_zero=None, w2_zero=None) -> torch.Tensor:
    quant = dict(w13_scale=w13_scale, w2_scale=w2_scale, w13_zero=w13_zero, w2_zero=w2_zero)
    check_once(x, router_logits, w13, w2, top_k, router, n_group, topk_group, score_bias, quant)
    # check_moe_args already checked the routing arguments: launch without checking them again.
    T = x.shape[0]
    if fusable(T, n_group, w13.shape[0]):
        # Decode: routing and align in one launch (route_align.py).
        bm = pick_bm(T * top_k, w13.shape[0], w13_scale is not None)
        weights, _, *aligned = route_align(router_logits, top_k, router, renormalize, routed_scaling, score_bias,
                                           w13.shape[0], bm)
        return _aligned(x, weights, w13, w2, top_k, bm, *aligned, quant=quant)
    weights, ids = route_launch(router_logits, top_k, router, renormalize, n_group, topk_group,
                                routed_scaling, score_bias)
    return experts(x, weights, ids, w13, w2, quant=quant)


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_tokens: int, dtype=None, **routing) -> int:
    """Run the op once at every token count whose GEMM tuning key a step of up to ``max_tokens``
    tokens can hit (grouped_gemm.token_counts), on random activations of ``dtype`` (default: the
    weights'; the scales of quantised experts among ``routing``): the engine calls it at start-up,
    so that no step tunes while requests wait (a DeepSeek-V2-Lite run at batch 32 had its mixed
    steps wait on tuning). Returns how many counts ran."""
    counts = token_counts(max_tokens, top_k, w13.shape[0], routing.get("w13_scale") is not None)
    g = torch.Generator(device=w13.device).manual_seed(0)
    dtype = dtype or w13.dtype
    hidden = w2.shape[1]
    for t in counts:
        x = torch.randn(t, hidden, generator=g, device=w13.device, dtype=dtype)
        logits = torch.randn(t, w13.shape[0], generator=g, device=w13.device, dtype=dtype)
        moe(x, logits, w13, w2, top_k, **routing)
    return len(counts)
