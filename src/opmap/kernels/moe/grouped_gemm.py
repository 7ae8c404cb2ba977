"""Grouped GEMM over expert-aligned row blocks (see align.py), and the weighted combine.

One kernel, two uses:
- gate/up (GATED=True): rows of x gathered by token (pair // top_k), two accumulators (gate
  columns n and up columns I + n of w13[e]) sharing each A tile; the epilogue writes
  SiLU(gate) * up to ``inter[pair, n]`` so the [T*k, 2I] intermediate never exists.
- down (GATED=False, WEIGHTED=True): rows of ``inter`` by pair, w2[e]; the epilogue multiplies
  by the pair's routing weight in fp32 and writes ``y[pair, :]``.
The combine sums the k rows of each token in fp32 (deterministic: no atomics).

Each program owns one BM-row block (all rows of one expert) and one BN column tile; blocks past
the padded total exit at once. Weights are read as [BK, BN] tiles of the row-major [N, K]
expert matrix (K contiguous). Offsets into x / w / outputs are int64.

Quantised experts (QUANT) stay quantised in memory, the layouts of ``opmap.ops.gemm.quant``:
int4 (QUANT=1: packed int32 [E, N, K / 8], a scale per group of SPAN input channels, uint8 zero
codes or the symmetric 8) and block fp8 (QUANT=2: e4m3 [E, N, K], a scale per SPAN x SPAN block).
A K tile never straddles a group or block (BK divides SPAN), so the tile's codes (int4: minus the
zero) are exact in x's dtype: the MMA runs on them and each column's scale multiplies the tile's
fp32 product, as the dense weight-only kernels do (kernels/gemm/w4a16.py, fp8_block.py).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from opmap.kernels.gemm import nibbles
from opmap.kernels.moe.common import next_pow2
from opmap.ops.gemm.quant import INT4_SYM_ZERO, block_of


@triton.jit
def _scales_of(s_base, z_base, cols, kk, live, stride_sn, SPAN: tl.constexpr, QUANT: tl.constexpr,
               HAS_ZERO: tl.constexpr, SYM_ZERO: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """The scales ([BN] fp32) and zero codes ([BN] int32) of columns ``cols`` at K tile ``kk``
    (``live``: a K tile of the expert; else zeros, never used)."""
    rows = cols.to(tl.int64)
    m = (cols >= 0) & live
    g = (kk * BK) // SPAN
    if QUANT == 1:
        s = tl.load(s_base + rows * stride_sn + g, mask=m, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_base + rows * stride_sn + g, mask=m, other=0).to(tl.int32)
        else:
            z = tl.full([BN], SYM_ZERO, tl.int32)
    else:
        s = tl.load(s_base + (rows // SPAN) * stride_sn + g, mask=m, other=0.0).to(tl.float32)
        z = tl.full([BN], 0, tl.int32)
    return s, z


@triton.jit
def _weight_tile(w_base, cols, kk, live, K, stride_wn, z, QUANT: tl.constexpr, EVEN_K: tl.constexpr,
                 ADT: tl.constexpr, ASM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """The [BK, BN] quantised weight tile of columns ``cols`` at K tile ``kk`` in x's dtype (ADT),
    exactly (int4: code minus the zero ``z``; the scales multiply the tile's product)."""
    rows = cols.to(tl.int64)
    if QUANT == 1:
        words = tl.load(w_base + rows[None, :] * stride_wn + (kk * (BK // 8) + tl.arange(0, BK // 8))[:, None],
                        mask=live, other=0)
        v = nibbles.unpack(words, z[None, :], ADT, ASM)  # [BK // 8, BN, 8]: code i of word j is row 8j + i
        w = tl.reshape(tl.permute(v, (0, 2, 1)), [BK, BN])
    else:
        offs_k = kk * BK + tl.arange(0, BK)
        if EVEN_K:
            w = tl.load(w_base + rows[None, :] * stride_wn + offs_k[:, None], mask=live, other=0.0)
        else:
            w = tl.load(w_base + rows[None, :] * stride_wn + offs_k[:, None], mask=(offs_k < K)[:, None] & live,
                        other=0.0)
        w = w.to(ADT)
    return w


@triton.jit
def _quant_step(acc, acc_u, a_ptrs, w_base, cols, kk, live, K, N, offs_k, stride_wn, sg, zg, su, zu,
                GATED: tl.constexpr, QUANT: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                ADT: tl.constexpr, ASM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """One K tile of quantised experts: the gate (and up) products, each times its column scales."""
    a = tl.load(a_ptrs, mask=((offs_k < K - kk * BK) & live)[None, :], other=0.0)
    g = _weight_tile(w_base, cols, kk, live, K, stride_wn, zg, QUANT, EVEN_K, ADT, ASM, BK, BN)
    acc += tl.dot(a, g, input_precision=PRECISION) * sg[None, :]
    if GATED:
        u = _weight_tile(w_base, cols + N, kk, live, K, stride_wn, zu, QUANT, EVEN_K, ADT, ASM, BK, BN)
        acc_u += tl.dot(a, u, input_precision=PRECISION) * su[None, :]
    return acc, acc_u


@triton.jit
def _quant_scales(s_base, z_base, cols, kk, live, N, stride_sn, GATED: tl.constexpr, SPAN: tl.constexpr,
                  QUANT: tl.constexpr, HAS_ZERO: tl.constexpr, SYM_ZERO: tl.constexpr, BK: tl.constexpr,
                  BN: tl.constexpr):
    """The gate's (and up's) scales and zeros at K tile ``kk``."""
    sg, zg = _scales_of(s_base, z_base, cols, kk, live, stride_sn, SPAN, QUANT, HAS_ZERO, SYM_ZERO, BK, BN)
    if GATED:
        su, zu = _scales_of(s_base, z_base, cols + N, kk, live, stride_sn, SPAN, QUANT, HAS_ZERO, SYM_ZERO, BK, BN)
    else:
        su, zu = sg, zg
    return sg, zg, su, zu


@triton.jit(do_not_specialize=["n_pairs", "rows_bucket"])  # T varies: one binary for every T
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, total_ptr, s_ptr, z_ptr,
    n_pairs, N, K, a_row_div, rows_bucket,
    stride_am, stride_we, stride_wn, stride_om, stride_se, stride_sn,
    GATED: tl.constexpr, WEIGHTED: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    QUANT: tl.constexpr = 0, SPAN: tl.constexpr = 1, HAS_ZERO: tl.constexpr = False, SYM_ZERO: tl.constexpr = 8,
    ASM: tl.constexpr = False, SUB: tl.constexpr = 1,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    num_m = tl.num_programs(0) // num_n
    # Grouped ordering: GROUP_M consecutive row blocks (mostly one expert) walk the column
    # tiles together, so each weight tile is read from HBM once and from L2 after.
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    total = tl.load(total_ptr)
    if pid_m * BM >= total:
        return
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < n_pairs
    a_row = tl.where(valid, pair // a_row_div, 0).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BK)
    # Loads need no row or column masks: padding rows read row 0 and the column tail wraps
    # around (offs_n % N); neither result is stored. Masks cost registers and pipelining.
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    w_base = w_ptr + expert * stride_we
    g_ptrs = w_base + (offs_n % N).to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if GATED:
        u_ptrs = g_ptrs + N * stride_wn
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    if QUANT != 0:
        # Quantised weights: one [BK, BN] tile at a time, converted exactly, the column scales on
        # the tile's fp32 product (a separate loop keeps the unquantised one as it was).
        adt = a_ptr.dtype.element_ty
        cols = offs_n % N
        s_base = s_ptr + expert * stride_se
        z_base = z_ptr + expert * stride_se
        if not GATED:
            acc_u = acc  # (unused)
        nk = tl.cdiv(K, BK)
        # SUB K tiles an iteration, their scales loaded first: the scales are plain loads, which
        # Triton's pipeline leaves in the loop, so each iteration waits on their latency once.
        for k0 in range(0, nk, SUB):
            sg0, zg0, su0, zu0 = _quant_scales(s_base, z_base, cols, k0, True, N, stride_sn, GATED, SPAN, QUANT,
                                               HAS_ZERO, SYM_ZERO, BK, BN)
            if SUB > 1:
                sg1, zg1, su1, zu1 = _quant_scales(s_base, z_base, cols, k0 + 1, k0 + 1 < nk, N, stride_sn, GATED,
                                                   SPAN, QUANT, HAS_ZERO, SYM_ZERO, BK, BN)
            if SUB > 2:
                sg2, zg2, su2, zu2 = _quant_scales(s_base, z_base, cols, k0 + 2, k0 + 2 < nk, N, stride_sn, GATED,
                                                   SPAN, QUANT, HAS_ZERO, SYM_ZERO, BK, BN)
                sg3, zg3, su3, zu3 = _quant_scales(s_base, z_base, cols, k0 + 3, k0 + 3 < nk, N, stride_sn, GATED,
                                                   SPAN, QUANT, HAS_ZERO, SYM_ZERO, BK, BN)
            acc, acc_u = _quant_step(acc, acc_u, a_ptrs, w_base, cols, k0, True, K, N, offs_k, stride_wn, sg0, zg0,
                                     su0, zu0, GATED, QUANT, EVEN_K, PRECISION, adt, ASM, BK, BN)
            if SUB > 1:
                acc, acc_u = _quant_step(acc, acc_u, a_ptrs + BK, w_base, cols, k0 + 1, k0 + 1 < nk, K, N, offs_k,
                                         stride_wn, sg1, zg1, su1, zu1, GATED, QUANT, EVEN_K, PRECISION, adt, ASM,
                                         BK, BN)
            if SUB > 2:
                acc, acc_u = _quant_step(acc, acc_u, a_ptrs + 2 * BK, w_base, cols, k0 + 2, k0 + 2 < nk, K, N, offs_k,
                                         stride_wn, sg2, zg2, su2, zu2, GATED, QUANT, EVEN_K, PRECISION, adt, ASM,
                                         BK, BN)
                acc, acc_u = _quant_step(acc, acc_u, a_ptrs + 3 * BK, w_base, cols, k0 + 3, k0 + 3 < nk, K, N, offs_k,
                                         stride_wn, sg3, zg3, su3, zu3, GATED, QUANT, EVEN_K, PRECISION, adt, ASM,
                                         BK, BN)
            a_ptrs += SUB * BK
    else:
        for kk in range(0, tl.cdiv(K, BK)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                g = tl.load(g_ptrs)
            else:
                k_ok = offs_k < K - kk * BK
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, g, acc, input_precision=PRECISION)
            if GATED:
                if EVEN_K:
                    u = tl.load(u_ptrs)
                else:
                    u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
                acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
                u_ptrs += BK
            a_ptrs += BK
            g_ptrs += BK
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_u  # SiLU(gate) * up, in fp32
    if WEIGHTED:
        w = tl.load(weights_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0)
        acc = acc * w[:, None]
    o_ptrs = out_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(y_ptr, out_ptr, H, top_k, stride_y, stride_o, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = offs < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for j in range(0, top_k):
        acc += tl.load(y_ptr + (t * top_k + j) * stride_y + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# Read once: Triton itself fixes interpreter mode when @triton.jit runs at import, and an
# os.environ lookup on each of the three calls per MoE call is host time for nothing.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _interpreting() -> bool:
    return _INTERPRETING


def pick_bm(n_pairs: int, num_experts: int, quantised: bool = False) -> int:
    """Row-block height from the expected rows per expert (known on the host: no sync).
    Decode is weight-streaming: an expert whose rows spill into a second block has its weights
    read twice, so the tile covers the expected rows plus three standard deviations (Mixtral at
    64 tokens: 16 +- 4 rows -> 32). Prefill wants tall tiles to reuse each weight tile across
    rows, but every expert's last block is padded, so the tile stays well below the rows an
    expert gets (Qwen3-30B-A3B at 4096 tokens: ~256 rows -> 64; Mixtral: ~1000 -> 128). Quantised
    experts stop at 64: the 128-row gated tile with the converted weight tile spills on sm90."""
    if _interpreting():
        return 16
    per_expert = n_pairs / num_experts
    high = per_expert + 3.0 * per_expert ** 0.5
    if high <= 16:
        return 16
    if high <= 32:
        return 32
    if per_expert <= 512 or quantised:
        return 64
    return 128


def _c(bn, bk, warps, stages, group_m):
    return triton.Config(dict(BN=bn, BK=bk, GROUP_M=group_m), num_warps=warps, num_stages=stages)


# A few configs per regime (compile time counts): decode tiles are narrow and deep along K, to
# spread the weight stream over many CTAs; prefill tiles feed wgmma (BM >= 64). Configs whose
# accumulators spill on sm90 (seen with ptxas: 128x128 with 4 warps, 128x256 with 8, gated
# 2x128x128 with 8) are left out.
# GROUP_M=8 at decode too: the (rare) second block of an expert runs next to its first, so
# the weight tiles it re-reads come from L2.
# The down projection's short K (768-1408) at one token also takes 128-column tiles (fewer, longer
# programs; docs/moe.md, Decisions: the decode tiles at one token).
_DECODE = {True: [_c(32, 128, 4, 4, 8), _c(64, 128, 4, 3, 8), _c(32, 256, 4, 3, 8)],
           False: [_c(32, 128, 4, 4, 8), _c(64, 128, 4, 4, 8), _c(16, 256, 4, 3, 8), _c(128, 128, 4, 3, 8)]}
_BM64 = {True: [_c(64, 64, 4, 4, 8), _c(64, 128, 4, 3, 8)],
         False: [_c(128, 64, 4, 4, 8), _c(128, 128, 4, 3, 8)]}
_BM128 = {True: [_c(64, 64, 8, 3, 8), _c(64, 64, 8, 4, 8)],
          False: [_c(128, 64, 8, 3, 8), _c(128, 64, 8, 4, 8)]}


# K tiles a loop iteration the tuner tries for quantised experts, by whether the row tile is a
# prefill one (BM >= 64); INTERP_SUB: the one of the interpreter / fp32 path (tests vary it)
QUANT_SUB = {False: (1, 4), True: (1, 2)}
INTERP_SUB = 1


def _bk_in_span(bk: int, span: int) -> int:
    """The largest K tile up to ``bk`` that divides the scale's span (a power of two from 16)."""
    while bk > 16 and span % bk:
        bk //= 2
    return bk


def _prune(configs, named_args, **kw):
    bm = kw["BM"]
    table = _DECODE if bm <= 32 else (_BM64 if bm == 64 else _BM128)
    want = table[bool(kw["GATED"])]
    k = named_args["K"]
    out = [c for c in configs if c in want and c.kwargs["BK"] <= max(16, triton.next_power_of_2(k))] or want[:1]
    if kw.get("QUANT", 0):
        # a K tile inside one group / block; 8 warps on the prefill tiles, where the converted
        # weight tile beside the accumulators spills with 4 (ptxas, sm90); SUB K tiles an
        # iteration (QUANT_SUB: the tuner times each; 4 only on 32-column tiles and narrower,
        # 64-column ones spill), with fewer stages as each holds SUB tiles; the 128-column decode
        # tile is the 16-bit down projection's (measured there only)
        span = kw["SPAN"]
        out = [c for c in out if bm >= 64 or c.kwargs["BN"] <= 64]
        warps = 8 if bm >= 64 else 4
        out = list({(bk := _bk_in_span(c.kwargs["BK"], span), c.kwargs["BN"], max(c.num_warps, warps),
                     st := max(2, c.num_stages - sub // 2), sub):
                    triton.Config(dict(c.kwargs, BK=bk, SUB=sub), num_warps=max(c.num_warps, warps), num_stages=st)
                    for c in out for sub in QUANT_SUB[bm >= 64]
                    if sub <= 2 or c.kwargs["BN"] <= 32}.values())
    return out


def _bench(kernel_call, quantiles):
    """The tuner's timing: a quarter of Triton's default repeat time per config (rep=25 against 100)
    and a short warm-up: a few hundred runs of a kernel of tens to hundreds of microseconds decide
    as well, and the engine tunes every key at start-up (token_counts), 28 of them for
    DeepSeek-V2-Lite."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


_ALL_CONFIGS = list(dict.fromkeys(c for t in (_DECODE, _BM64, _BM128) for cs in t.values() for c in cs))
_tuned_kernel = triton.autotune(_ALL_CONFIGS, key=["N", "K", "rows_bucket", "BM", "GATED", "QUANT", "SPAN"],
                                prune_configs_by={"early_config_prune": _prune}, do_bench=_bench)(
    triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BK"] == 0})(_grouped_gemm_kernel))


def token_counts(max_tokens: int, top_k: int, num_experts: int, quantised: bool = False) -> list[int]:
    """One token count per tuning key (rows bucket, BM) that a call of 1..max_tokens tokens can
    hit, the smallest of each: running the MoE once at each tunes every GEMM a step can launch
    (the key's N, K, gating and dtypes are fixed by the weights)."""
    first: dict = {}
    for t in range(1, max_tokens + 1):
        n = t * top_k
        first.setdefault((next_pow2(n), pick_bm(n, num_experts, quantised)), t)
    return sorted(first.values())


def quant_of(w: torch.Tensor, scale) -> tuple[int, int]:
    """(QUANT, SPAN) of expert weights: (0, 1) unquantised, (1, group) int4, (2, block edge) block fp8."""
    if scale is None:
        return 0, 1
    E, n_rows, kw = w.shape
    if w.dtype == torch.int32:
        return 1, kw * 8 // scale.shape[2]
    return 2, block_of(n_rows, kw, scale[0])


def grouped_gemm(a, w, out, sorted_ids, block_expert, total, n_pairs, a_row_div, bm, *, gated, weights=None,
                 scale=None, zero=None):
    """out[pair] = f(a[pair // a_row_div] @ w[e].T) for every pair of every expert block; ``scale``
    (and ``zero``) for quantised experts (see the module's docstring)."""
    quant, span = quant_of(w, scale)
    E, n_rows, K = w.shape
    K = K * 8 if quant == 1 else K
    N = n_rows // 2 if gated else n_rows
    nblocks = block_expert.numel()
    args = (a, w, out, weights if weights is not None else out, sorted_ids, block_expert, total,
            scale if scale is not None else out, zero if zero is not None else out,
            n_pairs, N, K, a_row_div, next_pow2(n_pairs),
            a.stride(0), w.stride(0), w.stride(1), out.stride(0),
            scale.stride(0) if scale is not None else 0, scale.stride(1) if scale is not None else 0)
    # fp32 inputs: exact fp32 products (tl.dot would otherwise round them to TF32).
    flags = dict(GATED=gated, WEIGHTED=weights is not None, BM=bm,
                 PRECISION="ieee" if a.dtype == torch.float32 else "tf32")
    if quant:
        flags.update(QUANT=quant, SPAN=span, HAS_ZERO=zero is not None, SYM_ZERO=INT4_SYM_ZERO,
                     ASM=not _interpreting())  # nibbles.py: no PTX in the interpreter
    if _interpreting() or a.dtype == torch.float32:
        # Interpreter: small tiles keep it fast (speed is not measured there). fp32 on a GPU is a
        # correctness path (exact fp32 dot products spill with the tuned 16-bit tiles).
        bn, bk = 32, _bk_in_span(32, span) if quant else 32
        _grouped_gemm_kernel[(nblocks * -(-N // bn),)](
            *args, **flags, EVEN_K=K % bk == 0, BN=bn, BK=bk, GROUP_M=4, SUB=INTERP_SUB if quant else 1, num_warps=4,
            num_stages=1 if _interpreting() else 2)
        return
    # The tuner's decision per key, mirrored here: after the first call of a key the kernel is
    # launched directly with it, skipping Autotuner.run and Heuristics.run (their per-call dict
    # building over ~20 arguments is host time on every launch, measured on the CPU with the
    # launch stubbed; two GEMM launches per MoE call). The key is the autotuner's own: its key
    # arguments plus the dtypes of the tensor arguments (the int32 index tensors never vary).
    key = (N, K, args[13], bm, gated, quant, span, a.dtype, w.dtype, out.dtype,
           None if weights is None else weights.dtype, None if scale is None else scale.dtype,
           None if zero is None else zero.dtype)
    cfg = _BEST.get(key)
    if cfg is None:
        # EVEN_K depends on the BK the tuner picks, so a heuristic sets it per config.
        grid = lambda meta: (nblocks * -(-N // meta["BN"]),)  # noqa: E731  (plain ints: see common.next_pow2)
        _tuned_kernel[grid](*args, **flags)
        _BEST[key] = _tuned_kernel.best_config
        return
    kw = cfg.all_kwargs()
    _grouped_gemm_kernel[(nblocks * -(-N // kw["BN"]),)](*args, **flags, **kw, EVEN_K=K % kw["BK"] == 0)


_BEST: dict = {}


def combine(y: torch.Tensor, T: int, top_k: int, out: torch.Tensor) -> torch.Tensor:
    H = y.shape[1]
    bh = min(1024, next_pow2(H))
    _combine_kernel[(T, -(-H // bh))](y, out, H, top_k, y.stride(0), out.stride(0), BH=bh)
    return out
