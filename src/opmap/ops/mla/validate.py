"""Input checks shared by every MLA backend: each error names the argument (opmap.core.contract).

Shape, dtype and device checks always run. Checks of *values* (lengths against the pages a
sequence owns, page ids inside the cache, slots, sparse indices) read the tensors on the host;
they run in eager mode and are skipped while a CUDA graph is being captured (a host read is
impossible there; the kernels still mask every access so bad values cannot read out of bounds).
"""
from __future__ import annotations

import torch

from opmap.ops.norm.validate import check_norm  # the families' own checks, so errors read alike
from opmap.ops.rope.validate import check_rope
from opmap.core.contract import (InputError, expect, expect_same_device, expect_tensor, value_check_passed,
                         value_check_seen, values_wanted)

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
CACHE_DTYPES = FLOATS + (torch.float8_e4m3fn,)
INTS = (torch.int32,)


def scale_alias(kv_scale, scale):
    """``append_mla(..., scale=s)`` (docs/OPS_API.md's keyword) is ``kv_scale=s``."""
    if scale is None:
        return kv_scale
    expect(kv_scale is None, "scale", "both scale and kv_scale", "one of them (the same argument)")
    return scale


def scale_value(kv_scale, device) -> torch.Tensor:
    return torch.as_tensor(kv_scale, dtype=torch.float32, device=device).reshape(())


def check_scale(cache: torch.Tensor, kv_scale) -> None:
    if cache.dtype == torch.float8_e4m3fn:
        if kv_scale is None:
            raise InputError("kv_scale", "None", "a float or a [1] fp32 tensor for an fp8 cache")
        if isinstance(kv_scale, torch.Tensor):
            expect_tensor("kv_scale", kv_scale, dtype=torch.float32, shape=(1,), device=cache.device)
        else:
            expect(isinstance(kv_scale, (int, float)) and kv_scale > 0, "kv_scale", repr(kv_scale),
                   "a positive float or a [1] fp32 tensor")
    elif kv_scale is not None:
        raise InputError("kv_scale", "a scale", f"None for a {cache.dtype} cache (scales are for fp8)")


def check_cache(cache: torch.Tensor, width: int) -> None:
    expect_tensor("cache", cache, dtype=CACHE_DTYPES, ndim=3, contiguous=True)
    expect(cache.shape[2] == width, "cache", f"shape {tuple(cache.shape)}",
           f"last dim R + Dr = {width}")
    expect(cache.shape[0] > 0 and cache.shape[1] > 0, "cache", f"shape {tuple(cache.shape)}",
           "at least one page of at least one row")


def check_append(ckv, kpe, cache, slot_mapping, kv_scale) -> None:
    expect_tensor("ckv", ckv, dtype=FLOATS, ndim=2, last_dim_contiguous=True)
    T, R = ckv.shape
    expect_tensor("kpe", kpe, dtype=(ckv.dtype,), ndim=2, last_dim_contiguous=True)
    expect(kpe.shape[0] == T, "kpe", f"shape {tuple(kpe.shape)}", f"{T} rows like ckv")
    check_cache(cache, R + kpe.shape[1])
    expect_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(T,), contiguous=True)
    expect_same_device(ckv=ckv, kpe=kpe, cache=cache, slot_mapping=slot_mapping)
    check_scale(cache, kv_scale)
    n = cache.shape[0] * cache.shape[1]
    if T and values_wanted(slot_mapping) and not value_check_seen("mla-slots", slot_mapping, n):
        lo, hi = (int(v) for v in torch.stack((slot_mapping.min(), slot_mapping.max())).tolist())
        expect(lo >= -1 and hi < n, "slot_mapping", f"values in [{lo}, {hi}]",
               f"-1 (skip) or a slot in [0, {n}) = pages x page size")
        value_check_passed("mla-slots", slot_mapping, n)


def check_norm_rope_append(q_pe, kva, norm_weight, eps, positions, cos_sin, style, cache, slot_mapping,
                           kv_scale) -> tuple:
    """``norm_rope_append_mla``'s arguments: those of rmsnorm (the latent half of kva), rope (q_pe
    and kva's rope half, rotated over their whole width) and append_mla. Returns (T, R, Dr)."""
    expect_tensor("kva", kva, dtype=FLOATS, ndim=2, last_dim_contiguous=True)
    expect_tensor("q_pe", q_pe, dtype=(kva.dtype,), ndim=3, last_dim_contiguous=True)
    T, width = kva.shape
    Dr = q_pe.shape[2]
    R = width - Dr
    expect(R > 0 and q_pe.shape[0] == T, "kva", f"shape {tuple(kva.shape)}",
           f"({q_pe.shape[0]}, R + {Dr}): the latent rank then q_pe's rope width, one row a token of q_pe")
    check_norm(kva[:, :R], norm_weight, eps)
    r = check_rope(q_pe, kva[:, None, R:], positions, cos_sin, style)
    expect(r == Dr, "cos_sin", f"rotary dim {r}", f"{Dr}, the rope width of q_pe (MLA rotates all of it)")
    check_append(kva[:, :R], kva[:, R:], cache, slot_mapping, kv_scale)
    return T, R, Dr


def check_tables(seq_lens, block_tables, B: int, cache) -> None:
    expect_tensor("seq_lens", seq_lens, dtype=INTS, shape=(B,), contiguous=True)
    expect_tensor("block_tables", block_tables, dtype=INTS, ndim=2, last_dim_contiguous=True)
    expect(block_tables.shape[0] == B, "block_tables", f"shape {tuple(block_tables.shape)}",
           f"{B} rows (one per sequence)")
    page, P = cache.shape[1], cache.shape[0]
    memo = ("mla-tables", seq_lens, block_tables, P, page)
    if B == 0 or not values_wanted(seq_lens) or value_check_seen(*memo):
        return
    lens = seq_lens.long().cpu()
    cap = block_tables.shape[1] * page
    bad = ((lens < 0) | (lens > cap)).nonzero()
    if len(bad):
        b = int(bad[0])
        raise InputError("seq_lens", f"seq_lens[{b}] = {int(lens[b])}",
                         f"0 <= length <= max_pages x page size = {cap}")
    used = (torch.arange(block_tables.shape[1])[None, :] * page) < lens[:, None]
    ids = block_tables.long().cpu()[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= P):
        raise InputError("block_tables", f"page ids in [{int(ids.min())}, {int(ids.max())}] "
                         "among the pages the sequences own", f"page ids in [0, {P})")
    value_check_passed(*memo)


def check_softmax_scale(scale) -> None:
    """The softmax scale: a positive finite number (NaN, a negative or a string would run)."""
    expect(isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale < float("inf"),
           "scale", repr(scale), "a positive float")


def check_decode(q_nope, q_pe, cache, seq_lens, block_tables, kv_scale, scale=1.0) -> None:
    check_softmax_scale(scale)
    expect_tensor("q_nope", q_nope, dtype=FLOATS, ndim=3, last_dim_contiguous=True)
    B, H, R = q_nope.shape
    expect_tensor("q_pe", q_pe, dtype=(q_nope.dtype,), ndim=3, last_dim_contiguous=True)
    expect(q_pe.shape[:2] == (B, H), "q_pe", f"shape {tuple(q_pe.shape)}", f"({B}, {H}, Dr)")
    check_cache(cache, R + q_pe.shape[2])
    expect_same_device(q_nope=q_nope, q_pe=q_pe, cache=cache, seq_lens=seq_lens,
                       block_tables=block_tables)
    check_scale(cache, kv_scale)
    check_tables(seq_lens, block_tables, B, cache)


def check_sparse_indices(indices, seq_lens) -> None:
    B = seq_lens.shape[0]
    expect_tensor("indices", indices, dtype=INTS, ndim=2, last_dim_contiguous=True)
    expect(indices.shape[0] == B, "indices", f"shape {tuple(indices.shape)}", f"{B} rows")
    expect(indices.device == seq_lens.device, "indices", f"device {indices.device}",
           f"device {seq_lens.device}")
    if not values_wanted(indices) or indices.numel() == 0 or value_check_seen("mla-indices", indices, seq_lens):
        return
    idx = indices.long().cpu()
    lens = seq_lens.long().cpu()[:, None]
    bad = ((idx < -1) | (idx >= lens)).nonzero()
    if len(bad):
        b, j = (int(x) for x in bad[0])
        raise InputError("indices", f"indices[{b}, {j}] = {int(idx[b, j])} with seq_lens[{b}] = "
                         f"{int(lens[b, 0])}", "-1 (unused) or a token position in [0, seq_len)")
    s = idx.sort(dim=1).values
    dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).nonzero()
    if len(dup):
        b, j = (int(x) for x in dup[0])
        raise InputError("indices", f"token {int(s[b, j])} twice in row {b}",
                         "distinct token positions per sequence (duplicates would count twice)")
    value_check_passed("mla-indices", indices, seq_lens)


def check_prefill(q_nope, q_pe, cache, w_kc, w_vc, cu_seqlens_q, seq_lens, block_tables,
                  kv_scale, scale=1.0) -> None:
    check_softmax_scale(scale)
    expect_tensor("q_nope", q_nope, dtype=FLOATS, ndim=3, last_dim_contiguous=True)
    T, H, Dn = q_nope.shape
    expect_tensor("q_pe", q_pe, dtype=(q_nope.dtype,), ndim=3, last_dim_contiguous=True)
    expect(q_pe.shape[:2] == (T, H), "q_pe", f"shape {tuple(q_pe.shape)}", f"({T}, {H}, Dr)")
    expect_tensor("w_kc", w_kc, dtype=(q_nope.dtype,), ndim=3, last_dim_contiguous=True)
    expect(w_kc.shape[:2] == (H, Dn), "w_kc", f"shape {tuple(w_kc.shape)}", f"({H}, {Dn}, R)")
    R = w_kc.shape[2]
    expect_tensor("w_vc", w_vc, dtype=(q_nope.dtype,), ndim=3, last_dim_contiguous=True)
    expect(w_vc.shape[0] == H and w_vc.shape[2] == R, "w_vc", f"shape {tuple(w_vc.shape)}",
           f"({H}, Dv, {R})")
    check_cache(cache, R + q_pe.shape[2])
    expect_tensor("cu_seqlens_q", cu_seqlens_q, dtype=INTS, ndim=1, contiguous=True)
    B = cu_seqlens_q.shape[0] - 1
    expect(B >= 0, "cu_seqlens_q", "an empty tensor", "B + 1 offsets")
    expect_same_device(q_nope=q_nope, q_pe=q_pe, cache=cache, w_kc=w_kc, w_vc=w_vc,
                       cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, block_tables=block_tables)
    check_scale(cache, kv_scale)
    check_tables(seq_lens, block_tables, B, cache)
    if not values_wanted(cu_seqlens_q) or value_check_seen("mla-cu", cu_seqlens_q, seq_lens, T):
        return
    cu = cu_seqlens_q.long().cpu()
    expect(int(cu[0]) == 0 and int(cu[-1]) == T and bool((cu[1:] >= cu[:-1]).all()),
           "cu_seqlens_q", cu.tolist()[:8], f"non-decreasing offsets from 0 to T = {T}")
    qlen, lens = cu[1:] - cu[:-1], seq_lens.long().cpu()
    bad = (qlen > lens).nonzero()
    if len(bad):
        b = int(bad[0])
        raise InputError("seq_lens", f"seq_lens[{b}] = {int(lens[b])} < {int(qlen[b])} new tokens",
                         "seq_lens to include the new tokens (appended before attention)")
    value_check_passed("mla-cu", cu_seqlens_q, seq_lens, T)
