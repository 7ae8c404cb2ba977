"""Gated activation benchmark cases (bf16, Llama-3-8B intermediate 14336 and Qwen3-MoE 768):
decode rows {1, 64} (CUDA-graph replay) and a prefill of 4096 rows. Peers: PyTorch eager
(F.silu / F.gelu then a multiply: two kernels) and the same under torch.compile.
Minimal bytes: read 2H, write H per row (x 2 bytes)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opmap.core import hw, registry
from opmap.core.specs import ActivationSpec
from opmap.harness.bench.base import BenchCase, Provider

SHAPES = [(1, 14336), (64, 14336), (4096, 14336), (4096, 768)]


def _setup(R, H):
    def setup(device):
        return dict(x=torch.randn(R, 2 * H, device=device, dtype=torch.bfloat16))

    return setup


def _ours(entry):
    def make(inp):
        fn = registry.get("activation", "triton").fn(entry)
        return lambda: fn(inp["x"])

    return make


def _torch(entry, compiled):
    def f(x):
        g, u = x.chunk(2, dim=-1)
        a = F.silu(g) if entry == "silu_mul" else F.gelu(g, approximate="tanh")
        return a * u

    def make(inp):
        fn = torch.compile(f, dynamic=False) if compiled else f
        return lambda: fn(inp["x"])

    return make


def cases(quick: bool) -> list[BenchCase]:
    arch = hw.local_arch()
    out = []
    for entry in ("silu_mul", "gelu_tanh_mul"):
        for R, H in SHAPES:
            if entry == "gelu_tanh_mul" and H != 14336:
                continue
            decode = R <= 64
            out.append(BenchCase(
                op="activation", case=f"kind={entry},R={R},H={H},dtype=bf16", flops=float(6 * R * H),
                bytes=float(3 * R * H * 2), setup=_setup(R, H),
                providers=[Provider("opmap-triton", _ours(entry), backend=("activation", "triton")),
                           Provider("torch-eager", _torch(entry, False)),
                           Provider("torch-compile", _torch(entry, True))],
                graph=decode,
                spec=ActivationSpec(arch=arch, phase="decode" if decode else "prefill", kind=entry, hidden=H,
                                    dtype="bf16"),
                tags=("activation",)))
    return out
