"""Activation check cases: the reference against torch.nn.functional in fp64, every runnable
backend against the reference (SiLU and GELU-tanh, odd widths, saturating inputs), bad input."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opmap.core import registry
from opmap.core.specs import ActivationSpec
from opmap.core.tolerance import compare
from opmap.harness.check.base import CheckCase, Outcome, probe_errors, arch_of
from opmap.ops.activation import reference

_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ENTRIES = ("silu_mul", "gelu_tanh_mul")


def _x(device, rows, H, dtype, seed, extreme=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * H, generator=g) * 4
    if extreme:
        x[:, : H // 2] *= 60  # |gate| up to ~1000: exp overflows, results must saturate
    return x.to(device, dtype)


def _parity(backend, entry, device, rows, H, dtype, extreme=False):
    def run():
        x = _x(device, rows, H, dtype, rows + H, extreme)
        out = registry.get("activation", backend)(entry, x)
        want = getattr(reference, entry)(x)
        # The torch-eager peer rounds the activation to x.dtype before the multiply.
        e = compare(out, want, dtype, scale=4.0 if backend == "torch-eager" else 1.0)
        return Outcome(e.ok, str(e), e.worst_ratio, 1.0)

    return run


def _vs_functional(entry, device):
    def run():
        x = _x(device, 4, 1000, torch.float32, 1)
        g, u = x.double().chunk(2, -1)
        a = F.silu(g) if entry == "silu_mul" else F.gelu(g, approximate="tanh")
        e = compare(getattr(reference, entry)(x), (a * u).float(), torch.float32)
        return Outcome(e.ok, str(e), e.worst_ratio, 1.0)

    return run


def _bad_input(backend, device):
    def run():
        b = registry.get("activation", backend)
        probes = {"x": lambda: b("silu_mul", torch.randn(2, 7, device=device)),
                  "out": lambda: b("gelu_tanh_mul", torch.randn(2, 8, device=device),
                                   out=torch.empty(2, 8, device=device))}
        return probe_errors(probes)

    return run


def cases(device: str, quick: bool) -> list[CheckCase]:
    arch = arch_of(device)
    dtypes = ("fp32", "fp16") if device == "cpu" else ("bf16",)
    shapes = [(3, 4095), (2, 5120)] if device == "cpu" else [(1, 14336), (64, 14336), (4096, 768), (1000, 4095)]
    out = [CheckCase("parity", "activation", "reference", f"{e} vs torch.nn.functional fp64,rows=4,H=1000",
                     _vs_functional(e, device)) for e in ENTRIES]
    for name in ("triton", "torch-eager"):
        b = registry.get("activation", name)
        for dt in dtypes:
            for e in ENTRIES:
                if b.validate(ActivationSpec(arch=arch, kind=e, dtype=dt), runtime=True):
                    continue
                for rows, H in shapes:
                    out.append(CheckCase("parity", "activation", name, f"{e},rows={rows},H={H},dtype={dt}",
                                         _parity(name, e, device, rows, H, _DT[dt])))
                out.append(CheckCase("boundaries", "activation", name, f"{e},H=1,rows=3,dtype={dt}",
                                     _parity(name, e, device, 3, 1, _DT[dt])))
                out.append(CheckCase("boundaries", "activation", name, f"{e},saturating gate |g|~1e3,dtype={dt}",
                                     _parity(name, e, device, 2, 256, _DT[dt], extreme=True)))
        out.append(CheckCase("input", "activation", name, "odd width, out shape", _bad_input(name, device)))
    return out
