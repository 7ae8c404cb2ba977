"""Plain-PyTorch attention references (fp32 accumulation): the oracle for every kernel.

Conventions (docs/OPS_API.md): paged K/V caches ``[num_pages, page_size, num_kv_heads, head_dim]``
(NHD), int32 page ids, ``seq_lens`` = total KV length *including* the new tokens, the query of a
sequence is the last ``q_len`` positions of its context (bottom-right causal alignment), LSE is
the natural log in fp32, fp8 caches (e4m3) hold value / scale with per-kv-head fp32 scales.
Query head ``h`` reads KV head ``h // (Hq // Hk)`` (MHA, GQA, MQA alike).
Sliding window ``W``: the query at position ``p`` sees keys ``j`` with ``p - W < j`` (and
``j <= p`` when causal). Logit soft-cap ``c``: ``s -> c * tanh(s / c)`` after the scale.
A query row that sees no key (only possible for a sequence of length 0) outputs zeros and
LSE ``-inf``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from opmap.core.contract import expect, expect_same_device, expect_tensor
from opmap.ops.attention import validate as V
from opmap.ops.norm.reference import rmsnorm_rows
from opmap.ops.rope import reference as rope_ref


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """value / scale per kv head (dim -2), saturated to the e4m3 range, rounded to nearest."""
    y = x.float() / scale.float()[:, None]
    return y.clamp(-V.FP8_MAX, V.FP8_MAX).to(V.FP8)


def append(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Write k[t], v[t] to slot ``slot_mapping[t]`` = page * page_size + offset; -1 = skip."""
    P, page, hk, d, dv = V.check_cache(k_cache, v_cache)
    expect_tensor("k", k, ndim=3, dtype=V.Q_DTYPES, shape=(None, hk, d), device=k_cache.device)
    expect_tensor("v", v, ndim=3, dtype=k.dtype, shape=(k.shape[0], hk, dv), device=k_cache.device)
    if k_cache.dtype != V.FP8:
        expect(k_cache.dtype == k.dtype, "k_cache", f"dtype {k_cache.dtype}", f"{k.dtype} (k's) or fp8")
    V.check_scales(k_scale, v_scale, k_cache, hk)
    V.check_slots(slot_mapping, k.shape[0], P * page)
    s = slot_mapping.long()
    keep = s >= 0
    idx = s[keep]
    for src, cache, sc in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = src[keep]
        rows = quantize_fp8(rows, sc) if cache.dtype == V.FP8 else rows.to(cache.dtype)
        cache.view(P * page, hk, -1)[idx] = rows


def rope_append(q, k, v, positions, cos_sin, style, k_cache, v_cache, slot_mapping, k_scale=None,
                v_scale=None, qk_norm=None) -> None:
    """(Qwen3's q/k RMSNorm when ``qk_norm=(w_q, w_k, eps)``,) RoPE on q and k in place, then
    append: the fused entry's definition."""
    norm = V.check_qk_norm_arg(qk_norm, q)
    if norm is not None:
        q.copy_(rmsnorm_rows(q, norm[0], norm[2]))
        k.copy_(rmsnorm_rows(k, norm[1], norm[2]))
    rope_ref.rope(q, k, positions, cos_sin, style)
    append(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def gather_kv(cache, block_table_row, length: int, scale=None) -> torch.Tensor:
    """The first ``length`` tokens of one sequence, [length, Hk, D] in fp32 (dequantised)."""
    page = cache.shape[1]
    n = (length + page - 1) // page
    x = cache[block_table_row[:n].long()].reshape(n * page, *cache.shape[2:])[:length].float()
    if scale is not None:
        x = x * scale.float()[None, :, None]
    return x


def attend(q, k, v, q_pos, *, scale, causal=True, window=None, soft_cap=None, acc=torch.float32):
    """q [n, Hq, D] at positions q_pos [n]; k, v [L, Hk, D]. Returns (out [n, Hq, Dv] acc, lse [n, Hq])."""
    n, hq, _ = q.shape
    L, hk, _ = k.shape
    g = hq // hk
    qf = q.to(acc)
    kf = k.to(acc).repeat_interleave(g, dim=1)
    vf = v.to(acc).repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", qf, kf) * scale
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    j = torch.arange(L, device=q.device)[None, :]
    p = q_pos.to(q.device)[:, None]
    ok = torch.ones(n, L, dtype=torch.bool, device=q.device)
    if causal:
        ok &= j <= p
    if window is not None:
        ok &= j > p - window
    s = s.masked_fill(~ok[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, n]; -inf where a row sees nothing
    w = torch.exp(s - lse[..., None].masked_fill(torch.isinf(lse[..., None]), 0.0))
    w = w.masked_fill(~ok[None], 0.0)
    out = torch.einsum("hnl,lhd->nhd", w, vf)
    return out, lse.transpose(0, 1)


def _check_common(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap, k_scale, v_scale):
    P, page, hk, d, dv = V.check_cache(k_cache, v_cache)
    V.check_q(q, k_cache, hk, d)
    V.check_scales(k_scale, v_scale, k_cache, hk)
    V.check_scale_args(scale, window, soft_cap)
    expect_same_device(q=q, k_cache=k_cache, seq_lens=seq_lens, block_tables=block_tables)
    return P, page, hk, d, dv


def prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, *, scale: float, causal: bool = True,
            window: Optional[int] = None, soft_cap: Optional[float] = None, k_scale=None, v_scale=None,
            return_lse: bool = False, acc: torch.dtype = torch.float32):
    """Varlen prefill over the paged cache (also serves ``mixed``: a decode token is q_len 1)."""
    P, page, hk, d, dv = _check_common(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap,
                                       k_scale, v_scale)
    b = V.check_meta(seq_lens, block_tables, q.device)
    V.check_cu(cu_seqlens_q, q.shape[0], b, q.device)
    V.check_values(seq_lens, block_tables, P, page, cu_seqlens_q, q.shape[0])
    T, hq, _ = q.shape
    out = torch.zeros(T, hq, dv, dtype=acc, device=q.device)
    lse = torch.full((T, hq), float("-inf"), dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.cpu().tolist()
    sl = seq_lens.cpu().tolist()
    for i in range(b):
        s0, s1, L = cu[i], cu[i + 1], sl[i]
        if s1 == s0 or L == 0:
            continue
        k = gather_kv(k_cache, block_tables[i], L, k_scale)
        v = gather_kv(v_cache, block_tables[i], L, v_scale)
        pos = torch.arange(L - (s1 - s0), L, device=q.device)
        o, l = attend(q[s0:s1], k, v, pos, scale=scale, causal=causal, window=window, soft_cap=soft_cap, acc=acc)
        out[s0:s1], lse[s0:s1] = o, l.float()
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def mixed(*args, **kw):
    """A batch of prefill chunks and decode tokens: the same computation as ``prefill``."""
    return prefill(*args, **kw)


def decode(q, k_cache, v_cache, seq_lens, block_tables, *, scale: float, window: Optional[int] = None,
           soft_cap: Optional[float] = None, k_scale=None, v_scale=None, return_lse: bool = False,
           workspace=None, acc: torch.dtype = torch.float32):
    """One query token per sequence, at position seq_lens[b] - 1; length 0 gives zeros."""
    P, page, hk, d, dv = _check_common(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap,
                                       k_scale, v_scale)
    b = V.check_meta(seq_lens, block_tables, q.device, batch=q.shape[0])
    V.check_values(seq_lens, block_tables, P, page)
    hq = q.shape[1]
    out = torch.zeros(b, hq, dv, dtype=acc, device=q.device)
    lse = torch.full((b, hq), float("-inf"), dtype=torch.float32, device=q.device)
    for i, L in enumerate(seq_lens.cpu().tolist()):
        if L == 0:
            continue
        k = gather_kv(k_cache, block_tables[i], L, k_scale)
        v = gather_kv(v_cache, block_tables[i], L, v_scale)
        pos = torch.tensor([L - 1], device=q.device)
        o, l = attend(q[i:i + 1], k, v, pos, scale=scale, causal=True, window=window, soft_cap=soft_cap, acc=acc)
        out[i], lse[i] = o[0], l[0].float()
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def merge(o_a, lse_a, o_b, lse_b):
    """Merge two partial attention states over disjoint key sets by their LSE (natural log).

    Returns (o, lse): o = (o_a e^{lse_a} + o_b e^{lse_b}) / e^{lse}, lse = log(e^{lse_a} + e^{lse_b});
    a state with LSE -inf contributes nothing; both -inf gives zeros and -inf.
    """
    expect_tensor("o_a", o_a, ndim=3, dtype=V.Q_DTYPES)
    T, H, D = o_a.shape
    expect_tensor("o_b", o_b, dtype=o_a.dtype, shape=(T, H, D), device=o_a.device)
    expect_tensor("lse_a", lse_a, dtype=torch.float32, shape=(T, H), device=o_a.device)
    expect_tensor("lse_b", lse_b, dtype=torch.float32, shape=(T, H), device=o_a.device)
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe)[..., None]
    wb = torch.exp(lse_b - safe)[..., None]
    o = o_a.float() * wa + o_b.float() * wb
    return o.to(o_a.dtype), lse


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
