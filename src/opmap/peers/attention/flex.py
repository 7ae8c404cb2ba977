"""FlexAttention peer over the *paged* cache, behind opmap's entry signature.

The whole cache is one KV sequence of num_pages * page_size tokens ([1, Hk, P*page, D], a view,
no copy) and all query tokens of the batch are one query sequence. A block mask maps each query
token to the pages of its own sequence through an inverse page table (per sequence: physical
page -> logical page or -1, so shared pages work), and applies bottom-right causal alignment and
the sliding window; the soft-cap is a score_mod. FlexAttention returns the LSE in natural log
(checked in the tests). Flex needs torch.compile to be fast on a GPU: the compiled function is
built once per process (it recompiles per shape). On the CPU it runs eagerly (tests only).
"""
from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from opmap.core.contract import InputError, expect
from opmap.ops.attention import validate as V


@functools.lru_cache(maxsize=None)
def _flex_fn(device_type: str):
    if device_type == "cuda":
        # heavy: dynamo (it loads sympy and Triton), on the compiled CUDA path only
        import torch._dynamo.config as dc

        # Each call brings its own block mask (a new mask_mod closure over that step's tables) and
        # each benchmark shape recompiles; past dynamo's default limit of 8 it would silently fall
        # back to eager flex, which materialises the whole score matrix.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dc, name):
                setattr(dc, name, max(getattr(dc, name), 128))
        if hasattr(dc, "accumulated_recompile_limit"):
            dc.accumulated_recompile_limit = max(dc.accumulated_recompile_limit, 1024)
        return torch.compile(flex_attention, dynamic=False)
    return flex_attention


def _inverse_pages(seq_lens, block_tables, num_pages: int, page: int):
    """[B, P] int32: logical page index of each physical page for each sequence, -1 if not its page."""
    B, M = block_tables.shape
    used = torch.arange(M, device=seq_lens.device)[None, :] < ((seq_lens + page - 1) // page)[:, None]
    idx = torch.where(used, block_tables.long(), num_pages)  # unused columns go to a spill column
    inv = torch.full((B, num_pages + 1), -1, dtype=torch.int32, device=seq_lens.device)
    inv.scatter_(1, idx, torch.arange(M, dtype=torch.int32, device=seq_lens.device).expand(B, M).contiguous())
    return inv[:, :num_pages].contiguous()


def _check_distinct_pages(seq_lens, block_tables, page: int):
    """The inverse page table maps a physical page to one position per sequence: a page listed
    twice in one sequence's used pages cannot be represented, so it is refused (a host sync;
    this adapter is eager-only anyway)."""
    B, M = block_tables.shape
    if B == 0 or M < 2:
        return
    col = torch.arange(M, device=block_tables.device)
    used = col[None, :] < ((seq_lens.long() + page - 1) // page)[:, None]
    ids = torch.where(used, block_tables.long(), -1 - col[None, :])  # unused: distinct negatives
    srt = ids.sort(dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if bool(dup.any()):
        b, i = (int(x) for x in dup.nonzero()[0])
        raise InputError("block_tables", f"page {int(srt[b, i + 1])} listed twice for sequence {b}",
                         "distinct pages within one sequence (the flex adapter maps a page to one position)")


def _run(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, *, scale, causal, window, soft_cap,
         k_scale, v_scale, return_lse):
    P, page, hk, d, dv = V.check_cache(k_cache, v_cache)
    V.check_q(q, k_cache, hk, d)
    expect(k_cache.dtype != V.FP8, "k_cache", "fp8", "the query's dtype (the flex adapter takes no fp8 KV)")
    V.check_scales(k_scale, v_scale, k_cache, hk)
    V.check_scale_args(scale, window, soft_cap)
    B = V.check_meta(seq_lens, block_tables, q.device)
    V.check_cu(cu_seqlens_q, q.shape[0], B, q.device)
    V.check_values(seq_lens, block_tables, P, page, cu_seqlens_q, q.shape[0])
    _check_distinct_pages(seq_lens, block_tables, page)
    T, hq, _ = q.shape
    if T == 0:
        out = q.new_empty(0, hq, dv)
        return (out, torch.empty(0, hq, dtype=torch.float32, device=q.device)) if return_lse else out
    dev = q.device
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    seq_of = torch.repeat_interleave(torch.arange(B, device=dev), q_lens, output_size=T)
    tok = torch.arange(T, device=dev)
    qpos = seq_lens.long()[seq_of] - q_lens[seq_of] + (tok - cu_seqlens_q.long()[seq_of])
    inv = _inverse_pages(seq_lens, block_tables, P, page)
    lens = seq_lens.long()

    def mask_mod(b, h, qi, kv):
        s = seq_of[qi]
        lp = inv[s, kv // page]
        pos = lp * page + kv % page
        ok = (lp >= 0) & (pos < lens[s])
        if causal:
            ok = ok & (pos <= qpos[qi])
        if window is not None:
            ok = ok & (pos > qpos[qi] - window)
        return ok

    cap = float(soft_cap) if soft_cap is not None else None

    def capped(score, b, h, qi, kv):
        return cap * torch.tanh(score / cap)

    score_mod = capped if cap is not None else None

    KV = P * page
    bm = create_block_mask(mask_mod, 1, None, T, KV, device=dev)
    Q = q.transpose(0, 1).unsqueeze(0)
    K = k_cache.view(1, KV, hk, d).transpose(1, 2)
    Vv = v_cache.view(1, KV, hk, dv).transpose(1, 2)
    out, lse = _flex_fn(dev.type)(Q, K, Vv, score_mod=score_mod, block_mask=bm, scale=float(scale),
                                   enable_gqa=hq != hk, return_lse=True)
    out = out[0].transpose(0, 1).contiguous()
    return (out, lse[0].transpose(0, 1).float().contiguous()) if return_lse else out


def prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, *, scale, causal=True, window=None,
            soft_cap=None, k_scale=None, v_scale=None, return_lse=False):
    return _run(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale=scale, causal=causal,
                window=window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)


mixed = prefill


def decode(q, k_cache, v_cache, seq_lens, block_tables, *, scale, window=None, soft_cap=None, k_scale=None,
           v_scale=None, return_lse=False, workspace=None):
    expect(seq_lens.dim() == 1 and seq_lens.shape[0] == q.shape[0], "seq_lens", f"shape {tuple(seq_lens.shape)}",
           f"({q.shape[0]},) (one per query row)")
    # A decode token is a query of length 1; a sequence of length 0 gets no token (zeros, LSE -inf).
    cu = torch.zeros(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    cu[1:] = torch.cumsum((seq_lens > 0).int(), 0)
    keep = seq_lens > 0
    res = _run(q[keep] if not bool(keep.all()) else q, k_cache, v_cache, cu, seq_lens, block_tables, scale=scale,
               causal=True, window=window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
               return_lse=return_lse)
    if bool(keep.all()):
        return res
    out = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[3])
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    if return_lse:
        out[keep], lse[keep] = res
        return out, lse
    out[keep] = res
    return out
