"""Public ops of the dense layers: norms, RoPE, activations, linear, MoE, KV append.

Each builds the op's spec from its tensors (device -> arch, shapes, dtypes), lets the selector
choose (``backend=`` forces one by name and raises ``BackendError`` with the reasons when it
cannot serve), and calls the backend's entry, which validates every argument (``InputError``
naming it) before any kernel runs. Contracts in full: docs/OPS_API.md.
"""
from __future__ import annotations

from typing import Optional

import torch

from opmap.core.contract import expect, expect_tensor
from opmap.core.specs import ActivationSpec, GemmSpec, KVAppendSpec, MoESpec, NormSpec, RopeSpec
from opmap.api.dispatch import arch_of, call, dt, tensor
from opmap.ops.gemm.quant import block_of
from opmap.ops.gemm.validate import ACT_DTYPES, INT4_PACKED, QUANT_DTYPES
from opmap.ops.moe.routing import check_top_k, expert_format


def _floats(arg: str, t, ndim: Optional[int] = None, dtypes=ACT_DTYPES) -> torch.Tensor:
    """A tensor of ``dtypes`` with at least one dimension (``ndim`` of them if given) and a last one
    that is not empty: checked before its shape and dtype make a spec (an InputError naming the
    argument, where a spec would raise an IndexError or its own ValueError)."""
    tensor(arg, t, ndim)
    expect(t.dim() >= 1, arg, "a 0-d tensor", ">= 1 dims [..., H]")
    expect_tensor(arg, t, dtype=dtypes)
    expect(t.shape[-1] > 0, arg, f"shape {tuple(t.shape)}", "a last dimension > 0")
    return t


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, backend: Optional[str] = None,
            phase: str = "decode") -> torch.Tensor:
    """RMSNorm over the last dim of x[..., H] with weight[H] -> new tensor like x (HF numerics:
    normalise in fp32, cast to x.dtype, multiply by the weight)."""
    _floats("x", x)
    spec = NormSpec(arch=arch_of(x), phase=phase, hidden=x.shape[-1], dtype=dt(x))
    return call("rmsnorm", spec, "rmsnorm", backend, x, weight, eps)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                backend: Optional[str] = None, phase: str = "decode") -> torch.Tensor:
    """``residual += x`` in place, then -> rmsnorm(residual, weight, eps)."""
    _floats("x", x)
    spec = NormSpec(arch=arch_of(x), phase=phase, hidden=x.shape[-1], dtype=dt(x), fused_add=True)
    return call("rmsnorm", spec, "add_rmsnorm", backend, x, residual, weight, eps)


def qk_rmsnorm(qk: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, num_q_heads: int, eps: float = 1e-6, *,
               backend: Optional[str] = None, phase: str = "decode") -> torch.Tensor:
    """Per-head RMSNorm in place on qk[T, Hq + Hk, D] (Qwen3's q_norm / k_norm): heads below
    ``num_q_heads`` use w_q[D], the rest w_k[D]. Returns qk."""
    _floats("qk", qk, 3)
    spec = NormSpec(arch=arch_of(qk), phase=phase, hidden=qk.shape[-1], dtype=dt(qk))
    return call("rmsnorm", spec, "qk_rmsnorm", backend, qk, w_q, w_k, num_q_heads, eps)


def _rope_spec(q, cos_sin, style, phase):
    _floats("q", q, 3)
    tensor("cos_sin", cos_sin, 2)
    return RopeSpec(arch=arch_of(q), phase=phase, head_dim=q.shape[-1], rotary_dim=cos_sin.shape[1],
                      style=style if style in ("neox", "gptj") else "neox", dtype=dt(q))


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, style: str = "neox", *,
         backend: Optional[str] = None, phase: str = "decode") -> None:
    """Rotary embedding in place on the first rotary_dim dims of every head of q[T, Hq, D] and
    k[T, Hk, D] at positions[T] (int64); cos_sin[max_pos, rotary_dim] fp32 holds cos in its first
    half and sin in the second (``opmap.ops.rope.reference.cos_sin_cache``); style "neox" (halves)
    or "gptj" (interleaved pairs)."""
    call("rope", _rope_spec(q, cos_sin, style, phase), "rope", backend, q, k, positions, cos_sin, style)


def _append_spec(k_cache, kind, phase, heads, width, dtype):
    # [pages, page_size, Hk, D] (GQA) or [pages, page_size, R + Dr] (MLA): page_size is dim 1
    tensor("k_cache" if kind == "gqa" else "cache", k_cache, 4 if kind == "gqa" else 3)
    return KVAppendSpec(arch=arch_of(k_cache), phase=phase, kind=kind, num_kv_heads=heads, head_dim=width,
                          page_size=k_cache.shape[1] if k_cache.dim() > 1 else 0, dtype=dtype,
                          kv_dtype=dt(k_cache))


def rope_append(q, k, v, positions, cos_sin, style, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None,
                qk_norm=None, *, backend: Optional[str] = None, phase: str = "decode") -> None:
    """``rope(q, k, ...)`` then ``kv_append(k, v, ...)`` in one launch where the backend has it;
    ``qk_norm=(w_q, w_k, eps)`` applies Qwen3's per-head norm to q and k first."""
    tensor("k", k, 3)
    spec = _append_spec(k_cache, "gqa", phase, k.shape[1], k.shape[2], dt(k))
    call("kv_append", spec, "rope_append", backend, q, k, v, positions, cos_sin, style, k_cache, v_cache,
         slot_mapping, k_scale, v_scale, qk_norm)


def kv_append(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
              v_scale: Optional[torch.Tensor] = None, *, backend: Optional[str] = None, phase: str = "decode") -> None:
    """Write k[T, Hk, D], v[T, Hk, D] into the paged caches [pages, page_size, Hk, D] at
    slot_mapping[T] (page_id * page_size + offset; -1 skips the token). fp8 caches store
    value / scale with per-kv-head k_scale[Hk], v_scale[Hk] fp32."""
    tensor("k", k, 3)
    spec = _append_spec(k_cache, "gqa", phase, k.shape[1], k.shape[2], dt(k))
    call("kv_append", spec, "append", backend, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def append_mla(ckv: torch.Tensor, kpe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
               kv_scale=None, *, backend: Optional[str] = None, phase: str = "decode") -> None:
    """Write the MLA latent ckv[T, R] and rope part kpe[T, Dr] into cache[pages, page_size, R + Dr]."""
    tensor("ckv", ckv, 2)
    tensor("kpe", kpe, 2)
    spec = _append_spec(cache, "mla", phase, 1, ckv.shape[1] + kpe.shape[1], dt(ckv))
    call("kv_append", spec, "append_mla", backend, ckv, kpe, cache, slot_mapping, kv_scale)


def _act(kind: str, x, backend, phase):
    _floats("x", x)
    spec = ActivationSpec(arch=arch_of(x), phase=phase, kind=kind, hidden=x.shape[-1] // 2, dtype=dt(x))
    return call("activation", spec, kind, backend, x)


def silu_mul(x: torch.Tensor, *, backend: Optional[str] = None, phase: str = "decode") -> torch.Tensor:
    """silu(x[..., :H]) * x[..., H:] for x[..., 2H] -> [..., H]."""
    return _act("silu_mul", x, backend, phase)


def gelu_tanh_mul(x: torch.Tensor, *, backend: Optional[str] = None, phase: str = "decode") -> torch.Tensor:
    """gelu_tanh(x[..., :H]) * x[..., H:] for x[..., 2H] -> [..., H]."""
    return _act("gelu_tanh_mul", x, backend, phase)


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
           w_scale: Optional[torch.Tensor] = None, w_zero: Optional[torch.Tensor] = None, *,
           backend: Optional[str] = None, phase: Optional[str] = None) -> torch.Tensor:
    """x[M, K] @ w[N, K].T (+ bias[N]) -> [M, N] in x.dtype. Weight-only fp8-e4m3 or int8 ``w`` take
    per-output-channel w_scale[N] fp32 (``opmap.ops.gemm.quant.quantize_weight``); int4 ``w`` is
    int32 [N, K / 8] (eight 4-bit codes a word) with w_scale[N, K / group_size] and, for an
    asymmetric format, w_zero uint8 codes of that shape (``opmap.ops.gemm.quant.quantize_int4``).
    The phase defaults to decode for M <= 64 rows, else prefill."""
    _floats("x", x, 2)
    _floats("w", w, 2, ACT_DTYPES + QUANT_DTYPES + (INT4_PACKED,))
    m = x.shape[0]
    int4 = w.dtype == INT4_PACKED
    expect(w_zero is None or int4, "w_zero", "a tensor", f"None for {dt(w)} weights (zero points are int4's)")
    k = x.shape[1] if int4 else w.shape[1]  # int4: check_linear names a w whose words do not match x
    group, wd = None, "int4" if int4 else dt(w)
    if int4 and torch.is_tensor(w_scale) and w_scale.dim() == 2 and w_scale.shape[1] and k % w_scale.shape[1] == 0:
        group = k // w_scale.shape[1]  # else check_linear names the bad scale
    if wd == "fp8" and torch.is_tensor(w_scale) and w_scale.dim() == 2:  # a scale per block
        wd, group = "fp8-block", block_of(w.shape[0], k, w_scale)
        expect(group > 0, "w_scale", f"shape {tuple(w_scale.shape)}",
               f"one scale per b x b block of ({w.shape[0]}, {k}), b a power of two >= 16")
    spec = GemmSpec(arch=arch_of(x), phase=phase or ("decode" if m <= 64 else "prefill"), m=m, n=w.shape[0],
                    k=k, dtype=dt(x), weight_dtype=wd, bias=bias is not None, group_size=group)
    if w_zero is not None:
        return call("gemm", spec, "linear", backend, x, w, bias, w_scale, w_zero)
    return call("gemm", spec, "linear", backend, x, w, bias, w_scale)


def _moe_spec(router_logits, top_k, router, phase, x=None, w13=None, w2=None, w13_scale=None):
    tensor("router_logits", router_logits, 2)
    check_top_k(router_logits, top_k)
    fields = dict(arch=arch_of(router_logits), phase=phase, num_experts=router_logits.shape[1],
                  top_k=top_k, tokens=router_logits.shape[0],
                  router="sigmoid_grouped" if router in ("sigmoid", "sigmoid_grouped") else "softmax")
    if x is not None:
        _floats("x", x, 2)
        fmt = expert_format(w13)
        _floats("w13", w13, 3, dtypes=ACT_DTYPES if fmt is None else (w13.dtype,))
        fields.update(hidden=x.shape[1], intermediate=w13.shape[1] // 2, dtype=dt(x), weight_dtype=fmt or dt(w13))
        if fmt is not None and torch.is_tensor(w13_scale) and w13_scale.dim() == 3 and w13_scale.shape[2]:
            k = x.shape[1]  # else check_moe_args names the bad scale
            fields["group_size"] = k // w13_scale.shape[2] if fmt == "int4" else block_of(w13.shape[1], k, w13_scale[0])
    return MoESpec(**fields)


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, *,
        router: str = "softmax", renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
        routed_scaling: float = 1.0, score_bias: Optional[torch.Tensor] = None, backend: Optional[str] = None,
        phase: str = "decode", w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
        w13_zero: Optional[torch.Tensor] = None, w2_zero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Routed experts of x[T, H]: router_logits[T, E] fp32 -> top-k experts (``router`` "softmax"
    or DeepSeek's "sigmoid" with n_group / topk_group / score_bias), w13[E, 2I, H] (gate rows
    then up rows), w2[E, H, I] -> [T, H] in x.dtype. Shared experts are the caller's dense MLP.
    Quantised experts come with their scales: int4 (w13 int32 [E, 2I, H / 8], w13_scale
    [E, 2I, H / G], optional uint8 w13_zero; w2 alike) or block fp8 (e4m3 w13 [E, 2I, H],
    w13_scale [E, ceil(2I / b), ceil(H / b)] fp32; w2 alike)."""
    spec = _moe_spec(router_logits, top_k, router, phase, x, w13, w2, w13_scale)
    quant = {k: v for k, v in dict(w13_scale=w13_scale, w2_scale=w2_scale, w13_zero=w13_zero,
                                   w2_zero=w2_zero).items() if v is not None}
    return call("moe", spec, "moe", backend, x, router_logits, w13, w2, top_k, router=router,
                renormalize=renormalize, n_group=n_group, topk_group=topk_group, routed_scaling=routed_scaling,
                score_bias=score_bias, **quant)


def moe_route(router_logits: torch.Tensor, top_k: int, *, router: str = "softmax", renormalize: bool = True,
              n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
              score_bias: Optional[torch.Tensor] = None, backend: Optional[str] = None,
              phase: str = "decode") -> tuple:
    """-> (topk_weights[T, k] fp32, topk_ids[T, k] int32), ids always in [0, E)."""
    spec = _moe_spec(router_logits, top_k, router, phase)
    return call("moe", spec, "route", backend, router_logits, top_k, router=router, renormalize=renormalize,
                n_group=n_group, topk_group=topk_group, routed_scaling=routed_scaling, score_bias=score_bias)
