"""Model presets: shapes against the published parameter counts, tiny versions, and the step map
of one step per phase."""
import pytest

from opmap.model import presets, step
from opmap.core.specs import AttentionSpec, GemmSpec

# Total parameters as published on the models' Hugging Face pages (safetensors metadata).
PUBLISHED = {"llama3-8b": 8_030_261_248, "qwen2.5-7b": 7_615_616_512, "qwen3-8b": 8_190_735_360,
             "mixtral-8x7b": 46_702_792_704, "qwen3-30b-a3b": 30_532_122_624,
             "deepseek-v2-lite": 15_706_484_224}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shapes_match_published_parameter_counts(name):
    # Norm weights and biases are not counted (they are < 0.01% of any of these models).
    n = presets.get_preset(name).num_params()
    assert abs(n / PUBLISHED[name] - 1) < 1e-3, n


def test_decode_weight_bytes():
    """What one decode step reads: no embedding table, all experts only as rows grow."""
    llama = presets.get_preset("llama3-8b")
    assert llama.decode_weight_bytes(1) == llama.decode_weight_bytes(64) == \
        (llama.num_params() - llama.vocab * llama.hidden) * 2
    ds = presets.get_preset("deepseek-v2-lite")
    expert = 3 * ds.hidden * ds.moe_intermediate * (ds.layers - ds.first_dense_layers)
    base = ds.num_params() - ds.vocab * ds.hidden - ds.num_experts * expert
    # one row: its top_k experts (6 of 64) per MoE layer; many rows: every expert
    assert abs(ds.decode_weight_bytes(1, 1) - (base + ds.top_k * expert)) < 1e-3 * expert
    assert abs(ds.decode_weight_bytes(10_000, 1) - (base + ds.num_experts * expert)) < 1e-3 * expert
    b = [ds.decode_weight_bytes(r) for r in (1, 2, 8, 32, 256)]
    assert b == sorted(b) and b[0] < b[-1]
    # 16B parameters, of which a B=1 step reads ~2.6B
    assert 2.0e9 < ds.decode_weight_bytes(1, 1) < 3.5e9


def test_tiny_presets_keep_the_architecture():
    for name in PUBLISHED:
        cfg = presets.get_preset(name)
        tiny = [t for t in presets.PRESETS.values() if t.name.startswith("tiny-") and t.arch == cfg.arch]
        assert len(tiny) == 1, name
        t = tiny[0]
        assert t.num_params() < 500_000
        assert (t.is_moe, t.is_mla, t.rope_style, t.qk_norm) == (cfg.is_moe, cfg.is_mla, cfg.rope_style, cfg.qk_norm)
        assert t.heads % t.kv_heads == 0
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        presets.get_preset("nope")


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
@pytest.mark.parametrize("arch", ["sm90", "cpu"])
def test_step_map(name, arch):
    """The slots of one step (opmap.model.step) at the settings given: one slot per key, the forward
    pass in the step's phase, the sampler stage (decode's, uncaptured) after it at decode only."""
    cfg = presets.get_preset(name)
    pre = step.step_map(cfg, "prefill", step.StepSettings(arch=arch))
    dec = step.step_map(cfg, "decode", step.StepSettings(arch=arch, dtype="fp32", cuda_graph=True, m=3))
    for phase, m in (("prefill", pre), ("decode", dec)):
        ops = [s.op for s in m]
        assert len({s.key for s in m}) == len(m) and ops[0] == "rmsnorm"
        assert all(s.spec.phase == phase and s.spec.arch == arch for s in m)
        assert ops.count("attention") == 1 and ops.count("kv_append") == 1 and ops.count("rope") == 1
        assert ("moe" in ops) == cfg.is_moe
        assert ("activation" in ops) == (not cfg.is_moe or cfg.first_dense_layers > 0 or cfg.shared_experts > 0)
        att = next(s.spec for s in m if s.op == "attention")
        assert isinstance(att, AttentionSpec) and att.kind == ("mla" if cfg.is_mla else
                                                               "gqa" if cfg.kv_heads < cfg.heads else "mha")
        for s in m:
            if s.op in ("gemm", "moe"):
                assert s.spec.weight_dtype == s.spec.dtype  # dense weights in the model dtype
    assert not {"logits", "sampling", "grammar_mask"} & {s.op for s in pre}
    assert [s.key for s in dec][-4:] == ["penalties", "bitmask", "sample", "logprobs"]
    assert not any(s.spec.cuda_graph for s in dec[-4:])  # the sampler runs after the step's graph
    # decode captured here, prefill not; the GEMMs at the step's rows (prefill's: any)
    assert next(s.spec for s in dec if s.op == "attention").cuda_graph
    assert not next(s.spec for s in pre if s.op == "attention").cuda_graph
    lm = {ph: next(s.spec for s in m if s.key == "lm_head") for ph, m in (("prefill", pre), ("decode", dec))}
    assert isinstance(lm["decode"], GemmSpec) and lm["decode"].m == 3 and lm["prefill"].m is None
    assert lm["decode"].n == cfg.vocab


def test_step_map_quantised_weights():
    """Weight-only quantisation reaches the projections DecoderModel.quant_names quantises (the
    attention and dense MLP ones), the LM head only when asked; the router and experts keep the dtype."""
    for name, want in (("llama3-8b", {"qkv", "o", "gate_up", "down"}), ("deepseek-v3", {"o", "gate_up", "down"}),
                       ("qwen3-30b-a3b", {"qkv", "o"})):
        cfg = presets.get_preset(name)
        for head in (False, True):
            m = step.step_slots(cfg, "decode", step.StepSettings(arch="sm90", weight_quant="fp8", quant_lm_head=head))
            got = {s.key for s in m if s.op in ("gemm", "moe") and s.spec.weight_dtype == "fp8"}
            assert got == want | ({"lm_head"} if head else set()), (name, head, got)


@pytest.mark.parametrize("name", ["gemma2-9b", "gemma3-4b"])
def test_fewer_layers_keep_the_first_layer_types(name):
    """A preset cut to its first n layers (the GPU parity tests, check cases at real widths) keeps
    the first n layer types, so HF's config accepts it; fewer types than layers is refused."""
    import dataclasses

    from opmap.model.hf import to_hf_config

    full = presets.PRESETS[name]
    cut = dataclasses.replace(full, layers=8)
    assert cut.layer_types == full.layer_types[:8]
    assert [cut.window_of(i) for i in range(8)] == [full.window_of(i) for i in range(8)]
    assert len(to_hf_config(cut).layer_types) == 8
    with pytest.raises(ValueError, match="layer_types"):
        dataclasses.replace(cut, layers=9)
