"""The MLA ops as ``torch.library`` custom ops (namespace ``opmap``), backed by our Triton kernels,
with fake implementations so that they compose with torch.compile and CUDA graphs.

The schema takes ``kv_scale`` as an optional [1] fp32 tensor (no Python float) and always returns
the LSE next to the output. Decode allocates its split-KV scratch per call (from the graph's pool
when captured); callers that want a persistent workspace use ``decode.mla_decode`` directly.
"""
from __future__ import annotations

from typing import Optional

import torch


# The kernel modules (Triton) load on the first call, not with ``import opmap``: registering the ops
# costs only torch.
def _append():
    from . import append

    return append


def _decode():
    from . import decode

    return decode


def _prefill():
    from . import prefill

    return prefill



@torch.library.custom_op("opmap::mla_decode", mutates_args=())
def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, seq_lens: torch.Tensor,
               block_tables: torch.Tensor, scale: float,
               kv_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _decode().mla_decode(q_nope, q_pe, cache, seq_lens, block_tables, scale=scale,
                              kv_scale=kv_scale, return_lse=True)


@mla_decode.register_fake
def _(q_nope, q_pe, cache, seq_lens, block_tables, scale, kv_scale=None):
    B, H, _ = q_nope.shape
    return torch.empty_like(q_nope), q_nope.new_empty((B, H), dtype=torch.float32)


@torch.library.custom_op("opmap::mla_sparse_decode", mutates_args=())
def mla_sparse_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, indices: torch.Tensor,
                      scale: float, kv_scale: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    return _decode().mla_sparse_decode(q_nope, q_pe, cache, seq_lens, block_tables, indices,
                                     scale=scale, kv_scale=kv_scale, return_lse=True)


@mla_sparse_decode.register_fake
def _(q_nope, q_pe, cache, seq_lens, block_tables, indices, scale, kv_scale=None):
    B, H, _ = q_nope.shape
    return torch.empty_like(q_nope), q_nope.new_empty((B, H), dtype=torch.float32)


@torch.library.custom_op("opmap::mla_prefill", mutates_args=())
def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, w_kc: torch.Tensor,
                w_vc: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                block_tables: torch.Tensor, scale: float, kv_scale: Optional[torch.Tensor] = None,
                causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return _prefill().mla_prefill(q_nope, q_pe, cache, w_kc, w_vc, cu_seqlens_q, seq_lens, block_tables,
                                scale=scale, kv_scale=kv_scale, causal=causal, return_lse=True)


@mla_prefill.register_fake
def _(q_nope, q_pe, cache, w_kc, w_vc, cu_seqlens_q, seq_lens, block_tables, scale, kv_scale=None,
      causal=True):
    T, H, _ = q_nope.shape
    return (q_nope.new_empty((T, H, w_vc.shape[1])), q_nope.new_empty((T, H), dtype=torch.float32))


@torch.library.custom_op("opmap::append_mla", mutates_args=("cache",))
def append_mla(ckv: torch.Tensor, kpe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
               kv_scale: Optional[torch.Tensor] = None) -> None:
    _append().append_mla(ckv, kpe, cache, slot_mapping, kv_scale)


@append_mla.register_fake
def _(ckv, kpe, cache, slot_mapping, kv_scale=None):
    return None
