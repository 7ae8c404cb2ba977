"""The harness on a real GPU: ceilings, timing with L2 rotation and graph replay, a bench run
writing its files, compute-sanitizer catching a real out-of-bounds write, and the CLI's
check / report on a tiny preset. Figures are checked for consistency, never against targets."""
import json
import os
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_ceilings_measured_and_cached(tmp_path, monkeypatch):
    from opmap.core import hw

    monkeypatch.setenv("OPMAP_CACHE_DIR", str(tmp_path))
    c = hw.ceilings(measure=True)
    assert c is not None and c.read_tbps > 0 and c.copy_tbps > 0 and c.bf16_tflops > 0
    assert hw._cache_file(hw.detect()).exists()
    assert hw.ceilings(measure=False) == c


def test_time_calls_rotation_and_graph():
    from opmap.harness.bench import timing

    n = 16 * 2**20
    sets = [(torch.randn(n, device="cuda"), torch.empty(n, device="cuda")) for _ in range(3)]
    calls = [lambda s=s: s[1].copy_(s[0]) for s in sets]
    eager = timing.time_calls(calls, graph=False, rep_ms=20)
    graph = timing.time_calls(calls, graph=True, rep_ms=20)
    assert eager.method == "events" and graph.method == "events+graph" and graph.note == ""
    assert eager.sets == graph.sets == 3
    assert 0 < eager.median_us < 1e6 and 0 < graph.median_us < 1e6


def test_bench_run_writes_consistent_records(tmp_path):
    from opmap.core import hw
    from opmap.harness.bench import report
    from opmap.harness.bench import runner
    from opmap.harness.bench.base import BenchCase, Provider

    n = 32 * 2**20  # 128 MiB of fp32 read, 128 MiB written
    case = BenchCase("copy", f"N={n},dtype=fp32", flops=0, bytes=2 * 4 * n, family="copy",
                     setup=lambda d: (torch.randn(n, device=d), torch.empty(n, device=d)),
                     providers=[Provider("torch-copy", make=lambda s: (lambda: s[1].copy_(s[0]))),
                                Provider("absent-peer", make=lambda s: (lambda: None),
                                         available=lambda: "package 'absent' is not installed")])
    recs, skipped = runner.run_case(case, hw.ceilings(), torch.device("cuda"), quick=True)
    assert [r["provider"] for r in recs] == ["torch-copy"]
    assert skipped == [{"op": "copy", "case": case.case, "provider": "absent-peer",
                        "reason": "package 'absent' is not installed", "family": "copy"}]
    r = recs[0]
    assert r["median_us"] > 0 and r["tflops"] is None
    assert r["tbps"] == pytest.approx(case.bytes / (r["median_us"] * 1e-6) / 1e12, rel=1e-3)
    # A fraction far above 1 would mean the L2 served the inputs or the bytes are miscounted.
    assert 0 < r["frac_of_ceiling"] < 2
    from opmap.harness.output import environment

    doc = {"environment": environment(hw.ceilings()), "results": recs, "skipped": skipped,
           "load_errors": []}
    paths = report.write(doc, str(tmp_path))["copy"]
    d = json.loads(open(paths["json"]).read())
    assert d["environment"]["gpu"] and d["environment"]["ceilings"]["read_tbps"] > 0
    assert "torch-copy" in open(paths["markdown"]).read()


KERNELS = '''
import torch
import triton
import triton.language as tl
from opmap.harness.check.base import CheckCase, Outcome


@triton.jit
def oob_store_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, offs.to(tl.float32))  # no mask: writes past a 1000-element buffer


@triton.jit
def masked_store_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, offs.to(tl.float32), mask=offs < n)


def _oob():
    x = torch.zeros(1000, device="cuda")
    oob_store_kernel[(1,)](x, BLOCK=4096)
    torch.cuda.synchronize()
    return Outcome(True, "launched")


def _masked():
    x = torch.zeros(1000, device="cuda")
    masked_store_kernel[(1,)](x, 1000, BLOCK=4096)
    torch.cuda.synchronize()
    ok = bool((x == torch.arange(1000, device="cuda", dtype=torch.float32)).all())
    return Outcome(ok, "values " + ("match" if ok else "differ"))


def cases(device, quick):
    return [CheckCase("parity", "rmsnorm", "triton", "oob", _oob, device="cuda"),
            CheckCase("parity", "rmsnorm", "triton", "masked", _masked, device="cuda")]
'''


def test_sanitizer_catches_out_of_bounds_write(tmp_path, monkeypatch):
    from opmap.harness.check import sanitizer as san

    exe = san.find_sanitizer()
    if exe is None:
        pytest.skip("compute-sanitizer is not installed on this GPU machine")
    pkg = tmp_path / "sanpkg_gpu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cases.py").write_text(textwrap.dedent(KERNELS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path)] + sys.path))
    sys.path.insert(0, str(tmp_path))
    try:
        import sanpkg_gpu.cases as mod

        bad, good = mod.cases("cuda", True)
    finally:
        sys.path.remove(str(tmp_path))
    r = san.run_one("sanpkg_gpu.cases", bad, True, "memcheck", 300, exe)
    assert not r.passed and "oob_store_kernel" in r.figure, r.figure
    r = san.run_one("sanpkg_gpu.cases", good, True, "memcheck", 300, exe)
    assert r.passed and r.figure.startswith("memcheck: 0 errors"), r.figure
    # In one batch the error is found, then each case runs alone so it lands on the right one.
    rs = san.run_batch("sanpkg_gpu.cases", [good, bad], True, "memcheck", 300, exe)
    assert rs[0].passed and not rs[1].passed and "oob_store_kernel" in rs[1].figure, [r.figure for r in rs]


def test_cli_check_and_report_tiny_on_gpu(tmp_path):
    from opmap.cli import main as cli

    js = tmp_path / "check.json"
    rc = cli.main(["check", "--model", "tiny-llama3", "--quick", "--json", str(js)])
    d = json.loads(js.read_text())
    fails = [f"{r['op']}/{r['backend']} {r['case']}: {r['figure']}" for r in d["results"] if not r["passed"]]
    assert rc == 0 and d["results"], fails
    assert d["device"] == "cuda"
    rc = cli.main(["report", "--model", "tiny-llama3", "--no-bench", "--out", str(tmp_path / "rep")])
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert all(r["backend"] for rows in rep["operators"].values() for r in rows)
    assert rep["environment"]["ceilings"] is not None
    eng = rep["engine"]
    assert eng["status"] == "ok", eng
    assert eng["summary"]["tpot_ms_p50"] > 0 and eng["summary"]["ttft_ms_p50"] > 0
    assert eng["profile"]["status"] == "ok", eng["profile"]
    assert "## Engine (TTFT / TPOT, profile)" in (tmp_path / "rep" / "report.md").read_text()
    assert rc == 0
