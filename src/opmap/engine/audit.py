"""What an engine's steps do besides launching kernels: host synchronisations and kernel
compilations, counted per step phase (counts, not seconds, so that a test can require none).

- Host synchronisations are the ones PyTorch reports in its sync debug mode ("warn"): a
  ``.item()``, a device-to-host copy into pageable memory, ``nonzero`` and the like. The engine's
  own token readback waits on an event for a pinned, non-blocking copy, which is not one of them.
- Compilations are Triton's (its post-compile hook: a kernel specialisation built or loaded from
  the disk cache inside a step) and Dynamo's (the graphs ``torch.compile`` captured).

    with StepAudit(llm) as audit:
        llm.generate(prompts, params)
    audit.counts()  # {"prefill": {"syncs": 0, "compiles": 0}, "decode": {...}, ...}
"""
from __future__ import annotations

import collections
import warnings
from typing import Optional

import torch

_SYNC_WARNING = "synchronizing"  # torch's sync debug warning: "called a synchronizing CUDA operation"
# Synchronisations a step is allowed, by where they happen: FlashInfer's plan reads the page-table
# offsets on the host by design (its API: plan on the host, then run), and opmap's adapters build
# its page lists just before it; they plan once per step's metadata, so these come once per step
# and wrapper kind, never once per layer.
DECLARED = ("/flashinfer/", "/peers/attention/flashinfer.py", "/peers/mla/flashinfer.py")


class StepAudit:
    """Counts, per step phase, the host synchronisations and kernel compilations inside the steps
    of ``llm`` while the context is open. ``events`` keeps one line per event (phase, kind, what)."""

    def __init__(self, llm):
        self.llm = llm
        self.events: list[tuple[str, str, str]] = []
        self._phase: Optional[str] = None
        self._saved = {}

    def __enter__(self) -> "StepAudit":
        # heavy: triton, loaded when an audit opens (importing the engine loads none of it)
        import triton

        llm, audit = self.llm, self
        execute = llm._execute

        def audited(batch, pend=None):
            audit._phase = batch.phase
            dyn = _dynamo_graphs()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    return execute(batch, pend)
            finally:
                for w in caught:
                    if _SYNC_WARNING in str(w.message):
                        audit.events.append((batch.phase, "sync", f"{w.filename}:{w.lineno}"))
                    else:  # not ours to swallow
                        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
                for _ in range(_dynamo_graphs() - dyn):
                    audit.events.append((batch.phase, "compile", "torch.compile graph"))
                audit._phase = None

        def compiled(*args, **kwargs):
            if audit._phase is not None:
                fn = kwargs.get("fn")
                audit.events.append((audit._phase, "compile", kernel_name(fn)))
            prev = audit._saved["hook"]
            return prev(*args, **kwargs) if prev is not None else None

        self._saved = {"execute": execute, "hook": triton.knobs.runtime.jit_post_compile_hook,
                       "sync": torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else None}
        llm._execute = audited
        triton.knobs.runtime.jit_post_compile_hook = compiled
        if self._saved["sync"] is not None:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        # heavy: triton, as in __enter__
        import triton

        self.llm._execute = self._saved["execute"]
        triton.knobs.runtime.jit_post_compile_hook = self._saved["hook"]
        if self._saved["sync"] is not None:
            torch.cuda.set_sync_debug_mode(self._saved["sync"])

    def undeclared(self) -> list:
        """The events outside ``DECLARED``: every compilation, and the syncs not in that list."""
        return [e for e in self.events if not _declared(e)]

    def declared_per_site(self) -> dict:
        """{(phase, site): count} of the declared syncs (a site is file:line)."""
        return dict(collections.Counter((p, w) for p, k, w in self.events if _declared((p, k, w))))

    def counts(self) -> dict:
        """{phase: {"syncs": n, "compiles": n}} over the phases that had an event."""
        out = collections.defaultdict(lambda: {"syncs": 0, "compiles": 0})
        for phase, kind, _ in self.events:
            out[phase]["syncs" if kind == "sync" else "compiles"] += 1
        return dict(out)


def kernel_name(fn) -> str:
    """The kernel's name from the ``fn`` of Triton's compile hooks (a JitFunctionInfo: ``.name``)."""
    return getattr(fn, "name", None) or getattr(getattr(fn, "fn", fn), "__name__", "triton kernel")


def _declared(event) -> bool:
    return event[1] == "sync" and any(d in event[2] for d in DECLARED)


def _dynamo_graphs() -> int:
    try:
        # heavy and optional: dynamo
        from torch._dynamo.utils import counters
    except ImportError:  # a torch without Dynamo compiles nothing
        return 0
    return int(counters["stats"].get("unique_graphs", 0))
