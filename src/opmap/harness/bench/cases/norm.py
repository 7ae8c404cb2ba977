"""RMSNorm benchmark cases (bf16): 8192 x 8192 and decode sizes (B in {1, 64} x 4096 / 8192),
plain and fused residual add. Peers in the same run: torch.nn.functional.rms_norm (eager) and
the same function under torch.compile.

Minimal bytes: rmsnorm reads x and writes out (2 x R x H x 2) plus the weight; the fused add
also reads the residual and writes it back (4 x R x H x 2). Decode sizes are timed by CUDA-graph
replay: they are launch-bound, and the target is stated in microseconds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opmap.core import hw, registry
from opmap.core.specs import NormSpec
from opmap.harness.bench.base import BenchCase, Provider

SHAPES = [(8192, 8192), (1, 4096), (1, 8192), (64, 4096), (64, 8192)]
EPS = 1e-6


def _setup(R, H, fused):
    def setup(device):
        d = dict(x=torch.randn(R, H, device=device, dtype=torch.bfloat16),
                 w=torch.randn(H, device=device, dtype=torch.bfloat16))
        if fused:
            d["res"] = torch.randn(R, H, device=device, dtype=torch.bfloat16)
        return d

    return setup


def _ours(fused):
    def make(inp):
        b = registry.get("rmsnorm", "triton")
        if fused:
            fn = b.fn("add_rmsnorm")
            return lambda: fn(inp["x"], inp["res"], inp["w"], EPS)
        fn = b.fn("rmsnorm")
        return lambda: fn(inp["x"], inp["w"], EPS)

    return make


def _torch_fn(fused):
    if fused:
        def f(x, res, w):
            res.add_(x)
            return F.rms_norm(res, (res.shape[-1],), w, EPS)
    else:
        def f(x, w):
            return F.rms_norm(x, (x.shape[-1],), w, EPS)
    return f


def _torch(fused, compiled):
    def make(inp):
        f = _torch_fn(fused)
        if compiled:
            f = torch.compile(f, dynamic=False)
        if fused:
            return lambda: f(inp["x"], inp["res"], inp["w"])
        return lambda: f(inp["x"], inp["w"])

    return make


def cases(quick: bool) -> list[BenchCase]:
    return [_case(R, H, fused) for fused in (False, True) for R, H in SHAPES]


def model_cases(model_specs: dict, quick: bool) -> list[BenchCase]:
    """The grid's rows (R) at a model's own hidden sizes (``model_specs``: {op: [spec]} of its op map)."""
    hidden = sorted({s.hidden for s in model_specs.get("rmsnorm", []) if getattr(s, "hidden", None)})
    rows = sorted({R for R, _ in SHAPES})
    return [_case(R, H, fused) for fused in (False, True) for H in hidden for R in rows]


def _case(R: int, H: int, fused: bool) -> BenchCase:
    decode = R <= 64
    nbytes = (4 if fused else 2) * R * H * 2 + H * 2
    return BenchCase(
        op="rmsnorm", case=f"R={R},H={H},fused_add={int(fused)},dtype=bf16",
        flops=float((5 if fused else 4) * R * H), bytes=float(nbytes), setup=_setup(R, H, fused),
        providers=[Provider("opmap-triton", _ours(fused), backend=("rmsnorm", "triton")),
                   Provider("torch-rms_norm", _torch(fused, False)),
                   Provider("torch-compile", _torch(fused, True))],
        graph=decode,
        spec=NormSpec(arch=hw.local_arch(), phase="decode" if decode else "prefill", hidden=H, dtype="bf16",
                      fused_add=fused),
        tags=("norm",))
