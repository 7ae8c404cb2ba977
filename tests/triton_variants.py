"""Which compiled variants of opmap's Triton kernels a piece of code launches, without a GPU.

Triton compiles one binary per *specialization* of a kernel's arguments: each constexpr value,
and for the others their type and, unless the kernel opts out (``do_not_specialize``), whether an
integer is 1 or a multiple of 16 and whether a pointer is 16-byte aligned. A launch whose
specialization is new compiles (0.2-1.5 s on the H200) inside whatever called it. Under the
interpreter (TRITON_INTERPRET=1) nothing compiles, but the key is the same function of the
arguments: Triton's own ``native_specialize_impl`` computes it here from the launch's arguments,
as ``JITFunction.run`` does on a GPU.
"""
from __future__ import annotations

import inspect
import sys

import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import native_specialize_impl

RUN_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "launch_cooperative_grid")


def _import_ops() -> None:
    """Import every opmap.kernels module (the registry imports backends lazily, on first use)."""
    import importlib
    import pkgutil

    import opmap.kernels

    for m in pkgutil.walk_packages(opmap.kernels.__path__, "opmap.kernels."):
        try:
            importlib.import_module(m.name)
        except Exception:  # noqa: BLE001 - a peer's adapter whose package is not installed
            pass


def _kernels():
    """Every interpreted Triton kernel defined in an opmap.kernels module."""
    _import_ops()
    seen = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("opmap.kernels") or mod is None:
            continue
        for obj in vars(mod).values():
            fn = getattr(obj, "fn", None)  # an Autotuner / Heuristics wraps the function
            for k in (obj, fn, getattr(fn, "fn", None)):
                if isinstance(k, InterpretedFunction):
                    seen[id(k)] = k
    return list(seen.values())


class VariantRecorder:
    """``install()`` hooks every opmap kernel; ``keys`` collects (phase, kernel, specialization)
    for each launch, ``phase`` is whatever the caller sets (e.g. the engine step's phase)."""

    def __init__(self):
        self.keys: set = set()
        self.phase = "start-up"

    def install(self) -> "VariantRecorder":
        for k in _kernels():
            k.add_pre_run_hook(self._hook(k))
        return self

    def _hook(self, k: InterpretedFunction):
        params = list(inspect.signature(k.fn).parameters.values())
        dns = set(k.kwargs.get("do_not_specialize") or ())
        const = {p.name for p in params if p.annotation is tl.constexpr or p.annotation == "tl.constexpr"}

        def hook(*args, **kwargs):
            bound = dict(zip((p.name for p in params), args))
            bound.update({n: v for n, v in kwargs.items() if n not in RUN_OPTIONS})
            spec = []
            for i, p in enumerate(params):
                if p.name not in bound:
                    continue  # a default or an autotuned constexpr the hook does not see
                v = bound[p.name]
                if p.name in const:
                    spec.append((p.name, repr(v)))
                else:
                    s = p.name not in dns and i not in dns
                    spec.append((p.name, repr(native_specialize_impl(BaseBackend, v, False, s, True))))
            opts = tuple(sorted((n, kwargs[n]) for n in RUN_OPTIONS if n in kwargs))
            self.keys.add((self.phase, k.fn.__name__, tuple(spec), opts))

        return hook

    def variants(self, phases=None) -> set:
        """(kernel, specialization, options) of the launches in these phases (all when None)."""
        return {key[1:] for key in self.keys if phases is None or key[0] in phases}

    @staticmethod
    def explain(new: set, known: set) -> list:
        """One line per new variant: the arguments in which it differs from the closest known
        variant of the same kernel."""
        lines = []
        for k, spec, opts in sorted(new):
            same = [dict(s) for kk, s, _ in known if kk == k]
            d = dict(spec)
            if not same:
                lines.append(f"{k}: no variant of it ran at start-up")
                continue
            best = min(same, key=lambda o: sum(o.get(n) != v for n, v in d.items()))
            diff = {n: (best.get(n), v) for n, v in d.items() if best.get(n) != v}
            lines.append(f"{k}: differs from the closest start-up variant in {diff} (start-up, run)")
        return lines
