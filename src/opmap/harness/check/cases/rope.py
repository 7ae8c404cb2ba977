"""RoPE check cases: the cos/sin cache against HF's rope init functions (llama3, DeepSeek
YaRN), the reference against HF apply_rotary_pos_emb, every runnable backend against the
reference (NeoX / GPT-J, partial rotary, q/k as views of a fused qkv buffer), boundaries,
bad input."""
from __future__ import annotations

import torch

from opmap.core import registry
from opmap.core.specs import RopeSpec
from opmap.core.tolerance import compare
from opmap.harness.check.base import CheckCase, Outcome, probe_errors, arch_of
from opmap.ops.rope import reference

_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SCALINGS = {
    "none": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
             "mscale_all_dim": 0.5, "original_max_position_embeddings": 4096},
}


def _parity(backend, device, T, Hq, Hk, D, r, dtype, style, scaling, max_pos=65536, last_pos=False):
    def run():
        g = torch.Generator().manual_seed(T + D + r)
        cs = reference.cos_sin_cache(r, max_pos, 500000.0, SCALINGS[scaling], device=device)
        qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).to(device, dtype)
        q = qkv[:, : Hq * D].view(T, Hq, D)
        k = qkv[:, Hq * D: (Hq + Hk) * D].view(T, Hk, D)
        pos = torch.randint(0, max_pos, (T,), generator=g)
        if last_pos:
            pos[-1] = max_pos - 1
        pos = pos.to(device)
        q2, k2 = q.clone(), k.clone()
        registry.get("rope", backend)("rope", q, k, pos, cs, style)
        reference.rope(q2, k2, pos, cs, style)
        eq, ek = compare(q, q2, dtype), compare(k, k2, dtype)
        worst = max(eq.worst_ratio, ek.worst_ratio)
        return Outcome(eq.ok and ek.ok, f"q {eq}; k {ek}", worst, 1.0)

    return run


def _vs_hf_apply(device):
    def run():
        # heavy: transformers, for the HF parity cases only
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        T, H, D = 11, 4, 128
        g = torch.Generator().manual_seed(3)
        q, k = torch.randn(T, H, D, generator=g).to(device), torch.randn(T, 2, D, generator=g).to(device)
        pos = torch.randint(0, 8192, (T,), generator=g).to(device)
        cs = reference.cos_sin_cache(D, 8192, 500000.0, SCALINGS["llama3"], device=device)
        c, s = cs[pos, : D // 2], cs[pos, D // 2:]
        qh, kh = apply_rotary_pos_emb(q, k, torch.cat([c, c], -1), torch.cat([s, s], -1))
        reference.rope(q, k, pos, cs, "neox")
        eq, ek = compare(q, qh, torch.float32), compare(k, kh, torch.float32)
        return Outcome(eq.ok and ek.ok, f"q {eq}; k {ek}", max(eq.worst_ratio, ek.worst_ratio), 1.0)

    return run


def _vs_hf_init(scaling):
    def run():
        # heavy: transformers, for the HF parity cases only
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        s = SCALINGS[scaling]
        cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, max_position_embeddings=163840,
                          rope_parameters={"rope_theta": 10000.0, **s})
        inv_hf, attn_hf = ROPE_INIT_FUNCTIONS[s["rope_type"]](cfg)
        inv, attn = reference.inv_freq_and_scale(128, 10000.0, s, 163840)
        rel = float(((inv - inv_hf.float()).abs() / inv_hf.float().abs()).max())
        ok = rel <= 1e-6 and abs(attn - attn_hf) <= 1e-9 * max(1.0, abs(attn_hf))
        return Outcome(ok, f"inv_freq max rel err {rel:.2g}; attention factor {attn:.6f} vs HF {attn_hf:.6f}",
                       rel, 1e-6)

    return run


def _bad_input(backend, device):
    def run():
        fn = registry.get("rope", backend).fn("rope")
        cs = reference.cos_sin_cache(64, 32, device=device)
        q, k = torch.randn(4, 2, 64, device=device), torch.randn(4, 1, 64, device=device)
        pos = torch.arange(4, device=device)
        probes = {"style": lambda: fn(q, k, pos, cs, "llama"),
                  "k": lambda: fn(q, torch.randn(4, 1, 32, device=device), pos, cs, "neox"),
                  "positions": lambda: fn(q, k, pos.float(), cs, "neox"),
                  "cos_sin": lambda: fn(q, k, pos, reference.cos_sin_cache(128, 32, device=device), "neox")}
        if device == "cpu":  # the value check synchronises, so on a GPU it is a debug option
            probes["positions"] = lambda: fn(q, k, torch.tensor([0, 1, 2, 32]), cs, "neox")
        return probe_errors(probes)

    return run


def cases(device: str, quick: bool) -> list[CheckCase]:
    arch = arch_of(device)
    dtypes = ("fp32", "fp16") if device == "cpu" else ("bf16",)
    out = []
    out.append(CheckCase("parity", "rope", "reference", "vs HF apply_rotary_pos_emb,llama3,T=11,d=128",
                         _vs_hf_apply(device)))
    for sc in ("llama3", "yarn"):
        out.append(CheckCase("parity", "rope", "reference", f"cos/sin vs HF rope init,{sc}", _vs_hf_init(sc)))
    T = 9 if device == "cpu" else 4096
    shapes = [  # (label, Hq, Hk, D, r, style, scaling)
        ("llama3 neox", 8 if device == "cpu" else 32, 2 if device == "cpu" else 8, 128, 128, "neox", "llama3"),
        ("gptj", 4, 4, 64, 64, "gptj", "none"),
        ("deepseek yarn partial 64/192", 4, 1, 192, 64, "gptj", "yarn"),
    ]
    for name in ("triton",):
        b = registry.get("rope", name)
        for dt in dtypes:
            for label, Hq, Hk, D, r, style, sc in shapes:
                spec = RopeSpec(arch=arch, head_dim=D, rotary_dim=r, style=style, scaling=sc, dtype=dt)
                if b.validate(spec, runtime=True):
                    continue
                out.append(CheckCase("parity", "rope", name, f"{label},T={T},h={Hq}/{Hk},d={D},r={r},dtype={dt}",
                                     _parity(name, device, T, Hq, Hk, D, r, _DT[dt], style, sc)))
            if not b.validate(RopeSpec(arch=arch, dtype=dt), runtime=True):
                out.append(CheckCase("boundaries", "rope", name, f"T=1,last cache row,dtype={dt}",
                                     _parity(name, device, 1, 32, 8, 128, 128, _DT[dt], "neox", "none",
                                             max_pos=300, last_pos=True)))
                out.append(CheckCase("boundaries", "rope", name, f"odd head_dim 80,r=40,h=5/5,dtype={dt}",
                                     _parity(name, device, 5, 5, 5, 80, 40, _DT[dt], "neox", "none")))
        out.append(CheckCase("input", "rope", name, "style, head_dim mismatch, positions, cos_sin",
                             _bad_input(name, device)))
    out.append(CheckCase("input", "rope", "reference", "style, head_dim mismatch, positions, cos_sin",
                         _bad_input("reference", device)))
    return out
