"""`opmap check` on a GPU in worker processes. Most of a GPU case's wall time is compiling its
Triton kernels on one CPU core (the cache is cold on a fresh machine), so N processes share the
cases: each rebuilds the same selection (``runner.selection``), then runs the case indices the
parent hands it on stdin, one at a time, and answers each with one JSON line. The work queue
gives the slow cases (the model's own HF parity, the engine cases) out first. A worker that dies
(a CUDA error poisons its context) fails the case it held with its last stderr lines, and a
fresh worker takes the rest of its share.

The child side is ``opmap.check.worker_child`` (``python -m opmap.check.worker_child ARGS_JSON``).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from collections import deque

from .result import Result

MARK = "opmap-check-result: "


def _rank(case) -> int:
    """Order of the queue: the model's own parity first, the engine cases next, the rest as listed."""
    return 0 if "own" in case.tags else 1 if "engine" in case.tags else 2


def _failed(fam: str, c, why: str) -> Result:
    return Result(c.section, c.op, c.backend, c.case, False, why[:400], family=fam)


class _Worker:
    def __init__(self, cmd: list):
        self.err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: nothing blocks on it
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                  text=True, bufsize=1)

    def ask(self, k: int):
        """The worker's answer (a dict) for case k, or None when it died."""
        try:
            self.p.stdin.write(f"{k}\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        for line in self.p.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        return None

    def tail(self) -> str:
        self.p.wait()
        self.err.seek(0)
        lines = [ln for ln in self.err.read().strip().splitlines() if ln.strip()]
        return f"worker exited with code {self.p.returncode}: " + " | ".join(lines[-3:])

    def close(self) -> None:
        try:
            self.p.stdin.close()
        except OSError:
            pass
        self.p.wait()
        self.err.close()


def run_parallel(selected: list, n: int, args: dict, progress: bool = True) -> list:
    """Results of ``selected`` in its order, run by ``n`` worker processes; ``args`` are the
    selection's arguments (``runner.selection``), which each worker rebuilds the list from."""
    from contextlib import nullcontext

    order = sorted(range(len(selected)), key=lambda k: _rank(selected[k][1]))
    queue, lock = deque(order), threading.Lock()
    results: list = [None] * len(selected)
    cmd = _cmd(args, len(selected))
    bar = _bar(len(selected)) if progress else nullcontext()

    def drive(advance):
        w = _Worker(cmd)
        while True:
            with lock:
                k = queue.popleft() if queue else None
            if k is None:
                break
            fam, c = selected[k]
            got = w.ask(k)
            if got is None:
                results[k] = _failed(fam, c, w.tail())
                w.close()
                w = _Worker(cmd)
            elif "fatal" in got or got.get("title") != c.title:
                why = got.get("fatal") or f"the worker's case {k} is {got.get('title')!r}, not this one"
                results[k] = _failed(fam, c, why)
            else:
                results[k] = Result(**got["result"])
            advance(c.title)
        w.close()

    with bar as prog:
        task = prog.add_task("", total=len(selected)) if prog else None

        def advance(title):
            if prog:
                with lock:
                    prog.update(task, description=title[:70])
                    prog.advance(task)

        threads = [threading.Thread(target=drive, args=(advance,), daemon=True) for _ in range(min(n, len(selected)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results


def _cmd(args: dict, total: int) -> list:
    return [sys.executable, "-m", "opmap.check.worker_child", json.dumps({**args, "total": total})]


def _bar(total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]check"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.description}"), transient=True)
