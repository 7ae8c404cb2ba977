"""The engine on opmap's Triton kernels (forced through the selector, run by the Triton
interpreter on the CPU): the same greedy tokens as HF transformers. This is the code path the
GPU takes, checked here for its calling conventions (strided q/k views of the fused QKV output,
split-KV workspaces, MLA absorbed decode) before any GPU time is spent."""
import dataclasses
import os

import pytest
import torch

from opmap.model.hf import make_hf_model
from opmap.engine.llm import LLM
from opmap.engine.weights import StateDictSource
from opmap.engine.params import SamplingParams
from opmap.model.presets import PRESETS

from test_engine_util import hf_greedy, random_prompts, single_thread  # noqa: F401

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                       reason="Triton needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it)"),
    # The interpreter converts 1-element arrays to scalars, which NumPy 2.x deprecates (noise only).
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


def forced(cfg) -> dict:
    f = dict(rmsnorm="triton", rope="triton", activation="triton", sampling="triton", logits="triton")
    f.update(attention="mla-triton", kv_append="mla-triton") if cfg.is_mla else f.update(attention="triton",
                                                                                      kv_append="triton")
    if cfg.is_moe:
        f["moe"] = "triton"
    return f


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-deepseek", "tiny-qwen3moe", "tiny-mistral", "tiny-deepseek-v3",
                                  "tiny-qwen2moe", "tiny-gemma2", "tiny-gemma3"])
def test_triton_path_matches_hf(name, single_thread):
    cfg = PRESETS[name]
    if cfg.arch == "qwen2_moe":  # HF derives its head_dim from the hidden size
        cfg = dataclasses.replace(cfg, hidden=128, head_dim=32)
    elif not cfg.is_mla:
        cfg = dataclasses.replace(cfg, head_dim=32)  # a head_dim the Triton attention kernels serve
    hf = make_hf_model(cfg, seed=5)
    llm = LLM(cfg, source=StateDictSource(hf.state_dict()), max_num_batched_tokens=32, max_num_seqs=4,
              backends=forced(cfg))
    chosen = {c.op: c.backend.name for ops in [*llm.runner.ops.values(), *llm.runner.decode_ops.values()]
              for _, _, c in ops.choices}
    assert chosen["attention"] in ("triton", "mla-triton") and chosen["rmsnorm"] == "triton"
    # GQA models run RoPE and the KV append as one launch (kv_append entry rope_append); MLA models
    # the latent norm, RoPE and the latent append (entry norm_rope_append_mla).
    sets = [*llm.runner.ops.values(), *llm.runner.decode_ops.values()]
    assert all((ops.rope_append is not None) != cfg.is_mla for ops in sets)
    assert all((ops.norm_rope_append is not None) == cfg.is_mla and ops.rope is None for ops in sets)
    # Qwen3's q/k norms ride in the same launch when the norm is Triton too.
    assert all(ops.qk_norm_in_rope_append == cfg.qk_norm for ops in llm.runner.decode_ops.values()) or cfg.is_mla
    # DeepSeek's shared expert sums the routed output in its down GEMM (linear_add); a gated one
    # (Qwen2-MoE) keeps its add
    assert all(("shared_down_add" in ops.gemm) == bool(cfg.shared_experts and not cfg.shared_gate) for ops in sets)
    # 40 > budget 32: a chunked prefill; 3 decoding rows pad to bucket 4 (a row of slot -1, length 0)
    prompts = random_prompts(cfg.vocab, (5, 40, 17), seed=9)
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0))
    for p, o in zip(prompts, outs):
        assert o.error is None and o.token_ids == hf_greedy(hf, p, 5)


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-deepseek"])
def test_rope_append_fusion_can_be_turned_off(name, single_thread):
    """EngineConfig.fuse_rope_append False: RoPE and the KV append (MLA: and the latent norm) as
    separate launches of the same Triton backends; the same tokens."""
    cfg = PRESETS[name]
    cfg = cfg if cfg.is_mla else dataclasses.replace(cfg, head_dim=32)
    fused_label = "kv_a norm + RoPE + latent KV append (one launch)" if cfg.is_mla else "RoPE + KV append (one launch)"
    hf = make_hf_model(cfg, seed=5)
    prompts = random_prompts(cfg.vocab, (9, 20), seed=2)
    toks = {}
    for fuse in (True, False):
        llm = LLM(cfg, source=StateDictSource(hf.state_dict()), max_num_batched_tokens=32, max_num_seqs=2,
                  backends=forced(cfg), fuse_rope_append=fuse)
        for ops in llm.runner.decode_ops.values():
            one = ops.norm_rope_append if cfg.is_mla else ops.rope_append
            assert (one is not None) == fuse and (ops.rope is None) == fuse
            labels = [label for label, _, _ in ops.choices]
            assert (fused_label in labels) == fuse and ("RoPE" in labels) == (not fuse)
        toks[fuse] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))]
        llm.close()
    assert toks[True] == toks[False] == [hf_greedy(hf, p, 4) for p in prompts]


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-deepseek", "tiny-qwen3moe"])
def test_warm_up_launches_every_kernel_variant_of_prefill_and_mixed_steps(name, single_thread):
    """After the start-up warm-up, a run's prefill and mixed steps launch no Triton kernel in a
    specialization the start-up did not (on a GPU each new one compiles inside the step, 0.2-1.5 s:
    a fresh H200's Llama-3-8B B=32 run, 3.5 s of TTFT). Decode steps are left
    out: on a GPU they replay CUDA graphs captured at start-up. The workload has the H200 run's
    shape: prompts of a quarter of the step's token budget, more requests than one step takes,
    so that prefill chunks run beside decoding rows."""
    from triton_variants import VariantRecorder

    cfg = PRESETS[name]
    if cfg.arch == "qwen2_moe":  # HF derives its head_dim from the hidden size
        cfg = dataclasses.replace(cfg, hidden=128, head_dim=32)
    elif not cfg.is_mla:
        cfg = dataclasses.replace(cfg, head_dim=32)  # a head_dim the Triton attention kernels serve
    rec = VariantRecorder().install()
    llm = LLM(cfg, max_num_batched_tokens=32, max_num_seqs=8, backends=forced(cfg), warmup=True)
    start = rec.variants()
    run = llm.runner.run

    def tracked(batch, *a, **kw):
        rec.phase = "decode" if batch.is_decode else batch.phase
        return run(batch, *a, **kw)

    llm.runner.run = tracked
    prompts = random_prompts(cfg.vocab, [8] * 4 + [7, 11, 15, 3, 20], seed=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert all(o.error is None for o in outs)
    steps = llm.stats.steps
    assert steps["prefill"] >= 1 and steps["mixed"] >= 2, steps
    new = rec.variants({"prefill", "mixed"}) - start
    assert not new, "\n".join(rec.explain(new, start))
