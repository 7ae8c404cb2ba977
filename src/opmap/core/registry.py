"""Backend records and their capability declarations.

A backend is a record: op, name, provider, provider version, priority per GPU arch, and the
declarations of what it serves. ``validate(spec)`` is *derived* from those declarations, so
the capability matrix (``opmap matrix``) and the selector can never disagree.

Declarations:
- ``priority``: arch -> priority, or arch -> ``Prefer(value, otherwise, when, condition, basis)``
  where the measured order depends on the spec (the phase, the head count). An arch absent from it
  is not served.
- ``basis``: arch -> ``Basis(reason, evidence)``: why a fixed priority ranks the backend where it
  does against the backends that serve the same specs (a ``Prefer`` carries its own): the lesson in
  words and, where it is a measurement, the baseline rows (``Evidence``) it rests on.
- ``reqs``: ``Req(field, allowed, condition)``: the spec field must take one of ``allowed``
  (or satisfy ``allowed`` when it is a callable); ``condition`` is the human text shown in the
  matrix as a conditional cell.
- ``checks``: ``Check(condition, fn)``: a cross-field condition; ``fn(spec)`` returns a reason
  string when the spec violates it, else None.
- ``available``: a callable returning a reason when the backend cannot run in *this* process
  (package missing, no GPU), else None. It is consulted only when selecting for the local device.
- ``impl``: entry name -> "module:attr", imported on first use so that registering a
  backend never imports its provider.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from opmap.core.specs import OP_SPECS, TREE, Spec


@dataclass(frozen=True)
class Req:
    field: str
    allowed: Union[tuple, frozenset, Callable[[Any], bool]]
    condition: str = ""

    def reason(self, spec: Spec) -> Optional[str]:
        value = getattr(spec, self.field)
        ok = self.allowed(value) if callable(self.allowed) else value in self.allowed
        if ok:
            return None
        return f"{self.field}={value!r} not supported (needs {self.describe()})"

    def describe(self) -> str:
        if self.condition:
            return self.condition
        if callable(self.allowed):
            return f"{self.field} restricted"
        return f"{self.field} in {{{', '.join(str(v) for v in self.allowed)}}}"


@dataclass(frozen=True)
class Check:
    condition: str  # shown in the matrix
    fn: Callable[[Spec], Optional[str]]
    field: str = ""  # tree level the check belongs to (for ordering the trace)


@dataclass(frozen=True)
class Evidence:
    """A baseline row a priority rests on: in ``bench/baselines/<baseline>.json`` (``baseline`` is
    "<gpu>/<family>", e.g. "h200/attention"), the result of ``case`` and ``provider`` as the file
    names them. ``kernel``: the backend whose kernel the row measured, where the provider name does
    not say it (a file made before that kernel got its own backend names the provider of then)."""
    baseline: str
    case: str
    provider: str
    kernel: str = ""

    def cite(self) -> str:
        return f"{self.provider} ({self.kernel})" if self.kernel else self.provider


# What a reason without evidence may rest on, the first word(s) of its text: what a backend can serve
# ("capability"), how it rounds ("numerics"), a rule of the registry ("convention"), or a peer that
# the baseline run could not time because its package was missing there ("not timed"; the family
# doc's Decisions keep the lesson in words).
NOT_MEASURED = ("capability", "numerics", "convention", "not timed")


@dataclass(frozen=True)
class Basis:
    """Why a priority ranks a backend where it does against the backends that serve the same specs:
    ``reason`` in words, and ``evidence``, the baseline rows it rests on where it is a measurement.
    A reason that is not a measurement has no evidence and begins with its kind (``NOT_MEASURED``),
    e.g. "capability: the only kernel here that serves fp8 KV"."""
    reason: str
    evidence: tuple = ()

    def cite(self) -> str:
        """The reason, then the rows of its first cited case (and how many rows more): one line."""
        if not self.evidence:
            return self.reason
        first = self.evidence[0]
        same = [e.cite() for e in self.evidence if (e.baseline, e.case) == (first.baseline, first.case)]
        more = len(self.evidence) - len(same)
        return (f"{self.reason} [{first.baseline} `{first.case}`: {', '.join(same)}"
                f"{f'; +{more} rows' if more else ''}]")


@dataclass(frozen=True)
class Prefer:
    """A priority that depends on the spec: ``value`` where ``when(spec)`` holds, else
    ``otherwise``; ``condition`` says when, in the selector's trace and the matrix; ``basis`` says
    why (a rule that ranks by the spec rests on a measurement or a stated reason)."""
    value: int
    otherwise: int
    when: Callable[[Spec], bool]
    condition: str
    basis: Optional[Basis] = None

    def of(self, spec: Spec) -> int:
        return self.value if self.when(spec) else self.otherwise


@dataclass
class Backend:
    op: str
    name: str
    provider: str
    version: Union[str, Callable[[], str]]
    priority: dict
    impl: dict
    reqs: Sequence[Req] = ()
    checks: Sequence[Check] = ()
    available: Optional[Callable[[], Optional[str]]] = None
    notes: str = ""
    basis: dict = field(default_factory=dict)  # arch -> Basis of a fixed priority
    _fns: dict = field(default_factory=dict, repr=False)

    def provider_version(self) -> str:
        if callable(self.version):
            try:
                return self.version()
            except Exception as e:  # a missing package is a fact to show, not a crash
                return f"n/a ({type(e).__name__})"
        return self.version

    def priority_for(self, spec: Spec) -> Optional[int]:
        """The priority for ``spec`` on its arch (None where the arch is not served)."""
        p = self.priority.get(spec.arch)
        return p.of(spec) if isinstance(p, Prefer) else p

    def top_priority(self, arch: str) -> Optional[int]:
        """The highest priority on ``arch`` over all specs (the matrix orders its rows by it)."""
        p = self.priority.get(arch)
        return max(p.value, p.otherwise) if isinstance(p, Prefer) else p

    def basis_for(self, arch: str) -> Optional[Basis]:
        """Why the priority on ``arch`` ranks this backend where it does: the ``Prefer`` rule's
        basis, else the one declared for the arch, else None."""
        p = self.priority.get(arch)
        if isinstance(p, Prefer) and p.basis is not None:
            return p.basis
        return self.basis.get(arch)

    def describe_priority(self, arch: str) -> str:
        p = self.priority[arch]
        if not isinstance(p, Prefer):
            return f"priority {p}"
        return f"priority {p.value} where {p.condition}, else {p.otherwise}"

    def validate(self, spec: Spec, runtime: bool = False) -> list[str]:
        """Reasons this backend cannot serve ``spec`` (empty = it can), in tree order."""
        return [r for _, r in self._reasons(spec, runtime)]

    def _reasons(self, spec: Spec, runtime: bool) -> list[tuple[int, str]]:
        order = TREE[self.op]
        rank = lambda f: order.index(f) if f in order else len(order)  # noqa: E731
        out = []
        if spec.arch not in self.priority:
            served = ", ".join(sorted(self.priority)) or "none"
            out.append((0, f"arch={spec.arch} not served (serves {served})"))
        for req in self.reqs:
            r = req.reason(spec)
            if r:
                out.append((rank(req.field), r))
        for chk in self.checks:
            r = chk.fn(spec)
            if r:
                out.append((rank(chk.field) if chk.field else len(order), r))
        if runtime and self.available is not None:
            r = self.available()
            if r:
                out.append((-1, r))
        out.sort(key=lambda t: t[0])
        return out

    def first_level(self, spec: Spec, runtime: bool = False) -> Optional[str]:
        rs = self._reasons(spec, runtime)
        if not rs:
            return None
        order = TREE[self.op]
        i = rs[0][0]
        return "runtime" if i < 0 else (order[i] if i < len(order) else "other")

    def fn(self, entry: str) -> Callable:
        f = self._fns.get(entry)
        if f is None:
            try:
                target = self.impl[entry]
            except KeyError:
                raise KeyError(f"backend {self.op}/{self.name} has no entry {entry!r}; "
                               f"it has {sorted(self.impl)}") from None
            mod, _, attr = target.partition(":")
            f = getattr(importlib.import_module(mod), attr)
            self._fns[entry] = f
        return f

    def __call__(self, entry: str, *args, **kw):
        return self.fn(entry)(*args, **kw)


_REGISTRY: dict[str, dict[str, Backend]] = {op: {} for op in OP_SPECS}
_LOADED = False

# Modules whose import registers backends. One per op family, owned by that family.
BACKEND_MODULES = (
    "opmap.ops.attention.backends",
    "opmap.ops.mla.backends",
    "opmap.ops.norm.backends",
    "opmap.ops.rope.backends",
    "opmap.ops.activation.backends",
    "opmap.ops.gemm.backends",
    "opmap.ops.moe.backends",
    "opmap.ops.sampling.backends",
    "opmap.ops.grammar.backends",
)


def register(backend: Backend) -> Backend:
    if backend.op not in _REGISTRY:
        raise ValueError(f"unknown op {backend.op!r}; known ops: {', '.join(_REGISTRY)}")
    if backend.name in _REGISTRY[backend.op]:
        raise ValueError(f"backend {backend.op}/{backend.name} registered twice")
    _REGISTRY[backend.op][backend.name] = backend
    return backend


def load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for mod in BACKEND_MODULES:
        importlib.import_module(mod)


def backends(op: str) -> list[Backend]:
    load_all()
    if op not in _REGISTRY:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(_REGISTRY)}")
    return list(_REGISTRY[op].values())


def get(op: str, name: str) -> Backend:
    for b in backends(op):
        if b.name == name:
            return b
    raise KeyError(f"no backend {name!r} for op {op!r}; registered: "
                   f"{', '.join(b.name for b in backends(op)) or 'none'}")


def ops() -> list[str]:
    return list(_REGISTRY)


# ---- helpers shared by the families' declarations -------------------------------------------

def triton_version() -> str:
    import triton  # heavy: importing the registry imports no framework

    return triton.__version__


def torch_version() -> str:
    import torch  # heavy: importing the registry imports no framework

    return torch.__version__


def package_version(name: str) -> Callable[[], str]:
    def version() -> str:
        from importlib.metadata import version as v  # read when a version is shown, not at registration

        return v(name)

    return version


def needs_cuda() -> Optional[str]:
    import torch  # heavy: importing the registry imports no framework

    return None if torch.cuda.is_available() else "no CUDA device in this process"


def triton_available() -> Optional[str]:
    """Triton kernels run on a CUDA GPU, or on the CPU through the interpreter."""
    import torch  # heavy: importing the registry imports no framework

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "no CUDA device and TRITON_INTERPRET is not 1 (Triton kernels cannot run here)"


def package_available(name: str) -> Callable[[], Optional[str]]:
    def available() -> Optional[str]:
        import importlib.util  # consulted only when selecting for this process

        if importlib.util.find_spec(name) is None:
            return f"package {name!r} is not installed"
        return None

    return available


def all_of(*fns: Callable[[], Optional[str]]) -> Callable[[], Optional[str]]:
    def available() -> Optional[str]:
        for f in fns:
            r = f()
            if r:
                return r
        return None

    return available


# Priority conventions. On an arch that a baseline measured (bench/baselines/<gpu>/, sm90), where two
# backends serve the same spec, their order rests on a Basis of one of them: baseline rows, or a
# stated reason that is not a measurement (tests/test_priority_evidence.py). On the arches no
# baseline measured, the order is a convention, not a measurement: mostly sm90's, opmap's kernels
# above the peers. The reference is last on every GPU; on the CPU it comes first (the Triton
# interpreter is for testing, not for speed).
REFERENCE_PRIORITY = {"cpu": 100, "sm80": 1, "sm89": 1, "sm90": 1, "sm100": 1}
REFERENCE_BASIS = {arch: Basis("convention: the fp32 oracle, last on every GPU and first on the CPU")
                   for arch in REFERENCE_PRIORITY}
TRITON_CPU_PRIORITY = 10
