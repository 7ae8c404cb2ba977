"""Engine config: HF config.json (transformers 4.x and 5.x styles) -> ModelConfig, presets round
trip, engine knobs validated; weight loading errors name the tensor."""
import json

import pytest
import torch

from opmap.core.contract import InputError
from opmap.model.hf import from_hf_config, resolve_model, to_hf_config
from opmap.engine.config import EngineConfig
from opmap.engine.weights import Loader, SafetensorsSource, StateDictSource
from opmap.model.presets import PRESETS

LLAMA3_4X = {  # the shape of Meta-Llama-3.1-8B's config.json (transformers 4.x fields)
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def test_hf_4x_config_matches_preset():
    c = from_hf_config(LLAMA3_4X, name="llama3-8b")
    p = PRESETS["llama3-8b"]
    for f in ("arch", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "rope_theta",
              "rms_eps", "max_position"):
        assert getattr(c, f) == getattr(p, f), f
    assert c.rope_scaling["rope_type"] == "llama3" and c.num_params() == p.num_params()


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3moe", "tiny-deepseek",
                                  "tiny-qwen2moe", "tiny-deepseek-v3"])
def test_hf_5x_config_round_trip(name):
    p = PRESETS[name]
    c = from_hf_config(to_hf_config(p).to_dict(), name=name)
    assert c.num_params() == p.num_params() and c.arch == p.arch and c.rope_theta == p.rope_theta
    assert (c.rope_scaling is None) == (p.rope_scaling is None)


def test_qwen3_moe_key_variants_and_unsupported_layouts():
    d = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 512, "head_dim": 16,
         "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
    c = from_hf_config(d)
    assert (c.num_experts, c.top_k, c.norm_topk_prob, c.qk_norm) == (8, 2, True, True)
    with pytest.raises(InputError, match="mlp_only_layers"):
        from_hf_config({**d, "mlp_only_layers": [0]})
    with pytest.raises(InputError, match="model_type"):
        from_hf_config({**d, "model_type": "gpt2"})


def test_resolve_model_and_engine_knobs(tmp_path):
    assert resolve_model("tiny-qwen3")[1] is None
    with pytest.raises(InputError, match="preset"):
        resolve_model("nope")
    with pytest.raises(InputError, match="config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_4X))
    cfg, path = resolve_model(str(tmp_path))
    assert path == str(tmp_path) and cfg.hidden == 4096
    for kw, arg in ((dict(page_size=12), "page_size"), (dict(max_num_seqs=0), "max_num_seqs"),
                    (dict(gpu_memory_fraction=1.5), "gpu_memory_fraction")):
        with pytest.raises(InputError, match=arg):
            EngineConfig(**kw).validate()


def test_loader_errors_name_the_tensor(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2, 3), "b": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    src = SafetensorsSource(str(tmp_path))  # no index: the file is scanned
    assert src.names() == {"a", "b"}
    L = Loader(src, "cpu", torch.float32)
    dst = torch.empty(3, 2)
    with pytest.raises(InputError, match="checkpoint tensor a"):
        L.copy(dst, "a")
    with pytest.raises(InputError, match="no tensor 'c'"):
        L.copy(dst, "c")
    fused = torch.empty(6)
    with pytest.raises(InputError, match="checkpoint tensor b: got 4 rows, expected 6 as config.json's sizes"):
        L.cat(fused, ["b"])
    L2 = Loader(StateDictSource({"x": torch.arange(6.0).view(2, 3)}), "cpu", torch.float32)
    out = torch.empty(2, 3)
    L2.copy(out, "x")
    assert out.sum() == 15 and L2.unused() == []


def test_page_size_defaults_to_64_for_mla_models_and_on_sm90():
    """MLA models get 64-token pages (the MLA decode's TMA kernel tiles 64 keys of one page), and
    every model on sm90 (the TMA prefill's 64-key tiles); others 16. An explicit page size is kept,
    and the step maps of the engine's defaults (what the report reads) follow the same."""
    from opmap.model import presets
    from opmap.engine.config import EngineConfig
    from opmap.engine.opset import planned_maps

    ds, ll = presets.PRESETS["deepseek-v2-lite"], presets.PRESETS["llama3-8b"]
    assert EngineConfig().for_model(ds).page_size == 64
    assert EngineConfig().for_model(ll).page_size == 16
    assert EngineConfig().for_model(ll, "sm90").page_size == 64
    assert EngineConfig().for_model(ll, "sm80").page_size == 16
    assert EngineConfig(page_size=32).for_model(ds, "sm90").page_size == 32
    pages = {arch: {r.spec.page_size for cfg in (ds, ll) for r in planned_maps(cfg, arch)["decode"]
                    if getattr(r.spec, "page_size", None)} for arch in ("sm90", "sm80")}
    assert pages == {"sm90": {64}, "sm80": {64, 16}}
    kept = planned_maps(ll, "sm90", EngineConfig(page_size=32))["decode"]
    assert {r.spec.page_size for r in kept if getattr(r.spec, "page_size", None)} == {32}


def test_prefill_cap_is_checked_and_keeps_the_tokens():
    """max_prefill_tokens_with_decodes: an int from 1 to the step budget (else an InputError naming
    it); a run with it gives the greedy tokens of a run without (it moves work between steps only)."""
    for bad in (0, -3, 4096, 2.5, "8"):
        with pytest.raises(InputError, match="max_prefill_tokens_with_decodes"):
            EngineConfig(max_num_batched_tokens=2048, max_prefill_tokens_with_decodes=bad).validate()
    from opmap.engine.llm import LLM
    from opmap.engine.params import SamplingParams

    prompts = [list(range(3, 9)), list(range(10, 70)), list(range(5, 45))]
    outs = {}
    for cap in (None, 8):
        llm = LLM("tiny-llama3", max_num_batched_tokens=32, max_num_seqs=4, max_prefill_tokens_with_decodes=cap)
        outs[cap] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))]
        llm.close()
    assert outs[None] == outs[8]
