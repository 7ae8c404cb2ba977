"""The step map: the operators of one model step as the engine calls them, and their resolution.

``step_slots`` turns (ModelConfig, phase, engine settings) into the ordered slots of one forward
pass, each (key, label, op, spec, entry): the key is where the engine's op set keeps the callable
(``OpSet.<key>``, or ``OpSet.gemm[<key>]`` for a GEMM), the entry the backend function it runs.
``sampler_slots`` are the sampler stage's (logits processors, grammar bitmask, sample, logprobs);
``step_map`` is both, as the report lists a step. ``resolve`` puts each slot to the selector and
makes the decisions that depend on its answers: RoPE and the KV append in one launch where both
chose one backend that has a ``rope_append`` entry, Qwen3's q/k norm inside it where the norm chose
that backend too; MLA's latent norm, RoPE and latent append as one launch likewise; the gate/up
GEMM with its gated activation in the epilogue where the GEMM's backend has that entry. The engine's op
sets (``opmap.engine.opset``), ``opmap report``, ``opmap check --model`` and ``opmap bench --model``
all read these, so the rows the report prints are the calls the engine makes.

The slots are in the order of their first call in a forward pass (a model with dense first layers
runs its dense MLP before its MoE layers); a callable used at several places of a layer (the
RMSNorm of the first layer's input and of Gemma's post-attention / post-MLP norms; the add +
RMSNorm between blocks and before the LM head) is one slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from opmap.api.dispatch import entry_backend
from opmap.core import specs as S
from opmap.core.registry import Backend
from opmap.core.select import BackendError, Choice, select
from opmap.model.presets import ModelConfig
from opmap.ops.gemm.backends import MANY_ROWS
from opmap.ops.gemm.quant import int4_group
from opmap.ops.moe.backends import many_tokens


@dataclass(frozen=True)
class StepSettings:
    """The engine settings a step map depends on (``opmap.engine.opset.engine_settings`` derives
    them from an EngineConfig)."""

    arch: str  # "cpu" or "smNN"
    dtype: str = "bf16"  # activations and the dense weights
    page_size: Optional[int] = None  # None: ModelConfig.default_page_size(arch)
    kv_dtype: Optional[str] = None  # "fp8": the fp8 KV cache of GQA models; None: dtype
    weight_quant: Optional[str] = None  # weight-only "fp8" / "int8" / "int4" of the projections DecoderModel.quant_names
    group_size: Optional[int] = None  # int4: input channels a scale covers (None: one scale a row)
    quant_lm_head: bool = False  # the LM head quantised too
    experts: Optional[tuple] = None  # (format, group / block) of routed experts kept quantised (model.hf.quantised_experts)
    cuda_graph: bool = False  # the step is captured in a CUDA graph
    m: Optional[int] = None  # rows of the step (a decode batch bucket); None: any (eager prefill and mixed)


@dataclass(frozen=True)
class Slot:
    key: str  # the op set's name for the callable
    label: str
    op: str
    spec: S.Spec
    entry: str  # the backend's function that runs


@dataclass(frozen=True)
class Resolved:
    """A slot with the selector's answer: ``backend`` is the backend whose entry runs (the choice,
    or the next valid one that has the entry); ``error`` where none can serve (``resolve`` with
    ``strict=False``). ``folded``: the slots one launch took over (the fused RoPE + KV append)."""

    slot: Slot
    choice: Optional[Choice]
    backend: Optional[Backend]
    error: Optional[str] = None
    folded: tuple = ()

    key = property(lambda self: self.slot.key)
    label = property(lambda self: self.slot.label)
    op = property(lambda self: self.slot.op)
    spec = property(lambda self: self.slot.spec)
    entry = property(lambda self: self.slot.entry)


def step_slots(cfg: ModelConfig, phase: str, st: StepSettings) -> list[Slot]:
    """The slots of one forward pass of ``cfg`` in ``phase`` (prefill / mixed / decode)."""
    dtype, h = st.dtype, cfg.hidden
    base = dict(arch=st.arch, phase=phase)
    page = st.page_size or cfg.default_page_size(st.arch)
    graph = st.cuda_graph
    out: list[Slot] = []

    def add(key, label, op, spec, entry):
        out.append(Slot(key, label, op, spec, entry))

    def norm(key, label, hidden, entry="rmsnorm", fused_add=False):
        add(key, label, "rmsnorm", S.NormSpec(hidden=hidden, dtype=dtype, fused_add=fused_add, **base), entry)

    def gemm(key, label, n, k, bias=False, quantised=False):
        wd = st.weight_quant if quantised and st.weight_quant else dtype
        group = int4_group(k, st.group_size) if wd == "int4" else st.group_size if wd == "fp8-block" else None
        add(key, label, "gemm", S.GemmSpec(m=st.m, n=n, k=k, dtype=dtype, weight_dtype=wd, bias=bias, group_size=group,
                                           **base), "linear")

    def rope(head_dim):
        add("rope", "RoPE", "rope", S.RopeSpec(head_dim=head_dim, style=cfg.rope_style, scaling=_scaling(cfg),
                                              dtype=dtype, **base), "rope")

    norm("rmsnorm", "RMSNorm", h)
    if cfg.is_mla:
        qk = cfg.qk_nope_dim + cfg.qk_rope_dim
        if cfg.q_lora_rank:  # DeepSeek-V2 / V3: q = q_b(norm(q_a(x)))
            gemm("q_a", "q_a proj", cfg.q_lora_rank, h)
            norm("q_a_norm", "q_a norm", cfg.q_lora_rank)
            gemm("q_b", "q_b proj", cfg.heads * qk, cfg.q_lora_rank)
        else:
            gemm("q", "q proj", cfg.heads * qk, h)
        gemm("kv_a", "kv_a proj", cfg.kv_lora_rank + cfg.qk_rope_dim, h)
        norm("latent_norm", "kv_a norm", cfg.kv_lora_rank)
        rope(cfg.qk_rope_dim)
        # The latent cache stays in the model's dtype (MLAModel.set_kv_dtype refuses fp8).
        width = cfg.kv_lora_rank + cfg.qk_rope_dim
        add("kv_append", "latent KV append", "kv_append", S.KVAppendSpec(
            kind="mla", num_kv_heads=1, head_dim=width, page_size=page, dtype=dtype, kv_dtype=dtype,
            cuda_graph=graph, **base), "append_mla")
        add("attention", "MLA attention", "attention", S.AttentionSpec(
            kind="mla", num_heads=cfg.heads, num_kv_heads=1, head_dim=width, head_dim_v=cfg.kv_lora_rank,
            page_size=page, dtype=dtype, kv_dtype=dtype, cuda_graph=graph, **base),
            "mla_decode" if phase == "decode" else "mla_prefill")
        gemm("o", "O proj", h, cfg.heads * cfg.v_head_dim, quantised=True)
    else:
        kvd = st.kv_dtype or dtype
        gemm("qkv", "QKV proj", (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim, h, cfg.attention_bias, quantised=True)
        if cfg.qk_norm:
            norm("qk_norm", "q/k norm", cfg.head_dim, entry="qk_rmsnorm")
        rope(cfg.head_dim)
        add("kv_append", "KV append", "kv_append", S.KVAppendSpec(
            num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, page_size=page, dtype=dtype, kv_dtype=kvd,
            cuda_graph=graph, **base), "append")
        # One attention callable serves every layer; a layer's own window (Gemma, Mistral) and
        # soft cap are arguments of its call, so the spec asks for what any layer needs.
        add("attention", "attention (paged)", "attention", S.AttentionSpec(
            num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, page_size=page, dtype=dtype,
            kv_dtype=kvd, cuda_graph=graph, sliding_window=any(cfg.window_of(i) for i in range(cfg.layers)),
            soft_cap=bool(cfg.attn_soft_cap), **base), phase)
        gemm("o", "O proj", h, cfg.heads * cfg.head_dim, cfg.o_bias, quantised=True)
    norm("add_rmsnorm", "add + RMSNorm", h, entry="add_rmsnorm", fused_add=True)
    if not cfg.is_moe or cfg.first_dense_layers:
        gemm("gate_up", "gate/up proj", 2 * cfg.intermediate, h, cfg.mlp_bias, quantised=True)
        gelu = cfg.activation == "gelu_tanh"
        kind = "gelu_tanh_mul" if gelu else "silu_mul"
        add("act", "GELU-tanh * mul" if gelu else "SiLU * mul", "activation",
            S.ActivationSpec(kind=kind, hidden=cfg.intermediate, dtype=dtype, **base), kind)
        gemm("down", "down proj", h, cfg.intermediate, cfg.mlp_bias, quantised=True)
    if cfg.is_moe:
        gemm("router", "router", cfg.num_experts, h)
        efmt, egroup = st.experts or (dtype, None)
        add("moe", "MoE", "moe", S.MoESpec(
            num_experts=cfg.num_experts, top_k=cfg.top_k, hidden=h, intermediate=cfg.moe_intermediate,
            router=cfg.router, shared_experts=cfg.shared_experts, dtype=dtype, weight_dtype=efmt, tokens=st.m,
            group_size=int4_group(h, egroup) if efmt == "int4" else egroup, **base), "moe")
        if cfg.shared_experts:
            si = cfg.shared_width
            gemm("shared_gate_up", "shared gate/up proj", 2 * si, h)
            add("shared_act", "shared SiLU * mul", "activation", S.ActivationSpec(hidden=si, dtype=dtype, **base),
                "silu_mul")
            gemm("shared_down", "shared down proj", h, si)
            if cfg.shared_gate:
                gemm("shared_gate", "shared expert gate", 1, h)
    # The final norm is the add + RMSNorm slot; prefill's LM head runs on the sampled rows only.
    gemm("lm_head", "LM head", cfg.vocab, h, quantised=st.quant_lm_head)
    return out


def sampler_slots(vocab: int, arch: str) -> list[Slot]:
    """The sampler stage, in the order the engine runs it (engine/sampler.py). One set serves every
    step: it runs on the fp32 logits after the forward pass, outside any CUDA graph, so its specs
    are decode's and uncaptured whatever the step."""
    base = dict(arch=arch, phase="decode")
    logits = S.LogitsSpec(vocab=vocab, penalties=True, **base)
    return [Slot("penalties", "logits processors", "logits", logits, "apply_penalties"),
            Slot("bitmask", "grammar bitmask", "grammar_mask", S.GrammarMaskSpec(vocab=vocab, **base), "apply_bitmask"),
            Slot("sample", "sample (top-k/top-p/min-p)", "sampling",
                 S.SamplingSpec(vocab=vocab, top_k=True, top_p=True, min_p=True, **base), "sample"),
            Slot("logprobs", "logprobs", "logits", logits, "logprobs")]


def step_map(cfg: ModelConfig, phase: str, st: StepSettings) -> list[Slot]:
    """A step as the report lists it: the forward pass, and at decode the sampler stage."""
    return step_slots(cfg, phase, st) + (sampler_slots(cfg.vocab, st.arch) if phase == "decode" else [])


# Quantised weights: the weight-only GEMM backends are chosen by row count (GemmSpec.m), so an engine
# plans its eager mixed steps at these row counts as well as at M unknown (docs/dense.md, Decisions).
QUANTISED_MIXED_ROWS = (*(1 << i for i in range((MANY_ROWS // 2).bit_length())), MANY_ROWS)


def mixed_rows_of(tokens: int) -> Optional[int]:
    """The row count (of QUANTISED_MIXED_ROWS) whose plan a quantised engine's eager mixed step of
    ``tokens`` rows runs: the power of two at or above it up to MANY_ROWS / 2, MANY_ROWS from there on,
    None (the plan at M unknown) in between."""
    if tokens >= MANY_ROWS:
        return MANY_ROWS
    m = 1 << max(0, tokens - 1).bit_length()
    return m if m < MANY_ROWS else None


def many_tokens_of(cfg: ModelConfig) -> Optional[int]:
    """The fewest tokens a step needs for each routed expert to meet MANY_ROWS_AN_EXPERT rows on
    average (ops/moe/backends.py: from there the MoE selection of quantised experts may dequantise
    them once per call); None for a dense model."""
    if not cfg.is_moe:
        return None
    return many_tokens(cfg.num_experts, cfg.top_k)


def resolve(slots: list[Slot], forced: Optional[dict] = None, runtime: Optional[bool] = None,
            fuse_rope_append: bool = True, strict: bool = True, fuse_gated: bool = True,
            fuse_shared_add: bool = True) -> list[Resolved]:
    """Each slot with the selector's choice (``forced``: op -> backend name; ``runtime``: as
    ``select``'s, by default whether the slots' arch is this device's). ``strict``: a slot no
    backend can serve raises BackendError, else its row carries the error. ``fuse_rope_append``
    (EngineConfig.fuse_rope_append): RoPE and the GQA KV append as one launch where they chose one
    backend with a ``rope_append`` entry (the rope selection has then checked that backend's RoPE
    requirements); Qwen3's q/k norm rides in it where the norm chose that backend's name too.
    ``fuse_gated`` (EngineConfig.fuse_gated): the gate/up GEMM and its gated activation as one
    launch (``linear_act``) where the GEMM's backend has that entry and the activation chose the
    backend whose values it reproduces (GATED_FUSED). ``fuse_shared_add``
    (EngineConfig.fuse_shared_add): a shared expert's down GEMM sums the routed experts' output into
    its result (``linear_add``) where its backend has that entry."""
    forced = forced or {}
    rows = []
    for s in slots:
        try:
            ch = select(s.op, s.spec, backend=forced.get(s.op), runtime=runtime)
            rows.append(Resolved(s, ch, entry_backend(ch, s.entry)))
        except BackendError as e:
            if strict:
                raise
            rows.append(Resolved(s, None, None, str(e)))
    if fuse_rope_append:
        rows = _fuse_mla_norm_rope_append(_fuse_rope_append(rows))
    rows = _fuse_gated(rows) if fuse_gated else rows
    return _fuse_shared_add(rows) if fuse_shared_add else rows


def _fuse_shared_add(rows: list[Resolved]) -> list[Resolved]:
    """The shared expert's down GEMM with the routed experts' output as its addend (key
    ``shared_down_add``, the gemm entry ``linear_add``: the sum rounded once, in the GEMM's epilogue)
    where its backend has the entry and no sigmoid gate scales the shared output first (Qwen2-MoE)."""
    by = {r.key: r for r in rows}
    down = by.get("shared_down")
    if down is None or down.choice is None or "shared_gate" in by or "linear_add" not in down.choice.backend.impl:
        return rows
    return _splice(rows, Resolved(Slot("shared_down_add", f"{down.label} + routed experts' sum (one launch)", "gemm",
                                       down.spec, "linear_add"), down.choice, down.choice.backend, folded=(down,)))


# The activation backend whose values a GEMM backend's linear_act entry reproduces: the Triton
# epilogue computes the activation kernel's act_of on the two rounded outputs; the reference
# composes the references. Any other activation (torch-eager rounds elsewhere) keeps its launch.
GATED_FUSED = {"triton-decode": "triton", "triton-wo": "triton", "reference": "reference"}
GATED_ACTS = {"silu_mul": "silu", "gelu_tanh_mul": "gelu_tanh"}


def _fuse_gated(rows: list[Resolved]) -> list[Resolved]:
    """A gated MLP's gate/up GEMM with its SiLU / GELU-tanh * mul in the epilogue, the dense MLP's
    and the shared expert's: one launch each (keys ``gate_up_act``, ``shared_gate_up_act``; the gemm
    entry ``linear_act``) where the GEMM's backend has the entry and the activation chose the backend
    GATED_FUSED names for it."""
    for gemm, act in (("gate_up", "act"), ("shared_gate_up", "shared_act")):
        by = {r.key: r for r in rows}
        gu, a = by.get(gemm), by.get(act)
        if gu is None or a is None or gu.choice is None or a.choice is None or a.entry not in GATED_ACTS:
            continue
        b = gu.choice.backend
        if "linear_act" not in b.impl or GATED_FUSED.get(b.name) != a.backend.name:
            continue
        rows = _splice(rows, Resolved(Slot(f"{gemm}_act", f"{gu.label} + {a.label} (one launch)", "gemm", gu.spec,
                                           "linear_act"), gu.choice, b, folded=(gu, a)))
    return rows


# The latent append backend whose norm_rope_append_mla entry computes what these (rmsnorm, rope)
# backends compute: the Triton entry uses their kernels' row helpers, the reference composes the
# references. Any other norm or rope (a forced torch-rms_norm rounds elsewhere) keeps its own launch.
MLA_FUSED = {"mla-triton": ("triton", "triton"), "mla-reference": ("reference", "reference")}


def _fuse_mla_norm_rope_append(rows: list[Resolved]) -> list[Resolved]:
    """MLA: the latent norm, RoPE and the latent append as one launch where the append's backend has
    the ``norm_rope_append_mla`` entry and the norm and the rope chose the backends it reproduces
    (MLA_FUSED: the same values as the three launches)."""
    by = {r.key: r for r in rows}
    norm, rope, app = by.get("latent_norm"), by.get("rope"), by.get("kv_append")
    if any(r is None or r.choice is None for r in (norm, rope, app)) or app.entry != "append_mla":
        return rows
    b = app.choice.backend
    if "norm_rope_append_mla" not in b.impl or MLA_FUSED.get(b.name) != (norm.backend.name, rope.backend.name):
        return rows
    folded = (norm, rope, app)
    return _splice(rows, Resolved(Slot("norm_rope_append", "kv_a norm + RoPE + latent KV append (one launch)",
                                       "kv_append", app.spec, "norm_rope_append_mla"), app.choice, b, folded=folded))


def _splice(rows: list[Resolved], fused: Resolved) -> list[Resolved]:
    """``rows`` with ``fused`` where its first folded row was and its folded rows gone."""
    gone = {id(r) for r in fused.folded}
    at = next(i for i, r in enumerate(rows) if r is fused.folded[0])
    return [r for r in rows[:at] if id(r) not in gone] + [fused] + [r for r in rows[at:] if id(r) not in gone]


def _fuse_rope_append(rows: list[Resolved]) -> list[Resolved]:
    by = {r.key: r for r in rows}
    rope, app, qk = by.get("rope"), by.get("kv_append"), by.get("qk_norm")
    if rope is None or app is None or rope.choice is None or app.choice is None or app.entry != "append":
        return rows
    b = app.choice.backend
    if rope.choice.backend.name != b.name or "rope_append" not in b.impl:
        return rows
    folded = ((qk,) if qk is not None and qk.choice is not None and qk.choice.backend.name == b.name else ())
    folded += (rope, app)
    label = ("q/k norm + " if folded[0] is qk else "") + "RoPE + KV append (one launch)"
    return _splice(rows, Resolved(Slot("rope_append", label, "kv_append", app.spec, "rope_append"), app.choice, b,
                                  folded=folded))


def _scaling(cfg: ModelConfig) -> str:
    """The RopeSpec scaling of a model's ``rope_scaling`` (none / linear / llama3 / yarn)."""
    if not cfg.rope_scaling:
        return "none"
    t = cfg.rope_scaling.get("rope_type") or cfg.rope_scaling.get("type")
    return {"linear": "linear", "llama3": "llama3", "yarn": "yarn"}.get(t, "none")
