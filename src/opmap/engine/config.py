"""The engine's own knobs (not the model's): ``EngineConfig``."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

from opmap.core.contract import InputError

# Sequences per step when max_num_seqs is not given (fewer when the step's token budget is smaller).
DEFAULT_MAX_NUM_SEQS = 64
SEED_LIMIT = 2 ** 63  # seeds are int64 (torch generators; SamplingParams.seed has the same range)


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
    # sequences per step (and the largest CUDA-graph bucket); None: DEFAULT_MAX_NUM_SEQS, or the token
    # budget where that is smaller (a step computes at least one token of each of its sequences)
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits above it)
    # Prompt tokens a step may take while sequences of it decode (None: the whole step budget). A
    # step's time grows with its prompt tokens, and every decoding sequence waits for the step:
    # this bounds that wait (TPOT p99) at the cost of prompts taking more steps (TTFT).
    max_prefill_tokens_with_decodes: Optional[int] = None
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
    # The dense MLP's gate/up GEMM with SiLU / GELU-tanh * mul in its epilogue (one launch) where the
    # GEMM's backend has that entry (decode rows: triton-decode, triton-wo) and the activation chose
    # the backend it reproduces (opmap.model.step.GATED_FUSED); False: the GEMM, then the activation.
    fuse_gated: bool = True
    # A MoE layer's shared expert: its down GEMM sums the routed experts' output into its fp32
    # result (gemm entry linear_add, one rounding) where its backend has that entry, instead of a
    # separate add of the two rounded outputs; False: the GEMM, then the add.
    fuse_shared_add: bool = True
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
        """The settings alone (types, ranges, how they bound each other); ``check_sizes`` then holds
        the sizes against the model and the machine. Resolves a max_num_seqs left at None."""
        for name in ("page_size", "max_num_seqs", "max_model_len", "num_pages", "max_prefill_tokens_with_decodes"):
            v = getattr(self, name)
            if v is not None and not _is_int(v):
                raise InputError(name, repr(v), "an int")
        for name in ("max_num_batched_tokens", "prefill_graph_tokens", "seed"):
            if not _is_int(getattr(self, name)):
                raise InputError(name, repr(getattr(self, name)), "an int")
        if self.page_size is not None and (self.page_size <= 0 or self.page_size & (self.page_size - 1)):
            raise InputError("page_size", self.page_size, "a positive power of two")
        if self.prefill_graph_tokens < 0:
            raise InputError("prefill_graph_tokens", self.prefill_graph_tokens, ">= 0 (0: eager prefill)")
        if self.max_num_batched_tokens <= 0:
            raise InputError("max_num_batched_tokens", self.max_num_batched_tokens, "> 0")
        cap = self.max_prefill_tokens_with_decodes
        if cap is not None and not 0 < cap <= self.max_num_batched_tokens:
            raise InputError("max_prefill_tokens_with_decodes", cap,
                             f"1 to max_num_batched_tokens ({self.max_num_batched_tokens}), or None")
        if self.max_num_seqs is None:
            self.max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, self.max_num_batched_tokens)
        if self.max_num_seqs <= 0:
            raise InputError("max_num_seqs", self.max_num_seqs, "> 0")
        if self.max_num_seqs > self.max_num_batched_tokens:
            # The scheduler gives every sequence of a step at least one token of the budget, so
            # sequences beyond it never run; the decode buckets, buffers and graphs sized for them
            # would be work for nothing.
            raise InputError("max_num_seqs", self.max_num_seqs, f"at most max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}): a step computes at least one token of each sequence")
        for name in ("max_model_len", "num_pages"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise InputError(name, v, "> 0 (or None)")
        if not 0 <= self.seed < SEED_LIMIT:
            raise InputError("seed", self.seed, "an int in [0, 2**63)")
        if not (isinstance(self.gpu_memory_fraction, (int, float)) and 0.05 <= self.gpu_memory_fraction <= 0.99):
            raise InputError("gpu_memory_fraction", self.gpu_memory_fraction, "in [0.05, 0.99]")
        if self.kv_cache_dtype not in (None, "fp8"):
            raise InputError("kv_cache_dtype", self.kv_cache_dtype, "fp8 or None (the model's dtype)")
        if self.quantize not in (None, "fp8", "int8", "int4"):
            raise InputError("quantize", self.quantize, "fp8, int8 (weight-only, per output channel), int4 (weight-only, "
                             "a scale per 128 input channels) or None")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def kv_page_bytes(cfg, page_size: int, elem_bytes: int) -> int:
    """Bytes of one KV page of every layer (as the models allocate it: K and V per KV head, or MLA's
    latent and RoPE part)."""
    if cfg.is_mla:
        return cfg.layers * page_size * (cfg.kv_lora_rank + cfg.qk_rope_dim) * elem_bytes
    return 2 * cfg.layers * page_size * cfg.kv_heads * cfg.head_dim * elem_bytes


def machine_memory(device) -> tuple:
    """(bytes the engine may take, what they are): the GPU's total memory, or the host memory
    available now (MemAvailable) for "cpu" (a torch.device or its type)."""
    if getattr(device, "type", device) == "cuda":
        import torch  # only for a GPU engine, which has it loaded already

        total = torch.cuda.get_device_properties(device).total_memory
        return total, f"the GPU's {total / 2**30:.1f} GiB"
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return avail, f"the {avail / 2**30:.1f} GiB of host memory available"


def check_sizes(ecfg: EngineConfig, cfg, memory: tuple, elem_bytes: int, cpu_pages: Optional[int]) -> None:
    """Refuse, before anything is allocated, a size the model or the machine cannot hold, naming
    the setting: a max_model_len beyond the model's positions, a page longer than that length, KV
    pages, step buffers or metadata beyond ``memory`` ((bytes, what), from ``machine_memory``).
    ``cpu_pages``: the page count a CPU engine takes when num_pages is not given (None on a GPU,
    where the pages are sized from free memory)."""
    have, what = memory
    if ecfg.max_model_len is not None and ecfg.max_model_len > cfg.max_position:
        raise InputError("max_model_len", ecfg.max_model_len,
                         f"at most {cfg.max_position} (the model's max_position_embeddings)")
    length = ecfg.max_model_len or cfg.max_position
    # the length rounded up to a power of two, or the largest default page
    longest_page = max(1 << max(length - 1, 1).bit_length(), cfg.default_page_size("sm90"))
    if ecfg.page_size is not None and ecfg.page_size > longest_page:
        raise InputError("page_size", ecfg.page_size, f"at most {longest_page} (a page longer than the "
                         f"{length}-token model length holds nothing more)")
    page = ecfg.page_size or cfg.default_page_size()
    per_page = kv_page_bytes(cfg, page, elem_bytes)
    pages = ecfg.num_pages or cpu_pages
    if pages is not None and pages * per_page > have:
        name = "num_pages" if ecfg.num_pages else "page_size"
        raise InputError(name, getattr(ecfg, name), f"a KV cache that fits {what}: {pages} pages of {page} tokens "
                         f"take {pages * per_page / 2**30:.1f} GiB ({per_page} bytes a page)")
    # One step's rows: the activations of the widest layer (fp32 on the host worst case) and the
    # per-token metadata, device and pinned host copies.
    width = 4 * cfg.hidden + 2 * max(cfg.intermediate, cfg.moe_intermediate or 0) + cfg.vocab // 8
    per_token = 4 * width + 96
    if ecfg.max_num_batched_tokens * per_token > have:
        raise InputError("max_num_batched_tokens", ecfg.max_num_batched_tokens,
                         f"at most {have // per_token} (one step's activations must fit {what})")
    # Block tables (device and host, int32) hold a row of the longest sequence's pages per sequence.
    table = (ecfg.max_num_seqs + 1) * math.ceil(length / page) * 8
    if table > have:
        raise InputError("max_num_seqs", ecfg.max_num_seqs, f"fewer: their block tables ({table / 2**30:.1f} GiB) "
                         f"must fit {what}")
