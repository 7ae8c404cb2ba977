"""Memory safety: run each GPU check case of our kernels in its own process under
``compute-sanitizer`` (memcheck; racecheck too for kernels tagged ``racecheck``, i.e. those that
reduce through shared memory), with PyTorch's caching allocator off so that an out-of-bounds
access lands outside any allocation instead of inside a cached block. Each case has a timeout;
an error is reported with the kernel it happened in and the case.

The child side (``python -m opmap.harness.check.sanitizer --family F --section S --title T``) rebuilds
the family's cases, runs the one named and prints its outcome as one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Optional

import torch

from opmap.core import registry
from opmap.harness.check.base import CheckCase
from opmap.harness.check.fingerprint import fingerprint
from opmap.harness.check.result import Result

MARK = "opmap-sanitizer-outcome: "
SEP = "::"  # between a case's section and title on the child's command line
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
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def _env(graph: bool, tool: str) -> dict:
    # OPMAP_SANITIZER_TOOL: case modules may shrink what only costs time under a tool (the
    # attention cases cap their longest sequences under racecheck; see harness/check/cases/attention.py).
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", OPMAP_SANITIZER_TOOL=tool)
    # CUDA-graph capture allocates from the caching allocator's private pools: with the cache off,
    # capture fails in PyTorch before any kernel of ours runs (seen on the H200: the "replay after
    # re-planning" cases exited with a CUDA error under both tools). Those cases keep it on.
    if graph:
        env.pop("PYTORCH_NO_CUDA_MEMORY_CACHING")
    env.pop("TRITON_INTERPRET", None)
    return env


# The children under the tool at once (run_all sets it from --jobs): batch children and the
# single-case reruns of a failed batch share it, so the reruns run side by side within the limit.
_SLOTS: Optional[threading.BoundedSemaphore] = None


# Children still running, each the leader of its own process group. compute-sanitizer starts the
# checked Python as its own child, so killing the tool alone (subprocess.run's timeout) left that
# process on the GPU; and an `opmap check` killed by `timeout` left both. On a GPU machine kept
# warm between runs they ran on into the next run (bench figures several times slow, a racecheck
# timed out). Their whole groups are killed on a timeout and when this process is
# terminated (run_all's SIGTERM handler).
_CHILDREN: set = set()
_STOPPING = threading.Event()  # set on SIGTERM: start no child, record no verdict


def run_group(cmd: list, timeout: float, env=None) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=...) in a new process group,
    killed whole on timeout (raises TimeoutExpired) or by ``kill_children``."""
    if _STOPPING.is_set():
        raise SystemExit("terminated")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    _CHILDREN.add(p)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(p)
        p.communicate()
        raise
    finally:
        _CHILDREN.discard(p)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_children(signum=None, frame=None) -> None:
    """Kill every running child's process group; as a signal handler, then exit (the verdicts of
    the killed cases are not recorded: a resume runs them again)."""
    if signum is not None:
        _STOPPING.set()
    for p in list(_CHILDREN):
        _kill_group(p)
    if signum is not None:
        raise SystemExit(128 + signum)


def _launch(exe: str, tool: str, fam: str, cases: list, quick: bool, timeout: float):
    """Run ``cases`` (one family, one tool) in one child under the tool: (completed process or
    None on timeout, {title: outcome})."""
    cmd = [exe, "--tool", tool, "--report-api-errors", "no", "--print-limit", "20",
           sys.executable, "-m", "opmap.harness.check.sanitizer", "--family", fam]
    for c in cases:
        cmd += ["--case", f"{c.section}{SEP}{c.title}"]
    cmd += ["--quick"] if quick else []
    try:
        with _SLOTS or contextlib.nullcontext():
            p = run_group(cmd, timeout, _env(cases[0].section == "graph", tool))
    except subprocess.TimeoutExpired:
        return None, {}
    outcomes = {}
    for ln in p.stdout.splitlines():
        if ln.startswith(MARK):
            o = json.loads(ln[len(MARK):])
            outcomes[o.get("title")] = o
    return p, outcomes


def _verdict(tool: str, c: CheckCase, count: int, kernels: list, first: list, outcome, p) -> tuple:
    """(passed, figure) of one case from the tool's summary and the case's own outcome."""
    note = " (caching allocator on: graph capture needs it)" if c.section == "graph" else ""
    foreign = count > 0 and kernels and all(is_library(k) for k in kernels)
    if count == 0 and outcome is not None:
        ok = bool(outcome["passed"])
        return ok, f"{tool}: 0 errors{note} (the case {'passed' if ok else 'FAILED'} under the tool: {outcome['figure']})"
    if foreign and outcome is not None:
        ok = bool(outcome["passed"])
        return ok, (f"{tool}: 0 errors in our kernels{note}; {count} reported in other kernels only "
                    f"({', '.join(k[:60] for k in kernels)}) (the case {'passed' if ok else 'FAILED'} under the tool: "
                    f"{outcome['figure']})")
    if count > 0:
        return False, f"{tool}: {count} errors in {', '.join(kernels) or 'an unnamed kernel'}: " + " / ".join(first)
    text = (p.stdout + "\n" + p.stderr) if p is not None else ""
    tail = " | ".join(text.strip().splitlines()[-3:])
    return False, f"{tool} did not complete (exit {p.returncode if p is not None else '?'}): {tail}"[:400]


def run_one(fam: str, c: CheckCase, quick: bool, tool: str, timeout: float, exe: str):
    """One case alone in its own process under the tool."""
    t0 = time.perf_counter()
    case = f"{c.case} [{tool}]"
    p, outcomes = _launch(exe, tool, fam, [c], quick, timeout)
    if p is None:
        return Result("sanitizer", c.op, c.backend, case, False, f"timed out after {timeout:.0f} s",
                      seconds=time.perf_counter() - t0, family=fam)
    count, kernels, first = parse(tool, p.stdout + "\n" + p.stderr)
    ok, fig = _verdict(tool, c, count, kernels, first, outcomes.get(c.title), p)
    return Result("sanitizer", c.op, c.backend, case, ok, fig[:500], float(max(count, 0)), 0.0,
                  seconds=time.perf_counter() - t0, family=fam)


def run_batch(fam: str, cases: list, quick: bool, tool: str, timeout: float, exe: str) -> list:
    """Several cases of one family in one process under the tool (one Python start-up, one CUDA
    context under the tool, one build of the family's cases: most of a case's time under the tool).
    When the run is clean, or its errors are all in library kernels, each case gets its own
    verdict from its outcome line. Otherwise (an error in one of our kernels, a crash, a timeout)
    every case of the batch runs again alone, so each error is pinned to its case."""
    if len(cases) == 1:
        return [run_one(fam, cases[0], quick, tool, timeout, exe)]
    t0 = time.perf_counter()
    # One case's timeout plus 30 s per further case: most of a single-case child's time is
    # start-up, which the batch pays once. A batch holding one slow case (racecheck
    # of a prefill kernel) times out early and its cases run alone with the full timeout each.
    p, outcomes = _launch(exe, tool, fam, cases, quick, timeout + BATCH_EXTRA_S * (len(cases) - 1))
    if p is not None:
        count, kernels, first = parse(tool, p.stdout + "\n" + p.stderr)
        clean = count == 0 or (count > 0 and kernels and all(is_library(k) for k in kernels))
        if clean and p.returncode == 0 and all(c.title in outcomes for c in cases):
            each = (time.perf_counter() - t0) / len(cases)
            out = []
            for c in cases:
                ok, fig = _verdict(tool, c, count, kernels, first, outcomes[c.title], p)
                out.append(Result("sanitizer", c.op, c.backend, f"{c.case} [{tool}]", ok, fig[:500],
                                  float(max(count, 0)), 0.0, seconds=each, family=fam))
            return out
    # Side by side (within the --jobs limit of _SLOTS): a batch that timed out holds the slow
    # cases, and one after another they cost the sum of their timeouts.
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        return list(pool.map(lambda c: run_one(fam, c, quick, tool, timeout, exe), cases))


BATCH = 6  # cases per child process (same family, tool and allocator setting)
BATCH_EXTRA_S = 30.0  # batch timeout: one case's timeout plus this per further case


def _timed_out(r) -> bool:
    return not r.passed and r.figure.startswith("timed out after")


def _key(fam: str, c: CheckCase, tool: str) -> str:
    return f"{fam}{SEP}{c.section}{SEP}{c.title}{SEP}{tool}"


def load_state(path: Optional[str], current: bool = False) -> dict:
    """Finished sanitizer verdicts of an earlier run (one JSON line each), by case key. A run cut
    off by a time limit resumes from here instead of starting over: a full preset is over a
    hundred tool runs, each paying its start-up. ``current``: only the verdicts whose family's source
    fingerprint (check.fingerprint) is today's; a verdict of code edited since, or of a line
    saved before fingerprints were recorded, is left out (``stale_count`` says how many)."""
    return _load(path, current)[0]


def stale_count(path: Optional[str]) -> int:
    """Verdicts in the state file that ``load_state(path, current=True)`` leaves out."""
    return _load(path, True)[1]


def _load(path: Optional[str], current: bool) -> tuple:
    done, stale = {}, 0
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for ln in f:
                if ln.strip():
                    d = json.loads(ln)
                    key, source = d.pop("key"), d.pop("source", None)
                    if current and source != fingerprint(key.split(SEP, 1)[0]):
                        stale += 1
                        continue
                    done[key] = Result(**d)
    return done, stale


def _line(fam: str, c: CheckCase, tool: str, r) -> str:
    return json.dumps({"key": _key(fam, c, tool), "source": fingerprint(fam), **asdict(r)}) + "\n"


def run_all(pairs: list, quick: bool, timeout: float, progress: bool = True, jobs_n: int = 4,
            batch: int = BATCH, state: Optional[str] = None, reuse=()) -> list:
    """Every (family, case) under its tools. ``state``: a JSON-lines file that each verdict is
    appended to as it finishes; verdicts already in it are reused, not run again. ``reuse``: other
    runs' state files whose verdicts count where the key (family, section, case title, tool) is
    the same, e.g. another preset's run: the cases of families that do not depend on the model
    are the same cases. Those verdicts are copied into ``state``. Either way only verdicts whose
    family's source fingerprint is today's count (check.fingerprint)."""
    global _SLOTS
    exe = find_sanitizer()
    if exe is None:
        return [Result("sanitizer", "-", "-", "(all GPU cases)", False,
                       "compute-sanitizer not found on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin")]
    jobs = [(f, c, tool) for f, c in pairs for tool in tools_for(c)]
    earlier, stale = _load(state, True)
    results: list = [earlier.get(_key(f, c, tool)) for f, c, tool in jobs]
    if progress and (stale or any(r is not None for r in results)):
        print(f"[sanitizer] {sum(r is not None for r in results)} of {len(jobs)} verdicts reused from {state}"
              + (f"; {stale} left out: their family's sources or settings changed since" if stale else ""),
              file=sys.stderr, flush=True)
    for other in reuse:
        (shared, stale), n = _load(other, True), 0
        for k, (f, c, tool) in enumerate(jobs):
            key = _key(f, c, tool)
            if results[k] is None and key in shared:
                results[k], n = shared[key], n + 1
                if state:
                    with open(state, "a", encoding="utf-8") as fh:
                        fh.write(_line(f, c, tool, results[k]))
        if progress and (n or stale):
            print(f"[sanitizer] {n} verdicts of the same cases reused from {other}"
                  + (f"; {stale} left out (stale)" if stale else ""), file=sys.stderr, flush=True)
    lock = threading.Lock()
    if not jobs:
        return [Result("sanitizer", "-", "-", "(no case of our kernels selected)", True,
                       "nothing to run under compute-sanitizer")]
    # Batches of one family, tool and allocator setting; batches run concurrently (each child is
    # mostly Python start-up, CUDA context creation under the tool and Triton loading, and the
    # tool slows the kernels down, so one GPU holds several); results keep the case order.
    groups: dict = {}
    for k, (f, c, tool) in enumerate(jobs):
        if results[k] is not None:
            continue
        groups.setdefault((f, tool, c.section == "graph"), []).append(k)
    chunks = [ks[i:i + max(1, batch)] for ks in groups.values() for i in range(0, len(ks), max(1, batch))]
    # Longest first, so that a run cut off by a device call's time limit has finished them: the
    # racecheck runs take several times a memcheck one, and the MoE ones the longest.
    chunks.sort(key=lambda ks: (jobs[ks[0]][2] != "racecheck", jobs[ks[0]][0] != "moe"))
    done = [sum(r is not None for r in results)]

    def one(ks):
        f, _, tool = jobs[ks[0]]
        try:
            rs = run_batch(f, [jobs[k][1] for k in ks], quick, tool, timeout, exe)
        except SystemExit:  # terminated (kill_children): nothing to record
            return
        if _STOPPING.is_set():
            return  # killed mid-run: these verdicts are the kill's, not the kernels'
        for k, r in zip(ks, rs):
            results[k] = r
            with lock:
                done[0] += 1
                # A time-out is a verdict on the time limit, not on the kernel: reported, not kept,
                # so that a resumed run tries the case again (with a longer --timeout, or alone).
                if state and not _timed_out(r):
                    with open(state, "a", encoding="utf-8") as fh:
                        fh.write(_line(f, jobs[k][1], tool, r))
            if progress:
                # A failure's figure goes to the log at once: a run cut off by a time limit still
                # says why each finished case failed.
                print(f"[sanitizer {done[0]}/{len(jobs)}] {tool} {jobs[k][1].title}: "
                      f"{'ok' if r.passed else 'FAIL ' + r.figure[:400]} ({r.seconds:.0f} s)",
                      file=sys.stderr, flush=True)

    _SLOTS = threading.BoundedSemaphore(max(1, jobs_n))
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, kill_children) if main else None
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs_n)) as pool:
            list(pool.map(one, chunks))
    finally:
        _SLOTS = None
        kill_children()  # none left after a normal end; all of them after an exception
        if main:
            signal.signal(signal.SIGTERM, before)
        _STOPPING.clear()
    return results


def _child(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", required=True)
    ap.add_argument("--case", action="append", default=[], help=f"SECTION{SEP}TITLE (repeatable)")
    ap.add_argument("--section", help="with --title: one case")
    ap.add_argument("--title")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    wanted = [tuple(x.split(SEP, 1)) for x in a.case] + ([(a.section, a.title)] if a.title else [])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # A family name, or a dotted module path (how tests hand the child a module of their own).
    mod = importlib.import_module(a.family if "." in a.family else f"opmap.harness.check.cases.{a.family}")
    have = {(c.section, c.title): c for c in mod.cases(device, a.quick)}
    missing = [w for w in wanted if w not in have]
    if missing or not wanted:
        print(f"no case {missing[0][0] + ':' + repr(missing[0][1]) if missing else '(none named)'} "
              f"in family {a.family}", file=sys.stderr)
        return 3
    for key in wanted:
        o = have[key].run()
        if device == "cuda":
            torch.cuda.synchronize()  # an asynchronous fault must surface inside this process
        print(MARK + json.dumps({"title": key[1], "passed": bool(o.passed), "figure": o.figure}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child())
