"""`opmap profile --trace` on real traces recorded on the H200 (scripts/record_traces.py; the layer
shapes of Llama-3-8B, Mixtral-8x7B and Qwen3-30B-A3B cut to 2 layers, bf16): HF transformers
generate with SDPA and eager attention, with and without with_stack=True (and with record_shapes),
an HF forward under torch.compile, opmap's own engine (tiny dense and MLA presets), and a decode
loop written by hand around FlashInfer's paged decode.
What each must show is what an engineer reads off that run."""
import json
from pathlib import Path

import pytest

from opmap.cli import main as cli
from opmap.harness.profile import analyze
from opmap.harness.profile import trace

DATA = Path(__file__).parent / "data" / "traces"


def _res(name):
    return analyze.analyze(trace.load(str(DATA / f"{name}.json.gz")))


def _top(res, phase):
    return next(iter(res["phases"][phase]["categories"]))


@pytest.mark.parametrize("name", ["hf-llama-sdpa", "hf-llama-sdpa-shapes", "hf-llama-sdpa-stack", "hf-llama-eager-stack",
                                  "hf-mixtral-sdpa", "hf-mixtral-sdpa-stack", "hf-qwen3moe-sdpa-stack"])
def test_hf_generate_steps_and_phases(name):
    """generate(128-token prompt, 6 new tokens): one prefill forward and five decode forwards, split
    at the host's readbacks (HF emits no step range), told apart by their GPU time."""
    res = _res(name)
    assert res["steps"] == 6
    assert res["phases"]["prefill"]["steps"] == 1 and res["phases"]["decode"]["steps"] == 5
    assert res["phases"]["prefill"]["gpu_ms"] > res["phases"]["decode"]["gpu_ms"] / 5
    assert any("idle" in d and "host" in d for d in res["diagnosis"])  # a 2-layer model is host-bound


def test_hf_sdpa_attention_is_cudnn_and_modules_name_the_rest():
    plain, stack = _res("hf-llama-sdpa"), _res("hf-llama-sdpa-stack")
    for res in (plain, stack):
        assert res["backends"]["attention"][0] == "cuDNN"
        assert res["backends"]["GEMM"][0] == "cuBLAS"
    # without module frames the RMSNorm / RoPE elementwise kernels are named by the runs of ops that
    # spell them (symbols.json, motifs); with the frames, by their modules
    for res, how in ((plain, "motif"), (stack, "range")):
        cats = res["phases"]["decode"]["categories"]
        assert {"norm", "RoPE", "activation", "attention", "GEMM", "sampling"} <= set(cats)
        assert res["evidence"][how] > 0.1  # GEMMs (by their launcher) are most of the time at these shapes
    assert "range" not in plain["evidence"]


@pytest.mark.parametrize("name", sorted(p.name[:-len(".json.gz")] for p in DATA.glob("*.json.gz")))
def test_at_least_90_percent_is_named(name):
    assert _res(name)["unattributed"] <= 0.1


def test_flashinfer_decode_loop_without_ranges():
    """Four decode steps of a loop written by hand (projection, FlashInfer's paged decode through
    opmap's adapter, LM head, argmax, readback; no record_function range). The steps end at the
    token readbacks only (not at the readbacks of FlashInfer's plan or of a nonzero before it);
    FlashInfer's tensor-core decode launches its prefill kernel without a mask, which marks the
    steps as decode; the paged-KV metadata built with PyTorch ops before the plan (indptr,
    indices, last page lengths) is attention's, by the run of ops that spells it (symbols.json,
    motifs)."""
    res = _res("flashinfer-decode")
    assert res["steps"] == 4 and set(res["phases"]) == {"decode"}
    assert res["phases"]["decode"]["label_confidence"] == {"medium": 4}
    assert res["backends"]["attention"][0] == "FlashInfer" and res["backends"]["GEMM"] == ["cuBLAS"]
    top = [n for n, _ in res["phases"]["decode"]["top_kernels"]]
    assert any("flashinfer::BatchPrefillWithPagedKVCacheKernel" in n for n in top), top
    cats = res["phases"]["decode"]["categories"]
    assert list(cats)[:2] == ["GEMM", "attention"] and cats["attention"] > 0.3 * res["phases"]["decode"]["gpu_ms"]
    assert res["evidence"]["motif"] > 0.05  # the metadata kernels, named by their motif
    assert any("CUDA graphs not captured" in d for d in res["diagnosis"])


def test_hf_eager_attention_is_pytorch_kernels_inside_the_attention_module():
    """Unfused attention: the matmuls (cuBLAS) and the softmax (PyTorch) under eager_attention_forward
    are attention's, in both phases; the projections (Linear modules) stay GEMMs."""
    res = _res("hf-llama-eager-stack")
    assert set(res["backends"]["attention"]) == {"PyTorch", "cuBLAS"}
    for ph in ("prefill", "decode"):
        p = res["phases"][ph]
        assert p["categories"]["attention"] > 0 and "cuBLAS" in p["libraries"]["attention"]
        assert p["categories"]["GEMM"] > 2 * p["libraries"]["attention"]["cuBLAS"]


@pytest.mark.parametrize("name", ["hf-mixtral-sdpa-stack", "hf-mixtral-sdpa", "hf-qwen3moe-sdpa-stack"])
def test_hf_moe_is_the_largest_operator_of_prefill(name):
    """Mixtral's and Qwen3-MoE's MoE blocks, by their module frames or (without them) by the block
    between two norms that routes with a top-k and then multiplies; in decode, the experts' weight
    gathers (vectorized_gather_kernel) are the MoE's, not memory copies."""
    res = _res(name)
    assert _top(res, "prefill") == "MoE"
    dec = res["phases"]["decode"]
    assert dec["categories"]["MoE"] > 5 * dec["categories"].get("memory copies", 0.0)
    if name.startswith("hf-mixtral"):
        assert _top(res, "decode") == "MoE"
    else:  # Qwen3-MoE's 151936-token LM head is the larger GEMM at one token a step
        assert _top(res, "decode") == "GEMM" and dec["categories"]["MoE"] > 0.3 * dec["categories"]["GEMM"]


def test_torch_compile_kernels_are_inductor_and_cudnn():
    res = _res("hf-llama-compile")
    assert res["unattributed"] < 0.05
    assert "Inductor" in res["backends"]["norm"] and "Inductor" in res["backends"]["RoPE"]
    assert res["backends"]["attention"][0] == "cuDNN"  # and the Memset its launch makes


@pytest.mark.parametrize("name,attn", [("opmap-llama", "_decode_kernel"), ("opmap-deepseek", "_mla_decode")])
def test_opmap_engine_steps_are_named_and_attributed_by_range(name, attn):
    res = _res(name)
    for ph in ("prefill", "decode"):
        assert res["phases"][ph]["label_confidence"] == {"high": res["phases"][ph]["steps"]}
    assert res["backends"]["attention"][0] == "opmap" and res["evidence"]["range"] > 0.1
    assert {"GEMM", "attention", "norm", "sampling"} <= set(res["phases"]["decode"]["categories"])
    kernels = [k for k, _ in res["phases"]["decode"]["top_kernels"]]
    tr = trace.load(str(DATA / f"{name}.json.gz"))
    assert any(attn in k.name for k in tr.kernels), kernels
    if name == "opmap-deepseek":
        assert "MoE" in res["phases"]["decode"]["categories"]


def test_cli_writes_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "a.json", tmp_path / "a.png"
    rc = cli.main(["profile", "--trace", str(DATA / "hf-llama-sdpa-stack.json.gz"), "--json", str(out),
                   "--png", str(png)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["steps"] == 6 and set(doc["phases"]) == {"prefill", "decode"}
    assert png.stat().st_size > 1000
    assert "[decode] 5 steps" in capsys.readouterr().out


@pytest.mark.parametrize("symbol,cat,lib", [
    # symbols as they appear in the fixtures
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0",
     "attention", "cuDNN"),
    ("nvjet_sm90_tst_8x64_64x16_2x1_v_bz_TNN", "GEMM", "cuBLAS"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>(cutlass_80_simt_sgemm_128x32_8x5_nn_align1::Params)",
     "GEMM", "cuBLAS"),
    ("void at::cuda::detail::prepare_grouped_gemm_data<cutlass::bfloat16_t, cutlass::bfloat16_t, cutlass::bfloat16_t, "
     "float, cute::tuple<int, int, int>", "MoE", "CUTLASS"),
    ("triton_red_fused__to_copy__unsafe_view_add_embedding_mean_mul_pow_rsqrt_10", "norm", "Inductor"),
    ("triton_poi_fused__unsafe_view_mul_silu_8", "activation", "Inductor"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::(anonymous namespace)::silu_kernel("
     "at::TensorIteratorBase&)::{lambda()#1}::operator()() ", "activation", "PyTorch"),
    ("_grouped_gemm_kernel", "MoE", "opmap"),
    ("_mla_decode_tma_kernel", "attention", "opmap"),
    ("_rope_kv_append_kernel", "attention", "opmap"),
    ("Memcpy HtoD (Pageable -> Device)", "memory copies", "CUDA"),
])
def test_symbols_of_the_fixtures(symbol, cat, lib):
    from opmap.harness.profile import symbols

    assert symbols.classify(symbol) == (cat, lib)
    assert any(symbol[:40] in k.name for n in DATA.glob("*.json.gz") for k in trace.load(str(n)).kernels[:4000])


def test_opmap_pipelined_decode_reads_busy_not_idle():
    """opmap's engine at batch 1 (Qwen3-30B-A3B, random weights, H100; `opmap profile --model
    --save-trace`, cut to its last decode steps) launches each step's graph while the GPU still
    runs the one before, so each step's range opens about a step before its kernels. The GPU is
    busy nearly the whole time: no idle-GPU diagnosis, and the steps' idle time a few percent of
    their wall time (from the ranges it read as almost half)."""
    res = _res("opmap-qwen3moe-b1-decode")
    dec = res["phases"]["decode"]
    assert dec["steps"] >= 4 and set(res["phases"]) == {"decode"}
    assert dec["idle_ms"] < 0.05 * (dec["idle_ms"] + dec["gpu_ms"])
    assert not any("GPU is idle" in d for d in res["diagnosis"]), res["diagnosis"]
    assert _top(res, "decode") == "MoE"
