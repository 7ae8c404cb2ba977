"""The `opmap` command through main(argv) (and once through the installed entry point)."""
import json
import os
import subprocess
import sys
import time

import pytest

from opmap.cli import main as cli
from opmap.harness import matrix as M

from opmap.core import registry

from opmap.core import select as sel

EXAMPLE = ["select", "attention", "--phase", "decode", "--heads", "32", "--kv-heads", "8", "--head-dim", "128",
           "--page-size", "16", "--kv-dtype", "fp8", "--cuda-graph", "--arch", "sm90"]


def test_select_issue_example(capsys):
    rc = cli.main(EXAMPLE)
    out, err = capsys.readouterr()
    assert "spec: attention [arch=sm90, phase=decode, kind=gqa, num_heads=32, num_kv_heads=8, head_dim=128" in out
    assert "kv_dtype=fp8" in out and "cuda_graph=True" in out
    if rc == 0:
        # The choice line, then one line per other candidate; every rejected one says where and why.
        assert "attention [decode] -> " in out
        names = {b.name for b in registry.backends("attention")}
        listed = [ln.split()[1] for ln in out.splitlines() if ln.startswith(("  ok ", "  no "))]
        assert len(listed) == len(names) - 1 and set(listed) < names
        assert all(" at " in ln for ln in out.splitlines() if ln.startswith("  no "))
    else:
        # Nothing serves it (yet): a clear error, never a traceback.
        assert rc == 2 and err.startswith("error: attention: no backend") and "Traceback" not in err


def test_select_names_the_kernel_that_runs(capsys):
    """bf16 and fp8-KV decode on sm90 run different kernels, and `opmap select` names each one's
    backend (the fp8 one the Gluon kernel's, with the Triton kernel's as the valid runner-up); the
    TMA prefill on pages of 64 likewise."""
    assert cli.main(EXAMPLE) == 0
    fp8 = capsys.readouterr().out
    assert "attention [decode] -> gluon-fp8 (opmap-triton" in fp8
    assert any(ln.split()[:2] == ["ok", "triton"] for ln in fp8.splitlines())
    assert cli.main([x if x != "fp8" else "bf16" for x in EXAMPLE]) == 0
    bf16 = capsys.readouterr().out
    assert "attention [decode] -> triton (opmap-triton" in bf16
    assert any(ln.split()[:3] == ["no", "gluon-fp8", "at"] and "kv_dtype=bf16" in ln for ln in bf16.splitlines())
    assert cli.main(["select", "attention", "--phase", "prefill", "--page-size", "64", "--cuda-graph",
                     "--arch", "sm90"]) == 0
    assert "attention [prefill] -> triton-tma (opmap-triton" in capsys.readouterr().out
    assert cli.main(["select", "attention", "--kind", "mla", "--kv-dtype", "fp8", "--cuda-graph", "--arch", "sm90"]) == 0
    assert "attention [decode] -> mla-gluon-fp8 (opmap-triton" in capsys.readouterr().out


def test_select_mla_defaults_to_a_latent_layer(capsys):
    """--kind mla without shapes: DeepSeek-V2-Lite's latent layer, not the GQA defaults (which no
    MLA backend serves); given fields still win."""
    assert cli.main(["select", "attention", "--kind", "mla", "--arch", "sm90", "--kv-dtype", "fp8"]) == 0
    out, _ = capsys.readouterr()
    assert "num_heads=16, num_kv_heads=1, head_dim=576, head_dim_v=512" in out and "page_size=64" in out
    assert "attention [decode] -> mla-" in out
    assert cli.main(["select", "attention", "--kind", "mla", "--heads", "128", "--arch", "sm90"]) == 0
    assert "num_heads=128, num_kv_heads=1" in capsys.readouterr()[0]


def test_select_forced_backend_error(capsys):
    names = [b.name for b in registry.backends("attention")]
    assert "reference" in names
    # The reference cannot be captured in a CUDA graph (host loop) or serve fp8 on sm90 eagerly;
    # whatever its reasons, forcing it on this spec must fail with them, exit 2.
    spec = cli.spec_from_args("attention", cli.build_parser().parse_args(EXAMPLE), "sm90")
    reasons = registry.get("attention", "reference").validate(spec)
    rc = cli.main(EXAMPLE + ["--backend", "reference"])
    out, err = capsys.readouterr()
    if reasons:
        assert rc == 2 and "forced backend 'reference' (argument) cannot serve" in err
        assert reasons[0] in err and "backends that could:" in err
    else:
        assert rc == 0 and "forced by argument" in out


def test_select_env_forcing(capsys, monkeypatch):
    monkeypatch.setenv("OPMAP_RMSNORM_BACKEND", "reference")
    sel.clear_cache()
    assert cli.main(["select", "rmsnorm", "--arch", "sm90", "--hidden", "4096", "--fused-add"]) == 0
    assert "forced by env OPMAP_RMSNORM_BACKEND=reference" in capsys.readouterr().out
    monkeypatch.setenv("OPMAP_RMSNORM_BACKEND", "no-such-backend")
    assert cli.main(["select", "rmsnorm", "--arch", "sm90"]) == 2
    assert "'no-such-backend'" in capsys.readouterr().err
    sel.clear_cache()


def test_select_flags_and_errors(capsys):
    # A field of another op, a bad value, a bad --set, an unknown op: exit 2 with the reason.
    assert cli.main(["select", "moe", "--vocab", "3"]) == 2
    assert "'vocab' is not a field of the moe spec" in capsys.readouterr().err
    assert cli.main(["select", "attention", "--heads", "x"]) == 2
    assert "cannot read 'x' as int" in capsys.readouterr().err
    assert cli.main(["select", "attention", "--set", "head_dim"]) == 2
    assert "expected FIELD=VALUE" in capsys.readouterr().err
    assert cli.main(["select", "nope"]) == 2
    assert "unknown op 'nope'" in capsys.readouterr().err
    assert cli.main(["select", "attention", "--kv-dtype", "int4"]) == 2
    assert "kv_dtype='int4'" in capsys.readouterr().err
    # --top-k is an int for moe and a bool for sampling; --set reaches any field; --no-X clears a bool.
    args = cli.build_parser().parse_args(["select", "moe", "--top-k", "4", "--set", "num_experts=16"])
    assert cli.spec_from_args("moe", args, "sm90").top_k == 4
    args = cli.build_parser().parse_args(["select", "sampling", "--top-k", "--no-seeded"])
    s = cli.spec_from_args("sampling", args, "sm90")
    assert s.top_k is True and s.seeded is False
    args = cli.build_parser().parse_args(["select", "attention", "--no-paged", "--set", "head_dim_v=none"])
    s = cli.spec_from_args("attention", args, "sm90")
    assert s.paged is False and s.head_dim_v == s.head_dim
    assert cli.main(["select", "gemm", "--fields"]) == 0
    assert "weight_dtype" in capsys.readouterr().out


def test_matrix_terminal_and_markdown(tmp_path, capsys):
    md = tmp_path / "m.md"
    assert cli.main(["matrix", "--arch", "sm90", "--op", "rmsnorm", "--op", "attention", "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "rmsnorm (sm90)" in out and "attention (sm90, part 1 of 2)" in out
    # 120 columns off a terminal, no header cut short: a wide table comes in parts of whole columns
    assert max(len(ln) for ln in out.splitlines()) <= 120 and "…" not in out
    for field in ("num_kv_heads", "sliding_window", "batch_invariant"):
        assert f" {field} " in out
    text = md.read_text()
    assert text.startswith("# Capability matrix (sm90)") and "## rmsnorm" in text and "## attention" in text
    for b in registry.backends("rmsnorm"):
        assert f"| {b.name} | {b.provider} |" in text
    assert cli.main(["matrix", "--arch", "sm90", "--op", "rmsnorm", "--md"]) == 0
    assert capsys.readouterr().out == M.to_markdown(M.build("sm90", ["rmsnorm"]))
    assert cli.main(["matrix", "--op", "nope"]) == 2
    assert "unknown op 'nope'" in capsys.readouterr().err


def test_env_cpu(capsys):
    assert cli.main(["env", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    if d["device"]["kind"] == "cpu":
        assert d["ceilings"] is None and d["device"]["arch"] == "cpu"
        assert cli.main(["env"]) == 0
        out = capsys.readouterr().out
        assert "no GPU" in out and "interpreter" in out


def test_bench_on_cpu_writes_nothing(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU message is only given without a GPU")
    assert cli.main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    assert "GPU timings need a GPU" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_bench_names_a_misspelt_op_or_row(tmp_path, capsys):
    """A --op that selects no case, or a --provider no selected case has, is an error (exit 2) that
    names the closest ones, before anything is timed, on any machine."""
    assert cli.main(["bench", "--quick", "--op", "atention.decode", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no benchmark case matches --op 'atention.decode'" in err and "closest ['attention.decode'" in err
    assert cli.main(["bench", "--quick", "--op", "attention.decode", "--provider", "opmap-triton[f16=1]",
                     "--out", str(tmp_path)]) == 2
    assert "no benchmark row is named 'opmap-triton[f16=1]'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_check_names_a_misspelt_filter(capsys):
    """opmap check --op / --backend / --section with a name no case has: exit 2 and the closest
    names, not a run of nothing."""
    assert cli.main(["check", "--quick", "--op", "atention"]) == 2
    assert "no check case has op 'atention'" in capsys.readouterr().err
    assert cli.main(["check", "--quick", "--backend", "tritn"]) == 2
    assert "closest ['triton'" in capsys.readouterr().err


def test_check_quick_tiny_llama3(tmp_path, capsys):
    js = tmp_path / "check.json"
    t0 = time.perf_counter()
    rc = cli.main(["check", "--model", "tiny-llama3", "--quick", "--json", str(js), "--out", str(tmp_path / "res")])
    took = time.perf_counter() - t0
    out = capsys.readouterr().out
    d = json.loads(js.read_text())
    assert d["model"] == "tiny-llama3" and d["environment"]["torch"]
    assert {s["phase"] for s in d["selection"]} == {"prefill", "decode", "mixed"}  # the engine's three step maps
    fails = [r for r in d["results"] if not r["passed"]]
    assert rc == (1 if fails or not d["results"] else 0)
    assert rc == 0, "failing lines: " + "; ".join(f"{r['op']}/{r['backend']} {r['case']}: {r['figure']}"
                                                  for r in fails) + out[-2000:]
    written = sorted(p.suffix for p in (tmp_path / "res").iterdir())
    assert written == [".json", ".md"] and all("tiny-llama3" in p.name for p in (tmp_path / "res").iterdir())
    print(f"check --quick tiny-llama3: {len(d['results'])} cases in {took:.1f} s")


def test_report_tiny_llama3(tmp_path):
    """The main job completes on the CPU and writes both files (time is printed, not asserted)."""
    t0 = time.perf_counter()
    rc = cli.main(["report", "--model", "tiny-llama3", "--out", str(tmp_path)])
    took = time.perf_counter() - t0
    md = (tmp_path / "report.md").read_text()
    d = json.loads((tmp_path / "report.json").read_text())
    assert md.startswith("# opmap report: tiny-llama3")
    for ph in ("prefill", "decode"):
        assert f"## Operator map, {ph}" in md
        assert [r["op"] for r in d["operators"][ph]][:2] == ["rmsnorm", "gemm"]
    assert len(d["questions"]) == 4 and all(q["answer"] for q in d["questions"])
    assert "## Correctness" in md and "## Benchmarks" in md
    missing = [f"{r['phase']} {r['label']}" for rows in d["operators"].values() for r in rows if not r["backend"]]
    assert not missing, f"operators without a backend on this device: {missing}"
    assert rc == (1 if d["check"]["summary"]["failed"] else 0)
    print(f"report tiny-llama3 built in {took:.1f} s")


def test_engine_commands_exist():
    p = cli.build_parser()
    sub = next(a for a in p._actions if a.dest == "command")
    assert {"env", "select", "matrix", "check", "bench", "report", "run", "profile"} <= set(sub.choices)
    assert "usage" in sub.choices["run"].format_help()


def test_console_entry_point():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-m", "opmap.cli.main", "select", "rmsnorm", "--arch", "sm90",
                          "--hidden", "8192"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("spec: rmsnorm [arch=sm90, phase=decode, hidden=8192")


def test_environment_records_the_optional_packages(monkeypatch):
    """Result files say which optional packages were importable (FlashInfer changes sm90's prefill
    choice): a version, "installed" without distribution metadata, or None."""
    import importlib.util
    from importlib.machinery import ModuleSpec

    from opmap.harness import output

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: ModuleSpec(name, None) if name == "flashinfer" else
                        (None if name == "xgrammar" else real(name, *a)))
    pk = output.environment()["packages"]
    assert pk["flashinfer"] == "installed" and pk["xgrammar"] is None and pk["transformers"]


def test_environment_records_the_host_cpu(tmp_path, monkeypatch):
    """Host-bound figures follow the host CPU: result files name it, the bench Markdown prints it."""
    from opmap.harness import output
    from opmap.harness.bench import report

    env = output.environment()
    assert env["host_cpu"] == output.host_cpu()
    if os.path.exists("/proc/cpuinfo"):
        assert env["host_cpu"].endswith(f", {os.cpu_count()} cores")
    env = {**env, "host_cpu": "Example CPU 9000, 16 cores", "ceilings": None}
    md = report.to_markdown({"environment": env, "results": [], "skipped": []})
    assert "Host CPU: Example CPU 9000, 16 cores." in md
