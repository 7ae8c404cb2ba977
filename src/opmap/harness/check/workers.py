"""`opmap check` on a GPU in worker processes. Most of a GPU case's wall time is compiling its
Triton kernels on one CPU core (the cache is cold on a fresh machine), so N processes share the
cases: each rebuilds the same selection (``runner.selection``), then runs the case indices the
parent hands it on stdin, one at a time, and answers each with one JSON line. The work queue
gives the slow cases (the model's own HF parity, the engine cases) out first. A worker that dies
(a CUDA error poisons its context) fails the case it held with its last stderr lines, and a
fresh worker takes the rest of its share.

The child side is ``opmap.harness.check.worker_child`` (``python -m opmap.harness.check.worker_child ARGS_JSON``).
"""
from __future__ import annotations

from contextlib import nullcontext

from opmap.harness.workpool import child_cmd, run_queue
from opmap.harness.check.result import Result, progress_bar


def _rank(case) -> int:
    """Order of the queue: the model's own parity first, the engine cases next, the rest as listed."""
    return 0 if "own" in case.tags else 1 if "engine" in case.tags else 2


def _failed(fam: str, c, why: str) -> Result:
    return Result(c.section, c.op, c.backend, c.case, False, why[:400], family=fam)


def run_parallel(selected: list, n: int, args: dict, progress: bool = True) -> list:
    """Results of ``selected`` in its order, run by ``n`` worker processes; ``args`` are the
    selection's arguments (``runner.selection``), which each worker rebuilds the list from."""
    order = sorted(range(len(selected)), key=lambda k: _rank(selected[k][1]))
    results: list = [None] * len(selected)
    with (progress_bar() if progress else nullcontext()) as prog:
        task = prog.add_task("", total=len(selected)) if prog else None

        def answer(k, got, why):
            fam, c = selected[k]
            if got is None:
                results[k] = _failed(fam, c, why)
            elif "fatal" in got or got.get("title") != c.title:
                results[k] = _failed(fam, c, got.get("fatal") or f"the worker's case {k} is {got.get('title')!r}, not this one")
            else:
                results[k] = Result(**got["result"])
            if prog:
                prog.update(task, description=c.title[:70])
                prog.advance(task)

        run_queue(order, n, _cmd(args, len(selected)), answer)
    return results


def _cmd(args: dict, total: int) -> list:
    return child_cmd("opmap.harness.check.worker_child", args, total)
