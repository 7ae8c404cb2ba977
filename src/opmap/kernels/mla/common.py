"""What the MLA decode kernels (the pointer kernel in decode.py, the TMA kernel in decode_tma.py, the
Gluon fp8 kernel in decode_fp8.py) share: the device-side split plan, the fp8 cache scale, the
persistent split-KV workspace and the merge of split partials. Every kernel imports it; none imports
another, and each backend's ``make_workspace`` plans the splits for its own kernel's programs.

Split-KV, planned on the device: the grid is fixed by (head blocks, ``num_splits``, batch) so that a
captured CUDA graph replays for any lengths; each program derives from ``seq_lens[b]`` (read on the
device) how many splits this sequence uses (one per ``split_min`` tokens, at most ``num_splits``)
and which token range is its own. Programs past the used splits exit at once. With one split the
kernel writes the output directly; otherwise partial outputs and LSEs go to the workspace and
``_mla_merge_kernel`` combines them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect
from opmap.kernels.attention.merge import split_sum


@triton.jit
def _cache_scale(SCALE_PTR, kv_scale, FP8: tl.constexpr, SCALE_FROM_PTR: tl.constexpr):
    """An fp8 cache's scale (from a [1] tensor, graph-safe, or a float argument); 1 otherwise."""
    ks = 1.0
    if FP8:
        if SCALE_FROM_PTR:
            ks = tl.load(SCALE_PTR)
        else:
            ks = kv_scale
    return ks


def scale_args(cache, kv_scale, unused_ptr):
    """(FP8, SCALE_FROM_PTR, SCALE_PTR, kv_scale float) launch arguments of ``_cache_scale``;
    ``unused_ptr``: any tensor, passed where no scale pointer is read."""
    fp8 = cache.dtype == torch.float8_e4m3fn
    from_ptr = fp8 and isinstance(kv_scale, torch.Tensor)
    return fp8, from_ptr, kv_scale if from_ptr else unused_ptr, float(kv_scale) if fp8 and not from_ptr else 1.0


@triton.jit
def _split_range(SEQ_LENS, b, split, K_SPARSE, SPLIT_MIN, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                 SPARSE: tl.constexpr):
    """(seq_len, used splits, first token, end) of this program's split: the device-side plan."""
    seq_len = tl.load(SEQ_LENS + b)
    if SPARSE:
        total = seq_len * 0 + K_SPARSE
    else:
        total = seq_len
    # at least one split, so that an empty sequence still writes zeros and lse = -inf
    used = tl.maximum(tl.minimum(tl.cdiv(total, SPLIT_MIN), NUM_SPLITS), 1)
    chunk = tl.cdiv(tl.cdiv(total, used), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, total)
    return seq_len, used, start, end


@dataclass
class Workspace:
    """Persistent split-KV buffers: allocate once (per batch bucket) and reuse across steps."""

    part_o: torch.Tensor  # [max_batch, H, num_splits, R] fp32
    part_lse: torch.Tensor  # [max_batch, H, num_splits] fp32
    num_splits: int
    split_min: int  # fewest tokens per split (the device-side plan never cuts finer)

    @property
    def max_batch(self) -> int:
        return self.part_o.shape[0]


def sm_count(device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: any small number exercises the split path


def plan_splits(batch: int, num_heads: int, device, block_h: int = 16, warps: int = 4, per_sm: int = 0) -> int:
    """Splits per sequence: as many as fit in one wave (floor, so that a partial second wave does
    not double the time), at most 128. A wave is two 4-warp programs per SM, or one 8-warp program
    (the 64-head blocks: docs/mla.md, Decisions), or ``per_sm`` where the kernel says (its shared
    memory decides how many of its programs an SM holds)."""
    progs = max(batch, 1) * triton.cdiv(num_heads, block_h)
    per_sm = per_sm or (2 if warps <= 4 else 1)
    return max(1, min(128, per_sm * sm_count(device) // progs))


def workspace(max_batch: int, num_heads: int, rank: int, device, num_splits: int, split_min: int) -> Workspace:
    expect(max_batch >= 1, "max_batch", max_batch, ">= 1")
    expect(num_splits >= 1, "num_splits", num_splits, ">= 1")
    expect(split_min >= 1, "split_min", split_min, ">= 1")
    return Workspace(torch.empty(max_batch, num_heads, num_splits, rank, dtype=torch.float32, device=device),
                     torch.empty(max_batch, num_heads, num_splits, dtype=torch.float32, device=device),
                     num_splits, split_min)


def decode_outputs(q_nope: torch.Tensor, workspace, make_workspace):
    """(out, lse, workspace) of a decode entry: its output [B, H, R] in q's dtype, its LSE [B, H] in
    fp32, and the workspace given (checked) or one ``make_workspace(B, H, R, device)`` makes."""
    B, H, R = q_nope.shape
    out = torch.empty(B, H, R, dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty(B, H, dtype=torch.float32, device=q_nope.device)
    if workspace is None:
        workspace = make_workspace(B, H, R, q_nope.device)
    check_workspace(workspace, B, H, R, q_nope.device)
    return out, lse, workspace


def check_workspace(ws: Workspace, B: int, H: int, R: int, device) -> None:
    expect(isinstance(ws, Workspace), "workspace", type(ws).__name__, "an MLA Workspace from make_workspace")
    expect(ws.max_batch >= B and ws.part_o.shape[1] == H and ws.part_o.shape[3] == R,
           "workspace", f"buffers {tuple(ws.part_o.shape)}", f"at least ({B}, {H}, splits, {R})")
    expect(ws.part_o.device == device, "workspace", str(ws.part_o.device), str(device))


@triton.jit
def _mla_merge_kernel(SEQ_LENS, PO, PLSE, O, LSE, H, R, K_SPARSE, SPLIT_MIN,
                      s_pob, s_poh, s_pos, s_plb, s_plh, s_ob, s_oh,
                      BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, S_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      SPARSE: tl.constexpr):
    """out[b, h, r-block] = the LSE-weighted mean of the used splits' partials (the attention
    package's merge.split_sum; the loop before it made one latency-bound load per split, 128 at
    B=1), over a grid that also splits R."""
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rb = tl.program_id(2)
    if SPARSE:
        total = tl.load(SEQ_LENS + b) * 0 + K_SPARSE
    else:
        total = tl.load(SEQ_LENS + b)
    used = tl.maximum(tl.minimum(tl.cdiv(total, SPLIT_MIN), NUM_SPLITS), 1)  # the decode's plan
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    mr = offs_r < R
    acc, m, l = split_sum(PLSE + b * s_plb + h * s_plh, PO + b * s_pob + h * s_poh, s_pos, used, offs_r, mr,
                          S_P, BLOCK_S, False)
    l_safe = tl.where(l != 0, l, 1.0)  # a NaN partial leaves l NaN: the output and the LSE NaN
    tl.store(O + b * s_ob + h * s_oh + offs_r, (acc / l_safe).to(O.dtype.element_ty), mask=mr)
    if rb == 0:
        tl.store(LSE + b * H + h, tl.where(l != 0, m + tl.log(l_safe), float("-inf")))


def merge_block_r(B: int, H: int, R: int, device) -> int:
    """The merge's latent block: the whole row (one program per head and sequence) when those
    programs fill the GPU, else blocks of 128 for more programs (docs/mla.md, Decisions: whole
    latent rows when B x H >= 4 x SMs)."""
    r = triton.next_power_of_2(R)
    return r if B * H >= 4 * sm_count(device) else min(128, r)


def merge(ws: Workspace, out, lse, seq_lens, k_sparse: int, split_min: int, sparse: bool) -> None:
    """Merge the partials a decode wrote into ``ws`` (nothing to do with one split): ``split_min``
    is the one the decode kernel planned with."""
    S = ws.num_splits
    if S <= 1:
        return
    B, H, R = out.shape
    po, pl = ws.part_o, ws.part_lse
    br = merge_block_r(B, H, R, out.device)
    s_p = triton.next_power_of_2(S)
    _mla_merge_kernel[(H, B, triton.cdiv(R, br))](
        seq_lens, po, pl, out, lse, H, R, k_sparse, split_min, po.stride(0), po.stride(1), po.stride(2),
        pl.stride(0), pl.stride(1), out.stride(0), out.stride(1), BLOCK_R=br, BLOCK_S=min(s_p, 4096 // br),
        S_P=s_p, NUM_SPLITS=S, SPARSE=sparse, num_warps=4)
