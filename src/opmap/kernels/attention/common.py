"""What the Triton attention launchers share: the contract they enforce before launching, the
tile configurations per device, and the scale pointers."""
from __future__ import annotations

import os

import torch
import triton

from opmap.core.contract import expect
from opmap.core.tiles import tile_config
from opmap.ops.attention import validate as V

LOG2E = 1.4426950408889634
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two: tl.arange over D; >= 16 for tl.dot


def check_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap, k_scale, v_scale,
                    cu_seqlens_q=None):
    """The whole input contract of the Triton prefill / decode entries; returns (P, page, Hk, D, Dv, B)."""
    P, page, hk, d, dv = V.check_cache(k_cache, v_cache, page_sizes=PAGE_SIZES, head_dims=HEAD_DIMS)
    V.check_q(q, k_cache, hk, d)
    V.check_scales(k_scale, v_scale, k_cache, hk)
    V.check_scale_args(scale, window, soft_cap)
    if cu_seqlens_q is None:
        B = V.check_meta(seq_lens, block_tables, q.device, batch=q.shape[0])
        V.check_values(seq_lens, block_tables, P, page)
    else:
        B = V.check_meta(seq_lens, block_tables, q.device)
        V.check_cu(cu_seqlens_q, q.shape[0], B, q.device)
        V.check_values(seq_lens, block_tables, P, page, cu_seqlens_q, q.shape[0])
    return P, page, hk, d, dv, B


_INTERP = os.environ.get("TRITON_INTERPRET") == "1"  # read once: asked on every launch


def interpreted(device: torch.device) -> bool:
    return device.type != "cuda" or _INTERP


def kernel_config(kind: str, head_dim: int, group: int, device: torch.device, override=None,
                  ieee: bool = False) -> dict:
    """``override`` (a dict of some of the same keys: core/tiles.py) replaces defaults: the
    benchmarks' ``--variants`` time alternatives in one GPU run so the defaults can follow
    measurement. ``ieee``: fp32 inputs (IEEE dots)."""
    cfg = tile_config(_default_config(kind, head_dim, group, device, ieee), override)
    if override:
        rows = cfg.get("BLOCK_M", cfg.get("BLOCK_H"))
        expect(rows >= group and rows >= 16 and cfg["BLOCK_N"] >= 16, "config", override,
               f"row block >= max(16, group={group}) and BLOCK_N >= 16")
    return cfg


def _default_config(kind: str, head_dim: int, group: int, device: torch.device, ieee: bool = False) -> dict:
    """Tile sizes of one kernel: ``kind`` "prefill" (the gather prefill), "prefill_tma" (the TMA
    prefill) or "decode" (the Triton decode). GPU values are the FlashAttention-2 starting points
    for sm90 (BLOCK_M 128 / BLOCK_N 64 / 8 warps / 3 stages at d<=128, halved for d=256 to stay in
    registers); the interpreter gets small tiles because its cost grows with the tile, not the
    grid. fp32 prefill on a GPU (IEEE dots: the exactness checks' dtype, not a speed path) gets
    small tiles too: its dots lower to FMA loops whose compile time grows with the tile."""
    gp = triton.next_power_of_2(group)
    # PREFETCH (the gather prefill and the decode): the page ids of the next key tile are loaded
    # one iteration ahead and carried in registers. With the page-table load in the same iteration
    # as the K/V loads that it addresses, Triton 3.6's pipeliner waits for every outstanding copy at
    # the top of each iteration (ttg.async_wait num = 0: no overlap of loads and MMAs, seen in the
    # sm90 TTGIR of both kernels); carried ids give it a real num_stages-deep pipeline (num = 2 at 3
    # stages). 0 keeps the in-iteration load: the same kernel, its loads issued in another order.
    # Decode turns it off for large grids (decode.decode_config). The TMA prefill always carries
    # its page ids (prefill_tma._page_of): no switch.
    pf = {} if kind == "prefill_tma" else {"PREFETCH": 1}
    if interpreted(device):
        if kind == "decode":
            return dict(BLOCK_H=max(16, gp), BLOCK_N=16, num_warps=4, num_stages=1, **pf)
        return dict(BLOCK_M=max(32, gp), BLOCK_N=16, num_warps=4, num_stages=1, **pf)
    if kind == "decode":
        bn = 64 if head_dim <= 128 else 32
        return dict(BLOCK_H=max(16, gp), BLOCK_N=bn, num_warps=4, num_stages=3, **pf)
    if ieee:
        return dict(BLOCK_M=max(32, gp), BLOCK_N=32, num_warps=4, num_stages=2, **pf)
    if head_dim <= 128:
        return dict(BLOCK_M=max(128, gp), BLOCK_N=64, num_warps=8, num_stages=3, **pf)
    return dict(BLOCK_M=max(64, gp), BLOCK_N=32, num_warps=8, num_stages=2, **pf)


def prepare_scales(k_cache, k_scale, v_scale):
    """Pointers for the scale arguments: the scales for fp8, any tensor otherwise (never read)."""
    if k_cache.dtype == V.FP8:
        return k_scale, v_scale
    return k_cache, k_cache


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 64  # the interpreter: a pretend GPU on which the tests' small batches still split


_SM = {}


def _sm_count(index: int) -> int:
    if index not in _SM:
        _SM[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM[index]
