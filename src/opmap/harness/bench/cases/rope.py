"""RoPE benchmark cases (bf16, Llama-3-8B heads: 32 q / 8 kv, d=128, llama3 scaling): 16k
tokens (prefill) and decode batches {1, 64} (CUDA-graph replay); GPT-J layout and DeepSeek-V2's
partial rotary (64 of 192) at 16k tokens. Peer: HF transformers' apply_rotary_pos_emb (out of
place, NeoX layout only), given cos/sin already gathered for the positions as HF does once per
forward, so only the per-layer rotation is timed.
Minimal bytes: the rotary part of q and k read and written once, plus positions and one cos/sin
row (fp32) per token."""
from __future__ import annotations

import importlib.util

import torch

from opmap.core import hw, registry
from opmap.core.specs import RopeSpec
from opmap.harness.bench.base import BenchCase, Provider
from opmap.ops.rope.reference import cos_sin_cache

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
MAX_POS = 131072
CASES = [  # (T, Hq, Hk, D, r, style)
    (16384, 32, 8, 128, 128, "neox"),
    (1, 32, 8, 128, 128, "neox"),
    (64, 32, 8, 128, 128, "neox"),
    (16384, 32, 8, 128, 128, "gptj"),
    (16384, 16, 16, 192, 64, "gptj"),
]


def _setup(T, Hq, Hk, D, r):
    def setup(device):
        qkv = torch.randn(T, (Hq + 2 * Hk) * D, device=device, dtype=torch.bfloat16)
        pos = torch.randint(0, MAX_POS, (T,), device=device)
        cs = cos_sin_cache(r, MAX_POS, 500000.0, LLAMA3, device=device)
        c, s = cs[pos, : r // 2], cs[pos, r // 2:]
        return dict(q=qkv[:, : Hq * D].view(T, Hq, D), k=qkv[:, Hq * D: (Hq + Hk) * D].view(T, Hk, D), pos=pos,
                    cs=cs, hf_cos=torch.cat([c, c], -1).to(torch.bfloat16),
                    hf_sin=torch.cat([s, s], -1).to(torch.bfloat16))

    return setup


def _ours(style):
    def make(inp):
        fn = registry.get("rope", "triton").fn("rope")
        return lambda: fn(inp["q"], inp["k"], inp["pos"], inp["cs"], style)

    return make


def _hf(inp):
    # heavy: transformers, for the HF row only
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return lambda: apply_rotary_pos_emb(inp["q"], inp["k"], inp["hf_cos"], inp["hf_sin"], unsqueeze_dim=1)


def _hf_available():
    return None if importlib.util.find_spec("transformers") else "transformers is not installed"


def cases(quick: bool) -> list[BenchCase]:
    arch = hw.local_arch()
    out = []
    for T, Hq, Hk, D, r, style in CASES:
        decode = T <= 64
        nbytes = 2 * T * (Hq + Hk) * r * 2 + T * r * 4 + T * 8
        providers = [Provider("opmap-triton", _ours(style), backend=("rope", "triton"))]
        if style == "neox" and r == D:
            providers.append(Provider("hf-transformers", _hf, available=_hf_available))
        out.append(BenchCase(
            op="rope", case=f"T={T},h={Hq}/{Hk},d={D},r={r},style={style},dtype=bf16",
            flops=float(3 * T * (Hq + Hk) * r), bytes=float(nbytes), setup=_setup(T, Hq, Hk, D, r),
            providers=providers, graph=decode,
            spec=RopeSpec(arch=arch, phase="decode" if decode else "prefill", head_dim=D, rotary_dim=r, style=style,
                          scaling="llama3", dtype="bf16"),
            tags=("rope",)))
    return out
