"""Plain-PyTorch RoPE, the oracle of the family, and the cos/sin cache every backend reads.

``cos_sin_cache(rotary_dim, max_pos, theta, scaling)`` returns ``[max_pos, rotary_dim]`` fp32:
``[:, :r/2]`` = cos, ``[:, r/2:]`` = sin of ``position * inv_freq``. ``scaling`` is a Hugging
Face ``rope_scaling`` dict: ``llama3`` (Llama-3.1 frequency smoothing) or ``yarn`` (DeepSeek /
Qwen YaRN; its attention factor, "mscale", is folded into cos and sin). Frequencies follow
``transformers.modeling_rope_utils`` exactly (they are tested against it).

``rope(q, k, positions, cos_sin, style)`` rotates the first ``rotary_dim`` dims of each head of
q and k in place; the remaining dims (partial rotary) are untouched. ``style``: ``neox``
rotates the two halves (x[i], x[i + r/2]); ``gptj`` rotates interleaved pairs (x[2i], x[2i+1]).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from opmap.ops.rope.validate import check_rope


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    low_ff = float(s.get("low_freq_factor", 1.0))
    high_ff = float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s["original_max_position_embeddings"])
    low_wl, high_wl = old_ctx / low_ff, old_ctx / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rotary_dim: int, theta: float, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = s.get("factor")
    orig = s["original_max_position_embeddings"]
    if factor is None:
        factor = max_pos / orig
    factor = float(factor)
    attn = s.get("attention_factor")
    if attn is None:
        ms, ms_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = _yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all) if ms and ms_all else _yarn_mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1
    dim = rotary_dim

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp, as HF does
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra = 1.0 - ramp  # weight of the unscaled (extrapolated) frequency
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(attn)


def inv_freq_and_scale(rotary_dim: int, theta: float, scaling: Optional[dict] = None,
                       max_pos: int = 0) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] fp32 and the cos/sin multiplier (YaRN mscale)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim={rotary_dim}: expected a positive even number")
    kind = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)), 1.0
    if kind == "llama3":
        base = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        return _llama3_inv_freq(base, scaling), 1.0
    if kind == "yarn":
        return _yarn(rotary_dim, theta, scaling, max_pos)
    if kind == "linear":  # positions divided by the factor: HF's linear scaling
        base = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        return base / float(scaling["factor"]), 1.0
    raise ValueError(f"rope scaling {kind!r} not supported (supported: {', '.join(ROPE_SCALINGS)})")


ROPE_SCALINGS = ("default", "linear", "llama3", "yarn")


def cos_sin_cache(rotary_dim: int, max_pos: int, theta: float = 10000.0,
                  scaling: Optional[dict] = None, device=None) -> torch.Tensor:
    inv_freq, mscale = inv_freq_and_scale(rotary_dim, theta, scaling, max_pos)
    # Angles in fp64 so that large positions (128k) do not lose phase before the cast.
    t = torch.arange(max_pos, dtype=torch.float64)
    ang = torch.outer(t, inv_freq.double())
    cache = torch.cat([ang.cos() * mscale, ang.sin() * mscale], dim=-1).float()
    return cache.to(device) if device is not None else cache


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> None:
    """x[T, H, D] in place; cos/sin [T, r/2] fp32."""
    r = cos.shape[-1] * 2
    xr = x[..., :r].float()
    c, s = cos[:, None, :], sin[:, None, :]
    if style == "neox":
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        y = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        y = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    x[..., :r].copy_(y.to(x.dtype))


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
         style: str = "neox") -> None:
    check_rope(q, k, positions, cos_sin, style, check_values=True)
    half = cos_sin.shape[1] // 2
    cs = cos_sin[positions.long()]
    cos, sin = cs[:, :half], cs[:, half:]
    _rotate(q, cos, sin, style)
    _rotate(k, cos, sin, style)
