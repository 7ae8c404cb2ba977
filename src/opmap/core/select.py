"""The selector: spec -> Choice(backend, trace).

Walks the tree of ``specs.TREE[op]`` (GPU arch -> kind -> phase -> paged / page size / KV
dtype -> ... -> CUDA-graph capture) over every registered backend, then picks the valid one
with the highest priority for the arch. The trace lists every candidate with the level at
which it fell and its reasons. A forced backend (argument, or ``OPMAP_<OP>_BACKEND`` /
``OPMAP_<OP>_<PHASE>_BACKEND``) that cannot serve the spec raises ``BackendError`` listing its
reasons and the backends that could; there is no silent fallback.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.core.registry import Backend
from opmap.core.specs import OP_SPECS, PHASES, Spec


class BackendError(RuntimeError):
    """A forced backend cannot serve a spec, or no backend can."""


@dataclass(frozen=True)
class Candidate:
    name: str
    provider: str
    version: str
    priority: Optional[int]
    level: Optional[str]  # tree level at which it fell, None if valid
    reasons: tuple

    @property
    def valid(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class Choice:
    op: str
    spec: Spec
    backend: Backend
    trace: tuple  # of Candidate, chosen first, then valid by priority, then rejected
    forced_by: Optional[str]  # "argument", "env OPMAP_..." or None
    runtime: bool

    @property
    def name(self) -> str:
        return self.backend.name

    def why(self) -> str:
        if self.forced_by:
            return f"forced by {self.forced_by}"
        others = [c for c in self.trace[1:] if c.valid]
        pr = self.trace[0].priority
        if others:
            return (f"highest {self.spec.arch} priority ({pr}) among valid: "
                    + ", ".join(f"{c.name}({c.priority})" for c in others))
        return f"only valid backend for {self.spec.arch}"

    def _rule(self, name: str) -> str:
        """A spec-dependent priority's rule (``registry.Prefer``), or "" for a fixed one."""
        b = registry.get(self.op, name)
        if not isinstance(b.priority.get(self.spec.arch), registry.Prefer):
            return ""
        return f" ({b.describe_priority(self.spec.arch)})"

    def explain(self) -> str:
        lines = [f"{self.op} [{self.spec.phase}] -> {self.backend.name} "
                 f"({self.backend.provider} {self.backend.provider_version()}): {self.why()}"
                 f"{self._rule(self.backend.name)}"]
        basis = self.backend.basis_for(self.spec.arch)
        if basis is not None and not self.forced_by and any(c.valid for c in self.trace[1:]):
            lines.append(f"  basis: {basis.cite()}")
        if not self.runtime:
            lines.append("  (planned for another device: runtime availability not checked)")
        for c in self.trace[1:]:
            if c.valid:
                lines.append(f"  ok    {c.name:<22} priority {c.priority}{self._rule(c.name)}")
            else:
                lines.append(f"  no    {c.name:<22} at {c.level}: " + "; ".join(c.reasons))
        return "\n".join(lines)

    def condensed(self) -> str:
        rej = [c for c in self.trace if not c.valid]
        tail = f"; rejected {', '.join(f'{c.name} ({c.level})' for c in rej)}" if rej else ""
        return f"{self.op}[{self.spec.phase}] = {self.backend.name}: {self.why()}{tail}"


def local_arch() -> str:
    from opmap.core.hw import local_arch as la  # heavy: hw imports torch, which importing the selector does not

    return la()


_ENV_CHECKED = [-1]  # len(os.environ) when the forcing variables were last found well-formed


def check_env() -> None:
    """Every ``OPMAP_..._BACKEND`` variable names an op (and a phase) in upper case, as
    ``OPMAP_<OP>_BACKEND`` or ``OPMAP_<OP>_<PHASE>_BACKEND``: a variable that forces nothing is
    an InputError naming it, since the user set it to force a kernel. Re-read only when the
    environment's size changed (each selection calls this)."""
    if len(os.environ) == _ENV_CHECKED[0]:
        return
    ops = {op.upper(): op for op in OP_SPECS}
    for var in os.environ:
        up = var.upper()
        if not (up.startswith("OPMAP_") and up.endswith("_BACKEND")):
            continue
        form = "OPMAP_<OP>_BACKEND or OPMAP_<OP>_<PHASE>_BACKEND"
        if var != up:
            raise InputError(f"environment variable {var}", "a name in lower case", f"upper case: {up}")
        middle = up[len("OPMAP_"):-len("_BACKEND")]
        head, _, tail = middle.rpartition("_")
        if middle in ops or (head in ops and tail.lower() in PHASES):
            continue
        if head in ops:
            raise InputError(f"environment variable {var}", f"no phase {tail!r}",
                             f"{form} with a phase of {', '.join(p.upper() for p in PHASES)}")
        raise InputError(f"environment variable {var}", f"no op {middle!r}",
                         f"{form} with an op of {', '.join(ops)}")
    _ENV_CHECKED[0] = len(os.environ)


def _env_force(op: str, phase: str) -> tuple[Optional[str], Optional[str]]:
    check_env()
    for var in (f"OPMAP_{op.upper()}_{phase.upper()}_BACKEND", f"OPMAP_{op.upper()}_BACKEND"):
        v = os.environ.get(var)
        if v:
            return v, f"env {var}={v}"
    return None, None


def select(op: str, spec: Spec, backend: Optional[str] = None, runtime: Optional[bool] = None) -> Choice:
    """Choose the backend for ``op`` and ``spec``.

    ``backend`` forces a backend by name. ``runtime`` (default: spec.arch is this device's
    arch) also checks that the backend can run in this process.
    """
    if runtime is None:
        runtime = spec.arch == local_arch()
    env_name, env_why = _env_force(op, spec.phase)
    forced, forced_by = (backend, "argument") if backend else (env_name, env_why)
    return _select(op, spec, forced, forced_by, runtime)


@functools.lru_cache(maxsize=4096)
def _select(op, spec, forced, forced_by, runtime) -> Choice:
    cands = []
    for b in registry.backends(op):
        reasons = tuple(b.validate(spec, runtime=runtime))
        cands.append((b, Candidate(b.name, b.provider, b.provider_version(), b.priority_for(spec),
                                   b.first_level(spec, runtime) if reasons else None, reasons)))
    valid = sorted((bc for bc in cands if bc[1].valid), key=lambda bc: -bc[1].priority)
    rejected = [bc for bc in cands if not bc[1].valid]
    if forced is not None:
        match = [bc for bc in cands if bc[0].name == forced]
        if not match:
            raise BackendError(f"{op}: forced backend {forced!r} ({forced_by}) is not registered; "
                               f"registered: {', '.join(b.name for b, _ in cands)}")
        b, c = match[0]
        if not c.valid:
            could = ", ".join(v.name for _, v in valid) or "none"
            raise BackendError(f"{op}: forced backend {forced!r} ({forced_by}) cannot serve "
                               f"[{spec.describe()}]:\n  - " + "\n  - ".join(c.reasons)
                               + f"\nbackends that could: {could}")
        rest = [v for _, v in valid if v.name != forced] + [r for _, r in rejected]
        return Choice(op, spec, b, (c, *rest), forced_by, runtime)
    if not valid:
        lines = "\n".join(f"  - {c.name} at {c.level}: " + "; ".join(c.reasons) for _, c in rejected)
        raise BackendError(f"{op}: no backend can serve [{spec.describe()}]:\n{lines}")
    b, c = valid[0]
    return Choice(op, spec, b, (c, *[v for _, v in valid[1:]], *[r for _, r in rejected]), None, runtime)


def clear_cache() -> None:
    _select.cache_clear()
