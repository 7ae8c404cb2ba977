"""RoPE: cos/sin cache vs HF transformers' rope init functions (default, llama3, yarn incl.
DeepSeek mscale), reference vs HF apply_rotary_pos_emb, GPT-J layout vs a complex-number
formulation, Triton vs reference, bad input, custom op."""
import math

import pytest
import torch

from opmap.core.contract import InputError
from opmap.ops.rope import reference as ref
from opmap.kernels.rope import triton_rope as tri
from opmap.core.tolerance import assert_close

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
# DeepSeek-V2-Lite's YaRN: rope on 64 dims; mscale == mscale_all_dim gives attention factor 1.
DSV2_YARN = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
             "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}
# Plain YaRN (Qwen-style): attention factor 0.1 ln(s) + 1 folded into cos/sin.
QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
# mscale != mscale_all_dim: a non-trivial attention factor from the DeepSeek formula.
MIXED_YARN = {"rope_type": "yarn", "factor": 16.0, "mscale": 1.0, "mscale_all_dim": 0.5,
              "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2}


def _hf_inv_freq(head_dim, theta, scaling, max_pos, partial=1.0):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", "rope_theta": theta}
    params.update(scaling or {})
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=max_pos, rope_parameters=params)
    if params["rope_type"] == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg)


@pytest.mark.parametrize("head_dim,theta,scaling,max_pos,partial", [
    (128, 10000.0, None, 4096, 1.0),
    (128, 500000.0, LLAMA3, 131072, 1.0),
    (64, 10000.0, DSV2_YARN, 163840, 1.0),
    (128, 1000000.0, QWEN_YARN, 131072, 1.0),
    (128, 10000.0, MIXED_YARN, 65536, 0.5),  # partial rotary: 64 of 128 dims
])
def test_cos_sin_cache_matches_hf_rope_init(head_dim, theta, scaling, max_pos, partial):
    inv_hf, attn_hf = _hf_inv_freq(head_dim, theta, scaling, max_pos, partial)
    r = int(head_dim * partial)
    inv, attn = ref.inv_freq_and_scale(r, theta, scaling, max_pos)
    torch.testing.assert_close(inv, inv_hf.float(), rtol=1e-6, atol=0)
    assert math.isclose(attn, attn_hf, rel_tol=1e-9)
    pos = torch.tensor([0, 1, 17, 4095, max_pos - 1])
    cs = ref.cos_sin_cache(r, max_pos, theta, scaling)
    assert cs.shape == (max_pos, r) and cs.dtype == torch.float32
    ang = pos.double()[:, None] * inv_hf.double()[None, :]
    exp = torch.cat([ang.cos(), ang.sin()], -1) * attn_hf
    torch.testing.assert_close(cs[pos].double(), exp, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_neox_matches_hf_apply_rotary_pos_emb(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    T, Hq, Hk, D = 9, 4, 2, 128
    q, k = torch.randn(T, Hq, D, dtype=dtype), torch.randn(T, Hk, D, dtype=dtype)
    pos = torch.tensor([0, 3, 3, 100, 7, 4000, 1, 2, 8191])  # arbitrary order, repeats
    cs = ref.cos_sin_cache(D, 8192, 500000.0, LLAMA3)
    c, s = cs[pos, : D // 2], cs[pos, D // 2:]
    cos, sin = torch.cat([c, c], -1), torch.cat([s, s], -1)
    # HF on [T, H, D] with cos/sin [T, D] broadcast over heads; fp32 math like ours.
    qh, kh = apply_rotary_pos_emb(q.float(), k.float(), cos, sin, unsqueeze_dim=1)
    q2, k2 = q.clone(), k.clone()
    ref.rope(q2, k2, pos, cs, "neox")
    assert_close(q2, qh.to(dtype), dtype=dtype)
    assert_close(k2, kh.to(dtype), dtype=dtype)


def test_reference_partial_rotary_matches_hf_on_the_rotated_part():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(1)
    T, H, D, r = 5, 3, 128, 64
    q, k = torch.randn(T, H, D), torch.randn(T, 1, D)
    pos = torch.randint(0, 1000, (T,))
    cs = ref.cos_sin_cache(r, 1000, 10000.0, DSV2_YARN)
    c, s = cs[pos, : r // 2], cs[pos, r // 2:]
    qh, kh = apply_rotary_pos_emb(q[..., :r], k[..., :r], torch.cat([c, c], -1), torch.cat([s, s], -1))
    q2, k2 = q.clone(), k.clone()
    ref.rope(q2, k2, pos, cs, "neox")
    assert_close(q2[..., :r], qh)
    assert_close(k2[..., :r], kh)
    assert torch.equal(q2[..., r:], q[..., r:]) and torch.equal(k2[..., r:], k[..., r:])


def test_reference_gptj_is_complex_multiplication():
    # GPT-J / Meta Llama layout: (x[2i], x[2i+1]) is the complex number x[2i] + i x[2i+1],
    # multiplied by exp(i * pos * inv_freq[i]).
    torch.manual_seed(2)
    T, H, D = 6, 2, 64
    q, k = torch.randn(T, H, D, dtype=torch.float64).float(), torch.randn(T, H, D).float()
    pos = torch.randint(0, 500, (T,))
    inv, _ = ref.inv_freq_and_scale(D, 10000.0)
    rot = torch.polar(torch.ones(T, D // 2, dtype=torch.float64), pos.double()[:, None] * inv.double())
    exp = torch.view_as_real(torch.view_as_complex(q.double().reshape(T, H, D // 2, 2)) * rot[:, None]).reshape(T, H, D)
    q2, k2 = q.clone(), k.clone()
    ref.rope(q2, k2, pos, ref.cos_sin_cache(D, 500), "gptj")
    assert_close(q2, exp.float())


# (head_dim, rotary_dim): full, partial (DeepSeek 64 of 192), odd-width partial 40 of 80.
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D,r,Hq,Hk", [(128, 128, 8, 2), (192, 64, 3, 1), (80, 40, 5, 5)])
def test_triton_matches_reference(style, dtype, D, r, Hq, Hk):
    torch.manual_seed(D + r)
    T = 13
    # q and k as strided views into one fused qkv buffer (what a QKV GEMM produces).
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, dtype=dtype)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D: (Hq + Hk) * D].view(T, Hk, D)
    v_before = qkv[:, (Hq + Hk) * D:].clone()
    pos = torch.randint(0, 3000, (T,), dtype=torch.int32)
    cs = ref.cos_sin_cache(r, 3000, 500000.0, LLAMA3)
    q2, k2 = q.clone(), k.clone()
    tri.rope(q, k, pos, cs, style)
    ref.rope(q2, k2, pos.long(), cs, style)
    assert_close(q, q2)
    assert_close(k, k2)
    assert torch.equal(qkv[:, (Hq + Hk) * D:], v_before)  # v untouched


def test_triton_empty_and_single_token():
    cs = ref.cos_sin_cache(64, 16)
    q, k = torch.randn(0, 2, 64), torch.randn(0, 1, 64)
    tri.rope(q, k, torch.empty(0, dtype=torch.int64), cs, "neox")
    q, k = torch.randn(1, 32, 64, dtype=torch.float16), torch.randn(1, 8, 64, dtype=torch.float16)
    q2, k2 = q.clone(), k.clone()
    tri.rope(q, k, torch.tensor([15]), cs, "neox")
    ref.rope(q2, k2, torch.tensor([15]), cs, "neox")
    assert_close(q, q2)
    assert_close(k, k2)


@pytest.mark.parametrize("impl", [ref, tri])
def test_bad_input_is_input_error(impl):
    cs = ref.cos_sin_cache(64, 32)
    q, k, pos = torch.randn(4, 2, 64), torch.randn(4, 1, 64), torch.arange(4)
    with pytest.raises(InputError, match="style"):
        impl.rope(q, k, pos, cs, "llama")
    with pytest.raises(InputError, match="k"):
        impl.rope(q, torch.randn(4, 1, 32), pos, cs, "neox")  # mismatched head_dim
    with pytest.raises(InputError, match="k"):
        impl.rope(q, k.double(), pos, cs, "neox")
    with pytest.raises(InputError, match="positions"):
        impl.rope(q, k, pos.float(), cs, "neox")
    with pytest.raises(InputError, match="positions"):
        impl.rope(q, k, torch.tensor([0, 1, 2, 32]), cs, "neox")  # beyond the cache
    with pytest.raises(InputError, match="cos_sin"):
        impl.rope(q, k, pos, ref.cos_sin_cache(128, 32), "neox")  # rotary_dim > head_dim
    with pytest.raises(InputError, match="cos_sin"):
        impl.rope(q, k, pos, cs.half(), "neox")
    with pytest.raises(InputError, match="q"):
        impl.rope(q.transpose(1, 2).contiguous().transpose(1, 2), k, pos, cs, "neox")


def test_unknown_scaling_is_rejected():
    with pytest.raises(ValueError, match="dynamic"):
        ref.cos_sin_cache(64, 16, scaling={"rope_type": "dynamic", "factor": 2.0})


def test_custom_op_opcheck():
    import opmap  # noqa: F401  (registers torch.ops.opmap.*)

    cs = ref.cos_sin_cache(16, 8)
    args = (torch.randn(3, 2, 16), torch.randn(3, 1, 16), torch.tensor([0, 5, 7]), cs, "gptj")
    torch.library.opcheck(torch.ops.opmap.rope, args)
    q, k = args[0].clone(), args[1].clone()
    torch.ops.opmap.rope(*args)
    ref.rope(q, k, args[2], cs, "gptj")
    assert_close(args[0], q)


def test_bench_cases_providers_run_and_agree(monkeypatch):
    from opmap.harness.bench.cases import rope as bench

    monkeypatch.setattr(bench, "CASES", [(5, 4, 2, 128, 128, "neox"), (3, 2, 1, 192, 64, "gptj")])
    monkeypatch.setattr(bench, "MAX_POS", 512)
    cs = bench.cases(quick=True)
    assert [len(c.providers) for c in cs] == [2, 1]  # HF only for full-rotary NeoX
    for c in cs:
        style = "gptj" if "gptj" in c.case else "neox"
        for p in c.providers:
            inp = c.setup("cpu")
            inp["q"], inp["k"] = inp["q"].float(), inp["k"].float()  # interpreter: no bf16
            inp["hf_cos"], inp["hf_sin"] = inp["hf_cos"].float(), inp["hf_sin"].float()
            q0, k0 = inp["q"].clone(), inp["k"].clone()
            res = p.make(inp)()
            if res is not None:  # HF is out of place
                inp["q"], inp["k"] = res
            ref.rope(q0, k0, inp["pos"], inp["cs"], style)
            dt = torch.bfloat16 if p.name == "hf-transformers" else None  # HF: bf16-rounded cos/sin
            assert_close(inp["q"], q0, dtype=dt, what=f"{p.name} {c.case}")
            assert_close(inp["k"], k0, dtype=dt, what=f"{p.name} {c.case}")
