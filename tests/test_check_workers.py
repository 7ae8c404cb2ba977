"""`opmap check` in worker processes (harness/check/workers.py): the same results as one process, in the
selection's order; a worker that dies fails the case it held and a fresh one takes the rest."""
import sys

from opmap.harness.check import runner

from opmap.harness.check import workers

ARGS = dict(model=None, backends=None, ops=["logits"], sections=None, quick=True, device="cpu")


def _selected():
    return runner.selection(ARGS["model"], ARGS["backends"], ARGS["ops"], ARGS["sections"], ARGS["quick"], "cpu")[0]


def test_workers_give_the_serial_results_in_order():
    sel = _selected()
    assert len(sel) >= 2
    serial = runner.run(sel, progress=False)
    par = workers.run_parallel(sel, 2, ARGS, progress=False)
    assert [r.title for r in par] == [r.title for r in serial]
    assert [(r.passed, r.figure) for r in par] == [(r.passed, r.figure) for r in serial]
    assert all(r.seconds > 0 for r in par)


def test_a_dying_worker_fails_its_case_with_the_reason(monkeypatch):
    sel = _selected()
    die = [sys.executable, "-c", "import sys; sys.stdin.readline(); sys.stderr.write('boom\\n'); sys.exit(3)"]
    monkeypatch.setattr(workers, "_cmd", lambda args, total: die)
    out = workers.run_parallel(sel, 2, ARGS, progress=False)
    assert [r.title for r in out] == [c.title for _, c in sel]
    assert all(not r.passed and "worker exited with code 3" in r.figure and "boom" in r.figure for r in out)


def test_a_worker_with_another_selection_refuses_every_case():
    sel = _selected()[:2]
    out = workers.run_parallel(sel, 1, {**ARGS, "ops": ["rope"]}, progress=False)
    assert all(not r.passed and "selection has" in r.figure for r in out)


def test_gpu_default_is_several_workers_cpu_one():
    assert runner.default_workers("cpu") == 1
    assert runner.default_workers("cuda") >= 1


def test_a_worker_past_the_timeout_is_killed_and_replaced():
    from opmap.harness import workpool

    hang = [sys.executable, "-c", "import sys, time\nfor line in sys.stdin:\n    time.sleep(60)"]
    got = []
    workpool.run_queue([0, 1], 1, hang, lambda k, a, why: got.append((k, a, why)), timeout=1.0)
    assert [(k, a) for k, a, _ in got] == [(0, None), (1, None)]
    assert all(why.startswith("killed after 1 s") for _, _, why in got)


def test_a_worker_ends_when_its_parent_is_gone():
    """A worker whose parent exits without closing its queue (a background warm-up nobody waited
    for) ends by itself instead of working on for as long as its item takes."""
    import os
    import subprocess
    import sys
    import time

    child = ("import sys, time; from opmap import workpool; workpool._exit_with_parent(int(sys.argv[1]), 0.1); "
             "time.sleep(60)")
    parent = (f"import os, subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid())], "
              "stdout=subprocess.DEVNULL); print(p.pid)")
    pid = int(subprocess.check_output([sys.executable, "-c", parent], text=True).strip())
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        # a zombie reaped by init is gone too; one still listed here is alive
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split()[2] == "Z":
                break
        time.sleep(0.2)
    else:
        os.kill(pid, 9)
        raise AssertionError("the orphaned worker was still running after 20 s")
