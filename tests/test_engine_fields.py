"""Config fields that change the math are implemented (with HF parity) or refused at load; a
checkpoint tensor that nothing reads, or one of the wrong shape, is an error, not a log line."""
import dataclasses

import pytest
import torch

from opmap.core.contract import InputError
from opmap.model.hf import from_hf_config, make_hf_model, to_hf_config
from opmap.engine.llm import LLM
from opmap.engine.weights import StateDictSource
from opmap.engine.params import SamplingParams
from opmap.model.presets import PRESETS

from test_engine_util import hf_greedy, random_prompts, single_thread  # noqa: F401

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _parity(cfg, seed=3):
    hf = make_hf_model(cfg, seed=seed)
    prompts = random_prompts(cfg.vocab, (7, 19), seed=seed)
    llm = LLM(cfg, source=StateDictSource(hf.state_dict()), max_num_seqs=2, num_pages=32, page_size=16)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [hf_greedy(hf, p, 6) for p in prompts]
    return hf


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen3", "tiny-qwen3moe"])
def test_attention_bias_with_the_output_projection_bias(name, single_thread):
    cfg = dataclasses.replace(PRESETS[name], attention_bias=True, o_bias=True)
    hf = _parity(cfg)
    assert any(n.endswith("o_proj.bias") for n, _ in hf.named_parameters())
    assert from_hf_config(to_hf_config(cfg).to_dict()).o_bias


def test_llama_mlp_bias(single_thread):
    cfg = dataclasses.replace(PRESETS["tiny-llama3"], mlp_bias=True)
    hf = _parity(cfg)
    assert any(n.endswith("down_proj.bias") for n, _ in hf.named_parameters())
    assert from_hf_config(to_hf_config(cfg).to_dict()).mlp_bias


def test_deepseek_groups_only_where_hf_routes_by_group():
    d = to_hf_config(dataclasses.replace(PRESETS["tiny-deepseek"], n_group=2, topk_group=1)).to_dict()
    assert d["topk_method"] == "group_limited_greedy" and from_hf_config(d).n_group == 2
    d.update(topk_method="greedy")
    cfg = from_hf_config(d)
    assert cfg.n_group == 1 and cfg.topk_group == 1  # HF's greedy ignores n_group


def test_refused_fields_name_themselves():
    d = to_hf_config(PRESETS["tiny-qwen2"]).to_dict()
    d.update(use_sliding_window=True)
    with pytest.raises(InputError, match="use_sliding_window"):
        from_hf_config(d)
    d = to_hf_config(PRESETS["tiny-qwen3"]).to_dict()
    d.update(mlp_bias=True)
    with pytest.raises(InputError, match="mlp_bias"):
        from_hf_config(d)


def test_unused_and_misshapen_tensors_fail_at_load(single_thread):
    cfg = PRESETS["tiny-llama3"]
    state = make_hf_model(cfg, seed=1).state_dict()
    extra = dict(state, **{"model.layers.0.self_attn.o_proj.bias": torch.zeros(cfg.hidden)})
    with pytest.raises(InputError, match="tensors nothing reads: model.layers.0.self_attn.o_proj.bias"):
        LLM(cfg, source=StateDictSource(extra), num_pages=8)
    bad = dict(state, **{"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 1)})  # would broadcast
    with pytest.raises(InputError, match="q_proj.weight"):
        LLM(cfg, source=StateDictSource(bad), num_pages=8)


def test_linear_rope_scaling_and_a_refused_kind(single_thread):
    cfg = dataclasses.replace(PRESETS["tiny-llama3"], rope_scaling={"rope_type": "linear", "factor": 4.0})
    _parity(cfg)
    d = to_hf_config(PRESETS["tiny-llama3"]).to_dict()
    d["rope_scaling"] = {"rope_type": "longrope", "factor": 2.0}
    with pytest.raises(InputError, match="rope_scaling.*'longrope'"):
        from_hf_config(d)


def test_dynamic_rope_is_the_default_within_max_position(single_thread):
    """HF's dynamic NTK RoPE rescales the base only past max_position_embeddings, which the engine's
    max_model_len never passes: parity with HF's dynamic model, through the config parser."""
    base = PRESETS["tiny-llama3"]
    hf = make_hf_model(dataclasses.replace(base, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), seed=3)
    cfg = from_hf_config(hf.config.to_dict())
    assert cfg.rope_scaling is None
    prompts = random_prompts(cfg.vocab, (7, 19), seed=3)
    llm = LLM(cfg, source=StateDictSource(hf.state_dict()), max_num_seqs=2, num_pages=32, page_size=16)
    assert llm.runner.max_model_len <= hf.config.max_position_embeddings
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [hf_greedy(hf, p, 6) for p in prompts]


@pytest.mark.parametrize("name,window", [("tiny-mistral", 8), ("tiny-mixtral", 6)])
def test_sliding_window_models(name, window, single_thread):
    """Mistral (and Mixtral with a window): every layer attends to the last W keys; prompts longer
    than the window, so the window changes the tokens (checked: the same model without it differs)."""
    cfg = dataclasses.replace(PRESETS[name], sliding_window=window)
    hf = make_hf_model(cfg, seed=4)
    prompts = random_prompts(cfg.vocab, (19, 23), seed=4)
    llm = LLM(cfg, source=StateDictSource(hf.state_dict()), max_num_seqs=2, num_pages=32, page_size=16,
              max_num_batched_tokens=16)  # chunked prefill: the window crosses chunks
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [hf_greedy(hf, p, 6) for p in prompts]
    assert from_hf_config(to_hf_config(cfg).to_dict()).sliding_window == window
    full = LLM(dataclasses.replace(cfg, sliding_window=None), source=StateDictSource(hf.state_dict()),
               max_num_seqs=2, num_pages=32, page_size=16)
    assert [o.token_ids for o in full.generate(prompts, GREEDY)] != [hf_greedy(hf, p, 6) for p in prompts]


def test_deepseek_v3_fields_and_its_mtp_head(single_thread):
    cfg = PRESETS["tiny-deepseek-v3"]
    d = to_hf_config(cfg).to_dict()
    back = from_hf_config(d)
    assert (back.router, back.router_bias, back.n_group, back.topk_group, back.routed_scaling,
            back.first_dense_layers, back.rope_style) == ("sigmoid_grouped", True, 4, 2, 2.5, 1, "gptj")
    d.update(topk_method="greedy")
    with pytest.raises(InputError, match="topk_method"):
        from_hf_config(d)
    # a checkpoint's multi-token-prediction layer (after the decoder's) is ignored when the config
    # declares it, and is an unread tensor when it does not
    state = make_hf_model(cfg, seed=1).state_dict()
    state[f"model.layers.{cfg.layers}.eh_proj.weight"] = torch.zeros(cfg.hidden, 2 * cfg.hidden)
    with pytest.raises(InputError, match="eh_proj"):
        LLM(cfg, source=StateDictSource(state), num_pages=8)
    mtp = dataclasses.replace(cfg, extra={"mtp_layers": 1})
    assert from_hf_config(dict(to_hf_config(cfg).to_dict(), num_nextn_predict_layers=1)).extra == {"mtp_layers": 1}
    assert LLM(mtp, source=StateDictSource(state), num_pages=8).runner.unused == []


def test_qwen2_moe_fields():
    back = from_hf_config(to_hf_config(PRESETS["tiny-qwen2moe"]).to_dict())
    assert (back.shared_experts, back.shared_intermediate, back.shared_gate, back.attention_bias) == (1, 48, True, True)
    d = dict(to_hf_config(PRESETS["tiny-qwen2moe"]).to_dict(), use_sliding_window=True)
    with pytest.raises(InputError, match="use_sliding_window"):
        from_hf_config(d)


def test_every_architecture_says_what_it_reads_and_another_activation_is_refused():
    from opmap.model.hf import HF_TYPES, HONOURED

    assert set(HONOURED) == set(HF_TYPES.values())
    d = dict(to_hf_config(PRESETS["tiny-llama3"]).to_dict(), hidden_act="gelu")
    with pytest.raises(InputError, match="hidden_act"):
        from_hf_config(d)


def test_gemma2_features_decide_the_output(single_thread):
    """tiny-gemma2 (3 layers: sliding window 8, full, sliding; score cap 2, logit cap 3) matches HF,
    and a model without its window, its score cap, its sandwich norms or its embedding scale does
    not; the final logit cap shows in the log-probabilities (greedy tokens cannot see a monotone cap)."""
    cfg = PRESETS["tiny-gemma2"]
    hf = make_hf_model(cfg, seed=3)
    prompts = random_prompts(cfg.vocab, (7, 19, 30), seed=3)
    want = [hf_greedy(hf, p, 6) for p in prompts]

    def run(c, **sp):
        llm = LLM(c, source=StateDictSource(hf.state_dict()), max_num_seqs=3, num_pages=32, page_size=16)
        return llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, **sp))

    assert [o.token_ids for o in run(cfg)] == want
    for wrong in (dict(layer_types=("full",) * 3), dict(attn_soft_cap=None), dict(embed_scale=False),
                  dict(query_scale=16.0)):
        got = [o.token_ids for o in run(dataclasses.replace(cfg, **wrong))]
        assert got != want, wrong
    assert from_hf_config(to_hf_config(cfg).to_dict()) == dataclasses.replace(cfg, name="checkpoint")
    # the capped logits' log-softmax at the first generated token
    o = run(cfg, logprobs=1)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[0]])).logits[0, -1].float()
    ref = torch.log_softmax(logits, -1)[want[0][0]].item()
    assert abs(o.logprobs[0]["token"] - ref) < 1e-4, (o.logprobs[0], ref)
    with torch.no_grad():
        raw = hf.lm_head(hf.model(torch.tensor([prompts[0]])).last_hidden_state)[0, -1].float()
    uncapped = torch.log_softmax(raw, -1)
    assert abs(uncapped[want[0][0]].item() - ref) > 1e-3  # the cap moved it



def test_gemma3_qk_norms_and_the_local_rope_base_decide_tokens(single_thread):
    cfg = PRESETS["tiny-gemma3"]  # sliding, sliding, full; local base 10000, the full layer's linear x4
    hf = make_hf_model(cfg, seed=4)
    prompts = random_prompts(cfg.vocab, (9, 25), seed=4)
    want = [hf_greedy(hf, p, 6) for p in prompts]

    def run(c):
        llm = LLM(c, source=StateDictSource(hf.state_dict()), max_num_seqs=2, num_pages=32, page_size=16)
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]

    assert run(cfg) == want
    assert run(dataclasses.replace(cfg, local_rope_theta=None)) != want  # one RoPE for every layer
    assert from_hf_config(to_hf_config(cfg).to_dict()) == dataclasses.replace(cfg, name="checkpoint")
    d = to_hf_config(cfg).to_dict()
    d["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(InputError, match="sliding_attention"):
        from_hf_config(d)
