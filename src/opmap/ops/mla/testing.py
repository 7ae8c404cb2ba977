"""Random MLA problems for tests, check cases and benchmarks (fresh random data, shuffled pages)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .reference import quantize


@dataclass
class Paged:
    cache: torch.Tensor  # [P, page, R + Dr]
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, maxp] int32
    kv_scale: Optional[torch.Tensor]  # [1] fp32 for fp8
    values: torch.Tensor  # [P, page, R + Dr] fp32: what the cache represents (before fp8)


def make_cache(lens, R, Dr, page, dtype=torch.float16, device="cpu", fp8=False, spare_pages=3,
               gen: Optional[torch.Generator] = None, std=1.0) -> Paged:
    """A paged latent cache holding random tokens for sequences of ``lens``, pages shuffled.

    Table entries past a sequence's pages are 0 (a page some other sequence may own); pages owned
    by no sequence hold random values too, so reading a wrong page changes the result."""
    B = len(lens)
    need = [(n + page - 1) // page for n in lens]
    maxp = max(max(need, default=0), 1)
    P = sum(need) + spare_pages
    perm = torch.randperm(P, generator=gen)
    tables = torch.zeros(B, maxp, dtype=torch.int32)
    k = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[k:k + n].to(torch.int32)
        k += n
    values = torch.randn(P, page, R + Dr, generator=gen) * std
    scale = None
    if fp8:
        scale = torch.tensor([float(values.abs().max()) / 448.0 * 1.05])
        cache = quantize(values, torch.float8_e4m3fn, scale)
        scale = scale.to(device)
    else:
        cache = values.to(dtype)
    return Paged(cache.to(device), torch.tensor(lens, dtype=torch.int32, device=device),
                 tables.to(device), scale, values.to(device))


def sparse_indices(lens, k: int, gen: Optional[torch.Generator] = None, device="cpu") -> torch.Tensor:
    """[B, k] int32 distinct random positions < len per row, -1 padded when len < k."""
    out = torch.full((len(lens), k), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        m = min(n, k)
        out[b, :m] = torch.randperm(n, generator=gen)[:m].to(torch.int32)
        out[b] = out[b][torch.randperm(k, generator=gen)]  # -1 anywhere in the row
    return out.to(device)
