"""Decoder models built only from opmap operators (resolved through the selector in an OpSet):
Llama / Llama-3, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), Mixtral and Qwen3-MoE (routed MoE);
DeepSeek-V2 (MLA + shared experts) lives in ``model_mla``.

Parameters are fused at load time: QKV in one [(Hq + 2 Hk) D, H] matrix, gate+up in one
[2I, H], experts as w13[E, 2I, H] / w2[E, H, I]. Token embedding lookup is a plain index (there is
no operator family for it; it moves H values per token).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from opmap.model.hf import quantised_experts
from opmap.model.presets import ModelConfig
from opmap.engine.weights import Loader, fill_random, kv_layer_scales
from opmap.ops.gemm.quant import int4_group, quantize_fp8_block, quantize_int4, quantize_weight
from opmap.ops.moe.reference import quantize_experts


@dataclass
class Step:
    """Step metadata shared by all layers (views of the runner's persistent buffers)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding
    seq_lens: torch.Tensor  # [B] int32, including this step's tokens
    block_tables: torch.Tensor  # [B, max_pages] int32
    cu_seqlens_q: Optional[torch.Tensor]  # [B + 1] int32 (None in decode)
    logits_idx: Optional[torch.Tensor]  # rows whose logits are wanted (None = every row)
    is_decode: bool
    workspace: Any = None
    # Host ints of prefill and mixed steps: the longest query chunk and sequence. The MLA prefill
    # plans its chunks from them; without them it reads them from the device, a host
    # synchronisation in every layer (DeepSeek-V2-Lite's prefill steps left the GPU idle more than
    # half the time).
    max_q_len: Optional[int] = None
    max_seq_len: Optional[int] = None


class DecoderModel:
    """GQA decoder (Llama family); MoE layers for Mixtral / Qwen3-MoE."""

    def __init__(self, cfg: ModelConfig, device, dtype: torch.dtype):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.kv_dtype = dtype  # set_kv_dtype: fp8 caches with their scales
        self.kv_scale_kw: dict = {}
        self.kv_layer_kw: Optional[list] = None  # per layer, where the checkpoint has KV scales
        self.kv_layer_scales: Optional[list] = None  # (k_scale, v_scale) per layer from the checkpoint
        self.dequantised: list = []  # quantised checkpoint tensors loaded into model-dtype parameters
        self.expert_quant: Optional[tuple] = None  # (format, group / block) of experts kept quantised
        self.params: dict = {}
        h, d = cfg.hidden, cfg.head_dim
        self.scale = d ** -0.5
        self._p("embed", cfg.vocab, h)
        for i in range(cfg.layers):
            self.declare_layer(i)
        self._p("norm", h)
        if not cfg.tie_embeddings:
            self._p("lm_head", cfg.vocab, h)

    def _p(self, name: str, *shape, meta: bool = False) -> torch.Tensor:
        """A parameter of the model's dtype on its device, or a placeholder without memory (``meta``:
        what the loader fills in another layout, or ``dense()`` allocates)."""
        t = torch.empty(shape, device="meta" if meta else self.device, dtype=self.dtype)
        self.params[name] = t
        return t

    def dense(self) -> None:
        """Allocate the expert placeholders still without memory (a checkpoint's experts declared
        quantised but stored in 16 bits, or random weights of a quantised config)."""
        for n, t in self.params.items():
            if t.is_meta and n.endswith((".w13", ".w2")):
                self.params[n] = torch.empty(t.shape, device=self.device, dtype=self.dtype)

    def declare_layer(self, i: int) -> None:
        c = self.cfg
        h, d = c.hidden, c.head_dim
        self._p(f"{i}.in_norm", h)
        self._p(f"{i}.post_norm", h)
        self._p(f"{i}.qkv", (c.heads + 2 * c.kv_heads) * d, h)
        if c.attention_bias:
            self._p(f"{i}.qkv_bias", (c.heads + 2 * c.kv_heads) * d)
        if c.qk_norm:
            self._p(f"{i}.q_norm", d)
            self._p(f"{i}.k_norm", d)
        self._p(f"{i}.o", h, c.heads * d)
        if c.o_bias:
            self._p(f"{i}.o_bias", h)
        self.declare_mlp(i)

    def declare_mlp(self, i: int) -> None:
        c = self.cfg
        if c.is_moe and i >= c.first_dense_layers:
            self._p(f"{i}.router", c.num_experts, c.hidden)
            # experts a quantised checkpoint keeps quantised take no 16-bit memory (a GPTQ Mixtral's
            # experts in bf16 would not fit where their int4 codes do); the loader fills them
            meta = quantised_experts(c) is not None
            self._p(f"{i}.w13", c.num_experts, 2 * c.moe_intermediate, c.hidden, meta=meta)
            self._p(f"{i}.w2", c.num_experts, c.hidden, c.moe_intermediate, meta=meta)
            if c.router_bias:  # fp32, as HF keeps e_score_correction_bias
                self.params[f"{i}.router_bias"] = torch.empty(c.num_experts, device=self.device, dtype=torch.float32)
            if c.shared_experts:
                si = c.shared_width
                self._p(f"{i}.shared_gate_up", 2 * si, c.hidden)
                self._p(f"{i}.shared_down", c.hidden, si)
                if c.shared_gate:
                    self._p(f"{i}.shared_gate", 1, c.hidden)
        else:
            self._p(f"{i}.gate_up", 2 * c.intermediate, c.hidden)
            self._p(f"{i}.down", c.hidden, c.intermediate)
            if c.mlp_bias:
                self._p(f"{i}.gate_up_bias", 2 * c.intermediate)
                self._p(f"{i}.down_bias", c.hidden)

    # ---- weights --------------------------------------------------------------------------
    def random_(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights. Experts a quantised config keeps quantised (declared without memory) are
        drawn one layer's matrix at a time and quantised at once, as a load would leave them: the
        model never holds its experts in 16 bits."""
        index = {n: i for i, n in enumerate(sorted(self.params))}
        meta = [n for n, t in self.params.items() if t.is_meta]
        fill_random({n: t for n, t in self.params.items() if not t.is_meta}, seed=seed, std=std, index=index)
        eq = quantised_experts(self.cfg) if meta else None
        wq = self.cfg.extra.get("weight_quant") or {}
        for n in meta:
            w = torch.empty(self.params[n].shape, device=self.device, dtype=self.dtype)
            fill_random({n: w}, seed=seed, std=std, index=index)
            self._quantize_expert(n, w, *eq, zero_point=bool(eq[0] == "int4" and wq.get("zero_point")))
        if meta:
            self.expert_quant = eq

    def quant_names(self) -> list:
        """The linear weights that weight-only quantisation applies to: the attention and dense
        MLP projections (the router, the MoE experts, the embedding and the LM head stay in the
        model's dtype)."""
        out = []
        for i in range(self.cfg.layers):
            out += [n for n in (f"{i}.qkv", f"{i}.o", f"{i}.gate_up", f"{i}.down") if n in self.params]
        return out

    def _fp8_params(self, dtype=torch.float8_e4m3fn) -> dict:
        """The projections of ``quant_names`` as fp8 (or int8) parameters with an fp32 scale per row;
        returns {id(weight): scale} for the Loader."""
        out = {}
        for n in self.quant_names():
            w = self.params[n] = torch.empty(self.params[n].shape, dtype=dtype, device=self.device)
            out[id(w)] = self.params[f"{n}.scale"] = torch.empty(w.shape[0], dtype=torch.float32, device=self.device)
        return out

    def _block_params(self, b: int) -> dict:
        """The projections of ``quant_names`` as fp8 parameters with an fp32 scale per b x b block;
        returns {id(weight): scale} for the Loader."""
        out = {}
        for n in self.quant_names():
            N, K = self.params[n].shape
            w = self.params[n] = torch.empty(N, K, dtype=torch.float8_e4m3fn, device=self.device)
            out[id(w)] = self.params[f"{n}.scale"] = torch.empty(-(-N // b), -(-K // b), device=self.device)
        return out

    def _int4_params(self) -> dict:
        """The projections of ``quant_names`` as placeholders the Loader replaces by packed int4
        parameters; returns {id(placeholder): (placeholder, params, name)} (the entry holds the
        placeholder, so that its id is not reused while the entry lives)."""
        out = {}
        for n in self.quant_names():
            w = self.params[n] = torch.empty(self.params[n].shape, device="meta")
            out[id(w)] = (w, self.params, n)
        return out

    @torch.no_grad()
    def quantize_experts_(self, fmt: str, group: Optional[int], zero_point: bool = False) -> None:
        """The routed experts in ``fmt`` ("int4": a scale per ``group`` input channels, int4_group's
        rule; "fp8-block": per ``group`` x ``group`` block), per expert, as the MoE kernels read them:
        ``<layer>.w13`` / ``.w2`` and their ``_scale`` (and int4 ``_zero``)."""
        for n in [n for n in self.params if n.endswith((".w13", ".w2"))]:
            self._quantize_expert(n, self.params[n], fmt, group, zero_point)
        self.expert_quant = (fmt, group)

    def _quantize_expert(self, n: str, w: torch.Tensor, fmt: str, group: Optional[int], zero_point: bool) -> None:
        """Parameter ``n`` (experts [E, rows, K]) from the 16-bit ``w``, quantised per expert."""
        self.params[n], self.params[f"{n}_scale"], zero = quantize_experts(w, fmt, group, zero_point)
        if zero is not None:
            self.params[f"{n}_zero"] = zero

    def expert_bytes_per_param(self) -> float:
        """Bytes a routed-expert parameter takes as stored (codes, scales and zero codes over the
        dense parameter count); the model's dtype size where the experts are not quantised."""
        names = [n for n in self.params if n.endswith((".w13", ".w2"))]
        return self._bytes_per_param(names, "_") or float(self.dtype.itemsize)

    def _bytes_per_param(self, names: list, sep: str) -> float:
        """Bytes of weights ``names`` as stored, with their ``<name><sep>scale`` / ``<sep>zero``, over
        their dense parameter count (int4: eight codes a word); 0.0 for no weights."""
        nbytes = params = 0
        for n in names:
            w = self.params[n]
            params += w.numel() * (8 if w.dtype == torch.int32 else 1)
            nbytes += sum(self.params[k].numel() * self.params[k].element_size()
                          for k in (n, f"{n}{sep}scale", f"{n}{sep}zero") if k in self.params)
        return nbytes / params if params else 0.0

    @torch.no_grad()
    def quantize_(self, fmt: str, lm_head: bool = False, group_size: Optional[int] = None,
                  zero_point: bool = False) -> list:
        """Weight-only ``fmt`` in place: "fp8" e4m3 / "int8" with one scale per output channel,
        "int4" with one per ``group_size`` input channels (int4_group: one a row where it does not
        divide the input size), symmetric or with ``zero_point``s. Each weight of ``quant_names`` becomes its
        quantised tensor, its scale ``<name>.scale`` (fp32), int4's zero codes ``<name>.zero``;
        ``lm_head``: the LM head too where it is not the embedding table (a tied one is read by
        the embedding lookup; not int4). Returns the names quantised."""
        names = self.quant_names() + (["lm_head"] if lm_head and "lm_head" in self.params and fmt != "int4" else [])
        for n in names:
            if fmt == "int4":
                k = self.params[n].shape[1]
                wq, scale, zero = quantize_int4(self.params[n], int4_group(k, group_size), zero_point)
                if zero is not None:
                    self.params[f"{n}.zero"] = zero
            elif fmt == "fp8-block":
                wq, scale = quantize_fp8_block(self.params[n], group_size)
            else:
                wq, scale = quantize_weight(self.params[n], fmt)
            self.params[n] = wq
            self.params[f"{n}.scale"] = scale
        return names

    def quantised_bytes_per_param(self) -> float:
        """Bytes a parameter of the quantised projections (``quant_names``, and the LM head where
        quantised) takes as stored: the weights', scales' and zero codes' bytes over the dense
        parameter count."""
        names = self.quant_names() + (["lm_head"] if "lm_head.scale" in self.params else [])
        return self._bytes_per_param(names, ".") or 1.0

    def linear(self, ops, key: str, name: str, x: torch.Tensor, bias: Optional[torch.Tensor] = None):
        """``ops.gemm[key]`` on weight ``name`` with what its format keeps beside it: a scale,
        int4 zero codes, and an act-order checkpoint's channel order (x's columns permuted into the
        weight's group order)."""
        P = self.params
        perm = P.get(f"{name}.perm")
        if perm is not None:
            x = x[:, perm]
        zero = P.get(f"{name}.zero")
        if zero is not None:
            return ops.gemm[key](x, P[name], bias, P[f"{name}.scale"], zero)
        return ops.gemm[key](x, P[name], bias, P.get(f"{name}.scale"))

    def load(self, source) -> list:
        """Fill every parameter from an HF-named source; returns source names left unused. An fp8
        checkpoint (``cfg.extra["weight_quant"]``) keeps the projections of ``quant_names`` in fp8
        with a scale per row; its other quantised tensors are dequantised (``self.dequantised``)."""
        wq = self.cfg.extra.get("weight_quant") or {}
        int4 = wq.get("format") == "int4"
        scales = {"fp8": lambda: self._fp8_params(), "int8": lambda: self._fp8_params(torch.int8),
                  "fp8-block": lambda: self._block_params(wq["group_size"])}.get(wq.get("format"))
        L = Loader(source, self.device, self.dtype, scales() if scales else None, wq.get("block"),
                   int4=wq if int4 else None, int4_params=self._int4_params() if int4 else None)
        self.expert_quant = quantised_experts(self.cfg) if self._experts_stored_quantised(L) else None
        if not self.expert_quant:  # experts stored in 16 bits: read as they are
            self.dense()
        self.dequantised = L.dequantised
        self.kv_layer_scales = kv_layer_scales(L, self.cfg.layers, wq.get("kv_scales"))
        P = self.params
        L.copy(P["embed"], "model.embed_tokens.weight")
        for i in range(self.cfg.layers):
            self.load_layer(L, i)
        L.copy(P["norm"], "model.norm.weight")
        if "lm_head" in P:
            L.copy(P["lm_head"], "lm_head.weight")
        source.close()
        return L.unused()

    def load_layer(self, L: Loader, i: int) -> None:
        P, pre = self.params, f"model.layers.{i}"
        L.copy(P[f"{i}.in_norm"], f"{pre}.input_layernorm.weight")
        L.copy(P[f"{i}.post_norm"], f"{pre}.post_attention_layernorm.weight")
        a = f"{pre}.self_attn"
        if self.cfg.arch == "phi3":  # stored fused, in our order (q, k, v)
            L.copy(P[f"{i}.qkv"], f"{a}.qkv_proj.weight")
        else:
            L.cat(P[f"{i}.qkv"], [f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"])
        if self.cfg.attention_bias:
            L.cat(P[f"{i}.qkv_bias"], [f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias"])
        if self.cfg.qk_norm:
            L.copy(P[f"{i}.q_norm"], f"{a}.q_norm.weight")
            L.copy(P[f"{i}.k_norm"], f"{a}.k_norm.weight")
        L.copy(P[f"{i}.o"], f"{a}.o_proj.weight")
        if self.cfg.o_bias:
            L.copy(P[f"{i}.o_bias"], f"{a}.o_proj.bias")
        self.load_mlp(L, i)

    def _experts_of(self, L: Loader, i: int) -> tuple:
        """(module prefix, names of gate, up, down in the per-expert layout) of layer i's experts."""
        pre = f"model.layers.{i}.mlp"
        if self.cfg.arch == "mixtral" and not L.has(f"{pre}.gate.weight"):
            return f"model.layers.{i}.block_sparse_moe", ("w1", "w3", "w2")
        return pre, ("gate_proj", "up_proj", "down_proj")

    def _experts_stored_quantised(self, L: Loader) -> bool:
        """Whether the checkpoint stores its routed experts in its quantised format (an expert
        per module, as GPTQ, AWQ, llm-compressor and the fp8 releases write them); a checkpoint that
        keeps them in 16 bits loads them as stored."""
        fmt = (quantised_experts(self.cfg) or (None,))[0]
        i = next((i for i in range(self.cfg.layers) if f"{i}.w13" in self.params), None)
        if fmt is None or i is None:
            return False
        pre, legacy = self._experts_of(L, i)
        name = f"{pre}.experts.0.{legacy[0]}.weight"
        return L.is_int4(name) if fmt == "int4" else L.has(name) and L._scale_name(name) is not None

    def load_mlp(self, L: Loader, i: int) -> None:
        P, c = self.params, self.cfg
        pre = f"model.layers.{i}.mlp"
        if f"{i}.w13" in P:
            pre, legacy = self._experts_of(L, i)
            L.copy(P[f"{i}.router"], f"{pre}.gate.weight")
            if c.router_bias:
                L.copy(P[f"{i}.router_bias"], f"{pre}.gate.e_score_correction_bias")
            if self.expert_quant:
                P.update({f"{i}.{k}": v for k, v in L.quantised_experts(
                    pre, legacy, c.num_experts, c.moe_intermediate, c.hidden, self.expert_quant[0]).items()})
            else:
                L.experts(P[f"{i}.w13"], P[f"{i}.w2"], pre, legacy)
            if c.shared_experts:
                s = f"{pre}.shared_expert" if c.shared_gate else f"{pre}.shared_experts"  # Qwen2-MoE: one, gated
                L.cat(P[f"{i}.shared_gate_up"], [f"{s}.gate_proj.weight", f"{s}.up_proj.weight"])
                L.copy(P[f"{i}.shared_down"], f"{s}.down_proj.weight")
                if c.shared_gate:
                    L.copy(P[f"{i}.shared_gate"], f"{pre}.shared_expert_gate.weight")
        else:
            if c.arch == "phi3":  # gate rows then up rows, as ours
                L.copy(P[f"{i}.gate_up"], f"{pre}.gate_up_proj.weight")
            else:
                L.cat(P[f"{i}.gate_up"], [f"{pre}.gate_proj.weight", f"{pre}.up_proj.weight"])
            L.copy(P[f"{i}.down"], f"{pre}.down_proj.weight")
            if c.mlp_bias:
                L.cat(P[f"{i}.gate_up_bias"], [f"{pre}.gate_proj.bias", f"{pre}.up_proj.bias"])
                L.copy(P[f"{i}.down_bias"], f"{pre}.down_proj.bias")

    # ---- forward --------------------------------------------------------------------------
    def forward(self, ops, st: Step, kv: list) -> torch.Tensor:
        """Logits (fp32) of the rows ``st.logits_idx`` (all rows when None)."""
        out, residual = self.layers(ops, st, kv)
        if st.logits_idx is not None:
            out, residual = out[st.logits_idx], residual[st.logits_idx]
        return self.head(ops, out, residual)

    def layers(self, ops, st: Step, kv: list) -> tuple:
        """(last MLP output, residual) of every row: the decoder without its final norm and LM head
        (a prefill CUDA graph ends here; the head runs on the sampled rows only)."""
        P, c = self.params, self.cfg
        eps = c.rms_eps
        residual = P["embed"][st.input_ids]  # a fresh tensor: add_rmsnorm may update it in place
        h = ops.rmsnorm(residual, P["0.in_norm"], eps)
        out = None
        for i in range(c.layers):
            if i > 0:
                h = ops.add_rmsnorm(out, residual, P[f"{i}.in_norm"], eps)
            a = self.attention(ops, st, kv[i], i, h)
            h = ops.add_rmsnorm(a, residual, P[f"{i}.post_norm"], eps)
            out = self.mlp(ops, i, h)
        return out, residual

    def head(self, ops, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the rows given: the last residual add, the final norm and the LM head."""
        h = ops.add_rmsnorm(out, residual, self.params["norm"], self.cfg.rms_eps)
        logits = ops.gemm["lm_head"](h, self.params.get("lm_head", self.params["embed"]), None,
                                     self.params.get("lm_head.scale"))
        return logits.float()

    def attention(self, ops, st: Step, kv, i: int, h: torch.Tensor) -> torch.Tensor:
        P, c = self.params, self.cfg
        T, d = h.shape[0], c.head_dim
        qkv = self.linear(ops, "qkv", f"{i}.qkv", h, P.get(f"{i}.qkv_bias"))
        qd, kd = c.heads * d, c.kv_heads * d
        if c.qk_norm and not ops.qk_norm_in_rope_append:
            # q and k heads side by side in the qkv row: one in-place launch normalises both.
            ops.qk_norm(qkv[:, :qd + kd].view(T, c.heads + c.kv_heads, d), P[f"{i}.q_norm"], P[f"{i}.k_norm"],
                        c.heads, c.rms_eps)
        q = qkv[:, :qd].view(T, c.heads, d)
        k = qkv[:, qd:qd + kd].view(T, c.kv_heads, d)
        v = qkv[:, qd + kd:].view(T, c.kv_heads, d)
        k_cache, v_cache = kv
        skw = self.kv_kw(i)  # the fp8 cache's scales, or nothing
        if ops.rope_append is not None:
            kw = {"qk_norm": (P[f"{i}.q_norm"], P[f"{i}.k_norm"], c.rms_eps)} if ops.qk_norm_in_rope_append else {}
            ops.rope_append(q, k, v, st.positions, self.cos_sin_of(i), c.rope_style, k_cache, v_cache, st.slot_mapping,
                            **skw, **kw)
        else:
            ops.rope(q, k, st.positions, self.cos_sin_of(i), c.rope_style)
            ops.kv_append(k, v, k_cache, v_cache, st.slot_mapping, **skw)
        win = {**self.attention_kw(i), **skw}
        if st.is_decode:
            kw = {"workspace": st.workspace} if st.workspace is not None else {}
            o = ops.attention(q, k_cache, v_cache, st.seq_lens, st.block_tables, scale=self.scale, **kw, **win)
        else:
            o = ops.attention(q, k_cache, v_cache, st.cu_seqlens_q, st.seq_lens, st.block_tables,
                              scale=self.scale, **win)
        return self.linear(ops, "o", f"{i}.o", o.reshape(T, qd), P.get(f"{i}.o_bias"))

    def cos_sin_of(self, i: int) -> torch.Tensor:
        """The RoPE cache of layer i: Gemma-3's sliding layers have their own base."""
        return self.cos_sin_local if self.cfg.local_rope_theta and self.cfg.window_of(i) else self.cos_sin

    def attention_kw(self, i: int) -> dict:
        """The attention call's window (and, in subclasses, soft cap) for layer i."""
        w = self.cfg.window_of(i)
        return {"window": w} if w else {}

    def expert_scales(self, i: int) -> dict:
        """The scales (and int4 zero codes) of layer i's quantised experts, by ``moe``'s argument names."""
        P = self.params
        return {k: P[f"{i}.{k}"] for k in ("w13_scale", "w2_scale", "w13_zero", "w2_zero") if f"{i}.{k}" in P}

    def mlp(self, ops, i: int, h: torch.Tensor) -> torch.Tensor:
        P, c = self.params, self.cfg
        if f"{i}.w13" in P:
            # bf16 logits as they are: every routing backend upcasts them itself (exactly, as
            # HF's softmax(dtype=float) does), and a .float() here was one more kernel per layer
            # in the decode graph (48 per Qwen3-30B-A3B step), outside the PDL chain.
            logits = ops.gemm["router"](h, P[f"{i}.router"])
            out = ops.moe(h, logits, P[f"{i}.w13"], P[f"{i}.w2"], c.top_k, router=c.router,
                          renormalize=c.norm_topk_prob, n_group=c.n_group, topk_group=c.topk_group,
                          routed_scaling=c.routed_scaling, score_bias=P.get(f"{i}.router_bias"),
                          **self.expert_scales(i))
            if c.shared_experts:
                if "shared_gate_up_act" in ops.gemm:  # its activation in the gate/up GEMM's epilogue
                    a = ops.gemm["shared_gate_up_act"](h, P[f"{i}.shared_gate_up"])
                else:
                    a = ops.shared_act(ops.gemm["shared_gate_up"](h, P[f"{i}.shared_gate_up"]))
                if "shared_down_add" in ops.gemm:  # the routed experts' sum in the down GEMM's epilogue
                    return ops.gemm["shared_down_add"](a, P[f"{i}.shared_down"], out)
                s = ops.gemm["shared_down"](a, P[f"{i}.shared_down"])
                if c.shared_gate:  # Qwen2-MoE: sigmoid(h @ w_gate) [T, 1] scales the shared expert
                    s = torch.sigmoid(ops.gemm["shared_gate"](h, P[f"{i}.shared_gate"])) * s
                out = out + s
            return out
        if "gate_up_act" in ops.gemm:  # the gated activation in the gate/up GEMM's epilogue
            a = self.linear(ops, "gate_up_act", f"{i}.gate_up", h, P.get(f"{i}.gate_up_bias"))
        else:
            a = ops.act(self.linear(ops, "gate_up", f"{i}.gate_up", h, P.get(f"{i}.gate_up_bias")))
        return self.linear(ops, "down", f"{i}.down", a, P.get(f"{i}.down_bias"))

    # ---- KV cache ---------------------------------------------------------------------------
    def set_kv_dtype(self, kv: Optional[str]) -> None:
        """``"fp8"``: e4m3 caches, stored as value / scale with one fp32 scale per KV head (1.0 for
        every layer: the same two tensors serve all); the append and attention calls get them."""
        if kv != "fp8":
            return
        self.kv_dtype = torch.float8_e4m3fn
        one = torch.ones(self.cfg.kv_heads, device=self.device, dtype=torch.float32)
        self.kv_scale_kw = {"k_scale": one, "v_scale": one.clone()}
        if self.kv_layer_scales:  # the checkpoint's, one per layer, the same for each KV head
            self.kv_layer_kw = [{"k_scale": one * ks, "v_scale": one * vs} for ks, vs in self.kv_layer_scales]

    def kv_kw(self, i: int) -> dict:
        """The scale arguments of layer i's append and attention ({} for a cache in the model's dtype)."""
        return self.kv_layer_kw[i] if self.kv_layer_kw else self.kv_scale_kw

    def kv_bytes_per_page(self, page_size: int) -> int:
        c = self.cfg
        return 2 * c.layers * page_size * c.kv_heads * c.head_dim * torch.tensor([], dtype=self.kv_dtype).element_size()

    def make_kv(self, num_pages: int, page_size: int) -> list:
        c = self.cfg
        shape = (c.layers, num_pages, page_size, c.kv_heads, c.head_dim)
        k = torch.zeros(shape, device=self.device, dtype=self.kv_dtype)
        v = torch.zeros(shape, device=self.device, dtype=self.kv_dtype)
        return [(k[i], v[i]) for i in range(c.layers)]

    def rope_dim(self) -> int:
        return self.cfg.head_dim
