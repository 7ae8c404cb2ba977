"""The public ops as ``torch.library`` custom ops (namespace ``opmap``) with fake implementations,
so they trace under ``torch.compile(fullgraph=True)`` and capture in CUDA graphs. Each calls the
``opmap.api`` function of the same name (the selector's backend; ``backend`` forces one). The
schemas fix what a Python signature leaves open: attention ops always return (out, lse); the
MLA ``kv_scale`` is an optional [1] fp32 tensor; workspaces stay with the Python API."""
from __future__ import annotations

from typing import Optional

import torch

from opmap.api import attention as A, dense as D, sampling as S

Tensor, Opt, Str = torch.Tensor, Optional[torch.Tensor], Optional[str]


def _op(name: str, mutates=()):
    return lambda fn: torch.library.custom_op(f"opmap::{name}", fn, mutates_args=mutates)


def _none(*args, **kw):
    return None


# ---- dense --------------------------------------------------------------------------------------
@_op("rmsnorm")
def rmsnorm(x: Tensor, weight: Tensor, eps: float, backend: Str = None) -> Tensor:
    return D.rmsnorm(x, weight, eps, backend=backend)


@_op("add_rmsnorm", ("residual",))
def add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, backend: Str = None) -> Tensor:
    return D.add_rmsnorm(x, residual, weight, eps, backend=backend)


@_op("qk_rmsnorm", ("qk",))
def qk_rmsnorm(qk: Tensor, w_q: Tensor, w_k: Tensor, num_q_heads: int, eps: float, backend: Str = None) -> None:
    D.qk_rmsnorm(qk, w_q, w_k, num_q_heads, eps, backend=backend)


@_op("rope", ("q", "k"))
def rope(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, style: str, backend: Str = None) -> None:
    D.rope(q, k, positions, cos_sin, style, backend=backend)


@_op("paged_kv_append", ("k_cache", "v_cache"))
def paged_kv_append(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                    k_scale: Opt = None, v_scale: Opt = None, backend: Str = None) -> None:
    D.kv_append(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, backend=backend)


@_op("rope_append", ("q", "k", "k_cache", "v_cache"))
def rope_append(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin: Tensor, style: str, k_cache: Tensor,
                v_cache: Tensor, slot_mapping: Tensor, k_scale: Opt = None, v_scale: Opt = None,
                backend: Str = None) -> None:
    D.rope_append(q, k, v, positions, cos_sin, style, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                  backend=backend)


@_op("append_mla", ("cache",))
def append_mla(ckv: Tensor, kpe: Tensor, cache: Tensor, slot_mapping: Tensor, kv_scale: Opt = None,
               backend: Str = None) -> None:
    D.append_mla(ckv, kpe, cache, slot_mapping, kv_scale, backend=backend)


@_op("silu_mul")
def silu_mul(x: Tensor, backend: Str = None) -> Tensor:
    return D.silu_mul(x, backend=backend)


@_op("gelu_tanh_mul")
def gelu_tanh_mul(x: Tensor, backend: Str = None) -> Tensor:
    return D.gelu_tanh_mul(x, backend=backend)


@_op("linear")
def linear(x: Tensor, w: Tensor, bias: Opt = None, w_scale: Opt = None, w_zero: Opt = None,
           backend: Str = None) -> Tensor:
    return D.linear(x, w, bias, w_scale, w_zero, backend=backend)


@_op("moe_route")
def moe_route(router_logits: Tensor, top_k: int, router: str = "softmax", renormalize: bool = True, n_group: int = 1,
              topk_group: int = 1, routed_scaling: float = 1.0, score_bias: Opt = None,
              backend: Str = None) -> tuple[Tensor, Tensor]:
    return D.moe_route(router_logits, top_k, router=router, renormalize=renormalize, n_group=n_group,
                       topk_group=topk_group, routed_scaling=routed_scaling, score_bias=score_bias, backend=backend)


@_op("moe")
def moe(x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int, router: str = "softmax",
        renormalize: bool = True, n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
        score_bias: Opt = None, backend: Str = None, w13_scale: Opt = None, w2_scale: Opt = None,
        w13_zero: Opt = None, w2_zero: Opt = None) -> Tensor:
    return D.moe(x, router_logits, w13, w2, top_k, router=router, renormalize=renormalize, n_group=n_group,
                 topk_group=topk_group, routed_scaling=routed_scaling, score_bias=score_bias, backend=backend,
                 w13_scale=w13_scale, w2_scale=w2_scale, w13_zero=w13_zero, w2_zero=w2_zero)


# ---- attention ----------------------------------------------------------------------------------
def _varlen(name: str, fn):
    """The custom op of a varlen paged entry (prefill, mixed: one signature)."""
    def op(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor, block_tables: Tensor,
           scale: float, causal: bool = True, window: Optional[int] = None, soft_cap: Optional[float] = None,
           k_scale: Opt = None, v_scale: Opt = None, backend: Str = None) -> tuple[Tensor, Tensor]:
        return fn(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, causal=causal, window=window,
                  soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, return_lse=True, backend=backend)

    op.__name__ = op.__qualname__ = name
    return _op(name)(op)


attention_prefill = _varlen("attention_prefill", A.attention_prefill)
attention_mixed = _varlen("attention_mixed", A.attention_mixed)


@_op("attention_decode")
def attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, block_tables: Tensor,
                     scale: float, window: Optional[int] = None, soft_cap: Optional[float] = None,
                     k_scale: Opt = None, v_scale: Opt = None, backend: Str = None) -> tuple[Tensor, Tensor]:
    return A.attention_decode(q, k_cache, v_cache, seq_lens, block_tables, scale, window=window, soft_cap=soft_cap,
                              k_scale=k_scale, v_scale=v_scale, return_lse=True, backend=backend)


@_op("attention_merge")
def attention_merge(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor,
                    backend: Str = None) -> tuple[Tensor, Tensor]:
    return A.attention_merge(o_a, lse_a, o_b, lse_b, backend=backend)


@_op("mla_decode")
def mla_decode(q_nope: Tensor, q_pe: Tensor, cache: Tensor, seq_lens: Tensor, block_tables: Tensor, scale: float,
               kv_scale: Opt = None, backend: Str = None) -> tuple[Tensor, Tensor]:
    return A.mla_decode(q_nope, q_pe, cache, seq_lens, block_tables, scale, kv_scale=kv_scale, return_lse=True,
                        backend=backend)


@_op("mla_sparse_decode")
def mla_sparse_decode(q_nope: Tensor, q_pe: Tensor, cache: Tensor, seq_lens: Tensor, block_tables: Tensor,
                      indices: Tensor, scale: float, kv_scale: Opt = None,
                      backend: Str = None) -> tuple[Tensor, Tensor]:
    return A.mla_sparse_decode(q_nope, q_pe, cache, seq_lens, block_tables, indices, scale, kv_scale=kv_scale,
                               return_lse=True, backend=backend)


@_op("mla_prefill")
def mla_prefill(q_nope: Tensor, q_pe: Tensor, cache: Tensor, w_kc: Tensor, w_vc: Tensor, cu_seqlens_q: Tensor,
                seq_lens: Tensor, block_tables: Tensor, scale: float, kv_scale: Opt = None, causal: bool = True,
                backend: Str = None) -> tuple[Tensor, Tensor]:
    return A.mla_prefill(q_nope, q_pe, cache, w_kc, w_vc, cu_seqlens_q, seq_lens, block_tables, scale,
                         kv_scale=kv_scale, causal=causal, return_lse=True, backend=backend)


# ---- sampler ------------------------------------------------------------------------------------
@_op("apply_penalties", ("logits",))
def apply_penalties(logits: Tensor, prompt_mask: Tensor, output_counts: Tensor, repetition: Tensor,
                    frequency: Tensor, presence: Tensor, backend: Str = None) -> None:
    S.apply_penalties(logits, prompt_mask, output_counts, repetition, frequency, presence, backend=backend)


@_op("apply_temperature", ("logits",))
def apply_temperature(logits: Tensor, temperature: Tensor, backend: Str = None) -> None:
    S.apply_temperature(logits, temperature, backend=backend)


@_op("sample")
def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, seeds: Tensor,
           positions: Tensor, backend: Str = None) -> tuple[Tensor, Tensor]:
    return S.sample(logits, temperature, top_k, top_p, min_p, seeds, positions, backend=backend)


@_op("apply_bitmask", ("logits",))
def apply_bitmask(logits: Tensor, bitmask: Tensor, rows: Opt = None, backend: Str = None) -> None:
    S.apply_bitmask(logits, bitmask, rows, backend=backend)


# ---- fakes --------------------------------------------------------------------------------------
def _like(x, *a, **k):
    return torch.empty_like(x)


def _half(x, backend=None):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _with_lse(width_of):
    def fake(*args, **kw):
        q = args[0]
        T, H = q.shape[0], q.shape[1]
        return q.new_empty((T, H, width_of(*args))), q.new_empty((T, H), dtype=torch.float32)
    return fake


for _o, _f in ((rmsnorm, _like), (add_rmsnorm, _like), (silu_mul, _half), (gelu_tanh_mul, _half)):
    _o.register_fake(_f)
for _o in (qk_rmsnorm, rope, paged_kv_append, rope_append, append_mla, apply_penalties, apply_temperature,
           apply_bitmask):
    _o.register_fake(_none)
linear.register_fake(lambda x, w, bias=None, w_scale=None, w_zero=None, backend=None:
                     x.new_empty((x.shape[0], w.shape[0])))
moe.register_fake(lambda x, *a, **k: torch.empty_like(x))
moe_route.register_fake(lambda logits, top_k, *a, **k: (logits.new_empty((logits.shape[0], top_k), dtype=torch.float32),
                                                        logits.new_empty((logits.shape[0], top_k), dtype=torch.int32)))
attention_prefill.register_fake(_with_lse(lambda q, k, v, *a: v.shape[3]))
attention_mixed.register_fake(_with_lse(lambda q, k, v, *a: v.shape[3]))
attention_decode.register_fake(_with_lse(lambda q, k, v, *a: v.shape[3]))
attention_merge.register_fake(lambda o_a, lse_a, o_b, lse_b, backend=None: (torch.empty_like(o_a),
                                                                            torch.empty_like(lse_a)))
mla_decode.register_fake(_with_lse(lambda qn, *a: qn.shape[2]))
mla_sparse_decode.register_fake(_with_lse(lambda qn, *a: qn.shape[2]))
mla_prefill.register_fake(_with_lse(lambda qn, qp, cache, w_kc, w_vc, *a: w_vc.shape[1]))
sample.register_fake(lambda logits, *a, **k: (logits.new_empty((logits.shape[0],), dtype=torch.int64),
                                              logits.new_empty((logits.shape[0],), dtype=torch.bool)))
