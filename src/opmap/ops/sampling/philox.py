"""The sampler's random stream in plain PyTorch, bit for bit: Philox-4x32-10 keyed by the
request seed, counter (token id, position low, position high, 0), first output word; then
u = (r >> 8 + 0.5) / 2**24 in (0, 1) and Gumbel noise g = -log(-log(u)) in fp32.

The Triton kernel (``sampler_jit._gumbel``) computes the same words, so the reference sampler
draws the same tokens as the kernel (up to a last-ulp difference of the two logs, which can
only matter for a near-exact tie of two race keys). 32-bit products are split in 16-bit halves
so that int64 arithmetic never overflows.
"""
from __future__ import annotations

import torch

__all__ = ["philox_word", "gumbel"]

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85


def _mulhilo(a: int, b: torch.Tensor):
    lo16, hi16 = b & 0xFFFF, b >> 16
    pl, ph = a * lo16, a * hi16  # each < 2**48
    hi = (ph + (pl >> 16)) >> 16
    lo = (((ph & 0xFFFF) << 16) + pl) & _M32
    return hi, lo


def philox_word(seeds: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor, rounds: int = 10) -> torch.Tensor:
    """First Philox output word (int64 holding a uint32) for seeds[B], positions[B], ids[B, n]."""
    ids = ids.to(torch.int64) & _M32
    s = seeds.to(torch.int64)[:, None]
    p = positions.to(torch.int64)[:, None]
    k0, k1 = s & _M32, (s >> 32) & _M32
    c0 = ids
    c1 = (p & _M32).expand_as(ids)
    c2 = ((p >> 32) & _M32).expand_as(ids)
    c3 = torch.zeros_like(ids)
    for _ in range(rounds):
        hb, lb = _mulhilo(_ROUND_B, c2)
        ha, la = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hb ^ c1 ^ k0, lb, ha ^ c3 ^ k1, la
        k0 = (k0 + _KEY_A) & _M32
        k1 = (k1 + _KEY_B) & _M32
    return c0


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fp32 Gumbel noise [B, n] of tokens ``ids[B, n]`` for each row's (seed, position)."""
    r = philox_word(seeds, positions, ids)
    u = ((r >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return -torch.log(-torch.log(u))
