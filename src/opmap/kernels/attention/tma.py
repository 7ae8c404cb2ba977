"""What the TMA kernels read their caches with (prefill_tma.py; MLA's decode_tma.py takes MAX_BOX):
the cache checks a tensor descriptor needs and the descriptors themselves, one box = ``rows`` rows of
one kv head in one page."""
from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

MAX_BOX = 256  # a TMA box is at most 256 elements along each dimension


def cache_problem(k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """None when both [pages, page, kv_heads, D] caches can be read through descriptors, else why."""
    for c in (k_cache, v_cache):
        if c.stride(3) != 1 or any((st * c.element_size()) % 16 for st in c.stride()[:3]) or c.data_ptr() % 16:
            return "TMA needs the cache's last dimension contiguous and 16-byte aligned rows"
        if c.shape[3] > MAX_BOX or c.shape[3] * c.element_size() < 16:
            return f"head_dim {c.shape[3]}: a TMA box row is 16 bytes to {MAX_BOX} elements"
    return None


def descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: int):
    """[pages, page, kv_heads, D] descriptors whose box is one kv head's ``rows`` rows of one page."""
    return tuple(TensorDescriptor(c, list(c.shape), list(c.stride()), [1, rows, 1, c.shape[3]])
                 for c in (k_cache, v_cache))


SMEM_BUDGET = 200 * 1024  # of the H100/H200's 227 KB per block, leaving room for the rest


def fit_stages(stages: int, tile_bytes: int, fixed_bytes: int, buffers_per_stage_off: int) -> int:
    """num_stages capped so that the pipeliner's buffers fit in shared memory: Triton 3.6 keeps
    ``stages - buffers_per_stage_off`` copies of a tile (sm90 builds: the decode double-buffers at 3
    stages, off 1; the prefill triple-buffers, off 0). A config that asks for more would fail at
    launch with OutOfResources."""
    room = max(1, (SMEM_BUDGET - fixed_bytes) // max(1, tile_bytes))
    return max(1, min(stages, room + buffers_per_stage_off))
