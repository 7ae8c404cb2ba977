"""``act_linear(x[M, 2K], w[N, K], bias, w_scale, act)`` = ``linear(act(x), w, bias, w_scale)``
for the backends without a fused kernel: the activation's fp32 reference (one rounding to x's
dtype, the activation family's contract), then the backend's own linear. The decode GEMM fuses
the two (``triton_gemm.act_linear``); these keep ``opmap.act_linear`` on the fast path at every M."""
from __future__ import annotations

from ..activation import reference as act_ref
from . import dequant_cublas, reference, torch_peer
from .validate import check_act_linear


def _then(linear):
    def act_linear(x, w, bias=None, w_scale=None, act="silu_mul"):
        check_act_linear(x, w, bias, w_scale, act)
        return linear(getattr(act_ref, act)(x), w, bias, w_scale)
    act_linear.__doc__ = f"act(x) by the activation reference, then {linear.__module__}.linear"
    return act_linear


reference_act_linear = _then(reference.linear)
cublas_act_linear = _then(torch_peer.linear)
dequant_cublas_act_linear = _then(dequant_cublas.linear)
