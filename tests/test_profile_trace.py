"""`opmap profile --trace`: another engine's trace on the operator map. The traces here are built
in the test in the two formats the reader takes (a PyTorch profiler Chrome trace with its launch
correlation ids and record_function ranges; an Nsight Systems SQLite export's tables), with kernel
symbols as vLLM, FlashInfer, FlashAttention, cuBLAS, NCCL and PyTorch name them."""
import gzip
import json
import sqlite3
from pathlib import Path

import pytest
import torch

from opmap.cli import main as cli
from opmap.core.contract import InputError
from opmap.harness.profile import analyze
from opmap.harness.profile import ours
from opmap.harness.profile import symbols
from opmap.harness.profile import steps as profile_steps
from opmap.harness.profile import trace


@pytest.mark.parametrize("symbol,cat,lib", [
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", "attention", "FlashInfer"),
    ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>", "attention", "FlashAttention"),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>", "attention", "FlashAttention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", "attention", "cuDNN"),
    ("void vllm::paged_attention_v2_kernel<__nv_bfloat16, 128, 16>", "attention", "vLLM"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>", "attention", "vLLM"),
    ("kernel_unified_attention_2d", "attention", "vLLM"),
    ("xqa_kernel_dt_bf16_d_128_beam_1_kvt_bf16_nq_4", "attention", "TensorRT-LLM"),
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>", "norm", "vLLM"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel>", "activation", "vLLM"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", "RoPE", "vLLM"),
    ("fused_moe_kernel", "MoE", "vLLM"),
    ("void vllm::moe::moe_align_block_size_kernel<int>", "MoE", "vLLM"),
    ("nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "GEMM", "cuBLAS"),
    ("void gemvx::kernel<int, int, __nv_bfloat16, __nv_bfloat16, float, false, true>", "GEMM", "cuBLAS"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "GEMM", "cuBLAS"),
    ("void deep_gemm::fp8_gemm_kernel<128, 128>", "GEMM", "DeepGEMM"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication", "NCCL"),
    ("TopKTopPSamplingFromProbKernel", "sampling", "FlashInfer"),
    ("void at::native::(anonymous namespace)::sampleMultinomialOnce<float, float>", "sampling", "PyTorch"),
    # a sort says nothing alone: a sampler's, a MoE router's or a block mask's (the context decides)
    ("void cub::DeviceRadixSortOnesweepKernel<...>", "unattributed", "PyTorch"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm", "Inductor"),
    ("triton_poi_fused_mul_silu_1", "activation", "Inductor"),
    ("apply_token_bitmask_inplace_kernel", "grammar", "XGrammar"),
    ("Memcpy HtoD (Pinned -> Device)", "memory copies", "CUDA"),
])
def test_symbol_table(symbol, cat, lib):
    assert symbols.classify(symbol) == (cat, lib)


def _chrome(steps):
    """A Chrome trace of engine steps: each a host range holding cpu ops that launch kernels."""
    evs, t, corr = [], 0.0, 0
    for name, kernels in steps:
        start = t
        for op, sym, dur in kernels:
            corr += 1
            evs.append({"ph": "X", "cat": "cpu_op", "name": op, "ts": t, "dur": 8, "pid": 1, "tid": 1})
            evs.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t + 1, "dur": 5,
                        "pid": 1, "tid": 1, "args": {"correlation": corr}})
            evs.append({"ph": "X", "cat": "kernel", "name": sym, "ts": t + 10, "dur": dur, "pid": 0, "tid": 7,
                        "args": {"correlation": corr, "stream": 7}})
            t += 10 + dur
        if name:
            evs.append({"ph": "X", "cat": "user_annotation", "name": name, "ts": start - 0.5, "dur": t - start + 1,
                        "pid": 1, "tid": 1})
        t += 2000  # the host between steps
    return {"traceEvents": evs}


PREFILL = [("aten::rms_norm", "void vllm::rms_norm_kernel<c10::BFloat16>", 20),
           ("aten::linear", "nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 400),
           ("vllm::rotary_embedding", "void vllm::rotary_embedding_kernel<c10::BFloat16, true>", 15),
           ("vllm::unified_attention", "void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>", 900),
           ("aten::linear", "nvjet_sm90_tst_128x128_64x4_1x2_h_bz_TNT", 300),
           ("aten::mm", "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNN", 60),
           ("aten::sort", "void cub::DeviceRadixSortOnesweepKernel<...>", 30)]
DECODE = [("aten::rms_norm", "void vllm::rms_norm_kernel<c10::BFloat16>", 3),
          ("aten::linear", "void gemvx::kernel<int, int, __nv_bfloat16>", 40),
          ("vllm::unified_attention", "void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", 25),
          ("aten::linear", "void gemvx::kernel<int, int, __nv_bfloat16>", 35),
          ("aten::index_select", "void at::native::indexSelectLargeIndex<c10::BFloat16>", 4),
          ("aten::sort", "void cub::DeviceRadixSortOnesweepKernel<...>", 30),
          ("aten::multinomial", "void at::native::(anonymous namespace)::sampleMultinomialOnce<float>", 6)]


def _write(tmp_path, doc, name="t.json.gz"):
    p = tmp_path / name
    with gzip.open(p, "wt") as f:
        json.dump(doc, f)
    return str(p)


def test_a_vllm_like_trace_without_step_ranges(tmp_path):
    """No step ranges: steps from the host gaps, labelled from the attention kernels (medium)."""
    t = trace.load(_write(tmp_path, _chrome([(None, PREFILL)] + [(None, DECODE)] * 5)))
    assert len(t.kernels) == 7 * 6 and t.kernels[0].launcher == "aten::rms_norm"
    res = analyze.analyze(t)
    assert res["steps"] == 6 and set(res["phases"]) == {"prefill", "decode"}
    dec, pre = res["phases"]["decode"], res["phases"]["prefill"]
    assert dec["steps"] == 5 and dec["label_confidence"] == {"medium": 5}
    assert list(pre["libraries"]["attention"]) == ["FlashInfer"] and list(dec["libraries"]["attention"]) == ["FlashInfer"]
    # the categories' times: each kernel once, as the trace ran them
    assert dec["categories"]["GEMM"] == pytest.approx(5 * 75 / 1e3)
    assert dec["categories"]["attention"] == pytest.approx(5 * 25 / 1e3)
    assert pre["categories"]["attention"] == pytest.approx(0.9)
    assert res["unattributed"] <= 0.1
    assert any(d.startswith("prefill: attention + GEMM take") for d in res["diagnosis"])
    assert any("sorting-free sampler" in d for d in res["diagnosis"])
    assert any(d.startswith("decode: the GPU is idle") for d in res["diagnosis"])  # 2 ms of host between steps


def test_step_ranges_and_opmap_op_ranges(tmp_path):
    steps = [("opmap::step::prefill", [("opmap::attention::attention (paged)::triton", "_prefill_kernel", 300)]),
             ("opmap::step::decode", [("opmap::gemm::QKV proj::triton-decode", "_gemm_kernel", 50),
                                      ("opmap::attention::attention (paged)::triton", "_decode_kernel", 20)])]
    doc = _chrome(steps)
    for e in doc["traceEvents"]:  # opmap's op ranges are user annotations around the launches
        if e["cat"] == "cpu_op":
            e["cat"] = "user_annotation"
    res = analyze.analyze(trace.load(_write(tmp_path, doc)))
    assert res["phases"]["prefill"]["label_confidence"] == {"high": 1}
    assert res["phases"]["decode"]["categories"] == {"GEMM": 0.05, "attention": 0.02}
    assert res["backends"]["attention"] == ["opmap"] and res["evidence"].get("range", 0) > 0.9


def _nsys(path):
    db = sqlite3.connect(path)
    db.executescript("""
      CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT);
      CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT, demangledName INT, shortName INT,
                                               correlationId INT, streamId INT);
      CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT, end INT, correlationId INT, globalTid INT);
      CREATE TABLE NVTX_EVENTS (start INT, end INT, text TEXT, textId INT, globalTid INT);
      CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INT, end INT);
    """)
    names = ["ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
             "nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "void flash::flash_fwd_splitkv_kernel<...>"]
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", list(enumerate(names)))
    t, c = 0, 0
    for step in range(3):
        db.execute("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, NULL, 1)", (t, t + 400_000, "execute_model"))
        for sid, dur in ((1, 60_000), (2, 30_000), (0, 150_000)):  # ns: GEMM, attention, all-reduce
            c += 1
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, 1)", (t + 1000, t + 2000, c))
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, ?, ?, 7)",
                       (t + 5000, t + 5000 + dur, sid, sid, c))
            t += 5000 + dur
        t += 1_000_000
    db.commit()
    db.close()


def test_an_nsight_systems_export(tmp_path):
    p = str(tmp_path / "run.sqlite")
    _nsys(p)
    t = trace.load(p)
    assert t.kind == "nsys" and len(t.kernels) == 9 and t.kernels[0].ranges == ("execute_model",)
    res = analyze.analyze(t)
    assert res["steps"] == 3 and list(res["phases"]) == ["decode"]  # flash_fwd_splitkv: a decode kernel
    p_ = res["phases"]["decode"]
    assert p_["categories"]["communication"] == pytest.approx(0.45) and res["backends"]["communication"] == ["NCCL"]
    assert any("communication takes" in d and "TP/EP layout" in d for d in res["diagnosis"])


def test_cli_prints_writes_json_and_png(tmp_path, capsys):
    path = _write(tmp_path, _chrome([(None, PREFILL)] + [(None, DECODE)] * 3))
    out_json, out_png = tmp_path / "a.json", tmp_path / "a.png"
    assert cli.main(["profile", "--trace", path, "--json", str(out_json), "--png", str(out_png)]) == 0
    text = capsys.readouterr().out
    assert "[decode] 3 steps" in text and "FlashInfer" in text and "diagnosis:" in text
    doc = json.loads(out_json.read_text())
    assert {"phases", "unattributed", "backends", "diagnosis"} <= set(doc)
    assert {"steps", "gpu_ms", "idle_ms", "categories"} <= set(doc["phases"]["decode"])
    if "no timeline" not in text:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_trace_files_are_one_line(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{ not json")
    assert cli.main(["profile", "--trace", str(bad)]) == 1
    assert capsys.readouterr().err.strip().startswith("opmap profile: error: trace")
    assert cli.main(["profile", "--trace", str(tmp_path / "none.json")]) == 1
    assert cli.main(["profile"]) == 1
    assert "--model MODEL (run the engine) or --trace FILE" in capsys.readouterr().err
    with pytest.raises(InputError):
        trace.load(str(bad))


@pytest.mark.parametrize("wo_symbol", ["sm90_xmma_gemm_e4m3bf16_bf16f32_f32_tn_n_tilesize128x128x64_kernel"]
                         + sorted(s for s in ours.table() if ours.low_precision_gemm(s)))
def test_a_dequantise_then_bf16_gemm_is_flagged_and_the_weight_only_gemm_is_not(tmp_path, wo_symbol):
    """A weight-only GEMM (opmap's: the kernels of its quantised-only gemm backends, from the registry)
    is a quantised GEMM; the prefill route that dequantises each weight for a bf16 cuBLAS GEMM
    (_dequant_kernel, then nvjet) is the fallback the profile names."""
    deq = [("opmap::linear", "_dequant_kernel", 40), ("aten::linear", "nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 300),
           ("opmap::attention", "_prefill_tma_kernel", 200)]
    wo = [("opmap::linear", wo_symbol, 30), ("opmap::attention", "_decode_kernel", 20)]
    flag = "the quantised path fell back to a dequantise kernel and a bf16 GEMM"
    res = analyze.analyze(trace.load(_write(tmp_path, _chrome([(None, deq)] * 2), "deq.json.gz")))
    assert any(flag in d for d in res["diagnosis"]) and res["unattributed"] == 0
    res = analyze.analyze(trace.load(_write(tmp_path, _chrome([(None, wo)] * 2), "wo.json.gz")))
    assert not any(flag in d for d in res["diagnosis"]) and res["unattributed"] == 0


def test_a_host_only_trace_says_host_not_gpu(tmp_path):
    """A torch.profiler recording with no GPU activity (a tiny HF generate on the CPU, recorded here
    with this torch): its ops stand for kernels, and the lines that fire never speak of an idle GPU
    or of CUDA graphs, which the trace cannot show; on the committed CPU recording they speak of the
    host's time between operators. The GPU traces above keep the GPU line."""
    import transformers
    from torch.profiler import ProfilerActivity, profile

    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512)
    m = transformers.Qwen2ForCausalLM(cfg).eval()
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        m.generate(torch.randint(0, 512, (2, 16)), max_new_tokens=6, do_sample=False, pad_token_id=0)
    path = str(tmp_path / "cpu.json")
    prof.export_chrome_trace(path)
    t = trace.load(path)
    assert t.kind == "chrome-cpu"
    res = analyze.analyze(t)
    assert res["diagnosis"] and not any("GPU is idle" in d or "CUDA graph" in d for d in res["diagnosis"])
    # the host's time between operators, from the committed recording: in a live one, other
    # processes on a loaded CPU stretch the operators (preempted time reads as busy) and the line
    # may not fire
    fixture = analyze.analyze(trace.load(str(Path(__file__).parent / "data" / "traces" / "hf-gemma2-cpu.json.gz")))
    assert any(": the host runs no operator" in d and "no GPU activity" in d for d in fixture["diagnosis"])


def test_step_walls_of_a_pipelined_engine_and_of_a_host_bound_one():
    """A step's wall runs from where it starts (its range, or where the GPU finished the steps before
    it) to the next step's start. An engine that opens each step's range a step early (one-step-ahead
    decode) gets walls of one GPU step, not two, so its GPU reads as busy; one whose host leaves gaps
    between steps keeps them as the steps' idle time."""
    from types import SimpleNamespace as K

    def step(ts, end, k0, k1):
        return {"name": "opmap::step::decode", "ts": ts, "end": end, "kernels": [K(ts=k0, dur=k1 - k0)]}

    # the host opens step i at 1000 i and returns at once; the GPU runs step i over [1000 i + 900, 1000 i + 1900)
    ahead = [step(1000 * i, 1000 * i + 50, 1000 * i + 900, 1000 * i + 1900) for i in range(5)]
    walls = profile_steps.step_walls(ahead)
    assert walls[1:] == pytest.approx([1.0] * 4) and walls[0] == pytest.approx(1.9)
    idle = sum(w - analyze.busy(s["kernels"]) / 1e3 for w, s in zip(walls[1:], ahead[1:]))
    assert idle == pytest.approx(0.0)
    # host-bound: each step's kernels take 0.3 ms of a 2 ms stretch
    slow = [step(2000 * i, 2000 * i + 500, 2000 * i + 100, 2000 * i + 400) for i in range(4)]
    walls = profile_steps.step_walls(slow)
    assert walls[:3] == pytest.approx([2.0] * 3) and walls[3] == pytest.approx(0.5)


def test_a_step_longer_than_the_median_is_prefill_only_if_its_launches_grew():
    """Without a range or attention kernel to say the phase, a step well over the median step's busy
    time reads as a prefill; where its launches' sizes are recorded (grids, or a host-only trace's
    input shapes) and match the median step's, the extra time is not a prompt's rows (host jitter:
    the last step of a sampled HF generate on the CPU read as a second prefill) and it stays decode.
    A step whose sizes grew keeps the prefill label: from GRID_PREFILL times up with medium
    confidence, below it from the busy time."""
    def step(t0, dur, rows):
        ks = [trace.Kernel(f"aten::op{i}", t0 + 10 * i, dur, launcher=f"aten::op{i}",
                           shapes=((3, rows, 128), (128, 128))) for i in range(4)]
        return {"name": None, "ts": t0, "end": t0 + 100, "kernels": ks}

    decode = [step(1000 * i, 2.0, 1) for i in range(6)]
    steps = decode + [step(9000, 2.6, 1), step(10000, 2.6, 4), step(11000, 2.6, 40)]
    medians = profile_steps.grid_medians(steps)
    median_busy = 8.0  # four launches of 2 us
    assert profile_steps.label(steps[-3], median_busy, medians) == ("decode", "low")  # 1.3x the time, same sizes
    assert profile_steps.label(steps[-2], median_busy, medians) == ("prefill", "low")  # 4x the rows
    assert profile_steps.label(steps[-1], median_busy, medians) == ("prefill", "medium")  # 40x the rows
    assert profile_steps.label(decode[0], median_busy, medians) == ("decode", "low")


def test_a_host_only_step_without_shapes_is_labelled_by_its_launches_before_its_time():
    """With no sizes recorded, the decode loop's launches (the set most steps ran) say decode
    whatever the step's host time (other processes stretch it: a later generate call's decode step
    read as a prefill); a step that launched more of its own (an HF prefill's mask and cache
    set-up) is a prefill even when the host ran it faster than the median; a step with fewer
    launches of its own, or a run with no set most steps share, is labelled by its busy time."""
    def step(t0, dur, names):
        ks = [trace.Kernel(n, t0 + 10 * i, dur, launcher=n) for i, n in enumerate(names)]
        return {"name": None, "ts": t0, "end": t0 + 100, "kernels": ks}

    loop = ["aten::linear", "aten::silu", "aten::linear", "aten::argmax"]
    decode = [step(1000 * i, 2.0, loop) for i in range(6)]
    jitter, stalled = step(9000, 2.6, loop), step(10000, 12.0, loop)  # 1.3x and 6x the median time
    prompt_fast = step(11000, 0.5, ["aten::triu"] + loop)  # a prompt's own launches, run fast
    tail_short, tail_long = step(12000, 2.0, loop[:3]), step(13000, 4.0, loop[:3])
    steps = decode + [jitter, stalled, prompt_fast, tail_short, tail_long]
    medians, common = profile_steps.grid_medians(steps), profile_steps.common_launches(steps)
    assert common is not None and medians == {}
    median_busy = 8.0  # four launches of 2 us
    for s in decode + [jitter, stalled]:
        assert profile_steps.label(s, median_busy, medians, common) == ("decode", "low")
    assert profile_steps.label(prompt_fast, median_busy, medians, common) == ("prefill", "low")
    assert profile_steps.label(tail_short, median_busy, medians, common) == ("decode", "low")  # 6 us < 1.15 x 8
    assert profile_steps.label(tail_long, median_busy, medians, common) == ("prefill", "low")  # 12 us
    # no set of launches shared by more steps than any other: the busy time decides
    alone = [step(0, 2.0, loop), step(1000, 2.0, ["aten::mm"] + loop), step(2000, 2.0, ["aten::bmm"] + loop)]
    assert profile_steps.common_launches(alone) is None
    assert profile_steps.label(jitter, median_busy, {}, None) == ("prefill", "low")
    assert profile_steps.label(decode[0], median_busy, {}, None) == ("decode", "low")


def test_three_hf_generate_calls_on_a_loaded_cpu_read_as_three_prefills():
    """A real host-only recording without shapes (scripts/record_traces.py hf-llama-cpu-calls: three
    greedy generate calls of 8 new tokens, recorded while other processes loaded the CPU, so the
    steps' host times scatter): 24 steps, one prefill a call. Labelled by busy time, as before the
    launch rule, it read 9 prefills."""
    res = analyze.analyze(trace.load(str(Path(__file__).parent / "data" / "traces" / "hf-llama-cpu-calls.json.gz")))
    assert res["steps"] == 24
    assert res["phases"]["prefill"]["steps"] == 3 and res["phases"]["decode"]["steps"] == 21


def test_kernels_another_thread_launched_during_a_step_join_it():
    """A kernel launched with no step range open on its thread (autograd's backward, a pipeline's
    second stream) belongs to the step whose range was open when it was launched; one launched
    before any step range (a warm-up still draining) or with no launch time stays out."""
    rng = ("ProfilerStep#1", 1000.0, 1000.0)
    ours = trace.Kernel("ampere_sgemm", 1100.0, 100.0, ranges=("ProfilerStep#1",), launched=1050.0)
    other = trace.Kernel("ampere_sgemm_bwd", 1150.0, 300.0, launched=1120.0)  # another thread, mid-step
    early = trace.Kernel("warmup_kernel", 1010.0, 50.0, launched=900.0)  # launched before the range
    unknown = trace.Kernel("no_correlation", 1200.0, 50.0)
    after = trace.Kernel("next_thing", 2100.0, 10.0, launched=2050.0)  # after the range closed
    t = trace.Trace([early, ours, other, unknown, after], ranges=[rng], kind="chrome")
    (s,) = profile_steps.steps_of(t)
    assert [k.name for k in s["kernels"]] == ["ampere_sgemm", "ampere_sgemm_bwd"]


def test_a_training_steps_loss_and_optimizer_are_no_sampler():
    """The stretch after the LM head is a sampler stage where it reads tokens back or draws them; in
    a training step it ends where autograd's backward begins, so the loss, the backward nodes and the
    optimizer (whose scalar reads look like a token read-back) are not sampling. The same stretch
    without a backward pass still is."""
    from opmap.harness.profile import attribute

    def op(name, t):
        return trace.Kernel(name, t, 5.0, launcher=name)

    infer = [op("aten::mm", 0), op("aten::softmax", 10), op("aten::multinomial", 20), op("aten::item", 30)]
    assert [a.category for a in attribute.step(infer)][1:] == ["sampling"] * 3
    train = [op("aten::mm", 0), op("aten::log_softmax", 10), op("aten::nll_loss", 20),
             op("autograd::engine::evaluate_function: MmBackward0", 30), op("aten::mul_", 40), op("aten::item", 50)]
    assert "sampling" not in [a.category for a in attribute.step(train)]
