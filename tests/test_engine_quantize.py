"""Weight-only quantisation at load (EngineConfig.quantize, ``opmap run --quantize``): the engine's
greedy tokens == HF transformers' on the same checkpoint with those projections replaced by their
dequantised weights (fp32 on the CPU: the same products), for a dense, an MoE and an MLA model;
the selector is asked for the quantised weight dtype of exactly those projections."""
import pytest
import torch

from opmap.contract import InputError
from opmap.engine.config import save_checkpoint
from opmap.engine.llm import LLM
from opmap.ops.sampling.params import SamplingParams
from opmap.presets import PRESETS

from test_engine_util import hf_greedy, random_prompts, single_thread, word_tokenizer  # noqa: F401


def _dequantised_into_hf(hf, params, cfg):
    """Copy the engine's dequantised projections into the HF model (our fused rows split back)."""
    layers = hf.model.layers
    for name in [n[:-len(".scale")] for n in params if n.endswith(".scale")]:
        i, what = name.split(".")
        w = params[name].float() * params[f"{name}.scale"][:, None]
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


@pytest.mark.parametrize("name,fmt,want", [("tiny-llama3", "int8", {"qkv", "o", "gate_up", "down"}),
                                           ("tiny-llama3", "fp8", {"qkv", "o", "gate_up", "down"}),
                                           ("tiny-qwen3moe", "int8", {"qkv", "o"}),
                                           ("tiny-deepseek", "fp8", {"o", "gate_up", "down"})])
def test_quantised_engine_matches_hf_on_the_dequantised_weights(name, fmt, want, tmp_path, single_thread):
    cfg = PRESETS[name]
    hf = save_checkpoint(cfg, str(tmp_path), seed=3, tokenizer=word_tokenizer(cfg.vocab))
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4, quantize=fmt)
    P = llm.runner.model.params
    quantised = [n for n in P if n.endswith(".scale")]
    assert {n.split(".")[1] for n in quantised} == want
    dt = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[fmt]
    assert all(P[n[:-len(".scale")]].dtype == dt for n in quantised)
    # the selector was asked for that weight dtype, for those projections only
    for ops in [*llm.runner.ops.values(), *llm.runner.decode_ops.values()]:
        for label, _, c in ops.choices:
            if c.op == "gemm":
                q = label in ("QKV proj", "O proj", "gate/up proj", "down proj")
                assert c.spec.weight_dtype == (fmt if q else "fp32"), (label, c.spec.weight_dtype)
    _dequantised_into_hf(hf, P, cfg)
    prompts = random_prompts(cfg.vocab, (3, 21, 60), seed=7)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    for p, o in zip(prompts, outs):
        assert o.error is None and o.token_ids == hf_greedy(hf, p, 10), name


def test_quantize_refuses_an_unknown_format():
    with pytest.raises(InputError, match="quantize"):
        LLM("tiny-llama3", quantize="int4")
