"""FlashInfer peer (paged, NHD) behind opmap's entry signature.

FlashInfer is optional: where it is not installed it can travel as a trimmed package with modules
built ahead of time (scripts/flashinfer/). The backend is registered with ``available=package_available("flashinfer")`` so that
the matrix shows it and the selector says why it is not chosen where it is missing. This adapter
follows the FlashInfer 0.7 wrapper API: a plan, which synchronises (hence no CUDA graphs through
it), made once per set of metadata tensors and reused while they are unchanged (``_planned``: the
layers of an engine step plan once); on the H200 it passed opmap check's FlashInfer cases.
Conventions bridged here: FlashInfer's LSE is base 2 (converted to natural log); its
``window_left`` counts the keys left of the query (opmap's window W sees W keys including the
query: window_left = W - 1); the soft-cap is ``logits_soft_cap``.
"""
from __future__ import annotations

import functools

import torch

from opmap.core.contract import TensorMemo, expect
from opmap.ops.attention import validate as V

LN2 = 0.6931471805599453


@functools.lru_cache(maxsize=None)
def plan_workspace(device: str, kind: str) -> torch.Tensor:
    """One per device and wrapper kind: a planned wrapper keeps its schedule in its workspace, so
    the prefill and decode plans held by ``_planned`` must not share one."""
    return torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)


# One live plan per wrapper kind (its workspace holds the schedule): the wrapper planned for the
# metadata tensors and arguments of the last call of that kind.
_PLANS = {"prefill": TensorMemo(1), "decode": TensorMemo(1)}


def _planned(kind: str, tensors: tuple, args: tuple, make):
    """The wrapper planned for exactly these metadata tensors (same objects, same versions) and
    arguments, else ``make()``'s, remembered. FlashInfer's plan copies the page table offsets to
    the host (a synchronisation), and the layers of one engine step share their metadata: the
    first layer plans, the others reuse it. An in-place rewrite of the metadata (the next step)
    bumps the tensors' versions and so plans again."""
    memo, items = _PLANS[kind], (*tensors, *args)
    w = memo.get(items)
    if w is None:
        w = make()
        memo.put(items, w)
    return w


def paged_meta(seq_lens, block_tables, page: int):
    n_pages = (seq_lens.long() + page - 1) // page
    indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    indptr[1:] = torch.cumsum(n_pages, 0)
    used = torch.arange(block_tables.shape[1], device=seq_lens.device)[None, :] < n_pages[:, None]
    indices = block_tables[used].to(torch.int32)
    last = torch.where(n_pages > 0, seq_lens.long() - (n_pages - 1) * page, 0).to(torch.int32)
    return indptr, indices, last


def _common(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap, k_scale, v_scale):
    P, page, hk, d, dv = V.check_cache(k_cache, v_cache)
    V.check_q(q, k_cache, hk, d)
    expect(k_cache.dtype != V.FP8, "k_cache", "fp8", "bf16/fp16 (FlashInfer takes one scalar scale per cache)")
    V.check_scales(k_scale, v_scale, k_cache, hk)
    V.check_scale_args(scale, window, soft_cap)
    return P, page, hk, d


def prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, *, scale, causal=True, window=None,
            soft_cap=None, k_scale=None, v_scale=None, return_lse=False):
    # optional: flashinfer
    import flashinfer

    P, page, hk, d = _common(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap, k_scale, v_scale)
    B = V.check_meta(seq_lens, block_tables, q.device)
    V.check_cu(cu_seqlens_q, q.shape[0], B, q.device)
    V.check_values(seq_lens, block_tables, P, page, cu_seqlens_q, q.shape[0])

    def make():
        indptr, indices, last = paged_meta(seq_lens, block_tables, page)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(plan_workspace(str(q.device), "prefill"), kv_layout="NHD")
        w.plan(cu_seqlens_q, indptr, indices, last, q.shape[1], hk, d, page, causal=causal, pos_encoding_mode="NONE",
               window_left=(window - 1) if window else -1, logits_soft_cap=soft_cap, sm_scale=float(scale),
               q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        return w

    w = _planned("prefill", (cu_seqlens_q, seq_lens, block_tables),
                 (q.shape[1], hk, d, page, causal, window, soft_cap, float(scale), q.dtype, k_cache.dtype), make)
    out, lse = w.run(q, (k_cache, v_cache), return_lse=True)
    return (out, lse.float() * LN2) if return_lse else out


def decode(q, k_cache, v_cache, seq_lens, block_tables, *, scale, window=None, soft_cap=None, k_scale=None,
           v_scale=None, return_lse=False, workspace=None):
    # optional: flashinfer
    import flashinfer

    P, page, hk, d = _common(q, k_cache, v_cache, seq_lens, block_tables, scale, window, soft_cap, k_scale, v_scale)
    V.check_meta(seq_lens, block_tables, q.device, batch=q.shape[0])
    V.check_values(seq_lens, block_tables, P, page)

    def make():
        indptr, indices, last = paged_meta(seq_lens, block_tables, page)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(plan_workspace(str(q.device), "decode"), kv_layout="NHD",
                                                          use_tensor_cores=True)
        w.plan(indptr, indices, last, q.shape[1], hk, d, page, pos_encoding_mode="NONE",
               window_left=(window - 1) if window else -1, logits_soft_cap=soft_cap, q_data_type=q.dtype,
               kv_data_type=k_cache.dtype, sm_scale=float(scale))
        return w

    w = _planned("decode", (seq_lens, block_tables),
                 (q.shape[0], q.shape[1], hk, d, page, window, soft_cap, float(scale), q.dtype, k_cache.dtype), make)
    out, lse = w.run(q, (k_cache, v_cache), return_lse=True)
    return (out, lse.float() * LN2) if return_lse else out
