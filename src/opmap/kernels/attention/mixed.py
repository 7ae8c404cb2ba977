"""The engine's chunked-prefill step: prefill chunks and decode tokens in one varlen batch.

Two launches over the same batch, no host synchronisation: the gather prefill kernel (prefill.py)
serves the sequences with more than one query token (its programs for one-token sequences return
at once), and a split-KV decode kernel serves the one-token sequences, reading the query and writing
the output at row cu_seqlens_q[b] (its programs for the other sequences return at once). Which
kernel serves a sequence is decided on the device from cu_seqlens_q, so the step can be captured in
a CUDA graph and replayed with a different mix. Both grids are static in (T, B).

Decode tokens thus get small tiles and split-KV over long contexts instead of a BLOCK_Q-token
prefill tile with one valid token. A one-token prompt (seq_len 1) is served by the decode kernel
too; the result is the same attention.

Each backend's ``mixed`` entry names its kernels: ``mixed`` (the ``triton`` backend) the gather
prefill and the Triton decode, ``mixed_fp8`` (the ``gluon-fp8`` backend, fp8 caches at head dim 128)
the gather prefill (its in-kernel fp8 conversion: a chunk's few query rows read each key tile about
once) and the Gluon decode, ``mixed_ws`` (the ``gluon-ws`` backend) the Gluon warp-specialised
prefill and the Triton decode.
"""
from __future__ import annotations

import torch

from opmap.kernels.attention import decode, decode_fp8, prefill_ws
from opmap.kernels.attention.common import check_attention
from opmap.kernels.attention.prefill import launch_prefill


def _gather_chunks(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, lse, *, causal, config, **kw):
    launch_prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, lse, causal=causal,
                   config=config, skip_single=True, **kw)


def _step(launch_decode, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, *, scale, causal, window,
          soft_cap, k_scale, v_scale, return_lse, workspace, config, chunks=_gather_chunks):
    """``chunks``: the launch of the prefill kernel over the sequences of more than one token."""
    T, hq, _ = q.shape
    out = torch.empty(T, hq, v_cache.shape[3], dtype=q.dtype, device=q.device)
    lse = torch.empty(T, hq, dtype=torch.float32, device=q.device) if return_lse else out
    kw = dict(scale=scale, window=window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)
    # A single query token at the end of its context sees every key up to it, causal or not, so
    # the decode kernel's semantics hold for the one-token sequences either way.
    chunks(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, lse, causal=causal, config=config, **kw)
    launch_decode(q, k_cache, v_cache, seq_lens, block_tables, out, lse, workspace=workspace,
                  cu_seqlens_q=cu_seqlens_q, **kw)
    return (out, lse) if return_lse else out


def mixed(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, *, scale: float, causal: bool = True,
          window=None, soft_cap=None, k_scale=None, v_scale=None, return_lse: bool = False, workspace=None,
          config=None):
    """Same signature as ``prefill``; ``workspace`` (from ``splitkv.make_workspace`` for at least B
    sequences) holds the decode part's split-KV partials; without it they are allocated per call.
    ``config`` tunes the prefill part's tiles (the decode part takes its defaults)."""
    check_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap, k_scale, v_scale,
                    cu_seqlens_q=cu_seqlens_q)
    return _step(decode.launch_decode, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale=scale,
                 causal=causal, window=window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
                 return_lse=return_lse, workspace=workspace, config=config)


def mixed_fp8(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, *, scale: float, causal: bool = True,
              window=None, soft_cap=None, k_scale=None, v_scale=None, return_lse: bool = False, workspace=None,
              config=None):
    """``mixed`` with the one-token sequences on the Gluon fp8 decode (decode_fp8.py), whose
    requirements the inputs must meet (an InputError otherwise)."""
    check_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap, k_scale, v_scale,
                    cu_seqlens_q=cu_seqlens_q)
    decode_fp8.check_inputs(q, k_cache, v_cache)
    return _step(decode_fp8.launch_decode, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale=scale,
                 causal=causal, window=window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
                 return_lse=return_lse, workspace=workspace, config=config)


def mixed_ws(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, *, scale: float, causal: bool = True,
             window=None, soft_cap=None, k_scale=None, v_scale=None, return_lse: bool = False, workspace=None,
             config=None):
    """``mixed`` with the chunks on the Gluon warp-specialised prefill (prefill_ws.py), whose
    requirements the inputs must meet (an InputError otherwise); ``config`` tunes its tiles."""
    cfg = prefill_ws.checked_config(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window,
                                    soft_cap, k_scale, v_scale, config)

    def chunks(q, k_cache, v_cache, cu, sl, bt, out, lse, *, causal, config, k_scale, v_scale, **kw):
        prefill_ws.launch(q, k_cache, v_cache, cu, sl, bt, out, lse, cfg, causal=causal, skip_single=True, **kw)

    return _step(decode.launch_decode, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale=scale,
                 causal=causal, window=window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
                 return_lse=return_lse, workspace=workspace, config=config, chunks=chunks)
