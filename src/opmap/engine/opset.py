"""The operators of one model step, resolved once through the selector.

An ``OpSet`` holds, for one phase (prefill / mixed / decode) and one row count, the callable of
every operator the model runs: the selector's choice and its entry, resolved as the public op
functions resolve theirs (``opmap.api.dispatch.entry_of``). It is built when the model
is built, never per step; the engine logs each choice once per op and phase
(``Choice.condensed()``). On the CPU the selector picks the fp32 references; the same code picks
Triton / cuBLAS / ... on a GPU.
"""
from __future__ import annotations

import logging
from typing import Optional

from opmap.core import specs as S
from opmap.model.presets import ModelConfig, _scaling
from opmap.api.dispatch import entry_of
from opmap.core.select import select

# False: RoPE (with Qwen3's q/k norm) and the KV append as separate launches (tests compare the two).
FUSE_ROPE_APPEND = True

log = logging.getLogger("opmap.engine")


class OpSet:
    def __init__(self, cfg: ModelConfig, phase: str, arch: str, dtype: str, page_size: int,
                 cuda_graph: bool, m: Optional[int], forced: Optional[dict] = None, trace: bool = False,
                 quant: Optional[str] = None, kv_dtype: Optional[str] = None, quant_lm_head: bool = False):
        self.phase, self.m, self.cuda_graph, self.trace = phase, m, cuda_graph, trace
        self.choices: list = []  # (label, entry, Choice)
        self._forced = forced or {}
        base = dict(arch=arch, phase=phase)
        h = cfg.hidden
        self.rmsnorm = self._pick("rmsnorm", "RMSNorm", S.NormSpec(hidden=h, dtype=dtype, **base), "rmsnorm")
        self.add_rmsnorm = self._pick("rmsnorm", "add + RMSNorm", S.NormSpec(hidden=h, dtype=dtype, fused_add=True,
                                                                             **base), "add_rmsnorm")
        # ``quant``: the weight-only format of the projections DecoderModel.quant_names quantises
        gemm = lambda label, n, k, bias=False, q=False: self._pick(  # noqa: E731
            "gemm", label, S.GemmSpec(m=m, n=n, k=k, dtype=dtype, weight_dtype=(quant if q and quant else dtype),
                                      bias=bias, **base), "linear")
        rope_dim = cfg.qk_rope_dim if cfg.is_mla else cfg.head_dim
        self.rope = self._pick("rope", "RoPE", S.RopeSpec(head_dim=rope_dim, style=cfg.rope_style,
                                                          scaling=_scaling(cfg), dtype=dtype, **base), "rope")
        rope_choice = self.choices[-1][2]
        self.rope_append = None  # RoPE + KV append in one launch, where both ops chose one backend
        self.qk_norm_in_rope_append = False
        self.gemm: dict = {}
        self.moe_warm_up = None
        if cfg.is_mla:
            qk = cfg.qk_nope_dim + cfg.qk_rope_dim
            if cfg.q_lora_rank:
                self.gemm["q_a"] = gemm("q_a proj", cfg.q_lora_rank, h)
                self.gemm["q_b"] = gemm("q_b proj", cfg.heads * qk, cfg.q_lora_rank)
                self.q_a_norm = self._pick("rmsnorm", "q_a norm", S.NormSpec(hidden=cfg.q_lora_rank, dtype=dtype,
                                                                             **base), "rmsnorm")
            else:
                self.gemm["q"] = gemm("q proj", cfg.heads * qk, h)
            self.gemm["kv_a"] = gemm("kv_a proj", cfg.kv_lora_rank + cfg.qk_rope_dim, h)
            self.gemm["o"] = gemm("O proj", h, cfg.heads * cfg.v_head_dim, q=True)
            self.latent_norm = self._pick("rmsnorm", "kv_a norm", S.NormSpec(hidden=cfg.kv_lora_rank, dtype=dtype,
                                                                             **base), "rmsnorm")
            self.kv_append = self._pick("kv_append", "latent KV append", S.KVAppendSpec(
                kind="mla", num_kv_heads=1, head_dim=cfg.kv_lora_rank + cfg.qk_rope_dim, page_size=page_size,
                dtype=dtype, kv_dtype=dtype, cuda_graph=cuda_graph, **base), "append_mla")
            aspec = S.AttentionSpec(kind="mla", num_heads=cfg.heads, num_kv_heads=1,
                                    head_dim=cfg.kv_lora_rank + cfg.qk_rope_dim, head_dim_v=cfg.kv_lora_rank,
                                    page_size=page_size, dtype=dtype, kv_dtype=dtype, cuda_graph=cuda_graph, **base)
            self.attention = self._pick("attention", "MLA attention", aspec,
                                        "mla_decode" if phase == "decode" else "mla_prefill")
        else:
            qkv_n = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
            self.gemm["qkv"] = gemm("QKV proj", qkv_n, h, cfg.attention_bias, q=True)
            self.gemm["o"] = gemm("O proj", h, cfg.heads * cfg.head_dim, cfg.o_bias, q=True)
            qk_choice = None
            if cfg.qk_norm:
                self.qk_norm = self._pick("rmsnorm", "q/k norm", S.NormSpec(hidden=cfg.head_dim, dtype=dtype, **base),
                                          "qk_rmsnorm")
                qk_choice = self.choices[-1][2]
            kvd = kv_dtype or dtype  # "fp8": the engine's fp8 cache (EngineConfig.kv_cache_dtype)
            self.kv_append = self._pick("kv_append", "KV append", S.KVAppendSpec(
                num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, page_size=page_size, dtype=dtype,
                kv_dtype=kvd, cuda_graph=cuda_graph, **base), "append")
            app = self.choices[-1][2]
            if (app.backend.name == rope_choice.backend.name and "rope_append" in app.backend.impl
                    and FUSE_ROPE_APPEND):
                # One launch instead of two per layer (kernels/attention/rope_append.py); the rope
                # selection above already checked the rope requirements for this backend.
                # Qwen3's q/k norms ride along when the norm chose that backend's name too.
                self.qk_norm_in_rope_append = qk_choice is not None and qk_choice.backend.name == app.backend.name
                label = "q/k norm + RoPE + KV append (one launch)" if self.qk_norm_in_rope_append else \
                    "RoPE + KV append (one launch)"
                self.rope_append = self._use(app, label, "rope_append")
            aspec = S.AttentionSpec(num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                                    page_size=page_size, dtype=dtype, kv_dtype=kvd, cuda_graph=cuda_graph,
                                    sliding_window=any(cfg.window_of(i) for i in range(cfg.layers)),
                                    soft_cap=bool(cfg.attn_soft_cap), **base)
            self.attention = self._pick("attention", "attention (paged)", aspec, phase)
        self.attn_backend = self.choices[-1][2].backend
        self.make_workspace = (self.attn_backend.fn("make_workspace")
                               if "make_workspace" in self.attn_backend.impl else None)
        if cfg.is_moe:
            self.gemm["router"] = gemm("router", cfg.num_experts, h)
            self.moe = self._pick("moe", "MoE", S.MoESpec(
                num_experts=cfg.num_experts, top_k=cfg.top_k, hidden=h, intermediate=cfg.moe_intermediate,
                router=cfg.router, shared_experts=cfg.shared_experts, dtype=dtype, weight_dtype=dtype,
                tokens=m, **base), "moe")
            moe_backend = self.choices[-1][2].backend
            # a backend that tunes kernels per token count does it once at start-up (runner)
            self.moe_warm_up = moe_backend.fn("warm_up") if "warm_up" in moe_backend.impl else None
            if cfg.shared_experts:
                si = cfg.shared_width
                self.gemm["shared_gate_up"] = gemm("shared gate/up proj", 2 * si, h)
                self.gemm["shared_down"] = gemm("shared down proj", h, si)
                if cfg.shared_gate:
                    self.gemm["shared_gate"] = gemm("shared expert gate", 1, h)
                self.shared_act = self._pick("activation", "shared SiLU * mul",
                                             S.ActivationSpec(hidden=si, dtype=dtype, **base), "silu_mul")
        if not cfg.is_moe or cfg.first_dense_layers:
            self.gemm["gate_up"] = gemm("gate/up proj", 2 * cfg.intermediate, h, cfg.mlp_bias, q=True)
            self.gemm["down"] = gemm("down proj", h, cfg.intermediate, cfg.mlp_bias, q=True)
            kind = "gelu_tanh_mul" if cfg.activation == "gelu_tanh" else "silu_mul"
            self.act = self._pick("activation", "GELU-tanh * mul" if cfg.activation == "gelu_tanh" else "SiLU * mul",
                                  S.ActivationSpec(kind=kind, hidden=cfg.intermediate, dtype=dtype, **base), kind)
        # Prefill computes logits for the sampled rows only; decode for every row.
        self.gemm["lm_head"] = gemm("LM head", cfg.vocab, h, q=quant_lm_head)

    def _pick(self, op: str, label: str, spec, entry: str):
        return self._use(select(op, spec, backend=self._forced.get(op)), label, entry)

    def _use(self, choice, label: str, entry: str):
        self.choices.append((label, entry, choice))
        fn = entry_of(choice, entry)[1]  # the callable a user's opmap.<op> call runs for this spec
        return _ranged(fn, f"opmap::{choice.op}::{label}::{choice.backend.name}") if self.trace else fn

    def summary(self) -> list:
        """(op, phase, label, backend, condensed trace) per operator, in map order."""
        return [(c.op, c.spec.phase, label, c.backend.name, c.condensed()) for label, _, c in self.choices]


def _ranged(fn, name: str):
    """fn inside a torch.profiler range and an NVTX range (for Nsight), both named ``name``."""
    import torch

    def wrapped(*args, **kw):
        nvtx = torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing()
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            with torch.profiler.record_function(name):
                return fn(*args, **kw)
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()

    return wrapped


def log_choices(opsets, logger=log, seen: Optional[set] = None) -> list:
    """Log each (op, phase, label, backend) once; returns the lines logged."""
    seen = set() if seen is None else seen
    lines = []
    for ops in opsets:
        for op, phase, label, backend, text in ops.summary():
            key = (op, phase, label, backend)
            if key in seen:
                continue
            seen.add(key)
            line = f"{label:<22} {text}"
            lines.append(line)
            logger.info("%s", line)
    return lines
