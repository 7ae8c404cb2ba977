"""Gated activations in Triton: ``out = act(x[..., :H]) * x[..., H:]`` (SiLU or GELU-tanh).

Grid (rows, column blocks); each program reads one block of the gate half and the matching
block of the up half and writes one block of the output: 3 bytes moved per output byte, the
minimum. fp32 math, one rounding. Row offsets are int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.core.contract import InputError
from opmap.kernels import pdl
from opmap.kernels.pdl import enter
from opmap.ops.activation.validate import check_act

BLOCK = 1024


@triton.jit
def _act_mul_kernel(x_ptr, o_ptr, stride_x, stride_o, H, GELU: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + H + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * stride_o + offs, (act_of(g, GELU) * u).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def act_of(g, GELU: tl.constexpr):
    """SiLU or GELU-tanh of fp32 ``g`` (also the gated GEMM's epilogue: triton_gemm, GATED)."""
    if GELU:
        # tanh(z) = 1 - 2 / (1 + exp(2z)): exact in the limits (exp -> inf gives 1), and
        # needs no libdevice, so it also runs in the interpreter.
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * z)))
    return g / (1.0 + tl.exp(-g))


def _launch(x: torch.Tensor, out, gelu: bool) -> torch.Tensor:
    H = check_act(x, out)
    x2 = x.reshape(-1, 2 * H)  # a view when the leading dims flatten, else a copy of the input
    if out is None:
        out = torch.empty((*x.shape[:-1], H), dtype=x.dtype, device=x.device)
    try:
        o2 = out.view(-1, H)
    except RuntimeError:
        raise InputError("out", f"strides {out.stride()}", "leading dims that flatten to one row stride") from None
    R = x2.shape[0]
    if R == 0 or H == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(H))
    grid = (R, triton.cdiv(H, block))
    _act_mul_kernel[grid](x2, o2, x2.stride(0), o2.stride(0), H, GELU=gelu, BLOCK=block,
                          num_warps=4 if block >= 512 else 2, **pdl.launch(x2.device))
    return out


def silu_mul(x: torch.Tensor, *, out=None) -> torch.Tensor:
    return _launch(x, out, gelu=False)


def gelu_tanh_mul(x: torch.Tensor, *, out=None) -> torch.Tensor:
    return _launch(x, out, gelu=True)
