"""Weight-only quantisation at load (EngineConfig.quantize, ``opmap run --quantize``): the engine's
greedy tokens == HF transformers' on the same checkpoint with those projections replaced by their
dequantised weights (fp32 on the CPU: the same products), for a dense, an MoE and an MLA model;
the selector is asked for the quantised weight dtype of exactly those projections."""
import pytest
import torch

from opmap.core.contract import InputError
from opmap.model.hf import save_checkpoint
from opmap.engine.llm import LLM
from opmap.engine.params import SamplingParams
from opmap.model.presets import PRESETS

from test_engine_util import hf_greedy, random_prompts, single_thread, word_tokenizer  # noqa: F401


def _dequantised_into_hf(hf, params, cfg):
    """Copy the engine's dequantised projections into the HF model (our fused rows split back)."""
    layers = hf.model.layers
    for name in [n[:-len(".scale")] for n in params if n.endswith(".scale")]:
        w = params[name].float() * params[f"{name}.scale"][:, None]
        if name == "lm_head":
            with torch.no_grad():
                hf.lm_head.weight.copy_(w)
            continue
        i, what = name.split(".")
        att, mlp = layers[int(i)].self_attn, layers[int(i)].mlp
        if what == "qkv":
            qd, kd = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
            parts = [(att.q_proj, w[:qd]), (att.k_proj, w[qd:qd + kd]), (att.v_proj, w[qd + kd:])]
        elif what == "o":
            parts = [(att.o_proj, w)]
        elif what == "gate_up":
            parts = [(mlp.gate_proj, w[:cfg.intermediate]), (mlp.up_proj, w[cfg.intermediate:])]
        else:
            parts = [(mlp.down_proj, w)]
        for mod, t in parts:
            assert mod.weight.shape == t.shape, (name, mod.weight.shape, t.shape)
            with torch.no_grad():
                mod.weight.copy_(t)


@pytest.mark.parametrize("name,fmt,want", [("tiny-llama3", "int8", {"qkv", "o", "gate_up", "down", "lm_head"}),
                                           ("tiny-llama3", "fp8", {"qkv", "o", "gate_up", "down", "lm_head"}),
                                           ("tiny-qwen3moe", "int8", {"qkv", "o", "lm_head"}),
                                           ("tiny-deepseek", "fp8", {"o", "gate_up", "down", "lm_head"})])
def test_quantised_engine_matches_hf_on_the_dequantised_weights(name, fmt, want, tmp_path, single_thread):
    cfg = PRESETS[name]
    hf = save_checkpoint(cfg, str(tmp_path), seed=3, tokenizer=word_tokenizer(cfg.vocab))
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4, quantize=fmt)
    P = llm.runner.model.params
    quantised = [n for n in P if n.endswith(".scale")]
    assert {n[:-len(".scale")].split(".")[-1] for n in quantised} == want  # --quantize takes the LM head too
    dt = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[fmt]
    assert all(P[n[:-len(".scale")]].dtype == dt for n in quantised)
    # the selector was asked for that weight dtype, for those projections only
    for ops in [*llm.runner.ops.values(), *llm.runner.decode_ops.values()]:
        for label, _, c in ops.choices:
            if c.op == "gemm":
                # a fused row is named by its GEMM first ("gate/up proj + SiLU * mul (one launch)")
                q = label.split(" + ")[0] in ("QKV proj", "O proj", "gate/up proj", "down proj", "LM head")
                assert c.spec.weight_dtype == (fmt if q else "fp32"), (label, c.spec.weight_dtype)
    _dequantised_into_hf(hf, P, cfg)
    prompts = random_prompts(cfg.vocab, (3, 21, 60), seed=7)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    for p, o in zip(prompts, outs):
        assert o.error is None and o.token_ids == hf_greedy(hf, p, 10), name


def test_quantize_refuses_an_unknown_format():
    with pytest.raises(InputError, match="quantize"):
        LLM("tiny-llama3", quantize="int2")


# quantization_config of each fp8 layout (_to_fp8_checkpoint): the scale tensors' suffix, and the
# config (strategy: "tensor" or "channel").
LAYOUTS = {
    "compressed-tensors": ("_scale", lambda strategy: {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                  "symmetric": True, "dynamic": False},
                                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                            "symmetric": True, "dynamic": False}}}}),
    # AutoFP8 / vLLM: per-tensor weight_scale and static input_scale
    "fp8": ("_scale", lambda strategy: {"quant_method": "fp8", "activation_scheme": "static",
                                        "ignored_layers": ["lm_head"]}),
    # transformers' FineGrainedFP8 without blocks: weight_scale_inv, the same dequantising factor
    "fp8-inv": ("_scale_inv", lambda strategy: {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                "weight_block_size": None, "modules_to_not_convert": ["lm_head"]}),
    # fbgemm: a [rows, 1] weight_scale per output channel, dynamic activations
    "fbgemm_fp8": ("_scale", lambda strategy: {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                               "modules_to_not_convert": ["lm_head"]}),
}


def _to_fp8_checkpoint(hf, path, strategy, quantise_experts=False, layout="compressed-tensors"):
    """Rewrite the checkpoint at ``path`` as fp8 in ``layout`` (LAYOUTS; compressed-tensors is what
    llm-compressor writes): every projection weight in e4m3 beside its scale (one per tensor or per
    output channel) and, where the layout has one, a static ``input_scale``; the LM head kept (the
    ignore list). The HF model gets the dequantised weights, the reference of the parity."""
    suffix, qconfig = LAYOUTS[layout]
    import glob
    import json
    import os

    from safetensors.torch import save_file

    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    out = {}
    for k, v in state.items():
        # transformers 5.x keeps the experts fused ([E, rows, K] ``experts.gate_up_proj``)
        experts = ".experts." in k and k.endswith("_proj")
        if not (k.endswith("_proj.weight") and ".experts." not in k) and not (experts and quantise_experts):
            out[k] = v
            continue
        a = v.abs().amax(dim=-1, keepdim=True) if strategy == "channel" else v.abs().amax().reshape(1)
        s = (a / 448.0).clamp_min(1e-12)
        q = (v / (s if strategy == "channel" else s[0])).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[k], out[k + suffix] = q, s.float()
        if layout in ("compressed-tensors", "fp8"):
            out[k.rsplit(".", 1)[0] + ".input_scale"] = torch.ones(1)
        with torch.no_grad():
            hf.get_parameter(k).copy_(q.float() * (s if strategy == "channel" else s[0]))
    for f in glob.glob(os.path.join(path, "model*.safetensors*")):
        os.remove(f)
    save_file(out, os.path.join(path, "model.safetensors"))
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        c = json.load(f)
    c["quantization_config"] = qconfig(strategy)
    with open(cfg_path, "w") as f:
        json.dump(c, f)


@pytest.mark.parametrize("name,strategy", [("tiny-llama3", "tensor"), ("tiny-llama3", "channel"),
                                           ("tiny-qwen3moe", "channel")])
def test_fp8_checkpoint_loads_in_fp8_and_matches_hf(name, strategy, tmp_path, single_thread):
    """A compressed-tensors fp8 checkpoint: the projections stay fp8 (the per-tensor scales expanded
    to their rows, exactly), the quantised MoE experts are dequantised at load (no fp8 grouped GEMM:
    the fallback is named), the static activation scales are left out (weight-only), and the greedy
    tokens equal HF on the dequantised weights."""
    cfg = PRESETS[name]
    hf = save_checkpoint(cfg, str(tmp_path), seed=3, tokenizer=word_tokenizer(cfg.vocab))
    _to_fp8_checkpoint(hf, str(tmp_path), strategy, quantise_experts=cfg.is_moe)
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4)
    r = llm.runner
    assert r.weight_format == "fp8" and r.unused == []
    P = r.model.params
    assert P["0.qkv"].dtype == torch.float8_e4m3fn and P["0.qkv.scale"].shape == (P["0.qkv"].shape[0],)
    assert P["lm_head"].dtype == torch.float32
    from opmap.harness.profile import quant_lines

    lines = quant_lines(llm)  # what the profile and the report say of the quantised layers
    assert any(ln.startswith("fp8 weights, decode: QKV proj, O proj") for ln in lines), lines
    if cfg.is_moe:
        assert r.model.dequantised and all(".experts." in n for n in r.model.dequantised)
        assert P["1.w13"].dtype == torch.float32
        assert any("dequantised to fp32 at load" in ln and "fallback" in ln for ln in lines), lines
    else:
        assert r.model.dequantised == []
        assert not any("at load" in ln for ln in lines)
    prompts = random_prompts(cfg.vocab, (3, 21, 60), seed=7)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    for p, o in zip(prompts, outs):
        assert o.error is None and o.token_ids == hf_greedy(hf, p, 10), name
    with pytest.raises(InputError, match="already"):
        LLM(str(tmp_path), quantize="int8")


@pytest.mark.parametrize("layout,strategy", [("fp8", "tensor"), ("fp8-inv", "tensor"), ("fbgemm_fp8", "channel")])
def test_fp8_checkpoint_layouts_of_autofp8_transformers_and_fbgemm(layout, strategy, tmp_path, single_thread):
    """The other fp8 layouts with a scale per tensor or per output channel load as the
    compressed-tensors one does: the projections stay fp8 with their scales, nothing is left
    unread, and the greedy tokens equal HF's on the dequantised weights."""
    cfg = PRESETS["tiny-llama3"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=4, tokenizer=word_tokenizer(cfg.vocab))
    _to_fp8_checkpoint(hf, str(tmp_path), strategy, layout=layout)
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4)
    r = llm.runner
    assert r.weight_format == "fp8" and r.unused == [] and r.model.dequantised == []
    P = r.model.params
    assert P["0.qkv"].dtype == torch.float8_e4m3fn and P["0.o.scale"].shape == (P["0.o"].shape[0],)
    prompts = random_prompts(cfg.vocab, (3, 21, 60), seed=8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for p, o in zip(prompts, outs):
        assert o.error is None and o.token_ids == hf_greedy(hf, p, 8), layout


BLOCK_LAYOUTS = {  # (scale suffix, quantization_config of a block) of the block-fp8 layouts
    # transformers' FineGrainedFP8 (DeepSeek-V3's and Qwen3's FP8 releases)
    "fp8": ("_scale_inv", lambda block: {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                         "weight_block_size": list(block)}),
    # llm-compressor's FP8_BLOCK scheme: dynamic fp8 activations per 128-channel group
    "compressed-tensors": ("_scale", lambda block: {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                                  "block_structure": list(block), "symmetric": True,
                                                  "dynamic": False},
                                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                                            "group_size": 128, "symmetric": True,
                                                            "dynamic": True}}}}),
}


def _to_block_fp8_checkpoint(hf, path, block, experts=False, layout="fp8"):
    """Rewrite the checkpoint at ``path`` as block-wise fp8 (transformers' FineGrainedFP8 layout, as
    DeepSeek-V3's and Qwen3's FP8 releases): every projection weight in e4m3 beside a
    ``weight_scale_inv`` of one scale per ``block`` (partial blocks at the edges included); with
    ``experts`` the routed experts too, one tensor per expert and projection. The HF model gets the
    dequantised weights."""
    import glob
    import json
    import os

    from safetensors.torch import save_file

    bn, bk = block
    suffix, qconfig = BLOCK_LAYOUTS[layout]

    def quantise(v):
        N, K = v.shape
        nb, kb = -(-N // bn), -(-K // bk)
        pad = torch.zeros(nb * bn, kb * bk)
        pad[:N, :K] = v
        amax = pad.abs().reshape(nb, bn, kb, bk).amax(dim=(1, 3))
        s = (amax / 448.0).clamp_min(1e-12)
        full = s.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
        q = (v / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        return q, s.float(), q.float() * full

    out = {}
    for k, v in hf.state_dict().items():
        v = v.detach().clone().contiguous()
        if experts and ".experts." in k and k.endswith(("gate_up_proj", "down_proj")):
            # per expert and projection, as the fp8 releases store them (transformers fuses them)
            base, proj = k.rsplit(".", 1)
            with torch.no_grad():
                for e in range(v.shape[0]):
                    half = v.shape[1] // 2
                    parts = ({"gate_proj": v[e, :half], "up_proj": v[e, half:]} if proj == "gate_up_proj"
                             else {"down_proj": v[e]})
                    for name, w in parts.items():
                        q, s, deq = quantise(w)
                        out[f"{base}.{e}.{name}.weight"], out[f"{base}.{e}.{name}.weight{suffix}"] = q, s
                        p = hf.get_parameter(k)
                        if name == "up_proj":
                            p[e, half:].copy_(deq)
                        elif name == "gate_proj":
                            p[e, :half].copy_(deq)
                        else:
                            p[e].copy_(deq)
            continue
        if not (k.endswith("_proj.weight") and ".experts." not in k):
            out[k] = v
            continue
        q, s, deq = quantise(v)
        out[k], out[k + suffix] = q, s
        with torch.no_grad():
            hf.get_parameter(k).copy_(deq)
    for f in glob.glob(os.path.join(path, "model*.safetensors*")):
        os.remove(f)
    save_file(out, os.path.join(path, "model.safetensors"))
    c = json.loads(open(os.path.join(path, "config.json")).read())
    c["quantization_config"] = qconfig(block)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)


def test_block_wise_fp8_checkpoint_is_dequantised_at_load_and_named(tmp_path, single_thread):
    """Block-wise fp8 (one scale per 16 x 24 block here: partial blocks on both edges of the
    64-wide rows): no kernel takes block scales, so the projections are dequantised at load, the
    profile's lines name that fallback, and the greedy tokens equal HF's on the dequantised
    weights; --quantize fp8 then re-quantises them per output channel and runs in fp8."""
    from opmap.harness.profile import quant_lines

    cfg = PRESETS["tiny-llama3"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=5, tokenizer=word_tokenizer(cfg.vocab))
    _to_block_fp8_checkpoint(hf, str(tmp_path), (16, 24))
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4)
    r = llm.runner
    assert r.weight_format is None and r.unused == []
    assert len(r.model.dequantised) == cfg.layers * 7 and r.model.params["0.qkv"].dtype == torch.float32
    lines = quant_lines(llm)
    assert any("dequantised to fp32 at load" in ln and "fallback" in ln for ln in lines), lines
    prompts = random_prompts(cfg.vocab, (3, 21, 60), seed=9)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for p, o in zip(prompts, outs):
        assert o.error is None and o.token_ids == hf_greedy(hf, p, 8)
    requant = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4, quantize="fp8")
    assert requant.runner.weight_format == "fp8" and requant.runner.model.params["0.qkv"].dtype == torch.float8_e4m3fn
    out = requant.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert out[0].error is None and len(out[0].token_ids) == 4


@pytest.mark.parametrize("qc,words", [
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "e4m3"),
    ({"quant_method": "awq", "bits": 4, "version": "exllama"}, "version"),
    # int4 / int8 variants not loaded (tests/test_engine_int4.py loads the others)
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*mlp.*": {}}}, "dynamic"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}}, "strategy"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 128}}}},
     "channel"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
        "input_activations": {"num_bits": 8, "type": "int"}}}}, "input_activations"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}, "weights"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128], "dynamic": True}}}},
     "weights"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128]}}}}, "block_structure"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}, "input_activations": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}, "input_activations"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}, "input_activations": {
        "num_bits": 4, "type": "int", "dynamic": True}}}}, "input_activations"),
])
def test_other_quantised_checkpoints_are_refused(qc, words, tmp_path):
    import json

    from opmap.model.hf import resolve_model

    cfg = PRESETS["tiny-llama3"]
    save_checkpoint(cfg, str(tmp_path), seed=3)
    c = json.loads((tmp_path / "config.json").read_text())
    c["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(InputError, match=words):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen3moe", "tiny-gemma2"])
def test_fp8_kv_cache(name, single_thread):
    """EngineConfig.kv_cache_dtype="fp8": e4m3 caches with per-KV-head scales, the selector asked
    for kv_dtype=fp8 for the append and the attention, a page a quarter of fp32's bytes; the first
    tokens (a prefill over the fp8 cache) those of the model-dtype cache; and the scales honoured by
    both the append and the attention: scales of 2 (a power of two: the same e4m3 rounding) give
    the tokens of scales of 1 exactly, where one side ignoring them would move every score."""
    prompts = random_prompts(PRESETS[name].vocab, (5, 40, 90), seed=3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {}
    for kv, mul in ((None, 1.0), ("fp8", 1.0), ("fp8", 2.0)):
        llm = LLM(name, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_dtype=kv, seed=2)
        m = llm.runner.model
        for t in m.kv_scale_kw.values():
            t.fill_(mul)
        runs[kv, mul] = [o.token_ids for o in llm.generate(prompts, params)]
        if kv:
            assert llm.runner.kv[0][0].dtype == torch.float8_e4m3fn
            assert m.kv_bytes_per_page(16) * 4 == base_bytes
            specs = [c.spec for ops in [*llm.runner.ops.values(), *llm.runner.decode_ops.values()]
                     for _, _, c in ops.choices if c.op in ("attention", "kv_append")]
            assert specs and all(s.kv_dtype == "fp8" for s in specs)
        else:
            base_bytes = m.kv_bytes_per_page(16)
    assert [x[0] for x in runs[None, 1.0]] == [x[0] for x in runs["fp8", 1.0]], runs
    assert runs["fp8", 2.0] == runs["fp8", 1.0]


def test_fp8_kv_cache_refused_for_mla_and_unknown_dtypes():
    with pytest.raises(InputError, match="kv_cache_dtype"):
        LLM("tiny-deepseek", kv_cache_dtype="fp8")
    with pytest.raises(InputError, match="kv_cache_dtype"):
        LLM("tiny-llama3", kv_cache_dtype="int8")


def test_fp8_config_json_alone_runs_quantised_random_weights(tmp_path, single_thread):
    """The config.json of an fp8 checkpoint without its weights: random weights in that format."""
    import json

    cfg = PRESETS["tiny-llama3"]
    save_checkpoint(cfg, str(tmp_path), seed=3)
    c = json.loads((tmp_path / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}
    (tmp_path / "config.json").write_text(json.dumps(c))
    llm = LLM(str(tmp_path / "config.json"), max_num_seqs=2, max_num_batched_tokens=64)
    assert llm.runner.model.params["0.qkv"].dtype == torch.float8_e4m3fn
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert out[0].error is None and len(out[0].token_ids) == 3


@pytest.mark.parametrize("weights", [True, False])
def test_checkpoint_kv_scales(weights, tmp_path, single_thread):
    """compressed-tensors ``kv_cache_scheme``: each layer's ``self_attn.k_scale`` / ``v_scale`` become
    that layer's fp8 cache scales (with fp8 weights, and alone with unquantised ones); powers of two
    here, so the tokens are those of scales of 1."""
    import json

    from safetensors.torch import load_file, save_file

    cfg = PRESETS["tiny-llama3"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=3)
    if weights:
        _to_fp8_checkpoint(hf, str(tmp_path), "channel")
    else:
        # one file, so that the scales can be added to it
        import glob
        import os

        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        for f in glob.glob(os.path.join(str(tmp_path), "model*.safetensors*")):
            os.remove(f)
        save_file(state, str(tmp_path / "model.safetensors"))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for i in range(cfg.layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5 * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    c = json.loads((tmp_path / "config.json").read_text())
    qc = c.setdefault("quantization_config", {"quant_method": "compressed-tensors", "config_groups": {}})
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    (tmp_path / "config.json").write_text(json.dumps(c))
    llm = LLM(str(tmp_path), max_num_seqs=2, max_num_batched_tokens=64, kv_cache_dtype="fp8")
    m = llm.runner.model
    assert llm.runner.weight_format == ("fp8" if weights else None) and llm.runner.unused == []
    for i in range(cfg.layers):
        assert m.kv_kw(i)["k_scale"].tolist() == [0.5 * (i + 1)] * cfg.kv_heads
        assert m.kv_kw(i)["v_scale"].tolist() == [0.25] * cfg.kv_heads
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert out[0].error is None and len(out[0].token_ids) == 4


@pytest.mark.parametrize("names", [("k_scale", "v_scale"), ("kv_scale", "kv_scale"), None])
def test_fp8_layout_kv_scales_are_read_where_present(names, tmp_path, single_thread):
    """The ``fp8`` layout names no KV scheme: per-layer ``k_scale`` / ``v_scale`` (or the older
    single ``kv_scale``) become the fp8 cache's scales when the checkpoint has them; without them
    the cache keeps its default scales."""
    from safetensors.torch import load_file, save_file

    cfg = PRESETS["tiny-llama3"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=3)
    _to_fp8_checkpoint(hf, str(tmp_path), "tensor", layout="fp8")
    if names:
        tensors = load_file(str(tmp_path / "model.safetensors"))
        for i in range(cfg.layers):
            tensors[f"model.layers.{i}.self_attn.{names[0]}"] = torch.tensor(0.5 * (i + 1))
            tensors[f"model.layers.{i}.self_attn.{names[1]}"] = torch.tensor(0.5 * (i + 1) if names[0] == names[1]
                                                                               else 0.25)
        save_file(tensors, str(tmp_path / "model.safetensors"))
    llm = LLM(str(tmp_path), max_num_seqs=2, max_num_batched_tokens=64, kv_cache_dtype="fp8")
    m = llm.runner.model
    assert llm.runner.unused == []
    if names:
        for i in range(cfg.layers):
            assert m.kv_kw(i)["k_scale"].tolist() == [0.5 * (i + 1)] * cfg.kv_heads
            v = 0.5 * (i + 1) if names[0] == names[1] else 0.25
            assert m.kv_kw(i)["v_scale"].tolist() == [v] * cfg.kv_heads
    else:
        assert m.kv_layer_scales is None
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert out[0].error is None and len(out[0].token_ids) == 4


def test_quant_lines_name_the_kernel_and_flag_only_fallbacks():
    """The profile's quantised-layer lines: a weight-only backend is named as it is; the reference
    (which dequantises for its GEMM) is flagged as a fallback; an unquantised engine has none."""
    from types import SimpleNamespace as NS

    from opmap.harness.profile import quant_lines
    from opmap.core.registry import backends
    from opmap.core.specs import GemmSpec

    def engine(name, fmt="fp8"):
        b = next(x for x in backends("gemm") if x.name == name)
        spec = GemmSpec(m=1, n=64, k=64, dtype="bf16", weight_dtype=fmt or "bf16", phase="decode")
        ops = NS(choices=[("QKV proj", "linear", NS(op="gemm", spec=spec, backend=b))])
        runner = NS(weight_format=fmt, ops={}, decode_ops={1: ops}, model=NS(dequantised=[]), dtype=torch.bfloat16)
        return NS(runner=runner, ecfg=NS(kv_cache_dtype=None))

    for name in ("triton-wo", "gluon-wo", "gluon-wo-wgmma"):  # each weight-only kernel by its backend's name
        (wo,) = quant_lines(engine(name))
        assert wo == f"fp8 weights, decode: QKV proj run `{name}`"
    (ref,) = quant_lines(engine("reference"))
    assert "run `reference` -> fallback: the weight is dequantised for a bf16 GEMM" in ref
    (dq,) = quant_lines(engine("dequant-cublas"))
    assert "run `dequant-cublas` -> dequantise then bf16 GEMM" in dq and "fallback" not in dq
    (sm,) = quant_lines(engine("scaled-mm"))
    assert "run `scaled-mm` -> fp8 activations: each row quantised per token" in sm and "fallback" not in sm
    assert quant_lines(engine("cublas", fmt=None)) == []


def test_mixed_steps_take_the_op_set_planned_at_their_row_count(single_thread):
    """Quantised weights: an eager mixed step runs the op set planned at the power of two at or above
    its rows up to MANY_ROWS / 2 (on sm90 fp8 projections at M <= 32 on gluon-wo, at 32 < M <= 64 on
    gluon-wo-wgmma), the one planned at M = MANY_ROWS from MANY_ROWS rows (scaled-mm for fp8 on sm90,
    dequant-cublas for int8), the one planned at M unknown in between (triton-wo, the one weight-only
    kernel of any M); prefill steps and dense models keep one set. A run whose second prompt prefills
    beside the first one's decode takes them."""
    from opmap.core.select import select
    from opmap.core.specs import GemmSpec
    from opmap.model.step import QUANTISED_MIXED_ROWS
    from opmap.ops.gemm.backends import MANY_ROWS

    fp8 = dict(arch="sm90", phase="mixed", n=6144, k=4096, dtype="bf16", weight_dtype="fp8")
    assert select("gemm", GemmSpec(m=MANY_ROWS, **fp8), runtime=False).backend.name == "scaled-mm"
    int8 = dict(fp8, weight_dtype="int8")
    assert select("gemm", GemmSpec(m=MANY_ROWS, **int8)).backend.name == "dequant-cublas"
    assert select("gemm", GemmSpec(m=None, **fp8)).backend.name == "triton-wo"
    assert select("gemm", GemmSpec(m=32, **fp8), runtime=False).backend.name == "gluon-wo"
    assert select("gemm", GemmSpec(m=64, **fp8), runtime=False).backend.name == "gluon-wo-wgmma"
    llm = LLM("tiny-llama3", max_num_seqs=2, max_num_batched_tokens=256, max_model_len=512, quantize="fp8")
    run = llm.runner
    assert sorted(run.mixed_rows) == [1, 2, 4, 8, 16, 32, 64, MANY_ROWS] == list(QUANTISED_MIXED_ROWS)
    assert all(ops.m == m for m, ops in run.mixed_rows.items())
    assert run.eager_ops("mixed", MANY_ROWS) is run.mixed_rows[MANY_ROWS]
    assert run.eager_ops("mixed", 1000) is run.mixed_rows[MANY_ROWS]
    assert run.eager_ops("mixed", MANY_ROWS - 1) is run.ops["mixed"]
    assert run.eager_ops("mixed", 65) is run.ops["mixed"]
    assert run.eager_ops("mixed", 64) is run.mixed_rows[64]
    assert run.eager_ops("mixed", 33) is run.mixed_rows[64]
    assert run.eager_ops("mixed", 17) is run.mixed_rows[32]
    assert run.eager_ops("mixed", 1) is run.mixed_rows[1]
    assert run.eager_ops("prefill", 1000) is run.ops["prefill"]
    used = []
    real = run.eager_ops
    run.eager_ops = lambda phase, tokens: used.append((phase, tokens)) or real(phase, tokens)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = llm.generate([[5] * 8, [7] * 400], params)  # the second prompt in two chunks
    assert all(o.error is None and len(o.token_ids) == 4 for o in out)
    assert any(p == "mixed" and t >= MANY_ROWS for p, t in used), used
    assert LLM("tiny-llama3", max_num_seqs=2).runner.mixed_rows == {}


def test_report_names_the_mixed_step_kernel_of_every_row_count():
    """The report's mixed-step line of a quantised GEMM names, for every row count, the backend the
    engine's op set for that count (model.step.mixed_rows_of) selects."""
    import re

    from opmap.core.select import select
    from opmap.core.specs import GemmSpec
    from opmap.harness.report import _by_rows
    from opmap.model.step import mixed_rows_of

    for wd in ("fp8", "int8"):
        g = GemmSpec(arch="sm90", phase="mixed", m=None, n=6144, k=4096, dtype="bf16", weight_dtype=wd)
        line = _by_rows(g)
        spans = [(int(lo or at_least), int(hi) if hi else None, name)
                 for lo, hi, at_least, name in re.findall(r"(?:(\d+)-(\d+)|>= (\d+)): `([\w-]+)`", line)]
        assert spans[0][0] == 1 and spans[-1][1] is None, line
        for rows in range(1, 300):
            said = next(n for lo, hi, n in spans if lo <= rows and (hi is None or rows <= hi))
            runs = select("gemm", g.replace(m=mixed_rows_of(rows)), runtime=False).backend.name
            assert said == runs, (wd, rows, line)
        assert "gluon-wo" in line and "triton-wo" in line


def test_block_wise_fp8_with_square_blocks_stays_fp8(tmp_path, single_thread):
    """Block-wise fp8 with square power-of-two blocks (DeepSeek-V3's and Qwen3-FP8's 128 x 128;
    16 x 16 here): the projections stay e4m3 with their scale per block for triton-fp8-block (the
    selector asked for fp8-block with that edge), nothing dequantised at load, and the greedy
    tokens equal HF's on the dequantised weights."""
    cfg = PRESETS["tiny-llama3"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=5, tokenizer=word_tokenizer(cfg.vocab))
    _to_block_fp8_checkpoint(hf, str(tmp_path), (16, 16))
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4)
    r = llm.runner
    assert r.weight_format == "fp8-block" and r.unused == [] and r.model.dequantised == []
    P = r.model.params
    assert P["0.qkv"].dtype == torch.float8_e4m3fn and P["0.qkv.scale"].shape == (P["0.qkv"].shape[0] // 16, 4)
    for ops in [*r.ops.values(), *r.decode_ops.values()]:
        for label, _, c in ops.choices:
            if c.op == "gemm" and label != "LM head":
                assert c.spec.weight_dtype == "fp8-block" and c.spec.group_size == 16, (label, c.spec)
    prompts = random_prompts(cfg.vocab, (3, 21, 60), seed=9)
    for p, o in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))):
        assert o.error is None and o.token_ids == hf_greedy(hf, p, 8)
    # k_proj's 32 rows end inside a 64-row block: the blocks cannot stack into the fused QKV's, so the
    # checkpoint loads dequantised (the fallback, named), and still matches HF
    hf2 = save_checkpoint(cfg, str(tmp_path / "b64"), seed=5)
    _to_block_fp8_checkpoint(hf2, str(tmp_path / "b64"), (64, 64))
    llm2 = LLM(str(tmp_path / "b64"), max_num_batched_tokens=48, max_num_seqs=4)
    assert llm2.runner.weight_format is None and llm2.runner.model.dequantised
    out = llm2.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))
    assert out[0].token_ids == hf_greedy(hf2, prompts[0], 8)


@pytest.mark.parametrize("name", ["tiny-qwen3moe", "tiny-deepseek"])
def test_block_wise_fp8_moe_experts_stay_fp8(name, tmp_path, single_thread):
    """A block-fp8 MoE checkpoint with its experts quantised (DeepSeek-V3's and Qwen3-30B-A3B-FP8's
    layout): the routed experts stay e4m3 with their block scales for the grouped GEMM (the MoE
    slot asks for fp8-block), and the greedy tokens equal HF's on the dequantised weights."""
    cfg = PRESETS[name]
    hf = save_checkpoint(cfg, str(tmp_path), seed=5, tokenizer=word_tokenizer(cfg.vocab))
    _to_block_fp8_checkpoint(hf, str(tmp_path), (16, 16), experts=True)
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4)
    r = llm.runner
    assert r.unused == [] and r.model.expert_quant == ("fp8-block", 16)
    assert not any(".experts." in n for n in r.model.dequantised)
    layer = next(i for i in range(cfg.layers) if f"{i}.w13" in r.model.params)
    P = r.model.params
    assert P[f"{layer}.w13"].dtype == torch.float8_e4m3fn
    assert P[f"{layer}.w13_scale"].shape == (cfg.num_experts, 2 * cfg.moe_intermediate // 16, cfg.hidden // 16)
    moe = next(c for _, _, c in r.ops["prefill"].choices if c.op == "moe")
    assert moe.spec.weight_dtype == "fp8-block" and moe.spec.group_size == 16
    prompts = random_prompts(cfg.vocab, (3, 21, 60), seed=9)
    for p, o in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))):
        assert o.error is None and o.token_ids == hf_greedy(hf, p, 8)


def test_block_wise_fp8_moe_with_16_bit_experts_loads_them_as_stored(tmp_path, single_thread):
    """A block-fp8 MoE checkpoint whose experts are stored in 16 bits (only the projections
    quantised): the experts load as stored, the MoE slot says the model's dtype, tokens equal HF's."""
    cfg = PRESETS["tiny-qwen3moe"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=5, tokenizer=word_tokenizer(cfg.vocab))
    _to_block_fp8_checkpoint(hf, str(tmp_path), (16, 16), experts=False, layout="compressed-tensors")
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4)
    r = llm.runner
    assert r.weight_format == "fp8-block" and r.model.expert_quant is None and r.unused == []
    assert r.model.params["1.w13"].dtype == torch.float32
    moe = next(c for _, _, c in r.ops["prefill"].choices if c.op == "moe")
    assert moe.spec.weight_dtype == "fp32"
    prompts = random_prompts(cfg.vocab, (3, 21), seed=4)
    for p, o in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))):
        assert o.token_ids == hf_greedy(hf, p, 8)


def test_compressed_tensors_block_fp8_as_transformers_loads_it(tmp_path, single_thread):
    """llm-compressor's FP8_BLOCK layout (compressed-tensors float-quantized, block strategy):
    transformers decompresses it (the compressed-tensors package, run_compressed=False) to the
    weights this file's writer gives; opmap keeps the projections e4m3 with their block scales and
    its greedy tokens equal transformers' own load."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    cfg = PRESETS["tiny-llama3"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=6, tokenizer=word_tokenizer(cfg.vocab))
    _to_block_fp8_checkpoint(hf, str(tmp_path), (16, 16), layout="compressed-tensors")
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, quantization_config=
                                                  CompressedTensorsConfig(run_compressed=False)).eval()
    for name, p in hf.named_parameters():
        if name.endswith("_proj.weight"):
            assert torch.equal(theirs.get_parameter(name).float(), p.float()), name
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4)
    r = llm.runner
    assert r.weight_format == "fp8-block" and r.unused == [] and r.model.dequantised == []
    assert r.model.params["0.o"].dtype == torch.float8_e4m3fn
    prompts = random_prompts(cfg.vocab, (4, 25), seed=2)
    for p, o in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))):
        assert o.token_ids == hf_greedy(theirs, p, 8)


def test_block_wise_fp8_missing_scales_and_unquantised_projections_are_named(tmp_path):
    """A block-wise fp8 projection stored unquantised (an ignore list) is refused naming it (its
    re-quantisation would not be HF's numbers), and an fp8 tensor without its scale is refused
    wherever it loads, a dense parameter (MLA's kv_b) included, instead of read unscaled."""
    import os

    from safetensors.torch import load_file, save_file

    cfg = PRESETS["tiny-llama3"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=5)
    _to_block_fp8_checkpoint(hf, str(tmp_path), (16, 16))
    f = os.path.join(tmp_path, "model.safetensors")
    state = load_file(f)
    o = "model.layers.0.self_attn.o_proj.weight"
    save_file({**{k: v for k, v in state.items() if k != o + "_scale_inv"}, o: torch.randn(64, 64)}, f)
    with pytest.raises(InputError, match="stored unquantised"):
        LLM(str(tmp_path))
    save_file({k: v for k, v in state.items() if k != o + "_scale_inv"}, f)
    with pytest.raises(InputError, match="fp8 without a scale"):
        LLM(str(tmp_path))
    ds = PRESETS["tiny-deepseek"]
    hf = save_checkpoint(ds, str(tmp_path / "ds"), seed=5)
    _to_block_fp8_checkpoint(hf, str(tmp_path / "ds"), (16, 16))
    f = os.path.join(tmp_path / "ds", "model.safetensors")
    state = load_file(f)
    kvb = next(k for k in state if k.endswith("kv_b_proj.weight_scale_inv"))
    save_file({k: v for k, v in state.items() if k != kvb}, f)
    with pytest.raises(InputError, match="fp8 without a scale"):
        LLM(str(tmp_path / "ds"))


def test_many_token_steps_take_the_op_set_planned_at_many_tokens(single_thread):
    """Quantised routed experts: steps of at least many_tokens_of(cfg) rows (MANY_ROWS_AN_EXPERT rows an
    expert on average) run op sets planned at that count, whose MoE slot the selector gives the
    dequantising route on sm90 while the sets of fewer or unknown rows keep the stored-format kernel;
    a long prompt's prefill takes it. Dense models and 16-bit experts plan no such set."""
    from opmap.core.select import select
    from opmap.model.step import many_tokens_of

    cfg = PRESETS["tiny-qwen3moe"]
    many = many_tokens_of(cfg)
    llm = LLM("tiny-qwen3moe", max_num_seqs=2, max_num_batched_tokens=many + 64, max_model_len=many + 128,
              quantize="int4")
    run = llm.runner
    assert run.many_tokens == many and sorted(run.many_token_ops) == ["mixed", "prefill"]  # no graphs on the CPU
    assert all(ops.m == many for ops in run.many_token_ops.values())
    assert run.eager_ops("prefill", many) is run.many_token_ops["prefill"]
    assert run.eager_ops("mixed", many + 5) is run.many_token_ops["mixed"]
    assert run.eager_ops("prefill", many - 1) is run.ops["prefill"]
    assert run.eager_ops("mixed", many - 1) is run.mixed_rows[128]

    def moe_on_sm90(ops):
        spec = next(c.spec for _, _, c in ops.choices if c.op == "moe")
        return select("moe", spec.replace(arch="sm90"), runtime=False).backend.name

    assert moe_on_sm90(run.many_token_ops["prefill"]) == "dequant-triton"
    assert moe_on_sm90(run.ops["prefill"]) == moe_on_sm90(run.mixed_rows[128]) == "triton"
    used = []
    real = run.eager_ops
    run.eager_ops = lambda phase, tokens: used.append((phase, tokens)) or real(phase, tokens)
    out = llm.generate([[9] * (many + 8)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert out[0].error is None and len(out[0].token_ids) == 2
    assert ("prefill", many + 8) in used
    dense = LLM("tiny-llama3", max_num_seqs=2, max_num_batched_tokens=256, max_model_len=512, quantize="int4")
    assert dense.runner.many_token_ops == {} and dense.runner.many_tokens is None
    plain = LLM("tiny-qwen3moe", max_num_seqs=2, max_num_batched_tokens=many + 64, max_model_len=many + 128)
    assert plain.runner.many_token_ops == {}


def test_padded_buckets_from_many_tokens_take_the_many_token_set():
    """A padded prefill bucket from many_tokens runs the many-token op set planned for graphs, or the
    eager one where that set could not be planned (prefill graphs off); shorter buckets, and
    engines with no many-token sets, run the padded op set."""
    from types import SimpleNamespace as NS

    from opmap.engine.runner import ModelRunner

    pre, padded, graphed = object(), object(), object()
    r = NS(many_token_ops={"prefill": pre, "mixed": object()}, many_tokens=1024, padded_ops=padded)
    assert ModelRunner.padded_ops_of(r, 2048) is pre and ModelRunner.padded_ops_of(r, 1024) is pre
    assert ModelRunner.padded_ops_of(r, 1023) is padded
    r.many_token_ops["padded"] = graphed
    assert ModelRunner.padded_ops_of(r, 1024) is graphed and ModelRunner.padded_ops_of(r, 512) is padded
    assert ModelRunner.padded_ops_of(NS(many_token_ops={}, many_tokens=None, padded_ops=padded), 4096) is padded
