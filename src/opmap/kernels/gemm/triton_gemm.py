"""Linear in Triton for decode-shaped GEMMs, with dense or weight-only fp8-e4m3 / int8 weights.

``linear(x[M, K], w[N, K], bias=None, w_scale=None, *, config=None) -> [M, N]`` in x.dtype: the
kernel of the backends ``triton-decode`` (dense weights) and ``triton-wo`` (weight-only; the Gluon
kernels of wo_gluon.py and wo_wgmma.py are their own backends, selected above it where they serve).

Design (the weight is the traffic; at decode M the activations are noise):
- Swap AB: each program computes a ``[BLOCK_N, BLOCK_M]`` tile of out^T = w @ x^T. The weight
  tile is the MMA's A operand, so a converted (fp8 / int8 -> x.dtype) weight tile can feed the
  tensor cores from registers, and a 64-row weight tile matches one Hopper warpgroup MMA
  even when M = 1 (x is padded to 16 columns, which costs no memory traffic).
- Many narrow N tiles (BLOCK_N = 64: 448 programs for N = 28672) so every SM streams weight;
  when N is far too small for that (fewer tiles than a quarter of the SMs; weight-only formats
  below four tiles an SM, see plan()), split K: each split writes fp32 partials to a workspace,
  and the program that finishes a tile last (splitk.py's counters) sums them in split order,
  scales, adds bias and casts: deterministic.
- Weight-only formats are converted tile by tile in registers; the per-output-channel scale
  multiplies the fp32 accumulator in the epilogue (it is constant along K), so no dequantised
  copy of the weight ever exists. On GPUs before sm89 (no fp8 conversion instruction) the
  fp8 bits are decoded with integer ops.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect
from opmap.core.tiles import tile_config
from opmap.kernels import pdl
from opmap.kernels.activation.triton_act import act_of, gelu_tanh_mul, silu_mul
from opmap.kernels.gemm.splitk import counters, sm_count
from opmap.kernels.pdl import gdc_launch_dependents, gdc_wait
from opmap.ops.gemm.validate import check_addend, check_linear

_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
W_SAME, W_INT8, W_FP8, W_FP8_BITS = 0, 1, 2, 3
@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, o_ptr, ws_ptr, cnt_ptr, a_ptr, M, N, K, stride_xm, stride_wn,
                 stride_om, stride_am, K_PER_SPLIT, W_KIND: tl.constexpr, HAS_SCALE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                 GATED: tl.constexpr = 0, HAS_ADD: tl.constexpr = False):
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
    if PDL:
        # Wait for x; the dependents are released only after the wait (see pdl.enter).
        gdc_wait()
        gdc_launch_dependents()
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + (k0 + offs_k)[:, None]
    xdt = x_ptr.dtype.element_ty
    # GATED (1 SiLU, 2 GELU-tanh): the weight is [gate; up] ([2N, K]); each program takes N-rows
    # tile of both halves (up rows N further on) and stores act(gate) * up, as the activation
    # kernel computes it from the two rounded GEMM outputs.
    up_off = tl.cast(N, tl.int64) * stride_wn if GATED else 0  # tl.cast: N may be a constant (1)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            w_mask = n_mask[:, None]
        else:
            k_mask = (k + offs_k) < k_end
            xt = tl.load(x_ptrs, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
            w_mask = n_mask[:, None] & k_mask[None, :]
        acc = tl.dot(_weight_tile(w_ptrs, w_mask, W_KIND, xdt), xt, acc, input_precision=PREC)
        if GATED:
            acc_u = tl.dot(_weight_tile(w_ptrs + up_off, w_mask, W_KIND, xdt), xt, acc_u, input_precision=PREC)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT == 1:
        _finish(acc, acc_u, s_ptr, b_ptr, o_ptr, a_ptr, offs_n, offs_m, N, n_mask, mask, stride_om, stride_am,
                HAS_SCALE, HAS_BIAS, GATED, HAS_ADD)
    else:
        # Partials [SPLIT, M, N] fp32 (gated: the up half's after them, [2, SPLIT, M, N]). The
        # program that finishes a tile last (a counter per tile) sums its partials in split order,
        # so the result does not depend on which split ends last, then applies scale and bias once
        # and resets the counter for the next call.
        part = ws_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        mn = M.to(tl.int64) * N
        tl.store(part + pid_k * mn, acc, mask=mask)
        if GATED:
            tl.store(part + (SPLIT + pid_k) * mn, acc_u, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        tile = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(SPLIT):  # .cg: the other splits' partials are in L2, never in this SM's L1
                acc += tl.load(part + s * mn, mask=mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_u += tl.load(part + (SPLIT + s) * mn, mask=mask, other=0.0, cache_modifier=".cg")
            _finish(acc, acc_u, s_ptr, b_ptr, o_ptr, a_ptr, offs_n, offs_m, N, n_mask, mask, stride_om, stride_am,
                    HAS_SCALE, HAS_BIAS, GATED, HAS_ADD)
            tl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _weight_tile(w_ptrs, w_mask, W_KIND: tl.constexpr, xdt: tl.constexpr):
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if W_KIND == 3:
        # e4m3fn bits -> fp16 bits: shifting exponent+mantissa left by 7 gives the value
        # times 2^-8 (subnormals included); the sign moves from bit 7 to bit 15.
        u = w.to(tl.int16) & 0xFF
        wv = (((u & 0x7F) << 7) | ((u & 0x80) << 8)).to(tl.float16, bitcast=True)
        return (wv * 256.0).to(xdt)
    return w.to(xdt)


@triton.jit
def _finish(acc, acc_u, s_ptr, b_ptr, o_ptr, a_ptr, offs_n, offs_m, N, n_mask, mask, stride_om, stride_am,
            HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, HAS_ADD: tl.constexpr):
    if GATED:
        dt = o_ptr.dtype.element_ty
        g = _scaled(acc, s_ptr, b_ptr, offs_n, n_mask, HAS_SCALE, HAS_BIAS).to(dt).to(tl.float32)
        u = _scaled(acc_u, s_ptr, b_ptr, N + offs_n, n_mask, HAS_SCALE, HAS_BIAS).to(dt).to(tl.float32)
        acc = act_of(g, GATED == 2) * u
    else:
        acc = _scaled(acc, s_ptr, b_ptr, offs_n, n_mask, HAS_SCALE, HAS_BIAS)
    if HAS_ADD:  # linear_add: the addend joins the fp32 result, one rounding for the sum
        acc += tl.load(a_ptr + offs_m[None, :].to(tl.int64) * stride_am + offs_n[:, None], mask=mask,
                       other=0.0).to(tl.float32)
    o_ptrs = o_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scaled(acc, s_ptr, b_ptr, offs_n, n_mask, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    if HAS_SCALE:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    return acc


# (BLOCK_K, warps, stages). 4 warps: a 64-row weight tile is one Hopper warpgroup MMA; deep
# pipelines keep enough weight bytes in flight per SM to cover HBM latency. BLOCK_K 512 is left
# out: its converted fp8/int8 tile needs all 255 registers and spills (seen in the sm90 cubin).
_SMALL_BN64 = [(128, 4, 4), (256, 4, 3), (256, 4, 4), (256, 4, 6)]
_SMALL_BN128 = [(64, 4, 6), (128, 4, 3), (128, 4, 4), (128, 8, 4)]  # M 33-64: 128 x 64 tiles
_LARGE = [(64, 4, 4), (64, 8, 3)]


def _configs(small_m: bool):
    shapes = list(dict.fromkeys(_SMALL_BN64 + _SMALL_BN128)) if small_m else _LARGE
    return [triton.Config({"BLOCK_K": bk}, num_warps=w, num_stages=s) for bk, w, s in shapes]


SMEM_BUDGET = 200 * 1024  # below the 227 KiB of sm90 / 163 KiB of sm80 is checked by Triton


def stage_bytes(bk: int, bn: int, bm: int, wb: int, xb: int, gated) -> int:
    """Shared memory of one pipeline stage: the weight tile (two for a gated call: gate and up)
    and the x tile."""
    return bk * ((2 if gated else 1) * bn * wb + bm * xb)


def _prune(configs, named_args, **kw):
    """Keep the configs meant for this tile width, and drop those whose pipelined tiles cannot
    fit in shared memory: compiling them only to fail costs seconds each."""
    wb = named_args["w_ptr"].element_size()
    xb = named_args["x_ptr"].element_size()
    bm, bn = kw["BLOCK_M"], kw["BLOCK_N"]
    meant = set(_SMALL_BN128 if bn == 128 else _SMALL_BN64) | set(_LARGE)
    mine = [c for c in configs if (c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) in meant]
    fit = [c for c in mine if c.num_stages * stage_bytes(c.kwargs["BLOCK_K"], bn, bm, wb, xb, kw.get("GATED"))
           <= SMEM_BUDGET]
    return fit or mine[:1]


_TUNED = {}
# Default (BLOCK_K, warps, stages) by (small M, BLOCK_N); each fits shared memory for bf16. Narrower
# tiles (config BLOCK_N 16 / 32) take the 64-row tile's.
DEFAULT = {(True, 64): (256, 4, 3), (True, 128): (128, 4, 3), (False, 128): (64, 4, 4)}
# config= keys: BLOCK_K, num_warps, num_stages fix that part of the tile (0: the shape class's
# default); AUTOTUNE=0 runs the default tile without autotuning (the check cases and tests that
# sweep many shapes pass it to spare compile time; benchmarks and the engine autotune);
# BLOCK_N and SPLIT replace the planner's weight-row tile and K split at decode M (0: plan()'s), to
# time narrower tiles and deeper splits where a few column tiles leave most SMs idle (a router).
CONFIG = {"BLOCK_K": 0, "num_warps": 0, "num_stages": 0, "AUTOTUNE": 1, "BLOCK_N": 0, "SPLIT": 0}


def config_of(config) -> dict:
    """The checked tuning dict of a call (CONFIG's keys)."""
    if config is None:
        return CONFIG  # read only: no checks on the path of every call
    cfg = tile_config(CONFIG, config)
    expect(cfg["BLOCK_K"] in (0, 16, 32, 64, 128, 256), "config", f"BLOCK_K={cfg['BLOCK_K']}",
           "16, 32, 64, 128 or 256 (K splits are multiples of 256)")
    expect(cfg["AUTOTUNE"] in (0, 1), "config", f"AUTOTUNE={cfg['AUTOTUNE']}", "0 or 1")
    expect(cfg["BLOCK_N"] in (0, 16, 32, 64, 128), "config", f"BLOCK_N={cfg['BLOCK_N']}", "16, 32, 64 or 128")
    return cfg


def _planned(p: dict, cfg: dict) -> dict:
    """plan()'s fields with config's BLOCK_N and SPLIT over them (decode M only: the prefill tile
    stays the planner's)."""
    if p["small"] and (cfg["BLOCK_N"] or cfg["SPLIT"]):
        p = dict(p, BLOCK_N=cfg["BLOCK_N"] or p["BLOCK_N"], SPLIT=cfg["SPLIT"] or p["SPLIT"])
    return p


def _fixed_tile(cfg: dict, small: bool, bn: int):
    """(BLOCK_K, warps, stages) when config fixes any of them or turns autotuning off, else None."""
    if cfg["AUTOTUNE"] and not (cfg["BLOCK_K"] or cfg["num_warps"] or cfg["num_stages"]):
        return None
    bk, nw, ns = DEFAULT[(small, max(bn, 64))]
    return cfg["BLOCK_K"] or bk, cfg["num_warps"] or nw, cfg["num_stages"] or ns


def _tuned(small_m: bool):
    """Autotuned variants (GPU only; the interpreter runs one fixed config). Few configs:
    compile time counts. Keyed on the shape class, not on M, so decode batches of any size
    reuse the choice."""
    if small_m not in _TUNED:
        _TUNED[small_m] = triton.autotune(
            _configs(small_m), key=["N", "K", "BLOCK_M", "BLOCK_N", "SPLIT", "W_KIND", "EVEN_K", "GATED", "HAS_ADD"],
            prune_configs_by={"early_config_prune": _prune})(_gemm_kernel)
    return _TUNED[small_m]


def describe(M: int, N: int, K: int, device, quantised: bool = False, config=None) -> str:
    """The tiles and K splits a call of this shape runs, and the config the autotuner chose for
    its shape class when it has run on this device (benchmark rows name it in their note)."""
    dev = torch.device(device)
    p = _planned(plan(M, N, K, sm_count(dev), quantised=quantised), config_of(config))
    kq = p.get("BLOCK_K", 256)
    split = triton.cdiv(K, triton.cdiv(triton.cdiv(K, kq), p["SPLIT"]) * kq)  # as linear() rounds it
    text = f"BLOCK_N {p['BLOCK_N']}, BLOCK_M {p['BLOCK_M']}, {split} K split{'s' if split > 1 else ''}"
    if "BLOCK_K" in p:
        return f"{text}, BLOCK_K {p['BLOCK_K']} (fixed)"
    fixed = _fixed_tile(config_of(config), p["small"], p["BLOCK_N"])
    if fixed is not None:
        return f"{text}, BLOCK_K {fixed[0]}, {fixed[1]} warps, {fixed[2]} stages (config)"
    best = getattr(_TUNED.get(p["small"]), "best_config", None)  # the last tuned call's, this shape's in a bench row
    if best is None:
        return text
    return f"{text}, BLOCK_K {best.kwargs['BLOCK_K']}, {best.num_warps} warps, {best.num_stages} stages (autotuned)"


def _w_kind(w: torch.Tensor, x: torch.Tensor) -> int:
    if w.dtype == torch.int8:
        return W_INT8
    if w.dtype == torch.float8_e4m3fn:
        if w.device.type != "cuda":
            return W_FP8
        if torch.cuda.get_device_capability(w.device) < (8, 9):
            return W_FP8_BITS
        return W_FP8
    return W_SAME


# K is split while the tiles number fewer than sms // SPLIT_BELOW (a quarter of the SMs).
SPLIT_BELOW = 4


def plan(M: int, N: int, K: int, sms: int, interp: bool = _INTERP, quantised: bool = False) -> dict:
    """Tile shape and split-K for a problem (BLOCK_K is autotuned on a GPU)."""
    small = M <= 64
    bm = max(16, triton.next_power_of_2(M)) if small else 64
    # 128-row weight tiles once x has 64 columns: each program re-reads its x tile from L2, and
    # at M = 64 with 64-row tiles that re-read traffic would equal the weight traffic.
    bn = 128 if bm == 64 else 64
    tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
    split = 1
    # Split K only when the N tiles leave most SMs idle (fewer than a quarter of them): at 64 and
    # 96 tiles no split beat split 1 on the H200 (docs/dense.md, Decisions).
    if small and tiles < sms // SPLIT_BELOW:
        # Enough programs for two per SM, but keep >= 4 K-blocks of 256 per split; where that
        # leaves fewer programs than a quarter of the SMs (a MoE router's 1-3 tiles), splits of one
        # K-block up to that quarter (docs/dense.md, Decisions: the router's deep K split).
        split = max(1, min(triton.cdiv(2 * sms, tiles), K // 1024))
        if tiles * split < sms // SPLIT_BELOW:
            split = max(split, min(triton.cdiv(sms // SPLIT_BELOW, tiles), K // 256))
    elif small and quantised and bm <= 32 and tiles < 4 * sms:
        # A weight-only program streams its weights at about half a bf16 program's byte rate and
        # is latency-bound (docs/dense.md), so more programs in flight help: 4 splits below one
        # tile an SM, 2 below four (docs/dense.md, Decisions: the weight-only K splits at M <= 32).
        # Kept at >= 4 K-blocks of 256 per split.
        split = max(1, min(4 if tiles < sms else 2, K // 1024))
    elif small and quantised and tiles < sms:
        # M 33-64 (128 x 64 tiles): about two programs an SM, as at M <= 32 before the rule above
        # (measured at M <= 32 only).
        split = max(1, min((2 * sms) // tiles, K // 1024))
    d = {"BLOCK_M": bm, "BLOCK_N": bn, "SPLIT": split, "small": small}
    if interp:
        d["BLOCK_K"] = max(16, min(64, triton.next_power_of_2(K)))
    return d


ACTS = {"silu": 1, "gelu_tanh": 2}  # linear_act's act -> the kernel's GATED


def linear_act(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None, *, act: str = "silu",
               config=None, _plan: dict | None = None) -> torch.Tensor:
    """``act(x @ w[:I].T) * (x @ w[I:].T)`` for a gate/up weight ``w`` [2I, K] (gate rows first) in
    one launch: each program takes the same rows of both halves and stores the gated product, as
    the activation kernel computes it from the two outputs rounded to x's dtype (the same values
    as linear then silu_mul / gelu_tanh_mul, up to the GEMM's summation order). -> [M, I]."""
    expect(act in ACTS, "act", repr(act), f"one of {sorted(ACTS)}")
    return linear(x, w, bias, w_scale, w_zero, config=config, _plan=_plan, _gated=ACTS[act])


def linear_add(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor, bias=None, w_scale=None, w_zero=None, *,
               config=None, _plan: dict | None = None) -> torch.Tensor:
    """``add + x @ w.T (+ bias)`` in one launch: the addend ([M, N], x's dtype; a residual, or the
    routed experts' sum beside a shared expert) joins the fp32 result in the epilogue and the sum is
    rounded once, as cuBLAS's addmm does it. -> [M, N]."""
    return linear(x, w, bias, w_scale, w_zero, config=config, _plan=_plan, _add=add)


def linear(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None, *, config=None,
           _plan: dict | None = None, _gated: int = 0, _add=None) -> torch.Tensor:
    """``config``: the tile of this kernel (CONFIG's keys); none autotunes BLOCK_K / warps / stages
    on a GPU. ``_plan`` (internal) overrides fields of ``plan()``, e.g. {"SPLIT": 3} or
    {"W_KIND": W_FP8_BITS} (tests and benchmarks). ``w_zero``: linear's contract; int4 only, named here.
    ``_gated``: linear_act's (the kernel's GATED); ``_add``: linear_add's addend."""
    M, N, K = check_linear(x, w, bias, w_scale, w_zero)
    if _add is not None:
        check_addend(_add, x, N)
    if _gated:
        expect(N % 2 == 0, "w", f"shape {tuple(w.shape)}", "an even number of rows: the gate half, then the up half")
        N //= 2
    cfg = config_of(config)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.zero_()
        if bias is not None:
            if _gated:
                b = bias.to(x.dtype).expand(M, 2 * N).contiguous()
                return (silu_mul if _gated == 1 else gelu_tanh_mul)(b)
            if _add is not None:
                return (_add.float() + bias.float()).to(x.dtype)
            out += bias.to(x.dtype)
        if _add is not None:
            out.copy_(_add)
        return out
    p = _planned(plan(M, N, K, sm_count(x.device), quantised=w.dtype != x.dtype), cfg)
    p.update(_plan or {})  # tests and benchmarks override fields (split, W_KIND)
    if "BLOCK_K" in p and cfg["BLOCK_K"]:
        p["BLOCK_K"] = cfg["BLOCK_K"]  # the interpreter's one fixed tile, as config asks
    split, bm, bn = p["SPLIT"], p["BLOCK_M"], p["BLOCK_N"]
    kind = p.get("W_KIND", _w_kind(w, x))  # tests force the bit-decoding fp8 path
    wk = w.view(torch.uint8) if kind == W_FP8_BITS else w
    dummy = out  # never read when the HAS_* flag is off
    fixed_k = "BLOCK_K" in p
    # K_PER_SPLIT must be a multiple of every BLOCK_K that may run (<= 256 when tuned or given);
    # then a K that is a multiple of it too needs no K masks.
    kq = p["BLOCK_K"] if fixed_k else 256
    k_per_split = triton.cdiv(triton.cdiv(K, kq), split) * kq
    split = triton.cdiv(K, k_per_split)  # rounding K_PER_SPLIT up can leave the last splits empty
    even = K % kq == 0
    common = dict(W_KIND=kind, HAS_SCALE=w_scale is not None, HAS_BIAS=bias is not None, SPLIT=split,
                  HAS_ADD=_add is not None,
                  PREC="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=bm, BLOCK_N=bn, GATED=_gated,
                  **pdl.launch(x.device))
    if split > 1:
        ws = torch.empty(((2 if _gated else 1) * split, M, N), dtype=torch.float32, device=x.device)
        cnt = counters(triton.cdiv(N, bn) * triton.cdiv(M, bm), x.device)
    else:
        ws = cnt = dummy  # never read with one split
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), split)
    args = (x, wk, w_scale if w_scale is not None else dummy, bias if bias is not None else dummy, out, ws, cnt,
            _add if _add is not None else dummy, M, N, K, x.stride(0), w.stride(0), out.stride(0),
            _add.stride(0) if _add is not None else 0, k_per_split)
    fixed = None if fixed_k else _fixed_tile(cfg, p["small"], bn)
    if fixed_k:
        _gemm_kernel[grid](*args, EVEN_K=even, BLOCK_K=p["BLOCK_K"], num_warps=4, **common)
    elif fixed is not None:
        bk, nw, ns = fixed
        if _gated:  # two weight tiles a stage: as _prune, the stages shared memory holds
            fit = SMEM_BUDGET // stage_bytes(bk, bn, bm, w.element_size(), x.element_size(), True)
            expect(not cfg["num_stages"] or cfg["num_stages"] <= fit, "config", f"num_stages={cfg['num_stages']}",
                   f"at most {fit} stages for a gated call of BLOCK_K {bk} (two weight tiles a stage)")
            ns = max(1, min(ns, fit))
        _gemm_kernel[grid](*args, EVEN_K=even, BLOCK_K=bk, num_warps=nw, num_stages=ns, **common)
    else:
        _tuned(p["small"])[grid](*args, EVEN_K=even, **common)
    return out
