"""Weight-only fp8 / int8 / int4 linear for many rows (prefill): the weight dequantised by one
Triton pass into a bf16 scratch buffer (its fp8 / int8 / packed int4 bytes read once, the bf16
bytes written once, the per-output-channel or per-group scale and zero applied there), then
cuBLAS on it. The scratch is one buffer per
device, dtype and stream, grown to the largest weight and reused by every layer (stream order
keeps a layer's GEMM before the next layer's dequantisation): the model keeps its weights
quantised, at the cost of one weight's bf16 copy.

Why: the weight-only kernels (triton-wo, gluon-wo, gluon-wo-wgmma: tiles converted in registers)
are the decode path; from M = 256 triton-wo is well behind cuBLAS on bf16 weights, and this route
ahead of it (docs/dense.md, Decisions, the many-rows row), the dequantisation's ~3 bytes an element
being spread over the rows."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from opmap.kernels.gemm import nibbles
from opmap.kernels.gemm.scaled_tiles import INTERP
from opmap.ops.gemm.quant import INT4_SYM_ZERO, block_of
from opmap.ops.gemm.validate import INT4_PACKED, QUANT_DTYPES, check_linear
from opmap.core.contract import expect

BLOCK_N, BLOCK_K = 16, 256
INT4_BLOCK_N = 32


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, o_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=mask).to(tl.float32)  # masked lanes are not stored
    s = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    tl.store(o_ptr + rn[:, None] * K + rk[None, :], (w * s[:, None]).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_int4_kernel(w_ptr, s_ptr, z_ptr, o_ptr, N, K, stride_w, G: tl.constexpr, HAS_ZERO: tl.constexpr,
                         SYM_ZERO: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed int4 [N, K / 8] -> (code - zero) * scale [N, K]: BLOCK_K columns (inside one group) of
    BLOCK_N rows a program, each word read once and turned into its eight values in registers
    (kernels/gemm/nibbles.py), rounded once, after the scale."""
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = rn < N
    words = tl.load(w_ptr + rn[:, None] * stride_w + k0 // 8 + tl.arange(0, BLOCK_K // 8)[None, :],
                    mask=n_ok[:, None], other=0)
    g = rn * (K // G) + k0 // G
    s = tl.load(s_ptr + g, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(z_ptr + g, mask=n_ok, other=0).to(tl.int32)[:, None]
    else:
        z = tl.full([BLOCK_N, 1], SYM_ZERO, tl.int32)
    odt = o_ptr.dtype.element_ty
    v = tl.reshape(nibbles.unpack(words, z, odt, ASM), [BLOCK_N, BLOCK_K])  # code - zero: exact in odt
    tl.store(o_ptr + rn[:, None] * K + k0 + tl.arange(0, BLOCK_K)[None, :], (v.to(tl.float32) * s[:, None]).to(odt),
             mask=n_ok[:, None])


@triton.jit
def _dequant_block_kernel(w_ptr, s_ptr, o_ptr, N, K, stride_w, stride_s, B: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """Block-wise fp8 [N, K] -> w * scale[n // B, k // B] [N, K]."""
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=mask).to(tl.float32)
    s = tl.load(s_ptr + (rn[:, None] // B) * stride_s + rk[None, :] // B, mask=mask, other=0.0)
    tl.store(o_ptr + rn[:, None] * K + rk[None, :], (w * s).to(o_ptr.dtype.element_ty), mask=mask)


_SCRATCH: dict = {}  # (device, dtype, stream, slot) -> flat buffer


def scratch(n: int, dtype: torch.dtype, device: torch.device, slot: int = 0) -> torch.Tensor:
    """A flat buffer of at least ``n`` elements, one per device, dtype, stream and ``slot`` (a caller
    that needs two dequantised weights alive at once takes two slots), grown and kept."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, dtype, stream, slot)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH[key] = torch.empty(n, dtype=dtype, device=device)
    return buf


def scratch_view(shape: tuple, dtype: torch.dtype, device: torch.device, slot: int = 0) -> torch.Tensor:
    """The first elements of ``scratch`` as a contiguous tensor of ``shape``."""
    n = math.prod(shape)
    return scratch(n, dtype, device, slot)[:n].view(shape)


def release(device: torch.device, streams) -> None:
    """Drop the scratch buffers of ``streams`` (raw CUDA stream handles) on ``device``: an engine that
    closes gives back what its steps and graphs grew (another engine's next call regrows its own).
    The keys hold the tensors' devices, which carry an index: "cuda" means the current one."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for key in [k for k in _SCRATCH if k[0] == device and k[2] in set(streams)]:
        del _SCRATCH[key]


def dequantize(wq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``wq * scale[:, None]`` rounded once to ``dtype``, [N, K], in the shared scratch buffer (the
    next call on this stream overwrites it)."""
    N, K = wq.shape
    out = scratch_view((N, K), dtype, wq.device)
    if N and K:
        _dequant_kernel[(triton.cdiv(N, BLOCK_N), triton.cdiv(K, BLOCK_K))](
            wq, scale, out, N, K, wq.stride(0), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return out


def int4_into(w: torch.Tensor, scale: torch.Tensor, zero, out: torch.Tensor) -> torch.Tensor:
    """int4 ``w`` [N, K / 8] with its group scales [N, K / G] and zero codes as ``out`` [N, K]
    (contiguous, any 16-bit float dtype)."""
    N, K = out.shape
    if N and K:
        G = K // scale.shape[1]
        expect(G % 8 == 0, "w_scale", f"shape {tuple(scale.shape)} (group size {G})",
               "a group size that is a multiple of 8 (whole packed words a group)")
        bk = next(b for b in (128, 64, 32, 16, 8) if G % b == 0)  # a K tile inside one group
        _dequant_int4_kernel[(triton.cdiv(N, INT4_BLOCK_N), K // bk)](
            w, scale, zero if zero is not None else scale, out, N, K, w.stride(0), G=G, HAS_ZERO=zero is not None,
            SYM_ZERO=INT4_SYM_ZERO, ASM=not INTERP, BLOCK_N=INT4_BLOCK_N, BLOCK_K=bk, num_warps=4)
    return out


def block_into(w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Block-wise fp8 ``w`` [N, K] times its scale per block [ceil(N / b), ceil(K / b)] as ``out`` [N, K]."""
    N, K = w.shape
    if N and K:
        _dequant_block_kernel[(triton.cdiv(N, BLOCK_N), triton.cdiv(K, BLOCK_K))](
            w, scale, out, N, K, w.stride(0), scale.stride(0), B=block_of(N, K, scale), BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K, num_warps=4)
    return out


def dequantize_int4(w: torch.Tensor, scale: torch.Tensor, zero, dtype: torch.dtype) -> torch.Tensor:
    """int4 ``w`` [N, K / 8] with its group scales and zero codes as [N, K] ``dtype`` in the shared
    scratch buffer (the next call on this stream overwrites it)."""
    N, K = w.shape[0], w.shape[1] * 8
    return int4_into(w, scale, zero, scratch_view((N, K), dtype, w.device))


def dequantize_block(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Block-wise fp8 ``w`` [N, K] times its scale per block as [N, K] ``dtype`` in the shared scratch."""
    N, K = w.shape
    return block_into(w, scale, scratch_view((N, K), dtype, w.device))


def linear(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None) -> torch.Tensor:
    check_linear(x, w, bias, w_scale, w_zero, int4=True, block=True)
    expect(w.dtype in QUANT_DTYPES + (INT4_PACKED,), "w", f"dtype {w.dtype}",
           "fp8-e4m3, int8 or packed int4 weights (dense ones go to cublas)")
    if w.dtype == INT4_PACKED:
        wd = dequantize_int4(w, w_scale, w_zero, x.dtype)
    elif w_scale.dim() == 2:
        wd = dequantize_block(w, w_scale, x.dtype)
    else:
        wd = dequantize(w, w_scale, x.dtype)
    return F.linear(x, wd, None if bias is None else bias.to(x.dtype))
