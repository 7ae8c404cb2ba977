"""Weight quantisation: bf16/fp16/fp32 weights [N, K] to fp8-e4m3 or int8 with one fp32 scale
per output channel (row), symmetric, scale = max|w_row| / qmax. ``w ~= wq * scale[:, None]``.

Also the dynamic per-token fp8 quantisation of activations used by the scaled-mm backend.
"""
from __future__ import annotations

import torch

from opmap.core.contract import InputError, expect_in, expect_tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
INT8_MAX = 127.0
# A row of zeros would give scale 0 and 0/0 = NaN; any positive floor reproduces zeros exactly.
MIN_SCALE = 1e-12


def quantize_weight(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    expect_in("fmt", fmt, ("fp8", "int8"))
    expect_tensor("w", w, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=2)
    wf = w.float()
    qmax = FP8_MAX if fmt == "fp8" else INT8_MAX
    scale = (wf.abs().amax(dim=1) / qmax).clamp_min(MIN_SCALE)
    q = wf / scale[:, None]
    if fmt == "fp8":
        wq = q.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    else:
        wq = q.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return wq.contiguous(), scale.contiguous()


def dequantize_weight(wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K]; for references and tests only (kernels never materialise this)."""
    return wq.float() * scale.float()[:, None]


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row) dynamic fp8: returns (xq[M, K] fp8, scale[M, 1] fp32)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_act_fp8_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group dynamic fp8 (the activations of block-fp8 checkpoints: DeepSeek-V3 quantises
    each run of ``group`` input channels of a token on its own): (xq[M, K] fp8, scale[M, K / group]
    fp32), K a multiple of ``group``."""
    M, K = x.shape
    if group <= 0 or K % group:
        raise InputError("group", group, f"a positive divisor of K={K}")
    xf = x.float().reshape(M, K // group, group)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(M, K), scale.reshape(M, K // group)


# ---- int4 weight-only (W4A16) -------------------------------------------------------------
# The one layout every int4 checkpoint format (GPTQ, AWQ, compressed-tensors pack-quantized) is
# repacked into at load: ``w[N, K // 8]`` int32, nibble i of word j (bits 4i..4i+3) holding the
# unsigned code u of input channel 8j + i; ``w_scale[N, K // G]`` (fp16 / bf16 / fp32) and, where
# the format is asymmetric, ``w_zero[N, K // G]`` uint8 codes (symmetric: zero = 8). The value is
# ``(u - zero) * scale`` of the channel's group; G = K / w_scale.shape[1] (G = K: one per channel).
INT4_SYM_ZERO = 8
INT4_GROUP = 128  # --quantize int4's group: that of most int4 checkpoints (GPTQ, AWQ, W4A16)


def int4_group(k: int, group) -> int:
    """The group size a weight of input size ``k`` has under a format's ``group`` (None: one
    group a row; a group that does not divide k: one a row too)."""
    return group if group and k % group == 0 else k


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in [0, 15] (K a multiple of 8) -> int32 [N, K // 8], nibble i of word
    j = code of column 8j + i."""
    expect_tensor("u", u, dtype=(torch.uint8,), ndim=2)
    N, K = u.shape
    if K % 8:
        raise InputError("u", f"shape {tuple(u.shape)}", "K a multiple of 8 (eight 4-bit codes a word)")
    v = u.view(N, K // 8, 8).to(torch.int64) << (4 * torch.arange(8, device=u.device, dtype=torch.int64))
    return _to_int32(v.sum(-1))


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the int32 with the same bits."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32).contiguous()


def unpack_int4(w: torch.Tensor) -> torch.Tensor:
    """int32 [N, K // 8] -> uint8 codes [N, K]."""
    shifts = 4 * torch.arange(8, device=w.device, dtype=torch.int32)
    return ((w[..., None] >> shifts) & 0xF).to(torch.uint8).flatten(-2)


def quantize_int4(w: torch.Tensor, group_size: int, zero_point: bool = False):
    """bf16/fp16/fp32 [N, K] -> (packed int32 [N, K // 8], scale fp32 [N, K // G], zero uint8
    [N, K // G] or None): round to nearest; symmetric codes u = round(w / s) + 8 with s =
    max|w| / 7 per group, or asymmetric (``zero_point``) over the group's [min, max] range."""
    expect_tensor("w", w, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=2)
    N, K = w.shape
    if group_size <= 0 or K % group_size or group_size % 8:
        raise InputError("group_size", group_size, f"a multiple of 8 that divides K={K}")
    g = w.float().view(N, K // group_size, group_size)
    if zero_point:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp_min(MIN_SCALE)
        zero = (-lo / scale).round().clamp(0, 15)
        u = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15)
        zq = zero.to(torch.uint8).contiguous()
    else:
        scale = (g.abs().amax(-1) / 7).clamp_min(MIN_SCALE)
        u = (g / scale[..., None]).round().clamp(-8, 7) + INT4_SYM_ZERO
        zq = None
    return pack_int4(u.to(torch.uint8).view(N, K)), scale.contiguous(), zq


def dequantize_int4(w: torch.Tensor, scale: torch.Tensor, zero=None) -> torch.Tensor:
    """fp32 [N, K] of the int4 layout above (for references and loaders' checks; kernels never
    materialise it)."""
    u = unpack_int4(w).float()
    N, K = u.shape
    G = K // scale.shape[1]
    z = zero.float() if zero is not None else torch.full_like(scale, INT4_SYM_ZERO, dtype=torch.float32)
    return ((u.view(N, -1, G) - z[..., None]) * scale.float()[..., None]).view(N, K)


# ---- block-wise fp8 (DeepSeek-V3, Qwen3-FP8) ------------------------------------------------
# e4m3 weights [N, K] with one fp32 scale per b x b block: ``w_scale[ceil(N / b), ceil(K / b)]``
# (partial blocks at the edges), the value ``wq * scale[n // b, k // b]``.

def quantize_fp8_block(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    expect_tensor("w", w, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=2)
    if block <= 0:
        raise InputError("block", block, "a positive block edge")
    N, K = w.shape
    nb, kb = -(-N // block), -(-K // block)
    pad = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    pad[:N, :K] = w.float()
    scale = (pad.abs().reshape(nb, block, kb, block).amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)
    full = scale.repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous(), scale.contiguous()


def dequantize_fp8_block(wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] of block-scaled fp8 (the block edge from the scale's shape: ceil(N / b) rows)."""
    N, K = wq.shape
    b = block_of(N, K, scale)
    return wq.float() * scale.float().repeat_interleave(b, 0)[:N].repeat_interleave(b, 1)[:, :K]


BLOCK_EDGES = (16, 32, 64, 128, 256, 512)  # the block edges triton-fp8-block and the loader take


def block_of(N: int, K: int, scale: torch.Tensor) -> int:
    """The block edge b of a block scale [ceil(N / b), ceil(K / b)]: the smallest of BLOCK_EDGES
    that gives that shape (0 where none does)."""
    for b in BLOCK_EDGES:
        if tuple(scale.shape) == (-(-N // b), -(-K // b)):
            return b
    return 0
