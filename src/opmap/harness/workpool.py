"""Worker processes that share a list of items by index (the GPU check's cases, the benchmark's
compile warm-up). Each worker is a child process that rebuilds the same list itself, then reads
indices from stdin, one at a time, and answers each with one JSON line marked ``MARK`` on stdout
(anything else it prints goes to stderr: ``child_stdout``). The parent hands out the indices in
the order given (a queue shared by the workers); a worker that dies is replaced, and the item it
held is answered with None and its last stderr lines."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from typing import Callable, Optional

MARK = "opmap-worker-answer: "


class Worker:
    def __init__(self, cmd: list):
        self.err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: nothing blocks on it
        # One Inductor compile thread a worker: the workers are the parallelism (Inductor's default
        # pool of a process per core, in each of 8 workers, would be 8 x cores processes).
        env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                  text=True, bufsize=1, env=env)

    def ask(self, k: int, timeout: Optional[float] = None) -> Optional[dict]:
        """The worker's answer for item k, or None when it died (or was killed after ``timeout`` s)."""
        try:
            self.p.stdin.write(f"{k}\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        self.timed_out = False
        timer = threading.Timer(timeout, self._kill) if timeout else None
        if timer:
            timer.start()
        try:
            for line in self.p.stdout:
                if line.startswith(MARK):
                    return json.loads(line[len(MARK):])
            return None
        finally:
            if timer:
                timer.cancel()

    def _kill(self) -> None:
        self.timed_out = True
        self.p.kill()

    def tail(self, timeout: Optional[float] = None) -> str:
        self.p.wait()
        self.err.seek(0)
        lines = [ln for ln in self.err.read().strip().splitlines() if ln.strip()]
        head = (f"killed after {timeout:.0f} s" if getattr(self, "timed_out", False)
                else f"worker exited with code {self.p.returncode}")
        return head + ": " + " | ".join(lines[-3:])

    def close(self) -> None:
        try:
            self.p.stdin.close()
        except OSError:
            pass
        self.p.wait()
        self.err.close()


def run_queue(order: list, n: int, cmd: list, answer: Callable[[int, Optional[dict], str], None],
              timeout: Optional[float] = None) -> None:
    """Hand the indices of ``order`` to ``n`` workers started with ``cmd``; ``answer(k, got, why)``
    is called (from the workers' threads, one at a time) for each: ``got`` the worker's answer, or
    None with ``why`` when the worker died on it or was killed after ``timeout`` seconds on it."""
    queue, lock = deque(order), threading.Lock()

    def drive():
        w = Worker(cmd)
        while True:
            with lock:
                k = queue.popleft() if queue else None
            if k is None:
                break
            got = w.ask(k, timeout)
            why = ""
            if got is None:
                why = w.tail(timeout)
                w.close()
                w = Worker(cmd)
            with lock:
                answer(k, got, why)
        w.close()

    threads = [threading.Thread(target=drive, daemon=True) for _ in range(max(1, min(n, len(order))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def child_stdout():
    """In a worker: a file for the answers on the real stdout; the process's stdout (Python and C)
    then goes to stderr, so that nothing a case prints is read as an answer."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def answer_line(d: dict) -> str:
    return MARK + json.dumps(d) + "\n"


def child_cmd(module: str, args: dict, total: int) -> list:
    """The command of a worker running ``python -m module`` on the parent's list of ``total`` items."""
    return [sys.executable, "-m", module, json.dumps({**args, "total": total, "parent": os.getpid()})]


def _exit_with_parent(parent: Optional[int], poll_s: float = 2.0) -> None:
    """End this worker when its parent (the pid that started it, passed in its arguments: one read
    here could already be the reaper's) is gone. A parent that exits without closing the queue (a
    caller that never waits for a background warm-up) would otherwise leave the worker compiling
    its current item for as long as it takes: on a 2-core CI machine, an orphan of one test took a
    core for 40 minutes."""
    if parent is None:
        return

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(poll_s)

    threading.Thread(target=watch, daemon=True).start()


def serve(argv, build: Callable[[dict], list], handle: Callable[[object], dict], what: str) -> int:
    """A worker's main loop: ``build(args)`` remakes the parent's list (its ``what``, named in the
    refusal when it differs in length), then each index read from stdin is answered with
    ``handle(item)``, or with {"fatal": why} for every index when the list could not be made."""
    a = json.loads((argv if argv is not None else sys.argv[1:])[0])
    _exit_with_parent(a.get("parent"))
    out = child_stdout()
    try:
        items = build(a)
    except Exception as e:  # answer every request with the reason
        items, fatal = None, f"the worker could not build the {what}: {type(e).__name__}: {e}"
    else:
        fatal = None if len(items) == a["total"] else (
            f"the worker's {what} has {len(items)} items, the parent's {a['total']}")
    for line in sys.stdin:
        out.write(answer_line({"fatal": fatal} if fatal else handle(items[int(line)])))
    return 0


def default_workers() -> int:
    """Workers on a GPU machine: 8 or the CPU cores, fewer (each compiles on one core)."""
    return min(8, os.cpu_count() or 1)
