"""The split-KV plan, workspace and merge that the paged decode kernels share (the Triton kernel of
decode.py and the Gluon fp8 kernel of decode_fp8.py): a helper module both import, so that neither
imports the other and both backends hand the engine the same ``make_workspace``.

The split plan is a pure function of one sequence's length, evaluated *on the device* by the decode
kernel and by ``_combine_kernel`` (no host synchronisation, nothing to rebuild when lengths change):
- auto mode: n = min(max_splits, ceil(E / min_chunk)) splits of equal size (rounded up to
  BLOCK_N) over the E keys the query sees; ``max_splits`` is chosen on the host from B, Hk and
  the SM count (one wave of ~2 programs per SM), so long contexts at small batch fill the GPU,
  and ``min_chunk`` too (64 keys when B x Hk is tiny, else 256: ``auto_min_chunk``);
- fixed mode (batch invariant): splits of exactly ``split_tokens`` keys; a sequence's result
  depends on its own length only, never on the batch it runs in.
A sequence with one split has its output written by the decode kernel; with more, each split
writes a normalised partial and its LSE (log2) into the persistent workspace and
``_combine_kernel`` merges them by LSE.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect, expect_tensor
from opmap.kernels import pdl
from opmap.kernels.attention.common import sm_count
from opmap.kernels.attention.merge import split_sum
from opmap.kernels.attention.tiles import _plan
from opmap.kernels.pdl import enter

MAX_SPLITS_AUTO = 32
MIN_CHUNK = 256
SPLIT_TOKENS_FIXED = 1024


@dataclass
class DecodeWorkspace:
    """Persistent split-KV buffers (allocate once per batch bucket; safe to capture)."""

    part_o: torch.Tensor  # [max_batch, Hq, max_splits, Dv] fp32, normalised partial outputs
    part_lse: torch.Tensor  # [max_batch, Hq, max_splits] fp32, log2 domain
    max_splits: int
    split_tokens: int  # 0 = auto plan; > 0 = fixed split size in keys (batch invariant)
    min_chunk: int  # 0: auto_min_chunk per launch


def make_workspace(max_batch: int, num_heads: int, head_dim: int, *, device, max_seq_len: Optional[int] = None,
                   batch_invariant: bool = False, split_tokens: Optional[int] = None,
                   max_splits: Optional[int] = None, min_chunk: Optional[int] = None) -> DecodeWorkspace:
    """``min_chunk``: fewest keys per split in auto mode; None chooses per launch (auto_min_chunk)."""
    expect(max_batch >= 1, "max_batch", max_batch, ">= 1")
    expect(min_chunk is None or min_chunk >= 1, "min_chunk", min_chunk, ">= 1 or None")
    fixed = 0
    if batch_invariant or split_tokens:
        fixed = int(split_tokens or SPLIT_TOKENS_FIXED)
        expect(fixed >= 1, "split_tokens", fixed, ">= 1")
        expect(max_seq_len is not None and max_seq_len >= 1, "max_seq_len", max_seq_len,
               "the longest context (sizes the fixed-split workspace)")
        splits = triton.cdiv(max_seq_len, fixed)
    else:
        splits = int(max_splits or MAX_SPLITS_AUTO)
    expect(splits >= 1, "max_splits", splits, ">= 1")
    dev = torch.device(device)
    return DecodeWorkspace(torch.empty(max_batch, num_heads, splits, head_dim, dtype=torch.float32, device=dev),
                           torch.empty(max_batch, num_heads, splits, dtype=torch.float32, device=dev),
                           splits, fixed, int(min_chunk or 0))


def auto_max_splits(batch: int, num_kv_heads: int, device: torch.device, per_sm: int = 2,
                    cap: int = MAX_SPLITS_AUTO) -> int:
    """Splits per sequence so that B * Hk * splits fills one wave of about ``per_sm`` programs per
    SM (rounded down: a second, mostly empty wave would cost as much as the first)."""
    return max(1, min(cap, (per_sm * sm_count(device)) // max(1, batch * num_kv_heads)))


def auto_min_chunk(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Fewest keys per split: 64 when B x Hk is at most 1/16 of the SMs (batch 1 with 8 KV heads
    on the H200), else 256 (docs/attention.md, Decisions: the 64-key minimum split)."""
    return 64 if batch * num_kv_heads * 16 <= sm_count(device) else MIN_CHUNK


@dataclass
class Plan:
    """One launch's split plan and partial buffers (``po`` / ``pl`` stand in for the output when
    there is one split: never written then)."""

    split_tokens: int
    min_chunk: int
    splits: int
    po: torch.Tensor  # [B', Hq, S, Dv] fp32
    pl: torch.Tensor  # [B', Hq, S] fp32


def plan(workspace, out, B, hq, dv, hk, page, block_tables, device) -> Plan:
    """The split plan of a decode launch over ``B`` sequences writing ``out`` [rows, Hq, Dv]."""
    if workspace is None:
        splits = auto_max_splits(B, hk, device)
        if splits == 1:
            return Plan(0, MIN_CHUNK, 1, out.view(out.shape[0], hq, 1, dv), torch.empty(1, 1, 1, device=device))
        # A split plan needs partial buffers; without a workspace they are allocated here, with
        # room for MAX_SPLITS_AUTO whatever this batch uses, so that their strides (kernel
        # arguments, specialized) are the same for every batch size: one binary for all of them.
        # Splits happen below ~2 programs per SM only (B * Hk < 2 * SMs): a few MB.
        room = max(splits, MAX_SPLITS_AUTO)
        return Plan(0, auto_min_chunk(B, hk, device), splits,
                    torch.empty(B, hq, room, dv, dtype=torch.float32, device=device),
                    torch.empty(B, hq, room, dtype=torch.float32, device=device))
    expect(isinstance(workspace, DecodeWorkspace), "workspace", type(workspace).__name__,
           "a DecodeWorkspace from make_workspace")
    expect_tensor("workspace.part_o", workspace.part_o, dtype=torch.float32, ndim=4, device=device)
    expect(workspace.part_o.shape[0] >= B and workspace.part_o.shape[1] == hq and workspace.part_o.shape[3] == dv,
           "workspace", f"part_o {tuple(workspace.part_o.shape)}", f"(>= {B}, {hq}, *, {dv})")
    fixed = workspace.split_tokens
    if fixed:
        splits = triton.cdiv(block_tables.shape[1] * page, fixed)
        expect(splits <= workspace.max_splits, "workspace", f"{workspace.max_splits} splits",
               f">= {splits} for block_tables of {block_tables.shape[1]} pages at split_tokens={fixed}")
    else:
        splits = min(workspace.max_splits, auto_max_splits(B, hk, device))
    return Plan(fixed, workspace.min_chunk or auto_min_chunk(B, hk, device), splits, workspace.part_o,
                workspace.part_lse)


# max_splits and min_chunk come from the batch size (auto plan): not specialized, so that every
# batch of a run launches the one binary the start-up compiled (decode._decode_kernel).
@triton.jit(do_not_specialize=["max_splits", "min_chunk"])
def _combine_kernel(o_ptr, lse_ptr, po_ptr, pl_ptr, sl_ptr, cu_ptr, window, split_tokens, max_splits, min_chunk,
                    s_ob, s_oh, s_pob, s_poh, s_pos, s_plb, s_plh,
                    DV: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, RETURN_LSE: tl.constexpr,
                    Q_FROM_CU: tl.constexpr, S_P: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    """out = the LSE-weighted mean of a row's split partials (merge.split_sum). The result depends
    on the row's own splits only (fixed mode stays batch invariant) and is the same on every run.
    The plan is read before the PDL wait: this kernel is launched right after a decode kernel only,
    which releases it after its own wait for everything before it, and seq_lens and cu_seqlens are
    inputs of both that the decode kernel does not write; the partials are read after the wait."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    L = tl.load(sl_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(L - window, 0)
    chunk, n = _plan(L - lo, split_tokens, max_splits, min_chunk, BLOCK_N)
    skip = n <= 1  # the decode kernel wrote this row itself
    row = b
    if Q_FROM_CU:
        r0 = tl.load(cu_ptr + b)
        skip = skip | (tl.load(cu_ptr + b + 1) - r0 != 1)
        row = r0.to(tl.int64)
    enter(PDL)
    if skip:
        return
    merge_head(o_ptr, lse_ptr, po_ptr, pl_ptr, b, h, row, n, tl.num_programs(1), s_ob, s_oh, s_pob, s_poh, s_pos,
               s_plb, s_plh, DV, RETURN_LSE, S_P, BLOCK_S)


@triton.jit
def merge_head(o_ptr, lse_ptr, po_ptr, pl_ptr, b, h, row, n, hq, s_ob, s_oh, s_pob, s_poh, s_pos, s_plb, s_plh,
               DV: tl.constexpr, RETURN_LSE: tl.constexpr, S_P: tl.constexpr, BLOCK_S: tl.constexpr):
    """Head h of sequence b: its n split partials merged by LSE (merge.split_sum) into output row
    ``row`` (and the LSE, natural log, of ``hq`` heads a row)."""
    dv = tl.arange(0, DV)
    # Every split holds >= 1 key: tot >= 1.
    acc, m, tot = split_sum(pl_ptr + b * s_plb + h * s_plh, po_ptr + b * s_pob + h * s_poh, s_pos, n, dv,
                            dv < DV, S_P, BLOCK_S, True)
    tl.store(o_ptr + row * s_ob + h * s_oh + dv, (acc / tot).to(o_ptr.dtype.element_ty))
    if RETURN_LSE:
        tl.store(lse_ptr + row * hq + h, (m + tl.log2(tot)) * 0.6931471805599453)


def merge_tiles(p: Plan, dv: int) -> tuple:
    """(S_P, BLOCK_S) of merging a plan's partials: sized by the partial buffers' most splits (the
    workspace's), not this batch's, so that one binary serves every batch size."""
    s_p = triton.next_power_of_2(p.po.shape[2])
    return s_p, max(1, min(s_p, 4096 // triton.next_power_of_2(dv)))


def combine(p: Plan, out, lse, seq_lens, cu, *, window, block_n: int, return_lse: bool, q_from_cu: bool):
    """Merge the partials of a plan with more than one split into ``out`` (and ``lse``); ``block_n``
    is the decode kernel's key tile (the plan rounds splits to it)."""
    if p.splits <= 1:
        return
    B, hq, dv = seq_lens.shape[0], out.shape[1], out.shape[2]
    s_p, block_s = merge_tiles(p, dv)
    _combine_kernel[(B, hq)](out, lse, p.po, p.pl, seq_lens, cu, int(window or 0), p.split_tokens, p.splits,
                             p.min_chunk, out.stride(0), out.stride(1), p.po.stride(0), p.po.stride(1),
                             p.po.stride(2), p.pl.stride(0), p.pl.stride(1), DV=dv, BLOCK_N=block_n,
                             HAS_WINDOW=window is not None, RETURN_LSE=return_lse, Q_FROM_CU=q_from_cu, S_P=s_p,
                             BLOCK_S=block_s, num_warps=4, **pdl.launch(out.device))
