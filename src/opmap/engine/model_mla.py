"""DeepSeek-V2 (MLA attention, MoE with shared experts, first layers dense) from opmap operators.

The latent cache holds per token ``[ckv (R) | k_pe (Dr)]``. Prefill and mixed steps use the
non-absorbed ``mla_prefill`` (keys and values expanded from the latent per head); decode uses the
absorbed ``mla_decode``: the query's no-RoPE half is multiplied by W_UK (``w_kc``) first, and the
latent output by W_UV (``w_vc``) after. Those two per-head batched products are ``torch.bmm``:
no opmap operator family covers a batched per-head GEMM.
"""
from __future__ import annotations

import math

import torch

from opmap.engine.model import DecoderModel, Step
from opmap.model.presets import ModelConfig
from opmap.engine.weights import Loader
from opmap.core.contract import InputError
from opmap.engine.model_gemma import GemmaModel


def _yarn_mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


class MLAModel(DecoderModel):
    def __init__(self, cfg, device, dtype):
        super().__init__(cfg, device, dtype)
        qk = cfg.qk_nope_dim + cfg.qk_rope_dim
        self.scale = qk ** -0.5
        rs = cfg.rope_scaling or {}
        if rs.get("mscale_all_dim"):
            m = _yarn_mscale(rs["factor"], rs["mscale_all_dim"])
            self.scale *= m * m  # HF DeepseekV2Attention.scaling

    def declare_layer(self, i: int) -> None:
        c = self.cfg
        h, H, R = c.hidden, c.heads, c.kv_lora_rank
        self._p(f"{i}.in_norm", h)
        self._p(f"{i}.post_norm", h)
        if c.q_lora_rank:  # DeepSeek-V2 / V3: q = q_b(norm(q_a(x)))
            self._p(f"{i}.q_a", c.q_lora_rank, h)
            self._p(f"{i}.q_a_norm", c.q_lora_rank)
            self._p(f"{i}.q_b", H * (c.qk_nope_dim + c.qk_rope_dim), c.q_lora_rank)
        else:  # V2-Lite: a plain q_proj
            self._p(f"{i}.q", H * (c.qk_nope_dim + c.qk_rope_dim), h)
        self._p(f"{i}.kv_a", R + c.qk_rope_dim, h)
        self._p(f"{i}.kv_a_norm", R)
        self._p(f"{i}.w_kc", H, c.qk_nope_dim, R)  # kv_b_proj.weight as [H, Dn + Dv, R], split
        self._p(f"{i}.w_vc", H, c.v_head_dim, R)
        self._p(f"{i}.o", h, H * c.v_head_dim)
        self.declare_mlp(i)

    def load_layer(self, L: Loader, i: int) -> None:
        P, c, pre = self.params, self.cfg, f"model.layers.{i}"
        a = f"{pre}.self_attn"
        L.copy(P[f"{i}.in_norm"], f"{pre}.input_layernorm.weight")
        L.copy(P[f"{i}.post_norm"], f"{pre}.post_attention_layernorm.weight")
        if c.q_lora_rank:
            L.copy(P[f"{i}.q_a"], f"{a}.q_a_proj.weight")
            L.copy(P[f"{i}.q_a_norm"], f"{a}.q_a_layernorm.weight")
            L.copy(P[f"{i}.q_b"], f"{a}.q_b_proj.weight")
        else:
            L.copy(P[f"{i}.q"], f"{a}.q_proj.weight")
        L.copy(P[f"{i}.kv_a"], f"{a}.kv_a_proj_with_mqa.weight")
        L.copy(P[f"{i}.kv_a_norm"], f"{a}.kv_a_layernorm.weight")
        H, Dn, Dv, R = c.heads, c.qk_nope_dim, c.v_head_dim, c.kv_lora_rank
        kvb = torch.empty(H * (Dn + Dv), R, device=self.device, dtype=self.dtype)
        L.copy(kvb, f"{a}.kv_b_proj.weight")
        kvb = kvb.view(H, Dn + Dv, R)
        P[f"{i}.w_kc"].copy_(kvb[:, :Dn])
        P[f"{i}.w_vc"].copy_(kvb[:, Dn:])
        L.copy(P[f"{i}.o"], f"{a}.o_proj.weight")
        self.load_mlp(L, i)

    def attention(self, ops, st: Step, cache, i: int, h: torch.Tensor) -> torch.Tensor:
        P, c = self.params, self.cfg
        T, H, Dn, Dr, R = h.shape[0], c.heads, c.qk_nope_dim, c.qk_rope_dim, c.kv_lora_rank
        if c.q_lora_rank:
            qa = ops.q_a_norm(ops.gemm["q_a"](h, P[f"{i}.q_a"]), P[f"{i}.q_a_norm"], 1e-6)  # HF: default eps
            q = ops.gemm["q_b"](qa, P[f"{i}.q_b"]).view(T, H, Dn + Dr)
        else:
            q = ops.gemm["q"](h, P[f"{i}.q"]).view(T, H, Dn + Dr)
        q_nope, q_pe = q[..., :Dn], q[..., Dn:]
        kva = ops.gemm["kv_a"](h, P[f"{i}.kv_a"])
        if ops.norm_rope_append is not None:  # the three below in one launch (model.step)
            ops.norm_rope_append(q_pe, kva, P[f"{i}.kv_a_norm"], 1e-6, st.positions, self.cos_sin, c.rope_style,
                                 cache, st.slot_mapping)
        else:
            ckv = ops.latent_norm(kva[:, :R], P[f"{i}.kv_a_norm"], 1e-6)  # HF: the layer's default eps
            k_pe = kva[:, R:].view(T, 1, Dr)
            ops.rope(q_pe, k_pe, st.positions, self.cos_sin, c.rope_style)
            ops.kv_append(ckv, k_pe.view(T, Dr), cache, st.slot_mapping)
        if st.is_decode:
            q_abs = torch.bmm(q_nope.transpose(0, 1), P[f"{i}.w_kc"]).transpose(0, 1).contiguous()
            kw = {"workspace": st.workspace} if st.workspace is not None else {}
            lat = ops.attention(q_abs, q_pe.contiguous(), cache, st.seq_lens, st.block_tables,
                                scale=self.scale, **kw)
            o = torch.bmm(lat.transpose(0, 1), P[f"{i}.w_vc"].transpose(1, 2)).transpose(0, 1)
        else:
            o = ops.attention(q_nope, q_pe, cache, P[f"{i}.w_kc"], P[f"{i}.w_vc"], st.cu_seqlens_q,
                              st.seq_lens, st.block_tables, scale=self.scale, max_q_len=st.max_q_len,
                              max_seq_len=st.max_seq_len)
        return self.linear(ops, "o", f"{i}.o", o.reshape(T, H * c.v_head_dim))

    def set_kv_dtype(self, kv) -> None:
        if kv is not None:
            raise InputError("kv_cache_dtype", kv, "None for MLA models (the engine's latent cache stays in the "
                             "model's dtype)")

    def kv_bytes_per_page(self, page_size: int) -> int:
        c = self.cfg
        es = torch.tensor([], dtype=self.dtype).element_size()
        return c.layers * page_size * (c.kv_lora_rank + c.qk_rope_dim) * es

    def make_kv(self, num_pages: int, page_size: int) -> list:
        c = self.cfg
        kv = torch.zeros((c.layers, num_pages, page_size, c.kv_lora_rank + c.qk_rope_dim),
                         device=self.device, dtype=self.dtype)
        return [kv[i] for i in range(c.layers)]

    def rope_dim(self) -> int:
        return self.cfg.qk_rope_dim


def build_model(cfg: ModelConfig, device, dtype):
    """The model for a config: MLA layers for DeepSeek-V2-style configs, else the decoder."""
    if cfg.is_mla:
        return MLAModel(cfg, device, dtype)
    if cfg.sandwich_norms:
        return GemmaModel(cfg, device, dtype)
    return DecoderModel(cfg, device, dtype)
