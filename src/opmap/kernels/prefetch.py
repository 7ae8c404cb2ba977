"""Weight rows into L2 ahead of their loads (sm90: ``cp.async.bulk.prefetch.L2``), for the decode GEMMs.

A decode GEMM streams its weight once; the kernel is bound by the bytes each warp keeps in flight
(registers, shared-memory stages), not by the DRAM (docs/dense.md). A bulk prefetch asks the L2
for a whole row range in one instruction and holds nothing in the SM, so a program can put its
split's weight rows in flight at its first instruction and its loads then find them in L2 or on
their way there. Issued before the PDL wait, the prefetch also overlaps the predecessor kernel
(norms, RoPE, attention at batch 1: latency-bound launches that leave the DRAM idle), because the
weight does not depend on it.

The L2 holds a few tens of MB: ``row_bytes`` caps the bytes a call asks for at ``BUDGET`` of the
device's L2 (a prefix of each row beyond that), so a wide GEMM does not evict its own prefetched
lines before it reads them. The instruction needs 16-byte aligned rows and a multiple of 16 bytes;
``row_bytes`` returns 0 (no prefetch) where a call has neither, and on devices before sm90.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

BUDGET = 0.5  # of the L2: the bytes one call may ask to prefetch
_ASM = tl.constexpr("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;")


@functools.lru_cache(maxsize=None)
def _l2(device: torch.device) -> int:
    """The device's L2 bytes where it runs the bulk prefetch (sm90+), else 0."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)


def row_bytes(w: torch.Tensor, rows: int, k_per_split: int, splits: int, per_element: int = 1) -> int:
    """Bytes of each program's row range (from its split's first column) to prefetch: the whole
    split's ``k_per_split`` columns (``per_element`` of them an element of ``w``: 8 for int4 codes
    in int32 words) while ``rows`` rows x ``splits`` splits fit ``BUDGET`` of the L2, else a prefix;
    a multiple of 16, and 0 where the device has no bulk prefetch or a row start is not 16-byte
    aligned."""
    l2 = _l2(w.device)
    row_stride = w.stride(0) * w.element_size()
    split_bytes = k_per_split * w.element_size() // per_element
    if not l2 or w.data_ptr() % 16 or row_stride % 16 or rows <= 0:
        return 0
    cap = int(BUDGET * l2) // (rows * max(splits, 1))
    return max(0, min(split_bytes, cap)) // 16 * 16


@triton.jit
def rows_to_l2(row_ptrs, nbytes):
    """Prefetch ``nbytes`` (a multiple of 16, > 0) from each 16-byte aligned pointer of ``row_ptrs``
    into L2. Duplicated pointers (a layout that replicates elements) prefetch twice: harmless."""
    tl.inline_asm_elementwise(_ASM, "=r,l,r", [row_ptrs.to(tl.int64), tl.zeros(row_ptrs.shape, tl.int32) + nbytes],
                              dtype=tl.int32, is_pure=False, pack=1)


@gluon.jit
def rows_to_l2_gluon(row_ptrs, nbytes):
    """rows_to_l2 for Gluon's distributed tensors."""
    addr = row_ptrs.to(gl.int64)
    gl.inline_asm_elementwise(_ASM, "=r,l,r", [addr, (addr * 0).to(gl.int32) + nbytes], dtype=gl.int32, is_pure=False,
                              pack=1)
