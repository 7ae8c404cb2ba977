"""The engine's chunked-prefill step: prefill chunks and decode tokens in one batch.

One launch of the varlen prefill kernel serves both: a decode token is a sequence with one query
token at the end of its context, and the kernel's grid (T // BLOCK_Q + B programs per KV head)
already gives each sequence its own programs. This keeps the step free of host synchronisation
(splitting the batch into its prefill and decode parts would need the lengths on the host). What
it gives up: decode rows use BLOCK_Q-token tiles with one valid token, and long decode contexts
are not split across SMs; at mixed steps the prefill chunks dominate the time.
"""
from __future__ import annotations

from .prefill import prefill


def mixed(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, *, scale: float, causal: bool = True,
          window=None, soft_cap=None, k_scale=None, v_scale=None, return_lse: bool = False):
    return prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale=scale, causal=causal,
                   window=window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)
