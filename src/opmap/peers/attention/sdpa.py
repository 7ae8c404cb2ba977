"""PyTorch SDPA peers (cuDNN, FlashAttention-2, memory-efficient) behind opmap's entry signature.

They serve *contiguous* KV only (spec.paged=False): ``k_cache``/``v_cache`` are ``[B, S, Hk, D]``,
i.e. a paged cache with one page of S tokens per sequence, sequence b in page b; ``block_tables``
is not read (pass None or ``arange(B)[:, None]``). Each sequence is one SDPA call under
``sdpa_kernel(<backend>)`` (lengths are read on the host: no CUDA graphs). Causal alignment:
- q_len == seq_len (a whole prompt): ``is_causal=True``;
- q_len == 1 (decode): no mask, the last position sees every key;
- otherwise (a chunk over a cached prefix, bottom-right): FlashAttention's own causal flag, which
  is bottom-right aligned, or the memory-efficient kernel's lower-right mask type; the cuDNN
  adapter has no bottom-right mask and refuses such a batch with an InputError.
GQA: flash takes ``enable_gqa``; the other two get K/V heads repeated (their support for
unequal head counts differs between torch versions, so the adapter does not rely on it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from opmap.core.contract import InputError, expect, expect_same_device, expect_tensor
from opmap.ops.attention import validate as V

LOWER_RIGHT = 2  # custom_mask_type of the memory-efficient kernel (torch.nn.attention.bias.CausalVariant)


def _check(q, k_cache, v_cache, seq_lens, window, soft_cap, k_scale, v_scale, return_lse, scale):
    expect_tensor("k_cache", k_cache, ndim=4, dtype=q.dtype, last_dim_contiguous=True)
    expect_tensor("v_cache", v_cache, ndim=4, dtype=q.dtype, shape=tuple(k_cache.shape[:3]) + (None,),
                  last_dim_contiguous=True)
    expect_tensor("q", q, ndim=3, last_dim_contiguous=True)
    expect_tensor("seq_lens", seq_lens, ndim=1, dtype=torch.int32)
    expect_same_device(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens)
    hk = k_cache.shape[2]
    expect(q.shape[1] % hk == 0, "q", f"{q.shape[1]} heads", f"a multiple of num_kv_heads={hk}")
    expect(q.shape[2] == k_cache.shape[3], "q", f"head_dim {q.shape[2]}", f"{k_cache.shape[3]}")
    expect(k_cache.shape[0] == seq_lens.shape[0], "k_cache", f"{k_cache.shape[0]} sequences",
           f"{seq_lens.shape[0]} (contiguous KV: one row [S, Hk, D] per sequence)")
    expect(window is None, "window", window, "None (SDPA adapters take no sliding window)")
    expect(soft_cap is None, "soft_cap", soft_cap, "None (SDPA has no logit soft-cap)")
    expect(k_scale is None and v_scale is None, "k_scale", "a scale", "None (no fp8 KV)")
    expect(not return_lse, "return_lse", return_lse, "False (the public SDPA API returns no LSE)")
    V.check_scale_args(scale, None, None)
    lens = seq_lens.tolist()
    S = k_cache.shape[1]
    for b, L in enumerate(lens):
        if not 0 <= L <= S:
            raise InputError("seq_lens", f"seq_lens[{b}]={L}", f"in [0, {S}] (the contiguous cache's length)")
    return lens


def _one(member, qb, kb, vb, n, L, scale, causal):
    """qb [1, Hq, n, D], kb/vb [1, Hk, L, D] -> [1, Hq, n, Dv]."""
    g = qb.shape[1] // kb.shape[1]
    if member != SDPBackend.FLASH_ATTENTION:
        # Dense [1, H, L, D] operands: the layouts every version of these kernels accepts.
        qb = qb.contiguous()
        kb, vb = ((kb.repeat_interleave(g, 1), vb.repeat_interleave(g, 1)) if g > 1
                  else (kb.contiguous(), vb.contiguous()))
    gqa = kb.shape[1] != qb.shape[1]
    if member == SDPBackend.CUDNN_ATTENTION and L == 1:
        # Seen on the H200 (torch 2.11, cuDNN 9.19): "cudnn SDPA does not support key/value sequence length 1".
        raise InputError("seq_lens", "a KV length of 1", "KV length >= 2 (cuDNN SDPA has no kernel for one key)")
    if not causal or n == 1:
        return F.scaled_dot_product_attention(qb, kb, vb, scale=scale, enable_gqa=gqa)
    if n == L:
        return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
    if member == SDPBackend.FLASH_ATTENTION:
        if gqa:
            kb, vb = kb.repeat_interleave(g, 1), vb.repeat_interleave(g, 1)
        # FlashAttention's causal flag is bottom-right aligned when q_len < kv_len.
        return torch.ops.aten._scaled_dot_product_flash_attention(qb, kb, vb, 0.0, is_causal=True, scale=scale)[0]
    if member == SDPBackend.EFFICIENT_ATTENTION:
        return torch.ops.aten._efficient_attention_forward(
            qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), bias=None, cu_seqlens_q=None,
            cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
            custom_mask_type=LOWER_RIGHT, compute_log_sumexp=False, scale=scale, seqlen_k=None)[0].transpose(1, 2)
    raise InputError("cu_seqlens_q", f"a chunk of {n} tokens over {L} keys",
                     "q_len == seq_len or 1 per sequence (cuDNN SDPA adapter: no bottom-right causal mask)")


def _run(member, q, k_cache, v_cache, cu_seqlens_q, seq_lens, *, scale, causal, window, soft_cap, k_scale,
         v_scale, return_lse):
    lens = _check(q, k_cache, v_cache, seq_lens, window, soft_cap, k_scale, v_scale, return_lse, scale)
    expect_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, shape=(len(lens) + 1,), device=q.device)
    cu = cu_seqlens_q.tolist()
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[3], dtype=q.dtype, device=q.device)
    with sdpa_kernel([member]):
        for b, L in enumerate(lens):
            s0, s1 = cu[b], cu[b + 1]
            n = s1 - s0
            if n == 0 or L == 0:
                continue
            expect(n <= L, "seq_lens", f"seq_lens[{b}]={L} < {n} query tokens", "seq_lens to include the new tokens")
            qb = q[s0:s1].transpose(0, 1).unsqueeze(0)
            kb = k_cache[b, :L].transpose(0, 1).unsqueeze(0)
            vb = v_cache[b, :L].transpose(0, 1).unsqueeze(0)
            out[s0:s1] = _one(member, qb, kb, vb, n, L, scale, causal)[0].transpose(0, 1)
    return out


def _entries(member):
    def prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables=None, *, scale, causal=True, window=None,
                soft_cap=None, k_scale=None, v_scale=None, return_lse=False):
        return _run(member, q, k_cache, v_cache, cu_seqlens_q, seq_lens, scale=scale, causal=causal, window=window,
                    soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)

    def decode(q, k_cache, v_cache, seq_lens, block_tables=None, *, scale, window=None, soft_cap=None, k_scale=None,
               v_scale=None, return_lse=False, workspace=None):
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return _run(member, q, k_cache, v_cache, cu, seq_lens, scale=scale, causal=True, window=window,
                    soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)

    return prefill, decode


sdpa_cudnn_prefill, sdpa_cudnn_decode = _entries(SDPBackend.CUDNN_ATTENTION)
sdpa_flash_prefill, sdpa_flash_decode = _entries(SDPBackend.FLASH_ATTENTION)
sdpa_efficient_prefill, sdpa_efficient_decode = _entries(SDPBackend.EFFICIENT_ATTENTION)
sdpa_cudnn_mixed, sdpa_flash_mixed, sdpa_efficient_mixed = sdpa_cudnn_prefill, sdpa_flash_prefill, sdpa_efficient_prefill
