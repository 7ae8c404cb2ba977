"""Builders of random paged-attention inputs, shared by the tests, the check cases and the
benchmarks (fresh random data, never zeros; pages shuffled, optionally shared)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .reference import gather_kv, quantize_fp8
from .validate import FP8


@dataclass
class Paged:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_pages] int32
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None

    @property
    def kw(self) -> dict:
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)

    def contiguous(self, dtype: Optional[torch.dtype] = None):
        """(k, v) as [B, S_max, Hk, D] (dequantised when fp8; zero-padded past each length)."""
        B = self.seq_lens.shape[0]
        S = max(1, int(self.seq_lens.max())) if B else 1
        hk, d = self.k_cache.shape[2:]
        dt = dtype or (self.k_cache.dtype if self.k_cache.dtype != FP8 else torch.bfloat16)
        k = torch.zeros(B, S, hk, d, dtype=dt, device=self.k_cache.device)
        v = torch.zeros(B, S, hk, self.v_cache.shape[3], dtype=dt, device=self.k_cache.device)
        for b, L in enumerate(self.seq_lens.tolist()):
            if L:
                k[b, :L] = gather_kv(self.k_cache, self.block_tables[b], L, self.k_scale).to(dt)
                v[b, :L] = gather_kv(self.v_cache, self.block_tables[b], L, self.v_scale).to(dt)
        return k, v


def make_paged(seq_lens: Sequence[int], num_kv_heads: int, head_dim: int, page_size: int, *,
               dtype=torch.float16, device="cpu", fp8: bool = False, extra_pages: int = 7,
               shared: bool = False, extra_cols: int = 1, head_dim_v: Optional[int] = None,
               poison: bool = False, generator: Optional[torch.Generator] = None) -> Paged:
    """A cache of many pages holding ``seq_lens`` tokens per sequence, pages in shuffled order.

    ``shared``: sequences 1.. reuse the first page of sequence 0 (a shared prefix page, as with
    prefix caching). ``extra_cols``: padding columns of -1 ... in each block-table row (never
    read). ``poison``: unused slots of the referenced pages hold NaN (they must not be read).
    """
    g = generator or torch.Generator().manual_seed(0)
    dv = head_dim_v or head_dim
    need = [(L + page_size - 1) // page_size for L in seq_lens]
    owned = sum(need) - (sum(1 for n in need[1:] if n) if shared and need and need[0] else 0)
    P = owned + extra_pages
    perm = torch.randperm(P, generator=g)
    max_pages = max(need + [1]) + extra_cols
    bt = torch.full((len(seq_lens), max_pages), -1, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(need):
        for i in range(n):
            if shared and b > 0 and i == 0 and need[0]:
                bt[b, 0] = bt[0, 0]
                continue
            bt[b, i] = perm[nxt]
            nxt += 1
    scale_dt = torch.float32
    k = torch.randn(P, page_size, num_kv_heads, head_dim, generator=g, dtype=scale_dt)
    v = torch.randn(P, page_size, num_kv_heads, dv, generator=g, dtype=scale_dt)
    if poison:
        # Slots no sequence reads (past the last token of a page, across all its sharers) and
        # pages no sequence owns hold NaN: a kernel that reads them poisons its output.
        fill = torch.zeros(P, dtype=torch.int64)
        for b, L in enumerate(seq_lens):
            for i in range(need[b]):
                p = int(bt[b, i])
                fill[p] = max(int(fill[p]), min(page_size, L - i * page_size))
        for p in range(P):
            k[p, int(fill[p]):] = float("nan")
            v[p, int(fill[p]):] = float("nan")
    k_scale = v_scale = None
    if fp8:
        k_scale = (torch.rand(num_kv_heads, generator=g) * 0.5 + 0.25).to(device)
        v_scale = (torch.rand(num_kv_heads, generator=g) * 0.5 + 0.25).to(device)
        k = quantize_fp8(k.to(device).view(-1, num_kv_heads, head_dim), k_scale).view(k.shape)
        v = quantize_fp8(v.to(device).view(-1, num_kv_heads, dv), v_scale).view(v.shape)
    else:
        k, v = k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)
    return Paged(k, v, torch.tensor(list(seq_lens), dtype=torch.int32, device=device), bt.to(device),
                 k_scale, v_scale)


def make_query(q_lens: Sequence[int], num_heads: int, head_dim: int, *, dtype=torch.float16, device="cpu",
               generator: Optional[torch.Generator] = None):
    """(q [T, Hq, D], cu_seqlens_q [B+1] int32)."""
    g = generator or torch.Generator().manual_seed(1)
    T = sum(q_lens)
    q = torch.randn(T, num_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(list(q_lens), dtype=torch.int64), 0).to(torch.int32)
    return q, cu.to(device)
