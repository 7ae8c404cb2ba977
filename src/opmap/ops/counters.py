"""Zeroed int32 counters for the kernels whose last program finishes a reduction (the split-K
GEMM's tiles, the split-KV decode's rows): each program adds one after writing its partial, the
one that sees the count complete merges the partials and puts the counter back to zero, so the
buffer is all zeros between launches and one buffer serves every kernel of a stream.

Stream order (and, under PDL, each program's wait for the previous kernel before it touches a
counter) keeps two kernels of one stream from using them at once; two streams never share them.
Made during a CUDA-graph capture they come from the graph's pool and stay valid while cached.
"""
from __future__ import annotations

import torch

COUNTERS: dict = {}  # (device, stream) -> int32 counters, zero between launches
RETIRED: list = []   # outgrown buffers: a captured CUDA graph may still point at one


def counters(n: int, device: torch.device) -> torch.Tensor:
    """At least ``n`` zeroed counters for this device and its current stream."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            RETIRED.append(buf)
        # 1024 covers every split plan of the GEMM (fewer than four tiles an SM) and the decode's
        # rows x KV heads that split (B x Hk < 2 x SMs): one buffer, made once.
        buf = COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf
