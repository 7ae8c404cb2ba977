"""Public attention ops: paged prefill / decode / mixed, the LSE merge, and MLA.

Paged caches are ``[num_pages, page_size, num_kv_heads, head_dim]`` per layer for K and for V
(vLLM's flash-attention layout), page ids int32, ``seq_lens[B]`` int32 counts every key of a
sequence including the new ones. An LSE crossing this API is the natural log in fp32
(FlashInfer's is base 2). Selection and validation as in ``opmap.api.dense``.
"""
from __future__ import annotations

from typing import Optional


from opmap.core.specs import AttentionSpec, MergeSpec
from opmap.core.registry import get as get_backend
from opmap.core.select import BackendError
from opmap.api.dispatch import arch_of, capturing, dt, no_workspace_for, resolve, tensor, workspace as cached_workspace
from opmap.core.contract import expect_tensor
from opmap.ops.attention.validate import FP8, Q_DTYPES


def _spec(q, k_cache, v_cache, phase, window, soft_cap, return_lse, batch_invariant=False):
    tensor("q", q, 3)
    tensor("k_cache", k_cache, 4)
    tensor("v_cache", v_cache, 4)
    # dtypes before they make the spec: an InputError naming the argument, not the spec's ValueError
    expect_tensor("q", q, dtype=Q_DTYPES)
    expect_tensor("k_cache", k_cache, dtype=Q_DTYPES + (FP8,))
    return AttentionSpec(arch=arch_of(q), phase=phase, num_heads=q.shape[1], num_kv_heads=k_cache.shape[2],
                           head_dim=q.shape[2], head_dim_v=v_cache.shape[3], page_size=k_cache.shape[1],
                           dtype=dt(q), kv_dtype=dt(k_cache), sliding_window=window is not None,
                           soft_cap=soft_cap is not None, return_lse=return_lse, cuda_graph=capturing(),
                           batch_invariant=batch_invariant)


def _prefill_like(entry, phase, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, causal, window,
                  soft_cap, k_scale, v_scale, return_lse, backend):
    spec = _spec(q, k_cache, v_cache, phase, window, soft_cap, return_lse)
    _, fn = resolve("attention", spec, entry, backend)
    return fn(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale=scale, causal=causal, window=window,
              soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)


def attention_prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale: float, *,
                      causal: bool = True, window: Optional[int] = None, soft_cap: Optional[float] = None,
                      k_scale=None, v_scale=None, return_lse: bool = False, backend: Optional[str] = None):
    """Varlen paged prefill: q[T, Hq, D] holds the last ``cu_seqlens_q[b+1] - cu_seqlens_q[b]``
    tokens of each sequence b (bottom-right causal alignment) -> out[T, Hq, Dv] (or (out, lse[T, Hq])).
    ``window`` W: the query at position p sees keys in (p - W, p]; ``soft_cap`` c: scores
    c * tanh(s / c); fp8-e4m3 caches take k_scale[Hk], v_scale[Hk] fp32."""
    return _prefill_like("prefill", "prefill", q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                         causal, window, soft_cap, k_scale, v_scale, return_lse, backend)


def attention_mixed(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale: float, *,
                    causal: bool = True, window: Optional[int] = None, soft_cap: Optional[float] = None,
                    k_scale=None, v_scale=None, return_lse: bool = False, backend: Optional[str] = None):
    """A batch mixing prefill chunks and decode tokens; arguments as ``attention_prefill``."""
    return _prefill_like("mixed", "mixed", q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                         causal, window, soft_cap, k_scale, v_scale, return_lse, backend)


def attention_decode(q, k_cache, v_cache, seq_lens, block_tables, scale: float, *, window: Optional[int] = None,
                     soft_cap: Optional[float] = None, k_scale=None, v_scale=None, return_lse: bool = False,
                     workspace=None, backend: Optional[str] = None):
    """One query token per sequence: q[B, Hq, D] at position seq_lens[b] - 1 -> out[B, Hq, Dv]
    (or (out, lse[B, Hq])); a sequence of length 0 gives zeros. Without ``workspace`` the split-KV
    partials come from a workspace cached per device, stream and batch bucket (``dispatch.workspace``),
    so the launch is the engine's; a caller that wants fixed (batch-invariant) splits passes its
    own from ``make_decode_workspace``."""
    inv = bool(workspace is not None and getattr(workspace, "split_tokens", 0))
    spec = _spec(q, k_cache, v_cache, "decode", window, soft_cap, return_lse, inv)
    b, fn = resolve("attention", spec, "decode", backend)
    no_workspace_for(b, workspace)
    kw = {}
    if workspace is None:
        B, hq, dv = q.shape[0], q.shape[1], v_cache.shape[3]
        workspace = cached_workspace(b, lambda rows: (rows, hq, dv), B, q.device, hq, dv)
    if workspace is not None:
        kw["workspace"] = workspace
    return fn(q, k_cache, v_cache, seq_lens, block_tables, scale=scale, window=window, soft_cap=soft_cap,
              k_scale=k_scale, v_scale=v_scale, return_lse=return_lse, **kw)


def make_decode_workspace(max_batch: int, num_heads: int, head_dim_v: int, *, device, backend: str = "triton",
                          **kw):
    """A persistent split-KV workspace for ``attention_decode`` (allocate before CUDA-graph
    capture; ``batch_invariant=True, max_seq_len=...`` fixes the split size in tokens)."""
    b = get_backend("attention", backend)
    if "make_workspace" not in b.impl:
        raise BackendError(f"attention: backend {backend!r} has no workspace")
    return b.fn("make_workspace")(max_batch, num_heads, head_dim_v, device=device, **kw)


def attention_merge(o_a, lse_a, o_b, lse_b, *, backend: Optional[str] = None, phase: str = "prefill"):
    """Merge two partial attentions over disjoint key sets by their LSEs (natural log, fp32):
    o[T, H, D], lse[T, H] each -> (o, lse)."""
    tensor("o_a", o_a, 3)
    spec = MergeSpec(arch=arch_of(o_a), phase=phase, num_heads=o_a.shape[1], head_dim=o_a.shape[2],
                       dtype=dt(o_a))
    return resolve("attention_merge", spec, "merge", backend)[1](o_a, lse_a, o_b, lse_b)


def _mla_spec(q_nope, q_pe, cache, phase, sparse=False, rank_from_cache=False):
    tensor("q_nope", q_nope, 3)
    tensor("q_pe", q_pe, 3)
    tensor("cache", cache, 3)
    expect_tensor("q_nope", q_nope, dtype=Q_DTYPES)
    expect_tensor("cache", cache, dtype=Q_DTYPES + (FP8,))
    R = cache.shape[2] - q_pe.shape[2] if rank_from_cache else q_nope.shape[2]  # prefill: q_nope is [T, H, Dn]
    return AttentionSpec(arch=arch_of(q_nope), phase=phase, kind="mla", num_heads=q_nope.shape[1],
                           num_kv_heads=1, head_dim=R + q_pe.shape[2], head_dim_v=R, page_size=cache.shape[1],
                           dtype=dt(q_nope), kv_dtype=dt(cache), sparse=sparse, cuda_graph=capturing())


def mla_decode(q_nope, q_pe, cache, seq_lens, block_tables, scale: float, *, kv_scale=None,
               return_lse: bool = False, workspace=None, backend: Optional[str] = None):
    """Absorbed MLA decode: q_nope[B, H, R] (the latent query), q_pe[B, H, Dr], cache[pages,
    page_size, R + Dr] (latent then rope part; fp8-e4m3 with a scalar kv_scale) -> out[B, H, R]
    in the latent space (or (out, lse))."""
    b, fn = resolve("attention", _mla_spec(q_nope, q_pe, cache, "decode"), "mla_decode", backend)
    no_workspace_for(b, workspace)
    kw = {"workspace": workspace} if workspace is not None else {}
    return fn(q_nope, q_pe, cache, seq_lens, block_tables, scale=scale, kv_scale=kv_scale, return_lse=return_lse,
              **kw)


def mla_sparse_decode(q_nope, q_pe, cache, seq_lens, block_tables, indices, scale: float, *, kv_scale=None,
                      return_lse: bool = False, workspace=None, backend: Optional[str] = None):
    """MLA decode over the token positions ``indices[B, k]`` int32 of each sequence (-1 = none)."""
    b, fn = resolve("attention", _mla_spec(q_nope, q_pe, cache, "decode", sparse=True), "mla_sparse_decode",
                    backend)
    no_workspace_for(b, workspace)
    kw = {"workspace": workspace} if workspace is not None else {}
    return fn(q_nope, q_pe, cache, seq_lens, block_tables, indices, scale=scale, kv_scale=kv_scale,
              return_lse=return_lse, **kw)


def mla_prefill(q_nope, q_pe, cache, w_kc, w_vc, cu_seqlens_q, seq_lens, block_tables, scale: float, *,
                kv_scale=None, causal: bool = True, return_lse: bool = False, backend: Optional[str] = None):
    """MLA prefill in the non-absorbed form: q_nope[T, H, Dn], q_pe[T, H, Dr], the latent cache,
    w_kc[H, Dn, R] and w_vc[H, Dv, R] (``opmap.ops.mla.reference.split_kv_b``) -> out[T, H, Dv]."""
    spec = _mla_spec(q_nope, q_pe, cache, "prefill", rank_from_cache=True)
    return resolve("attention", spec, "mla_prefill", backend)[1](
        q_nope, q_pe, cache, w_kc, w_vc, cu_seqlens_q, seq_lens, block_tables, scale=scale, kv_scale=kv_scale,
        causal=causal, return_lse=return_lse)
