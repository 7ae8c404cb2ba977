"""What a family's sanitizer verdict was computed from: a hash of the code of the source files its
cases can run (the family's check-cases module, its ops package, and every opmap module those
import, followed through the import statements; docstrings, comments and layout left out), the
``OPMAP_*`` settings that change what is compiled or launched, and the torch and Triton versions.

A verdict saved in a state file (``opmap check --sanitizer --resume/--reuse``) counts again only
while its family's fingerprint is unchanged: a kernel edited after the run, or a run under other
settings (PDL on against off), runs again instead of passing on an old verdict.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import os
from pathlib import Path

import torch

import opmap

# Settings that name the run, not what runs.
_NOT_CODE = frozenset({"OPMAP_COMMIT"})


def _origin(name: str):
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin).resolve()


def _module_name(path: Path, roots: tuple) -> str:
    for root in roots:
        try:
            rel = path.relative_to(root.parent)
        except ValueError:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        return ".".join(parts)
    return ""


def _imports(path: Path, roots: tuple) -> set:
    """Module names imported by the file (relative imports resolved), submodule candidates included."""
    me = _module_name(path, roots)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def files_of(family: str) -> list:
    """The source files a family's cases can run, sorted."""
    root = Path(opmap.__file__).resolve().parent
    start_mod = family if "." in family else f"opmap.harness.check.cases.{family}"
    first = _origin(start_mod)
    if first is None:
        raise ValueError(f"family {family!r}: no module {start_mod}")
    roots = (root,)
    if not first.is_relative_to(root):  # a family of cases outside opmap (tests use one)
        roots += (_origin(start_mod.split(".")[0]).parent,)
    todo = [first]
    # backends the registry loads by name, not by an import statement: the family's definitions,
    # kernels and peer adapters
    dirs = [root / "engine"] if family == "engine" else [root / d / family for d in ("ops", "kernels", "peers")]
    for pkg_dir in dirs:
        if pkg_dir.is_dir():
            todo += sorted(p.resolve() for p in pkg_dir.glob("*.py"))
    seen: set = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path, roots):
            if not any(name == r.name or name.startswith(r.name + ".") for r in roots):
                continue
            # the package __init__ files on the way run too
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                o = _origin(".".join(parts[:i]))
                if o is not None and o not in seen and any(o.is_relative_to(r) for r in roots):
                    todo.append(o)
    return sorted(seen)


def code_settings() -> dict:
    """This process's ``OPMAP_*`` switches that change what is compiled or launched, sorted (the
    benchmark result files record them too)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("OPMAP_") and k not in _NOT_CODE}


def _settings() -> list:
    # heavy: triton, for its version only (harness.output, which the CLI loads at start, imports this module)
    import triton

    return [("torch", torch.__version__), ("triton", triton.__version__)] + list(code_settings().items())


def _dump(node) -> str:
    """``ast.dump`` without the fields that are None or empty. Python versions add fields with such
    defaults (3.12: ``type_params=[]`` on every function and class), so ``ast.dump`` of the same
    code differs between the CPU machine's Python 3.11 and the GPU machine's 3.12, and a
    fingerprint computed on one never matched the other's (state keyed on the CPU was stale on
    the GPU). This form is the same on 3.11, 3.12 and 3.13 for every file of
    opmap (checked on all three)."""
    if isinstance(node, ast.AST):
        fields = (f"{k}={_dump(v)}" for k, v in ast.iter_fields(node) if v is not None and v != [])
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(_dump(x) for x in node) + "]"
    return repr(node)


def code_of(path: Path) -> bytes:
    """A source file's code: its syntax tree without docstrings, comments and layout (the dump
    keeps neither comments nor line numbers). Editing those cannot change what runs, so it does
    not make a verdict stale; every other edit does."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return _dump(tree).encode()


@functools.lru_cache(maxsize=None)
def _of(family: str, settings: tuple) -> str:
    h = hashlib.sha256()
    for path in files_of(family):
        h.update(path.parent.name.encode() + b"/" + path.name.encode() + b"\0" + code_of(path) + b"\0")
    h.update(repr(settings).encode())
    return h.hexdigest()[:16]


def fingerprint(family: str) -> str:
    """16 hex digits; equal while the family's sources, the OPMAP_* settings and the torch and
    Triton versions are."""
    return _of(family, tuple(_settings()))
