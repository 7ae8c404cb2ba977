"""The one tolerance table. Errors are measured against an fp32 (or fp64) reference.

``atol`` and ``rtol`` combine as in ``torch.allclose``: |out - ref| <= atol + rtol * |ref|.
Ops that accumulate long reductions in low precision (attention, GEMM over large K) may ask
for a looser factor with ``scale``; the factor is visible at the call site.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# fp8 is per case: callers give a cosine gate instead (see quality()).


def tol(dtype: torch.dtype, scale: float = 1.0) -> tuple[float, float]:
    atol, rtol = TOL[dtype]
    return atol * scale, rtol * scale


@dataclass
class Err:
    max_abs: float
    max_rel: float  # max |d| / (atol/rtol + |ref|), i.e. 1.0 = at the tolerance
    worst_ratio: float  # max |d| / (atol + rtol |ref|): <= 1 passes
    nonfinite: int

    @property
    def ok(self) -> bool:
        return self.nonfinite == 0 and self.worst_ratio <= 1.0

    def __str__(self) -> str:
        return f"max_abs={self.max_abs:.3g} worst/tol={self.worst_ratio:.3g}"


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype = None, scale: float = 1.0) -> Err:
    """Error of ``out`` against ``ref`` under the tolerance of ``dtype`` (default out.dtype)."""
    dtype = dtype or out.dtype
    atol, rtol = tol(dtype, scale)
    o = out.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    if o.shape != r.shape:
        raise AssertionError(f"shape mismatch: out {tuple(o.shape)} vs ref {tuple(r.shape)}")
    if o.numel() == 0:
        return Err(0.0, 0.0, 0.0, 0)
    both_inf = torch.isinf(o) & torch.isinf(r) & (torch.sign(o) == torch.sign(r))
    nonfinite = int((~torch.isfinite(o) & ~both_inf).sum() + (torch.isnan(r) & ~torch.isnan(o)).sum())
    d = (o - r).abs().masked_fill(both_inf, 0.0)
    d = torch.nan_to_num(d, nan=0.0)
    bound = atol + rtol * r.abs().masked_fill(both_inf, 0.0)
    return Err(float(d.max()), float((d / (rtol + r.abs().masked_fill(both_inf, 0.0))).max()),
               float((d / bound).max()), nonfinite)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype = None, scale: float = 1.0,
                 what: str = "output") -> Err:
    e = compare(out, ref, dtype, scale)
    if not e.ok:
        raise AssertionError(f"{what}: {e} (nonfinite={e.nonfinite}, dtype={dtype or out.dtype}, scale={scale})")
    return e


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.detach().double().flatten().cpu()
    b = b.detach().double().flatten().cpu()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))
