"""One step map (opmap.model.step): the rows `opmap report` prints are the calls the engine makes.

For every preset and phase the report's rows (label, op, entry, spec, backend) are compared with the
engine's op sets: on the CPU the real engine of each tiny preset (its runner's op sets and sampler,
and the operator ranges it records while it generates); for the full presets the op sets the runner
builds on sm90, planned from this CPU (selection without runtime availability, as the report plans).
"""
import dataclasses
import importlib.util

import pytest
import torch

from opmap.engine.config import EngineConfig
from opmap.engine.llm import LLM
from opmap.engine.opset import OpSet, engine_settings, planned_maps
from opmap.engine.params import SamplingParams
from opmap.engine.sampler import Sampler
from opmap.core.select import BackendError
from opmap.harness import report
from opmap.model.presets import PRESETS

from test_engine_util import single_thread  # noqa: F401

TINY = sorted(n for n in PRESETS if n.startswith("tiny-"))
FULL = sorted(n for n in PRESETS if not n.startswith("tiny-"))
PHASES = ("prefill", "decode", "mixed")


def report_rows(doc: dict, phase: str) -> list:
    return [(r["label"], r["op"], r["entry"], r["spec"], r["backend"]) for r in doc["operators"][phase]]


def opset_rows(ops) -> list:
    return [(label, c.op, entry, c.spec.describe(), c.backend.name) for label, entry, c in ops.choices]


def sampler_rows(sampler) -> list:
    return [(c.op, entry, c.spec.describe(), c.backend.name) for entry, c in sampler.choices]


def assert_same(doc: dict, forward: dict, sampler) -> None:
    """The report's rows per phase against the engine's op set of that phase (``forward``) and, at
    decode, its sampler after it."""
    assert set(doc["operators"]) == set(PHASES)
    for ph in PHASES:
        rows, want = report_rows(doc, ph), opset_rows(forward[ph])
        assert rows[:len(want)] == want, ph
        tail = [row[1:] for row in rows[len(want):]]
        assert tail == (sampler_rows(sampler) if ph == "decode" else []), ph


@pytest.mark.parametrize("name", TINY)
def test_report_rows_are_the_cpu_engines_op_sets(name, single_thread):
    llm = LLM(name, max_num_seqs=4, max_num_batched_tokens=64)
    r = llm.runner
    doc = report.build(name, run_check=False, run_bench=False, progress=False)
    assert doc["arch"] == "cpu" and not doc["planned"]
    assert_same(doc, {"prefill": r.ops["prefill"], "mixed": r.ops["mixed"], "decode": r.decode_ops[1]}, llm.sampler)
    # the other decode buckets differ from bucket 1 in their rows only
    first = [row[:3] + row[4:] for row in opset_rows(r.decode_ops[1])]
    for b, ops in r.decode_ops.items():
        assert [row[:3] + row[4:] for row in opset_rows(ops)] == first
        assert all(c.spec.m == b for _, _, c in ops.choices if c.op == "gemm")
    llm.close()


def _traced_calls(llm, prompts, params) -> set:
    """(op, label, backend) of every operator range the engine recorded while generating."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outs = llm.generate(prompts, params)
    assert all(o.error is None for o in outs)
    names = {e.name for e in prof.events() if e.name.startswith("opmap::")}
    return {tuple(n.split("::")[1:]) for n in names if n.count("::") == 3}


@pytest.mark.parametrize("name", TINY)
def test_the_engine_calls_exactly_the_report_rows(name, single_thread):
    """The operator ranges (EngineConfig.trace_ops) of a run with prefill, mixed and decode steps,
    penalties, logprobs and (where XGrammar is installed) a grammar: each names a row of the report
    and each row is called."""
    llm = LLM(name, max_num_seqs=4, max_num_batched_tokens=32, trace_ops=True)
    doc = report.build(name, run_check=False, run_bench=False, progress=False)
    rows = {(r["op"], r["label"], r["backend"]) for rows in doc["operators"].values() for r in rows}
    grammar = importlib.util.find_spec("xgrammar") is not None
    if not grammar:  # the bitmask launches only for a request under a grammar
        rows = {r for r in rows if r[0] != "grammar_mask"}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, PRESETS[name].vocab, (n,), generator=g).tolist() for n in (5, 50)]
    params = [SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.2, logprobs=2),
              SamplingParams(max_tokens=4, temperature=0.7, seed=1, top_k=5, top_p=0.9)]
    calls = _traced_calls(llm, prompts, params)
    if grammar:
        calls |= _traced_calls(llm, ["a"], SamplingParams(max_tokens=3, temperature=0.0, regex="(yes|no)!"))
    assert calls == rows
    llm.close()


def _planned_opsets(cfg, arch: str) -> tuple:
    """The op sets and sampler ModelRunner builds for ``cfg`` on ``arch`` with the default
    EngineConfig (decode at its first bucket; eager where no backend can be captured)."""
    ecfg = EngineConfig()
    st = engine_settings(cfg, ecfg, arch)
    out = {ph: OpSet(cfg, ph, st) for ph in ("prefill", "mixed")}
    try:
        out["decode"] = OpSet(cfg, "decode", dataclasses.replace(st, cuda_graph=True, m=1))
    except BackendError:
        out["decode"] = OpSet(cfg, "decode", dataclasses.replace(st, m=1))
    return out, Sampler(cfg.vocab, "cpu", arch)


@pytest.mark.parametrize("name", FULL)
def test_planned_report_rows_are_the_sm90_op_sets(name):
    doc = report.build(name, run_check=False, run_bench=False, progress=False, arch="sm90")
    assert doc["planned"]
    forward, sampler = _planned_opsets(PRESETS[name], "sm90")
    assert_same(doc, forward, sampler)


def _labels(maps: dict, phase: str = "decode") -> list:
    return [r.label for r in maps[phase]]


def _spec(maps: dict, key: str, phase: str = "decode"):
    return next(r.spec for r in maps[phase] if r.key == key)


def test_gemma_runs_gelu_tanh_with_soft_cap_and_windows():
    for name in ("gemma2-9b", "tiny-gemma2", "gemma3-4b"):
        cfg = PRESETS[name]
        maps = planned_maps(cfg, "sm90", EngineConfig(fuse_gated=False))  # the activation's own row
        for ph in PHASES:
            assert "GELU-tanh * mul" in _labels(maps, ph) and "SiLU * mul" not in _labels(maps, ph)
            assert _spec(maps, "act", ph).kind == "gelu_tanh_mul"
            att = _spec(maps, "attention", ph)
            assert att.sliding_window and att.soft_cap == bool(cfg.attn_soft_cap)
    assert _spec(planned_maps(PRESETS["gemma2-9b"], "sm90"), "attention").soft_cap


def test_sliding_windows_are_in_the_attention_spec():
    for name in ("mistral-7b", "tiny-mistral", "phi3-mini", "gemma2-9b", "gemma3-4b", "llama3-8b", "qwen3-8b"):
        cfg = PRESETS[name]
        for arch in ("sm90", "cpu"):
            maps = planned_maps(cfg, arch)
            assert all(_spec(maps, "attention", ph).sliding_window == bool(cfg.sliding_window) for ph in PHASES), name


def test_deepseek_v3_projects_q_through_its_lora_rank():
    maps = planned_maps(PRESETS["deepseek-v3"], "sm90")
    for ph in PHASES:
        labels = _labels(maps, ph)
        i = labels.index("q_a proj")
        assert labels[i:i + 3] == ["q_a proj", "q_a norm", "q_b proj"] and "q proj" not in labels
        assert _spec(maps, "q_a_norm", ph).hidden == 1536 and _spec(maps, "q_b", ph).k == 1536
    # V2-Lite has no q LoRA: one q proj
    lite = _labels(planned_maps(PRESETS["deepseek-v2-lite"], "sm90"))
    assert "q proj" in lite and "q_a proj" not in lite


def test_qwen3_qk_norm_rides_in_the_fused_launch_or_runs_on_its_own():
    for name, arch in (("qwen3-8b", "sm90"), ("qwen3-30b-a3b", "sm90"), ("tiny-qwen3", "cpu")):
        cfg = PRESETS[name]
        fused = planned_maps(cfg, arch)["decode"]
        row = next(r for r in fused if r.key == "rope_append")
        assert row.label == "q/k norm + RoPE + KV append (one launch)" and row.entry == "rope_append"
        assert [f.key for f in row.folded] == ["qk_norm", "rope", "kv_append"]
        assert not {"qk_norm", "rope", "kv_append"} & {r.key for r in fused}
        apart = planned_maps(cfg, arch, EngineConfig(fuse_rope_append=False))["decode"]
        keys = [r.key for r in apart]
        assert keys[keys.index("qkv") + 1:keys.index("attention")] == ["qk_norm", "rope", "kv_append"]
        assert next(r for r in apart if r.key == "qk_norm").entry == "qk_rmsnorm"
    # a forced q/k norm backend other than the append's keeps the norm as its own launch
    maps = planned_maps(PRESETS["qwen3-8b"], "sm90", EngineConfig(backends={"rmsnorm": "reference"}))
    assert [r.label for r in maps["decode"]][2:4] == ["q/k norm", "RoPE + KV append (one launch)"]


def test_mla_latent_norm_rope_and_append_in_one_launch_where_one_provider_serves_them():
    for name, arch in (("deepseek-v2-lite", "sm90"), ("deepseek-v3", "sm90"), ("tiny-deepseek", "cpu")):
        cfg = PRESETS[name]
        for ph, rows in planned_maps(cfg, arch).items():
            row = next(r for r in rows if r.key == "norm_rope_append")
            # on the CPU the three chose the references, whose entry composes the reference ops
            assert row.entry == "norm_rope_append_mla"
            assert row.backend.name == ("mla-triton" if arch == "sm90" else "mla-reference")
            assert [f.key for f in row.folded] == ["latent_norm", "rope", "kv_append"]
            assert not {"latent_norm", "rope", "kv_append"} & {r.key for r in rows}
            keys = [r.key for r in rows]
            assert keys.index("kv_a") < keys.index("norm_rope_append") < keys.index("attention")
        apart = [r.key for r in planned_maps(cfg, arch, EngineConfig(fuse_rope_append=False))["decode"]]
        assert apart[apart.index("kv_a") + 1:apart.index("attention")] == ["latent_norm", "rope", "kv_append"]
    # a norm the fused entry does not reproduce keeps the three launches apart: the reference beside
    # the Triton append, torch's rms_norm beside the reference append (the same provider, another rounding)
    maps = planned_maps(PRESETS["deepseek-v2-lite"], "sm90", EngineConfig(backends={"rmsnorm": "reference"}))
    assert "norm_rope_append" not in [r.key for r in maps["decode"]]
    maps = planned_maps(PRESETS["tiny-deepseek"], "cpu", EngineConfig(backends={"rmsnorm": "torch-rms_norm"}))
    keys = [r.key for r in maps["decode"]]
    assert "norm_rope_append" not in keys and "latent_norm" in keys
    assert next(r for r in maps["decode"] if r.key == "latent_norm").backend.name == "torch-rms_norm"
    assert all("norm_rope_append" not in [r.key for r in rows] for rows in planned_maps(PRESETS["llama3-8b"], "sm90").values())


def test_moe_rows_router_and_shared_experts():
    for name, cfg in PRESETS.items():
        if not cfg.is_moe:
            continue
        for arch in ("sm90", "cpu"):
            # each GEMM and activation its own row
            maps = planned_maps(cfg, arch, EngineConfig(fuse_gated=False, fuse_shared_add=False))
            for ph in PHASES:
                keys = [r.key for r in maps[ph]]
                assert keys[keys.index("router") + 1] == "moe" and _spec(maps, "router", ph).n == cfg.num_experts
                shared = ["shared_gate_up", "shared_act", "shared_down"] + (["shared_gate"] if cfg.shared_gate else [])
                assert keys[keys.index("moe") + 1:keys.index("lm_head")] == (shared if cfg.shared_experts else [])
                if cfg.shared_experts:
                    assert _spec(maps, "shared_gate_up", ph).n == 2 * cfg.shared_width
                # a model with dense first layers runs their MLP before its MoE layers
                assert ("gate_up" in keys) == bool(cfg.first_dense_layers)
                assert "gate_up" not in keys or keys.index("gate_up") < keys.index("router")


def test_shared_down_takes_the_routed_sum_where_its_backend_can():
    """fuse_shared_add: a shared expert's down GEMM sums the routed experts' output (linear_add) on
    every backend that has the entry (cuBLAS's addmm, the Triton epilogue, the reference), the plain
    row folded into it; not where a sigmoid gate scales the shared output (Qwen2-MoE), not when off,
    not for a model without shared experts."""
    for name, cfg in PRESETS.items():
        if not cfg.is_moe:
            continue
        for arch in ("sm90", "cpu"):
            on, off = planned_maps(cfg, arch), planned_maps(cfg, arch, EngineConfig(fuse_shared_add=False))
            for ph in PHASES:
                keys = [r.key for r in on[ph]]
                assert "shared_down_add" not in [r.key for r in off[ph]]
                if not cfg.shared_experts or cfg.shared_gate:
                    assert "shared_down_add" not in keys and ("shared_down" in keys) == bool(cfg.shared_experts)
                    continue
                row = next(r for r in on[ph] if r.key == "shared_down_add")
                assert "shared_down" not in keys and row.entry == "linear_add" and row.folded[0].key == "shared_down"
                assert "linear_add" in row.backend.impl and row.label.endswith("(one launch)"), row.label
                assert keys.index("moe") < keys.index("shared_down_add") < keys.index("lm_head")


def test_quantised_checkpoint_weights_and_lm_head_rows():
    """A checkpoint stored in fp8 (config.json's quantization): its projections' GEMMs are fp8 rows;
    --quantize also takes an untied LM head; the router and shared experts stay in the dtype."""
    cfg = dataclasses.replace(PRESETS["qwen1.5-moe-a2.7b"], extra={"weight_quant": {"format": "fp8"}})
    dec = planned_maps(cfg, "sm90")["decode"]
    fp8 = {r.key for r in dec if r.op == "gemm" and r.spec.weight_dtype == "fp8"}
    assert fp8 == {"qkv", "o"}
    dec = planned_maps(PRESETS["llama3-8b"], "sm90", EngineConfig(quantize="int8"))["decode"]
    assert {r.key for r in dec if r.op == "gemm" and r.spec.weight_dtype == "int8"} == {"qkv", "o", "gate_up",
                                                                                        "down", "lm_head"}
    tied = planned_maps(PRESETS["gemma2-9b"], "sm90", EngineConfig(quantize="int8"))["decode"]
    assert next(r for r in tied if r.key == "lm_head").spec.weight_dtype == "bf16"  # the embedding table


def test_lm_head_rows_and_capture_follow_the_engine():
    """Decode at the first batch bucket (one row) under a CUDA graph on a GPU; prefill and mixed
    eager at any row count (their LM head runs on the sampled rows); the CPU eager, in fp32."""
    for arch, dtype, graph in (("sm90", "bf16", True), ("cpu", "fp32", False)):
        maps = planned_maps(PRESETS["llama3-8b"], arch)
        assert _spec(maps, "lm_head", "decode").m == 1 and _spec(maps, "attention", "decode").cuda_graph == graph
        for ph in ("prefill", "mixed"):
            assert _spec(maps, "lm_head", ph).m is None and not _spec(maps, "attention", ph).cuda_graph
        assert {r.spec.dtype for rows in maps.values() for r in rows if r.op == "gemm"} == {dtype}
    eager = planned_maps(PRESETS["llama3-8b"], "sm90", EngineConfig(enforce_eager=True))
    assert not _spec(eager, "attention").cuda_graph


def test_decode_without_a_capturable_backend_is_planned_eager():
    """Phi-3's head dim 96: no attention backend can be captured at decode, so the runner's decode
    runs eagerly (ModelRunner) and the planned map says so instead of listing no backend."""
    maps = planned_maps(PRESETS["phi3-mini"], "sm90")
    assert not _spec(maps, "attention").cuda_graph and all(r.error is None for r in maps["decode"])


def test_gate_up_and_its_activation_in_one_launch_where_the_gemm_has_the_gated_entry():
    """The decode GEMM backends (triton-decode, triton-wo) and the reference carry linear_act: the
    gate/up row takes the activation where the activation chose the backend it reproduces; prefill's
    cuBLAS, the Gluon weight-only kernels and int4's kernel have no such entry, so two launches stay."""
    for name, arch, act in (("llama3-8b", "sm90", "SiLU * mul"), ("gemma2-9b", "sm90", "GELU-tanh * mul"),
                            ("tiny-llama3", "cpu", "SiLU * mul"), ("qwen3-30b-a3b", "sm90", None)):
        cfg = PRESETS[name]
        maps = planned_maps(cfg, arch)
        for ph, rows in maps.items():
            keys = [r.key for r in rows]
            if act is None:  # an MoE model without dense layers or shared experts: nothing to fuse
                assert not {"gate_up_act", "act", "shared_gate_up_act", "shared_act"} & set(keys)
                continue
            fused = ph == "decode" or arch == "cpu"  # sm90 prefill and mixed steps run cuBLAS
            assert ("gate_up_act" in keys) == fused and ("act" in keys) != fused, (name, ph)
            if fused:
                row = next(r for r in rows if r.key == "gate_up_act")
                assert (row.op, row.entry, row.label) == ("gemm", "linear_act", f"gate/up proj + {act} (one launch)")
                assert [f.key for f in row.folded] == ["gate_up", "act"]
                assert row.backend.name == ("triton-decode" if arch == "sm90" else "reference")
                assert keys.index("gate_up_act") + 1 == keys.index("down")
        apart = [r.key for r in planned_maps(cfg, arch, EngineConfig(fuse_gated=False))["decode"]]
        assert "gate_up_act" not in apart and (act is None or apart[apart.index("gate_up"):][:3] == ["gate_up", "act", "down"])
    # the shared expert's gate/up and SiLU likewise (DeepSeek-V2-Lite: after its dense first layer's)
    for name, arch in (("deepseek-v2-lite", "sm90"), ("qwen1.5-moe-a2.7b", "sm90"), ("tiny-qwen2moe", "cpu")):
        cfg = PRESETS[name]
        keys = [r.key for r in planned_maps(cfg, arch)["decode"]]
        assert "shared_gate_up_act" in keys and not {"shared_gate_up", "shared_act"} & set(keys)
        down = "shared_down" if cfg.shared_gate else "shared_down_add"  # the gated shared output keeps its add
        assert keys.index("shared_gate_up_act") + 1 == keys.index(down)
        assert ("gate_up_act" in keys) == bool(cfg.first_dense_layers)
        apart = [r.key for r in planned_maps(cfg, arch, EngineConfig(fuse_gated=False))["decode"]]
        assert "shared_gate_up_act" not in apart and "shared_act" in apart
    # an activation the epilogue does not reproduce (torch-eager rounds elsewhere) keeps its launch
    maps = planned_maps(PRESETS["llama3-8b"], "sm90", EngineConfig(backends={"activation": "torch-eager"}))
    assert "gate_up_act" not in [r.key for r in maps["decode"]]
    # weights whose decode kernel has no gated entry: fp8 on the Gluon kernel, int4 on triton-w4a16
    for fmt in ("fp8", "int4"):
        keys = [r.key for r in planned_maps(PRESETS["llama3-8b"], "sm90", EngineConfig(quantize=fmt))["decode"]]
        assert "gate_up_act" not in keys and "act" in keys, fmt


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-gemma2", "tiny-qwen2moe"])
def test_the_gated_launch_gives_the_tokens_of_the_two(name, single_thread):
    """On the CPU the fused row is the reference's linear_act (the GEMM's and the activation's
    references composed): the same greedy tokens with the fusion and without, and the op set binds
    the model's activation (Gemma's GELU-tanh) to the fused callable."""
    cfg = PRESETS[name]
    toks = {}
    for fuse in (True, False):
        llm = LLM(cfg, max_num_batched_tokens=32, max_num_seqs=2, fuse_gated=fuse)
        for ops in [*llm.runner.ops.values(), *llm.runner.decode_ops.values()]:
            key, act = ("shared_gate_up_act", ops.shared_act) if cfg.is_moe else ("gate_up_act", ops.act)
            assert (key in ops.gemm) == fuse and (act is None) == fuse
            if fuse:
                assert ops.gemm[key].keywords == {"act": "gelu_tanh" if cfg.activation == "gelu_tanh" else "silu"}
        toks[fuse] = [o.token_ids for o in llm.generate([[1, 2, 3, 4, 5], [7, 8, 9]],
                                                        SamplingParams(max_tokens=4, temperature=0.0))]
        llm.close()
    assert toks[True] == toks[False]
