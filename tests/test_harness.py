"""The check runner (collection, filters, failures, output) and the bench helpers (figures, L2
rotation sizing, result files, Markdown, roofline), with fake cases."""
import json
import sys
import types

import pytest
import torch

from opmap.harness.bench import report as bench_report
from opmap.harness.bench import runner as bench_runner
from opmap.harness.bench import timing
from opmap.harness.bench.cases import attention as bench_attention
from opmap.harness.bench.cases import gemm as bench_gemm
from opmap.harness.bench.base import BenchCase, Provider
from opmap.harness.check import runner
from opmap.harness.check.base import CheckCase, Outcome, probe_errors
from opmap.core.contract import InputError
from opmap.harness.output import environment, gpu_slug


def _case(section, op, backend, ok=True, raises=None, **kw):
    def run():
        if raises:
            raise raises
        return Outcome(ok, f"worst/tol={0.5 if ok else 3.0}", 0.5 if ok else 3.0, 1.0)

    return CheckCase(section, op, backend, "T=7,H=64,dtype=fp32", run, **kw)


@pytest.fixture
def fake_family(monkeypatch):
    mod = types.ModuleType("opmap.harness.check.cases.fakefam")
    mod.cases = lambda device, quick: [
        _case("parity", "rmsnorm", "reference"),
        _case("parity", "rmsnorm", "triton", ok=False),
        _case("boundaries", "rmsnorm", "torch-rms_norm", raises=RuntimeError("kernel blew up")),
        _case("parity", "rmsnorm", "reference", device="cuda"),
        _case("gqa-mla", "attention", "reference", tags=("mla",)),
        _case("parity", "rmsnorm", "reference", quick=False),
        _case("structured", "e2e", "-"),
    ]
    broken = types.ModuleType("opmap.harness.check.cases.brokenfam")
    broken.cases = lambda device, quick: 1 / 0
    monkeypatch.setitem(sys.modules, "opmap.harness.check.cases.fakefam", mod)
    monkeypatch.setitem(sys.modules, "opmap.harness.check.cases.brokenfam", broken)
    return mod


def test_collect_filters_device_and_quick(fake_family):
    found, errors = runner.collect("cpu", quick=True, families=("fakefam", "brokenfam", "nosuchfam"))
    assert len(found) == 5  # the cuda-only and the non-quick cases are left out
    assert len(errors) == 1 and not errors[0].passed and "ZeroDivisionError" in errors[0].figure
    found_full, _ = runner.collect("cpu", quick=False, families=("fakefam",))
    assert len(found_full) == 6
    found_gpu, _ = runner.collect("cuda", quick=True, families=("fakefam",))
    assert len(found_gpu) == 6


def test_run_records_pass_fail_and_exceptions(fake_family):
    found, _ = runner.collect("cpu", True, families=("fakefam",))
    res = runner.run(found, progress=False)
    by = {(r.section, r.backend): r for r in res}
    assert by[("parity", "reference")].passed and by[("parity", "reference")].value == 0.5
    assert not by[("parity", "triton")].passed
    boom = by[("boundaries", "torch-rms_norm")]
    assert not boom.passed and boom.figure.startswith("raised RuntimeError: kernel blew up at test_harness.py:")
    assert all(r.seconds >= 0 and r.family == "fakefam" for r in res)
    md = runner.to_markdown(res)
    assert "## Reference parity (1/2 pass)" in md and "**FAIL**" in md and "## Boundaries (0/1 pass)" in md
    d = runner.as_json(res, {"model": None})
    assert d["summary"] == {"passed": 3, "failed": 2, "total": 5}
    assert {"section", "op", "backend", "case", "passed", "figure", "value", "limit"} <= set(d["results"][0])
    json.dumps(d)
    runner.print_tables(res)  # renders without error


def test_model_filter_keeps_selected_backends_and_references(fake_family):
    t = runner.model_targets("tiny-llama3", "cpu")
    assert ("rmsnorm", "reference") in t.pairs and "attention" in t.ops
    # On a GPU arch the MLA model's attention reference is kept although Triton is chosen.
    ds = runner.model_targets("tiny-deepseek", "sm90")
    assert ("attention", "mla-reference") in ds.pairs and ("kv_append", "mla-reference") in ds.pairs
    chosen = {(op, ch.name) for _, op, _, ch, *_ in t.choices if ch}
    assert chosen <= t.pairs
    keep = lambda c: runner.keep(c, t)  # noqa: E731
    assert keep(_case("parity", "rmsnorm", "reference"))
    assert not keep(_case("gqa-mla", "attention", "reference", tags=("mla",)))  # llama3 has no MLA
    assert keep(_case("structured", "e2e", "-"))  # not a registry op: an engine case
    other = CheckCase("parity", "e2e", "-", "engine model=tiny-qwen3moe,greedy", lambda: None)
    same = CheckCase("parity", "e2e", "-", "engine model=llama3-8b,greedy", lambda: None)
    assert not keep(other) and keep(same)  # cases about a preset of another architecture are dropped
    assert not keep(_case("parity", "moe", "reference"))  # not an op of a dense model
    unchosen = [(op, b) for op in ("rmsnorm",) for b in ("triton", "torch-rms_norm") if (op, b) not in t.pairs]
    for op, b in unchosen:
        assert not keep(_case("parity", op, b))
    assert runner.keep(_case("parity", "rmsnorm", "triton"), None, backends=["triton"])
    assert not runner.keep(_case("parity", "rmsnorm", "triton"), None, sections=["quant"])
    assert not runner.keep(_case("parity", "rmsnorm", "triton"), None, ops=["gemm"])


def test_check_sanitizer_without_gpu_says_so(fake_family, monkeypatch):
    monkeypatch.setattr(runner, "collect", lambda device, quick: ([], []))
    res, extra = runner.check(sections=["parity"], device="cpu", progress=False, sanitizer=True)
    assert res == [] and any("compute-sanitizer needs a GPU" in n for n in extra["notes"])
    assert "sanitizer_sources" not in extra


def test_check_sanitizer_names_the_sources_of_its_verdicts(monkeypatch):
    """On a GPU the JSON names each sanitised family's source fingerprint: the code every
    sanitizer line of that report (run or resumed) is a verdict on."""
    from opmap.harness.check import sanitizer as san
    from opmap.harness.check.base import CheckCase, Outcome
    from opmap.harness.check.fingerprint import fingerprint

    cases = [("norm", CheckCase("parity", "rmsnorm", "triton", "x", lambda: Outcome(True, "ok"), device="cuda")),
             ("rope", CheckCase("parity", "rope", "triton", "y", lambda: Outcome(True, "ok"), device="cuda"))]
    monkeypatch.setattr(runner, "collect", lambda device, quick: (cases, []))
    monkeypatch.setattr(runner, "run", lambda selected, progress: [])
    monkeypatch.setattr(san, "run_all", lambda gpu, *a, **k: [])
    _, extra = runner.check(device="cuda", progress=False, sanitizer=True)
    assert extra["sanitizer_sources"] == {"norm": fingerprint("norm"), "rope": fingerprint("rope")}
    assert runner.sources_line(extra).count("`") == 4 and runner.sources_line({}) == ""


# ---- bench ----------------------------------------------------------------------------------

class _Ceil:
    read_tbps, copy_tbps, bf16_tflops = 4.0, 4.0, 800.0


def test_probe_errors_names_each_miss():
    def named(arg):
        def call():
            raise InputError(arg, "bad", "good")
        return call

    ok = probe_errors({"x": named("x"), "page out of range": ("block_tables", named("block_tables"))})
    assert ok.passed and ok.figure == "2 bad inputs named their argument"
    bad = probe_errors({"x": lambda: None, "dup": ("indices", named("seq_lens")), "w": named("w")})
    assert not bad.passed
    assert bad.figure == "x: no error; dup: error named 'seq_lens', not 'indices'"


def test_figures():
    f = timing.figures(10.0, flops=8e9, nbytes=4e7, bound="memory", ceil=_Ceil)
    assert f["tbps"] == pytest.approx(4.0) and f["tflops"] == pytest.approx(800.0)
    assert f["frac_of_ceiling"] == pytest.approx(1.0)
    f = timing.figures(20.0, flops=8e9, nbytes=0, bound="compute", ceil=_Ceil)
    assert f["tbps"] is None and f["frac_of_ceiling"] == pytest.approx(0.5)
    assert timing.figures(20.0, 1.0, 1.0, "memory", None)["frac_of_ceiling"] is None


def test_rotation_sets(monkeypatch):
    monkeypatch.setattr(timing, "l2_bytes", lambda: 50 * 2**20)
    assert timing.num_sets(1024) == timing.MAX_SETS  # tiny inputs: capped
    assert timing.num_sets(2 * 2**30) == 1  # far past the L2 already
    assert timing.num_sets(60 * 2**20) == 3  # 3 x L2 / 60 MiB -> 3 sets
    calls = []
    fn = timing._cycle([lambda i=i: calls.append(i) for i in range(3)])
    for _ in range(7):
        fn()
    assert calls == [0, 1, 2, 0, 1, 2, 0]


def _doc():
    env = environment(_Ceil_dc())
    env["gpu"] = "NVIDIA H200"
    recs = [{"op": "rmsnorm", "case": "T=8192,H=8192,dtype=bf16", "family": "norm", "provider": p, "median_us": us,
             **timing.figures(us, 3 * 8192 * 8192, 2 * 2 * 8192 * 8192, "memory", _Ceil), "selected": p == "opmap-triton"}
            for p, us in (("opmap-triton", 70.0), ("torch", 130.0))]
    recs.append({"op": "gemm", "case": "M=4096,N=4096,K=4096", "family": "gemm", "provider": "cublas", "median_us": 250.0,
                 **timing.figures(250.0, 2 * 4096**3, 3 * 2 * 4096**2, "compute", _Ceil)})
    return {"environment": env, "results": recs,
            "skipped": [{"op": "gemm", "case": "M=1", "family": "gemm", "provider": "flashinfer", "reason": "not installed"}]}


def _Ceil_dc():
    from opmap.core.hw import Ceilings

    return Ceilings(4.0, 4.0, 800.0, "NVIDIA H200", "580.1", "2026-01-01T00:00:00+00:00")


def test_result_files(tmp_path, monkeypatch):
    monkeypatch.setenv("OPMAP_PDL", "0")
    monkeypatch.setenv("OPMAP_COMMIT", "abc1234")
    doc = _doc()
    assert doc["environment"]["settings"].get("OPMAP_PDL") == "0"  # the variant a file timed
    assert "OPMAP_COMMIT" not in doc["environment"]["settings"]
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    p1 = bench_report.write(doc, str(tmp_path))
    # one file per family under the GPU's folder, replaced by the next run (never accumulated)
    assert sorted(p1) == ["gemm", "norm"] and p1["norm"]["json"] == str(tmp_path / "h200" / "norm.json")
    doc["results"] = [r for r in doc["results"] if r["provider"] != "torch"]
    p2 = bench_report.write(doc, str(tmp_path), png=False)
    assert p2["norm"]["json"] == p1["norm"]["json"] and sorted(p.name for p in (tmp_path / "h200").glob("*.json")) == [
        "gemm.json", "norm.json"]
    d = json.loads(open(p2["norm"]["json"]).read())
    assert [r["provider"] for r in d["results"]] == ["opmap-triton"] and d["family"] == "norm"
    d = json.loads(open(p1["gemm"]["json"]).read())
    for k in ("gpu", "driver", "torch", "triton", "cuda", "commit", "command", "ceilings"):
        assert k in d["environment"]
    for r in d["results"]:
        assert {"op", "case", "provider", "median_us", "frac_of_ceiling"} <= set(r) and (r["tbps"] or r["tflops"])
    md = open(p2["norm"]["markdown"]).read()
    assert "| rmsnorm | `T=8192,H=8192,dtype=bf16` | opmap-triton (selected) | 70.00 |" in md
    assert "flashinfer: not installed" in open(p2["gemm"]["markdown"]).read()
    if "png" in p1["norm"]:
        with open(p1["norm"]["png"], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib" in p1["norm"]["png_skipped"]


def test_variant_rows_only_when_asked():
    dflt = Provider("opmap-triton", make=lambda inp: (lambda: None))
    var = Provider("opmap-triton[bn=32]", make=lambda inp: (lambda: None))
    case = BenchCase("rmsnorm", "T=1", 0, 1, setup=lambda d: None, providers=[dflt, var])
    assert var.variant and not dflt.variant
    assert [p.name for p in bench_runner.without_variants([case])[0].providers] == ["opmap-triton"]


def test_bench_case_filters_and_provider_reasons():
    prov_ok = Provider("torch", make=lambda inp: (lambda: None))
    prov_pkg = Provider("peer", make=lambda inp: (lambda: None), available=lambda: "package 'peer' is not installed")
    prov_reg = Provider("opmap-triton", make=lambda inp: (lambda: None), backend=("rmsnorm", "no-such"))
    case = BenchCase("rmsnorm.fused", "T=1,H=4096", 0, 16384, setup=lambda d: None,
                     providers=[prov_ok, prov_pkg, prov_reg])
    assert bench_runner.why_not(prov_ok, case) is None
    assert bench_runner.why_not(prov_pkg, case) == "package 'peer' is not installed"
    assert "no backend 'no-such'" in bench_runner.why_not(prov_reg, case)
    assert bench_runner.keep(case, ["rmsnorm"], None) and bench_runner.keep(case, ["rmsnorm.fused"], None)
    assert not bench_runner.keep(case, ["gemm"], None)
    assert bench_runner.keep(case, ["rmsnorm.fu"], None)  # a prefix of the name, not only whole parts
    assert bench_runner.keep(case, None, {"rmsnorm", "gemm"}) and not bench_runner.keep(case, None, {"gemm"})
    # --provider: exact names; a case left with no provider is dropped, the others keep theirs only
    other = BenchCase("gemm", "M=1", 0, 1, setup=lambda d: None, providers=[prov_ok])
    kept = bench_runner.only_providers([case, other], ["opmap-triton", "peer"])
    assert [c.case for c in kept] == ["T=1,H=4096"]
    assert [p.name for p in kept[0].providers] == ["peer", "opmap-triton"]
    assert [p.name for p in case.providers] == ["torch", "peer", "opmap-triton"]  # the case itself unchanged
    assert bench_runner.only_providers([case], None) == [case]
    # a name no case has is an error naming the closest rows, not a run of the other rows only
    with pytest.raises(ValueError, match=r"'opmap-triton\[bh=16\]'.*closest \['opmap-triton'\]"):
        bench_runner.only_providers([case, other], ["opmap-triton", "opmap-triton[bh=16]"])
    from opmap.core.specs import AttentionSpec

    mla_case = BenchCase("attention.mla_decode", "B=1", 1, 1, setup=lambda d: None, providers=[prov_ok],
                         spec=AttentionSpec(kind="mla", num_kv_heads=1, head_dim=576, head_dim_v=512))
    gqa_case = BenchCase("attention.decode", "B=1", 1, 1, setup=lambda d: None, providers=[prov_ok],
                         spec=AttentionSpec())
    assert bench_runner.keep(mla_case, None, {"attention"}, mla=True)
    assert not bench_runner.keep(mla_case, None, {"attention"}, mla=False)
    assert bench_runner.keep(gqa_case, None, {"attention"}, mla=False)
    assert not bench_runner.keep(gqa_case, None, {"attention"}, mla=True)
    # a model's benchmarks: the formats it runs (bf16; a quantised checkpoint's own weights too)
    import dataclasses

    from opmap.model.presets import PRESETS
    from opmap.core.specs import GemmSpec

    g = lambda wd: BenchCase("gemm", f"w={wd}", 1, 1, setup=lambda d: None, providers=[prov_ok],  # noqa: E731
                             spec=GemmSpec(m=1, n=64, k=64, weight_dtype=wd))
    fp8kv = BenchCase("attention.decode", "fp8", 1, 1, setup=lambda d: None, providers=[prov_ok],
                      spec=AttentionSpec(kv_dtype="fp8"))
    plain = bench_runner.model_formats(PRESETS["llama3-8b"])
    stored = bench_runner.model_formats(dataclasses.replace(PRESETS["llama3-8b"], extra={"weight_quant": {"format": "fp8"}}))
    assert plain == {"bf16"} and stored == {"bf16", "fp8"}
    assert [bench_runner.in_formats(c, plain) for c in (g("bf16"), g("fp8"), gqa_case, fp8kv)] == [True, False, True, False]
    assert [bench_runner.in_formats(c, stored) for c in (g("fp8"), g("int8"))] == [True, False]
    assert bench_runner.in_formats(g("int8"), None)  # no model: every case


def test_model_benchmarks_keep_the_cases_at_its_widths():
    """A model's benchmarks: the real case list filtered to the ops of Llama-3-8B's step maps and
    their widths (RMSNorm at hidden 4096, SiLU at 14336, NeoX RoPE at d128, prefill attention 32/8
    heads at its page size); an op with no case at them (decode attention's cases are at page 16,
    sm90 runs 64) keeps its cases."""
    from opmap.engine.config import EngineConfig
    from opmap.engine.opset import planned_maps
    from opmap.model import presets
    from opmap.harness.bench import runner as bench_runner

    cfg = presets.PRESETS["llama3-8b"]
    every = bench_runner.collect(True)[0]

    def kept_for(ecfg):
        specs: dict = {}
        for rows in planned_maps(cfg, "sm90", ecfg).values():
            for r in rows:
                specs.setdefault(r.op, []).append(r.spec)
        cases = [c for c in every if bench_runner.keep(c, None, set(specs))]
        return cases, bench_runner.at_model_widths(cases, specs)

    # The engine's one launch of RoPE and the append (the default) is a kv_append case, which times
    # it against the two launches; with fuse_rope_append off, RoPE's own cases at the model's width.
    fused = kept_for(None)[1]
    assert not [c for c in fused if c.op == "rope"] and any(c.case.startswith("rope+append") for c in fused)
    cases, kept = kept_for(EngineConfig(fuse_rope_append=False))
    by = lambda op: [c for c in kept if c.op == op]  # noqa: E731
    assert by("rmsnorm") and {c.spec.hidden for c in by("rmsnorm")} == {4096}
    assert by("activation") and {(c.spec.kind, c.spec.hidden) for c in by("activation")} == {("silu_mul", 14336)}
    assert by("rope") and {(c.spec.style, c.spec.head_dim) for c in by("rope")} == {("neox", 128)}
    pre = by("attention.prefill")
    assert pre and all((c.spec.num_heads, c.spec.num_kv_heads, c.spec.page_size) == (32, 8, 64) for c in pre)
    assert by("attention.decode") == [c for c in cases if c.op == "attention.decode"]
    assert len(kept) < len(cases)


def test_bench_cases_of_families_are_well_formed():
    """Every family's bench cases declare FLOPs / bytes and providers (no timing on the CPU)."""
    cases, errors = bench_runner.collect(quick=True)
    assert errors == [], errors
    for c in cases:
        assert c.op and "=" in c.case and c.bytes > 0 and c.flops >= 0 and c.bound in ("memory", "compute")
        assert c.providers and len({p.name for p in c.providers}) == len(c.providers), c.case
    if torch.cuda.is_available():
        pytest.skip("CPU-side check only")


def test_run_case_plumbing(monkeypatch):
    """run_case on the CPU with the GPU timer replaced by a call counter: every runnable provider
    is made on every input set and called, failures and unavailable providers are listed, and the
    records carry the figures of the (stand-in) time. No timing is asserted."""
    calls = []

    def fake_time(fns, graph=False, warmup_ms=25, rep_ms=100):
        for f in fns:
            f()
        return timing.Timing(10.0, "events+graph" if graph else "events", len(fns))

    monkeypatch.setattr(timing, "time_calls", fake_time)
    monkeypatch.setattr(timing, "num_sets", lambda nbytes, max_sets=16: 3)
    made = []

    def make(inp):
        made.append(inp)
        return lambda: calls.append(inp)

    def boom(inp):
        raise RuntimeError("no kernel image for this device")

    case = BenchCase("rmsnorm", "T=4,H=8", flops=96, bytes=160, setup=lambda d: torch.randn(4, 8, device=d),
                     providers=[Provider("p-ok", make), Provider("p-boom", boom),
                                Provider("p-absent", make, available=lambda: "not installed")], graph=True)
    recs, skipped = bench_runner.run_case(case, _Ceil, torch.device("cpu"), quick=True)
    assert len(made) == 3 and len(calls) == 3  # one callable per input set, each called
    assert [r["provider"] for r in recs] == ["p-ok"]
    r = recs[0]
    assert r["median_us"] == 10.0 and r["method"] == "events+graph" and r["input_sets"] == 3
    assert r["tbps"] == pytest.approx(160 / 10e-6 / 1e12, rel=1e-3)
    assert r["frac_of_ceiling"] == pytest.approx(r["tbps"] / 4.0, rel=1e-3)
    reasons = {s["provider"]: s["reason"] for s in skipped}
    assert reasons["p-absent"] == "not installed"
    assert reasons["p-boom"].startswith("failed: RuntimeError: no kernel image")


def test_variant_rows_are_not_the_selectors_pick_and_print_whole(monkeypatch):
    """A bracketed row (a config variant of the selected backend) is not marked as the selector's
    pick, and the console table prints its whole name: rich read "[bm=128,...]" as markup and
    printed every MLA prefill variant as "opmap-triton *")."""
    import io

    from rich.console import Console

    monkeypatch.setattr(timing, "time_calls", lambda fns, graph=False, warmup_ms=25, rep_ms=100:
                        timing.Timing(10.0, "events", len(fns)))
    monkeypatch.setattr(timing, "num_sets", lambda nbytes, max_sets=16: 1)
    monkeypatch.setattr(bench_runner, "selected_backend", lambda case: "mla-triton")
    mk = lambda inp: (lambda: None)  # noqa: E731
    case = BenchCase("attention.mla_prefill", "new=8", flops=1, bytes=1, setup=lambda d: None,
                     providers=[Provider("opmap-triton", mk, backend=("attention", "mla-triton")),
                                Provider("opmap-triton[bm=128,bn=64,w=8,s=3]", mk, backend=("attention", "mla-triton"))])
    monkeypatch.setattr(bench_runner, "why_not", lambda p, c: None)
    recs, _ = bench_runner.run_case(case, _Ceil, torch.device("cpu"), quick=True)
    assert [r["selected"] for r in recs] == [True, False]
    buf = io.StringIO()
    bench_runner.print_table({"results": recs, "skipped": [], "load_errors": []},
                             console=Console(file=buf, width=200))
    text = buf.getvalue()
    assert "opmap-triton[bm=128,bn=64,w=8,s=3]" in text and "opmap-triton *" in text


def test_report_gpu_sections_render(monkeypatch, tmp_path):
    """The GPU-only parts of the report (ceilings, bench lines, engine TTFT/TPOT and profile)
    rendered on the CPU from stand-in results: the layout is checked, no figure is asserted."""
    import dataclasses

    from opmap.core import hw

    from opmap.harness import report
    from opmap.harness.check import runner as check_runner

    info = dataclasses.replace(hw.detect(), kind="cuda", name="NVIDIA Fake", arch="sm90", driver="1.0")
    monkeypatch.setattr(hw, "detect", lambda: info)
    monkeypatch.setattr(hw, "local_arch", lambda: "sm90")
    monkeypatch.setattr(hw, "ceilings", lambda measure=True, refresh=False: _Ceil_dc())
    monkeypatch.setattr(check_runner, "local_device", lambda: "cpu")
    doc = _doc()
    doc["quick"], doc["model"], doc["load_errors"] = True, "tiny-llama3", []
    monkeypatch.setattr(bench_runner, "bench", lambda **kw: doc)
    # (the real background warm-up would start compile workers that nothing here waits for)
    warm_calls = []
    monkeypatch.setattr(bench_runner, "warm_in_background", lambda **kw: warm_calls.append(kw) or (lambda: None))
    eng = {"status": "ok", "workload": "batch 1, prompt 1024, 128 new tokens, greedy, random weights",
           "summary": {"tpot_ms_p50": 1.0}, "lines": ["TTFT p50 2.00 ms", "TPOT p50 1.00 ms"],
           "profile": {"status": "ok", "workload": "batch 8",
                       "lines": ["[decode] 40 steps", "  memory copies  0.1%  Memcpy HtoD (Pinned -> Device)",
                                 "decode: GEMM takes 84% of GPU time"],
                       "phases": {"prefill": {"steps": 1, "categories": {"GEMM": 36.0, "attention": 2.0}},
                                  "decode": {"steps": 31, "categories": {"GEMM": 1.0, "attention": 3.0}}},
                       "diagnosis": ["decode: GEMM takes 84% of GPU time"]}}
    monkeypatch.setattr(report, "_engine_section", lambda model, on_gpu: eng if on_gpu else None)
    d = report.build("tiny-llama3", run_check=False, run_bench=True, progress=False)
    assert warm_calls == [dict(model="tiny-llama3", quick=True, progress=False)]  # started beside the check
    # The summary: each phase's largest category and the first diagnosis rule (not a kernel line
    # that happens to hold an arrow)
    summary = report.summary_lines(d)
    assert "- largest GPU-time share (batch 8): prefill GEMM 95%; decode attention 75%" in summary
    assert "- diagnosis: decode: GEMM takes 84% of GPU time" in summary
    md = report.to_markdown(d)
    assert "on NVIDIA Fake (sm90)" in md and "Ceilings: read 4.0 TB/s" in md
    assert "| rmsnorm | `T=8192,H=8192,dtype=bf16` | opmap-triton (selected) |" in md
    assert "Workload: batch 1, prompt 1024" in md and "- TPOT p50 1.00 ms" in md and "- [decode] 40 steps" in md
    assert all(r["phase"] == "decode" for r in d["operators"]["decode"])
    # On sm90 the decode step is captured in a CUDA graph: the attention spec says so.
    att = next(r for r in d["operators"]["decode"] if r["op"] == "attention")
    assert "cuda_graph=True" in att["spec"] and "dtype=bf16" in att["spec"]


def test_check_of_a_model_runs_that_model_itself(tmp_path):
    """`opmap check --model DIR` compares that checkpoint's own weights with HF (not only a preset of
    its architecture); a preset too large for the device's budget says so in a note; on a CPU no
    case sits under "Eager vs CUDA graph" (nothing is captured there)."""
    from opmap.harness.check.cases.engine import own_parity
    from opmap.model.hf import save_checkpoint
    from opmap.model.presets import PRESETS

    save_checkpoint(PRESETS["tiny-qwen3"], str(tmp_path), seed=1)
    case, note = own_parity(str(tmp_path), "cpu")
    assert note is None and f"model={tmp_path}" in case.case
    outcome = case.run()
    assert outcome.passed and "greedy tokens equal HF" in outcome.figure
    case, note = own_parity("tiny-qwen3", "cpu")  # a preset: its weights drawn and handed over in memory
    assert note is None and "random weights" in case.case and case.run().passed
    case, note = own_parity("llama3-8b", "cpu")
    assert case is None and "llama3-8b(2 layers, random weights) not run" in note and "GiB" in note
    found, _ = runner.collect("cpu", quick=True)
    assert not [c for _, c in found if c.section == "graph"]
    results, extra = runner.check(model=str(tmp_path), sections=["parity"], ops=["e2e"], progress=False)
    assert any(f"model={tmp_path}" in r.case and r.passed for r in results)


def test_cases_at_the_models_own_shapes(monkeypatch):
    """check --model adds, per operator whose selected backend is not the reference, a case at the
    model's own widths against the reference. On a GPU the selector makes those choices; here the
    Triton backends are forced (the interpreter runs them, fp32) for a tiny MoE model."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from opmap.core import select as sel
    from opmap.engine.config import EngineConfig
    from opmap.engine.opset import planned_maps
    from opmap.harness.check.cases.model_shapes import cases as shape_cases
    from opmap.model.presets import PRESETS

    ops, made_all = set(), []
    for name in ("tiny-qwen3moe", "tiny-llama3", "tiny-qwen2moe"):
        cfg = PRESETS[name]
        choices = []
        # the separate RoPE and append launches: the standalone RoPE gets its case too; tiny-llama3's
        # gate/up GEMM and its activation apart (the activation's case); of tiny-qwen2moe only its
        # fused shared-expert gate/up row, checked through the linear_act entry
        fuse = EngineConfig(fuse_rope_append=False, fuse_gated=name == "tiny-qwen2moe")
        for ph, m in planned_maps(cfg, "cpu", fuse).items():
            for r in m:
                if name == "tiny-qwen2moe" and r.entry != "linear_act":
                    continue
                for b in ("triton", "triton-decode"):
                    try:
                        choices.append((ph, r.op, r.label, sel.select(r.op, r.spec, backend=b), None, r.entry))
                        break
                    except sel.BackendError:
                        continue
        made = shape_cases(cfg, choices, "cpu")
        made_all += made
        ops |= {c.op for c in made}
        assert all(f"model={cfg.name}" in c.case for c in made)
        for c in made:
            o = c.run()
            assert o.passed, (c.case, o.figure)
    assert {"rmsnorm", "gemm", "rope", "attention", "moe", "activation", "sampling"} <= ops, ops
    assert any("shared gate/up proj + shared SiLU * mul (one launch)" in c.case for c in made_all)
    # DeepSeek's shared down GEMM with the routed output as addend: checked through linear_add
    cfg = PRESETS["tiny-deepseek"]
    rows = [(ph, r) for ph, m in planned_maps(cfg, "cpu").items() for r in m if r.entry == "linear_add"]
    assert {ph for ph, _ in rows} == {"prefill", "decode", "mixed"}
    added = shape_cases(cfg, [(ph, r.op, r.label, sel.select(r.op, r.spec, backend=b), None, r.entry)
                              for ph, r in rows for b in ("triton-decode", "cublas") if (b == "cublas") != (ph == "decode")],
                        "cpu")
    assert {c.backend for c in added} == {"triton-decode", "cublas"}
    assert added and all("routed experts' sum (one launch)" in c.case and c.run().passed for c in added)
    # with the selector's own choices on a CPU (the references) there is none, and the check says so
    targets = runner.model_targets("tiny-qwen3moe")
    assert shape_cases(targets.cfg, targets.choices, "cpu") == []
    _, extra = runner.check(model="tiny-qwen3moe", sections=["parity"], ops=["rmsnorm"], progress=False)
    assert any("no case at the model's own shapes" in n for n in extra["notes"])


def test_the_commit_of_an_archived_tree(tmp_path, monkeypatch):
    """A `git archive` of the tree carries its commit in opmap/COMMIT (export-subst): a result file
    names it even where the copy sits under another repository's .git; OPMAP_COMMIT comes first; in
    a checkout the file holds the unexpanded placeholder and git's HEAD is read."""
    from opmap.harness import output

    monkeypatch.delenv("OPMAP_COMMIT", raising=False)
    assert output.COMMIT_FILE.read_text().strip() == "$Format:%H$"  # the checkout's copy
    assert output._archived() is None
    f = tmp_path / "COMMIT"
    f.write_text("7681b94984491b4aa8d367eca82b3e249f03ec2b\n")
    monkeypatch.setattr(output, "COMMIT_FILE", f)
    assert output.git_commit() == "7681b94984491b4aa8d367eca82b3e249f03ec2b"
    monkeypatch.setenv("OPMAP_COMMIT", "abc1234")
    assert output.git_commit() == "abc1234"
    f.write_text("$Format:%H$\n")
    monkeypatch.delenv("OPMAP_COMMIT")
    assert output.git_commit() == output._git_head()


def test_report_names_the_quantised_expert_routes():
    """The report's quantised-paths answer names, for a MoE model, the MoE backend of int4 and
    block-fp8 experts at decode, at a prefill step and at a call with MANY_ROWS_AN_EXPERT rows an
    expert, and flags the dequantise-then-16-bit route where (and only where) it is chosen; a dense
    model gets no MoE line."""
    from opmap.engine.opset import planned_maps
    from opmap.harness import report
    from opmap.model.presets import get_preset

    def quant_answer(name):
        cfg = get_preset(name)
        qs = report.questions(cfg, "sm90", planned_maps(cfg, "sm90"))
        return [line for q in qs if "quantised" in q["question"] for line in q["answer"]]

    for name, many in (("mixtral-8x7b", 1024), ("qwen3-30b-a3b", 4096)):
        moe = [line for line in quant_answer(name) if line.startswith("MoE")]
        assert len(moe) == 6, moe
        for wd in ("int4", "fp8-block"):
            mine = [line for line in moe if f"with {wd} experts" in line]
            assert [("dequant-triton" in line, "dequantise then bf16 grouped GEMM" in line) for line in mine] == \
                [(False, False), (False, False), (True, True)], mine
            assert f"a call of {many} tokens" in mine[2] and "`triton`" in mine[0] and "`triton`" in mine[1]
    assert not any(line.startswith("MoE") for line in quant_answer("llama3-8b"))


def test_bench_of_a_model_times_its_own_gemm_and_norm_widths():
    """`opmap bench --model` (and the report) time a model's own projections: Qwen3-30B-A3B's router,
    QKV, O and LM head and its hidden 2048, not Llama-3-8B's widths the fixed grid has; Llama-3-8B keeps
    the grid's M on gate/up and down and gains its QKV, O and LM head at a decode row and a prefill
    chunk. An op none of whose cases is at the model's widths is named (``off_widths``), and only then."""
    from opmap.harness.bench import runner as bench_runner

    cases, errors = bench_runner.select_cases(model="qwen3-30b-a3b", quick=True)
    assert errors == []
    specs = bench_runner.model_facts("qwen3-30b-a3b")[0]
    gemm = [c for c in cases if c.op == "gemm"]
    assert {(c.spec.n, c.spec.k) for c in gemm} == {(s.n, s.k) for s in specs["gemm"]} \
        == {(128, 2048), (5120, 2048), (2048, 4096), (151936, 2048)}
    assert {c.spec.m for c in gemm} == set(bench_gemm.MS_MODEL_QUICK)
    assert {c.spec.hidden for c in cases if c.op == "rmsnorm"} == {2048}
    off = bench_runner.off_widths(cases, specs)
    assert "gemm" not in off and "rmsnorm" not in off and "moe" not in off
    # decode / prefill attention and the RoPE + append at its 32 / 4 heads and its page (the grid's
    # are Llama's 32 / 8), the append with and without its q / k norms in the launch
    assert "attention.decode" not in off and "attention.prefill" not in off and "kv_append" not in off
    page = {s.page_size for s in specs["attention"]}
    for op in ("attention.decode", "attention.prefill"):
        mine = [c for c in cases if c.op == op]
        assert mine and {(c.spec.num_heads, c.spec.num_kv_heads, c.spec.head_dim, c.spec.page_size)
                         for c in mine} == {(32, 4, 128, p) for p in page}, [c.case for c in mine]
    dec = [c for c in cases if c.op == "attention.decode"]
    assert {c.case.split(",h=")[0] for c in dec} == {f"B={b},kv={n}" for b, n in bench_attention.MODEL_DECODE[True]}
    assert all(c.spec.kv_dtype == "bf16" for c in dec)  # the model runs a bf16 cache: no fp8 rows
    tuned, _ = bench_runner.select_cases(model="qwen3-30b-a3b", quick=True, variants=True,
                                         ops=["attention", "kv_append"])
    short = next(c for c in tuned if c.op == "attention.decode" and c.case.startswith("B=1,kv=512,"))
    assert {"opmap-triton[chunk=64]", "opmap-triton[chunk=256]", "opmap-triton[pf=0]"} <= {p.name for p in short.providers}
    app = [c.case.split(",T=")[0] for c in tuned if c.op == "kv_append" and "h=32/4" in c.case]
    assert sorted(set(app)) == ["qk_norm+rope+append", "rope+append"]
    assert [c.case for c in cases if c.op == "kv_append"] == [f"T=64,h=4,d=128,page={p},kv_dtype=bf16" for p in page]

    llama, _ = bench_runner.select_cases(model="llama3-8b", quick=True, ops=["gemm"])
    shapes = {}
    for c in llama:
        if c.op == "gemm":
            shapes.setdefault((c.spec.n, c.spec.k), set()).add(c.spec.m)
    assert shapes[(28672, 4096)] == shapes[(4096, 14336)] == set(bench_gemm.MS)
    assert shapes[(6144, 4096)] == shapes[(4096, 4096)] == shapes[(128256, 4096)] == set(bench_gemm.MS_MODEL_QUICK)
    # the shared expert's GEMM + add is not Llama's: its rows are named as another model's widths
    assert bench_runner.off_widths(llama, bench_runner.model_facts("llama3-8b")[0]) == ["gemm.add"]


def test_model_attention_cases_take_the_model_heads_and_leave_mla_to_its_family():
    """attention.model_cases: each GQA geometry of the model (heads, KV heads, head dim, page) gets
    decode, prefill and RoPE + append rows whose inputs have those shapes; MLA specs get none here."""
    from opmap.core.specs import AttentionSpec

    spec = AttentionSpec(arch="sm90", phase="decode", num_heads=12, num_kv_heads=2, head_dim=64, page_size=32)
    mla = AttentionSpec(arch="sm90", phase="decode", kind="mla", num_heads=16, num_kv_heads=1, head_dim=576,
                        head_dim_v=512, page_size=64)
    out = bench_attention.model_cases({"attention": [spec, mla]}, quick=True)
    assert out
    for c in out:  # the plain append's case names its KV heads only
        assert "d=64,page=32" in c.case and ("h=12/2," in c.case or c.case.startswith("T=64,h=2,")), c.case
    dec = next(c for c in out if c.op == "attention.decode" and c.case.startswith("B=1,kv=512,"))
    inp = dec.setup("cpu")
    assert inp["q"].shape == (1, 12, 64) and inp["kc"].shape[1:] == (32, 2, 64) and inp["d"] == 64
    rows = [c for c in out if c.op == "kv_append" and c.case.startswith("qk_norm+rope+append,T=1,")]
    assert len(rows) == 1 and "norm" in rows[0].setup("cpu")
    assert bench_attention.model_cases({"attention": [mla]}, quick=True) == []


def test_model_gemm_cases_in_the_checkpoint_format():
    """A quantised checkpoint's GEMM widths are timed in its own format (int4: the w4a16 op)."""
    from opmap.core.specs import GemmSpec

    out = bench_gemm.model_cases({"gemm": [GemmSpec(n=3000, k=2048, weight_dtype="int4"),
                                           GemmSpec(n=3000, k=2048, weight_dtype="bf16")]}, quick=True)
    assert {(c.op, c.spec.weight_dtype) for c in out} == {("gemm.w4a16", "int4"), ("gemm", "bf16")}
    assert all(c.spec.n == 3000 and c.spec.k == 2048 for c in out)


def test_bench_markdown_names_ops_off_the_model_widths_per_family():
    from opmap.harness.bench import report as bench_report

    env = {"gpu": "G", "arch": "sm90", "torch": "t", "triton": "t", "cuda": "c", "driver": "d", "commit": "x",
           "date": "now", "command": "opmap bench --model m"}
    rec = lambda op, fam: {"op": op, "case": "a=1", "family": fam, "provider": "p", "median_us": 1.0,  # noqa: E731
                           "tbps": None, "tflops": None, "frac_of_ceiling": None}
    doc = {"environment": env, "model": "m", "not_at_model_widths": ["attention.decode", "sampling"],
           "results": [rec("attention.decode", "attention"), rec("gemm", "gemm")], "skipped": []}
    fams = bench_report.split_by_family(doc)
    assert "No case at m's own widths for attention.decode:" in bench_report.to_markdown(fams["attention"])
    assert "own widths" not in bench_report.to_markdown(fams["gemm"])
