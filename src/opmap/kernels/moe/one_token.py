"""The MoE of one token (backend ``triton-gemv``): the active experts as GEMVs on CUDA cores, in two
launches.

At one token the grouped path (triton_moe.py) runs four launches (routing + align, gate/up, down,
combine) whose row tiles hold one valid row each; the op's time there is mostly the launches and
the short K loops, not the weight stream (docs/moe.md, "Benchmarks and what limits speed"). Here:
1. ``_route_gate_up_kernel``, grid (top_k, I / BLOCK_N): every program routes the token itself
   (route_rows, the routing of route_triton / route_align; a few hundred scores; group-limited
   routing runs route_triton's launch first instead), takes the
   expert of its slot, and computes BLOCK_N channels of gate and up for it as elementwise products
   with x summed in fp32 ([BLOCK_N, BLOCK_K] partials reduced once at the end), then SiLU(g) * u in
   fp32, stored in x's dtype as the [top_k, I] intermediate. Program (0, 0) writes the routing.
2. ``_down_kernel``, grid (H / BLOCK_N, top_k): program (n, j) computes BLOCK_N output channels of
   slot j's down projection times its routing weight; the slots' partials meet through the split-K
   tile counters (gemm/splitk.finish: the last slot to finish a tile sums them in slot order, so
   the result is deterministic) and are rounded once to x's dtype.
The output is the combine of the grouped path without its rounding of each slot's row: one rounding
instead of two. 16-bit experts only (quantised experts take triton).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect
from opmap.core.tiles import tile_config
from opmap.kernels.activation.triton_act import act_of
from opmap.kernels.gemm.splitk import counters, finish
from opmap.kernels.moe.common import next_pow2, route_rows
from opmap.kernels.moe.route_triton import launch as route_launch
from opmap.kernels.moe.triton_moe import check_once

# Tiles (config= keys, 0: the plan's). BLOCK_K elements of a weight row a step (16-byte loads at
# 8 a thread), BLOCK_N rows of a program; warps 4.
CONFIG = {"BLOCK_N": 0, "BLOCK_K": 0, "DOWN_BLOCK_N": 0, "num_warps": 0}


@triton.jit
def _route_gate_up_kernel(x_ptr, logits_ptr, bias_ptr, w13_ptr, inter_ptr, w_ptr, ids_ptr, E, H, I, stride_we,
                          stride_wn, routed_scaling, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                          E_POW2: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                          RENORM: tl.constexpr, ROUTED: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    j = tl.program_id(0)
    pid_n = tl.program_id(1)
    if ROUTED:  # the routing given (group-limited routing: route_triton ran it)
        e = tl.load(ids_ptr + j).to(tl.int64)
    else:
        t = tl.arange(0, 2)[:, None]  # row 0 is the token (a tile of two rows: the routing tile's least)
        ws, ids, kidx = route_rows(logits_ptr, bias_ptr, t, t < 1, E, 0, routed_scaling, TOP_K, K_POW2, E_POW2,
                                   SIGMOID, HAS_BIAS, RENORM)
        if (j == 0) & (pid_n == 0):
            tl.store(w_ptr + kidx + t * 0, ws, mask=(t < 1) & (kidx < TOP_K))
            tl.store(ids_ptr + kidx + t * 0, ids, mask=(t < 1) & (kidx < TOP_K))
        e = tl.sum(tl.sum(tl.where((t < 1) & (kidx == j), ids, 0), axis=1), axis=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w13_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + tl.cast(I, tl.int64) * stride_wn  # tl.cast: I may be a constant (1)
    pg = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    pu = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        k_ok = (k + offs_k) < H
        m = n_ok[:, None] & k_ok[None, :]
        # x in the weight tile's layout (each thread its own copy, from L1): no trip through shared
        # memory and its barriers, which a [BLOCK_K] vector broadcast over the rows takes
        xv = tl.load(x_ptr + k + offs_k[None, :] + 0 * offs_n[:, None], mask=m, other=0.0).to(tl.float32)
        pg += tl.load(g_ptrs + k, mask=m, other=0.0).to(tl.float32) * xv
        pu += tl.load(u_ptrs + k, mask=m, other=0.0).to(tl.float32) * xv
    g = tl.sum(pg, axis=1)
    u = tl.sum(pu, axis=1)
    h = act_of(g, False) * u
    tl.store(inter_ptr + j * I + offs_n, h.to(inter_ptr.dtype.element_ty), mask=n_ok)


# M is always 1 here: Triton would make it a constant, and splitk.finish takes it as a tensor
@triton.jit(do_not_specialize=["M"])
def _down_kernel(inter_ptr, w2_ptr, w_ptr, ids_ptr, o_ptr, ws_ptr, cnt_ptr, M, H, I, stride_we, stride_wn,
                 TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    j = tl.program_id(1)
    e = tl.load(ids_ptr + j).to(tl.int64)
    weight = tl.load(w_ptr + j)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w2_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, I, BLOCK_K):
        k_ok = (k + offs_k) < I
        m = n_ok[:, None] & k_ok[None, :]
        hv = tl.load(inter_ptr + j * I + k + offs_k[None, :] + 0 * offs_n[:, None], mask=m, other=0.0).to(tl.float32)
        part += tl.load(w_ptrs + k, mask=m, other=0.0).to(tl.float32) * hv
    acc = (tl.sum(part, axis=1) * weight)[:, None]  # [BLOCK_N, 1]; M: 1, the token's one row
    finish(acc, o_ptr, o_ptr, ws_ptr, cnt_ptr, offs_n, tl.arange(0, 1), M, H, 0, 0, j, False, TOP_K, BLOCK_N, 1)


def plan(H: int, I: int, config=None) -> dict:
    """The tiles of a call: ``config``'s keys (CONFIG) over the plan's. BLOCK_K 256 (8 elements of
    16 bits a thread on 4 warps, each step's row a 512-byte run), BLOCK_N 16 for gate/up (two
    [16, 256] fp32 partials: 64 registers a thread) and 16 for down; smaller where the matrix is."""
    if config is None:
        return _planned(H, I)  # the decode path: once a shape
    cfg = tile_config(CONFIG, config)
    expect(cfg["BLOCK_K"] in (0, 16, 32, 64, 128, 256, 512, 1024), "config", f"BLOCK_K={cfg['BLOCK_K']}",
           "0 (the plan's) or a power of two from 16 to 1024")
    expect(cfg["num_warps"] in (0, 1, 2, 4, 8), "config", f"num_warps={cfg['num_warps']}", "1, 2, 4 or 8")
    return {key: cfg[key] or v for key, v in _planned(H, I).items()}


@lru_cache(maxsize=64)
def _planned(H: int, I: int) -> dict:
    return {"BLOCK_N": min(16, next_pow2(I)), "DOWN_BLOCK_N": min(16, next_pow2(H)),
            "BLOCK_K": min(256, max(16, next_pow2(min(H, I)))), "num_warps": 4}


def describe(H: int, I: int, top_k: int, config=None) -> str:
    p = plan(H, I, config)
    return (f"one token: routing + gate/up on {top_k} x {triton.cdiv(I, p['BLOCK_N'])} programs of "
            f"{p['BLOCK_N']} channels, down on {triton.cdiv(H, p['DOWN_BLOCK_N'])} x {top_k} programs of "
            f"{p['DOWN_BLOCK_N']}, BLOCK_K {p['BLOCK_K']}, {p['num_warps']} warps")


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, *,
        router: str = "softmax", renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
        routed_scaling: float = 1.0, score_bias: Optional[torch.Tensor] = None, w13_scale=None, w2_scale=None,
        w13_zero=None, w2_zero=None, config=None) -> torch.Tensor:
    quant = dict(w13_scale=w13_scale, w2_scale=w2_scale, w13_zero=w13_zero, w2_zero=w2_zero)
    check_once(x, router_logits, w13, w2, top_k, router, n_group, topk_group, score_bias, quant)
    T, H = x.shape
    E, two_i, _ = w13.shape
    expect(T == 1, "x", f"{T} tokens", "one token (the triton-gemv backend serves decode at batch 1)")
    expect(all(v is None for v in quant.values()), "w13_scale", "quantised experts",
           "experts in x's dtype (int4 / block-fp8 experts: backend triton)")
    I = two_i // 2
    p = plan(H, I, config)  # x: stride 1 along H, as check_moe_args requires
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    if score_bias is not None:
        score_bias = score_bias.contiguous()  # the kernel reads it at unit stride
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    out = torch.empty(1, H, dtype=x.dtype, device=x.device)
    if H == 0:
        return out
    if I == 0:
        return out.zero_()
    inter = torch.empty(top_k, I, dtype=x.dtype, device=x.device)
    routed = n_group > 1
    if routed:  # group-limited routing: route_triton's launch first (route_rows has no groups)
        weights, ids = route_launch(logits, top_k, router, renormalize, n_group, topk_group, routed_scaling,
                                    score_bias)
        weights, ids = weights.view(top_k), ids.view(top_k)
    else:
        weights = torch.empty(top_k, dtype=torch.float32, device=x.device)
        ids = torch.empty(top_k, dtype=torch.int32, device=x.device)
    _route_gate_up_kernel[(top_k, triton.cdiv(I, p["BLOCK_N"]))](
        x, logits, score_bias if score_bias is not None else weights, w13, inter, weights, ids, E, H, I,
        w13.stride(0), w13.stride(1), float(routed_scaling), TOP_K=top_k, K_POW2=max(2, next_pow2(top_k)),
        E_POW2=max(16, next_pow2(E)), SIGMOID=router != "softmax", HAS_BIAS=score_bias is not None,
        RENORM=bool(renormalize), ROUTED=routed, BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"], num_warps=p["num_warps"])
    tiles = triton.cdiv(H, p["DOWN_BLOCK_N"])
    ws = torch.empty(top_k, 1, H, dtype=torch.float32, device=x.device) if top_k > 1 else out
    cnt = counters(tiles, x.device) if top_k > 1 else ids
    _down_kernel[(tiles, top_k)](
        inter, w2, weights, ids, out, ws, cnt, 1, H, I, w2.stride(0), w2.stride(1), TOP_K=top_k,
        BLOCK_N=p["DOWN_BLOCK_N"], BLOCK_K=p["BLOCK_K"], num_warps=p["num_warps"])
    return out
