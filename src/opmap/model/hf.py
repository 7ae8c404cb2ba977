"""One internal model config (``opmap.model.presets.ModelConfig``) from a preset name or a Hugging Face
``config.json``, and the way back: an HF transformers
config and a random-weight HF model for a preset, saved with ``save_pretrained`` so that tests
exercise the real checkpoint-loading path.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import logging
import math
import os
import re
from typing import Optional

import torch

from opmap.ops.gemm.quant import BLOCK_EDGES
from opmap.core.contract import InputError
from opmap.model.presets import PRESETS, ModelConfig, get_preset
from opmap.ops.rope.reference import ROPE_SCALINGS

# HF model_type -> our arch name (the presets use the same names).
HF_TYPES = {"llama": "llama", "mistral": "mistral", "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3_text", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "mixtral",
            "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "deepseek_v2": "deepseek_v2",
            "deepseek_v3": "deepseek_v3"}

# What `opmap models` says of each architecture: the config.json fields read beyond the common
# ones, and those refused at load (any other value of a refused field is an InputError naming it).
COMMON_FIELDS = ("hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, "
                 "intermediate_size, vocab_size, max_position_embeddings, rope_theta / rope_parameters "
                 "(default, linear, llama3, yarn), rms_norm_eps, tie_word_embeddings, hidden_act (silu), "
                 "quantization_config (fp8 weights with a scale per tensor or per output channel: compressed-tensors, "
                 "fp8, fbgemm_fp8; int4 weight-only: gptq, awq (GEMM), compressed-tensors pack-quantized W4A16; int8 "
                 "weight-only: compressed-tensors pack-quantized W8A16 per channel; block-wise fp8 (fp8 "
                 "weight_block_size, compressed-tensors float-quantized block) with square power-of-two blocks kept "
                 "in fp8, other blocks dequantised at load; MoE experts stay int4 / block fp8 for the grouped GEMM "
                 "except int4 with act order)")
HONOURED = {
    "llama": ("attention_bias (q/k/v/o), mlp_bias", "-"),
    "mistral": ("sliding_window (every layer)", "mlp_bias"),
    "phi3": ("the fused qkv_proj and gate_up_proj tensors, sliding_window (every layer)",
             "partial_rotary_factor != 1, longrope scaling, attention_bias, mlp_bias"),
    "gemma2": ("attn_logit_softcapping, final_logit_softcapping, query_pre_attn_scalar, sliding_window with "
               "layer_types, hidden_activation (gelu_pytorch_tanh), the four norms of a layer with 1 + w, the "
               "embedding times sqrt(hidden_size)", "attention_bias, use_bidirectional_attention"),
    "gemma3_text": ("as gemma2, with q/k norms, the sliding layers' own RoPE base (rope_parameters per layer type "
                    "or rope_local_base_freq) and the full layers' scaling", "attention_bias, "
                    "use_bidirectional_attention, a scaled RoPE on the sliding layers"),
    "qwen2": ("q/k/v biases", "use_sliding_window, mlp_bias"),
    "qwen3": ("attention_bias, q/k norms", "use_sliding_window, mlp_bias"),
    "mixtral": ("num_local_experts, num_experts_per_tok, sliding_window", "mlp_bias"),
    "qwen2_moe": ("qkv_bias, num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, "
                  "shared_expert_intermediate_size with the shared-expert gate",
                  "use_sliding_window, mlp_only_layers, decoder_sparse_step != 1, mlp_bias"),
    "qwen3_moe": ("num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, attention_bias",
                  "use_sliding_window, mlp_only_layers, decoder_sparse_step != 1, mlp_bias"),
    "deepseek_v2": ("MLA (kv_lora_rank, q_lora_rank, qk_nope/rope_head_dim, v_head_dim), n_routed_experts, "
                    "n_shared_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, "
                    "first_k_dense_replace, routed_scaling_factor, topk_method with n_group / topk_group, "
                    "yarn mscale", "mlp_bias"),
    "deepseek_v3": ("as deepseek_v2, with sigmoid routing on e_score_correction_bias (noaux_tc), rope_interleave; "
                    "num_nextn_predict_layers: the MTP layers are ignored (one token per step)",
                    "topk_method other than noaux_tc, mlp_bias"),
}


def _rope(d: dict) -> tuple[float, Optional[dict]]:
    """(theta, scaling dict or None) from either transformers 5.x ``rope_parameters`` or 4.x fields (a
    checkpoint's config.json comes through ``AutoConfig`` first: ``_through_autoconfig``);
    of the full-attention layers where the dict is per layer type (Gemma-3: ``_local_rope``)."""
    rp = d.get("rope_parameters") or {}
    if isinstance(rp, dict) and "rope_theta" not in rp and rp:  # per layer type
        rp = rp.get("full_attention") or next(iter(rp.values()))
    theta = float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))
    scaling = d.get("rope_scaling") or None
    if scaling is None and rp.get("rope_type", "default") not in ("default", None):
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    kind = (scaling.get("rope_type") or scaling.get("type")) if scaling is not None else None
    # dynamic NTK scaling changes the base only past max_position_embeddings, which the engine's
    # max_model_len never exceeds: below it HF's dynamic RoPE is the default one
    if kind in ("default", None, "dynamic"):
        return theta, None
    if kind not in ROPE_SCALINGS:
        raise InputError("config.json rope_scaling", repr(kind), "one of " + ", ".join(ROPE_SCALINGS))
    return theta, scaling


def _local_rope(d: dict) -> Optional[float]:
    """The RoPE base of Gemma-3's sliding layers (plain RoPE: another kind there is refused)."""
    rp = (d.get("rope_parameters") or {}).get("sliding_attention")
    if rp is None:
        return float(d["rope_local_base_freq"]) if d.get("rope_local_base_freq") else None
    if rp.get("rope_type", "default") != "default":
        raise InputError("config.json rope_parameters.sliding_attention", repr(rp.get("rope_type")), "'default'")
    return float(rp.get("rope_theta", 10000.0))


def from_hf_config(d: dict, name: str = "checkpoint") -> ModelConfig:
    """Our ModelConfig from the dict of an HF config.json."""
    mt = d.get("model_type")
    if mt not in HF_TYPES:
        raise InputError("config.json model_type", repr(mt), "one of " + ", ".join(HF_TYPES))
    arch = HF_TYPES[mt]
    act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    want = ("gelu_pytorch_tanh", "gelu_tanh") if mt.startswith("gemma") else ("silu", "swish")
    if act not in want:
        raise InputError("config.json hidden_act", repr(act), f"{want[0]!r} ({mt} with another activation is not "
                                                              "implemented)")
    heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    theta, scaling = _rope(d)
    kw = dict(name=name, arch=arch, hidden=hidden, layers=d["num_hidden_layers"], heads=heads,
              kv_heads=d.get("num_key_value_heads") or heads,
              head_dim=d.get("head_dim") or hidden // heads, intermediate=d["intermediate_size"],
              vocab=d["vocab_size"], max_position=d.get("max_position_embeddings", 8192),
              rope_theta=theta, rope_scaling=scaling, rms_eps=d.get("rms_norm_eps", 1e-6),
              tie_embeddings=bool(d.get("tie_word_embeddings", False)),
              attention_bias=bool(d.get("attention_bias", False)))
    if arch in ("gemma2", "gemma3_text"):
        if d.get("attention_bias") or d.get("use_bidirectional_attention"):
            raise InputError("config.json attention_bias/use_bidirectional_attention",
                             (d.get("attention_bias"), d.get("use_bidirectional_attention")), "false (Gemma-2 as released)")
        L = d["num_hidden_layers"]
        types = d.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
        kw.update(activation="gelu_tanh", embed_scale=True, norm_offset=1.0, sandwich_norms=True,
                  attn_soft_cap=d.get("attn_logit_softcapping"), final_soft_cap=d.get("final_logit_softcapping"),
                  query_scale=float(d.get("query_pre_attn_scalar") or kw["head_dim"]),
                  sliding_window=d.get("sliding_window") or None,
                  layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in types),
                  tie_embeddings=bool(d.get("tie_word_embeddings", True)))
        if arch == "gemma3_text":
            kw.update(qk_norm=True, local_rope_theta=_local_rope(d))
    if arch in ("llama", "qwen3", "qwen3_moe"):
        kw["o_bias"] = kw["attention_bias"]  # HF: o_proj has bias=config.attention_bias
    if arch in ("mistral", "mixtral", "phi3"):
        kw["sliding_window"] = d.get("sliding_window") or None  # every layer, as HF's attention does
    if arch == "phi3":
        if float(d.get("partial_rotary_factor") or 1.0) != 1.0:
            raise InputError("config.json partial_rotary_factor", d.get("partial_rotary_factor"), "1.0 (RoPE on whole heads)")
        if d.get("attention_bias"):
            raise InputError("config.json attention_bias", "true", "false (Phi-3 as released)")
    if arch in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and d.get("use_sliding_window"):
        raise InputError("config.json use_sliding_window", "true",
                         f"false ({mt}'s per-layer sliding window is not implemented)")
    if d.get("mlp_bias"):
        if arch != "llama":
            raise InputError("config.json mlp_bias", repr(d.get("mlp_bias")), f"false for {mt} (only Llama's is read)")
        kw["mlp_bias"] = True
    if arch == "qwen2":
        kw["attention_bias"] = True  # Qwen2 always has q/k/v biases (no config switch)
    if arch in ("qwen3", "qwen3_moe"):
        kw["qk_norm"] = True
    if arch == "mixtral":
        kw.update(num_experts=d["num_local_experts"], top_k=d["num_experts_per_tok"],
                  moe_intermediate=d["intermediate_size"], norm_topk_prob=True)
    if arch == "qwen2_moe":
        if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
            raise InputError("config.json mlp_only_layers/decoder_sparse_step",
                             (d.get("mlp_only_layers"), d.get("decoder_sparse_step")), "[] and 1 (all layers MoE)")
        kw.update(attention_bias=bool(d.get("qkv_bias", True)), num_experts=d["num_experts"],
                  top_k=d["num_experts_per_tok"], moe_intermediate=d["moe_intermediate_size"],
                  norm_topk_prob=bool(d.get("norm_topk_prob", False)), shared_experts=1,
                  shared_intermediate=d["shared_expert_intermediate_size"], shared_gate=True)
    if arch == "qwen3_moe":
        if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
            raise InputError("config.json mlp_only_layers/decoder_sparse_step",
                             (d.get("mlp_only_layers"), d.get("decoder_sparse_step")), "[] and 1 (all layers MoE)")
        kw.update(num_experts=d.get("num_experts") or d["num_local_experts"], top_k=d["num_experts_per_tok"],
                  moe_intermediate=d["moe_intermediate_size"], norm_topk_prob=bool(d.get("norm_topk_prob", False)))
    if arch == "deepseek_v3":
        mtp = int(d.get("num_nextn_predict_layers") or d.get("num_mtp_layers") or 0)
        kw.update(num_experts=d["n_routed_experts"], top_k=d["num_experts_per_tok"],
                  moe_intermediate=d["moe_intermediate_size"], shared_experts=d.get("n_shared_experts") or 0,
                  norm_topk_prob=bool(d.get("norm_topk_prob", True)), first_dense_layers=d.get("first_k_dense_replace", 0),
                  routed_scaling=float(d.get("routed_scaling_factor", 1.0)), n_group=d.get("n_group") or 1,
                  topk_group=d.get("topk_group") or 1, router="sigmoid_grouped", router_bias=True,
                  kv_lora_rank=d["kv_lora_rank"], q_lora_rank=d.get("q_lora_rank"),
                  qk_nope_dim=d["qk_nope_head_dim"], qk_rope_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
                  rope_style="gptj" if d.get("rope_interleave", True) else "neox",
                  head_dim=d["qk_nope_head_dim"] + d["qk_rope_head_dim"], extra={"mtp_layers": mtp})
        if d.get("topk_method", "noaux_tc") != "noaux_tc":
            raise InputError("config.json topk_method", repr(d.get("topk_method")), "'noaux_tc' (DeepSeek-V3 routing)")
    if arch == "deepseek_v2":
        kw.update(num_experts=d["n_routed_experts"], top_k=d["num_experts_per_tok"],
                  moe_intermediate=d["moe_intermediate_size"], shared_experts=d.get("n_shared_experts") or 0,
                  norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                  first_dense_layers=d.get("first_k_dense_replace", 0),
                  routed_scaling=float(d.get("routed_scaling_factor", 1.0)),
                  # group-limited routing only where HF applies it (group_limited_greedy, noaux_tc)
                  n_group=(d.get("n_group") or 1) if d.get("topk_method") in ("group_limited_greedy", "noaux_tc") else 1,
                  topk_group=(d.get("topk_group") or 1) if d.get("topk_method") in ("group_limited_greedy", "noaux_tc") else 1,
                  router="sigmoid_grouped" if d.get("topk_method") == "noaux_tc" else "softmax",
                  kv_lora_rank=d["kv_lora_rank"], q_lora_rank=d.get("q_lora_rank"),
                  qk_nope_dim=d["qk_nope_head_dim"], qk_rope_dim=d["qk_rope_head_dim"],
                  v_head_dim=d["v_head_dim"], rope_style="gptj",
                  head_dim=d["qk_nope_head_dim"] + d["qk_rope_head_dim"])
    quant = weight_quant(d)
    if quant:
        kw["extra"] = {**kw.get("extra", {}), "weight_quant": quant}
    return ModelConfig(**kw)


def weight_quant(d: dict) -> Optional[dict]:
    """The weight format of a quantised checkpoint from its ``quantization_config``: fp8 (e4m3)
    weights with one scale per tensor or per output channel, in the compressed-tensors layout
    (llm-compressor), the ``fp8`` one (AutoFP8, vLLM, and transformers' per-tensor FP8: ``weight_scale``
    or ``weight_scale_inv``, the factor that dequantises) or the ``fbgemm_fp8`` one (a scale per
    output channel) -> {"format": "fp8", "strategy", "ignore", "static_activation_scales",
    "kv_scales"}; with a ``kv_cache_scheme`` only, {"format": None, "kv_scales": True}; None when
    unquantised. ``kv_scales`` "if-present": the format names no KV scheme, the per-layer
    ``k_scale`` / ``v_scale`` (or one ``kv_scale``) are read where the checkpoint has them.
    Block-wise fp8 (``weight_block_size``, DeepSeek-V3's and Qwen3's FP8 releases; compressed-tensors'
    block strategy) -> {"format": "fp8-block", "block": [b, b], "group_size": b, ...} for square
    power-of-two blocks whose fused parts end on whole blocks, else {"format": None, "block": ...}:
    dequantised at load. Any other quantisation is refused, naming the field (it would load as wrong
    numbers)."""
    q = d.get("quantization_config")
    if not q:
        return None
    where = "config.json quantization_config"
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("activation_scheme", "dynamic") not in ("dynamic", "static") or q.get("fmt", "e4m3") != "e4m3":
            got = {k: q[k] for k in ("activation_scheme", "fmt") if k in q}
            raise InputError(where, repr(got), "e4m3 weights, a 'dynamic' or 'static' activation scheme")
        ignore = list(q.get("ignored_layers") or q.get("modules_to_not_convert") or [])
        block = q.get("weight_block_size")
        if block:
            return _fp8_blocks(block, d, f"{where}.weight_block_size", {"ignore": ignore, "kv_scales": "if-present"})
        return {"format": "fp8", "strategy": "tensor", "ignore": ignore,
                "static_activation_scales": q.get("activation_scheme") == "static", "kv_scales": "if-present"}
    if method in ("gptq", "awq"):
        return _int4_quant(q, method, where)
    if method == "fbgemm_fp8":
        return {"format": "fp8", "strategy": "channel", "ignore": list(q.get("modules_to_not_convert") or []),
                "static_activation_scales": False, "kv_scales": False}
    if method != "compressed-tensors":
        raise InputError(f"{where}.quant_method", repr(method),
                         "'compressed-tensors', 'fp8' or 'fbgemm_fp8' with fp8 weights (one scale per tensor or per "
                         "output channel), 'gptq' or 'awq' (int4) or compressed-tensors pack-quantized W4A16; other "
                         "formats are not loaded (opmap run --quantize fp8|int8|int4 quantises an unquantised "
                         "checkpoint)")
    groups = q.get("config_groups") or {}
    if len(groups) == 1 and q.get("format") == "pack-quantized":
        return _compressed_int4(q, next(iter(groups.values())), where)
    kv = q.get("kv_cache_scheme")
    if kv is not None and not (kv.get("num_bits") == 8 and kv.get("type") == "float"
                               and kv.get("strategy", "tensor") == "tensor" and not kv.get("dynamic", False)):
        raise InputError(f"{where}.kv_cache_scheme", repr(kv), "8-bit float, one static scale per tensor (k_scale, "
                         "v_scale per layer)")
    groups = q.get("config_groups") or {}
    if not groups and kv is not None:  # fp8 KV scales only: the weights are unquantised
        return {"format": None, "kv_scales": True}
    if len(groups) != 1:
        raise InputError(f"{where}.config_groups", f"{len(groups)} groups", "one group (the same scheme for every Linear)")
    g = next(iter(groups.values()))
    w = g.get("weights") or {}
    if w.get("strategy") == "block":
        return _compressed_block(q, g, w, kv, d, where)
    ok = (w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") in ("tensor", "channel")
          and w.get("symmetric", True) and not w.get("dynamic", False) and not w.get("group_size"))
    if not ok:
        got = {k: w.get(k) for k in ("num_bits", "type", "strategy", "symmetric", "dynamic", "group_size") if k in w}
        raise InputError(f"{where}.config_groups weights", repr(got), "8-bit float (e4m3), symmetric, static, with a "
                         "'tensor' or 'channel' strategy (one scale per tensor or per output channel)")
    if (g.get("targets") or ["Linear"]) != ["Linear"]:
        raise InputError(f"{where} targets", repr(g.get("targets")), "['Linear']")
    if q.get("format") not in (None, "float-quantized", "naive-quantized"):
        raise InputError(f"{where}.format", repr(q.get("format")), "'float-quantized' (fp8 tensors as stored)")
    return {"format": "fp8", "strategy": w["strategy"], "ignore": list(q.get("ignore") or []),
            "static_activation_scales": g.get("input_activations") is not None, "kv_scales": kv is not None}


def _fp8_blocks(block, d: dict, where: str, extra: dict) -> dict:
    """A block-fp8 format's dict: square power-of-two blocks whose fused parts end on whole blocks
    stay fp8 for triton-fp8-block / scaled-mm-block; other blocks are dequantised at load."""
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool)
                                                                         and b > 0 for b in block)):
        raise InputError(where, repr(block), "two positive ints (rows, columns)")
    b = block[0]
    if block[0] == block[1] and b in BLOCK_EDGES and _whole_blocks(d, b):
        return {"format": "fp8-block", "block": list(block), "group_size": b, **extra}
    # Other blocks, or fused parts that end inside a block: no kernel takes them; the weights are
    # dequantised at load (named as a fallback; --quantize fp8 then re-quantises them).
    return {"format": None, "block": list(block), **extra}


def _compressed_block(q: dict, g: dict, w: dict, kv, d: dict, where: str) -> dict:
    """compressed-tensors ``float-quantized`` with the ``block`` strategy (llm-compressor's FP8_BLOCK:
    e4m3 weights, ``weight_scale`` [ceil(N / bn), ceil(K / bk)]); its dynamic per-group fp8
    activations are what scaled-mm-block computes for many rows, and the decode kernels keep them
    16-bit (weight-only)."""
    ok = w.get("num_bits") == 8 and w.get("type") == "float" and w.get("symmetric", True) and not w.get("dynamic")
    if not ok:
        got = {k: w.get(k) for k in ("num_bits", "type", "symmetric", "dynamic") if k in w}
        raise InputError(f"{where}.config_groups weights", repr(got), "8-bit float (e4m3), symmetric, static blocks")
    if (g.get("targets") or ["Linear"]) != ["Linear"]:
        raise InputError(f"{where} targets", repr(g.get("targets")), "['Linear']")
    if q.get("format") not in (None, "float-quantized", "naive-quantized"):
        raise InputError(f"{where}.format", repr(q.get("format")), "'float-quantized' (fp8 tensors as stored)")
    a = g.get("input_activations")
    if a is not None and not (a.get("dynamic", False) and a.get("num_bits") == 8 and a.get("type") == "float"):
        raise InputError(f"{where}.config_groups input_activations", repr(a),
                         "dynamic 8-bit float (quantised per token or group at run time) or null with block weights")
    if q.get("sparsity_config"):
        raise InputError(f"{where}.sparsity_config", repr(q["sparsity_config"]), "null (dense weights)")
    return _fp8_blocks(w.get("block_structure"), d, f"{where}.config_groups weights.block_structure",
                       {"ignore": list(q.get("ignore") or []), "kv_scales": kv is not None})


def _whole_blocks(d: dict, b: int) -> bool:
    """The fused projections' parts before the last end on whole b-row blocks (q and k of the QKV
    rows, gate of gate/up): their block scales then stack into the fused weight's."""
    heads, hidden = d.get("num_attention_heads") or 1, d.get("hidden_size") or 0
    hd = d.get("head_dim") or (hidden // heads if heads else 0)
    kv = d.get("num_key_value_heads") or heads
    inter = d.get("intermediate_size") or 0
    if d.get("kv_lora_rank"):  # MLA: only O and the dense MLP are quantised projections
        return inter % b == 0
    return (heads * hd) % b == 0 and (kv * hd) % b == 0 and inter % b == 0


def _group_of(v, where: str, field: str) -> Optional[int]:
    """A format's group size: None for one group a row (-1, None, 0), else a multiple of 16."""
    if v in (None, -1, 0):
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v % 16:
        raise InputError(f"{where}.{field}", repr(v), "-1 (one scale a row) or a multiple of 16")
    return v


def _int4_quant(q: dict, method: str, where: str) -> dict:
    """GPTQ and AWQ checkpoints: 4-bit codes, a scale per group (engine/int4_formats.py reads
    their tensors)."""
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise InputError(f"{where}.bits", repr(bits), f"4 (int4 {method}; other widths are not loaded)")
    group = _group_of(q.get("group_size", q.get("q_group_size")), where, "group_size")
    ignore = list(q.get("modules_to_not_convert") or [])
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise InputError(f"{where}.version", repr(q.get("version")), "'gemm' (AutoAWQ's GEMM layout)")
        if q.get("zero_point", True) is not True:
            raise InputError(f"{where}.zero_point", repr(q.get("zero_point")), "true (AWQ's GEMM layout)")
        return {"format": "int4", "layout": "awq", "group_size": group, "zero_point": True, "ignore": ignore,
                "kv_scales": False}
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise InputError(f"{where}.checkpoint_format", repr(fmt), "'gptq' or 'gptq_v2'")
    if q.get("dynamic"):
        raise InputError(f"{where}.dynamic", "per-module overrides", "none (one scheme for every Linear)")
    if q.get("lm_head"):
        raise InputError(f"{where}.lm_head", "true", "false (a quantised LM head is not loaded)")
    return {"format": "int4", "layout": "gptq", "group_size": group, "zero_point": True, "ignore": ignore,
            "gptq_v1": fmt == "gptq", "act_order": bool(q.get("desc_act")), "kv_scales": False}


def _compressed_int4(q: dict, g: dict, where: str) -> dict:
    """compressed-tensors ``pack-quantized`` W4A16 (llm-compressor): int4 weights, a scale per
    group or per output channel, symmetric or with zero points; activations unquantised."""
    w = g.get("weights") or {}
    wg = f"{where}.config_groups weights"
    if w.get("num_bits") == 8 and w.get("type") == "int":  # W8A16: the int8 weight-only kernels
        if w.get("strategy") != "channel" or not w.get("symmetric", True) or w.get("dynamic", False):
            got = {k: w.get(k) for k in ("strategy", "symmetric", "dynamic", "group_size") if k in w}
            raise InputError(wg, repr(got), "8-bit int weights: symmetric, static, 'channel' strategy (one scale "
                             "per output channel; groups and zero points are int4's)")
        if g.get("input_activations") is not None:
            raise InputError(f"{where}.config_groups input_activations", repr(g["input_activations"]),
                             "null (weight-only: activations stay 16-bit)")
        return {"format": "int8", "layout": "compressed", "strategy": "channel", "ignore": list(q.get("ignore") or []),
                "static_activation_scales": False, "kv_scales": False}
    ok = w.get("num_bits") == 4 and w.get("type") == "int" and not w.get("dynamic", False)
    if not ok or w.get("strategy") not in ("group", "channel"):
        got = {k: w.get(k) for k in ("num_bits", "type", "strategy", "dynamic") if k in w}
        raise InputError(wg, repr(got), "4-bit int weights, static, with a 'group' or 'channel' strategy (W4A16)")
    if g.get("input_activations") is not None:
        raise InputError(f"{where}.config_groups input_activations", repr(g["input_activations"]),
                         "null (weight-only: activations stay 16-bit)")
    if (g.get("targets") or ["Linear"]) != ["Linear"]:
        raise InputError(f"{where} targets", repr(g.get("targets")), "['Linear']")
    if w.get("actorder") not in (None, "group", "weight", "static", False):
        raise InputError(f"{wg}.actorder", repr(w.get("actorder")), "null, 'group' or 'weight'")
    group = _group_of(w.get("group_size"), wg, "group_size") if w["strategy"] == "group" else None
    if w["strategy"] == "group" and group is None:
        raise InputError(f"{wg}.group_size", repr(w.get("group_size")), "a multiple of 16 with the 'group' strategy")
    if q.get("kv_cache_scheme") is not None:
        raise InputError(f"{where}.kv_cache_scheme", repr(q["kv_cache_scheme"]), "null with int4 weights")
    return {"format": "int4", "layout": "compressed", "group_size": group, "zero_point": not w.get("symmetric", True),
            # "group" (alias "dynamic") reorders the groups and stores g_idx; "weight" / "static"
            # reorder the columns only while quantising: groups stay contiguous, no g_idx
            "act_order": w.get("actorder") in ("group", "dynamic"), "ignore": list(q.get("ignore") or []),
            "kv_scales": False}


def quantised_experts(cfg) -> Optional[tuple]:
    """(format, group size or block edge) in which a quantised checkpoint's routed experts stay at
    load, read as stored by the MoE kernels, or None (unquantised, or dequantised at load): int4
    experts (group G, or None for one scale a row) unless the checkpoint has act order (each
    expert's own channel order; the grouped GEMM reads one order), block-fp8 experts where the
    intermediate size is whole blocks (gate and up rows never share a block). The step map plans
    the report's MoE slot from it; the engine also looks at the checkpoint (experts stored in 16 bits
    despite the config load as stored, and its step map then says so)."""
    wq = cfg.extra.get("weight_quant") or {}
    # an ignore entry naming the routed experts ("experts", not DeepSeek's "shared_experts" or
    # Qwen's "shared_expert"): they are stored in 16 bits
    if not cfg.is_moe or any(re.search(r"(?<!shared_)experts", str(n)) for n in wq.get("ignore") or ()):
        return None
    g = wq.get("group_size")
    if wq.get("format") == "int4" and not wq.get("act_order"):
        sizes = (cfg.hidden, cfg.moe_intermediate)
        if all(k % 16 == 0 and (g is None or k % g == 0) for k in sizes):
            return ("int4", g)
    if wq.get("format") == "fp8-block" and cfg.moe_intermediate % g == 0:
        return ("fp8-block", g)
    return None


# config.json fields by the value they must hold: sizes (ints >= 1; None allowed for the optional
# ones), and positive finite floats. Checked before transformers reads the file, so that a bad
# value is refused naming its field instead of surfacing as a tensor of a wrong size.
REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "num_experts",
                  "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group")
POSITIVE_FLOATS = ("rope_theta", "rms_norm_eps", "rope_local_base_freq")
# optional sizes where 0 means "not set", as from_hf_config reads them (the default takes over)
ZERO_IS_UNSET = ("num_key_value_heads", "head_dim", "sliding_window", "q_lora_rank", "n_group", "topk_group",
                 "num_experts", "num_local_experts", "n_routed_experts", "shared_expert_intermediate_size")


def check_fields(d: dict, path: str) -> None:
    """The common config.json fields hold values a model can have: each size an int >= 1, each
    float positive and finite, the heads a whole number of KV-head groups, the hidden size whole
    heads where no head_dim is given (an InputError naming the field otherwise)."""
    def size(f: str, v) -> None:
        # max_position_embeddings: a prompt token and a generated one
        lo = 2 if f == "max_position_embeddings" else 0 if f in ZERO_IS_UNSET else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise InputError(f"{path} {f}", repr(v), f"an integer >= {lo}")

    for f in REQUIRED_SIZES:
        if f not in d:  # transformers would take its class default: a checkpoint of another size
            raise InputError(path, f"no field {f!r}", "every field the architecture needs")
        size(f, d[f])
    for f in OPTIONAL_SIZES:
        if d.get(f) is not None:
            size(f, d[f])
    floats = [(f, d[f]) for f in POSITIVE_FLOATS if d.get(f) is not None]
    rp = d.get("rope_parameters")
    if isinstance(rp, dict):  # one dict, or one per layer type (Gemma-3)
        for key, sub in ([("rope_parameters", rp)] if "rope_theta" in rp or "rope_type" in rp else
                         [(f"rope_parameters.{k}", v) for k, v in rp.items() if isinstance(v, dict)]):
            if sub.get("rope_theta") is not None:
                floats.append((f"{key}.rope_theta", sub["rope_theta"]))
    for f, v in floats:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise InputError(f"{path} {f}", repr(v), "a positive finite number")
    heads, kv = d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"]
    if heads % kv:
        raise InputError(f"{path} num_key_value_heads", kv, f"a divisor of num_attention_heads ({heads}): "
                         "each KV head serves a whole group of query heads")
    if d.get("head_dim") is None and d["hidden_size"] % heads and d.get("model_type") not in ("deepseek_v2",
                                                                                            "deepseek_v3"):
        raise InputError(f"{path} hidden_size", d["hidden_size"], f"a multiple of num_attention_heads ({heads}), "
                         "or a head_dim field")
    k, e = d.get("num_experts_per_tok"), d.get("num_experts") or d.get("num_local_experts") or d.get("n_routed_experts")
    if k is not None and e is not None and k > e:
        raise InputError(f"{path} num_experts_per_tok", k, f"at most the {e} experts")


def resolve_model(model: str) -> tuple:
    """A preset name, a local checkpoint directory or a config.json -> (config, checkpoint dir or
    None). The one resolver of every command: a config.json alone gives the architecture with
    random weights."""
    if model in PRESETS:
        return get_preset(model), None
    if os.path.isdir(model) or (os.path.isfile(model) and os.path.basename(model).endswith(".json")):
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        if os.path.isdir(model):
            inside(model, "config.json")
        if not os.path.isfile(path):
            raise InputError("model", repr(model), "a directory with a config.json")
        d = read_json_object(path, "a config.json")
        check_fields(d, path)
        d = _through_autoconfig(d, path)
        folder = model if os.path.isdir(model) else os.path.dirname(os.path.abspath(model))
        if os.path.isdir(model):
            check_folder(model)
        try:
            cfg = from_hf_config(d, name=os.path.basename(os.path.normpath(folder)))
        except KeyError as e:
            raise InputError(path, f"no field {e.args[0]!r}", "every field the architecture needs") from None
        if os.path.isdir(model):
            cfg = _tied_as_loaded(cfg, model, path)
        return cfg, (model if os.path.isdir(model) else None)
    raise InputError("model", repr(model), "a preset (" + ", ".join(PRESETS) + "), a checkpoint directory "
                     "or a config.json")


# ---- the files of a checkpoint folder ---------------------------------------------------------------

# Weights in Python's pickle format (PyTorch's .bin / .pt, ...): unpickling runs code, so opmap
# never opens them and loads safetensors only.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def _roots(folder: str) -> list:
    """Where a checkpoint's files may live: the folder (links resolved), and for a Hugging Face
    cache snapshot (``<repo>/snapshots/<rev>``, whose files link to ``<repo>/blobs``) those blobs."""
    root = os.path.realpath(folder)
    out = [root]
    if os.path.basename(os.path.dirname(root)) == "snapshots":
        out.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    return out


def inside(folder: str, name: str) -> str:
    """``folder/name``, checked by the one path rule of a checkpoint load: the file, links and
    ``..`` resolved, lies inside the folder (or a cache snapshot's blobs); an InputError naming the
    file otherwise. Every file a load opens goes through it (``check_folder`` for the whole folder,
    the weight loader for each file of the index)."""
    path = os.path.join(folder, name)
    real = os.path.realpath(path)
    if not any(os.path.commonpath([r, real]) == r for r in _roots(folder)):
        how = "a link to" if os.path.islink(path) else "a path to"
        raise InputError(path, f"{how} {real}, outside the checkpoint directory",
                         "files inside the checkpoint directory")
    return path


def read_json_object(path: str, what: str) -> dict:
    """The JSON object in a checkpoint file (``what`` names the file's kind in the error): a file that
    cannot be read as JSON, or holds something else than an object, is an InputError naming it."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(path, "a file that is not JSON", f"{what} ({e})") from None
    if not isinstance(d, dict):
        raise InputError(path, type(d).__name__, "a JSON object")
    return d


def check_folder(folder: str) -> None:
    """Every entry of a checkpoint folder by the path rule (``inside``): transformers' tokenizer
    loading opens files by its own list, so the whole folder is checked before anything is read;
    and a folder whose weights are pickle files only is refused naming one (safetensors only)."""
    names = sorted(os.listdir(folder))
    for n in names:
        inside(folder, n)
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES) and os.path.isfile(os.path.join(folder, n))]
    if pickles and not any(n.endswith(".safetensors") for n in names):
        raise InputError(os.path.join(folder, pickles[0]), "weights in a pickle file (unpickling runs code)",
                         "*.safetensors weights (convert the checkpoint, e.g. save_pretrained(safe_serialization=True))")


HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


def _tied_as_loaded(cfg: ModelConfig, folder: str, path: str) -> ModelConfig:
    """``tie_word_embeddings`` as transformers 5.x loads the checkpoint: true with an ``lm_head.weight``
    that differs from the embedding loads that tensor as the LM head (transformers then unties
    them, with a warning); true with an equal one stays tied. False without an ``lm_head.weight``
    is refused: transformers would draw that LM head at random on every load."""
    where = _tensor_files(folder)
    if where is None:  # no readable safetensors: the weight loader names what is wrong
        return cfg
    if not cfg.tie_embeddings and HEAD not in where:
        raise InputError(f"{path} tie_word_embeddings", f"false, and the checkpoint has no {HEAD} tensor",
                         f"true (the embedding is the LM head), or a checkpoint with {HEAD}")
    if cfg.tie_embeddings and HEAD in where and not _same_tensor(where, HEAD, EMBED):
        logging.getLogger("opmap.model").warning(
            "%s: tie_word_embeddings is true, but the checkpoint's %s differs from %s: it is loaded as the LM "
            "head, as transformers does", path, HEAD, EMBED)
        return dataclasses.replace(cfg, tie_embeddings=False)
    return cfg


def _tensor_files(folder: str) -> Optional[dict]:
    """{tensor name: safetensors file} of a checkpoint folder (the index's weight map, else the
    files' own headers), or None when they cannot be read."""
    index = os.path.join(folder, "model.safetensors.index.json")
    try:
        # A file outside the folder (``inside``) is never opened here: the weight loader refuses it.
        if os.path.isfile(index):
            with open(index) as f:
                wm = json.load(f)["weight_map"]
            out = {str(k): os.path.realpath(inside(folder, str(v))) for k, v in wm.items()}
        else:
            from safetensors import safe_open  # heavy: only for a checkpoint without an index

            out = {}
            for fn in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
                fn = os.path.realpath(inside(folder, os.path.basename(fn)))
                with safe_open(fn, framework="pt") as f:
                    out.update(dict.fromkeys(f.keys(), fn))
        return out or None
    except Exception:  # noqa: BLE001 - unreadable (JSON, a damaged file): the weight loader refuses it, naming it
        return None


def _same_tensor(where: dict, a: str, b: str) -> bool:
    """Whether tensors ``a`` and ``b`` of the checkpoint hold the same values (False when one is
    missing or unreadable)."""
    # safetensors: only for a checkpoint that has both tensors
    from safetensors import safe_open

    try:
        if b not in where:
            return False
        with safe_open(where[a], framework="pt") as fa, safe_open(where[b], framework="pt") as fb:
            ta, tb = fa.get_tensor(a), fb.get_tensor(b)
        return ta.shape == tb.shape and ta.dtype == tb.dtype and torch.equal(ta, tb)
    except Exception:  # noqa: BLE001 - unreadable: loaded separately, where the loader names the fault
        return False


def _through_autoconfig(d: dict, path: str) -> dict:
    """The config.json as transformers reads it (``AutoConfig.for_model``: the defaults of the
    architecture filled in, ``rope_scaling`` and ``rope_parameters`` in the form of this
    transformers); an architecture opmap does not serve is refused first, naming the supported ones."""
    mt = d.get("model_type")
    if mt not in HF_TYPES:
        raise InputError(f"{path} model_type", repr(mt), "one of " + ", ".join(HF_TYPES))
    # heavy: transformers, for a config.json only
    from transformers import AutoConfig

    rest = {k: v for k, v in d.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(mt, **rest).to_dict()
    except Exception as e:  # noqa: BLE001 - transformers' validators raise their own error classes
        msg = " ".join(str(e).split())
        raise InputError(path, f"a config transformers refuses ({type(e).__name__}: {msg[:300]})",
                         f"a valid {mt} config") from None


# ---- the way back: HF config and model for a preset -----------------------------------------------

def _rope_parameters(cfg: ModelConfig) -> dict:
    rp = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rp.update({k: v for k, v in cfg.rope_scaling.items() if k != "type"})
    return rp


def to_hf_config(cfg: ModelConfig, **overrides):
    """The transformers config of the same model (transformers 5.x classes)."""
    # heavy: transformers, for the HF peer and parity paths only
    import transformers as T

    common = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                  num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                  max_position_embeddings=cfg.max_position, rms_norm_eps=cfg.rms_eps,
                  rope_parameters=_rope_parameters(cfg), tie_word_embeddings=cfg.tie_embeddings,
                  hidden_act="silu", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    a = cfg.arch
    if a == "llama":
        c = T.LlamaConfig(intermediate_size=cfg.intermediate, head_dim=cfg.head_dim,
                          attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias, **common)
    elif a == "mistral":
        c = T.MistralConfig(intermediate_size=cfg.intermediate, head_dim=cfg.head_dim,
                            sliding_window=cfg.sliding_window, **common)
    elif a == "gemma3_text":
        g = dict(common, hidden_act="gelu_pytorch_tanh",
                 rope_parameters={"full_attention": _rope_parameters(cfg),
                                  "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta}})
        c = T.Gemma3TextConfig(intermediate_size=cfg.intermediate, head_dim=cfg.head_dim,
                               hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=int(cfg.query_scale),
                               sliding_window=cfg.sliding_window, layer_types=[f"{t}_attention" for t in cfg.layer_types],
                               attn_logit_softcapping=cfg.attn_soft_cap, final_logit_softcapping=cfg.final_soft_cap, **g)
    elif a == "phi3":
        c = T.Phi3Config(intermediate_size=cfg.intermediate, sliding_window=cfg.sliding_window, **common)
    elif a == "qwen2":
        c = T.Qwen2Config(intermediate_size=cfg.intermediate, **common)
    elif a == "gemma2":
        g = dict(common, hidden_act="gelu_pytorch_tanh")
        c = T.Gemma2Config(intermediate_size=cfg.intermediate, head_dim=cfg.head_dim, hidden_activation="gelu_pytorch_tanh",
                           query_pre_attn_scalar=int(cfg.query_scale), sliding_window=cfg.sliding_window,
                           layer_types=[f"{t}_attention" for t in cfg.layer_types],
                           attn_logit_softcapping=cfg.attn_soft_cap, final_logit_softcapping=cfg.final_soft_cap, **g)
    elif a == "qwen3":
        c = T.Qwen3Config(intermediate_size=cfg.intermediate, head_dim=cfg.head_dim,
                          attention_bias=cfg.attention_bias, **common)
    elif a == "mixtral":
        c = T.MixtralConfig(intermediate_size=cfg.moe_intermediate, head_dim=cfg.head_dim,
                            sliding_window=cfg.sliding_window,
                            num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, **common)
    elif a == "qwen3_moe":
        c = T.Qwen3MoeConfig(intermediate_size=cfg.intermediate, head_dim=cfg.head_dim,
                             moe_intermediate_size=cfg.moe_intermediate, num_experts=cfg.num_experts,
                             num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.norm_topk_prob,
                             decoder_sparse_step=1, mlp_only_layers=[], attention_bias=cfg.attention_bias, **common)
    elif a in ("deepseek_v2", "deepseek_v3"):
        ds = dict(intermediate_size=cfg.intermediate, n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                  moe_intermediate_size=cfg.moe_intermediate, n_shared_experts=cfg.shared_experts,
                  first_k_dense_replace=cfg.first_dense_layers, norm_topk_prob=cfg.norm_topk_prob,
                  routed_scaling_factor=cfg.routed_scaling, kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank,
                  qk_nope_head_dim=cfg.qk_nope_dim, qk_rope_head_dim=cfg.qk_rope_dim, v_head_dim=cfg.v_head_dim,
                  n_group=cfg.n_group, topk_group=cfg.topk_group, **common)
        if a == "deepseek_v2":
            c = T.DeepseekV2Config(topk_method="group_limited_greedy" if cfg.n_group > 1 else "greedy", **ds)
        else:
            c = T.DeepseekV3Config(rope_interleave=cfg.rope_style == "gptj", **ds)
    elif a == "qwen2_moe":
        c = T.Qwen2MoeConfig(intermediate_size=cfg.intermediate, moe_intermediate_size=cfg.moe_intermediate,
                             shared_expert_intermediate_size=cfg.shared_width, num_experts=cfg.num_experts,
                             num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
                             mlp_only_layers=[], qkv_bias=cfg.attention_bias, **common)
    else:
        raise ValueError(f"no HF config for arch {a!r}")
    for k, v in overrides.items():
        setattr(c, k, v)
    got = getattr(c, "rope_parameters", None) or {}
    got = got.get("full_attention", got)  # per layer type (Gemma-3)
    if float(got.get("rope_theta", -1)) != float(cfg.rope_theta):
        # A transformers without rope_parameters would silently keep its default theta.
        raise RuntimeError(f"transformers {T.__version__} did not take rope_parameters (got {got!r}); "
                           "this helper needs transformers 5.x")
    return c


def make_hf_model(cfg: ModelConfig, seed: int = 0, dtype=None, device="cpu", std: float = 0.05):
    """A random-weight HF model of ``cfg``. Every parameter is drawn (biases included: HF inits
    them to zero, which would leave the bias path untested); norm weights are drawn around 1."""
    # heavy: transformers, for the HF peer and parity paths only
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    hf_cfg = to_hf_config(cfg)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * r)
            else:
                p.copy_(std * r)
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias is a buffer (zeros at init)
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g, device=device, dtype=torch.float32))
    return model.eval()


def save_checkpoint(cfg: ModelConfig, path: str, seed: int = 0, tokenizer=None, max_shard_size="200KB"):
    """Save a random HF model of ``cfg`` (sharded, with its index) and an optional
    ``tokenizers.Tokenizer`` as tokenizer.json. Returns the HF model (for parity runs)."""
    model = make_hf_model(cfg, seed=seed)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save(os.path.join(path, "tokenizer.json"))
    return model


def with_overrides(cfg: ModelConfig, **kw) -> ModelConfig:
    return dataclasses.replace(cfg, **kw)
