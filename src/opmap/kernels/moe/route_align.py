"""MoE routing and the align by expert in one launch, for decode-sized token counts.

At decode the two launches of route_triton.py (one program per token) and align.py (one program
per expert) each cost more than their work (Qwen3-30B-A3B at batch 1: docs/moe.md, Decisions, the
routing-and-align row). Here each of the E programs routes *all* T tokens itself
(a [T, E] tile of router logits of at most MAX_TILE scores), so no program waits for another:
program e counts every expert's pairs from its own copy of the routing, places its own pairs
in token order and pads its blocks, exactly as align.py does; program 0 also writes the routing
(weights, ids). The routing math is route_triton's, along axis 1 of the tile (softmax or
sigmoid, bias for the choice, top-k by repeated arg-max with the lowest index first among equal
scores, weights from the unbiased scores, renormalisation, routed scaling): the same ids, sorted pairs and blocks, and weights
equal up to fp32 summation order (the softmax sums run along a tile axis). Group-limited routing
(DeepSeek-V3) is not served here: ``fusable`` says when this path applies.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.kernels.moe.common import align_plan, next_pow2, outputs, pad_segment, route_rows, segment

MAX_TOKENS = 64
# The [T, E] routing tile each program holds, padded to powers of two, at most this many scores:
# compiled for sm90 on the CPU, 2048 (T 16 x E 128, T 32 x E 64) at 8 warps takes 175-182
# registers without stack; 4096 took 255 registers, and spilled at T 64 x E 64 (104 bytes).
MAX_TILE = 2048

def _tile(T: int, E: int) -> tuple:
    t, e = max(2, next_pow2(T)), max(16, next_pow2(E))
    return t, e, t * e


def fusable(T: int, n_group: int, num_experts: int) -> bool:
    return 0 < T <= MAX_TOKENS and n_group == 1 and _tile(T, num_experts)[2] <= MAX_TILE


@triton.jit
def _route_align_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, sorted_ptr, block_expert_ptr, total_ptr, T, E,
                        stride_l, routed_scaling, TOP_K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr,
                        T_POW2: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                        BM: tl.constexpr):
    e = tl.program_id(0)
    # ---- routing of every token (route_triton's math, one row per token) ----
    t = tl.arange(0, T_POW2)[:, None]
    row_ok = t < T
    ws, ids, kidx = route_rows(logits_ptr, bias_ptr, t, row_ok, E, stride_l, routed_scaling, TOP_K, K_POW2, E_POW2,
                               SIGMOID, HAS_BIAS, RENORM)
    pair_ok = row_ok & (kidx < TOP_K)
    pair = t * TOP_K + kidx  # pair index p = t * k + j, as align.py numbers them
    if e == 0:
        tl.store(w_ptr + pair, ws, mask=pair_ok)
        tl.store(ids_ptr + pair, ids, mask=pair_ok)
    # ---- align (align.py's two passes, over the pairs held in registers) ----
    n_pairs = T * TOP_K
    flat_ids = tl.reshape(ids, [T_POW2 * K_POW2])
    flat_ok = tl.reshape(pair_ok, [T_POW2 * K_POW2])
    flat_pair = tl.reshape(pair, [T_POW2 * K_POW2])
    counts = tl.histogram(tl.where(flat_ok, flat_ids, 0), E_POW2, mask=flat_ok)
    start, mine, my_padded = segment(counts, e, total_ptr, BM, E_POW2)
    # Pairs in increasing p: the flattened [t, j] tile is in that order (padding lanes hit nothing).
    hit = (flat_ok & (flat_ids == e)).to(tl.int32)
    pos = start + tl.cumsum(hit, axis=0) - 1
    tl.store(sorted_ptr + pos, flat_pair, mask=hit != 0)
    pad_segment(sorted_ptr, block_expert_ptr, e, start, mine, my_padded, n_pairs, BM, 16)


def route_align(router_logits: torch.Tensor, top_k: int, router: str, renormalize: bool, routed_scaling: float,
                score_bias, num_experts: int, bm: int):
    """-> (topk_weights [T, k] fp32, topk_ids [T, k] int32, sorted_ids, block_expert, total) as
    route_triton.launch followed by align.align, in one launch; arguments already checked
    (triton_moe.moe runs check_moe_args) and ``fusable(T, n_group)`` true."""
    T, E = router_logits.shape
    dev = router_logits.device
    n = T * top_k
    _, nblocks, _, e_pow2, _ = align_plan(n, num_experts, bm)
    # align's three outputs and the routing ids in one int32 allocation, the weights in fp32.
    (sorted_ids, block_expert, total), ids = outputs(n, nblocks, bm, dev, extra=n)
    ids = ids.view(T, top_k)
    w = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    bias = score_bias.contiguous() if score_bias is not None else w
    t_pow2, e_tile, tile = _tile(T, E)
    _route_align_kernel[(num_experts,)](
        logits, bias, w, ids, sorted_ids, block_expert, total, T, E, logits.stride(0), float(routed_scaling),
        TOP_K=top_k, K_POW2=max(2, next_pow2(top_k)), E_POW2=max(e_tile, e_pow2), T_POW2=t_pow2,
        SIGMOID=router != "softmax", HAS_BIAS=score_bias is not None, RENORM=bool(renormalize), BM=bm,
        num_warps=8 if tile >= 1024 else 4)
    return w, ids, sorted_ids, block_expert, total
