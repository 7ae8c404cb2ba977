"""Peer: FlashInfer's MLA decode (``flashinfer.mla.BatchMLAPagedAttentionWrapper``), when the
package is importable (it is not on the CPU machine, and must be carried to the GPU machine:
scripts/flashinfer/). Entry ``mla_decode`` with the signature of reference.py (dense, bf16/fp16 cache).

FlashInfer plans on the host (CSR page lists, work partition) and runs on the device; ``plan``
and ``run`` are exposed separately so that a benchmark times ``run`` alone. Our cache
``[P, page, R + Dr]`` is passed as two strided views (ckv = [..., :R], kpe = [..., R:]), which the
kernel reads through its page / row strides. FlashInfer returns a base-2 LSE unless asked for the
natural log; ``run`` always hands back the natural log.
"""
from __future__ import annotations

import functools
import inspect
import math

import torch

from opmap.core.contract import InputError
from opmap.ops.mla.validate import check_decode

_WORKSPACE_BYTES = 128 * 2**20


@functools.lru_cache(maxsize=4)
def _wrapper(device: str):
    # optional: flashinfer
    import flashinfer

    ws = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="auto")


def plan(q_nope, q_pe, cache, seq_lens, block_tables, *, scale: float):
    """Build FlashInfer's plan for this batch (host work); returns the wrapper to ``run``."""
    B, H, R = q_nope.shape
    page = cache.shape[1]
    lens = seq_lens.cpu().long()
    npages = (lens + page - 1) // page
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(npages, 0).to(torch.int32)
    tables = block_tables.cpu()
    kv_indices = torch.cat([tables[b, :int(npages[b])] for b in range(B)]) if B else tables[:0, 0]
    dev = q_nope.device
    w = _wrapper(str(dev))
    w.plan(torch.arange(B + 1, dtype=torch.int32, device=dev), kv_indptr.to(dev),
           kv_indices.to(torch.int32).to(dev), seq_lens, H, R, q_pe.shape[2], page, False,
           float(scale), q_nope.dtype, cache.dtype)
    return w


def run(w, q_nope, q_pe, cache, return_lse: bool = False):
    R = q_nope.shape[2]
    ckv, kpe = cache[..., :R], cache[..., R:]
    if not return_lse:
        return w.run(q_nope, q_pe, ckv, kpe)
    if "return_lse_base_on_e" in inspect.signature(w.run).parameters:
        return w.run(q_nope, q_pe, ckv, kpe, return_lse=True, return_lse_base_on_e=True)
    out, lse2 = w.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    return out, lse2 * math.log(2.0)


def mla_decode(q_nope, q_pe, cache, seq_lens, block_tables, *, scale: float, kv_scale=None,
               return_lse: bool = False, workspace=None):
    check_decode(q_nope, q_pe, cache, seq_lens, block_tables, kv_scale, scale)
    if cache.dtype != q_nope.dtype:
        raise InputError("cache", f"dtype {cache.dtype}", f"{q_nope.dtype} (FlashInfer MLA: KV as q)")
    w = plan(q_nope, q_pe, cache, seq_lens, block_tables, scale=scale)
    return run(w, q_nope, q_pe, cache, return_lse)
