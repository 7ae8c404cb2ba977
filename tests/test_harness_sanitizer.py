"""The compute-sanitizer driver: output parsing, case selection, and the whole parent/child path
run on the CPU with a stand-in for the sanitizer binary (a script that runs the command it is
given and prints the summary the real tool prints)."""
import os
import stat
import sys
import textwrap

import pytest

from opmap.harness.check import sanitizer as san
from opmap.harness.check.base import CheckCase, Outcome

MEMCHECK_ERR = """========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at _rmsnorm_fwd_kernel+0x2d0 in /src/opmap/kernels/norm/triton_norm.py:57
=========     by thread (31,0,0) in block (3,0,0)
=========     Address 0x7f3a00001000 is out of bounds
=========
========= ERROR SUMMARY: 1 error
"""


def test_parse():
    assert san.parse("memcheck", MEMCHECK_ERR) == (1, ["_rmsnorm_fwd_kernel"], ["Invalid __global__ write of size 4 bytes"])
    assert san.parse("memcheck", "========= ERROR SUMMARY: 0 errors\n")[0] == 0
    assert san.parse("memcheck", "python crashed before the tool printed anything")[0] == -1
    race = "========= Error: Race reported between Write access at _k+0x10\n========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)\n"
    assert san.parse("racecheck", race)[0] == 2


def test_which_cases_and_tools():
    mk = lambda backend, **kw: CheckCase("parity", "rmsnorm", backend, "T=1", lambda: None, **kw)  # noqa: E731
    from opmap.core import registry

    provs = {b.name: b.provider for b in registry.backends("rmsnorm")}
    for name, prov in provs.items():
        assert san.wants_sanitizer(mk(name)) == (prov == "opmap-triton")
    assert not san.wants_sanitizer(mk("-"))
    assert not san.wants_sanitizer(mk("no-such-backend"))
    assert san.tools_for(mk("triton")) == ["memcheck", "racecheck"]  # a row reduction
    rope = CheckCase("parity", "rope", "triton", "T=1", lambda: None)
    assert san.tools_for(rope) == ["memcheck"]  # elementwise
    rope.tags = ("racecheck",)
    assert san.tools_for(rope) == ["memcheck", "racecheck"]


CASES_MODULE = """
from opmap.harness.check.base import CheckCase, Outcome
import os, time

def _ok():
    assert os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1"
    return Outcome(True, "max_abs=0")

def _graph():
    # capture needs PyTorch's caching allocator: the driver must not turn it off here
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING" not in os.environ
    return Outcome(True, "replayed")

def cases(device, quick):
    return [CheckCase("parity", "rope", "triton", "T=3", _ok),
            CheckCase("parity", "rope", "triton", "T=4", lambda: Outcome(False, "worst/tol=9")),
            CheckCase("parity", "rope", "triton", "T=5", lambda: time.sleep(60)),
            CheckCase("graph", "rope", "triton", "replay", _graph)]
"""

FAKE_TOOL = """#!/bin/sh
# Stand-in for compute-sanitizer: drop '--tool X --report-api-errors no --print-limit N', run the rest.
shift 6
[ -n "$FAKE_SANITIZER_LOG" ] && echo "$@" >> "$FAKE_SANITIZER_LOG"
"$@"
rc=$?
if [ -n "$FAKE_SANITIZER_FILE" ]; then
cat "$FAKE_SANITIZER_FILE"
elif [ -n "$FAKE_SANITIZER_ERROR" ]; then
cat <<'X'
{err}X
else
echo "========= ERROR SUMMARY: 0 errors"
fi
exit $rc
"""


@pytest.fixture
def fake_tool(tmp_path, monkeypatch):
    pkg = tmp_path / "fakesan_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cases.py").write_text(textwrap.dedent(CASES_MODULE))
    tool = tmp_path / "compute-sanitizer"
    tool.write_text(FAKE_TOOL.replace("{err}", MEMCHECK_ERR))
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path)] + sys.path))
    sys.path.insert(0, str(tmp_path))
    import fakesan_pkg.cases as mod

    yield str(tool), mod.cases("cpu", True)
    sys.path.remove(str(tmp_path))
    for m in ("fakesan_pkg", "fakesan_pkg.cases"):
        sys.modules.pop(m, None)


def test_parent_child_clean_and_failing_case(fake_tool):
    tool, cases = fake_tool
    r = san.run_one("fakesan_pkg.cases", cases[0], True, "memcheck", 120, tool)
    assert r.passed and r.section == "sanitizer" and r.case == "T=3 [memcheck]"
    assert r.figure.startswith("memcheck: 0 errors (the case passed under the tool")


def test_parent_reports_kernel_of_error(fake_tool, monkeypatch):
    tool, cases = fake_tool
    monkeypatch.setenv("FAKE_SANITIZER_ERROR", "1")
    r = san.run_one("fakesan_pkg.cases", cases[0], True, "memcheck", 120, tool)
    assert not r.passed and r.value == 1.0
    assert r.figure.startswith("memcheck: 1 errors in _rmsnorm_fwd_kernel: Invalid __global__ write")
    assert r.title == "rope/triton T=3 [memcheck]"


def test_timeout_and_missing_tool(fake_tool, monkeypatch):
    tool, cases = fake_tool
    r = san.run_one("fakesan_pkg.cases", cases[2], True, "memcheck", 0.5, tool)
    assert not r.passed and r.figure.startswith("timed out after")
    monkeypatch.setattr(san, "find_sanitizer", lambda: None)
    out = san.run_all([("fakesan_pkg.cases", cases[0])], True, 10, progress=False)
    assert len(out) == 1 and not out[0].passed and "compute-sanitizer not found" in out[0].figure


def test_run_all_concurrent_keeps_order(fake_tool):
    tool, cases = fake_tool
    import unittest.mock as mock

    with mock.patch.object(san, "find_sanitizer", lambda: tool):
        out = san.run_all([("fakesan_pkg.cases", cases[0]), ("fakesan_pkg.cases", cases[1])], True, 120,
                          progress=False, jobs_n=2)
    # Both children ran (at once) and the results come back in case order; the second case fails
    # its own check under the tool, which is a failing line too.
    assert [r.case for r in out] == ["T=3 [memcheck]", "T=4 [memcheck]"]
    assert [r.passed for r in out] == [True, False]
    assert "FAILED" in out[1].figure and "worst/tol=9" in out[1].figure


def test_child_unknown_case(fake_tool, capsys):
    rc = san._child(["--family", "fakesan_pkg.cases", "--section", "parity", "--title", "rope/triton T=99"])
    assert rc == 3 and "no case parity:'rope/triton T=99'" in capsys.readouterr().err


FOREIGN_RACE = """========= Error: Race reported between Read access at void at::native::reduce_kernel<(int)512, (int)1>(T3)+0xe5a0 in Reduce.cuh:12 and Write access at void at::native::reduce_kernel<(int)512, (int)1>(T3)+0xe5b0 in Reduce.cuh:14
========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
"""
OWN_RACE = FOREIGN_RACE.replace("void at::native::reduce_kernel<(int)512, (int)1>(T3)", "_decode_kernel")


def test_racecheck_hazards_only_in_other_kernels_do_not_fail_ours(fake_tool, monkeypatch, tmp_path):
    """Seen on the H200: racecheck reported hazards in PyTorch's amax reduction that an fp8 case
    uses to build its scales; the kernel under check had none."""
    tool, cases = fake_tool
    assert san.is_own("_decode_kernel") and san.is_own("_gemm_kernel") and not san.is_own("nvjet_sm90_tst")
    assert san.is_library("nvjet_sm90_tst") and san.is_library("void at::native::reduce_kernel<1>(T3)")
    assert not san.is_library("_rmsnorm_fwd_kernel")  # unknown plain name: not waved through
    f = tmp_path / "race.txt"
    f.write_text(FOREIGN_RACE)
    monkeypatch.setenv("FAKE_SANITIZER_FILE", str(f))
    r = san.run_one("fakesan_pkg.cases", cases[0], True, "racecheck", 120, tool)
    assert r.passed, r.figure
    assert r.figure.startswith("racecheck: 0 errors in our kernels; 2 reported in other kernels only (void at::native::reduce_kernel")
    f.write_text(OWN_RACE)
    r = san.run_one("fakesan_pkg.cases", cases[0], True, "racecheck", 120, tool)
    assert not r.passed and r.figure.startswith("racecheck: 2 errors in _decode_kernel")


def test_graph_cases_keep_the_caching_allocator(fake_tool):
    tool, cases = fake_tool
    r = san.run_one("fakesan_pkg.cases", cases[3], True, "memcheck", 120, tool)
    assert r.passed, r.figure
    assert "caching allocator on: graph capture needs it" in r.figure


def _runs(log):
    return log.read_text().splitlines() if log.exists() else []


def test_batch_one_process_when_clean(fake_tool, monkeypatch, tmp_path):
    tool, cases = fake_tool
    log = tmp_path / "runs.txt"
    monkeypatch.setenv("FAKE_SANITIZER_LOG", str(log))
    import unittest.mock as mock

    pairs = [("fakesan_pkg.cases", cases[0]), ("fakesan_pkg.cases", cases[1]), ("fakesan_pkg.cases", cases[3])]
    with mock.patch.object(san, "find_sanitizer", lambda: tool):
        out = san.run_all(pairs, True, 120, progress=False, jobs_n=2)
    # T=3 and T=4 share a child; the graph case gets its own (the allocator stays on there).
    assert len(_runs(log)) == 2 and sum(r.count("--case") for r in _runs(log)) == 3
    assert [r.case for r in out] == ["T=3 [memcheck]", "T=4 [memcheck]", "replay [memcheck]"]
    assert [r.passed for r in out] == [True, False, True]
    assert "worst/tol=9" in out[1].figure and "caching allocator on" in out[2].figure


def test_resume_reuses_finished_verdicts_and_runs_the_rest(fake_tool, monkeypatch, tmp_path):
    """A run cut off by a time limit continues from its state file: finished verdicts come back
    as they were (failures included), only the missing cases run."""
    tool, cases = fake_tool
    log = tmp_path / "runs.txt"
    state = tmp_path / "state.jsonl"
    monkeypatch.setenv("FAKE_SANITIZER_LOG", str(log))
    import unittest.mock as mock

    pairs = [("fakesan_pkg.cases", cases[0]), ("fakesan_pkg.cases", cases[1]), ("fakesan_pkg.cases", cases[3])]
    with mock.patch.object(san, "find_sanitizer", lambda: tool):
        first = san.run_all(pairs[:2], True, 120, progress=False, jobs_n=1, state=str(state))
        assert len(state.read_text().splitlines()) == 2
        n_runs = len(_runs(log))
        again = san.run_all(pairs, True, 120, progress=False, jobs_n=1, state=str(state))
    assert len(_runs(log)) == n_runs + 1  # only the graph case ran
    assert "replay" in _runs(log)[-1]
    assert [(r.case, r.passed, r.figure) for r in again[:2]] == [(r.case, r.passed, r.figure) for r in first]
    assert again[2].passed and again[2].case == "replay [memcheck]"
    assert len(state.read_text().splitlines()) == 3


def test_reuse_takes_the_same_cases_from_another_runs_state(fake_tool, monkeypatch, tmp_path):
    """--reuse: another run's verdicts (another preset's) count where the key is the same; only the
    other cases run, and the reused verdicts are copied into this run's state file."""
    tool, cases = fake_tool
    log = tmp_path / "runs.txt"
    other, mine = tmp_path / "other.jsonl", tmp_path / "mine.jsonl"
    monkeypatch.setenv("FAKE_SANITIZER_LOG", str(log))
    import unittest.mock as mock

    pairs = [("fakesan_pkg.cases", cases[0]), ("fakesan_pkg.cases", cases[1]), ("fakesan_pkg.cases", cases[3])]
    with mock.patch.object(san, "find_sanitizer", lambda: tool):
        first = san.run_all(pairs[:2], True, 120, progress=False, jobs_n=1, state=str(other))
        n_runs = len(_runs(log))
        got = san.run_all(pairs, True, 120, progress=False, jobs_n=1, state=str(mine), reuse=[str(other)])
    assert len(_runs(log)) == n_runs + 1 and "replay" in _runs(log)[-1]  # only the case the other run lacks
    assert [(r.case, r.passed, r.figure) for r in got[:2]] == [(r.case, r.passed, r.figure) for r in first]
    assert len(mine.read_text().splitlines()) == 3 and len(other.read_text().splitlines()) == 2
    assert [r.case for r in san.load_state(str(mine)).values()].count("replay [memcheck]") == 1


def test_batch_with_our_error_or_a_timeout_reruns_each_case_alone(fake_tool, monkeypatch, tmp_path):
    tool, cases = fake_tool
    log = tmp_path / "runs.txt"
    monkeypatch.setenv("FAKE_SANITIZER_LOG", str(log))
    monkeypatch.setenv("FAKE_SANITIZER_ERROR", "1")  # every run reports an error in an opmap-named kernel
    out = san.run_batch("fakesan_pkg.cases", cases[:2], True, "memcheck", 120, tool)
    assert len(_runs(log)) == 1 + 2  # the batch, then each case alone to pin the error on it
    assert all(not r.passed and "_rmsnorm_fwd_kernel" in r.figure for r in out)
    monkeypatch.delenv("FAKE_SANITIZER_ERROR")
    monkeypatch.setattr(san, "BATCH_EXTRA_S", 0.5)
    log.unlink()
    # T=5 sleeps 60 s. 15 s: the two reruns start side by side, each a Python and torch start-up,
    # which took over 2 s under the parallel test suite.
    out = san.run_batch("fakesan_pkg.cases", [cases[0], cases[2]], True, "memcheck", 15, tool)
    assert len(_runs(log)) == 1 + 2
    assert out[0].passed and not out[1].passed and out[1].figure.startswith("timed out after 15 s")


def test_racecheck_children_get_shorter_attention_sequences(monkeypatch):
    """The driver tells its children which tool runs them; the attention cases then cap their
    longest sequences under racecheck (same case titles, so the child still finds its case)."""
    import importlib

    from opmap.harness.check.cases import attention as A

    env = san._env(False, "racecheck")
    assert env["OPMAP_SANITIZER_TOOL"] == "racecheck" and env["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1"
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING" not in san._env(True, "memcheck")
    full = max(A._shape("cuda")["lens"])
    try:
        monkeypatch.setenv("OPMAP_SANITIZER_TOOL", "racecheck")
        capped = max(importlib.reload(A)._shape("cuda")["lens"])
    finally:
        monkeypatch.delenv("OPMAP_SANITIZER_TOOL")
        importlib.reload(A)
    assert full == 32768 and capped <= 4096


def test_batch_one_runs_each_case_in_its_own_child(fake_tool, monkeypatch, tmp_path):
    """`opmap check --batch 1`: what is left of a cut-off run (the slow cases) runs side by side."""
    tool, cases = fake_tool
    log = tmp_path / "runs.txt"
    monkeypatch.setenv("FAKE_SANITIZER_LOG", str(log))
    import unittest.mock as mock

    pairs = [("fakesan_pkg.cases", cases[0]), ("fakesan_pkg.cases", cases[1])]
    with mock.patch.object(san, "find_sanitizer", lambda: tool):
        out = san.run_all(pairs, True, 120, progress=False, jobs_n=2, batch=1)
    assert [r.count("--case") for r in _runs(log)] == [1, 1]
    assert [r.passed for r in out] == [True, False]


def test_racecheck_children_run_smaller_sampling_and_moe_problems(monkeypatch):
    """Under racecheck the sampling statistics cases sample RACE_ROWS rows (support membership
    only) and the Qwen3-30B-A3B-shaped MoE case runs fewer tokens; the figure says so. Without the
    tool they run in full."""
    import torch

    from opmap.harness.check.cases import moe as M
    from opmap.harness.check.cases import sampling as S

    monkeypatch.setattr(S, "RACE_ROWS", 32)  # the routing is under test, not the 512-row figure
    stats = S._statistics("triton", "cpu", 111, 20000, dict(T=0.8))
    moe = M._parity("triton", "cpu", 12, 32, 16, 8, 2, torch.float32, race_T=3)
    monkeypatch.setenv("OPMAP_SANITIZER_TOOL", "racecheck")
    o = stats()
    assert o.passed and o.figure.startswith(f"racecheck run on {S.RACE_ROWS} of the 20000 rows: outside=0"), o.figure
    o = moe()
    assert o.passed and o.figure.startswith("racecheck run at T=3: "), o.figure
    monkeypatch.delenv("OPMAP_SANITIZER_TOOL")
    o = moe()
    assert o.passed and not o.figure.startswith("racecheck"), o.figure


def test_failed_batch_reruns_its_cases_side_by_side_within_the_jobs_limit(fake_tool, monkeypatch):
    """A batch that timed out holds the slow cases: its single-case reruns run at once, each
    child process taking one of run_all's --jobs slots."""
    import threading
    import time as _time

    tool, cases = fake_tool
    monkeypatch.setenv("FAKE_SANITIZER_ERROR", "1")  # the batch reports an error in our kernel
    live, peak, lock = [0], [0], threading.Lock()
    real_run = san.run_group

    def counting_run(cmd, *a, **kw):
        if cmd.count("--case") == 1:  # a single-case rerun
            with lock:
                live[0] += 1
                peak[0] = max(peak[0], live[0])
            _time.sleep(0.5)
            with lock:
                live[0] -= 1
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(san, "run_group", counting_run)
    out = san.run_batch("fakesan_pkg.cases", [cases[0], cases[1], cases[0]], True, "memcheck", 120, tool)
    assert len(out) == 3 and peak[0] == 3  # no limit outside run_all: all three at once
    peak[0] = 0
    monkeypatch.setattr(san, "_SLOTS", threading.BoundedSemaphore(2))
    san.run_batch("fakesan_pkg.cases", [cases[0], cases[1], cases[0]], True, "memcheck", 120, tool)
    assert peak[0] == 2


def _gone(pid: int) -> bool:
    """No such process, or a zombie (a reparented child that nobody reaps in a container)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _spawner(pidfile) -> list:
    """A child that starts a grandchild (as compute-sanitizer starts the checked Python), writes
    the grandchild's pid, then sleeps."""
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(120)")
    return [sys.executable, "-c", code]


def _wait_pid(pidfile, limit=30.0) -> int:
    import time

    t = time.time()
    while time.time() - t < limit:
        if pidfile.exists() and pidfile.read_text():
            return int(pidfile.read_text())
        time.sleep(0.05)
    raise AssertionError("the child never wrote its grandchild's pid")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_timeout_kills_the_tool_and_the_process_it_checks(tmp_path):
    """A timed-out child's whole process group dies: the tool's checked process too (left alone,
    such processes stay on the GPU and slow what runs next)."""
    import subprocess
    import time

    pidfile = tmp_path / "pid"
    t = time.time()
    with pytest.raises(subprocess.TimeoutExpired):
        san.run_group(_spawner(pidfile), timeout=8)
    assert time.time() - t < 60
    pid = _wait_pid(pidfile, 1)
    deadline = time.time() + 5
    while not _gone(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert _gone(pid)
    assert not san._CHILDREN


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_kill_children_ends_running_groups(tmp_path):
    """What the SIGTERM handler does first: every running child group is killed, and run_group
    returns at once with the kill's exit status."""
    import threading
    import time

    pidfile = tmp_path / "pid"
    got = {}
    th = threading.Thread(target=lambda: got.setdefault("p", san.run_group(_spawner(pidfile), timeout=100)))
    th.start()
    pid = _wait_pid(pidfile)
    san.kill_children()
    th.join(20)
    assert not th.is_alive() and got["p"].returncode != 0
    deadline = time.time() + 5
    while not _gone(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert _gone(pid)


def test_resume_runs_again_what_changed_since(fake_tool, monkeypatch, tmp_path):
    """A state file's verdict counts only while its family's source fingerprint is today's: a
    case module edited after the run, a line saved before fingerprints existed, or a run under
    other OPMAP_* settings runs again."""
    import json as _json
    import unittest.mock as mock

    from opmap.harness.check import fingerprint as fp

    tool, cases = fake_tool
    log = tmp_path / "runs.txt"
    state = tmp_path / "state.jsonl"
    monkeypatch.setenv("FAKE_SANITIZER_LOG", str(log))
    pairs = [("fakesan_pkg.cases", cases[0]), ("fakesan_pkg.cases", cases[1])]
    with mock.patch.object(san, "find_sanitizer", lambda: tool):
        san.run_all(pairs, True, 120, progress=False, jobs_n=1, state=str(state))
        n = len(_runs(log))
        assert all(_json.loads(ln)["source"] == fp.fingerprint("fakesan_pkg.cases")
                   for ln in state.read_text().splitlines())
        san.run_all(pairs, True, 120, progress=False, jobs_n=1, state=str(state))
        assert len(_runs(log)) == n  # unchanged: both reused
        monkeypatch.setenv("OPMAP_PDL", "0")  # another setting: another fingerprint
        assert san.stale_count(str(state)) == 2 and san.load_state(str(state), current=True) == {}
        monkeypatch.delenv("OPMAP_PDL")
        assert san.stale_count(str(state)) == 0
        # the family's module edited after the run: a comment alone changes nothing that runs
        mod = tmp_path / "fakesan_pkg" / "cases.py"
        mod.write_text(mod.read_text() + "\n# edited\n")
        fp._of.cache_clear()
        assert san.stale_count(str(state)) == 0
        mod.write_text(mod.read_text() + "EDITED = 1\n")
        fp._of.cache_clear()
        assert san.stale_count(str(state)) == 2
        san.run_all(pairs, True, 120, progress=False, jobs_n=1, state=str(state))
        assert len(_runs(log)) == n + 1 and "T=3" in _runs(log)[-1] and "T=4" in _runs(log)[-1]  # both again
        # a line without a fingerprint (saved before they were recorded) is not reused
        lines = [_json.loads(ln) for ln in state.read_text().splitlines()][-2:]
        for d in lines:
            d.pop("source")
        state.write_text("".join(_json.dumps(d) + "\n" for d in lines))
        assert san.stale_count(str(state)) == 2 and len(san.load_state(str(state))) == 2
    fp._of.cache_clear()


def test_fingerprint_follows_a_familys_imports():
    from opmap.harness.check.fingerprint import files_of, fingerprint

    names = {"/".join(p.parts[-2:]) for p in files_of("norm")}
    assert {"cases/norm.py", "norm/triton_norm.py", "kernels/pdl.py", "check/base.py", "core/registry.py"} <= names
    # no attention kernel (the public API's attention contract is imported by every family's cases)
    assert not any(p.parent.name == "attention" and p.parent.parent.name == "kernels" for p in files_of("norm"))
    mla = {"/".join(p.parts[-2:]) for p in files_of("mla")}
    assert "mla/decode.py" in mla and "attention/merge.py" in mla  # the MLA merge is the shared split merge
    assert fingerprint("norm") != fingerprint("rope") and len(fingerprint("norm")) == 16


def test_fingerprint_is_of_the_code_not_its_docstrings_comments_or_layout(tmp_path):
    """A verdict stays current through edits that cannot change what runs (a docstring, a
    comment, line breaks); any change of code, a string constant in it included, makes it stale."""
    from opmap.harness.check.fingerprint import code_of

    base = 'import triton\n\n\ndef f(x):\n    """Doc."""\n    return x + 1  # one\n\n\nASM = "cvt.rn.f16x2.e4m3x2"\n'
    same = ('import triton\n# a comment\n\ndef f(x):\n    """Other\n    words."""\n    return (x +\n            1)\n\n\n'
            'ASM = "cvt.rn.f16x2.e4m3x2"\n')
    p = tmp_path / "m.py"

    def code(text):
        p.write_text(text)
        return code_of(p)

    assert code(base) == code(same)
    assert code(base) != code(base.replace("x + 1", "x + 2"))
    assert code(base) != code(base.replace("e4m3x2", "e5m2x2"))  # strings that are code, not docstrings
    assert code(base) == code(base.replace('    """Doc."""\n', ""))


def test_fingerprint_code_is_the_same_on_every_python():
    """The GPU machine runs Python 3.12, this one 3.11: ``ast.dump`` differs between them (3.12 adds
    ``type_params=[]``), so the dump leaves out empty and None fields and reads the same on both
    (a literal, so that the test fails on whichever version would differ)."""
    import ast

    from opmap.harness.check.fingerprint import _dump

    tree = ast.parse("def f(x, *, y=1):\n    return x\n\n\nclass C:\n    pass\n")
    assert _dump(tree) == (
        "Module(body=[FunctionDef(name='f', args=arguments(args=[arg(arg='x')], kwonlyargs=[arg(arg='y')], "
        "kw_defaults=[Constant(value=1)]), body=[Return(value=Name(id='x', ctx=Load()))]), "
        "ClassDef(name='C', body=[Pass()])])")


def test_longest_runs_start_first(monkeypatch):
    """Racecheck runs, MoE first, start before memcheck ones (one job: the start order is the
    order of the calls); results keep the case order."""
    from opmap.harness.check.base import CheckCase, Outcome
    from opmap.harness.check.result import Result

    ok = lambda: Outcome(True, "ok")  # noqa: E731
    cases = [("norm", CheckCase("parity", "rmsnorm", "triton", "a", ok, device="cuda")),
             ("moe", CheckCase("parity", "moe", "triton", "b", ok, device="cuda")),
             ("sampling", CheckCase("parity", "sampling", "triton", "c", ok, device="cuda"))]
    monkeypatch.setattr(san, "find_sanitizer", lambda: "/bin/true")
    monkeypatch.setattr(san, "tools_for", lambda c: ["memcheck", "racecheck"])
    order = []

    def fake_batch(fam, cs, quick, tool, timeout, exe):
        order.append((fam, tool))
        return [Result("sanitizer", c.op, c.backend, f"{c.case} [{tool}]", True, "ok", family=fam) for c in cs]

    monkeypatch.setattr(san, "run_batch", fake_batch)
    res = san.run_all(cases, True, 60, progress=False, jobs_n=1, batch=1)
    assert order[0] == ("moe", "racecheck") and [t for _, t in order[:3]] == ["racecheck"] * 3
    assert [r.case for r in res] == ["a [memcheck]", "a [racecheck]", "b [memcheck]", "b [racecheck]",
                                     "c [memcheck]", "c [racecheck]"]


def test_a_timed_out_verdict_is_reported_not_kept(fake_tool, monkeypatch, tmp_path):
    """A time-out says nothing about the kernel: the run reports it, the state file does not keep
    it, so a resumed run (alone, or with a longer --timeout) tries the case again."""
    import unittest.mock as mock

    tool, cases = fake_tool
    state = tmp_path / "state.jsonl"
    with mock.patch.object(san, "find_sanitizer", lambda: tool):
        # T=5 sleeps 60 s; 20 s leave T=3 room for a Python, torch and opmap start-up under load
        res = san.run_all([("fakesan_pkg.cases", cases[2]), ("fakesan_pkg.cases", cases[0])], True, 20,
                          progress=False, jobs_n=2, batch=1, state=str(state))
    assert not res[0].passed and res[0].figure.startswith("timed out after") and res[1].passed
    assert [k.split("::")[2] for k in san.load_state(str(state))] == ["rope/triton T=3"]
