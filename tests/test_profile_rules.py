"""The diagnosis rules and the attribution motifs of `opmap profile --trace`, each where it must fire
(a small Chrome trace built here where no real trace has the case) and where it must not (a real
trace: tests/data/traces, and the third-party ones in ../shared/traces/ext where that folder is).
The traces built here carry what torch.profiler records: cpu_op events (with their input shapes),
cudaLaunchKernel / cudaGraphLaunch runtime events and the kernels sharing their correlation ids,
nn.Module frames (python_function events), stream captures."""
import gzip
import json
from pathlib import Path
from typing import NamedTuple, Optional

import pytest

from opmap.harness.profile import analyze
from opmap.harness.profile import symbols
from opmap.harness.profile import trace

DATA = Path(__file__).parent / "data" / "traces"
EXT = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "ext"
ext = pytest.mark.skipif(not EXT.is_dir(), reason=f"the third-party traces are not in this checkout ({EXT})")


class K(NamedTuple):
    sym: str
    dur: float
    op: Optional[str] = None  # the launching CPU op
    frames: tuple = ()  # host frames open at the launch, outermost first
    stream: int = 7
    at: Optional[float] = None  # GPU start relative to the launch (default: right after the previous kernel)


class Builder:
    def __init__(self):
        self.evs, self.t, self.gpu, self.corr = [], 0.0, 0.0, 0

    def _host(self, cat, name, ts, dur, **args):
        self.evs.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1,
                         **({"args": args} if args else {})})

    def launch(self, k: K, gpu: bool = True, corr: Optional[int] = None) -> int:
        """Host events of one launch (frames, op, cudaLaunchKernel) and, with ``gpu``, its kernel."""
        t = self.t
        for i, f in enumerate(k.frames):
            self._host("python_function", f, t - 0.1 * (len(k.frames) - i), 8 + 0.2 * (len(k.frames) - i))
        if k.op:
            self._host("cpu_op", k.op, t, 8, **{"Input Dims": [[4, 8], [8, 8]]})
        if corr is None:
            self.corr += 1
            corr = self.corr
            self._host("cuda_runtime", "cudaLaunchKernel", t + 1, 5, correlation=corr)
        if gpu:
            self.kernel(k, corr)
        self.t += 10
        return corr

    def kernel(self, k: K, corr: int):
        start = max(self.gpu, self.t + 10) if k.at is None else self.t + k.at
        self.evs.append({"ph": "X", "cat": "kernel", "name": k.sym, "ts": start, "dur": k.dur, "pid": 0,
                         "tid": k.stream, "args": {"correlation": corr, "stream": k.stream}})
        self.gpu = max(self.gpu, start + k.dur)

    def step(self, ks: list, name: Optional[str] = None, gap: float = 50):
        start = self.t
        for k in ks:
            self.launch(k)
        self.t = max(self.t, self.gpu) + gap
        if name:
            self._host("user_annotation", name, start - 1, self.t - start, )

    def replay(self, ks: list, name: Optional[str] = None):
        """One cudaGraphLaunch whose kernels are ks (no op launched them on the host)."""
        start = self.t
        self.corr += 1
        self._host("cuda_runtime", "cudaGraphLaunch", self.t, 5, correlation=self.corr)
        for k in ks:
            self.kernel(k._replace(op=None, frames=()), self.corr)
        self.t = max(self.t, self.gpu) + 50
        if name:
            self._host("user_annotation", name, start - 1, self.t - start)

    def capture(self, ks: list):
        """A stream capture: the launches are recorded, no kernel runs."""
        self._host("cuda_runtime", "cudaStreamBeginCapture", self.t, 2)
        self.t += 5
        for k in ks:
            self.launch(k, gpu=False)
        self._host("cuda_runtime", "cudaStreamEndCapture", self.t, 2)
        self.t += 100

    def analyze(self, tmp_path, name="t.json.gz") -> dict:
        p = tmp_path / name
        with gzip.open(p, "wt") as f:
            json.dump({"traceEvents": self.evs}, f)
        return analyze.analyze(trace.load(str(p)))


NVJET = "nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT"
EW = "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16>>"
SOFTMAX = "void (anonymous namespace)::softmax_warp_forward<float, float, float, 7, false, false>"
SORT = "void at::native::bitonicSortKVInPlace<-2, -1, 16, 16, float, long, at::native::GTOp<float, true>>"
TOPK = "void at::native::sbtopk::gatherTopK<float, unsigned int, 1, false>"
ARGMAX = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>"
MULTINOMIAL = "void at::native::(anonymous namespace)::sampleMultinomialOnce<float, float>"
DTOH = "Memcpy DtoH (Device -> Pinned)"
RMS = "void vllm::rms_norm_kernel<c10::BFloat16>"


def _tail(random: bool = False, sort: bool = False) -> list:
    """The final norm, the LM head, the sampler stage (a sort, a random draw or the argmax), the readback."""
    out = [K(RMS, 3, "_C::rms_norm"), K(NVJET, 40, "aten::mm")]
    out += [K(SORT, 20, "aten::sort")] if sort else []
    out += [K(MULTINOMIAL, 5, "aten::multinomial")] if random else [K(ARGMAX, 5, "aten::argmax")]
    return out + [K(DTOH, 2, "aten::copy_")]


def _eager_layer() -> list:
    """A decoder layer of HF eager attention without module frames: QKV, QK^T, scale, mask, softmax,
    PV, O projection; then a gated MLP."""
    return [K(RMS, 3, "_C::rms_norm"), K(NVJET, 30, "aten::mm"), K(NVJET, 6, "aten::bmm"), K(EW, 2, "aten::mul"),
            K(EW, 2, "aten::add"), K(SOFTMAX, 3, "aten::_softmax"), K(NVJET, 6, "aten::bmm"), K(NVJET, 20, "aten::mm"),
            K(RMS, 3, "_C::rms_norm"), K(NVJET, 50, "aten::mm"), K(EW, 2, "aten::silu"), K(NVJET, 50, "aten::mm"),
            K(EW, 2, "aten::mul"), K(NVJET, 50, "aten::mm")]


def test_unfused_attention_chain_without_frames(tmp_path):
    """bmm -> mul -> add -> softmax -> bmm between the QKV and O projections is attention, its two
    matmuls included (a motif); the projections stay GEMMs."""
    b = Builder()
    for _ in range(3):
        b.step(_eager_layer() * 2 + _tail())
    res = b.analyze(tmp_path)
    p = next(iter(res["phases"].values()))
    n = p["steps"]
    assert p["categories"]["attention"] == pytest.approx(n * 2 * (6 + 2 + 2 + 3 + 6) / 1e3)
    assert p["evidence"]["attention"] == {"motif": p["categories"]["attention"]}
    assert p["categories"]["GEMM"] == pytest.approx(n * (2 * 200 + 40) / 1e3)
    assert p["categories"]["activation"] > 0 and res["attributed"] == 1.0


def test_mla_absorbed_matmuls(tmp_path):
    """MLA's absorbed matmuls: the bmm just before the MLA kernel (q_nope x W_UK) and just after it
    (x W_UV) are attention's; a bmm elsewhere (an expert's) is not."""
    mla = "void flash_fwd_splitkv_mla_kernel<Flash_fwd_kernel_traits_mla<576, 64, 64, 8>>"
    b = Builder()
    for _ in range(2):
        b.step([K(RMS, 3, "_C::rms_norm"), K(NVJET, 20, "aten::mm"), K(NVJET, 5, "aten::bmm"), K(mla, 30),
                K(NVJET, 5, "aten::bmm"), K(NVJET, 20, "aten::mm"), K(RMS, 3, "_C::rms_norm"), K(NVJET, 7, "aten::bmm"),
                K(NVJET, 20, "aten::mm")] + _tail())
    p = next(iter(b.analyze(tmp_path)["phases"].values()))
    assert p["categories"]["attention"] == pytest.approx(p["steps"] * 40 / 1e3)
    assert p["categories"]["GEMM"] == pytest.approx(p["steps"] * (20 + 20 + 7 + 20 + 40) / 1e3)


def test_the_kv_layout_rule_fires_on_attention_and_its_kv_writes(tmp_path):
    b = Builder()
    for _ in range(4):
        b.step([K(RMS, 2, "_C::rms_norm"), K(NVJET, 10, "aten::mm"),
                K("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>", 8, "_C_cache_ops::reshape_and_cache_flash"),
                K("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", 120, "vllm::unified_attention"),
                K(NVJET, 10, "aten::mm")] + _tail())
    res = b.analyze(tmp_path)
    assert list(res["phases"]) == ["decode"]
    assert any(d.startswith("decode: attention takes") and "KV-cache copies" in d for d in res["diagnosis"])


def test_the_kv_layout_rule_does_not_take_moe_weight_gathers():
    """HF Mixtral's decode gathers the experts' weights (vectorized_gather_kernel, more than half
    the step): the MoE's, not attention's or the KV layout's."""
    res = analyze.analyze(trace.load(str(DATA / "hf-mixtral-sdpa.json.gz")))
    assert not any("KV layout" in d for d in res["diagnosis"])
    assert res["phases"]["decode"]["libraries"]["MoE"].get("PyTorch", 0) > 0.3 * res["phases"]["decode"]["gpu_ms"]


def test_sort_sampler_fires_only_in_the_sampler_stage_of_a_sampling_run(tmp_path):
    b = Builder()
    for _ in range(3):
        b.step(_eager_layer() + _tail(random=True, sort=True))
    assert any("sorts the logits" in d for d in b.analyze(tmp_path, "a.json.gz")["diagnosis"])
    # greedy: the same sort after the LM head, no random draw
    b = Builder()
    for _ in range(3):
        b.step(_eager_layer() + _tail(random=False, sort=True))
    assert not any("sorts the logits" in d or "sampler fallback" in d for d in b.analyze(tmp_path, "b.json.gz")["diagnosis"])
    # a block mask's sort before the layers, a router's top-k inside them, a sampler without a sort
    b = Builder()
    moe = [K(RMS, 3, "_C::rms_norm"), K(NVJET, 5, "aten::mm"), K(SOFTMAX, 2, "aten::_softmax"),
           K(TOPK, 3, "aten::topk"), K(SORT, 3, "aten::topk"), K(NVJET, 30, "aten::bmm"), K(EW, 2, "aten::sum")]
    for _ in range(3):
        b.step([K(SORT, 4, "aten::sort")] + _eager_layer() + moe + _tail(random=True))
    res = b.analyze(tmp_path, "c.json.gz")
    assert not any("sorts the logits" in d or "sampler fallback" in d for d in res["diagnosis"])
    assert next(iter(res["phases"].values()))["categories"]["MoE"] > 0


def test_sort_sampler_does_not_fire_on_routing_or_masks():
    """HF Mixtral greedy: its routers' top-k sort (bitonicSortKVInPlace) is the MoE's."""
    res = analyze.analyze(trace.load(str(DATA / "hf-mixtral-sdpa.json.gz")))
    assert not any("sort" in d for d in res["diagnosis"])
    assert all(not p["sampler_sorts"] for p in res["phases"].values())


DEQUANT = "_dequant_kernel"
KV_FP8 = "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, unsigned char, (vllm::Fp8KVCacheDataType)1>"
ACT_QUANT = "void vllm::scaled_fp8_quant_kernel_strided<c10::BFloat16, c10::Float8_e4m3fn>"


@pytest.mark.parametrize("extra,fires", [
    ([K(DEQUANT, 20, "opmap::linear"), K(NVJET, 50, "aten::mm")], True),
    ([K(KV_FP8, 20, "_C_cache_ops::reshape_and_cache_flash"), K(NVJET, 50, "aten::mm")], False),
    ([K(ACT_QUANT, 20, "_C::static_scaled_fp8_quant"), K(NVJET, 50, "aten::mm")], False),
    ([K(DEQUANT, 20, "opmap::linear"), K(NVJET, 50, "aten::mm"),
      K("sm90_xmma_gemm_e4m3e4m3_bf16f32_f32_tn_n_tilesize128x128x64_kernel", 30, "aten::_scaled_mm")], False),
])
def test_quantised_fallback_needs_a_dequantiser_feeding_a_dense_gemm_and_no_low_precision_gemm(tmp_path, extra, fires):
    b = Builder()
    for _ in range(2):
        b.step([K(RMS, 3, "_C::rms_norm")] + extra + _tail())
    res = b.analyze(tmp_path)
    assert any("fell back" in d for d in res["diagnosis"]) == fires


def test_moe_per_expert_loop_fires_with_module_frames(tmp_path):
    block = ("nn.Module: MixtralDecoderLayer_0", "nn.Module: MixtralSparseMoeBlock_0")
    b = Builder()
    for _ in range(2):
        ks = [K(RMS, 3, "_C::rms_norm"), K(NVJET, 5, "aten::mm", block + ("nn.Module: Linear_0",)),
              K(TOPK, 3, "aten::topk", block)]
        for e in range(8):
            ks += [K(NVJET, 10, "aten::mm", block + ("nn.Module: MixtralBlockSparseTop2MLP_0", f"nn.Module: Linear_{e}"))]
        b.step(ks + _tail())
    res = b.analyze(tmp_path)
    assert any("loop of per-expert GEMMs" in d for d in res["diagnosis"])
    assert next(iter(res["phases"].values()))["categories"]["MoE"] == pytest.approx(2 * (5 + 3 + 80) / 1e3)


def test_moe_per_expert_loop_does_not_fire_on_grouped_or_batched_experts():
    for name in ("hf-mixtral-sdpa-stack", "hf-qwen3moe-sdpa-stack"):
        res = analyze.analyze(trace.load(str(DATA / f"{name}.json.gz")))
        assert not any("per-expert" in d for d in res["diagnosis"]), name


def test_overlapped_communication_is_not_diagnosed(tmp_path):
    """An all-reduce entirely under a GEMM on another stream waits for nothing."""
    ar = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    for overlap, fires in ((True, False), (False, True)):
        b = Builder()
        for _ in range(3):
            b.step([K(NVJET, 100, "aten::mm", at=10), K(ar, 60, "c10d::allreduce_", stream=13, at=15 if overlap else 200)])
        res = b.analyze(tmp_path, f"{overlap}.json.gz")
        assert any("communication takes" in d for d in res["diagnosis"]) == fires
        assert next(iter(res["phases"].values()))["comm_ms"] == pytest.approx(3 * 60 / 1e3)


def test_idle_rule_names_graphs_only_where_none_replayed():
    res = analyze.analyze(trace.load(str(DATA / "opmap-llama.json.gz")))
    idle = {d.split(":")[0]: d for d in res["diagnosis"] if "idle" in d}
    assert "CUDA graphs not captured" in idle["prefill"] and "CUDA graphs not captured" not in idle["decode"]


def test_inductor_kernels_spelling_a_collective_are_not_communication():
    s = "triton_poi_fused_add_all_reduce_bitwise_and_bitwise_or_embedding_ge_lt_masked_fill_mul_sub_0"
    assert symbols.classify(s) == ("memory copies", "Inductor")
    assert symbols.classify("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 4>") == (
        "communication", "vLLM custom all-reduce")
    assert symbols.classify("void dpsk::ep::internode::combine<false, 8>") == ("communication", "DeepEP")
    assert symbols.low_precision_gemm("bmm_MxE4m3_MxE2m1MxE4m3_Fp32_t128x16x256u2_s3_et128x16_m128x16x32")
    assert not symbols.low_precision_gemm(KV_FP8) and not symbols.low_precision_gemm(ACT_QUANT)


def test_unattributed_time_is_reported_and_feeds_no_rule(tmp_path):
    b = Builder()
    for _ in range(3):
        b.step([K("mystery_kernel_a", 300), K("mystery_kernel_b", 300), K(NVJET, 10, "aten::mm")])
    res = b.analyze(tmp_path)
    assert res["unattributed"] > 0.9
    assert res["diagnosis"] and all("feeds no diagnosis line" in d or "idle" in d for d in res["diagnosis"])


# ---- CUDA graphs -----------------------------------------------------------------------------------

def _graph_step() -> list:
    """A decode step's kernels as a graph replays them: a norm's pieces and a copy, generic symbols."""
    fr = ("nn.Module: LlamaDecoderLayer_0", "nn.Module: LlamaRMSNorm_0")
    return [K(EW, 3, "aten::pow", fr), K(EW, 3, "aten::mean", fr), K(EW, 3, "aten::rsqrt", fr),
            K(NVJET, 30, "aten::mm", ("nn.Module: LlamaAttention_0", "nn.Module: Linear_0")),
            K("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", 4, "aten::copy_",
              ("nn.Module: LlamaAttention_0",)),
            K(ARGMAX, 3, "aten::argmax"), K(DTOH, 2, "aten::copy_")]


@pytest.mark.parametrize("captured", [False, True])
def test_replayed_kernels_take_the_modules_and_ops_of_their_capture(tmp_path, captured):
    """Kernels under cudaGraphLaunch carry no launching op; where the trace holds the capture (SGLang
    writes one per batch size), the launch at the same place of it lends its op, shapes and module
    frames. Without the capture, the norm's elementwise pieces stay unattributed."""
    b = Builder()
    if captured:
        b.capture(_graph_step())
    for _ in range(3):
        b.replay(_graph_step(), "execute_model")
    res = b.analyze(tmp_path)
    p = res["phases"]["decode"]
    assert p["graph_ms"] == pytest.approx(p["gpu_ms"])
    if captured:
        assert p["categories"]["norm"] == pytest.approx(3 * 9 / 1e3) and res["attributed"] == 1.0
        assert p["evidence"]["norm"] == {"range": p["categories"]["norm"]}
        t = trace.load(str(tmp_path / "t.json.gz"))
        assert t.kernels[0].shapes == ((4, 8), (8, 8)) and t.kernels[0].launcher == "aten::pow"
    else:
        assert p["categories"]["unattributed"] == pytest.approx(3 * 9 / 1e3)
    assert p["categories"]["GEMM"] == pytest.approx(3 * 30 / 1e3)


@ext
def test_no_false_lines_on_the_third_party_traces():
    """The issue's false lines: the fallback rule on a bf16 KV write and on an fp8 x fp4 MoE, the
    sort sampler on routing / masks, the KV layout on weight gathers."""
    for f in EXT.glob("*.json.gz"):
        res = analyze.analyze(trace.load(str(f)))
        for d in res["diagnosis"]:
            assert not any(w in d for w in ("fell back", "sorts the logits", "KV layout", "sampler fallback")), (f, d)


def test_the_compute_path_rule_needs_attention_and_gemm_to_dominate_prefill():
    fires = analyze.analyze(trace.load(str(DATA / "hf-llama-compile.json.gz")))
    assert any(d.startswith("prefill: attention + GEMM take") and "[evidence: attention by" in d
               for d in fires["diagnosis"])
    moe = analyze.analyze(trace.load(str(DATA / "hf-mixtral-sdpa.json.gz")))  # MoE-bound prefill
    assert not any("the compute path" in d for d in moe["diagnosis"])


@ext
def test_tensor_parallel_decode_whose_collectives_are_small_is_not_told_to_change_its_layout():
    """vLLM TP 4: each decode step's custom all-reduces are a small share of its time; its GPU is
    busy between the graph replays (no idle line either)."""
    res = analyze.analyze(trace.load(str(EXT / "traceMap__1_h100_1000isl_10osl_32con.pt.trace.json.gz")))
    dec = res["phases"]["decode"]
    assert dec["comm_ms"] > 0 and dec["categories"]["communication"] > 0
    assert not any(d.startswith("decode:") and ("communication" in d or "idle" in d) for d in res["diagnosis"])


def test_compiled_unfused_attention_chain(tmp_path):
    """torch.compile of eager attention: cuBLAS matmuls (aten::bmm) around Inductor's fused softmax
    (launched under its own name) are attention's."""
    sm = "triton_per_fused__softmax_add_mul_0"
    b = Builder()
    for _ in range(2):
        b.step([K(RMS, 3, "_C::rms_norm"), K(NVJET, 30, "aten::mm"), K(NVJET, 6, "aten::bmm"), K(sm, 4, sm),
                K(NVJET, 6, "aten::bmm"), K(NVJET, 20, "aten::mm")] + _tail())
    p = next(iter(b.analyze(tmp_path)["phases"].values()))
    assert p["categories"]["attention"] == pytest.approx(2 * 16 / 1e3)


def _grid_step(grids: dict, copies: int = 1) -> dict:
    from opmap.harness.profile.trace import Kernel

    ks = [Kernel(name, float(i), 1.0, grid=g) for i, (name, g) in enumerate(list(grids.items()) * copies)]
    return {"name": None, "kernels": ks}


@pytest.mark.parametrize("prompt_growth, batch_growth, prefill", [(128, 1, True), (16, 1, True), (1, 1, False),
                                                                   (1, 4, False), (4, 1, False)])
def test_the_grid_rule_labels_the_prompt_step_and_not_a_grown_batch(prompt_growth, batch_growth, prefill):
    """Steps of one run with no range name and no phase-specific attention kernel: the step whose
    per-layer kernels (norm, RoPE, activation, copy) launch many times the blocks they launch in
    the other steps is a prefill (medium confidence); the sampler's and LM head's kernels (the
    last token only) stay as they were. A decode batch a few times larger, or a short prompt's
    few-fold growth below GRID_PREFILL, is no prefill by grids."""
    from opmap.harness.profile.steps import grid_medians, label

    per_layer = {"rmsnorm": 4, "rope": 8, "silu_mul": 14, "copy": 4, "add": 4}
    tail = {"lm_head_softmax": 251, "argmax": 251, "scalar": 1}
    decode = [_grid_step({**per_layer, **tail}, copies=2) for _ in range(5)]
    first = _grid_step({**{n: g * prompt_growth * batch_growth for n, g in per_layer.items()},
                        **{n: g * batch_growth if n != "scalar" else 1 for n, g in tail.items()}}, copies=2)
    steps = [first] + decode
    phase, conf = label(first, median_busy_us=1e9, medians=grid_medians(steps))
    assert (phase, conf) == (("prefill", "medium") if prefill else ("decode", "low"))
    assert all(label(s, 1e9, grid_medians(steps)) == ("decode", "low") for s in decode)
