"""The operators of one model step, resolved once through the selector.

An ``OpSet`` holds, for one phase (prefill / mixed / decode) and one row count, the callable of
every slot of the model's step map (``opmap.model.step``): the selector's choice and its entry,
resolved as the public op functions resolve theirs (``opmap.api.dispatch.entry_of``), under the
slot's key (``ops.<key>``; a GEMM's ``ops.gemm[<key>]``). It is built when the model is built,
never per step; the engine logs each choice once per op and phase (``Choice.condensed()``). On the
CPU the selector picks the fp32 references; the same code picks Triton / cuBLAS / ... on a GPU.
``engine_settings`` and ``planned_maps`` give the report, check and bench the step maps of the
engine's defaults, resolved as the runner resolves its op sets.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional

import torch

from opmap.api.dispatch import entry_of
from opmap.engine.config import EngineConfig
from opmap.model.hf import quantised_experts
from opmap.model.presets import ModelConfig
from opmap.model.step import GATED_ACTS, StepSettings, resolve, step_map, step_slots
from opmap.ops.gemm.quant import INT4_GROUP

log = logging.getLogger("opmap.engine")

# The callables a model may use besides ops.gemm; a slot the step map of a model lacks stays None.
CALLABLES = ("rmsnorm", "add_rmsnorm", "q_a_norm", "latent_norm", "qk_norm", "rope", "kv_append", "rope_append",
             "norm_rope_append", "attention", "moe", "shared_act", "act")
PLANNED_PHASES = ("prefill", "decode", "mixed")


class OpSet:
    def __init__(self, cfg: ModelConfig, phase: str, settings: StepSettings, forced: Optional[dict] = None,
                 trace: bool = False, fuse_rope_append: bool = True, fuse_gated: bool = True,
                 fuse_shared_add: bool = True):
        self.phase, self.m, self.cuda_graph, self.trace = phase, settings.m, settings.cuda_graph, trace
        self.rows = resolve(step_slots(cfg, phase, settings), forced, fuse_rope_append=fuse_rope_append,
                            fuse_gated=fuse_gated, fuse_shared_add=fuse_shared_add)
        self.choices: list = []  # (label, entry, Choice), in step-map order
        self.gemm: dict = {}
        for name in CALLABLES:
            setattr(self, name, None)
        for r in self.rows:
            fn = self._use(r)
            if r.op == "gemm":
                self.gemm[r.key] = fn
            else:
                setattr(self, r.key, fn)
        fused = next((r for r in self.rows if r.key == "rope_append"), None)
        self.qk_norm_in_rope_append = fused is not None and any(f.key == "qk_norm" for f in fused.folded)
        self.attn_backend = next(r.backend for r in self.rows if r.key == "attention")
        self.make_workspace = (self.attn_backend.fn("make_workspace")
                               if "make_workspace" in self.attn_backend.impl else None)
        moe = next((r.backend for r in self.rows if r.key == "moe"), None)
        # a backend that tunes kernels per token count does it once at start-up (runner)
        self.moe_warm_up = moe.fn("warm_up") if moe is not None and "warm_up" in moe.impl else None

    def _use(self, r):
        self.choices.append((r.label, r.entry, r.choice))
        fn = entry_of(r.choice, r.entry)[1]  # the callable a user's opmap.<op> call runs for this spec
        if r.entry == "linear_act":  # the fused gate/up GEMM: its activation is the folded slot's
            fn = functools.partial(fn, act=GATED_ACTS[r.folded[1].entry])
        return _ranged(fn, f"opmap::{r.op}::{r.label}::{r.backend.name}") if self.trace else fn

    def summary(self) -> list:
        """(op, phase, label, backend, condensed trace) per operator, in map order."""
        return [(c.op, c.spec.phase, label, c.backend.name, c.condensed()) for label, _, c in self.choices]


def engine_dtype(ecfg: EngineConfig, arch: str) -> str:
    """The activation dtype of an engine on ``arch``: ``ecfg.dtype``, auto = fp32 on the CPU, bf16 on a GPU."""
    return ecfg.dtype if ecfg.dtype != "auto" else ("fp32" if arch == "cpu" else "bf16")


def quantised_expert_format(cfg: ModelConfig, ecfg: EngineConfig) -> Optional[tuple]:
    """(format, group / block) of the routed experts as the engine keeps them: a checkpoint's per
    model.hf.quantised_experts, ``--quantize int4``'s (the experts too, a scale per INT4_GROUP
    channels), else None (experts in the model's dtype)."""
    if not cfg.is_moe:
        return None
    if ecfg.quantize:  # int4_group: one scale a row where the group does not divide the input size
        ok = cfg.hidden % 16 == 0 and cfg.moe_intermediate % 16 == 0
        return ("int4", INT4_GROUP) if ecfg.quantize == "int4" and ok else None
    return quantised_experts(cfg)


def engine_settings(cfg: ModelConfig, ecfg: EngineConfig, arch: str, weight_format: Optional[str] = None,
                    lm_head_quantised: bool = False, experts: Optional[tuple] = ()) -> StepSettings:
    """The step settings of an engine with ``ecfg`` on ``arch`` (no row count, no CUDA graph: each
    op set sets its own). ``weight_format``: the projections' quantised format (``--quantize`` or
    the checkpoint's); ``lm_head_quantised``: the LM head's too; ``experts``: the routed experts'
    (format, group) as loaded, None for experts in the model's dtype (default: as
    ``quantised_expert_format`` plans them)."""
    group = None
    stored = cfg.extra.get("weight_quant") or {}
    if weight_format == "int4":  # the checkpoint's groups, or --quantize int4's
        group = stored.get("group_size") if stored.get("format") == "int4" else INT4_GROUP
    elif weight_format == "fp8-block":  # the checkpoint's block edge
        group = stored.get("group_size")
    return StepSettings(arch=arch, dtype=engine_dtype(ecfg, arch), page_size=ecfg.page_size or
                        cfg.default_page_size(arch), kv_dtype=ecfg.kv_cache_dtype, weight_quant=weight_format,
                        group_size=group, quant_lm_head=lm_head_quantised,
                        experts=(quantised_expert_format(cfg, ecfg) if weight_format else None) if experts == ()
                        else experts)


def planned_maps(cfg: ModelConfig, arch: str, ecfg: Optional[EngineConfig] = None,
                 phases=PLANNED_PHASES) -> dict:
    """{phase: resolved rows of the step map} of an engine with ``ecfg`` (default: EngineConfig())
    on ``arch``, as ModelRunner resolves its op sets: prefill and mixed eager at any row count,
    decode at one row (the first batch bucket), captured in a CUDA graph on a GPU unless
    ``enforce_eager`` (eager again, as the runner falls back, where some op has no capturable
    backend); quantised weights as ``--quantize`` or the checkpoint's format gives them. A slot no
    backend can serve carries its error. What ``opmap report``, ``check --model`` and ``bench
    --model`` read."""
    ecfg = ecfg or EngineConfig()
    stored = (cfg.extra.get("weight_quant") or {}).get("format")
    fmt = ecfg.quantize or stored
    base = engine_settings(cfg, ecfg, arch, fmt, ecfg.quantize in ("fp8", "int8") and not cfg.tie_embeddings)

    def rows(phase, graph, m):
        return resolve(step_map(cfg, phase, dataclasses.replace(base, cuda_graph=graph, m=m)), ecfg.backends,
                       fuse_rope_append=ecfg.fuse_rope_append, fuse_gated=ecfg.fuse_gated,
                       fuse_shared_add=ecfg.fuse_shared_add, strict=False)

    out = {}
    for ph in phases:
        if ph != "decode":
            out[ph] = rows(ph, False, None)
            continue
        graph = arch != "cpu" and not ecfg.enforce_eager
        out[ph] = rows(ph, graph, 1)
        if graph and any(r.error and getattr(r.spec, "cuda_graph", False) for r in out[ph]):
            out[ph] = rows(ph, False, 1)
    return out


def _ranged(fn, name: str):
    """fn inside a torch.profiler range and an NVTX range (for Nsight), both named ``name``."""
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
