"""The engine's chunked-prefill step: prefill chunks and decode tokens in one varlen batch.

Two launches over the same batch, no host synchronisation: the prefill kernel serves the
sequences with more than one query token (its programs for one-token sequences return at once),
and the split-KV decode kernel serves the one-token sequences, reading the query and writing the
output at row cu_seqlens_q[b] (its programs for the other sequences return at once). Which kernel
serves a sequence is decided on the device from cu_seqlens_q, so the step can be captured in a
CUDA graph and replayed with a different mix. Both grids are static in (T, B).

Decode tokens thus get small tiles and split-KV over long contexts instead of a BLOCK_Q-token
prefill tile with one valid token. A one-token prompt (seq_len 1) is served by the decode kernel
too; the result is the same attention.
"""
from __future__ import annotations

import torch

from opmap.kernels.attention.common import check_attention
from opmap.kernels.attention.decode import launch_decode
from opmap.kernels.attention.prefill import launch_prefill


def mixed(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, *, scale: float, causal: bool = True,
          window=None, soft_cap=None, k_scale=None, v_scale=None, return_lse: bool = False, workspace=None,
          config=None):
    """Same signature as ``prefill``; ``workspace`` (from ``decode.make_workspace`` for at least B
    sequences) holds the decode part's split-KV partials; without it they are allocated per call."""
    P, page, hk, d, dv, B = check_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap,
                                            k_scale, v_scale, cu_seqlens_q=cu_seqlens_q)
    T, hq, _ = q.shape
    out = torch.empty(T, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, hq, dtype=torch.float32, device=q.device) if return_lse else out
    kw = dict(scale=scale, window=window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)
    # A single query token at the end of its context sees every key up to it, causal or not, so
    # the decode kernel's semantics hold for the one-token sequences either way.
    launch_prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, lse, causal=causal,
                   config=config, skip_single=True, **kw)
    launch_decode(q, k_cache, v_cache, seq_lens, block_tables, out, lse, workspace=workspace,
                  cu_seqlens_q=cu_seqlens_q, **kw)
    return (out, lse) if return_lse else out
