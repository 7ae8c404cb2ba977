"""`opmap run` / `opmap profile` through their parser factories, and the profile analysis of a GPU
trace (kernels, GPU-projected operator ranges, graph-replayed kernels) on a synthetic trace."""
import argparse
import json

import torch

from opmap.harness import profile as P
from opmap.harness.profile import engine as engine_view
from opmap.cli.run import add_profile_parser, add_run_parser

from test_engine_util import single_thread  # noqa: F401


def parse(*argv):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    add_run_parser(sub)
    add_profile_parser(sub)
    return ap.parse_args(list(argv))


def test_run_synthetic_workload(tmp_path, capsys, single_thread):
    out = tmp_path / "run.json"
    a = parse("run", "--model", "tiny-qwen3", "--num-requests", "6", "--input-len", "4:40", "--output-len", "2:6",
              "--max-num-batched-tokens", "32", "--no-progress", "--json", str(out))
    assert a.func(a) == 0
    text = capsys.readouterr().out
    assert "TTFT p50" in text and "TPOT p50" in text and "requests 6 (0 errors)" in text
    doc = json.loads(out.read_text())
    assert doc["summary"]["requests"] == 6 and len(doc["backends"]) > 5
    assert all(2 <= o["num_tokens"] <= 6 for o in doc["outputs"])


def test_prefill_graph_tokens_reaches_the_engine(monkeypatch):
    from opmap.cli import run as cli_run

    seen = {}
    monkeypatch.setattr("opmap.engine.llm.LLM", lambda model, **kw: seen.update(kw))
    cli_run._build(parse("run", "--model", "tiny-llama3", "--prefill-graph-tokens", "0"))
    assert seen["prefill_graph_tokens"] == 0
    cli_run._build(parse("run", "--model", "tiny-llama3"))
    assert seen["prefill_graph_tokens"] == 2048  # EngineConfig's default


def test_run_prompt_text(capsys, single_thread):
    a = parse("run", "--model", "tiny-llama3", "--prompt", "hi there", "--max-tokens", "3", "--no-progress")
    assert a.func(a) == 0
    assert "--- prompt 0: length" in capsys.readouterr().out


def test_profile_cpu(tmp_path, capsys, single_thread):
    trace = tmp_path / "t.json"
    a = parse("profile", "--model", "tiny-llama3", "--num-requests", "2", "--input-len", "20", "--output-len", "4",
              "--steps", "3", "--save-trace", str(trace))
    assert a.func(a) == 0
    text = capsys.readouterr().out
    assert "[prefill] 1 steps" in text and "[decode] 2 steps" in text
    assert "attention" in text and "GEMM" in text and "[reference]" in text
    assert "diagnosis: CPU run" in text and trace.exists()
    # host time per step, by part: the reference forward and sampler run on the host here
    host = [ln for ln in text.splitlines() if ln.strip().startswith("host:")]
    assert len(host) == 2 and all("ms of work" in ln and "forward" in ln and "sample" in ln for ln in host)


def test_profile_compare_closes_the_first_engine(capsys, single_thread, monkeypatch):
    from opmap.engine.llm import LLM

    built, open_before = [], []
    orig = LLM.__init__

    def track(self, *a, **k):
        open_before.append(sum(not x.closed for x in built))  # engines still open when this one is built
        orig(self, *a, **k)
        built.append(self)

    monkeypatch.setattr(LLM, "__init__", track)
    a = parse("profile", "--model", "tiny-llama3", "--num-requests", "1", "--input-len", "12", "--output-len", "3",
              "--steps", "2", "--compare", "rmsnorm=torch-rms_norm")
    assert a.func(a) == 0
    assert "forcing rmsnorm=torch-rms_norm changed the step time" in capsys.readouterr().out
    assert len(built) == 2 and open_before == [0, 0] and all(x.closed for x in built)


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_analyse_gpu_trace_and_diagnosis():
    ev = [
        _x("user_annotation", "opmap::step::decode", 0, 100),
        _x("user_annotation", "opmap::step::decode", 200, 100),
        # step 1, eager: kernels inside GPU-projected operator ranges
        _x("gpu_user_annotation", "opmap::attention::attention (paged)::triton", 10, 30),
        _x("kernel", "_decode_kernel", 12, 25),
        _x("gpu_user_annotation", "opmap::gemm::QKV proj::cublas", 45, 10),
        _x("kernel", "nvjet_tst_128x64", 46, 8),
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 60, 5),
        # step 2, graph replay: no operator ranges, classified by symbol
        _x("kernel", "_decode_kernel", 210, 20),
        _x("kernel", "_rmsnorm_kernel", 231, 2),
        _x("kernel", "_sample_kernel", 240, 5),
        _x("kernel", "mystery", 250, 1),
        _x("kernel", "outside_any_step", 500, 50),
    ]
    res = P.analyse({"traceEvents": ev})
    d = res["phases"]["decode"]
    assert res["on_gpu"] and d["steps"] == 2 and d["wall_us"] == 200
    c = d["by_category"]
    assert c["attention"] == 45 and c["GEMM"] == 8 and c["memory copies"] == 5
    assert c["norm"] == 2 and c["sampling"] == 5 and c["other"] == 1
    assert d["busy_us"] == 66 and d["idle_us"] == 134
    assert d["backends"]["attention"] == {"triton"} and d["backends"]["GEMM"] == {"cublas"}

    class R:  # the runner state the rules read
        use_graphs, graphs, buckets, graph_errors, graphs_off_reason = True, {1: 0}, [1, 2], {}, None

    class L:
        runner = R()

        class scheduler:
            running = []

    lines = P.diagnose(res, L(), {("sampling", "decode"): "reference"})
    assert any("attention + copies take 76%" in x for x in lines)
    idle = [x for x in lines if "GPU idle 67%" in x][0]
    assert "decode CUDA graphs not captured" in idle and "sampler fallback" in idle
    assert any("1 steps" in x or "ms/step" in x for x in P.format_profile(res))
    assert not any("host-bound" in x for x in lines)
    # host work per decode step (0.2 ms, mostly sampling) above the GPU's 0.033 ms: host-bound
    res["host_ms"] = {"decode": {"schedule": 0.02, "forward": 0.05, "sample": 0.12, "readback": 0.01, "wait": 0.5}}
    bound = [x for x in P.diagnose(res, L(), {}) if "host-bound" in x]
    assert bound and "host work 0.200 ms/step exceeds the GPU's 0.033 ms/step" in bound[0]
    assert "'sample' (0.120 ms" in bound[0]
    assert any(x.strip().startswith("host: 0.200 ms of work + 0.500 ms waiting") for x in P.format_profile(res))


def test_diagnose_gemm_floor_counts_quantised_weights(monkeypatch):
    """The decode GEMM line's floor: bf16 weights at two bytes, fp8 weight-only projections (and an
    LM head quantised by --quantize) at one (ModelRunner.decode_weight_bytes), and the line says which
    weights the engine runs."""
    from opmap.engine.runner import ModelRunner
    from types import SimpleNamespace

    from opmap.core import hw
    from opmap.harness import profile as P
    from opmap.model.presets import get_preset

    monkeypatch.setattr(hw, "ceilings", lambda measure=False: SimpleNamespace(read_tbps=4.0))
    cfg = get_preset("llama3-8b")
    ev = [_x("user_annotation", "opmap::step::decode", 0, 5000), _x("kernel", "_gemm_kernel", 10, 4000)]
    res = P.analyse({"traceEvents": ev})

    class R:
        use_graphs, graphs, buckets, graph_errors, graphs_off_reason = True, {1: 0}, [1], {}, None
        max_seqs, dtype, expert_bytes = 1, torch.bfloat16, None
        decode_weight_bytes = ModelRunner.decode_weight_bytes

    R.cfg = cfg
    lines = {}
    for q in (None, "fp8"):
        r = R()
        r.weight_format, r.lm_head_quantised = q, q is not None
        r.quantised_bytes = 1.0  # fp8 bits; their scales are left out here
        llm = SimpleNamespace(runner=r, scheduler=SimpleNamespace(running=[]))
        lines[q] = [x for x in P.diagnose(res, llm, {}) if x.startswith("decode: GEMM")][0]
    bf16_ms = cfg.decode_weight_bytes(1, 2) / 4e12 * 1e3
    fp8_ms = cfg.decode_weight_bytes(1, 2, quantised=True, lm_head=True) / 4e12 * 1e3
    assert f"weight-read floor {bf16_ms:.3f} ms/step, {4.0 / bf16_ms:.2f}x)" in lines[None]
    assert f"weight-read floor {fp8_ms:.3f} ms/step, {4.0 / fp8_ms:.2f}x, fp8 weights)" in lines["fp8"]
    assert fp8_ms < 0.6 * bf16_ms and "weight-only kernel" in lines["fp8"]


def test_analyse_counts_overlapping_kernels_once():
    """PDL: a kernel launched early overlaps the one before it (it waits inside); the categories
    count the overlap once, so that they add up to the busy time."""
    ev = [
        _x("user_annotation", "opmap::step::decode", 0, 100),
        _x("kernel", "_gemm_kernel", 10, 40),       # 10-50
        _x("kernel", "_rmsnorm_kernel", 30, 25),    # launched early: 30-55, its own 50-55
        _x("kernel", "_decode_kernel", 52, 20),     # 52-72, its own 55-72
        _x("kernel", "_act_mul_kernel", 60, 5),     # inside the one before: none of its own
    ]
    d = P.analyse({"traceEvents": ev})["phases"]["decode"]
    c = d["by_category"]
    assert c["GEMM"] == 40 and c["norm"] == 5 and c["attention"] == 17 and c["activation"] == 0
    assert d["busy_us"] == 62 == sum(c.values())
    assert sum(d["symbols"]["norm"].values()) == 5


def test_host_time_per_operator_on_a_gpu_trace():
    """--host-ops: the host time inside each operator's range (its checks, launch and Python), per
    step of a phase, also where the kernels carry the GPU times; steps without ranges list nothing."""
    ev = [
        _x("user_annotation", "opmap::step::prefill", 0, 1000),
        _x("user_annotation", "opmap::attention::attention (paged)::triton", 10, 120),
        _x("user_annotation", "opmap::attention::attention (paged)::triton", 300, 80),
        _x("user_annotation", "opmap::gemm::QKV proj::cublas", 150, 30),
        _x("kernel", "_prefill_tma_kernel", 140, 400),
        _x("user_annotation", "opmap::step::decode", 2000, 100),
        _x("kernel", "_decode_kernel", 2010, 20),
    ]
    res = P.analyse({"traceEvents": ev})
    lines = P.format_host_ops(res, 5)
    assert lines[0] == "[prefill] operators by host time (1 steps; 0.230 ms/step in operator ranges of 1.000 ms/step host wall)"
    assert lines[1].split() == ["200.0", "us/step", "2.0", "calls/step", "100.00", "us", "each", "attention", "(paged)",
                                "[triton]"]
    assert "QKV proj [cublas]" in lines[2] and len(lines) == 3  # no decode block: a replayed graph has no ranges
    # the CUDA API calls inside a step (launches, allocations) are listed after the operators
    ev += [_x("cuda_runtime", "cudaMalloc", 160, 90), _x("cuda_driver", "cuLaunchKernelEx", 20, 5),
           _x("cuda_driver", "cuLaunchKernelEx", 310, 7), _x("cuda_runtime", "cudaLaunchKernel", 2050, 3)]
    lines = P.format_host_ops(P.analyse({"traceEvents": ev}), 5)
    i = lines.index("[prefill] CUDA API calls by host time (0.102 ms/step)")
    assert lines[i + 1].split()[:4] == ["90.0", "us/step", "1.0", "calls/step"] and lines[i + 1].endswith("cudaMalloc")
    assert lines[i + 2].split()[:4] == ["12.0", "us/step", "2.0", "calls/step"] and lines[i + 2].endswith("cuLaunchKernelEx")
    assert lines[-1].endswith("cudaLaunchKernel") and lines[-2] == "[decode] CUDA API calls by host time (0.003 ms/step)"


def test_python_hotspots_rank_the_functions_of_a_run():
    """--python: the workload once more under cProfile, functions by own time, opmap's among them."""
    from opmap.engine.llm import LLM
    from opmap.engine.params import SamplingParams

    with LLM("tiny-llama3", device="cpu", dtype="fp32", num_pages=32, page_size=16) as llm:
        lines = P.python_hotspots(llm, [[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0), 6)
    assert lines[0].startswith("Python functions by own host time (cProfile over 1 prefill, 2 decode steps;")
    assert len(lines) == 7
    own = [float(ln.split()[0]) for ln in lines[1:]]
    assert own == sorted(own, reverse=True) and own[0] > 0
    assert any("opmap/" in ln for ln in lines[1:])


def test_categorize_symbols():
    cases = {"_prefill_kernel": "attention", "flash_fwd_kernel": "attention", "_append_kernel": "attention",
             "sm90_xmma_gemm_bf16bf16": "GEMM", "_gemm_kernel": "GEMM", "_grouped_gemm_kernel": "MoE",
             "_align_kernel": "MoE", "_rope_kernel": "RoPE", "_act_mul_kernel": "activation",
             "_bitmask_kernel": "grammar", "Memset (Device)": "memory copies", "void at::native::foo": "other",
             "_route_kernel": "MoE", "_combine_kernel": "MoE", "indexSelectLargeIndex": "memory copies",
             # the sampler's passes (A split, B, bracket, C) and the fused kernels
             "_sample_partials_kernel": "sampling", "_sample_hist_kernel": "sampling",
             "_sample_bracket_kernel": "sampling", "_sample_gather_kernel": "sampling",
             "_route_align_kernel": "MoE", "_rope_kv_append_kernel": "attention"}
    assert {k: P.categorize(k) for k in cases} == cases


def test_bad_engine_arguments_are_clean_errors(capsys):
    from opmap.cli import main as cli

    assert cli.main(["run", "--model", "no-such-model", "--no-progress"]) == 1
    assert "opmap run: error: model: got 'no-such-model'" in capsys.readouterr().err
    assert cli.main(["run", "--model", "tiny-llama3", "--page-size", "12"]) == 1
    assert "page_size" in capsys.readouterr().err


def test_ambiguous_symbols_follow_the_model():
    assert P.categorize("_combine_kernel", moe=False) == "attention"  # split-KV decode combine
    assert P.categorize("_combine_kernel", moe=True) == "MoE"


def test_profile_kernel_table_on_cpu(capsys):
    from opmap.cli import main as cli

    rc = cli.main(["profile", "--model", "tiny-llama3", "--steps", "4", "--kernels", "3", "--num-requests", "2",
                   "--input-len", "8", "--output-len", "4"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "[decode] operators by host time (CPU run)" in out and "launches/step" in out


def test_graph_replayed_phases_name_their_chosen_backends():
    """A replayed graph's kernels have no operator range: the profile names the op set's choice,
    marked "(graph)", and keeps what a range did attribute."""
    from types import SimpleNamespace as NS

    from opmap.harness.profile.engine import graph_backends

    def choice(op, phase, name):
        return ("x", "entry", NS(op=op, spec=NS(phase=phase), backend=NS(name=name)))

    padded = NS(choices=[choice("gemm", "prefill", "cublas"), choice("attention", "prefill", "triton")])
    runner = NS(graphs={1: None}, prefill_graphs={128: None}, padded_ops=padded, ops={},
                decode_ops={1: NS(choices=[choice("attention", "decode", "triton")])})
    llm = NS(runner=runner, sampler=NS(choices=[]))
    res = {"phases": {"prefill": {"by_category": {"attention": 5.0, "GEMM": 3.0, "norm": 0.0},
                                  "backends": {"GEMM": {"cublas-range"}}},
                      "decode": {"by_category": {"attention": 1.0}, "backends": {}},
                      "mixed": {"by_category": {"attention": 1.0}, "backends": {}}}}
    graph_backends(res, llm)
    ph = res["phases"]
    assert ph["prefill"]["backends"] == {"GEMM": {"cublas-range"}, "attention": {"triton (graph)"}}
    assert ph["decode"]["backends"] == {"attention": {"triton (graph)"}}
    assert ph["mixed"]["backends"] == {}  # mixed steps run eagerly: nothing to fill in
    # padded buckets from many_tokens run their own op set: both sets' choices are named
    many = NS(choices=[choice("moe", "prefill", "dequant-triton")])
    padded = NS(choices=[choice("moe", "prefill", "triton")])
    runner = NS(graphs={}, prefill_graphs={128: None, 1024: None}, padded_ops=padded, ops={}, decode_ops={},
                padded_ops_of=lambda tb: many if tb >= 1024 else padded)
    res = {"phases": {"prefill": {"by_category": {"MoE": 9.0}, "backends": {}}}}
    graph_backends(res, NS(runner=runner, sampler=NS(choices=[])))
    assert res["phases"]["prefill"]["backends"] == {"MoE": {"triton (graph)", "dequant-triton (graph)"}}
    runner.prefill_graphs = {128: None}  # no bucket that long captured: the stored-format kernel only
    res = {"phases": {"prefill": {"by_category": {"MoE": 9.0}, "backends": {}}}}
    graph_backends(res, NS(runner=runner, sampler=NS(choices=[])))
    assert res["phases"]["prefill"]["backends"] == {"MoE": {"triton (graph)"}}


def test_kernel_list_splits_a_symbol_by_its_launch_grids():
    """--kernels: a symbol launched with a few grids in a phase (one Triton GEMM kernel as QKV, O and
    router) gets a line per grid under its own; a symbol of one grid, or of more than MAX_GRIDS
    (prefill steps of many token counts), keeps its one line."""
    def k(name, ts, dur, grid):
        e = _x("kernel", name, ts, dur)
        e["args"] = {"grid": grid}
        return e

    ev = [_x("user_annotation", "opmap::step::decode", 0, 1000)]
    t = 10
    for _ in range(2):  # two layers: QKV, O, router GEMMs, one norm grid
        for grid, dur in (([80, 1, 1], 9), ([32, 1, 4], 8), ([2, 1, 2], 4)):
            ev.append(k("_gemm_kernel", t, dur, grid))
            t += dur + 1
        ev.append(k("_rmsnorm_kernel", t, 2, [1, 1, 1]))
        t += 3
    ev.append(_x("user_annotation", "opmap::step::prefill", 2000, 1000))
    for i in range(engine_view.MAX_GRIDS + 1):
        ev.append(k("_prefill_tma_kernel", 2010 + 20 * i, 10, [i + 1, 8, 1]))
    lines = P.format_kernels(P.analyse({"traceEvents": ev}), 10)
    grid_lines = [x for x in lines if "grid [" in x]
    assert len(grid_lines) == 3, lines
    assert any("18.0 us/step" in x and "2.0 launches/step" in x and "grid [80, 1, 1]" in x for x in grid_lines)
    assert any("grid [2, 1, 2]" in x and "4.00 us each" in x for x in grid_lines)
    assert not any("_rmsnorm" in x or "[1, 8, 1]" in x for x in grid_lines)
