"""RMSNorm check cases: the reference against HF LlamaRMSNorm (bitwise), every runnable
backend against the reference (plain and fused add, residual included), boundaries (hidden 1,
odd widths, rows wider than one register tile, strided rows), bad input."""
from __future__ import annotations

import torch

from opmap.core import registry
from opmap.core.specs import NormSpec
from opmap.core.tolerance import compare
from opmap.harness.check.base import CheckCase, Outcome, probe_errors, arch_of
from opmap.ops.norm import reference

_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BACKENDS = ("triton", "torch-rms_norm")


def _data(device, rows, H, dtype, seed, row_stride=None):
    g = torch.Generator().manual_seed(seed)
    width = row_stride or H
    x = (torch.randn(rows, width, generator=g) * 2 + 0.3).to(device, dtype)[:, :H]
    return x, torch.randn(H, generator=g).to(device, dtype), torch.randn(rows, H, generator=g).to(device, dtype)


def _parity(backend, device, rows, H, dtype, fused, row_stride=None):
    def run():
        x, w, r = _data(device, rows, H, dtype, seed=rows * 7 + H, row_stride=row_stride)
        b = registry.get("rmsnorm", backend)
        if fused:
            r2 = r.clone()
            out = b("add_rmsnorm", x, r, w, 1e-6)
            want = reference.add_rmsnorm(x, r2, w, 1e-6)
            er = compare(r, r2, dtype)
        else:
            out, want, er = b("rmsnorm", x, w, 1e-6), reference.rmsnorm(x, w, 1e-6), None
        # Both sides round x*rstd to x.dtype before the weight multiply; one rsqrt ulp can flip
        # that rounding, hence 2x the dtype tolerance.
        e = compare(out, want, dtype, scale=2.0)
        ok = e.ok and (er is None or er.ok)
        fig = str(e) + (f"; residual {er}" if er is not None else "")
        return Outcome(ok, fig, e.worst_ratio, 1.0)

    return run


def _qk_parity(backend, device, T, hq, hk, d, dtype):
    """qk_rmsnorm in place on the [T, hq + hk, d] view of a qkv row against two reference norms;
    the v columns (NaN here) must be neither read into q/k nor written."""
    def run():
        g = torch.Generator().manual_seed(T * 13 + hq)
        qkv = (torch.randn(T, (hq + 2 * hk) * d, generator=g) * 2 + 0.3).to(device, dtype)
        qkv[:, (hq + hk) * d:] = float("nan")
        wq, wk = torch.randn(d, generator=g).to(device, dtype), torch.randn(d, generator=g).to(device, dtype)
        qk = qkv[:, :(hq + hk) * d].view(T, hq + hk, d)
        want = reference.qk_rmsnorm(qk.clone(), wq, wk, hq, 1e-6)
        registry.get("rmsnorm", backend)("qk_rmsnorm", qk, wq, wk, hq, 1e-6)
        e = compare(qk, want, dtype, scale=2.0)
        v_ok = bool(qkv[:, (hq + hk) * d:].isnan().all())
        return Outcome(e.ok and v_ok, f"{e}; v columns {'untouched' if v_ok else 'WRITTEN'}", e.worst_ratio, 1.0)

    return run


def _vs_hf(device):
    def run():
        # heavy: transformers, for the HF parity case only
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        x, w, _ = _data(device, 9, 5120, torch.bfloat16, 11)
        m = LlamaRMSNorm(5120, eps=1e-5).to(device)
        m.weight.data = w.clone()
        with torch.no_grad():
            want = m(x)
        out = reference.rmsnorm(x, w, 1e-5)
        diff = int((out != want).sum())
        return Outcome(diff == 0, f"{diff} of {out.numel()} elements differ (bitwise)", float(diff), 0.0)

    return run


def _bad_input(backend, device):
    def run():
        b = registry.get("rmsnorm", backend)
        x = torch.randn(4, 64, device=device)
        w = torch.randn(64, device=device)
        probes = {"weight": lambda: b("rmsnorm", x, w[:63], 1e-6),
                  "x": lambda: b("rmsnorm", x.to(torch.int32), w, 1e-6),
                  "residual": lambda: b("add_rmsnorm", x, torch.randn(4, 65, device=device), w, 1e-6),
                  "eps": lambda: b("rmsnorm", x, w, -1.0)}
        return probe_errors(probes)

    return run


def cases(device: str, quick: bool) -> list[CheckCase]:
    arch = arch_of(device)
    dtypes = ("fp32", "fp16") if device == "cpu" else ("bf16",)
    out = []
    out.append(CheckCase("parity", "rmsnorm", "reference", "vs HF LlamaRMSNorm,rows=9,H=5120,dtype=bf16",
                         _vs_hf(device)))
    shapes = [(3, 4095), (2, 5120)] if device == "cpu" else [(1, 4096), (64, 8192), (17, 5120), (8192, 8192)]
    for name in BACKENDS:
        b = registry.get("rmsnorm", name)
        for dt in dtypes:
            d = _DT[dt]
            for fused in (False, True):
                if b.validate(NormSpec(arch=arch, dtype=dt, fused_add=fused), runtime=True):
                    continue
                entry = "add_rmsnorm" if fused else "rmsnorm"
                for rows, H in shapes:
                    out.append(CheckCase("parity", "rmsnorm", name, f"{entry},rows={rows},H={H},dtype={dt}",
                                         _parity(name, device, rows, H, d, fused), quick=rows * H <= 2 ** 20))
                bnd = [("H=1,rows=5", 5, 1, None), ("wide row (two passes),rows=2,H=20001", 2, 20001, None),
                       ("strided rows,rows=6,H=257,stride=300", 6, 257, 300)]
                for label, rows, H, stride in bnd:
                    out.append(CheckCase("boundaries", "rmsnorm", name, f"{entry},{label},dtype={dt}",
                                         _parity(name, device, rows, H, d, fused, stride)))
        for dt in dtypes:
            if b.validate(NormSpec(arch=arch, dtype=dt), runtime=True):
                continue
            # Qwen3-8B heads (32 q + 8 k, d=128) at decode and prefill sizes; an odd head_dim.
            for T, hq, hk, d in ([(3, 4, 2, 64), (2, 3, 1, 48)] if device == "cpu" else
                                 [(1, 32, 8, 128), (4096, 32, 8, 128), (5, 6, 1, 48)]):
                out.append(CheckCase("parity", "rmsnorm", name, f"qk_rmsnorm,T={T},heads={hq}+{hk},d={d},dtype={dt}",
                                     _qk_parity(name, device, T, hq, hk, d, _DT[dt]), quick=T <= 8))
        out.append(CheckCase("input", "rmsnorm", name, "hidden mismatch, wrong dtype, residual shape, eps",
                             _bad_input(name, device)))
    out.append(CheckCase("input", "rmsnorm", "reference", "hidden mismatch, wrong dtype, residual shape, eps",
                         _bad_input("reference", device)))
    return out
