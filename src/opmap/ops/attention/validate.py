"""Input checks shared by every attention / KV-append launcher (reference, Triton, peers).

Shape, dtype and device checks are free and always run. Checks on the *values* of the step
metadata (page ids inside the cache, lengths within the pages a sequence owns, cu_seqlens
consistent with seq_lens) need the data on the host: on a CUDA device that is a
synchronisation, so they are skipped while a CUDA graph is being captured and memoised per
(tensor, version) so that the 32+ layers of one step pay for them once. Set
``OPMAP_CHECK_VALUES=0`` to skip them entirely (benchmarks of a trusted engine).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from opmap.core.contract import (InputError, dtype_name, expect, expect_same_device, expect_tensor, value_check_passed,
                         value_check_seen, values_wanted)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
Q_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32,)

def check_cache(k_cache, v_cache, *, page_sizes: Optional[Sequence[int]] = None,
                head_dims: Optional[Sequence[int]] = None):
    """[num_pages, page_size, num_kv_heads, head_dim] NHD caches; returns (P, page, Hk, D, Dv)."""
    expect_tensor("k_cache", k_cache, ndim=4, dtype=Q_DTYPES + (FP8,), contiguous=True)
    expect_tensor("v_cache", v_cache, ndim=4, dtype=k_cache.dtype, contiguous=True)
    expect_same_device(k_cache=k_cache, v_cache=v_cache)
    P, page, hk, d = k_cache.shape
    expect(tuple(v_cache.shape[:3]) == (P, page, hk), "v_cache", f"shape {tuple(v_cache.shape)}",
           f"shape ({P}, {page}, {hk}, *) like k_cache")
    if page_sizes is not None:
        expect(page in page_sizes, "k_cache", f"page_size {page}", f"one of {tuple(page_sizes)}")
    if head_dims is not None:
        expect(d in head_dims, "k_cache", f"head_dim {d}", f"one of {tuple(head_dims)}")
        expect(v_cache.shape[3] == d, "v_cache", f"head_dim {v_cache.shape[3]}", f"{d} (same as k_cache)")
    return P, page, hk, d, v_cache.shape[3]


def check_scales(k_scale, v_scale, k_cache, num_kv_heads: int):
    """fp8 caches need per-kv-head fp32 scales; other caches take none."""
    if k_cache.dtype == FP8:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            expect(s is not None, name, "None", f"a float32 tensor [{num_kv_heads}] for an fp8 cache")
            expect_tensor(name, s, dtype=torch.float32, shape=(num_kv_heads,), device=k_cache.device,
                          contiguous=True)
    else:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            expect(s is None, name, "a tensor", f"None (cache dtype {dtype_name(k_cache.dtype)} is not fp8)")


def check_q(q, k_cache, num_kv_heads: int, head_dim: int, *, name: str = "q"):
    expect_tensor(name, q, ndim=3, dtype=Q_DTYPES, device=k_cache.device, last_dim_contiguous=True)
    expect(q.shape[2] == head_dim, name, f"head_dim {q.shape[2]}", f"{head_dim} (the cache's)")
    hq = q.shape[1]
    expect(hq % num_kv_heads == 0, name, f"{hq} heads", f"a multiple of num_kv_heads={num_kv_heads}")
    if k_cache.dtype != FP8:
        expect(k_cache.dtype == q.dtype, "k_cache", f"dtype {dtype_name(k_cache.dtype)}",
               f"{dtype_name(q.dtype)} (the query's) or fp8")
    return hq


def check_meta(seq_lens, block_tables, device, batch: Optional[int] = None):
    expect_tensor("seq_lens", seq_lens, ndim=1, dtype=INDEX_DTYPES, device=device, contiguous=True)
    b = seq_lens.shape[0] if batch is None else batch
    expect(seq_lens.shape[0] == b, "seq_lens", f"shape {tuple(seq_lens.shape)}", f"shape ({b},)")
    expect_tensor("block_tables", block_tables, ndim=2, dtype=INDEX_DTYPES, device=device,
                  last_dim_contiguous=True)
    expect(block_tables.shape[0] == b, "block_tables", f"{block_tables.shape[0]} rows", f"{b} (batch)")
    return b


def check_cu(cu_seqlens_q, num_tokens: int, batch: int, device):
    expect_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtype=INDEX_DTYPES, device=device,
                  shape=(batch + 1,), contiguous=True)


def check_scale_args(scale, window, soft_cap):
    expect(isinstance(scale, (int, float)) and scale > 0, "scale", repr(scale), "a positive float")
    expect(window is None or (isinstance(window, int) and window > 0), "window", repr(window),
           "None or a positive int")
    expect(soft_cap is None or (isinstance(soft_cap, (int, float)) and soft_cap > 0), "soft_cap",
           repr(soft_cap), "None or a positive float")


def check_values(seq_lens, block_tables, num_pages: int, page_size: int, cu_seqlens_q=None,
                 num_tokens: Optional[int] = None) -> None:
    """Page ids inside the cache and lengths within the pages owned (data-dependent)."""
    if not values_wanted(seq_lens, block_tables, cu_seqlens_q):
        return
    memo = ("meta", seq_lens, block_tables, cu_seqlens_q, num_pages, page_size, num_tokens)
    if value_check_seen(*memo):
        return
    sl = seq_lens.cpu().long()
    bt = block_tables.cpu().long()
    if (sl < 0).any():
        b = int((sl < 0).nonzero()[0])
        raise InputError("seq_lens", f"seq_lens[{b}]={int(sl[b])}", ">= 0")
    cap = bt.shape[1] * page_size
    if (sl > cap).any():
        b = int((sl > cap).nonzero()[0])
        raise InputError("seq_lens", f"seq_lens[{b}]={int(sl[b])}",
                         f"<= {cap} (block_tables has {bt.shape[1]} pages of {page_size} per sequence)")
    # Only the pages a sequence uses must be valid ids; the rest of the row is padding.
    used = torch.arange(bt.shape[1])[None, :] < ((sl + page_size - 1) // page_size)[:, None]
    bad = used & ((bt < 0) | (bt >= num_pages))
    if bad.any():
        b, i = (int(x) for x in bad.nonzero()[0])
        raise InputError("block_tables", f"block_tables[{b}, {i}]={int(bt[b, i])}",
                         f"a page id in [0, {num_pages}) for the {int(sl[b])} tokens of sequence {b}")
    if cu_seqlens_q is not None:
        cu = cu_seqlens_q.cpu().long()
        ql = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or (ql < 0).any() or int(cu[-1]) != num_tokens:
            raise InputError("cu_seqlens_q", f"{cu.tolist()[:8]}{'...' if len(cu) > 8 else ''}",
                             f"non-decreasing from 0 to {num_tokens} (the number of query tokens)")
        if (ql > sl).any():
            b = int((ql > sl).nonzero()[0])
            raise InputError("seq_lens", f"seq_lens[{b}]={int(sl[b])} < {int(ql[b])} query tokens",
                             "seq_lens to include the new tokens (append before attention)")
    value_check_passed(*memo)


def check_slots(slot_mapping, num_tokens: int, num_slots: int) -> None:
    expect_tensor("slot_mapping", slot_mapping, ndim=1, dtype=(torch.int32, torch.int64),
                  shape=(num_tokens,), contiguous=True)
    if not values_wanted(slot_mapping) or value_check_seen("slots", slot_mapping, num_slots):
        return
    s = slot_mapping.cpu().long()
    bad = (s < -1) | (s >= num_slots)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise InputError("slot_mapping", f"slot_mapping[{i}]={int(s[i])}",
                         f"-1 (skip) or a slot in [0, {num_slots}) (num_pages * page_size)")
    value_check_passed("slots", slot_mapping, num_slots)


def check_qk_norm_arg(qk_norm, q):
    """``qk_norm``: None or (w_q [D], w_k [D], eps), Qwen3's per-head norms of q and k."""
    if qk_norm is None:
        return None
    expect(isinstance(qk_norm, tuple) and len(qk_norm) == 3, "qk_norm", type(qk_norm).__name__,
           "None or a tuple (w_q, w_k, eps)")
    w_q, w_k, eps = qk_norm
    D = q.shape[2]
    for name, w in (("w_q", w_q), ("w_k", w_k)):
        expect_tensor(name, w, dtype=(q.dtype, torch.float32), ndim=1, shape=(D,), device=q.device)
    expect(isinstance(eps, (float, int)) and eps >= 0, "eps", repr(eps), "a float >= 0")
    return w_q, w_k, float(eps)
