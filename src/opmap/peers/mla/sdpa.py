"""Peer: MLA through PyTorch's ``F.scaled_dot_product_attention`` (cuDNN / FlashAttention-2 /
memory-efficient / math, whichever SDPA picks for the shapes).

Same entries and signatures as reference.py. The latent pages of each sequence are gathered into
a contiguous tensor, then:
- decode (dense and sparse): absorbed form as multi-query attention, key = [ckv | kpe] (head dim
  R + Dr = 576), value = ckv, the query heads laid out as query positions of the one latent head;
- prefill: non-absorbed form, K/V expanded per head by kv_b (``w_kc``, ``w_vc``), causal mask
  bottom-right aligned when a cached prefix precedes the new tokens.
SDPA does not return the LSE, so ``return_lse=True`` is refused (declared in backends.py).
Sequences run one at a time (host loop, host reads of lengths): eager only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opmap.core.contract import InputError
from opmap.ops.mla.reference import gather_tokens
from opmap.ops.mla.validate import check_decode, check_prefill, check_sparse_indices, scale_value


def _rows(cache, block_tables, b, pos, kv_scale, dtype):
    rows = gather_tokens(cache, block_tables, b, pos)
    if cache.dtype == torch.float8_e4m3fn:
        return (rows.float() * scale_value(kv_scale, cache.device)).to(dtype)
    return rows.to(dtype)


def _no_lse(return_lse):
    if return_lse:
        raise InputError("return_lse", True, "False (SDPA does not return the LSE)")


def mqa_latent(q_nope, q_pe, rows, scale):
    """q_nope[B, H, R], q_pe[B, H, Dr], rows[B, n, R + Dr] -> out[B, H, R] (one SDPA call).

    One decode token per sequence and one latent head: the H query heads are laid out as H query
    *positions* of a single non-causal head, so the latent is never copied per head (expanding it
    would cost H x the cache: 600 GB at B=128, H=128, 32k)."""
    R = q_nope.shape[-1]
    q = torch.cat([q_nope, q_pe], dim=-1).unsqueeze(1)  # [B, 1, H, R + Dr]
    k = rows.unsqueeze(1)  # [B, 1, n, R + Dr]
    return F.scaled_dot_product_attention(q, k, k[..., :R], scale=scale).squeeze(1)


def _decode(q_nope, q_pe, cache, block_tables, positions, scale, kv_scale):
    B, H, R = q_nope.shape
    out = torch.zeros_like(q_nope)
    for b in range(B):
        pos = positions[b]
        if pos.numel():
            rows = _rows(cache, block_tables, b, pos, kv_scale, q_nope.dtype)
            out[b] = mqa_latent(q_nope[b:b + 1], q_pe[b:b + 1], rows[None], scale)[0]
    return out


def mla_decode(q_nope, q_pe, cache, seq_lens, block_tables, *, scale: float, kv_scale=None,
               return_lse: bool = False, workspace=None):
    check_decode(q_nope, q_pe, cache, seq_lens, block_tables, kv_scale, scale)
    _no_lse(return_lse)
    dev = cache.device
    pos = [torch.arange(int(n), device=dev) for n in seq_lens.tolist()]
    return _decode(q_nope, q_pe, cache, block_tables, pos, scale, kv_scale)


def mla_sparse_decode(q_nope, q_pe, cache, seq_lens, block_tables, indices, *, scale: float,
                      kv_scale=None, return_lse: bool = False, workspace=None):
    check_decode(q_nope, q_pe, cache, seq_lens, block_tables, kv_scale, scale)
    check_sparse_indices(indices, seq_lens)
    _no_lse(return_lse)
    pos = [row[row >= 0].long() for row in indices]
    return _decode(q_nope, q_pe, cache, block_tables, pos, scale, kv_scale)


def mla_prefill(q_nope, q_pe, cache, w_kc, w_vc, cu_seqlens_q, seq_lens, block_tables, *,
                scale: float, kv_scale=None, causal: bool = True, return_lse: bool = False,
                max_q_len=None, max_seq_len=None, chunk_size=None):
    check_prefill(q_nope, q_pe, cache, w_kc, w_vc, cu_seqlens_q, seq_lens, block_tables, kv_scale, scale)
    _no_lse(return_lse)
    T, H, Dn = q_nope.shape
    R, Dv = w_kc.shape[2], w_vc.shape[1]
    out = torch.zeros(T, H, Dv, dtype=q_nope.dtype, device=q_nope.device)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    w = torch.cat([w_kc, w_vc], dim=1).reshape(H * (Dn + Dv), R)
    for b, n in enumerate(lens):
        q0, q1 = cu[b], cu[b + 1]
        if q1 == q0:
            continue
        rows = _rows(cache, block_tables, b, torch.arange(n, device=cache.device), kv_scale,
                     q_nope.dtype)
        kv = (rows[:, :R] @ w.T).view(n, H, Dn + Dv).transpose(0, 1)  # [H, n, Dn + Dv]
        k = torch.cat([kv[..., :Dn], rows[None, :, R:].expand(H, -1, -1)], dim=-1)
        q = torch.cat([q_nope[q0:q1], q_pe[q0:q1]], dim=-1).transpose(0, 1)  # [H, q, Dn + Dr]
        ql = q1 - q0
        mask, is_causal = None, False
        if causal and ql == n:
            is_causal = True
        elif causal:
            mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - ql, n, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q, k, kv[..., Dn:], attn_mask=mask, is_causal=is_causal,
                                           scale=scale)
        out[q0:q1] = o.transpose(0, 1)
    return out
