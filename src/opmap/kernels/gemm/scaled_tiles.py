"""The tile plan, tuning keys and split-K workspace that the weight-only kernels whose scale changes
along K share (w4a16.py: a scale per group of input channels; fp8_block.py: a scale per block). Both
keep a K tile inside one scale's span (``span``: the group or the block edge), so BLOCK_K divides it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect
from opmap.core.tiles import tile_config
from opmap.kernels.gemm.splitk import counters, sm_count

INTERP = os.environ.get("TRITON_INTERPRET") == "1"  # no PTX (inline asm) there
# config= keys: the tile (0: the plan's choice); BLOCK_K (and, where the kernel says so, BLOCK_N)
# must divide the scale's span.
# SUB: K tiles a loop iteration (1, 2 or 4), their scales loaded first (where the plan takes 2:
# docs/dense.md, Decisions).
# FOLD: where the scale meets the weight. 0: after the MMA (each K tile's fp32 product times its
# scale, exact codes into the MMA; the accumulator leaves the MMA every tile). 1: before it (the
# codes times the scale rounded once to x's dtype, as a dequantised weight is; the MMA accumulates
# in place across K tiles). Not given: the plan's.
CONFIG = {"BLOCK_N": 0, "BLOCK_K": 0, "num_warps": 0, "num_stages": 0, "SPLIT": 0, "SUB": 0, "FOLD": -1}


@triton.jit
def scaled_dot(acc, w, xt, s, FOLD: tl.constexpr):
    """acc + (w times its scale ``s``, broadcast over w) @ xt: with FOLD the scale on the weight,
    rounded once to x's dtype, and the MMA accumulating in place; else on the tile's fp32 product."""
    xdt = xt.dtype
    prec: tl.constexpr = "ieee" if xdt == tl.float32 else "tf32"
    if FOLD:
        return tl.dot((w.to(tl.float32) * s).to(xdt), xt, acc, input_precision=prec)
    return acc + tl.dot(w.to(xdt), xt, input_precision=prec) * s


def config_of(config) -> dict:
    if config is None:
        return CONFIG
    cfg = tile_config(CONFIG, config)
    expect(cfg["BLOCK_K"] in (0, 16, 32, 64, 128, 256), "config", f"BLOCK_K={cfg['BLOCK_K']}",
           "16, 32, 64, 128 or 256")
    expect(cfg["BLOCK_N"] in (0, 16, 32, 64, 128), "config", f"BLOCK_N={cfg['BLOCK_N']}", "16, 32, 64 or 128")
    expect(0 <= cfg["SPLIT"] <= 64, "config", f"SPLIT={cfg['SPLIT']}", "0 (planned) to 64")
    expect(cfg["SUB"] in (0, 1, 2, 4), "config", f"SUB={cfg['SUB']}", "1, 2 or 4 K tiles a loop iteration")
    expect(cfg["FOLD"] in (-1, 0, 1), "config", f"FOLD={cfg['FOLD']}", "0 (scale after the MMA) or 1 (before)")
    return cfg


def plan(M: int, N: int, K: int, span: int, sms: int, bk_top: int, bn_in_span: bool, interp: bool = INTERP) -> dict:
    """The tile, K split, warps, stages, SUB and FOLD of a call. ``bn_in_span`` is the block-fp8
    kernel's (BLOCK_N inside one block); the int4 kernel's groups run along K only.
    - BLOCK_N 64 (128 from M = 33; capped by the span where ``bn_in_span``), BLOCK_K the largest
      power of two up to ``bk_top`` (64 in the interpreter) that divides the span; 4 warps (8 on
      128-channel tiles: with 4 the 128 x 64 accumulator and the converted weight spill).
    - K split while the N tiles number fewer than two an SM (each split keeps >= 4 K tiles). int4
      at M <= 32 with fewer N tiles than half the SMs splits deeper: DEEP_SPLIT splits at two
      stages (docs/dense.md, Decisions: int4's deep K splits).
    - FOLD (the scale on the weight before the MMA): block fp8 at every M; int4 from 64-row tiles,
      with SUB 2 at M <= 64 (docs/dense.md, Decisions: where the scale meets the weight).
    int4 at M <= 32 with fewer N tiles than half the SMs takes at least DEEP_SPLIT splits.
    The interpreter runs SUB 1 at one stage."""
    bm = max(16, triton.next_power_of_2(M)) if M <= 64 else 64
    bn = 64 if bm <= 32 else 128
    if bn_in_span:
        bn = min(bn, span)
    top = 64 if interp else bk_top
    bk = next(b for b in (256, 128, 64, 32, 16) if b <= top and span % b == 0)
    tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
    split, deep = 1, False
    if M <= 64 and tiles < 2 * sms:
        split = max(1, min(triton.cdiv(2 * sms, tiles), K // (4 * bk)))
    int4 = not bn_in_span
    if int4 and bm <= 32 and 2 * tiles < sms and split < DEEP_SPLIT <= K // (4 * bk):
        split, deep = DEEP_SPLIT, True
    fold = 1 if not int4 or bm == 64 else 0
    sub = 2 if int4 and bm == 64 and M <= 64 else 1
    if interp:
        sub = 1
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": split, "num_warps": warps_for(bn),
            "SUB": sub, "FOLD": fold, "num_stages": 1 if interp else 2 if deep else stages(bm, sub)}


DEEP_SPLIT = 8  # int4's K splits where few N tiles leave SMs idle at decode M (docs/dense.md, Decisions)


def stages(bm: int, sub: int) -> int:
    """Pipeline stages (each holds SUB K tiles): 4 (3 from 64-row tiles) at SUB 1, then fewer, so
    that shared memory still holds several programs an SM."""
    return max(2, (4 if bm <= 32 else 3) - (sub // 2))


def planned(M, N, K, span, device, cfg, bk_top: int, bn_in_span: bool, what: str) -> dict:
    """``plan`` with ``cfg``'s overrides (BLOCK_K, and BLOCK_N where ``bn_in_span``, must divide the
    span: ``what`` names it) and K_PER_SPLIT, a whole number of K tiles (rounding it up can leave
    the last splits empty: SPLIT is recounted)."""
    p = plan(M, N, K, span, sm_count(device), bk_top, bn_in_span)
    if (cfg["SUB"] or cfg["SPLIT"]) and not cfg["num_stages"] and not INTERP:  # the stages of the tiling asked for
        p["num_stages"] = stages(p["BLOCK_M"], cfg["SUB"] or p["SUB"])
    for key in ("num_warps", "num_stages", "SPLIT", "SUB") + (() if bn_in_span else ("BLOCK_N",)):
        p[key] = cfg[key] or p[key]
    if cfg["FOLD"] >= 0:
        p["FOLD"] = cfg["FOLD"]
    if cfg["BLOCK_N"] and not cfg["num_warps"]:  # the plan's warps for the tile asked for (see plan)
        p["num_warps"] = warps_for(cfg["BLOCK_N"])
    for key in ("BLOCK_K",) + (("BLOCK_N",) if bn_in_span else ()):
        if cfg[key]:
            expect(span % cfg[key] == 0, "config", f"{key}={cfg[key]}", f"a divisor of {what} {span}")
            p[key] = cfg[key]
    return split_k(p, K)


def warps_for(bn: int) -> int:
    """Warps of a tile of ``bn`` channels: 8 from 128 (with 4 the 128 x 64 accumulator and the
    converted weight spill), else 4."""
    return 8 if bn >= 128 else 4


def split_k(p: dict, K: int) -> dict:
    """K_PER_SPLIT of the plan's SPLIT, a whole number of K tiles; rounding it up can leave the last
    splits empty, so SPLIT is recounted."""
    per = triton.cdiv(triton.cdiv(K, p["BLOCK_K"]), p["SPLIT"]) * p["BLOCK_K"]
    p["K_PER_SPLIT"], p["SPLIT"] = per, triton.cdiv(K, per)
    return p


def output(x: torch.Tensor, M: int, N: int, K: int, bias) -> tuple:
    """(out [M, N] in x's dtype, whether the kernel has work): an empty product is the output as is,
    K = 0 the bias (or zeros)."""
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out, False
    if K == 0:
        return (out.zero_() if bias is None else out.copy_(bias.to(x.dtype).expand(M, N))), False
    return out, True


def text(p: dict) -> str:
    return (f"BLOCK_N {p['BLOCK_N']}, BLOCK_M {p['BLOCK_M']}, BLOCK_K {p['BLOCK_K']} x {p['SUB']} a step, "
            f"scale {'before' if p['FOLD'] else 'after'} the MMA, "
            f"{p['SPLIT']} K split{'s' if p['SPLIT'] > 1 else ''}, {p['num_warps']} warps, {p['num_stages']} stages")


def workspace(p: dict, M: int, N: int, out: torch.Tensor) -> tuple:
    """(partials [SPLIT, M, N] fp32, tile counters) of a split call; ``out`` twice (never read) with one split."""
    if p["SPLIT"] == 1:
        return out, out
    ws = torch.empty((p["SPLIT"], M, N), dtype=torch.float32, device=out.device)
    return ws, counters(triton.cdiv(N, p["BLOCK_N"]) * triton.cdiv(M, p["BLOCK_M"]), out.device)


def grid(p: dict, M: int, N: int) -> tuple:
    return triton.cdiv(N, p["BLOCK_N"]), triton.cdiv(M, p["BLOCK_M"]), p["SPLIT"]
