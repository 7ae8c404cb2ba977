"""Linear with block-wise fp8 weights (e4m3, one fp32 scale per b x b block: DeepSeek-V3's and the
Qwen3-FP8 releases' layout) in Triton, weight-only, any M: the kernel of the backend
``triton-fp8-block``.

``linear(x[M, K], w[N, K] e4m3, bias=None, w_scale[ceil(N / b), ceil(K / b)] fp32, *, config=None)``
-> [M, N] in x.dtype.

Design, as w4a16.py: swap AB (each program a ``[BLOCK_N, BLOCK_M]`` tile of out^T, x padded to 16
columns), many narrow N tiles, split K at decode M through the family's counters. A weight tile
lies inside one block (BLOCK_N and BLOCK_K divide b), so its scale is one number: the tile is
converted to x's dtype exactly (e4m3 values are exact in fp16 and bf16), the MMA runs on it, and
the block's scale multiplies the tile's fp32 product; no dequantised weight exists.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect
from opmap.core.tiles import tile_config
from opmap.kernels.gemm.splitk import counters, finish, sm_count
from opmap.ops.gemm.quant import block_of
from opmap.ops.gemm.validate import check_linear

_INTERP = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["M"])
def _fp8_block_kernel(x_ptr, w_ptr, s_ptr, b_ptr, o_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                      stride_om, K_PER_SPLIT, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                      EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k0 = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k0 + K_PER_SPLIT, K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + (k0 + offs_k)[:, None]
    s_row = s_ptr + ((pid_n * BLOCK_N) // BLOCK).to(tl.int64) * stride_sn  # the tile's row of blocks
    xdt = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
        else:
            k_mask = (k + offs_k) < K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        part = tl.dot(w.to(xdt), xt, input_precision="ieee" if xdt == tl.float32 else "tf32")
        acc += part * tl.load(s_row + k // BLOCK)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    finish(acc, b_ptr, o_ptr, ws_ptr, cnt_ptr, offs_n, offs_m, M, N, stride_om, pid_m, pid_k, HAS_BIAS, SPLIT,
           BLOCK_N, BLOCK_M)


# config= keys: the tile (0: the plan's choice); BLOCK_N and BLOCK_K must divide the block edge.
CONFIG = {"BLOCK_N": 0, "BLOCK_K": 0, "num_warps": 0, "num_stages": 0, "SPLIT": 0}


def config_of(config) -> dict:
    if config is None:
        return CONFIG
    cfg = tile_config(CONFIG, config)
    expect(cfg["BLOCK_K"] in (0, 16, 32, 64, 128, 256), "config", f"BLOCK_K={cfg['BLOCK_K']}",
           "16, 32, 64, 128 or 256")
    expect(cfg["BLOCK_N"] in (0, 16, 32, 64, 128), "config", f"BLOCK_N={cfg['BLOCK_N']}", "16, 32, 64 or 128")
    expect(0 <= cfg["SPLIT"] <= 64, "config", f"SPLIT={cfg['SPLIT']}", "0 (planned) to 64")
    return cfg


def plan(M: int, N: int, K: int, b: int, sms: int, interp: bool = _INTERP) -> dict:
    """Tile, K split, warps and stages: BLOCK_N 64 (128 from M = 33) and BLOCK_K 128 (64 in the
    interpreter), each capped by the block edge b; K split while the N tiles number fewer than two
    an SM (each split keeps >= 4 K tiles)."""
    bm = max(16, triton.next_power_of_2(M)) if M <= 64 else 64
    bn = min(64 if bm <= 32 else 128, b)
    bk = min(64 if interp else 128, b)
    tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
    split = 1
    if M <= 64 and tiles < 2 * sms:
        split = max(1, min(triton.cdiv(2 * sms, tiles), K // (4 * bk)))
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": split, "num_warps": 4,
            "num_stages": 1 if interp else (4 if bm <= 32 else 3)}


def _planned(M, N, K, b, device, cfg) -> dict:
    p = plan(M, N, K, b, sm_count(device))
    for key in ("num_warps", "num_stages", "SPLIT"):
        p[key] = cfg[key] or p[key]
    for key in ("BLOCK_N", "BLOCK_K"):
        if cfg[key]:
            expect(b % cfg[key] == 0, "config", f"{key}={cfg[key]}", f"a divisor of the block edge {b}")
            p[key] = cfg[key]
    per = triton.cdiv(triton.cdiv(K, p["BLOCK_K"]), p["SPLIT"]) * p["BLOCK_K"]
    p["K_PER_SPLIT"], p["SPLIT"] = per, triton.cdiv(K, per)
    return p


def describe(M: int, N: int, K: int, device, b: int, config=None) -> str:
    p = _planned(M, N, K, b, torch.device(device), config_of(config))
    return (f"BLOCK_N {p['BLOCK_N']}, BLOCK_M {p['BLOCK_M']}, BLOCK_K {p['BLOCK_K']}, {p['SPLIT']} K split"
            f"{'s' if p['SPLIT'] > 1 else ''}, {p['num_warps']} warps, {p['num_stages']} stages")


def linear(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None, *, config=None) -> torch.Tensor:
    """``config``: the tile of this kernel (CONFIG's keys; 0 keeps the plan's)."""
    M, N, K = check_linear(x, w, bias, w_scale, w_zero, block=True)
    expect(w.dtype == torch.float8_e4m3fn and w_scale is not None and w_scale.dim() == 2, "w_scale",
           "a scale per output channel" if w_scale is not None else "None", "a scale per block (block-wise fp8)")
    cfg = config_of(config)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.to(x.dtype).expand(M, N))
    b = block_of(N, K, w_scale)
    p = _planned(M, N, K, b, x.device, cfg)
    split, bm, bn = p["SPLIT"], p["BLOCK_M"], p["BLOCK_N"]
    if split > 1:
        ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        cnt = counters(triton.cdiv(N, bn) * triton.cdiv(M, bm), x.device)
    else:
        ws = cnt = out  # never read with one split
    _fp8_block_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm), split)](
        x, w, w_scale, bias if bias is not None else out, out, ws, cnt, M, N, K, x.stride(0), w.stride(0),
        w_scale.stride(0), out.stride(0), p["K_PER_SPLIT"], BLOCK=b, HAS_BIAS=bias is not None, SPLIT=split,
        EVEN_K=K % p["BLOCK_K"] == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=p["BLOCK_K"], num_warps=p["num_warps"],
        num_stages=p["num_stages"])
    return out
