"""Gemma-2 and Gemma-3 (text): the Llama decoder with a norm after the attention and after the MLP as well (each before
its residual add), norm weights used as 1 + w, the embedding scaled by sqrt(hidden), tanh caps on
the attention scores (the attention kernels' ``soft_cap``) and on the final logits, alternating
sliding-window layers (their ``window``), a GELU-tanh gated MLP and a softmax scale of
``query_pre_attn_scalar ** -0.5``; Gemma-3 adds q/k norms and its sliding layers' own RoPE base
(``DecoderModel.cos_sin_of``).

The norm weights are stored as 1 + w at load: the norm kernels multiply by the weight they are
given (HF multiplies by 1 + w in fp32 before the cast, opmap casts first: the same in fp32, one
rounding apart in bf16).
"""
from __future__ import annotations

import torch

from opmap.engine.model import DecoderModel, Step
from opmap.engine.weights import Loader


class GemmaModel(DecoderModel):
    def __init__(self, cfg, device, dtype):
        super().__init__(cfg, device, dtype)
        self.scale = (cfg.query_scale or cfg.head_dim) ** -0.5
        # HF scales in the weights' dtype (sqrt(3072) is 55.5 in bf16); made once, not per step
        self.embed_mul = float(torch.tensor(cfg.hidden ** 0.5, dtype=dtype)) if cfg.embed_scale else None

    def declare_layer(self, i: int) -> None:
        super().declare_layer(i)
        self._p(f"{i}.post_attn_norm", self.cfg.hidden)  # post_attention_layernorm (on the attention output)
        self._p(f"{i}.post_ff_norm", self.cfg.hidden)

    def load_layer(self, L: Loader, i: int) -> None:
        P, pre = self.params, f"model.layers.{i}"
        L.copy(P[f"{i}.in_norm"], f"{pre}.input_layernorm.weight")
        L.copy(P[f"{i}.post_attn_norm"], f"{pre}.post_attention_layernorm.weight")
        L.copy(P[f"{i}.post_norm"], f"{pre}.pre_feedforward_layernorm.weight")  # the norm before the MLP
        L.copy(P[f"{i}.post_ff_norm"], f"{pre}.post_feedforward_layernorm.weight")
        a = f"{pre}.self_attn"
        L.cat(P[f"{i}.qkv"], [f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"])
        if self.cfg.qk_norm:  # Gemma-3
            L.copy(P[f"{i}.q_norm"], f"{a}.q_norm.weight")
            L.copy(P[f"{i}.k_norm"], f"{a}.k_norm.weight")
        L.copy(P[f"{i}.o"], f"{a}.o_proj.weight")
        self.load_mlp(L, i)

    def load(self, source) -> list:
        unused = super().load(source)
        self._offset_norms()
        return unused

    def _offset_norms(self) -> None:
        with torch.no_grad():
            for k, t in self.params.items():
                if k.endswith("norm"):
                    t.add_(self.cfg.norm_offset)

    def attention_kw(self, i: int) -> dict:
        kw = super().attention_kw(i)
        if self.cfg.attn_soft_cap:
            kw["soft_cap"] = float(self.cfg.attn_soft_cap)
        return kw

    def layers(self, ops, st: Step, kv: list) -> tuple:
        P, c = self.params, self.cfg
        eps = c.rms_eps
        residual = P["embed"][st.input_ids]
        if self.embed_mul is not None:
            residual = residual * self.embed_mul
        h = ops.rmsnorm(residual, P["0.in_norm"], eps)
        out = None
        for i in range(c.layers):
            if i > 0:
                h = ops.add_rmsnorm(out, residual, P[f"{i}.in_norm"], eps)
            a = ops.rmsnorm(self.attention(ops, st, kv[i], i, h), P[f"{i}.post_attn_norm"], eps)
            h = ops.add_rmsnorm(a, residual, P[f"{i}.post_norm"], eps)
            out = ops.rmsnorm(self.mlp(ops, i, h), P[f"{i}.post_ff_norm"], eps)
        return out, residual

    def head(self, ops, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        logits = super().head(ops, out, residual)
        if c.final_soft_cap:
            logits = torch.tanh(logits / c.final_soft_cap) * c.final_soft_cap
        return logits
