"""opmap's own kernel symbols, derived from the registry rather than kept by hand: each registered
backend's ``impl`` modules, and the ``opmap.kernels`` modules those import (transitively), are read
with ``ast`` (no Triton import), and every ``@triton.jit`` / ``@gluon.jit`` function they define is a
symbol that backend can launch. A trace of opmap's engine then names the backend of a kernel that no
operator range encloses (a replayed CUDA graph) from its symbol alone.

A definition reached by several backends belongs to those that reach it through the fewest imports:
the module a backend names in its ``impl`` is more specific than a module it merely imports (the
split-KV helpers ``merge.py`` lends the decode kernels stay ``attention_merge``'s; ``_rmsnorm_kernel``,
reachable from ``rope_append.py`` through its import of the norm module's helpers, stays
``rmsnorm``'s). Two definitions that share a name (``_combine_kernel``: the split-KV decode combine
and the MoE combine) are two kernels with one symbol: the symbol lists the owners of both, and the
trace decides between them (the operator range, or the kernels around it)."""
from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import NamedTuple

from opmap.core import registry

# The registry's ops -> operator categories (also the op of an ``opmap::<op>::<label>::<backend>``
# range of opmap's engine).
OP_CATEGORY = {"attention": "attention", "kv_append": "attention", "attention_merge": "attention", "gemm": "GEMM",
               "rmsnorm": "norm", "rope": "RoPE", "activation": "activation", "moe": "MoE", "logits": "sampling",
               "sampling": "sampling", "grammar_mask": "grammar"}
ROOT = Path(registry.__file__).resolve().parents[1]  # src/opmap
KERNELS = "opmap.kernels"


class Owner(NamedTuple):
    op: str  # the registry op ("attention", "kv_append", "gemm", ...)
    backend: str  # the backend's registered name
    module: str  # the module defining the jit function

    @property
    def category(self) -> str:
        return OP_CATEGORY.get(self.op, "other")


def module_file(module: str):
    """The source file of an opmap module (a .py file or a package's __init__.py), None outside."""
    if module != "opmap" and not module.startswith("opmap."):
        return None
    rel = Path(*module.split(".")[1:])
    for p in (ROOT / rel.with_suffix(".py"), ROOT / rel / "__init__.py"):
        if p.is_file():
            return p
    return None


def _is_jit(dec: ast.expr) -> bool:
    f = dec.func if isinstance(dec, ast.Call) else dec
    return (isinstance(f, ast.Attribute) and f.attr == "jit") or (isinstance(f, ast.Name) and f.id == "jit")


@functools.lru_cache(maxsize=None)
def parse(module: str) -> tuple[tuple, tuple]:
    """(jit function names defined at the top level, opmap.kernels modules imported anywhere in
    it, function-level imports included) of one module."""
    path = module_file(module)
    if path is None:
        return (), ()
    tree = ast.parse(path.read_text(), str(path))
    jit = tuple(n.name for n in tree.body if isinstance(n, ast.FunctionDef) and any(map(_is_jit, n.decorator_list)))
    imports = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            imports += [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            # `from opmap.kernels.attention import decode_fp8` imports a module; `from m import f`, m itself
            subs = [f"{n.module}.{a.name}" for a in n.names if module_file(f"{n.module}.{a.name}")]
            imports += subs or [n.module]
    kernels = (m for m in dict.fromkeys(imports) if m.startswith(KERNELS + ".") and module_file(m))
    return jit, tuple(kernels)


def _reach(module: str) -> dict:
    """module -> import depth (0: the impl module itself) of every module a backend's impl reaches."""
    depth, frontier = {module: 0}, [module]
    while frontier:
        nxt = []
        for m in frontier:
            for sub in parse(m)[1]:
                if sub not in depth:
                    depth[sub] = depth[m] + 1
                    nxt.append(sub)
        frontier = nxt
    return depth


@functools.lru_cache(maxsize=None)
def table() -> dict:
    """symbol -> tuple of Owners (op, backend, defining module), in registry order."""
    by_def: dict = {}  # (module, symbol) -> {(op, backend): depth}
    for op in registry.ops():
        for b in registry.backends(op):
            for target in b.impl.values():
                for m, d in _reach(target.split(":")[0]).items():
                    for sym in parse(m)[0]:
                        seen = by_def.setdefault((m, sym), {})
                        seen[(op, b.name)] = min(d, seen.get((op, b.name), d))
    out: dict = {}
    for (m, sym), owners in by_def.items():
        best = min(owners.values())
        out.setdefault(sym, [])
        out[sym] += [Owner(op, name, m) for (op, name), d in owners.items() if d == best]
    return {s: tuple(v) for s, v in out.items()}


def owners(symbol: str) -> tuple:
    """The Owners of a kernel symbol (empty for a symbol that is not opmap's)."""
    return table().get(symbol, ())


def categories(symbol: str) -> tuple:
    """The operator categories a symbol of ours can be, registry order, without repeats."""
    return tuple(dict.fromkeys(o.category for o in owners(symbol)))


def _weight_dtypes(b) -> tuple:
    req = next((r for r in b.reqs if r.field == "weight_dtype" and not callable(r.allowed)), None)
    return tuple(req.allowed) if req else ()


@functools.lru_cache(maxsize=None)
def quantised_gemms() -> frozenset:
    """Names of the gemm backends that serve quantised weights only (their declared weight dtypes
    hold no 16- or 32-bit one): their kernels read fp8 / int8 / int4 / block-fp8 weights."""
    return frozenset(b.name for b in registry.backends("gemm")
                     if _weight_dtypes(b) and not any(d in ("fp32", "fp16", "bf16") for d in _weight_dtypes(b)))


def quantised_only(symbol: str) -> bool:
    """A kernel of ours that only quantised-weight gemm backends launch."""
    own = owners(symbol)
    return bool(own) and all(o.op == "gemm" and o.backend in quantised_gemms() for o in own)


def low_precision_gemm(symbol: str) -> bool:
    """A kernel of ours that multiplies quantised weights: a kernel of quantised-only gemm backends
    that is not one of their (de)quantisers, which say so in their names (``_dequant_kernel`` feeds
    a dense GEMM; ``_act_quant_kernel`` feeds cuBLASLt's fp8 GEMM)."""
    return quantised_only(symbol) and "quant" not in symbol
