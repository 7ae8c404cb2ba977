"""The end-to-end benchmark's engine side on the CPU with a tiny preset: the records carry the
fields the result files promise (TTFT, TPOT, floor, host ms per step), and the structured-output
case runs with and without the grammar-fill overlap. Timings here mean nothing (CPU, reference
ops); the GPU run is what is reported."""
import pytest

from opmap.harness.bench.cases import e2e

from test_engine_util import single_thread  # noqa: F401


class _Ceil:
    read_tbps = 4.0


def test_engine_cases_records_and_grammar_overlap_variants(single_thread):
    pytest.importorskip("xgrammar")
    from opmap.engine.llm import LLM
    from opmap.model.presets import get_preset

    model = "tiny-llama3"
    with LLM(model, max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=256) as llm:
        out, skipped = [], []
        e2e._engine_cases(llm, model, get_preset(model), [(model, 1, 20, 6), (model, "json32", 12, 5)], _Ceil(),
                          out, skipped)
        assert llm.ecfg.overlap_grammar  # restored after the serial variant
    assert not skipped, skipped
    b1, js, serial = out
    assert b1["case"].startswith(f"model={model},B=1") and b1["tpot_ms"] > 0 and b1["weight_floor_ms"] > 0
    assert set(b1["host_ms"]["decode"]) >= {"forward", "sample", "wait"} and b1["steps"]["decode"] == 5
    assert len(b1["runs"]) == e2e.REPS_B1 and b1["tpot_ms"] in [r["tpot_ms"] for r in b1["runs"]]
    assert sorted(r["tpot_ms"] for r in b1["runs"])[e2e.REPS_B1 // 2] == b1["tpot_ms"]  # the median run
    assert js["provider"] == "opmap-engine" and serial["provider"] == "opmap-engine[serial grammar fill]"
    for r in (js, serial):
        assert r["structured_overhead"] is not None and r["host_ms"]["decode"]["grammar"] > 0
        assert "first constrained request (warm-up, untimed)" in r["note"]  # one-time costs kept out


def test_kv_bytes_and_step_floor_figures(monkeypatch):
    """Llama-3-8B at B=32, prompt 512, 128 new tokens: 32 x 576 x 32 layers x (2 x 8 x 128) x 2 B
    = 2.42 GB of KV per decode step; MLA counts the latent and RoPE key."""
    from opmap.harness.bench.cases import e2e
    from opmap.model.presets import get_preset

    assert abs(e2e.kv_bytes_per_step(get_preset("llama3-8b"), 32, 512, 128) - 2.416e9) < 1e7
    ds = get_preset("deepseek-v2-lite")
    assert e2e.kv_bytes_per_step(ds, 1, 100, 0) == 100 * ds.layers * (512 + 64) * 2

    from opmap.engine.config import EngineConfig

    class _L:
        class ecfg:
            async_decode = True
            prefill_graph_tokens = EngineConfig.prefill_graph_tokens
            max_prefill_tokens_with_decodes = None

    monkeypatch.delenv("OPMAP_PDL", raising=False)
    assert e2e._engine_name(_L) == "opmap-engine"
    monkeypatch.setenv("OPMAP_PDL", "0")
    assert e2e._engine_name(_L) == "opmap-engine[no-pdl]"
    monkeypatch.delenv("OPMAP_PDL")
    _L.ecfg.prefill_graph_tokens = 4096  # a non-default prefill graph limit names its rows
    assert e2e._engine_name(_L) == "opmap-engine[prefill-graphs=4096]"
    _L.ecfg.max_prefill_tokens_with_decodes = 512  # and a cap on prompt tokens beside decodes
    assert e2e._engine_name(_L) == "opmap-engine[prefill-graphs=4096,prefill-cap=512]"
    _L.e2e_settings = {"fuse_gated": False}  # an EngineConfig field set with --engine
    assert e2e._engine_name(_L) == "opmap-engine[prefill-graphs=4096,prefill-cap=512,fuse_gated=false]"


def test_engine_settings_parse_into_engine_config_fields():
    import argparse

    from opmap.harness.bench.cases import e2e

    assert e2e.engine_setting("fuse_gated=false") == ("fuse_gated", False)
    assert e2e.engine_setting("max_num_batched_tokens=4096") == ("max_num_batched_tokens", 4096)
    assert e2e.engine_setting("gpu_memory_fraction=0.5") == ("gpu_memory_fraction", 0.5)
    assert e2e.engine_setting("kv_cache_dtype=fp8") == ("kv_cache_dtype", "fp8")
    assert e2e.engine_setting("page_size=none") == ("page_size", None)
    for bad in ("fuse_gatd=false", "fuse_gated"):
        with pytest.raises(argparse.ArgumentTypeError, match="EngineConfig field .*fuse_gated"):
            e2e.engine_setting(bad)


def test_quantised_engine_cases_and_floor(single_thread):
    """A "<preset>:fp8" case runs the engine with weight-only fp8 (its floor counts the quantised
    projections as stored: a byte a weight and its scales); HF says it runs only the unquantised model."""
    from opmap.engine.llm import LLM
    from opmap.model.presets import get_preset

    assert e2e.split_model("llama3-8b:fp8") == ("llama3-8b", "fp8", None)
    assert e2e.split_model("llama3-8b:fp8+fp8kv") == ("llama3-8b", "fp8", "fp8")
    assert e2e.split_model("tiny-llama3") == ("tiny-llama3", None, None)
    c = get_preset("llama3-8b")
    q = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)  # QKV, O, gate/up and down of 32 layers
    assert c.quantised_params() == q
    assert c.decode_weight_bytes(1, quantised=True) == c.decode_weight_bytes(1) - q
    assert c.decode_weight_bytes(1, quantised=True, lm_head=True) == c.decode_weight_bytes(1) - q - 128256 * 4096
    model = "tiny-llama3:int8"
    with LLM("tiny-llama3", max_num_seqs=4, max_model_len=256, quantize="int8") as llm:
        out, skipped = [], []
        e2e._engine_cases(llm, model, get_preset("tiny-llama3"), [(model, 1, 20, 6)], _Ceil(), out, skipped)
    t = get_preset("tiny-llama3")
    # --quantize took the (untied) LM head too; the int8 weights and their fp32 scale per row as stored
    per = llm.runner.quantised_bytes
    assert per == pytest.approx(1 + 4 / 64, rel=0.05)  # K = 64 or 128: one scale a row
    assert out[0]["weight_floor_ms"] == t.decode_weight_bytes(1, quantised=True, lm_head=True,
                                                              bytes_per_quantised=per) / 4e12 * 1e3
    skipped = []
    e2e._hf(model, [(model, 1, 20, 6)], _Ceil(), [], skipped)
    assert skipped and "unquantised" in skipped[0]["reason"]


@pytest.mark.parametrize("model,compile", [("tiny-llama3", False), ("tiny-llama3", True), ("tiny-deepseek", False)])
def test_hf_static_greedy_loop_matches_generate(model, compile):
    """The static-cache peer's own greedy loop gives HF generate's tokens, twice from one cache
    (reset between runs); compiled, its decode step is one graph (fullgraph=True: Inductor's CPU
    kernels here, where mode="reduce-overhead" has no CUDA graphs to capture). DeepSeek's keys and
    values differ in head dim (the cache sizes them at the prefill)."""
    import torch

    from opmap.harness.bench.cases.hf_static import StaticGreedy
    from opmap.model.hf import make_hf_model
    from opmap.model.presets import get_preset

    cfg = get_preset(model)
    hf = make_hf_model(cfg, seed=1).eval()
    ids = torch.randint(0, cfg.vocab, (3, 17), generator=torch.Generator().manual_seed(0))
    run = StaticGreedy(hf, 3, 17 + 8, compile=compile)
    toks, prefill_s, decode_s = run.generate(ids, 8)
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)[:, 17:]
    assert toks.tolist() == ref.tolist() and prefill_s > 0 and decode_s > 0
    assert torch.equal(run.generate(ids, 8)[0], toks)


def test_records_are_handed_over_after_each_provider(monkeypatch):
    """A run cut off by a time limit keeps what it finished: ``done`` sees the records after every
    provider of a model, and a provider that fails leaves a skipped line, not a lost model."""
    import torch

    from opmap.core import hw

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hw, "ceilings", lambda measure=True: _Ceil())

    def side(name, fail=False):
        def run(model, cases, ceil, out, skipped, **kw):
            if fail:
                raise RuntimeError("compile failed")
            out.append({"model": model, "provider": name})
        return run

    monkeypatch.setattr(e2e, "_engine", side("opmap-engine"))
    monkeypatch.setattr(e2e, "_hf", side("hf-transformers-eager"))
    monkeypatch.setattr(e2e, "_hf_static", side("hf-transformers-static-compile", fail=True))
    seen = []
    out, skipped = e2e.records(quick=True, progress=False, models=["llama3-8b"], kinds=["1"],
                               done=lambda o, s: seen.append((len(o), len(s))))
    assert seen[:3] == [(1, 0), (2, 0), (2, 1)]
    assert "compile failed" in skipped[0]["reason"] and skipped[0]["provider"] == "hf-transformers-static-compile"


def test_step_budget_prefills_a_batch_case_in_one_step():
    # Every batch case's prompts fit one prefill step (as HF's one forward over the batch), so the
    # engine's TPOT counts decode steps only; B=1 cases and the workload keep the 4096 floor.
    llama = [c for c in e2e.FULL if c[0] == "llama3-8b"]
    assert e2e.step_budget(llama) == 128 * 512
    assert e2e.step_budget([("x", 32, 512, 128), ("x", 1, 1024, 128)]) == 32 * 512
    assert e2e.step_budget([("x", 1, 1024, 128), ("x", "workload", None, None)]) == 4096


def test_a_failed_request_fails_the_side_with_its_error():
    from types import SimpleNamespace as NS

    class Fake:
        def generate(self, prompts, params):
            return [NS(error=None), NS(error="the sequence needs 9 KV pages, the cache has 8")]

    with pytest.raises(RuntimeError, match=r"1 of 2 requests failed; the first: the sequence needs 9 KV pages"):
        e2e._run(Fake(), [[1], [2]], None)


def test_models_run_in_children_and_a_dead_child_keeps_its_rows(monkeypatch):
    """``records(isolate=True)`` hands each model to a child process with the run's options; the
    rows a child wrote before it died are kept beside a line naming its exit status."""
    import json

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls, seen = [], []

    def call(cmd):
        calls.append(cmd)
        path, model = cmd[cmd.index("--child") + 1], cmd[cmd.index("--model") + 1]
        with open(path, "w") as f:
            json.dump({"results": [{"model": model}], "skipped": []}, f)
        return 0 if model == "llama3-8b" else -9

    monkeypatch.setattr(e2e.subprocess, "call", call)
    out, skipped = e2e.records(quick=False, models=["llama3-8b", "deepseek-v2-lite"], kinds=["1", "32"], hf=False,
                               prefill_graph_tokens=1024, isolate=True, done=lambda o, s: seen.append((len(o), len(s))),
                               engine_kw={"fuse_gated": False})
    assert [c[c.index("--model") + 1] for c in calls] == ["llama3-8b", "deepseek-v2-lite"]
    assert calls[0][calls[0].index("--model") + 2:] == ["--case", "1", "--case", "32", "--no-hf",
                                                         "--prefill-graph-tokens", "1024", "--engine", "fuse_gated=false"]
    assert out == [{"model": "llama3-8b"}, {"model": "deepseek-v2-lite"}] and seen == [(1, 0), (2, 1)]
    assert skipped[0]["case"] == "model=deepseek-v2-lite" and "status -9" in skipped[0]["reason"]


def test_a_child_run_writes_its_part_file(tmp_path):
    """The real command line of a child, on this CPU machine: its part file says why nothing ran."""
    import json
    import subprocess
    import sys

    part = tmp_path / "part.json"
    rc = subprocess.call([sys.executable, "-m", "opmap.harness.bench.cases.e2e", "--child", str(part), "--model", "llama3-8b",
                          "--case", "1", "--no-hf"])
    doc = json.loads(part.read_text())
    assert rc == 0 and doc["results"] == [] and doc["skipped"][0]["reason"] == "needs a CUDA GPU"


def test_keep_others_keeps_unmeasured_rows_noted_with_their_commit(tmp_path):
    """--keep-others: rows of the existing baseline that this run did not measure stay, noted with
    the commit that measured them; a row measured again is replaced; a kept row is not re-noted."""
    import json

    from opmap.harness.output import baseline_dir

    env = {"gpu": "NVIDIA H200", "commit": "new"}
    old = {"environment": {"gpu": "NVIDIA H200", "commit": "abc1234"},
           "results": [{"case": "a", "provider": "opmap-engine", "note": "x"},
                       {"case": "b", "provider": "hf", "note": ""},
                       {"case": "c", "provider": "hf", "note": "y; measured at commit 0000000",
                        "measured_at": "0000000"}]}
    (baseline_dir(str(tmp_path), env["gpu"]) / "e2e.json").write_text(json.dumps(old))
    kept = e2e.kept_rows(str(tmp_path), env, [{"case": "a", "provider": "opmap-engine"}])
    assert [(r["case"], r["note"], r["measured_at"]) for r in kept] == [
        ("b", "measured at commit abc1234", "abc1234"), ("c", "y; measured at commit 0000000", "0000000")]
    assert e2e.kept_rows(str(tmp_path / "none"), env, []) == []
