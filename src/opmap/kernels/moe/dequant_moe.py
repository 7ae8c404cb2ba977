"""MoE with quantised experts for many tokens (backend ``dequant-triton``): the int4 or block-fp8
experts dequantised by one pass each into 16-bit scratch buffers (kernels/gemm/dequant_cublas.py's
kernels over the experts' stacked rows, two slots: gate/up and down live at once), then our MoE
(triton_moe.py) on those weights.

Why: the grouped GEMM that reads quantised experts as stored (backend ``triton``) converts a weight
tile once per row tile that uses it. At decode an expert meets a few rows, so that is once, and the
weight bytes are what the step costs. At prefill an expert meets hundreds of rows, the conversion and
the per-tile scale repeat for each row tile, and the quantised kernel's smaller row tiles lower its
MMA rate; one pass over the weights (their stored bytes read, the 16-bit ones written once) costs a
fixed time that the rows share (docs/moe.md, Decisions: the many-token route for quantised experts).
The model keeps its experts quantised; the price is one layer's experts in 16 bits (gate/up and down)
of scratch per stream, reused by every layer (stream order keeps a layer's GEMMs before the next
dequantisation); a CUDA graph captured on another stream holds a copy of its own.
"""
from __future__ import annotations

from typing import Optional

import torch

from opmap.kernels.gemm.dequant_cublas import block_into, int4_into, scratch_view
from opmap.kernels.moe import triton_moe
from opmap.ops.gemm.quant import block_of
from opmap.ops.gemm.validate import INT4_PACKED


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], dtype: torch.dtype,
                       slot: int) -> torch.Tensor:
    """Quantised experts [E, N, K'] (int4 words or block fp8) as [E, N, K] ``dtype`` in scratch
    ``slot`` (overwritten by the next call of that slot on this stream)."""
    E, N = w.shape[:2]
    K = w.shape[2] * 8 if w.dtype == INT4_PACKED else w.shape[2]
    out = scratch_view((E, N, K), dtype, w.device, slot)
    if w.dtype == INT4_PACKED:
        # One scale (and zero) row per weight row: the experts' rows stack into one matrix.
        int4_into(w.reshape(E * N, -1), scale.reshape(E * N, -1), None if zero is None else zero.reshape(E * N, -1),
                  out.view(E * N, K))
    elif N % block_of(N, K, scale[0]) == 0:
        # Whole blocks per expert: the experts' block rows stack too.
        block_into(w.reshape(E * N, K), scale.reshape(-1, scale.shape[2]), out.view(E * N, K))
    else:
        for e in range(E):  # a last block row shared by no other expert's rows
            block_into(w[e], scale[e], out[e])
    return out


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, *,
        router: str = "softmax", renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
        routed_scaling: float = 1.0, score_bias: Optional[torch.Tensor] = None, w13_scale=None, w2_scale=None,
        w13_zero=None, w2_zero=None) -> torch.Tensor:
    """``moe``'s contract (docs/OPS_API.md); experts in x's dtype go straight to triton_moe."""
    quant = dict(w13_scale=w13_scale, w2_scale=w2_scale, w13_zero=w13_zero, w2_zero=w2_zero)
    triton_moe.check_once(x, router_logits, w13, w2, top_k, router, n_group, topk_group, score_bias, quant)
    if w13_scale is not None:
        w13 = dequantize_experts(w13, w13_scale, w13_zero, x.dtype, 0)
        w2 = dequantize_experts(w2, w2_scale, w2_zero, x.dtype, 1)
    return triton_moe.moe(x, router_logits, w13, w2, top_k, router=router, renormalize=renormalize,
                          n_group=n_group, topk_group=topk_group, routed_scaling=routed_scaling,
                          score_bias=score_bias)


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_tokens: int, dtype=None, **routing) -> int:
    """triton_moe.warm_up for the 16-bit experts this route runs (their GEMM tuning keys are those
    of 16-bit weights): on the dequantised experts, which also sizes the scratch buffers."""
    scales = {k: routing.pop(k, None) for k in ("w13_scale", "w2_scale", "w13_zero", "w2_zero")}
    dtype = dtype or w13.dtype
    if scales["w13_scale"] is not None:
        w13 = dequantize_experts(w13, scales["w13_scale"], scales["w13_zero"], dtype, 0)
        w2 = dequantize_experts(w2, scales["w2_scale"], scales["w2_zero"], dtype, 1)
    return triton_moe.warm_up(w13, w2, top_k, max_tokens, dtype, **routing)
