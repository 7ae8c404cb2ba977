"""Model presets with real models' shapes and their tiny CPU versions (the operators of one step
of a model are its step map: ``opmap.model.step``).

Shapes follow the models' published config.json files. ``tiny-*`` presets keep the
architecture (GQA ratio, MoE routing, MLA ranks scaled down, RoPE style) at sizes a CPU runs
in seconds.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional



@dataclass(frozen=True)
class ModelConfig:
    name: str
    arch: str  # llama / mistral / phi3 / gemma2 / gemma3_text / qwen2 / qwen3 / mixtral / qwen2_moe / qwen3_moe / deepseek_v2 / deepseek_v3
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_position: int = 8192
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    rope_style: str = "neox"
    rms_eps: float = 1e-5
    sliding_window: Optional[int] = None  # every layer attends to the last W keys (Mistral)
    attention_bias: bool = False  # q/k/v projection biases
    o_bias: bool = False  # output projection bias (Llama and Qwen3 with attention_bias; not Qwen2)
    mlp_bias: bool = False  # gate/up/down projection biases (Llama's mlp_bias)
    qk_norm: bool = False
    tie_embeddings: bool = False
    activation: str = "silu"  # of the gated MLP: silu / gelu_tanh (Gemma)
    # Gemma: the embedding times sqrt(hidden), norm weights stored as offset + w, a norm after the
    # attention and after the MLP too (before their residual adds), tanh caps on the attention
    # scores and the final logits, a softmax scale of query_scale ** -0.5, and per-layer windows.
    embed_scale: bool = False
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    attn_soft_cap: Optional[float] = None
    final_soft_cap: Optional[float] = None
    query_scale: Optional[float] = None
    layer_types: tuple = ()  # "sliding" / "full" per layer; () = every layer as sliding_window says
    local_rope_theta: Optional[float] = None  # RoPE base of the sliding layers where it differs (Gemma-3)
    # MoE
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_experts: int = 0
    shared_intermediate: int = 0  # the shared experts' width when it is not shared_experts x moe_intermediate (Qwen2-MoE)
    shared_gate: bool = False  # sigmoid(h @ w_gate) scales the shared experts' output (Qwen2-MoE)
    router_bias: bool = False  # experts chosen on sigmoid scores + a per-expert bias (DeepSeek-V3)
    norm_topk_prob: bool = True
    router: str = "softmax"
    first_dense_layers: int = 0
    routed_scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    # MLA
    kv_lora_rank: int = 0
    q_lora_rank: Optional[int] = None
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        # A config cut to its first n layers (tests, check cases at real widths) keeps the first n
        # layer types; fewer types than layers is a malformed config.
        if self.layer_types and len(self.layer_types) != self.layers:
            if len(self.layer_types) < self.layers:
                raise ValueError(f"{self.name}: {len(self.layer_types)} layer_types for {self.layers} layers")
            object.__setattr__(self, "layer_types", tuple(self.layer_types[:self.layers]))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def shared_width(self) -> int:
        """Intermediate width of the shared experts (one MLP), 0 without them."""
        return self.shared_intermediate or self.shared_experts * self.moe_intermediate

    def window_of(self, layer: int) -> Optional[int]:
        """The sliding window of a layer (None: full attention)."""
        if self.layer_types:
            return self.sliding_window if self.layer_types[layer] == "sliding" else None
        return self.sliding_window

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def default_page_size(self, arch: str = "cpu") -> int:
        """Tokens per KV page when none is asked for: 64 for MLA models (the MLA decode's TMA kernel
        tiles 64 keys of one page; docs/mla.md) and on sm90 (the TMA prefill reads whole 64-key
        tiles of one page, faster than the gather prefill on 16-token pages, decode steps the same:
        docs/engine.md, Decisions, KV pages of 64 tokens), 16 otherwise."""
        return 64 if self.is_mla or arch == "sm90" else 16

    def decode_weight_bytes(self, rows: float, bytes_per_param: float = 2.0, quantised: bool = False,
                            lm_head: bool = False, bytes_per_quantised: float = 1.0,
                            bytes_per_expert: Optional[float] = None) -> float:
        """Bytes of the weights one decode step of ``rows`` sequences reads: every dense weight and
        the LM head, not the embedding table (``rows`` rows of it; unless tied to the LM head), and
        of each MoE layer's routed experts the expected number of distinct ones that rows x top_k
        uniform picks hit, E (1 - (1 - k/E)^rows). ``quantised``: the projections of weight-only
        quantisation (``quantised_params``) at ``bytes_per_quantised`` each (fp8 / int8: one byte;
        int4: half a byte and its share of the group scales); ``lm_head``: the LM head too (``opmap
        run --quantize`` quantises an LM head of its own); ``bytes_per_expert``: the routed experts'
        bytes per parameter as stored, where they are quantised."""
        total = self.num_params() - (0 if self.tie_embeddings else self.vocab * self.hidden)
        active = 0.0
        if self.is_moe:
            E, k = self.num_experts, self.top_k
            hit = E * (1 - (1 - k / E) ** max(rows, 1))
            per_expert = (self.layers - self.first_dense_layers) * 3 * self.hidden * self.moe_intermediate
            total -= E * per_expert  # the experts are counted below, those a step reads
            active = hit * per_expert
        q = self.quantised_params() if quantised else 0
        if quantised and lm_head and not self.tie_embeddings:
            q += self.vocab * self.hidden
        expert = active * (bytes_per_param if bytes_per_expert is None else bytes_per_expert)
        return (total - q) * bytes_per_param + q * bytes_per_quantised + expert

    def quantised_params(self) -> int:
        """Parameters of the projections weight-only quantisation applies to (the engine's
        DecoderModel.quant_names): attention QKV and O (MLA: O only), the dense MLP layers."""
        h = self.hidden
        attn = self.heads * self.v_head_dim * h if self.is_mla else self._gqa_attn_params()
        dense = self.first_dense_layers if self.is_moe else self.layers
        return self.layers * attn + dense * 3 * h * self.intermediate

    def _gqa_attn_params(self) -> int:
        """QKV and O of one GQA layer."""
        h, d = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h

    def num_params(self) -> int:
        h, L = self.hidden, self.layers
        if self.is_mla:
            qk = self.qk_nope_dim + self.qk_rope_dim
            attn = (h * self.heads * qk + h * (self.kv_lora_rank + self.qk_rope_dim)
                    + self.kv_lora_rank * self.heads * (self.qk_nope_dim + self.v_head_dim)
                    + self.heads * self.v_head_dim * h)
        else:
            attn = self._gqa_attn_params()
        dense_mlp = 3 * h * self.intermediate
        if self.is_moe:
            moe = self.num_experts * 3 * h * self.moe_intermediate + h * self.num_experts
            moe += 3 * h * self.shared_width + (h if self.shared_gate else 0)
            mlp_total = self.first_dense_layers * dense_mlp + (L - self.first_dense_layers) * moe
        else:
            mlp_total = L * dense_mlp
        emb = self.vocab * h * (1 if self.tie_embeddings else 2)
        return L * attn + mlp_total + emb


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
DSV2_LITE_YARN = {"type": "yarn", "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

PRESETS: dict[str, ModelConfig] = {}


def _add(cfg: ModelConfig) -> ModelConfig:
    PRESETS[cfg.name] = cfg
    return cfg


_add(ModelConfig("llama3-8b", "llama", 4096, 32, 32, 8, 128, 14336, 128256, max_position=131072,
                 rope_theta=500000.0, rope_scaling=LLAMA3_SCALING))
_add(ModelConfig("qwen2.5-7b", "qwen2", 3584, 28, 28, 4, 128, 18944, 152064, max_position=32768,
                 rope_theta=1e6, rms_eps=1e-6, attention_bias=True))
_add(ModelConfig("qwen3-8b", "qwen3", 4096, 36, 32, 8, 128, 12288, 151936, max_position=40960,
                 rope_theta=1e6, rms_eps=1e-6, qk_norm=True))
_add(ModelConfig("mistral-7b", "mistral", 4096, 32, 32, 8, 128, 14336, 32000, max_position=32768,
                 rope_theta=10000.0, sliding_window=4096))
_add(ModelConfig("mixtral-8x7b", "mixtral", 4096, 32, 32, 8, 128, 14336, 32000, max_position=32768,
                 rope_theta=1e6, num_experts=8, top_k=2, moe_intermediate=14336))
_add(ModelConfig("qwen3-30b-a3b", "qwen3_moe", 2048, 48, 32, 4, 128, 6144, 151936, max_position=40960,
                 rope_theta=1e6, rms_eps=1e-6, qk_norm=True, num_experts=128, top_k=8,
                 moe_intermediate=768))
_add(ModelConfig("deepseek-v2-lite", "deepseek_v2", 2048, 27, 16, 16, 192, 10944, 102400,
                 max_position=163840, rope_theta=10000.0, rope_scaling=DSV2_LITE_YARN, rms_eps=1e-6,
                 rope_style="gptj", num_experts=64, top_k=6, moe_intermediate=1408, shared_experts=2,
                 norm_topk_prob=False, first_dense_layers=1, kv_lora_rank=512, qk_nope_dim=128,
                 qk_rope_dim=64, v_head_dim=128))

DSV3_YARN = {"type": "yarn", "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
_add(ModelConfig("deepseek-v3", "deepseek_v3", 7168, 61, 128, 128, 192, 18432, 129280, max_position=163840,
                 rope_theta=10000.0, rope_scaling=DSV3_YARN, rms_eps=1e-6, rope_style="gptj", num_experts=256,
                 top_k=8, moe_intermediate=2048, shared_experts=1, norm_topk_prob=True, router="sigmoid_grouped",
                 router_bias=True, first_dense_layers=3, routed_scaling=2.5, n_group=8, topk_group=4,
                 kv_lora_rank=512, q_lora_rank=1536, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128))
_add(ModelConfig("phi3-mini", "phi3", 3072, 32, 32, 32, 96, 8192, 32064, max_position=4096, rope_theta=10000.0,
                 sliding_window=2047))
_add(ModelConfig("gemma2-9b", "gemma2", 3584, 42, 16, 8, 256, 14336, 256000, max_position=8192, rope_theta=10000.0,
                 rms_eps=1e-6, tie_embeddings=True, activation="gelu_tanh", embed_scale=True, norm_offset=1.0,
                 sandwich_norms=True, attn_soft_cap=50.0, final_soft_cap=30.0, query_scale=256.0,
                 sliding_window=4096, layer_types=tuple("sliding" if i % 2 == 0 else "full" for i in range(42))))
_add(ModelConfig("gemma3-4b", "gemma3_text", 2560, 34, 8, 4, 256, 10240, 262208, max_position=131072,
                 rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0}, local_rope_theta=10000.0,
                 rms_eps=1e-6, tie_embeddings=True, activation="gelu_tanh", embed_scale=True, norm_offset=1.0,
                 sandwich_norms=True, qk_norm=True, query_scale=256.0, sliding_window=1024,
                 layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(34))))
_add(ModelConfig("qwen1.5-moe-a2.7b", "qwen2_moe", 2048, 24, 16, 16, 128, 5632, 151936, max_position=8192,
                 rope_theta=1e6, rms_eps=1e-6, attention_bias=True, num_experts=60, top_k=4, moe_intermediate=1408,
                 shared_experts=1, shared_intermediate=5632, shared_gate=True, norm_topk_prob=False))


def _tiny(base: str, **kw) -> ModelConfig:
    cfg = dataclasses.replace(PRESETS[base], name="tiny-" + base.split("-")[0].replace(".5", ""), **kw)
    return _add(cfg)


_TINY_COMMON = dict(hidden=64, layers=2, head_dim=16, intermediate=128, vocab=512, max_position=2048)
# The tiny presets' RoPE scaling keeps its kind, with the original context under their 2048
# positions (HF warns about a scaling whose original context exceeds the model's).
_tiny("llama3-8b", heads=4, kv_heads=2, rope_scaling=dict(LLAMA3_SCALING, original_max_position_embeddings=1024),
      **_TINY_COMMON)  # tiny-llama3
_tiny("qwen2.5-7b", heads=4, kv_heads=2, **_TINY_COMMON)  # tiny-qwen2
_tiny("qwen3-8b", heads=4, kv_heads=2, **_TINY_COMMON)  # tiny-qwen3
_tiny("mistral-7b", heads=4, kv_heads=2, sliding_window=8, **_TINY_COMMON)  # tiny-mistral
_tiny("mixtral-8x7b", heads=4, kv_heads=2, num_experts=4, top_k=2, moe_intermediate=96,
      **_TINY_COMMON)  # tiny-mixtral
PRESETS["tiny-qwen3moe"] = dataclasses.replace(
    PRESETS["qwen3-30b-a3b"], name="tiny-qwen3moe", heads=4, kv_heads=2, num_experts=8, top_k=2,
    moe_intermediate=32, **_TINY_COMMON)
PRESETS["tiny-deepseek"] = dataclasses.replace(
    PRESETS["deepseek-v2-lite"], name="tiny-deepseek", hidden=64, layers=2, heads=4, kv_heads=4,
    rope_scaling=dict(DSV2_LITE_YARN, factor=4.0, original_max_position_embeddings=512),
    head_dim=24, intermediate=128, vocab=512, max_position=2048, num_experts=8, top_k=2,
    moe_intermediate=32, shared_experts=1, kv_lora_rank=32, qk_nope_dim=16, qk_rope_dim=8,
    v_head_dim=16)

PRESETS["tiny-deepseek-v3"] = dataclasses.replace(
    PRESETS["deepseek-v3"], name="tiny-deepseek-v3", hidden=64, layers=3, heads=4, kv_heads=4, head_dim=24,
    intermediate=128, vocab=512, max_position=2048, num_experts=8, top_k=2, moe_intermediate=32, shared_experts=1,
    first_dense_layers=1, n_group=4, topk_group=2, routed_scaling=2.5, kv_lora_rank=32, q_lora_rank=24,
    qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16, rope_scaling=None)
PRESETS["tiny-phi3"] = dataclasses.replace(PRESETS["phi3-mini"], name="tiny-phi3", heads=4, kv_heads=4,
                                            sliding_window=8, **_TINY_COMMON)
PRESETS["tiny-gemma2"] = dataclasses.replace(
    PRESETS["gemma2-9b"], name="tiny-gemma2", heads=4, kv_heads=2, attn_soft_cap=2.0, final_soft_cap=3.0,
    query_scale=24.0, sliding_window=8, layer_types=("sliding", "full", "sliding"),
    **dict(_TINY_COMMON, layers=3))
PRESETS["tiny-gemma3"] = dataclasses.replace(
    PRESETS["gemma3-4b"], name="tiny-gemma3", heads=4, kv_heads=2, query_scale=16.0, sliding_window=8,
    layer_types=("sliding", "sliding", "full"), rope_scaling={"rope_type": "linear", "factor": 4.0},
    **dict(_TINY_COMMON, layers=3))
PRESETS["tiny-qwen2moe"] = dataclasses.replace(
    PRESETS["qwen1.5-moe-a2.7b"], name="tiny-qwen2moe", heads=4, kv_heads=2, num_experts=8, top_k=2,
    moe_intermediate=32, shared_intermediate=48, **_TINY_COMMON)


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
