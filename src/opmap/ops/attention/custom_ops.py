"""The attention ops as ``torch.library`` custom ops (namespace ``opmap``), backed by our Triton
kernels, with fake implementations so that they compose with torch.compile and CUDA graphs.

Attention ops always return the LSE (natural log, fp32) next to the output. Decode runs the
auto split plan and allocates its split-KV partials per call (from the graph's pool when
captured); callers that want a persistent or fixed-split (batch-invariant) workspace call
``decode.decode`` directly.
"""
from __future__ import annotations

from typing import Optional

import torch


# The kernel modules (Triton) load on the first call, not with ``import opmap``: registering the ops
# costs only torch.
def _decode():
    from . import decode

    return decode


def _append():
    from . import kv_append

    return kv_append


def _merge():
    from . import merge

    return merge


def _prefill():
    from . import prefill

    return prefill



@torch.library.custom_op("opmap::paged_kv_append", mutates_args=("k_cache", "v_cache"))
def paged_kv_append(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
                    v_scale: Optional[torch.Tensor] = None) -> None:
    _append().append(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@paged_kv_append.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    return None


@torch.library.custom_op("opmap::attention_prefill", mutates_args=())
def attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, causal: bool = True,
                      window: Optional[int] = None, soft_cap: Optional[float] = None,
                      k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    return _prefill().prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale=scale, causal=causal,
                            window=window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, return_lse=True)


@attention_prefill.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, causal=True, window=None, soft_cap=None,
      k_scale=None, v_scale=None):
    T, H, _ = q.shape
    return q.new_empty((T, H, v_cache.shape[3])), q.new_empty((T, H), dtype=torch.float32)


@torch.library.custom_op("opmap::attention_decode", mutates_args=())
def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float, window: Optional[int] = None,
                     soft_cap: Optional[float] = None, k_scale: Optional[torch.Tensor] = None,
                     v_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _decode().decode(q, k_cache, v_cache, seq_lens, block_tables, scale=scale, window=window,
                          soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, return_lse=True)


@attention_decode.register_fake
def _(q, k_cache, v_cache, seq_lens, block_tables, scale, window=None, soft_cap=None, k_scale=None, v_scale=None):
    B, H, _ = q.shape
    return q.new_empty((B, H, v_cache.shape[3])), q.new_empty((B, H), dtype=torch.float32)


@torch.library.custom_op("opmap::attention_merge", mutates_args=())
def attention_merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return _merge().merge(o_a, lse_a, o_b, lse_b)


@attention_merge.register_fake
def _(o_a, lse_a, o_b, lse_b):
    return torch.empty_like(o_a), torch.empty_like(lse_a)
