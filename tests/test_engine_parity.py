"""Greedy tokens of the engine == HF transformers' greedy generation, on the same random fp32
weights, loaded through the real save_pretrained -> safetensors -> engine path, per architecture."""
import dataclasses

import pytest
import torch

from opmap.model.hf import save_checkpoint
from opmap.engine.llm import LLM
from opmap.engine.params import SamplingParams
from opmap.model.presets import PRESETS

from test_engine_util import first_near_tie, hf_greedy, random_prompts, single_thread, word_tokenizer  # noqa: F401

PRESET_NAMES = ["tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-phi3", "tiny-gemma2", "tiny-gemma3", "tiny-mixtral", "tiny-qwen2moe",
                "tiny-qwen3moe", "tiny-deepseek", "tiny-deepseek-v3"]


VARIANTS = {  # layouts the presets do not cover
    "tiny-deepseek+q_lora": ("tiny-deepseek", dict(q_lora_rank=24)),  # DeepSeek-V2 / V3 query path
    "tiny-qwen2+tied": ("tiny-qwen2", dict(tie_embeddings=True)),  # small Qwen2.5: LM head = embedding
}


@pytest.mark.parametrize("name", PRESET_NAMES + list(VARIANTS))
def test_greedy_matches_hf(name, tmp_path, single_thread):
    base, kw = VARIANTS.get(name, (name, {}))
    cfg = dataclasses.replace(PRESETS[base], **kw)
    hf = save_checkpoint(cfg, str(tmp_path), seed=3, tokenizer=word_tokenizer(cfg.vocab))
    assert (tmp_path / "model.safetensors.index.json").exists()  # sharded: the index path is exercised
    # Budget 48 < the longest prompt: chunked prefill and a mixed step are part of the run.
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4)
    assert llm.runner.unused == []
    prompts = random_prompts(cfg.vocab, (3, 21, 60), seed=7)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    for p, o in zip(prompts, outs):
        ref = hf_greedy(hf, p, 10)
        assert o.error is None and o.finish_reason == "length"
        assert o.token_ids == ref, (f"{name}: engine {o.token_ids} vs HF {ref}; "
                                   f"first HF near-tie at {first_near_tie(hf, p, ref)}")
    # Every op was chosen by the selector, and on the CPU that is the fp32 reference.
    backends = {c.backend.name for ops in [*llm.runner.ops.values(), *llm.runner.decode_ops.values()]
                for _, _, c in ops.choices}
    assert backends <= {"reference", "mla-reference"}, backends


@pytest.mark.parametrize("name,param", [("tiny-deepseek-v3", "router_bias"), ("tiny-qwen2moe", "shared_gate")])
def test_the_new_moe_features_decide_tokens(name, param, tmp_path, single_thread):
    """DeepSeek-V3's router bias and Qwen2-MoE's shared-expert gate change the tokens: the parity
    above is not met by a model that ignores them."""
    cfg = PRESETS[name]
    hf = save_checkpoint(cfg, str(tmp_path), seed=3, tokenizer=word_tokenizer(cfg.vocab))
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4)
    for k, t in llm.runner.model.params.items():
        if k.endswith("." + param):
            t.zero_()
    prompts = random_prompts(cfg.vocab, (3, 21, 60), seed=7)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    assert any(o.token_ids != hf_greedy(hf, p, 10) for p, o in zip(prompts, outs))


NEW_ARCHS = ["tiny-mistral", "tiny-phi3", "tiny-gemma2", "tiny-gemma3", "tiny-qwen2moe", "tiny-deepseek-v3"]


@pytest.mark.parametrize("name", NEW_ARCHS)
def test_new_architectures_single_pages_of_64_and_preemption(name, single_thread):
    """Beyond the batch run above: each prompt alone, pages of 64 tokens, and a cache too small for
    the batch (requests preempted and recomputed), all with HF's greedy tokens."""
    from opmap.model.hf import make_hf_model
    from opmap.engine.weights import StateDictSource

    cfg = PRESETS[name]
    hf = make_hf_model(cfg, seed=6)
    prompts = random_prompts(cfg.vocab, (5, 30, 47, 12), seed=8)
    want = [hf_greedy(hf, p, 8) for p in prompts]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    state = hf.state_dict()
    alone = LLM(cfg, source=StateDictSource(state), max_num_seqs=1, num_pages=16, page_size=64)
    assert [alone.generate([p], greedy)[0].token_ids for p in prompts] == want
    small = LLM(cfg, source=StateDictSource(state), max_num_batched_tokens=32, max_num_seqs=4, num_pages=7,
                page_size=16, prefix_caching=False)
    outs = small.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == want
    assert small.stats.preemptions > 0


def _retie(path, tied: bool, drop_head: bool = False):
    """Rewrite a saved checkpoint's tie_word_embeddings (and drop its lm_head.weight)."""
    import json

    from safetensors.torch import load_file, save_file

    conf = path / "config.json"
    d = json.loads(conf.read_text())
    d["tie_word_embeddings"] = tied
    conf.write_text(json.dumps(d))
    if drop_head:
        index = path / "model.safetensors.index.json"
        m = json.loads(index.read_text())
        fn = path / m["weight_map"].pop("lm_head.weight")
        index.write_text(json.dumps(m))
        state = load_file(str(fn))
        del state["lm_head.weight"]
        save_file(state, str(fn), metadata={"format": "pt"})


def test_tied_config_with_its_own_lm_head_loads_it_as_transformers_does(tmp_path, single_thread, caplog):
    """tie_word_embeddings true beside an lm_head.weight that differs from the embedding:
    transformers 5.x unties them and loads lm_head.weight; so does the engine (greedy tokens equal)."""
    from transformers import AutoModelForCausalLM

    cfg = PRESETS["tiny-llama3"]  # untied: save_pretrained writes both tensors
    save_checkpoint(cfg, str(tmp_path), seed=3, tokenizer=word_tokenizer(cfg.vocab))
    _retie(tmp_path, True)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)  # what transformers loads
    with caplog.at_level("WARNING", logger="opmap.model"):
        llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4)
    assert not llm.cfg.tie_embeddings and "lm_head" in llm.runner.model.params
    assert any("tie_word_embeddings is true" in r.getMessage() and "lm_head.weight" in r.getMessage()
               for r in caplog.records)
    prompts = random_prompts(cfg.vocab, (3, 21, 60), seed=7)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 10)


def test_tied_config_with_an_equal_lm_head_stays_tied(tmp_path, single_thread):
    """An lm_head.weight equal to the embedding (transformers ties them): one table on the device."""
    from safetensors.torch import load_file, save_file
    import json

    cfg = PRESETS["tiny-llama3"]
    hf = save_checkpoint(cfg, str(tmp_path), seed=3, tokenizer=word_tokenizer(cfg.vocab))
    _retie(tmp_path, True)
    wm = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    fn = tmp_path / wm["lm_head.weight"]
    state = load_file(str(fn))
    state["lm_head.weight"] = hf.model.embed_tokens.weight.detach().clone()
    save_file(state, str(fn), metadata={"format": "pt"})
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, max_num_seqs=4)
    assert llm.cfg.tie_embeddings and "lm_head" not in llm.runner.model.params


def test_untied_config_without_lm_head_is_refused_naming_field_and_tensor(tmp_path):
    """tie_word_embeddings false and no lm_head.weight: transformers draws a random LM head on
    every load (nothing to match), so the load is refused in one line naming both."""
    from opmap.core.contract import InputError

    cfg = PRESETS["tiny-llama3"]
    save_checkpoint(cfg, str(tmp_path), seed=3, tokenizer=word_tokenizer(cfg.vocab))
    _retie(tmp_path, False, drop_head=True)
    with pytest.raises(InputError) as e:
        LLM(str(tmp_path))
    msg = str(e.value)
    assert "tie_word_embeddings" in msg and "lm_head.weight" in msg and "\n" not in msg
