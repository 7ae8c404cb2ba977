"""MLA (DeepSeek multi-head latent attention): the plain-PyTorch fp32 reference, the oracle.

Latent cache (one per layer): ``cache[P, page, R + Dr]``: per token the compressed KV vector
``ckv`` (rank R = kv_lora_rank, 512 in DeepSeek-V2/V3) followed by the RoPE key ``kpe`` (Dr = 64,
shared by all heads). Token ``t`` of a sequence lives in page ``block_tables[b, t // page]`` at
row ``t % page``. An fp8 (e4m3) cache stores value / ``kv_scale`` (one scale per layer, since MLA
has one KV head), clamped to +-448.

Entries (the same signatures for every backend of the family):

``append_mla(ckv[T, R], kpe[T, Dr], cache[P, page, R + Dr], slot_mapping[T] int32|int64,
kv_scale=None) -> None``: writes token i at slot ``slot_mapping[i]`` = page_id * page + offset;
-1 = skip. (``scale=`` is accepted as a keyword alias of ``kv_scale``: docs/OPS_API.md's name.)

``mla_decode(q_nope[B, H, R], q_pe[B, H, Dr], cache, seq_lens[B] int32, block_tables[B, maxp]
int32, *, scale, kv_scale=None, return_lse=False, workspace=None) -> out[B, H, R]`` (or
``(out, lse[B, H] fp32, natural log)``). Absorbed form: ``q_nope`` is already multiplied by the
key half of kv_b (W_UK), the score is ``scale * (q_nope . ckv + q_pe . kpe)``, the value is
``ckv`` itself, and the caller applies W_UV to ``out``. Length 0 gives zeros and lse = -inf.

``mla_sparse_decode(q_nope, q_pe, cache, seq_lens, block_tables, indices[B, K] int32, *, scale,
kv_scale=None, return_lse=False, workspace=None) -> out[B, H, R]``: like ``mla_decode`` but
sequence b attends only to the token positions ``indices[b]`` (0 <= i < seq_lens[b]; -1 = unused
slot). Duplicates and out-of-range indices are an InputError.

``mla_prefill(q_nope[T, H, Dn], q_pe[T, H, Dr], cache, w_kc[H, Dn, R], w_vc[H, Dv, R],
cu_seqlens_q[B+1] int32, seq_lens[B] int32, block_tables, *, scale, kv_scale=None, causal=True,
return_lse=False, max_q_len=None, max_seq_len=None, chunk_size=None) -> out[T, H, Dv]``:
non-absorbed form. ``w_kc``/``w_vc`` are kv_b_proj.weight viewed as [H, Dn + Dv, R] and split.
Per head h, key = [ckv @ w_kc[h].T, kpe], value = ckv @ w_vc[h].T. The new tokens of sequence b
are the last ``q_len_b`` of its ``seq_lens[b]`` (already appended to the cache), so a cached
prefix is attended to; causal is bottom-right aligned. ``max_q_len``/``max_seq_len`` are host
hints that spare a device->host read; ``chunk_size`` bounds how many context tokens are expanded
at once (the Triton backend; the reference ignores it).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from opmap.ops.norm.reference import rmsnorm_rows
from opmap.ops.rope.reference import rope
from opmap.ops.mla.validate import (check_append, check_decode, check_norm_rope_append, check_prefill,
                                    check_sparse_indices, scale_alias, scale_value)

FP8_MAX = 448.0


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, qk_nope_dim: int, v_dim: int):
    """HF ``kv_b_proj.weight`` [H * (Dn + Dv), R] -> (w_kc[H, Dn, R], w_vc[H, Dv, R]), contiguous.
    Absorbed decode: q_nope_abs = einsum("bhd,hdr->bhr", q_nope, w_kc); out = einsum("bhr,hvr->bhv",
    latent_out, w_vc)."""
    w = kv_b_weight.view(num_heads, qk_nope_dim + v_dim, -1)
    return w[:, :qk_nope_dim].contiguous(), w[:, qk_nope_dim:].contiguous()


def dequant(cache: torch.Tensor, kv_scale) -> torch.Tensor:
    """The cache as fp32 values (fp8 times its scale)."""
    c = cache.float()
    if cache.dtype == torch.float8_e4m3fn:
        c = c * scale_value(kv_scale, cache.device)
    return c


def quantize(x: torch.Tensor, dtype: torch.dtype, kv_scale) -> torch.Tensor:
    """What the cache stores for values ``x`` (fp8: x / scale, clamped to +-448)."""
    if dtype == torch.float8_e4m3fn:
        s = scale_value(kv_scale, x.device)
        return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def append_mla(ckv, kpe, cache, slot_mapping, kv_scale=None, *, scale=None) -> None:
    kv_scale = scale_alias(kv_scale, scale)
    check_append(ckv, kpe, cache, slot_mapping, kv_scale)
    keep = slot_mapping.long() >= 0
    slots = slot_mapping.long()[keep]
    rows = torch.cat([ckv, kpe], dim=-1)[keep]
    flat = cache.view(-1, cache.shape[-1])
    flat[slots] = quantize(rows, cache.dtype, kv_scale)


def norm_rope_append_mla(q_pe, kva, norm_weight, eps, positions, cos_sin, style, cache, slot_mapping,
                         kv_scale=None) -> None:
    """The latent step of an MLA layer before attention, as one entry: ckv = RMSNorm of kva's first R
    columns (HF numerics), q_pe and kva's last Dr columns (kpe) rotated in place, then the row
    [ckv, kpe] appended at ``slot_mapping`` (append_mla). R = the cache's width - Dr."""
    _, R, _ = check_norm_rope_append(q_pe, kva, norm_weight, eps, positions, cos_sin, style, cache, slot_mapping,
                                     kv_scale)
    ckv = rmsnorm_rows(kva[:, :R], norm_weight, eps)
    rope(q_pe, kva[:, None, R:], positions, cos_sin, style)
    append_mla(ckv, kva[:, R:], cache, slot_mapping, kv_scale)


def gather_tokens(cache, block_tables, b: int, positions: torch.Tensor) -> torch.Tensor:
    """Rows of sequence ``b`` at token ``positions`` (int64), as stored."""
    page = cache.shape[1]
    pages = block_tables[b].long()[positions // page]
    return cache[pages, positions % page]


def _attend(q_nope, q_pe, rows, R, scale):
    """q_nope[H, R], q_pe[H, Dr], rows[N, R + Dr] fp32 -> out[H, R], lse[H]."""
    ckv, kpe = rows[:, :R], rows[:, R:]
    s = (q_nope @ ckv.T + q_pe @ kpe.T) * scale
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ ckv, lse


def mla_decode(q_nope, q_pe, cache, seq_lens, block_tables, *, scale: float, kv_scale=None,
               return_lse: bool = False, workspace=None):
    check_decode(q_nope, q_pe, cache, seq_lens, block_tables, kv_scale, scale)
    B, H, R = q_nope.shape
    out = torch.zeros(B, H, R, dtype=torch.float32, device=q_nope.device)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float32, device=q_nope.device)
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        rows = dequant(gather_tokens(cache, block_tables, b, torch.arange(n, device=cache.device)),
                       kv_scale)
        out[b], lse[b] = _attend(q_nope[b].float(), q_pe[b].float(), rows, R, scale)
    out = out.to(q_nope.dtype)
    return (out, lse) if return_lse else out


def mla_sparse_decode(q_nope, q_pe, cache, seq_lens, block_tables, indices, *, scale: float,
                      kv_scale=None, return_lse: bool = False, workspace=None):
    check_decode(q_nope, q_pe, cache, seq_lens, block_tables, kv_scale, scale)
    check_sparse_indices(indices, seq_lens)
    B, H, R = q_nope.shape
    out = torch.zeros(B, H, R, dtype=torch.float32, device=q_nope.device)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float32, device=q_nope.device)
    for b in range(B):
        pos = indices[b].long()
        pos = pos[pos >= 0]
        if pos.numel() == 0:
            continue
        rows = dequant(gather_tokens(cache, block_tables, b, pos), kv_scale)
        out[b], lse[b] = _attend(q_nope[b].float(), q_pe[b].float(), rows, R, scale)
    out = out.to(q_nope.dtype)
    return (out, lse) if return_lse else out


def mla_prefill(q_nope, q_pe, cache, w_kc, w_vc, cu_seqlens_q, seq_lens, block_tables, *,
                scale: float, kv_scale=None, causal: bool = True, return_lse: bool = False,
                max_q_len: Optional[int] = None, max_seq_len: Optional[int] = None,
                chunk_size: Optional[int] = None):
    check_prefill(q_nope, q_pe, cache, w_kc, w_vc, cu_seqlens_q, seq_lens, block_tables, kv_scale, scale)
    T, H, _ = q_nope.shape
    R = w_kc.shape[2]
    Dv = w_vc.shape[1]
    out = torch.zeros(T, H, Dv, dtype=torch.float32, device=q_nope.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q_nope.device)
    cu = cu_seqlens_q.long().tolist()
    wk, wv = w_kc.float(), w_vc.float()
    for b in range(len(cu) - 1):
        q0, q1, n = cu[b], cu[b + 1], int(seq_lens[b])
        if q1 == q0 or n == 0:
            continue
        rows = dequant(gather_tokens(cache, block_tables, b, torch.arange(n, device=cache.device)),
                       kv_scale)
        ckv, kpe = rows[:, :R], rows[:, R:]
        k_nope = torch.einsum("nr,hdr->hnd", ckv, wk)  # [H, n, Dn]
        v = torch.einsum("nr,hdr->hnd", ckv, wv)  # [H, n, Dv]
        qn = q_nope[q0:q1].float().transpose(0, 1)  # [H, q, Dn]
        qp = q_pe[q0:q1].float().transpose(0, 1)
        s = (qn @ k_nope.transpose(1, 2) + qp @ kpe.T) * scale  # [H, q, n]
        if causal:
            qpos = torch.arange(n - (q1 - q0), n, device=s.device)
            s = s.masked_fill(torch.arange(n, device=s.device)[None, :] > qpos[:, None], float("-inf"))
        lse_b = torch.logsumexp(s, dim=-1)  # [H, q]
        p = torch.softmax(s, dim=-1)
        out[q0:q1] = (p @ v).transpose(0, 1)
        lse[q0:q1] = lse_b.T
    out = out.to(q_nope.dtype)
    return (out, lse) if return_lse else out
