"""Memory safety: run each GPU check case of our kernels in its own process under
``compute-sanitizer`` (memcheck; racecheck too for kernels tagged ``racecheck``, i.e. those that
reduce through shared memory), with PyTorch's caching allocator off so that an out-of-bounds
access lands outside any allocation instead of inside a cached block. Each case has a timeout;
an error is reported with the kernel it happened in and the case.

The child side (``python -m opmap.check.sanitizer --family F --section S --title T``) rebuilds
the family's cases, runs the one named and prints its outcome as one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Optional

from .. import registry
from .base import CheckCase

MARK = "OPMAP_SANITIZER_OUTCOME "
# Providers whose kernels are ours (peers are other people's binaries: not ours to sanitise).
OWN_PROVIDERS = ("opmap-triton",)


def find_sanitizer() -> Optional[str]:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            p = os.path.join(root, "bin", "compute-sanitizer")
            if os.access(p, os.X_OK):
                return p
    return None


def wants_sanitizer(c: CheckCase) -> bool:
    """A case of one of our kernels (by the provider its backend declares) that runs on a GPU."""
    if c.device == "cpu" or c.backend == "-":
        return False
    try:
        return registry.get(c.op, c.backend).provider in OWN_PROVIDERS
    except KeyError:
        return False


# Ops whose Triton kernels reduce across warps through shared memory (row sums and maxima,
# softmax, top-k search, tl.dot tiles): racecheck runs on their cases too. A case of another op
# asks for it with the tag "racecheck".
SMEM_REDUCTION_OPS = ("rmsnorm", "attention", "sampling", "logits", "moe", "gemm")


def tools_for(c: CheckCase) -> list[str]:
    race = "racecheck" in c.tags or c.op in SMEM_REDUCTION_OPS
    return ["memcheck", "racecheck"] if race else ["memcheck"]


_KERNEL = re.compile(r"\bat (?:0x[0-9a-f]+ in )?([A-Za-z_][\w:<>, ()]*?)(?:\+0x[0-9a-f]+| in |$)")
_RACE_KERNEL = re.compile(r"access at (?:0x[0-9a-f]+ in )?(.+?)\+0x[0-9a-f]+")


def parse(tool: str, text: str) -> tuple[int, list[str], list[str]]:
    """(error count, kernels named in the errors, first error lines) from sanitizer output."""
    if tool == "racecheck":
        m = re.search(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?", text)
    else:
        m = None
    m = m or re.search(r"ERROR SUMMARY: (\d+) errors?", text)
    count = int(m.group(1)) if m else -1  # -1: no summary line (the tool itself failed)
    lines = [ln.strip("= ").strip() for ln in text.splitlines() if ln.startswith("=========")]
    first = [ln for ln in lines if re.match(r"(Invalid|Error|Race|Out of|Misaligned|Program hit)", ln)][:3]
    kernels = []
    for ln in lines:
        # memcheck names the kernel on an "at KERNEL+0x..." line; racecheck inside the error line
        # ("Race reported between Read access at KERNEL+0x... and Write access at KERNEL+0x...").
        found = [k.group(1) for k in _RACE_KERNEL.finditer(ln)] if "access at" in ln else []
        if not found and ln.startswith("at "):
            k = _KERNEL.search(ln)
            found = [k.group(1)] if k else []
        for name in found:
            name = name.strip()
            if name not in kernels:
                kernels.append(name)
    return count, kernels[:3], first


_OWN_KERNELS: Optional[frozenset] = None


def own_kernels() -> frozenset:
    """Names of the @triton.jit functions in opmap's sources: the kernels that are ours. A hazard
    the tool reports only in other kernels (PyTorch's reductions that a case uses to build its
    inputs or its reference, cuBLAS) is not a defect of the kernel under check."""
    global _OWN_KERNELS
    if _OWN_KERNELS is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        names = set()
        for d, _, files in os.walk(root):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(d, f), encoding="utf-8") as fh:
                        names.update(re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+)", fh.read()))
        _OWN_KERNELS = frozenset(names)
    return _OWN_KERNELS


def is_own(kernel: str) -> bool:
    return kernel in own_kernels()


_LIBRARY_PREFIXES = ("nvjet", "cutlass", "sm80_", "sm90_", "ampere_", "cublas", "cudnn", "void ")


def is_library(kernel: str) -> bool:
    """Positively someone else's: a C++ name (namespace or template) or a cuBLAS/CUTLASS name.
    A plain name that is not one of our @triton.jit functions is neither: it still fails."""
    return not is_own(kernel) and ("::" in kernel or "<" in kernel or kernel.startswith(_LIBRARY_PREFIXES))


def run_one(fam: str, c: CheckCase, quick: bool, tool: str, timeout: float, exe: str):
    from .runner import Result

    cmd = [exe, "--tool", tool, "--report-api-errors", "no", "--print-limit", "20",
           sys.executable, "-m", "opmap.check.sanitizer", "--family", fam, "--section", c.section,
           "--title", c.title] + (["--quick"] if quick else [])
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    # CUDA-graph capture allocates from the caching allocator's private pools: with the cache off,
    # capture fails in PyTorch before any kernel of ours runs (seen on the H200: the "replay after
    # re-planning" cases exited with a CUDA error under both tools). Those cases keep it on.
    allocator_on = c.section == "graph"
    if allocator_on:
        env.pop("PYTORCH_NO_CUDA_MEMORY_CACHING")
    env.pop("TRITON_INTERPRET", None)
    t0 = time.perf_counter()
    case = f"{c.case} [{tool}]"
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return Result("sanitizer", c.op, c.backend, case, False, f"timed out after {timeout:.0f} s",
                      seconds=time.perf_counter() - t0, family=fam)
    text = p.stdout + "\n" + p.stderr
    count, kernels, first = parse(tool, text)
    outcome = None
    for ln in p.stdout.splitlines():
        if ln.startswith(MARK):
            outcome = json.loads(ln[len(MARK):])
    note = " (caching allocator on: graph capture needs it)" if allocator_on else ""
    foreign = count > 0 and kernels and all(is_library(k) for k in kernels)
    if count == 0 and outcome is not None:
        ok = bool(outcome["passed"])
        fig = f"{tool}: 0 errors{note} (the case {'passed' if ok else 'FAILED'} under the tool: {outcome['figure']})"
    elif foreign and outcome is not None:
        ok = bool(outcome["passed"])
        fig = (f"{tool}: 0 errors in our kernels{note}; {count} reported in other kernels only "
               f"({', '.join(k[:60] for k in kernels)}) (the case {'passed' if ok else 'FAILED'} under the tool: "
               f"{outcome['figure']})")
    elif count > 0:
        fig, ok = (f"{tool}: {count} errors in {', '.join(kernels) or 'an unnamed kernel'}: "
                   + " / ".join(first)), False
    else:
        tail = " | ".join(text.strip().splitlines()[-3:])
        fig, ok = f"{tool} did not complete (exit {p.returncode}): {tail}"[:400], False
    return Result("sanitizer", c.op, c.backend, case, ok, fig[:500], float(max(count, 0)), 0.0,
                  seconds=time.perf_counter() - t0, family=fam)


def run_all(pairs: list, quick: bool, timeout: float, progress: bool = True, jobs_n: int = 4) -> list:
    from .runner import Result

    exe = find_sanitizer()
    if exe is None:
        return [Result("sanitizer", "-", "-", "(all GPU cases)", False,
                       "compute-sanitizer not found on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin")]
    jobs = [(f, c, tool) for f, c in pairs for tool in tools_for(c)]
    if not jobs:
        return [Result("sanitizer", "-", "-", "(no case of our kernels selected)", True,
                       "nothing to run under compute-sanitizer")]
    # Children run concurrently (each is mostly Python start-up and Triton compilation, and the
    # tool slows the kernels down, so one GPU holds several); results keep the case order.
    from concurrent.futures import ThreadPoolExecutor

    done = [0]

    def one(job):
        f, c, tool = job
        r = run_one(f, c, quick, tool, timeout, exe)
        done[0] += 1
        if progress:
            # A failure's figure goes to the log at once: a run cut off by a time limit still
            # says why each finished case failed.
            print(f"[sanitizer {done[0]}/{len(jobs)}] {tool} {c.title}: "
                  f"{'ok' if r.passed else 'FAIL ' + r.figure[:400]} ({r.seconds:.0f} s)", file=sys.stderr, flush=True)
        return r

    with ThreadPoolExecutor(max_workers=max(1, jobs_n)) as pool:
        return list(pool.map(one, jobs))


def _child(argv=None) -> int:
    import importlib

    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--family", required=True)
    ap.add_argument("--section", required=True)
    ap.add_argument("--title", required=True)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # A family name, or a dotted module path (how tests hand the child a module of their own).
    mod = importlib.import_module(a.family if "." in a.family else f"opmap.check.cases.{a.family}")
    match = [c for c in mod.cases(device, a.quick) if c.section == a.section and c.title == a.title]
    if not match:
        print(f"no case {a.section}:{a.title!r} in family {a.family}", file=sys.stderr)
        return 3
    o = match[0].run()
    if device == "cuda":
        torch.cuda.synchronize()  # an asynchronous fault must surface inside this process
    print(MARK + json.dumps({"passed": bool(o.passed), "figure": o.figure}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child())
