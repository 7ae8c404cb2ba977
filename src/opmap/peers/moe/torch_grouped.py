"""Peer: ``torch._grouped_mm`` (CUTLASS grouped GEMM on sm90; torch >= 2.9 also serves sm80,
and the CPU build has a kernel for every float dtype).

Pairs are sorted by expert, the per-expert end offsets (int32 cumulative counts) are built on
the device (no host sync), then two grouped GEMMs with SiLU-and-mul between them, and an fp32
weighted combine.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from opmap.core.contract import expect

from opmap.ops.moe.routing import check_moe_args, route
from opmap.peers.moe.torch_loop import combine, sort_by_expert


def check_alignment(x, w13, w2) -> None:
    """grouped_mm (CPU and CUDA) needs 16-byte aligned row strides and base pointers."""
    el = x.element_size()
    H, inter = x.shape[1], w2.shape[2]
    expect(H * el % 16 == 0, "x", f"hidden size {H} ({H * el} bytes per row)",
           "rows of a multiple of 16 bytes for torch._grouped_mm")
    expect(inter * el % 16 == 0, "w2", f"intermediate size {inter} ({inter * el} bytes per row)",
           "rows of a multiple of 16 bytes for torch._grouped_mm")
    for name, t in (("w13", w13), ("w2", w2)):
        expect(t.data_ptr() % 16 == 0 and t.stride(-1) == 1, name,
               f"data pointer {t.data_ptr()} with strides {t.stride()}",
               "a 16-byte aligned base and a contiguous last dimension for torch._grouped_mm")


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, *,
        router: str = "softmax", renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
        routed_scaling: float = 1.0, score_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    T, H, E, inter = check_moe_args(x, router_logits, w13, w2, top_k, router, n_group, topk_group, score_bias)
    check_alignment(x, w13, w2)
    weights, ids = route(router_logits, top_k, router=router, renormalize=renormalize, n_group=n_group,
                         topk_group=topk_group, routed_scaling=routed_scaling, score_bias=score_bias)
    order, counts = sort_by_expert(ids, E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // top_k]
    # w13.transpose(-2, -1) is the column-major [E, H, 2I] operand grouped_mm expects, no copy.
    h = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
    a = F.silu(h[:, :inter]) * h[:, inter:]
    ys = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    return combine(ys, order, weights, T, top_k, x.dtype)
