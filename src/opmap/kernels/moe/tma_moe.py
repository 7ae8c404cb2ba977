"""MoE on contiguous per-expert rows through TMA (backend ``triton-tma``): the many-token route.

The grouped GEMM of ``triton`` (grouped_gemm.py) gathers each row block's activations by pointer,
and every column-tile program of an expert gathers the same rows again; at prefill sizes its
tensor pipe sits idle behind those loads (docs/moe.md, "What bounds the prefill"). Here the rows are
gathered once, and both GEMMs then read dense tiles through tensor descriptors:
1. routing, then the align by expert padded to the row tile BM (route_triton.py, align.py);
2. permute: ``xs[r] = x[sorted_ids[r] // top_k]`` for every row of the padded total, zeros for the
   padding rows (one pass over the routed rows);
3. gate/up: ``inter[r] = SiLU(xs[r] @ w13[e, :I].T) * (xs[r] @ w13[e, I:].T)`` for the rows of
   expert e's blocks, A and both B tiles by TMA, stored by TMA in the same sorted order;
4. down: ``y[pair] = weight[pair] * (inter[r] @ w2[e].T)``, A and B by TMA, rows stored at their pair;
5. combine (grouped_gemm.combine): the k rows of each token summed in fp32.
Both GEMMs are persistent: as many programs as the GPU holds at once walk the (row block, column
tile) pairs of the padded total, GROUP_M row blocks at a time, so each weight tile is reused from L2
by the blocks of its expert. The padded total is read on the device: no host synchronisation, and
the whole op can be captured in a CUDA graph.

Bounds: a tile's columns past N (gate/up: into the up half or the next expert; down: into the next
expert) and rows past the padded total are computed and never stored; K tails read zeros from the
descriptors' bounds on both operands, so every stored value is exact to the K it has.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from opmap.core.contract import expect
from opmap.core.tiles import tile_config
from opmap.kernels.gluon_util import sm_figures
from opmap.kernels.moe.align import align
from opmap.kernels.moe.grouped_gemm import combine
from opmap.kernels.moe.route_triton import launch as route_launch
from opmap.kernels.moe.triton_moe import check_once


@triton.jit(do_not_specialize=["n_pairs"])
def _permute_kernel(x_ptr, sorted_ptr, total_ptr, xs_ptr, n_pairs, H, stride_x, stride_xs, TOP_K: tl.constexpr,
                    BR: tl.constexpr, BH: tl.constexpr):
    r0 = tl.program_id(0) * BR
    if r0 >= tl.load(total_ptr):  # BR divides BM: a program's rows are all in the total or all past it
        return
    rows = r0 + tl.arange(0, BR)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < n_pairs
    src = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    dst = rows.to(tl.int64)
    for h in range(0, H, BH):
        cols = h + tl.arange(0, BH)
        v = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=valid[:, None] & (cols < H)[None, :],
                    other=0.0)
        tl.store(xs_ptr + dst[:, None] * stride_xs + cols[None, :], v, mask=(cols < H)[None, :])


@triton.jit
def _tile_of(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row block, column tile) of a linear tile index: GROUP_M row blocks walk the column tiles
    together, so a weight tile is read from HBM once and from L2 by the other blocks of its expert."""
    width = GROUP_M * num_n
    first_m = (tile // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@triton.jit
def _gate_up_kernel(xs_desc, w_desc, inter_desc, block_expert_ptr, total_ptr, N, K, PRECISION: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                    PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr):
    num_m = tl.load(total_ptr) // BM
    num_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_of(tile, num_m, num_n, GROUP_M)
        row0 = pid_m * BM
        gate0 = tl.load(block_expert_ptr + pid_m) * (2 * N) + pid_n * BN  # w13 as [E * 2N, K]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            a = xs_desc.load([row0, k * BK])
            g = w_desc.load([gate0, k * BK])
            u = w_desc.load([gate0 + N, k * BK])
            acc = tl.dot(a, g.T, acc, input_precision=PRECISION)
            acc_u = tl.dot(a, u.T, acc_u, input_precision=PRECISION)
        h = acc / (1.0 + tl.exp(-acc)) * acc_u  # SiLU(gate) * up, in fp32
        inter_desc.store([row0, pid_n * BN], h.to(inter_desc.dtype))


@triton.jit(do_not_specialize=["n_pairs"])
def _down_kernel(inter_desc, w_desc, y_ptr, weights_ptr, sorted_ptr, block_expert_ptr, total_ptr, n_pairs, N, K,
                 stride_y, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr):
    num_m = tl.load(total_ptr) // BM
    num_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_of(tile, num_m, num_n, GROUP_M)
        row0 = pid_m * BM
        w0 = tl.load(block_expert_ptr + pid_m) * N + pid_n * BN  # w2 as [E * N, K]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            a = inter_desc.load([row0, k * BK])
            b = w_desc.load([w0, k * BK])
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        rows = row0 + tl.arange(0, BM)
        pair = tl.load(sorted_ptr + rows)
        valid = pair < n_pairs
        safe = tl.where(valid, pair, 0)
        acc = acc * tl.load(weights_ptr + safe, mask=valid, other=0.0)[:, None]
        cols = pid_n * BN + tl.arange(0, BN)
        tl.store(y_ptr + safe.to(tl.int64)[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=valid[:, None] & (cols < N)[None, :])


# config= keys (0: the plan's): the row tile (64 or 128; the plan takes it from the rows an expert
# meets), the column and K tiles of each GEMM, warps, pipeline stages, programs an SM, and whether
# the tile loop and the K loop are flattened into one pipelined loop (the next tile's loads issued
# under the current tile's epilogue).
CONFIG = {"BM": 0, "BN": 0, "BK": 0, "num_warps": 0, "num_stages": 0, "per_sm": 0, "FLATTEN": -1}
ROW_TILES = (64, 128)


def _defaults(bm: int) -> dict:
    # wgmma tiles: 64 rows on one warpgroup, 128 on two; the gated tile holds two accumulators
    return dict(BM=bm, BN=128, BK=64, num_warps=4 if bm == 64 else 8, num_stages=4 if bm == 64 else 3, per_sm=1,
                FLATTEN=1)


def pick_bm(n_pairs: int, num_experts: int) -> int:
    """64-row blocks unless each expert meets over 512 rows on average (every expert's last block is
    padding: tall tiles waste more of it where the experts are small, as Qwen3-30B-A3B's ~256 rows an
    expert at 4096 tokens)."""
    return 128 if n_pairs / num_experts > 512 else 64


def plan(n_pairs: int, num_experts: int, config=None) -> dict:
    cfg = tile_config(CONFIG, config)
    bm = cfg["BM"] or pick_bm(n_pairs, num_experts)
    expect(bm in ROW_TILES, "config", f"BM={bm}", f"one of {ROW_TILES}")
    out = _defaults(bm)
    for key in ("BN", "BK", "num_warps", "num_stages", "per_sm"):
        out[key] = cfg[key] or out[key]
    if cfg["FLATTEN"] != -1:
        expect(cfg["FLATTEN"] in (0, 1), "config", f"FLATTEN={cfg['FLATTEN']}", "0 or 1")
        out["FLATTEN"] = cfg["FLATTEN"]
    expect(out["BN"] in (32, 64, 128, 256) and out["BK"] in (32, 64, 128), "config",
           f"BN={out['BN']}, BK={out['BK']}", "BN of 32-256 and BK of 32-128, powers of two")
    expect(out["num_warps"] in (4, 8) and 1 <= out["num_stages"] <= 6 and 1 <= out["per_sm"] <= 4, "config",
           f"num_warps={out['num_warps']}, num_stages={out['num_stages']}, per_sm={out['per_sm']}",
           "4 or 8 warps, 1-6 stages, 1-4 programs an SM")
    return out


def _desc(t: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, cols])


def layout_problem(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> Optional[str]:
    """None when the operands can be read through tensor descriptors, else why (16-byte rows)."""
    per16 = 16 // x.element_size()
    H, I = x.shape[1], w2.shape[2]
    if H % per16 or I % per16:
        return f"hidden={H}, intermediate={I}: TMA rows need multiples of {per16} elements (16 bytes)"
    return None


def experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor, config=None) -> torch.Tensor:
    """The expert part for a given routing: -> [T, H] in x.dtype."""
    T, H = x.shape
    if T == 0:
        return torch.empty_like(x)
    E, two_i, _ = w13.shape
    I = two_i // 2
    top_k = topk_ids.shape[1]
    n_pairs = T * top_k
    p = plan(n_pairs, E, config)
    bm = p["BM"]
    sorted_ids, block_expert, total = align(topk_ids, E, bm)
    rows = sorted_ids.numel()  # the static bound of the padded total (a multiple of bm)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13 = w13.contiguous()
    w2 = w2.contiguous()
    xs = torch.empty(rows, H, dtype=x.dtype, device=x.device)
    br = 16
    bh = min(256, triton.next_power_of_2(H))
    _permute_kernel[(rows // br,)](x, sorted_ids, total, xs, n_pairs, H, x.stride(0), xs.stride(0), TOP_K=top_k,
                                   BR=br, BH=bh, num_warps=4)
    inter = torch.empty(rows, I, dtype=x.dtype, device=x.device)
    bn, bk = p["BN"], p["BK"]
    # the interpreter's 4 programs walk several tiles each, as a GPU's do
    programs = (sm_figures(x.device)[0] if x.device.type == "cuda" else 4) * p["per_sm"]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    common = dict(PRECISION=precision, BM=bm, BN=bn, BK=bk, GROUP_M=8, FLATTEN=bool(p["FLATTEN"]),
                  num_warps=p["num_warps"], num_stages=p["num_stages"])
    tiles_gu = (rows // bm) * triton.cdiv(I, bn)
    _gate_up_kernel[(min(programs, tiles_gu),)](
        _desc(xs, bm, bk), _desc(w13.view(E * two_i, H), bn, bk), _desc(inter, bm, bn), block_expert, total, I, H,
        PROGRAMS=min(programs, tiles_gu), **common)
    y = torch.empty(n_pairs, H, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.to(torch.float32).contiguous()
    tiles_down = (rows // bm) * triton.cdiv(H, bn)
    _down_kernel[(min(programs, tiles_down),)](
        _desc(inter, bm, bk), _desc(w2.view(E * H, I), bn, bk), y, weights, sorted_ids, block_expert, total, n_pairs,
        H, I, y.stride(0), PROGRAMS=min(programs, tiles_down), **common)
    return combine(y, T, top_k, torch.empty(T, H, dtype=x.dtype, device=x.device))


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, *,
        router: str = "softmax", renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
        routed_scaling: float = 1.0, score_bias: Optional[torch.Tensor] = None, w13_scale=None, w2_scale=None,
        w13_zero=None, w2_zero=None, config=None) -> torch.Tensor:
    """``config``: the tiles of both GEMMs (CONFIG), for tuning."""
    quant = dict(w13_scale=w13_scale, w2_scale=w2_scale, w13_zero=w13_zero, w2_zero=w2_zero)
    check_once(x, router_logits, w13, w2, top_k, router, n_group, topk_group, score_bias, quant)
    expect(all(v is None for v in quant.values()), "w13_scale", "quantised experts",
           "experts in x's dtype (triton and dequant-triton serve int4 / block fp8)")
    why = layout_problem(x, w13, w2)
    expect(why is None, "x", f"shape {tuple(x.shape)}", why)
    weights, ids = route_launch(router_logits, top_k, router, renormalize, n_group, topk_group, routed_scaling,
                                score_bias)
    return experts(x, weights, ids, w13, w2, config=config)
