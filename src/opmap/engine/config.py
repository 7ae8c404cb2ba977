"""The engine's own knobs (not the model's): ``EngineConfig``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from opmap.core.contract import InputError


@dataclass
class EngineConfig:
    """Knobs of the engine (not of the model)."""

    dtype: str = "auto"  # auto = bf16 on a GPU, fp32 on the CPU
    # weight-only quantisation at load: "fp8" (e4m3) or "int8", one scale per output channel, of
    # the attention and dense MLP projections (DecoderModel.quant_names); None keeps the dtype
    quantize: Optional[str] = None
    # "fp8": the KV cache in e4m3 with one fp32 scale per (layer, KV head), 1.0 (values beyond
    # +-448 saturate, as in vLLM's default fp8 cache); None keeps the model's dtype. GQA models.
    kv_cache_dtype: Optional[str] = None
    page_size: Optional[int] = None  # tokens per KV page; None: the model's on this GPU (ModelConfig.default_page_size)
    max_num_seqs: int = 64  # sequences per step (and the largest CUDA-graph bucket)
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits above it)
    max_model_len: Optional[int] = None  # None = the model's max_position
    chunked_prefill: bool = True
    prefix_caching: bool = True
    gpu_memory_fraction: float = 0.85  # of total GPU memory the engine may use (weights + KV + activations)
    num_pages: Optional[int] = None  # force the KV page count (default: from free memory; CPU: 256)
    enforce_eager: bool = False  # no CUDA graphs (decode or prefill)
    # On a GPU, a prefill step of at most this many tokens is padded to a multiple of 128 tokens
    # and, unless enforce_eager, replayed from a CUDA graph captured at start-up: at these sizes
    # the ~300 launches of a step cost more host time than the GPU takes. 0: no padding, eager.
    prefill_graph_tokens: int = 2048
    seed: int = 0  # random weights for presets
    device: Optional[str] = None  # None = cuda if available else cpu
    backends: Optional[dict] = None  # op -> forced backend name (passed to the selector)
    # RoPE (with Qwen3's q/k norm) and the KV append as one launch per layer where the rope and
    # kv_append ops chose one backend that has that entry (opmap.model.step.resolve); False: two
    # launches, whatever the backends (the fused and separate paths give the same tokens).
    fuse_rope_append: bool = True
    trace_ops: bool = False  # a profiler range + NVTX range around every operator call (opmap profile)
    # Launch decode step n+1 before reading step n's tokens back (the input ids go device to
    # device); see LLM.step. False: lockstep (read every step's tokens before the next).
    async_decode: bool = True
    # Fill the grammar bitmasks on the host while the GPU runs the step's forward pass. False
    # waits for the forward first (serial), which is only there to measure what the overlap saves.
    overlap_grammar: bool = True
    # Build the structured-output machinery (XGrammar, the tokenizer info, the compiler) at start-up
    # instead of on the first constrained request, whose time to first token would otherwise carry
    # it (XGrammar's import and the tokenizer info, and on the GPU run a burst of garbage collections).
    # Its objects are then frozen with the engine's (see LLM.__init__). Needs xgrammar.
    structured_output: bool = False
    # Run a short workload at start-up (a prefill, a mixed chunked-prefill step, decode steps,
    # greedy and filtered sampling) so that the first requests do not carry the JIT compiles of
    # the kernel variants those steps launch. None: on a GPU only (compiles are the interpreter's
    # normal cost on the CPU). See LLM._warm_up.
    warmup: Optional[bool] = None

    def for_model(self, cfg, arch: str = "cpu") -> "EngineConfig":
        """The page size resolved for a model on ``arch`` (see ``page_size``)."""
        if self.page_size is None:
            self.page_size = cfg.default_page_size(arch)
        return self

    def validate(self) -> None:
        if self.page_size is not None and (self.page_size <= 0 or self.page_size & (self.page_size - 1)):
            raise InputError("page_size", self.page_size, "a positive power of two")
        if self.max_num_seqs <= 0:
            raise InputError("max_num_seqs", self.max_num_seqs, "> 0")
        if self.prefill_graph_tokens < 0:
            raise InputError("prefill_graph_tokens", self.prefill_graph_tokens, ">= 0 (0: eager prefill)")
        if self.max_num_batched_tokens <= 0:
            raise InputError("max_num_batched_tokens", self.max_num_batched_tokens, "> 0")
        if not 0.05 <= self.gpu_memory_fraction <= 0.99:
            raise InputError("gpu_memory_fraction", self.gpu_memory_fraction, "in [0.05, 0.99]")
        if self.kv_cache_dtype not in (None, "fp8"):
            raise InputError("kv_cache_dtype", self.kv_cache_dtype, "fp8 or None (the model's dtype)")
        if self.quantize not in (None, "fp8", "int8"):
            raise InputError("quantize", self.quantize, "fp8, int8 or None (weight-only, per output channel)")
