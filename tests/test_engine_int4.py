"""int4 weight-only checkpoints (GPTQ v1 / v2 with and without act order, AWQ GEMM,
compressed-tensors pack-quantized W4A16 symmetric and with zero points): the attention and dense
MLP projections load packed (the kernels' layout, ops/gemm/quant.py), everything else of the
format is dequantised at load and named; greedy tokens equal HF transformers' on the same
weights, for a dense, a MoE and an MLA model.

The checkpoints are packed here from known codes, in each format's published layout (AutoGPTQ's
``pack``, AutoAWQ's ``WQLinear_GEMM.from_linear``, compressed-tensors' ``pack_to_int32``): the HF
reference gets the weights those codes stand for, computed from the codes, not by opmap's
unpacking. compressed-tensors checkpoints are also loaded by transformers itself (which
decompresses them with the compressed-tensors package) for an independent reference; AWQ's
packing is checked against compressed-tensors' AutoAWQ converter."""
import glob
import json
import os

import pytest
import torch

from opmap.core.contract import InputError
from opmap.engine.llm import LLM
from opmap.engine.params import SamplingParams
from opmap.model.hf import save_checkpoint
from opmap.model.presets import PRESETS

from test_engine_util import hf_greedy, random_prompts, single_thread, word_tokenizer  # noqa: F401

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _quantise(w: torch.Tensor, group: int, zero_point: bool, g_idx=None):
    """Codes [N, K] uint8, scales [N, K/G], zeros [N, K/G] uint8 (8 where symmetric) of w [N, K]
    with channel k in group g_idx[k] (default k // group); round to nearest."""
    N, K = w.shape
    g_idx = torch.arange(K) // group if g_idx is None else g_idx
    codes = torch.empty(N, K, dtype=torch.uint8)
    scales = torch.empty(N, K // group)
    zeros = torch.full((N, K // group), 8, dtype=torch.uint8)
    for g in range(K // group):
        cols = (g_idx == g).nonzero().flatten()
        blk = w[:, cols].float()
        if zero_point:
            lo, hi = blk.amin(1).clamp(max=0), blk.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).clamp_min(1e-8)
            z = (-lo / s).round().clamp(0, 15)
        else:
            s = (blk.abs().amax(1) / 7).clamp_min(1e-8)
            z = torch.full_like(s, 8.0)
        s = s.half().float()  # the formats store fp16 scales
        codes[:, cols] = (blk / s[:, None] + z[:, None]).round().clamp(0, 15).to(torch.uint8)
        scales[:, g], zeros[:, g] = s, z.to(torch.uint8)
    return codes, scales, zeros, g_idx


def _dequant(codes, scales, zeros, g_idx):
    return (codes.float() - zeros[:, g_idx].float()) * scales[:, g_idx]


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values in [0, 15] -> int32 words, value i in bits 4i..4i+3."""
    v = sum(nibbles[..., i].to(torch.int64) << (4 * i) for i in range(8))
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _pack_gptq(codes, scales, zeros, g_idx, v1: bool) -> dict:
    N, K = codes.shape
    z = zeros.to(torch.int64) - (1 if v1 else 0)
    return {"qweight": _words(codes.t().reshape(K // 8, 8, N).permute(0, 2, 1)),
            "qzeros": _words((z & 0xF).t().reshape(-1, N // 8, 8)),
            "scales": scales.t().contiguous().half(), "g_idx": g_idx.to(torch.int32)}


def _pack_awq(codes, scales, zeros, g_idx) -> dict:
    N, K = codes.shape
    order = torch.tensor(AWQ_ORDER)
    return {"qweight": _words(codes.t().reshape(K, N // 8, 8)[:, :, order]),
            "qzeros": _words(zeros.t().reshape(-1, N // 8, 8)[:, :, order]),
            "scales": scales.t().contiguous().half()}


def _pack_compressed(codes, scales, zeros, g_idx, zero_point: bool) -> dict:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out = {"weight_packed": pack_to_int32((codes.to(torch.int16) - 8).to(torch.int8), 4),
           "weight_scale": scales.clone(), "weight_shape": torch.tensor(list(codes.shape))}
    if zero_point:
        out["weight_zero_point"] = pack_to_int32((zeros.to(torch.int16) - 8).to(torch.int8), 4, packed_dim=0)
    return out


QCONFIG = {
    "gptq": lambda g, v1, act: {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": act, "sym": False,
                                "checkpoint_format": "gptq" if v1 else "gptq_v2"},
    "awq": lambda g, v1, act: {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True,
                               "version": "gemm"},
    "compressed": lambda g, zp, act: {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": 4, "type": "int", "symmetric": not zp, "strategy": "group", "group_size": g,
            "dynamic": False}}}},
}


def _to_int4_checkpoint(hf, path, layout: str, group: int, flag: bool = False, act_order: bool = False):
    """Rewrite the checkpoint at ``path`` in ``layout``: every Linear of the decoder (attention,
    MLP, each expert; not the router or the LM head) as int4 codes; the HF model gets the weights
    the codes stand for. ``flag``: GPTQ's v1 zeros / compressed-tensors' zero points."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(11)
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    linears = {}
    for k, v in state.items():
        if ".experts." in k and k.endswith(("gate_up_proj", "down_proj")):  # transformers 5.x fused experts
            base = k.rsplit(".", 1)[0]
            for e in range(v.shape[0]):
                if k.endswith("gate_up_proj"):
                    half = v.shape[1] // 2
                    linears[f"{base}.{e}.gate_proj"], linears[f"{base}.{e}.up_proj"] = v[e, :half], v[e, half:]
                else:
                    linears[f"{base}.{e}.down_proj"] = v[e]
        elif k.endswith("_proj.weight") and k.startswith("model.layers."):
            linears[k[:-len(".weight")]] = v
    out = {k: v for k, v in state.items() if not (k[:-len(".weight")] in linears or
                                                   (".experts." in k and k.endswith(("gate_up_proj", "down_proj"))))}
    deq, orders = {}, {}
    zp = layout in ("gptq", "awq") or flag
    for name, w in linears.items():
        K = w.shape[1]
        g = group if K % group == 0 else K
        g_idx = None
        if act_order:  # one channel order per input (GPTQ's act order follows the input's Hessian)
            src = name.replace("q_proj", "in").replace("k_proj", "in").replace("v_proj", "in")
            src = src.replace("gate_proj", "in").replace("up_proj", "in")
            if src not in orders:
                orders[src] = torch.empty(K, dtype=torch.long)
                orders[src][torch.randperm(K, generator=gen)] = torch.arange(K) // g
            g_idx = orders[src]
        codes, scales, zeros, g_idx = _quantise(w, g, zp, g_idx)
        deq[name] = _dequant(codes, scales, zeros, g_idx)
        packed = (_pack_gptq(codes, scales, zeros, g_idx, flag) if layout == "gptq" else
                  _pack_awq(codes, scales, zeros, g_idx) if layout == "awq" else
                  _pack_compressed(codes, scales, zeros, g_idx, flag))
        out.update({f"{name}.{t}": v.contiguous() for t, v in packed.items()})
    with torch.no_grad():
        for name, w in deq.items():
            if ".experts." in name:
                base, e, proj = name.rsplit(".", 2)
                e = int(e)
                if proj == "down_proj":
                    hf.get_parameter(f"{base}.down_proj")[e].copy_(w)
                else:
                    p = hf.get_parameter(f"{base}.gate_up_proj")
                    half = p.shape[1] // 2
                    p[e, :half].copy_(w) if proj == "gate_proj" else p[e, half:].copy_(w)
            else:
                hf.get_parameter(f"{name}.weight").copy_(w)
    for f in glob.glob(os.path.join(path, "model*.safetensors*")):
        os.remove(f)
    save_file(out, os.path.join(path, "model.safetensors"))
    c = json.loads(open(os.path.join(path, "config.json")).read())
    c["quantization_config"] = QCONFIG[layout](group, flag, act_order)
    open(os.path.join(path, "config.json"), "w").write(json.dumps(c))
    return deq


def _run_and_compare(path, hf, cfg, packed: set):
    llm = LLM(str(path), max_num_batched_tokens=48, max_num_seqs=4)
    r = llm.runner
    assert r.weight_format == "int4" and r.unused == []
    P = r.model.params
    got = {n.split(".")[1] for n in P if n.count(".") == 1 and P[n].dtype == torch.int32}
    assert got == packed, got
    for ops in [*r.ops.values(), *r.decode_ops.values()]:  # the selector was asked for int4 there only
        for label, _, c in ops.choices:
            if c.op == "gemm":
                q = label.split(" + ")[0] in ("QKV proj", "O proj", "gate/up proj", "down proj")  # fused rows too
                assert (c.spec.weight_dtype == "int4") == q, (label, c.spec.weight_dtype)
    prompts = random_prompts(cfg.vocab, (3, 21, 60), seed=7)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    for p, o in zip(prompts, outs):
        assert o.error is None and o.token_ids == hf_greedy(hf, p, 10)
    return llm


@pytest.mark.parametrize("layout,group,flag,act_order", [
    ("gptq", 32, True, False), ("gptq", 16, False, True), ("gptq", 32, True, True),
    ("awq", 32, False, False), ("compressed", 32, False, False), ("compressed", 16, True, False)])
def test_int4_checkpoint_loads_packed_and_matches_hf(layout, group, flag, act_order, tmp_path, single_thread):
    cfg = PRESETS["tiny-llama3"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=3, tokenizer=word_tokenizer(cfg.vocab))
    _to_int4_checkpoint(hf, str(tmp_path), layout, group, flag, act_order)
    llm = _run_and_compare(tmp_path, hf, cfg, {"qkv", "o", "gate_up", "down"})
    P = llm.runner.model.params
    assert P["0.qkv.scale"].shape == (P["0.qkv"].shape[0], cfg.hidden // group)
    assert ("0.qkv.zero" in P) == (layout != "compressed" or flag)
    assert ("0.qkv.perm" in P) == act_order
    assert llm.runner.model.dequantised == []
    from opmap.harness.profile import quant_lines

    lines = quant_lines(llm)
    assert any(ln.startswith("int4 weights, decode: QKV proj, O proj") for ln in lines), lines
    assert not any("at load" in ln for ln in lines), lines


@pytest.mark.parametrize("name,packed", [("tiny-qwen3moe", {"qkv", "o", "w13", "w2"}),
                                         ("tiny-deepseek", {"o", "gate_up", "down", "w13", "w2"})])
def test_int4_moe_and_mla_checkpoints(name, packed, tmp_path, single_thread):
    """GPTQ MoE (experts per module, as GPTQ writes them) and MLA checkpoints: the attention and
    dense MLP projections packed, the routed experts packed for the grouped GEMM (the step map's
    MoE slot int4); the shared experts and MLA's low-rank projections dequantised at load, named as
    the fallback they are."""
    cfg = PRESETS[name]
    hf = save_checkpoint(cfg, str(tmp_path), seed=3, tokenizer=word_tokenizer(cfg.vocab))
    _to_int4_checkpoint(hf, str(tmp_path), "gptq", 16, True)
    llm = _run_and_compare(tmp_path, hf, cfg, packed)
    model = llm.runner.model
    deq = model.dequantised
    low_rank = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    assert not any(".experts." in n for n in deq), deq
    assert all(".shared_expert" in n or (cfg.is_mla and n.split(".")[-2] in low_rank) for n in deq), deq
    layer = next(i for i in range(cfg.layers) if f"{i}.w13" in model.params)
    P = model.params
    assert P[f"{layer}.w13"].dtype == torch.int32 and P[f"{layer}.w13_scale"].shape[-1] == cfg.hidden // 16
    assert model.expert_quant == ("int4", 16)
    moe = [r for r in llm.runner.ops["prefill"].rows if r.key == "moe"][0]
    assert moe.spec.weight_dtype == "int4" and moe.backend.name in ("triton", "reference")
    from opmap.harness.profile import quant_lines

    lines = quant_lines(llm)
    assert any(ln.startswith("int4 routed experts, ") and "MoE runs `" in ln for ln in lines), lines
    if deq:
        assert any("dequantised to fp32 at load" in ln and "fallback" in ln for ln in lines)


def test_int4_moe_act_order_experts_dequantised(tmp_path, single_thread):
    """An act-order GPTQ MoE checkpoint: each expert has its own channel order, which the grouped
    GEMM does not take, so its experts are dequantised at load (named) and the MoE slot says bf16;
    greedy tokens still match HF."""
    cfg = PRESETS["tiny-qwen3moe"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=3, tokenizer=word_tokenizer(cfg.vocab))
    _to_int4_checkpoint(hf, str(tmp_path), "gptq", 16, True, True)
    llm = _run_and_compare(tmp_path, hf, cfg, {"qkv", "o"})
    assert llm.runner.model.expert_quant is None
    assert any(".experts." in n for n in llm.runner.model.dequantised)


@pytest.mark.parametrize("zero_point", [False, True])
def test_compressed_tensors_checkpoint_matches_transformers_own_load(zero_point, tmp_path, single_thread):
    """The compressed-tensors W4A16 checkpoint as transformers itself loads it (decompressed by the
    compressed-tensors package, run_compressed=False on a CPU): the weights this file's reference
    gives, exactly, and the same greedy tokens as opmap's packed engine."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    cfg = PRESETS["tiny-llama3"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=3, tokenizer=word_tokenizer(cfg.vocab))
    deq = _to_int4_checkpoint(hf, str(tmp_path), "compressed", 32, zero_point)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, quantization_config=
                                                  CompressedTensorsConfig(run_compressed=False)).eval()
    for name, w in deq.items():
        assert torch.equal(theirs.get_parameter(f"{name}.weight"), w), name
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4)
    prompts = random_prompts(cfg.vocab, (5, 30), seed=9)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(theirs, p, 8)


def test_awq_packing_is_autoawqs():
    """This file's AWQ packing against compressed-tensors' AutoAWQ converter (its unpack and
    reverse order), so the loader is tested on the real layout."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (24, 64), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (24, 2), generator=g, dtype=torch.uint8)
    p = _pack_awq(codes, torch.ones(24, 2), zeros, None)
    iw, iz = AutoAWQConverter.unpack_awq(p["qweight"].contiguous(), p["qzeros"].contiguous(), 4)
    iw, iz = AutoAWQConverter.reverse_awq_order(iw, iz, 4)
    assert torch.equal((iw & 0xF).t().to(torch.uint8), codes) and torch.equal((iz & 0xF).t().to(torch.uint8), zeros)


def test_damaged_int4_tensors_are_named(tmp_path):
    """A qweight of the wrong shape, or stored as float, and q / k / v with different act orders
    (their fused GEMM reads one permuted input), are InputErrors naming the tensors."""
    from safetensors.torch import load_file, save_file

    cfg = PRESETS["tiny-llama3"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=3)
    _to_int4_checkpoint(hf, str(tmp_path), "gptq", 32, True, act_order=True)
    f = os.path.join(tmp_path, "model.safetensors")
    state = load_file(f)
    key = "model.layers.0.self_attn.k_proj.qweight"
    g_idx = "model.layers.0.self_attn.v_proj.g_idx"
    for name, bad, words in ((key, state[key][:-1].contiguous(), "shape"), (key, state[key].float(), "int32"),
                             (g_idx, state[g_idx].flip(0).contiguous(), "act-order")):
        save_file({**state, name: bad}, f)
        with pytest.raises(InputError, match=words):
            LLM(str(tmp_path))
    # a projection left unquantised beside int4 ones (an ignore list): named, not run on int4 kernels
    o = "model.layers.1.self_attn.o_proj"
    dense = {k: v for k, v in state.items() if not k.startswith(o + ".")}
    dense[o + ".weight"] = torch.randn(cfg.hidden, cfg.heads * cfg.head_dim)
    save_file(dense, f)
    with pytest.raises(InputError, match="stored unquantised"):
        LLM(str(tmp_path))


def test_quantize_int4_plans_the_int4_kernel_and_runs():
    """--quantize int4 (round to nearest, a scale per 128 input channels or one a row where K is
    smaller): the projections packed, the selector asked for int4 with that group size."""
    llm = LLM("tiny-llama3", quantize="int4", max_num_batched_tokens=48, max_num_seqs=4)
    P = llm.runner.model.params
    assert P["0.qkv"].dtype == torch.int32 and P["0.qkv.scale"].shape[1] == 1  # K = 64 < 128: one group
    for label, _, c in llm.runner.ops["prefill"].choices:
        if label == "QKV proj":
            assert c.spec.weight_dtype == "int4" and c.spec.group_size == 64
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    assert outs[0].error is None and len(outs[0].token_ids) == 4


def test_compressed_tensors_w8a16_loads_int8_and_matches_transformers(tmp_path, single_thread):
    """compressed-tensors pack-quantized W8A16 (symmetric, a scale per output channel; packed by
    compressed-tensors): the projections load as int8 with their scales for the int8 weight-only
    kernels, and greedy tokens equal transformers' own load of the checkpoint."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    cfg = PRESETS["tiny-llama3"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=3, tokenizer=word_tokenizer(cfg.vocab))
    out = {}
    for k, v in hf.state_dict().items():
        if not (k.endswith("_proj.weight") and k.startswith("model.layers.")):
            out[k] = v.contiguous()
            continue
        s = (v.abs().amax(1, keepdim=True) / 127).clamp_min(1e-8)
        q = (v / s).round().clamp(-128, 127).to(torch.int8)
        base = k[:-len(".weight")]
        out[f"{base}.weight_packed"] = pack_to_int32(q, 8)
        out[f"{base}.weight_scale"], out[f"{base}.weight_shape"] = s, torch.tensor(list(v.shape))
    for f in glob.glob(os.path.join(tmp_path, "model*.safetensors*")):
        os.remove(f)
    save_file(out, os.path.join(tmp_path, "model.safetensors"))
    c = json.loads((tmp_path / "config.json").read_text())
    c["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}}}}
    (tmp_path / "config.json").write_text(json.dumps(c))
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, quantization_config=
                                                  CompressedTensorsConfig(run_compressed=False)).eval()
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4)
    P = llm.runner.model.params
    assert llm.runner.weight_format == "int8" and llm.runner.unused == []
    assert P["0.qkv"].dtype == torch.int8 and P["0.qkv.scale"].shape == (P["0.qkv"].shape[0],)
    prompts = random_prompts(cfg.vocab, (5, 30), seed=9)
    for p, o in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))):
        assert o.token_ids == hf_greedy(theirs, p, 8)


def test_weight_floor_counts_int4_bytes_as_stored():
    """The decode floor of an int4 engine counts its projections at half a byte and their group
    scales (fp32 under --quantize int4), not at fp8's byte."""
    llm = LLM("tiny-llama3", quantize="int4", max_num_batched_tokens=48, max_num_seqs=4)
    r = llm.runner
    cfg = PRESETS["tiny-llama3"]
    assert 0.5 < r.quantised_bytes < 0.5 + 4 / 16 + 1e-9  # groups of 64 / 128 input channels here
    assert r.decode_weight_bytes(1) < cfg.decode_weight_bytes(1, 4.0, quantised=True)


def test_experts_declared_quantised_take_no_dense_memory():
    """A config whose checkpoint keeps its experts int4 declares them without memory (a GPTQ
    Mixtral's bf16 experts would not fit where its int4 codes do); random weights of that config
    allocate and quantise them, as a load would leave them."""
    import dataclasses

    from opmap.engine.model_mla import build_model

    cfg = PRESETS["tiny-qwen3moe"]
    q = dataclasses.replace(cfg, extra={**cfg.extra, "weight_quant": {"format": "int4", "layout": "gptq",
                                                                       "group_size": 16, "zero_point": True}})
    m = build_model(q, "cpu", torch.float32)
    layer = next(i for i in range(q.layers) if f"{i}.w13" in m.params)
    assert m.params[f"{layer}.w13"].is_meta and m.params[f"{layer}.w2"].is_meta
    assert not build_model(cfg, "cpu", torch.float32).params[f"{layer}.w13"].is_meta
    m.random_(seed=1)  # the experts drawn one matrix at a time and quantised at once
    assert m.params[f"{layer}.w13"].dtype == torch.int32 and m.expert_quant == ("int4", 16)
    assert m.params[f"{layer}.w13_scale"].shape == (q.num_experts, 2 * q.moe_intermediate, q.hidden // 16)
    assert f"{layer}.w13_zero" in m.params  # the config's zero points
    # the same random values as a model of the unquantised config draws, quantised
    d = build_model(cfg, "cpu", torch.float32)
    d.random_(seed=1)
    d.quantize_experts_("int4", 16, zero_point=True)
    for k in (f"{layer}.w13", f"{layer}.w2_scale", f"{layer}.w2_zero", f"{layer}.router"):
        assert torch.equal(m.params[k], d.params[k]), k


def test_int4_moe_forced_onto_the_dequantising_route(tmp_path, single_thread):
    """The routed experts of a GPTQ MoE checkpoint on the many-token route (`dequant-triton`, forced:
    the CPU ranks it below triton): greedy tokens still match HF, and the profile's quantised-path
    lines name the route as a dequantise-then-16-bit path."""
    from opmap.harness.profile import quant_lines

    cfg = PRESETS["tiny-qwen3moe"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=5, tokenizer=word_tokenizer(cfg.vocab))
    _to_int4_checkpoint(hf, str(tmp_path), "gptq", 16, True)
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4, backends={"moe": "dequant-triton"})
    assert {r.backend.name for ops in llm.runner.ops.values() for r in ops.rows if r.key == "moe"} == {"dequant-triton"}
    prompts = random_prompts(cfg.vocab, (5, 33), seed=11)
    for p, o in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))):
        assert o.error is None and o.token_ids == hf_greedy(hf, p, 8)
    lines = [ln for ln in quant_lines(llm) if "routed experts" in ln]
    assert lines and all("`dequant-triton`" in ln and "dequantise then fp32 grouped GEMM" in ln for ln in lines), lines
