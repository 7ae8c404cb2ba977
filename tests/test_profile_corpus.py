"""`opmap profile --trace` on every real trace we have: the project's recordings (tests/data/traces)
and third-party traces of other engines (../shared/traces/ext, read from there: they are not ours
to redistribute; see its index.md). On each: at least 95% of the GPU time attributed, attention in
every phase of a model with attention, MoE in every phase of a MoE model, communication where
NCCL / DeepEP / an all-reduce kernel runs, and no diagnosis line without its evidence."""
import functools
from pathlib import Path

import pytest

from opmap.harness.profile import analyze
from opmap.harness.profile import steps
from opmap.harness.profile import trace

DATA = Path(__file__).parent / "data" / "traces"
EXT = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "ext"
ext = pytest.mark.skipif(not EXT.is_dir(), reason=f"the third-party traces are not in this checkout ({EXT})")

# name -> what the model runs: (attention, MoE, communication)
OURS = {"flashinfer-decode": (True, False, False), "hf-llama-compile": (True, False, False),
        "hf-llama-eager-stack": (True, False, False), "hf-llama-sdpa-shapes": (True, False, False),
        "hf-llama-sdpa-stack": (True, False, False), "hf-llama-sdpa": (True, False, False),
        "hf-mixtral-sdpa-stack": (True, True, False), "hf-mixtral-sdpa": (True, True, False),
        "hf-qwen3moe-sdpa-stack": (True, True, False), "opmap-deepseek": (True, True, False),
        "opmap-llama": (True, False, False), "hf-llama-flex": (True, False, False),
        "hf-llama-compile-static": (True, False, False), "hf-llama-sdpa-b4-sampled": (True, False, False),
        "hf-mixtral-sdpa-b4-sampled": (True, True, False), "hf-deepseekv2-eager-stack": (True, True, False),
        "hf-deepseekv2-sdpa": (True, True, False), "hf-gemma2-cpu": (True, False, False),
        "opmap-qwen3moe-b1-decode": (True, True, False), "hf-llama-cpu-calls": (True, False, False)}
# HF generate runs: one prefill step (the prompt) and the decode steps after it (hf-llama-cpu-calls
# holds three generate calls: tests/test_profile_trace.py)
HF_GENERATE = sorted(n for n in OURS if n.startswith("hf-") and n not in ("hf-llama-compile", "hf-llama-cpu-calls"))
THEIRS = {"traceMap__1_h100_1000isl_10osl_32con.pt.trace": (True, False, True),
          "TraceLens__eager_trace": (True, True, True),
          "TraceLens__Qwen_Qwen1.5-0.5B-Chat__1016005": (True, False, False),
          "deepseek-profile-data__train": (True, True, True)}


@functools.lru_cache(maxsize=None)  # each trace read once for all the tests that look at it (read-only)
def _res(path: Path) -> dict:
    return analyze.analyze(trace.load(str(path)))


def _check(res: dict, attention: bool, moe: bool, comm: bool) -> None:
    assert res["attributed"] >= 0.95, res["attributed"]
    for ph, p in res["phases"].items():
        cats = p["categories"]
        assert not attention or cats.get("attention", 0) > 0, (ph, cats)
        assert not moe or cats.get("MoE", 0) > 0, (ph, cats)
        assert not comm or cats.get("communication", 0) > 0, (ph, cats)
        assert comm or "communication" not in cats, (ph, cats)
    for d in res["diagnosis"]:  # each rule's line ends with its evidence; the unattributed note feeds none
        assert "[evidence: " in d or "feeds no diagnosis line" in d, d


def test_every_fixture_is_in_the_table():
    assert set(OURS) == {p.name[:-len(".json.gz")] for p in DATA.glob("*.json.gz")}


@pytest.mark.parametrize("name", sorted(OURS))
def test_our_recordings(name):
    _check(_res(DATA / f"{name}.json.gz"), *OURS[name])


@ext
def test_every_third_party_trace_is_in_the_table():
    assert set(THEIRS) == {p.name[:-len(".json.gz")] for p in EXT.glob("*.json.gz")}


@ext
@pytest.mark.parametrize("name", sorted(THEIRS))
def test_third_party_traces(name):
    _check(_res(EXT / f"{name}.json.gz"), *THEIRS[name])


@ext
def test_vllm_tp4_llama_with_cuda_graphs():
    """vLLM V1, TP 4, torch.compile with piecewise CUDA graphs: one prefill step and nine decode
    steps (execute_model ranges); FA3 attention eager between the replayed pieces, cuBLAS GEMMs,
    vLLM's custom all-reduce and NCCL; the KV write's fp8-capable template is no quantised path."""
    res = _res(EXT / "traceMap__1_h100_1000isl_10osl_32con.pt.trace.json.gz")
    assert {ph: p["steps"] for ph, p in res["phases"].items()} == {"prefill": 1, "decode": 9}
    dec = res["phases"]["decode"]
    assert dec["graph_ms"] > 0.5 * dec["gpu_ms"]  # the pieces replayed by cudaGraphLaunch
    assert list(dec["libraries"]["attention"])[0] == "FlashAttention"
    assert {"NCCL", "vLLM custom all-reduce"} <= set(res["backends"]["communication"])
    assert not any("fell back" in d for d in res["diagnosis"])
    assert not any("sorts the logits" in d for d in res["diagnosis"])


@ext
def test_vllm_gpt_oss_eager_prefill():
    """vLLM gpt-oss, TP 8, eager: the one step is a context (prefill) batch by its range name; its
    MoE runs TRT-LLM-gen's fp8 x fp4 batched GEMMs, so an activation quantiser and the fp8 KV write
    are no fallback; the all-reduces are PyTorch's symmetric-memory multimem kernels."""
    res = _res(EXT / "TraceLens__eager_trace.json.gz")
    assert list(res["phases"]) == ["prefill"] and res["phases"]["prefill"]["label_confidence"] == {"high": 1}
    p = res["phases"]["prefill"]
    assert next(iter(p["categories"])) == "MoE" and "TensorRT-LLM" in p["libraries"]["MoE"]
    assert p["lowp_steps"] == 1 and not p["fallbacks"]
    assert "PyTorch symmetric memory" in p["libraries"]["communication"]
    assert list(p["libraries"]["attention"])[0] == "TensorRT-LLM"
    assert not any("fell back" in d for d in res["diagnosis"])


@ext
def test_deepseek_dualpipe_training_chunk():
    """DeepSeek-V3 training (DualPipe, EP 64): DeepEP's dispatch / combine / notify are
    communication, overlapped with the other stream's compute: the backward's kernels, launched by
    autograd's thread outside the step range while it was open, are the step's too, and with them
    next to no communication time is exposed, so no layout diagnosis (DualPipe's point). The
    M-grouped fp8 GEMMs are MoE, the fp8 casts quantisation; no kernel of it is a sampler's."""
    t = trace.load(str(EXT / "deepseek-profile-data__train.json.gz"))
    res = analyze.analyze(t)
    p = next(iter(res["phases"].values()))
    assert res["backends"]["communication"] == ["DeepEP"] and "DeepSeek" in res["backends"]["MoE"]
    assert "sampling" not in p["categories"] and p["categories"]["quantise"] > 0
    assert sum(len(s["kernels"]) for s in steps.steps_of(t)) == len(t.kernels)
    assert p["comm_exposed_ms"] < 0.1 * p["comm_ms"]
    assert not any("communication takes" in d for d in res["diagnosis"])


@ext
def test_hf_qwen2_forward_with_frames():
    """HF transformers Qwen2 forward (one prefill) with module frames and shapes: SDPA's
    FlashAttention-2 kernel, GEMMs by their Linear modules, RMSNorm and RoPE by theirs, the
    MLP's act * up by its motif."""
    res = _res(EXT / "TraceLens__Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz")
    p = res["phases"]["prefill"]
    assert list(p["libraries"]["attention"])[0] == "PyTorch"  # pytorch_flash::flash_fwd_kernel
    assert {"GEMM", "norm", "RoPE", "attention", "activation"} <= set(p["categories"])
    assert p["evidence"]["GEMM"].get("range", 0) > 0.5 * p["categories"]["GEMM"]


@pytest.mark.parametrize("name", HF_GENERATE)
def test_hf_generate_has_one_prefill_then_decode(name):
    """The prompt's step is prefill and the five after it decode, on every HF generate recording:
    FlexAttention and the MoE decode paths included, whose prefill costs about what a decode step
    does (the LM head runs on the last token only), so the step's busy time cannot tell it; the
    grids of its per-layer kernels can (blocks over the prompt's rows). The CPU recording (host
    operators only, no device-to-host copy) ends its steps where the host reads the stop check's
    value (attribute.readback)."""
    res = _res(DATA / f"{name}.json.gz")
    assert {ph: p["steps"] for ph, p in res["phases"].items()} == {"prefill": 1, "decode": 5}


def test_flex_attention_named_in_both_phases():
    """FlexAttention's Inductor template kernels (triton_tem_fused_flex_attention_*) are attention
    in prefill and decode, and its block-mask construction (a sort) is no sampler: greedy run."""
    res = _res(DATA / "hf-llama-flex.json.gz")
    for ph in ("prefill", "decode"):
        assert res["phases"][ph]["categories"]["attention"] > 0
    flex = [c for k, c in _categories(DATA / "hf-llama-flex.json.gz") if "flex_attention" in k.name]
    assert flex and set(flex) == {"attention"}, set(flex)
    assert not any("sorts the logits" in d for d in res["diagnosis"])


def test_sampled_decoding_sorts_are_the_sampler():
    """Batch 4 with top-k / top-p (HF's sort-based warpers): the sampler-sort rule fires in every
    phase of the Llama and Mixtral runs, with its evidence; it stays silent on their greedy runs."""
    for name in ("hf-llama-sdpa-b4-sampled", "hf-mixtral-sdpa-b4-sampled"):
        res = _res(DATA / f"{name}.json.gz")
        for ph in ("prefill", "decode"):
            assert any(d.startswith(f"{ph}: sampling sorts the logits") and "[evidence: " in d
                       for d in res["diagnosis"]), (name, ph, res["diagnosis"])
    for name in ("hf-llama-sdpa", "hf-mixtral-sdpa", "hf-qwen3moe-sdpa-stack"):
        assert not any("sorts the logits" in d for d in _res(DATA / f"{name}.json.gz")["diagnosis"]), name


def test_hf_deepseek_v2_mla_and_moe():
    """DeepSeek-V2-Lite shapes in HF (eager MLA, 64 routed experts + 2 shared): MoE and attention
    in both phases, the eager attention's matmul -> softmax -> matmul found by its module frames
    (with_stack) and by its motif (SDPA run), the expert weights' gathers of the decode MoE path
    not taken for memory copies."""
    for name, evidence in (("hf-deepseekv2-eager-stack", "range"), ("hf-deepseekv2-sdpa", "motif")):
        res = _res(DATA / f"{name}.json.gz")
        for ph in ("prefill", "decode"):
            p = res["phases"][ph]
            assert p["categories"]["MoE"] > 0 and p["categories"]["attention"] > 0, (name, ph)

        assert res["phases"]["decode"]["evidence"]["MoE"].get(evidence, 0) > 0, name
        # the experts' weight gathers; the embedding lookup's one small gather is a memory copy
        gathers = [(k.dur, c) for k, c in _categories(DATA / f"{name}.json.gz") if "vectorized_gather" in k.name]
        moe = sum(d for d, c in gathers if c == "MoE")
        assert moe > 0.9 * sum(d for d, _ in gathers), (name, gathers)


def _categories(path: Path) -> list:
    """(kernel, category) of every kernel of the trace's steps."""
    from opmap.harness.profile import attribute
    from opmap.harness.profile.steps import steps_of

    out = []
    for st in steps_of(trace.load(str(path))):
        ks = sorted(st["kernels"], key=lambda k: k.ts)
        out += [(k, a.category) for k, a in zip(ks, attribute.step(ks))]
    return out


def test_compiled_generate_without_graphs_is_said():
    """generate with a static cache compiles the decode forward (reduce-overhead asked), but
    Inductor skipped its CUDA graphs on this run: the decode kernels are Inductor's, none replayed
    by cudaGraphLaunch, and the idle-GPU line says graphs were not captured. The vLLM trace above,
    whose pieces do replay, gets no such line."""
    res = _res(DATA / "hf-llama-compile-static.json.gz")
    dec = res["phases"]["decode"]
    assert dec["graph_ms"] == 0 and "Inductor" in dec["libraries"]["norm"]
    assert any(d.startswith("decode: the GPU is idle") and "CUDA graphs not captured" in d for d in res["diagnosis"])


def test_host_reads_end_steps_only_on_host_only_traces():
    """A host operator that reads a tensor's value (item(), bool(tensor)) is a readback only where
    the trace's "kernels" are host operators: GPU traces hold such operators too, but their steps
    are split at the device-to-host copies among their kernels, which these names never match."""
    from types import SimpleNamespace as K

    from opmap.harness.profile import attribute
    assert all(attribute.readback(K(name=n)) for n in ("aten::is_nonzero", "aten::item", "aten::_local_scalar_dense",
                                                       "Memcpy DtoH (Device -> Pinned)"))
    assert not any(attribute.readback(K(name=n)) for n in ("aten::argmax", "aten::copy_", "Memcpy HtoD (Pinned -> Device)"))
    gpu = trace.load(str(DATA / "hf-llama-sdpa.json.gz"))
    assert gpu.kind != "chrome-cpu" and not any(k.name in attribute._HOST_READS for k in gpu.kernels)
