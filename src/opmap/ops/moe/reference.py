"""Plain-PyTorch fp32 reference of the MoE block (routed experts only), the oracle.

A per-expert loop: for each expert, gather the tokens routed to it, gate/up projection,
SiLU(gate) * up, down projection, scale by the routing weight, scatter-add into an fp32
output. Weights are ``w13[E, 2I, H]`` (rows [:I] = gate, [I:] = up, as HF transformers 5.x
``gate_up_proj``) and ``w2[E, H, I]`` (HF ``down_proj``), or quantised (int4, block fp8: see
``routing.check_moe_args``), dequantised here to fp32. Shared experts are a dense MLP that the
model adds; they are not part of this entry.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from opmap.ops.gemm.quant import dequantize_fp8_block, dequantize_int4, int4_group, quantize_fp8_block, quantize_int4
from opmap.ops.moe.routing import check_moe_args, expert_format, route


def dequantize_experts(w: torch.Tensor, scale=None, zero=None) -> torch.Tensor:
    """fp32 [E, N, K] of expert weights in any format ``check_moe_args`` takes."""
    fmt = expert_format(w)
    if fmt is None:
        return w.float()
    if fmt == "int4":
        return torch.stack([dequantize_int4(w[e], scale[e], None if zero is None else zero[e]) for e in range(w.shape[0])])
    return torch.stack([dequantize_fp8_block(w[e], scale[e]) for e in range(w.shape[0])])


def quantize_experts(w: torch.Tensor, fmt: str, span: Optional[int], zero_point: bool = False) -> tuple:
    """(weights, scale, zero codes or None) of experts w [E, N, K] in ``fmt``, per expert: "int4"
    with a scale per ``span`` input channels (int4_group's rule: one a row where it does not divide
    K), symmetric or with ``zero_point``s; "fp8-block" per ``span`` x ``span`` block."""
    k = w.shape[2]
    qs = [quantize_int4(w[e], int4_group(k, span), zero_point) if fmt == "int4"
          else (*quantize_fp8_block(w[e], span), None) for e in range(w.shape[0])]
    zero = torch.stack([q[2] for q in qs]) if qs[0][2] is not None else None
    return torch.stack([q[0] for q in qs]), torch.stack([q[1] for q in qs]), zero


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, *,
        router: str = "softmax", renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
        routed_scaling: float = 1.0, score_bias: Optional[torch.Tensor] = None, w13_scale=None, w2_scale=None,
        w13_zero=None, w2_zero=None) -> torch.Tensor:
    """-> [T, H] in x.dtype, computed in fp32."""
    check_moe_args(x, router_logits, w13, w2, top_k, router, n_group, topk_group, score_bias,
                   w13_scale, w2_scale, w13_zero, w2_zero)
    weights, ids = route(router_logits, top_k, router=router, renormalize=renormalize, n_group=n_group,
                         topk_group=topk_group, routed_scaling=routed_scaling, score_bias=score_bias)
    return moe_from_routing(x, weights, ids, dequantize_experts(w13, w13_scale, w13_zero),
                            dequantize_experts(w2, w2_scale, w2_zero)).to(x.dtype)


def moe_from_routing(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor) -> torch.Tensor:
    """The expert computation for a given routing, in fp32; returns fp32 [T, H]."""
    T, H = x.shape
    inter = w2.shape[2]
    xf = x.float()
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:  # an expert that receives no token does no work
            continue
        h = xf[tok] @ w13[e].float().t()
        a = F.silu(h[:, :inter]) * h[:, inter:]
        y = a @ w2[e].float().t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out
