"""Every PDL-aware kernel waits for its predecessor before it touches memory.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it still runs; if it
loads, stores or atomically updates global memory before ``griddepcontrol.wait``, it can read
stale data or race with the predecessor, and no test on an idle GPU would notice. So: for each
@triton.jit kernel under opmap.kernels that takes a ``PDL`` parameter, no statement before the first
``enter(PDL)`` / ``gdc_wait()`` may call a memory operation. Checked on the source (AST), so it
runs on the CPU and covers kernels added later."""
import ast
import importlib
import inspect
import pkgutil
import textwrap

import opmap.kernels

MEMORY = {"load", "store", "atomic_add", "atomic_cas", "atomic_xchg", "atomic_max", "atomic_min",
          "atomic_and", "atomic_or", "atomic_xor"}
WAITS = {"enter", "gdc_wait"}


def _pdl_kernels():
    out = {}
    for m in pkgutil.walk_packages(opmap.kernels.__path__, "opmap.kernels."):
        mod = importlib.import_module(m.name)
        for name, obj in vars(mod).items():
            # JITFunction, or InterpretedFunction under TRITON_INTERPRET=1: both keep the Python function
            fn = getattr(obj, "fn", None)
            # (the Gluon kernels' own enter(PDL) helper is the wait itself)
            if callable(fn) and "PDL" in (getattr(obj, "arg_names", None) or ()) and fn.__name__ not in WAITS:
                out[f"{fn.__module__}.{fn.__name__}"] = fn
    return out


# Gluon kernels load through async copies, issued by their issue / _issue* helpers: counted as loads
ASYNC_LOADS = {"async_copy_global_to_shared"}


def _calls(node):
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            names.add("load" if name in ASYNC_LOADS or name == "issue" or name.startswith("_issue") else name)
    return names


def _problem(src: str):
    """None when the function waits before any memory operation, else what is wrong."""
    body = ast.parse(textwrap.dedent(src)).body[0].body
    before = []
    for stmt in body:
        if _calls(stmt) & WAITS:
            break
        before.append(stmt)
    else:
        return "takes PDL but never waits (enter(PDL) / gdc_wait())"
    touched = set().union(set(), *(_calls(s) for s in before)) & MEMORY
    return f"{sorted(touched)} before the PDL wait" if touched else None


def test_the_check_sees_a_load_before_the_wait():
    bad = """
def k(x_ptr, PDL: tl.constexpr = False):
    x = tl.load(x_ptr)
    enter(PDL)
    tl.store(x_ptr, x)
"""
    good = bad.replace("    x = tl.load(x_ptr)\n    enter(PDL)\n", "    enter(PDL)\n    x = tl.load(x_ptr)\n")
    assert _problem(bad) == "['load'] before the PDL wait" and _problem(good) is None
    assert "never waits" in _problem("def k(PDL):\n    tl.store(p, 1)\n")


# Kernels that load before the wait, and why that is safe: only loads, of inputs that their one
# possible predecessor does not write (a predecessor releases its dependents only after its own
# wait, so everything before it is complete and visible).
LOADS_BEFORE_WAIT = {
    "opmap.kernels.attention.splitkv._combine_kernel":
        "seq_lens / cu_seqlens for the split plan; launched only right after a decode kernel (decode.py's or "
        "decode_fp8.py's), which reads them",
    "opmap.kernels.gemm.wo_gluon._wo_kernel":
        "the weight tiles of the first stages (async copies): weights, which no kernel of a step writes",
    "opmap.kernels.gemm.w4a16_gluon._w4a16_mma_kernel":
        "the first K tile's weight words: weights, which no kernel of a step writes",
    "opmap.kernels.gemm.wo_wgmma._wo_wgmma_kernel":
        "the weight tiles of the first stages (async copies): weights, which no kernel of a step writes",
}


def test_every_pdl_kernel_waits_before_touching_memory():
    kernels = _pdl_kernels()
    assert len(kernels) >= 15, sorted(kernels)  # the decode-step kernels and the sampler's passes at least
    problems = {name: p for name, fn in kernels.items() if (p := _problem(inspect.getsource(fn)))}
    declared = {name: p for name, p in problems.items() if name in LOADS_BEFORE_WAIT}
    assert all(p == "['load'] before the PDL wait" for p in declared.values()), declared  # loads only
    assert set(declared) == set(LOADS_BEFORE_WAIT), "a declared kernel no longer loads early: drop it"
    assert not {n: p for n, p in problems.items() if n not in declared}, problems


def _launch_sites():
    """(module, kernel expression) of every ``kernel[grid](..., **pdl.launch(...))`` under opmap.kernels,
    and of launches whose keyword dict came from pdl.launch by name (``**pl``, ``**cb``)."""
    sites = []
    for m in pkgutil.walk_packages(opmap.kernels.__path__, "opmap.kernels."):
        mod = importlib.import_module(m.name)
        try:
            tree = ast.parse(inspect.getsource(mod))
        except (OSError, TypeError):
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.Module)):
                continue
            # names bound to pdl.launch(...) or to dicts that unpack it, in this function
            pdl_names = set()
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                    v = n.value
                    uses = any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "launch"
                               and getattr(c.func.value, "id", "") == "pdl" for c in ast.walk(v))
                    if uses or any(isinstance(x, ast.Name) and x.id in pdl_names for x in ast.walk(v)):
                        pdl_names.add(n.targets[0].id)
            for n in ast.walk(fn):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript):
                    for kw in n.keywords:
                        if kw.arg is not None:
                            continue
                        v = kw.value
                        direct = (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute)
                                  and v.func.attr == "launch" and getattr(v.func.value, "id", "") == "pdl")
                        if direct or (isinstance(v, ast.Name) and v.id in pdl_names):
                            sites.append((mod, ast.unparse(n.func.value)))
    return sites


def test_every_kernel_launched_with_pdl_takes_the_pdl_parameter():
    """A kernel launched with launch_pdl=True but without a PDL parameter would start early and
    never wait."""
    sites = _launch_sites()
    assert len(sites) >= 15, sites
    missing = []
    for mod, expr in set(sites):
        if "(" in expr:  # triton_gemm's _tuned(small): the autotuned kernel of one shape class
            expr = expr.split("(")[0] + "(True)"
        obj = eval(expr, vars(mod))  # noqa: S307 - a name or call from our own source
        names = getattr(obj, "arg_names", None)
        if names is None:  # an autotuner or heuristics wrapper: the kernel underneath
            inner = obj
            while names is None and hasattr(inner, "fn"):
                inner = inner.fn
                names = getattr(inner, "arg_names", None)
        if not names or "PDL" not in names:
            missing.append(f"{mod.__name__}: {expr}")
    assert not missing, missing
