"""Specs: frozen descriptions of what is asked of an operator.

A spec says *what* is to be computed (shapes that matter for selection, dtypes, features,
phase, target GPU arch), never *how*. Backends declare which specs they serve; the selector
walks the fields of a spec in the order given by ``TREE`` below.

Dtype fields are short strings ("bf16", "fp16", "fp32", "fp8", "int8") so that specs print
well and can be given on the command line.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

PHASES = ("prefill", "decode", "mixed")
DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8")
MAY_BE_ZERO = ("m", "tokens", "shared_experts")  # sizes that may be 0 (an empty batch, no shared expert)


@functools.lru_cache(maxsize=None)
def _sizes(cls) -> tuple:
    """(name, least value, may be None) of a spec class's integer size fields: specs are made per
    op call on the API path, so the fields are looked up once per class."""
    return tuple((f.name, 0 if f.name in MAY_BE_ZERO else 1, f.type == "Optional[int]")
                 for f in dataclasses.fields(cls) if f.type in ("int", "Optional[int]"))


def _check_choice(spec, field, allowed):
    value = getattr(spec, field)
    if value not in allowed:
        raise ValueError(f"{type(spec).__name__}.{field}={value!r}: expected one of {allowed}")


@dataclass(frozen=True)
class Spec:
    """Fields shared by every op: the GPU generation and the phase."""

    arch: str = "sm90"
    phase: str = "decode"

    def __post_init__(self):
        _check_choice(self, "phase", PHASES)
        if not (self.arch == "cpu" or (self.arch.startswith("sm") and self.arch[2:].isdigit())):
            raise ValueError(f"arch={self.arch!r}: expected 'cpu' or 'smNN' such as 'sm90'")
        for name, least, optional in _sizes(type(self)):
            v = getattr(self, name)
            if not ((v is None and optional) or (type(v) is int and v >= least)):  # bool is not a size
                raise ValueError(f"{type(self).__name__}.{name}={v!r}: expected an integer >= {least}")

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


@dataclass(frozen=True)
class AttentionSpec(Spec):
    kind: Optional[str] = None  # mha / gqa / mqa / mla; derived from head counts when None
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    head_dim_v: Optional[int] = None  # None = head_dim (MLA: 512 with head_dim 576)
    paged: bool = True
    page_size: int = 16
    dtype: str = "bf16"  # query / output dtype
    kv_dtype: str = "bf16"  # bf16 / fp16 / fp8 (e4m3, per-(layer, kv head) scales)
    causal: bool = True
    sliding_window: bool = False
    soft_cap: bool = False
    sparse: bool = False  # top-k sparse (MLA) attention
    return_lse: bool = False
    cuda_graph: bool = False
    batch_invariant: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.num_heads <= 0 or self.num_kv_heads <= 0:
            raise ValueError("num_heads and num_kv_heads must be positive")
        if self.kind is None:
            if self.num_kv_heads == self.num_heads:
                kind = "mha"
            elif self.num_kv_heads == 1:
                kind = "mqa"
            else:
                kind = "gqa"
            object.__setattr__(self, "kind", kind)
        _check_choice(self, "kind", ("mha", "gqa", "mqa", "mla"))
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        _check_choice(self, "dtype", ("fp32", "fp16", "bf16"))
        _check_choice(self, "kv_dtype", ("fp32", "fp16", "bf16", "fp8"))

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class KVAppendSpec(Spec):
    kind: str = "gqa"  # gqa (K and V pages) or mla (latent + rope pages)
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "bf16"
    kv_dtype: str = "bf16"
    cuda_graph: bool = False


@dataclass(frozen=True)
class MergeSpec(Spec):
    """Merge of partial attention states by their LSE (natural log, fp32)."""

    num_heads: int = 32
    head_dim: int = 128
    dtype: str = "bf16"


@dataclass(frozen=True)
class GemmSpec(Spec):
    m: Optional[int] = None  # rows of the activation; None = unknown / any
    n: int = 4096
    k: int = 4096
    dtype: str = "bf16"  # activation and output dtype
    # bf16 / fp16 / fp8 (weight-only, e4m3, a scale per output channel) / int8 (weight-only) / int4
    # (weight-only) / fp8-block (weight-only e4m3, a scale per group_size x group_size block)
    weight_dtype: str = "bf16"
    act_dtype: Optional[str] = None  # "fp8": fp8 activations x fp8 weights
    bias: bool = False
    group_size: Optional[int] = None  # int4: input channels a scale covers; fp8-block: the block edge

    def __post_init__(self):
        super().__post_init__()
        _check_choice(self, "weight_dtype", ("fp32", "fp16", "bf16", "fp8", "int8", "int4", "fp8-block"))
        if self.act_dtype is None:
            object.__setattr__(self, "act_dtype", self.dtype)


@dataclass(frozen=True)
class NormSpec(Spec):
    hidden: int = 4096
    dtype: str = "bf16"
    fused_add: bool = False  # residual add + RMSNorm, residual updated in place


@dataclass(frozen=True)
class RopeSpec(Spec):
    head_dim: int = 128
    rotary_dim: Optional[int] = None  # None = head_dim
    style: str = "neox"  # neox (halves) / gptj (interleaved pairs)
    scaling: str = "none"  # none / linear / llama3 / yarn
    dtype: str = "bf16"

    def __post_init__(self):
        super().__post_init__()
        if self.rotary_dim is None:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        _check_choice(self, "style", ("neox", "gptj"))
        _check_choice(self, "scaling", ("none", "linear", "llama3", "yarn"))


@dataclass(frozen=True)
class ActivationSpec(Spec):
    kind: str = "silu_mul"  # silu_mul / gelu_tanh_mul
    hidden: int = 14336  # width of the output (input is 2x)
    dtype: str = "bf16"


@dataclass(frozen=True)
class MoESpec(Spec):
    num_experts: int = 8
    top_k: int = 2
    hidden: int = 4096
    intermediate: int = 14336
    router: str = "softmax"  # softmax (top-k, renormalised) / sigmoid_grouped (DeepSeek)
    shared_experts: int = 0
    dtype: str = "bf16"
    weight_dtype: str = "bf16"  # or "int4" / "fp8-block" (quantised experts)
    tokens: Optional[int] = None
    group_size: Optional[int] = None  # int4: the group; fp8-block: the block edge


@dataclass(frozen=True)
class LogitsSpec(Spec):
    """Logits processors: penalties, temperature, top-k / top-p / min-p masks."""

    vocab: int = 128256
    dtype: str = "fp32"
    penalties: bool = False
    cuda_graph: bool = False


@dataclass(frozen=True)
class SamplingSpec(Spec):
    vocab: int = 128256
    dtype: str = "fp32"
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    seeded: bool = True
    cuda_graph: bool = False
    batch_invariant: bool = True


@dataclass(frozen=True)
class GrammarMaskSpec(Spec):
    vocab: int = 128256
    dtype: str = "fp32"
    cuda_graph: bool = False


# Op name -> spec class.
OP_SPECS = {
    "attention": AttentionSpec,
    "kv_append": KVAppendSpec,
    "attention_merge": MergeSpec,
    "gemm": GemmSpec,
    "rmsnorm": NormSpec,
    "rope": RopeSpec,
    "activation": ActivationSpec,
    "moe": MoESpec,
    "logits": LogitsSpec,
    "sampling": SamplingSpec,
    "grammar_mask": GrammarMaskSpec,
}

# The selection tree: the order in which spec fields are examined for each op. A backend
# that cannot serve a spec is reported at the first level where it fails.
TREE = {
    "attention": ("arch", "kind", "phase", "paged", "page_size", "kv_dtype", "dtype", "head_dim",
                  "head_dim_v", "num_heads", "num_kv_heads", "causal", "sliding_window", "soft_cap",
                  "sparse", "return_lse", "cuda_graph", "batch_invariant"),
    "kv_append": ("arch", "kind", "page_size", "kv_dtype", "dtype", "head_dim", "num_kv_heads",
                  "cuda_graph"),
    "attention_merge": ("arch", "phase", "dtype", "head_dim", "num_heads"),
    "gemm": ("arch", "phase", "weight_dtype", "act_dtype", "dtype", "m", "n", "k", "bias"),
    "rmsnorm": ("arch", "phase", "fused_add", "dtype", "hidden"),
    "rope": ("arch", "phase", "style", "scaling", "dtype", "head_dim", "rotary_dim"),
    "activation": ("arch", "phase", "kind", "dtype", "hidden"),
    "moe": ("arch", "phase", "router", "weight_dtype", "dtype", "num_experts", "top_k", "hidden",
            "intermediate", "shared_experts", "tokens"),
    "logits": ("arch", "phase", "penalties", "dtype", "vocab", "cuda_graph"),
    "sampling": ("arch", "phase", "top_k", "top_p", "min_p", "seeded", "dtype", "vocab",
                 "cuda_graph", "batch_invariant"),
    "grammar_mask": ("arch", "phase", "dtype", "vocab", "cuda_graph"),
}


def spec_for(op: str, **fields) -> Spec:
    try:
        cls = OP_SPECS[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(OP_SPECS)}") from None
    return cls(**fields)
