"""Decode GEMM benchmark cases: M in {1, 16, 32, 64, 256} (and 1024 in the full grid) for the Llama-3-8B MLP shapes
(K=4096, N=28672: gate+up; K=14336, N=4096: down), bf16 / fp8-e4m3 / int8 weights with
per-output-channel scales, bf16 activations. The full grid (not ``--quick``) adds every other
projection of Llama-3-8B and Qwen3-8B (QKV, O, Qwen3's MLP, both LM heads).

Providers, timed in the same run on the same inputs, each named after the backend it runs:
- bf16 weights: our small-M Triton GEMM ("opmap-triton": triton-decode, M <= 64) and cuBLAS (F.linear).
- fp8 / int8 weights: our weight-only kernels, each its own backend: the Triton one
  ("opmap-triton": triton-wo, every M), the Gluon mma.sync one at M <= 32 ("opmap-gluon-wo") and the
  Gluon warpgroup-MMA one at 32 < M <= 64 ("opmap-gluon-wo-wgmma", sm90), with their tunings as
  ``--variants`` rows; at M >= 128 also our
  "dequant-cublas" (the weight dequantised by one Triton pass into a reused bf16 scratch, then
  cuBLAS); cuBLAS bf16 on the same
  weights kept in bf16 (the baseline of the "fp8 weight-only >= 1.8x cuBLAS bf16" target);
  "dequant+cublas" (a bf16 copy of the weight made per call, then cuBLAS: what a quantised
  path that falls back costs); and for fp8, "scaled-mm" (activations quantised per token to
  fp8, then torch._scaled_mm on cuBLASLt).
The ops ``gemm.w4a16`` and ``gemm.fp8_block`` time the formats whose scale changes along K (int4 with
a scale per 128 input channels; fp8 with a scale per 128 x 128 block): our Triton kernel at every M,
for int4 at M <= 16 our Gluon kernel (gluon-w4a16) and its tunings,
cuBLAS on the weights kept in bf16, from M = 128 dequant-cublas, for int4 gemlite (a Triton low-bit GEMM
library, on the same codes and scales) and for block fp8 scaled-mm-block (activations quantised per
128-channel group, cuBLASLt's block-scaled fp8 GEMM).
The op ``gemm.act_quant`` times the per-token fp8 activation quantisation that scaled-mm runs
before its GEMM (our Triton kernel against the same thing in PyTorch ops) at prefill row counts.
Minimal bytes: the weight (N*K*elem) + its scales, x read and the output written once.
Every M is timed by CUDA-graph replay (launch costs out): decode steps replay from graphs, and so
do the engine's prefill steps of up to ``EngineConfig.prefill_graph_tokens`` (2048) tokens, so the
GPU time is what a route choice at M >= 128 has to compare (eager timings of the small shapes
measured the host's launch work instead: dequant-cublas on O at M = 256 took about twice its
graph-timed figure eagerly).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opmap.core import hw, registry
from opmap.core.specs import GemmSpec
from opmap.harness.bench.base import BenchCase, Provider
from opmap.kernels.activation.triton_act import silu_mul
from opmap.kernels.gemm import act_quant, fp8_block, scaled_mm, triton_gemm, w4a16, w4a16_gluon, wo_gluon, wo_wgmma
from opmap.ops.gemm import quant
from opmap.peers.gemm import gemlite_peer
from opmap.ops.gemm.quant import quantize_weight

SHAPES = [(4096, 28672), (14336, 4096)]  # (K, N)
# QKV (32 + 2 x 8 heads of 128) and O of both models, Qwen3-8B's gate+up and down, the LM heads
MORE_SHAPES = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (4096, 128256), (4096, 151936)]
MS = (1, 16, 32, 64, 256)
MS_FULL = MS + (1024,)  # a prefill chunk: where a quantised path that dequantises once per call may win
MS_MODEL_QUICK = (1, 256)  # a model's other widths in the quick grid: batch-1 decode and a prefill chunk
RIDGE = 180.0  # FLOP per byte where an H200 turns from bandwidth- to compute-bound (bf16)


INT4_GROUP = quant.INT4_GROUP


def _setup(M, N, K, fmt):
    def setup(device):
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16) / K ** 0.5
        d = dict(x=x, w=w)  # quantised cases keep the bf16 weight for the cuBLAS-bf16 baseline
        if fmt == "int4":  # symmetric, fp16 group scales: what GPTQ / AWQ / W4A16 checkpoints carry
            d["wq"], s, _ = quant.quantize_int4(w, INT4_GROUP)
            d["s"] = s.half()
        elif fmt == "fp8-block":
            d["wq"], d["s"] = quant.quantize_fp8_block(w, 128)
        elif fmt:
            d["wq"], d["s"] = quantize_weight(w, fmt)
        return d

    return setup


def _ours(backend, quantised, config=None, scale_dtype=None):
    """``scale_dtype``: the weight's scales converted to it first (outside the timed call)."""
    def make(inp):
        fn = registry.get("gemm", backend).fn("linear")
        kw = {} if config is None else {"config": config}
        if quantised:
            s = inp["s"] if scale_dtype is None else inp["s"].to(scale_dtype)
            return lambda: fn(inp["x"], inp["wq"], None, s, **kw)
        return lambda: fn(inp["x"], inp["w"], **kw)

    return make


def _described(describe, M, N, K, **kw):
    def note():
        return describe(M, N, K, "cuda" if torch.cuda.is_available() else "cpu", **kw)

    return note


def _cublas(inp):
    return lambda: F.linear(inp["x"], inp["w"])


def _dequant_cublas(inp):
    wq, s, x = inp["wq"], inp["s"], inp["x"]
    return lambda: F.linear(x, wq.to(x.dtype) * s[:, None].to(x.dtype))


# Tunings (config=) of the weight-only Gluon kernels (gluon-wo at M <= 32, gluon-wo-wgmma at
# 32 < M <= 64 on sm90), timed with --variants beside their defaults.
WO_VARIANTS = [dict(STAGES=2), dict(STAGES=3), dict(BLOCK_K=128), dict(per_sm=8)]
WGMMA_VARIANTS = [dict(BLOCK_N=64), dict(BLOCK_N=128), dict(STAGES=3), dict(per_sm=2)]
_SHORT = {"BLOCK_N": "bn", "BLOCK_K": "bk", "STAGES": "s", "per_sm": "per_sm", "SUB": "sub", "SPLIT": "split",
          "num_stages": "s", "FOLD": "fold"}
# Narrow weight-row tiles and deep K splits (triton_gemm.CONFIG BLOCK_N / SPLIT) where a few column
# tiles leave most SMs idle at decode (NARROW_N and below: a MoE router's 64-160 columns), against
# the planner's, which keeps each split at 1024 or more of K
NARROW_N = 512
NARROW_VARIANTS = [dict(SPLIT=8), dict(BLOCK_N=32, SPLIT=8), dict(BLOCK_N=16, SPLIT=8)]
# Tunings of the kernels whose scale changes along K (scaled_tiles.CONFIG), at decode M: K tiles an
# iteration (SUB), and many short programs (deep K splits at two stages: a few K tiles each); at
# every M, the scale on the weight before the MMA (FOLD)
SCALED_VARIANTS = [dict(SUB=2), dict(SPLIT=8, num_stages=2), dict(FOLD=1), dict(FOLD=1, SUB=2),
                   dict(FOLD=1, SPLIT=8, num_stages=2)]
SCALED_VARIANTS_MANY_ROWS = [dict(FOLD=1)]
# gluon-w4a16's config=: tiles and deeper K splits
GLUON_INT4_VARIANTS = [dict(BLOCK_N=32), dict(BLOCK_N=128), dict(per_sm=8)]
SCALED_VARIANTS_FP32_SCALE = [dict(FOLD=1), dict(FOLD=1, SPLIT=8, num_stages=2)]
# (provider, backend, describe, variants) of the Gluon weight-only kernels, by whether M is above 32
GLUON = {False: ("opmap-gluon-wo", "gluon-wo", wo_gluon.describe, WO_VARIANTS),
         True: ("opmap-gluon-wo-wgmma", "gluon-wo-wgmma", wo_wgmma.describe, WGMMA_VARIANTS)}


def _tag(cfg):
    return ",".join(f"{_SHORT[k]}={v}" for k, v in cfg.items())


def _gluon_rows(M, N, K) -> list:
    """The Gluon kernel of this M (M <= 64), its default and its --variants rows."""
    name, backend, describe, variants = GLUON[M > wo_gluon.MAX_M]
    return [Provider(name, _ours(backend, True), backend=("gemm", backend), describe=_described(describe, M, N, K))] + [
        Provider(f"{name}[{_tag(c)}]", _ours(backend, True, c), backend=("gemm", backend),
                 describe=_described(describe, M, N, K, config=c)) for c in variants]


def _scaled_mm(inp):
    return lambda: scaled_mm.linear(inp["x"], inp["wq"], None, inp["s"])


def _act_quant(triton_kernel):
    def make(inp):
        fn = act_quant.quantize_act_fp8 if triton_kernel else quant.quantize_act_fp8
        return lambda: fn(inp["x"])

    return make


ACT_QUANT_MS = (128, 1024, 2048)


def _act_quant_cases(arch) -> list[BenchCase]:
    out = []
    for K, N in SHAPES:  # N: the GEMM the quantised x feeds (places the row at a model's widths)
        for M in ACT_QUANT_MS:
            out.append(BenchCase(
                op="gemm.act_quant", case=f"M={M},K={K},dtype=bf16", flops=0.0,
                bytes=float(M * K * 3 + M * 4),  # bf16 read, fp8 and one fp32 scale a row written
                setup=lambda device, M=M, K=K: dict(x=torch.randn(M, K, device=device, dtype=torch.bfloat16)),
                providers=[Provider("opmap-triton", _act_quant(True)), Provider("torch-ops", _act_quant(False))],
                graph=True, tags=("gemm",),
                spec=GemmSpec(arch=arch, phase="prefill", m=M, n=N, k=K, dtype="bf16", weight_dtype="fp8")))
    return out


def _scaled_case(arch, M, N, K, fmt) -> BenchCase:
    """A SCALED format: our Triton kernel at every M, the dequantise-once route from M = 128, cuBLAS
    on the same weights in bf16 and, where given, a bf16 copy made per call (the fallback's cost)."""
    op, backend, describe, tag, wbytes, per_call = SCALED[fmt]
    nbytes = wbytes(N, K) + M * K * 2 + M * N * 2
    flops = 2.0 * M * N * K
    provs = [Provider(f"opmap-{backend}", _ours(backend, True), backend=("gemm", backend), describe=describe(M, N, K)),
             Provider("cublas-bf16-weights", _cublas)]
    provs += [Provider(f"opmap-{backend}[{_tag(c)}]", _ours(backend, True, c), backend=("gemm", backend),
                       describe=describe(M, N, K, config=c))
              for c in (SCALED_VARIANTS if M <= 64 else SCALED_VARIANTS_MANY_ROWS)]
    if fmt == "int4" and M <= w4a16_gluon.MAX_M:  # the Gluon mma.sync kernel and its tunings
        provs += [Provider("opmap-gluon-w4a16" + (f"[{_tag(c)}]" if c else ""), _ours("gluon-w4a16", True, c or None),
                           backend=("gemm", "gluon-w4a16"),
                           describe=_described(w4a16_gluon.describe, M, N, K, config=c or None))
                  for c in [{}] + GLUON_INT4_VARIANTS]
    if fmt == "int4":  # fp32 group scales: 4-byte loads that Triton's pipeline can copy ahead (fp16: not)
        provs += [Provider(f"opmap-{backend}[{_tag(c)},scale=fp32]", _ours(backend, True, c, torch.float32),
                           backend=("gemm", backend), describe=describe(M, N, K, config=c))
                  for c in (SCALED_VARIANTS_FP32_SCALE if M <= 64 else SCALED_VARIANTS_MANY_ROWS)]
    if per_call is not None:
        provs.append(Provider("dequant+cublas", per_call))
    if M >= 128:
        provs.append(Provider("opmap-dequant-cublas", _ours("dequant-cublas", True), backend=("gemm", "dequant-cublas")))
    if fmt == "int4":
        provs.append(Provider("gemlite", _gemlite, available=gemlite_peer.available))
    elif M >= 128 and K % 512 == 0:
        provs.append(Provider("opmap-scaled-mm-block", _ours("scaled-mm-block", True), available=_sm90,
                              backend=("gemm", "scaled-mm-block")))
    return BenchCase(
        op=op, case=f"M={M},N={N},K={K},w={tag},dtype=bf16", flops=flops, bytes=float(nbytes),
        setup=_setup(M, N, K, fmt), providers=provs, bound="compute" if flops / nbytes > RIDGE else "memory",
        graph=True, tags=("gemm",),
        spec=GemmSpec(arch=arch, phase="decode" if M <= 64 else "prefill", m=M, n=N, k=K, dtype="bf16",
                      weight_dtype=fmt, group_size=INT4_GROUP if fmt == "int4" else 128))


def _dequant_int4(inp):
    wq, s, x = inp["wq"], inp["s"], inp["x"]
    return lambda: F.linear(x, quant.dequantize_int4(wq, s).to(x.dtype))


# The weight-only formats whose scale changes along K, by format: (op, backend, its describe and
# the scale span it takes, case tag, weight bytes (N, K), the per-call dequantise of the fallback
# row or None). int4: codes at half a byte, an fp16 scale per 128 input channels (what GPTQ / AWQ /
# W4A16 checkpoints carry); fp8-block: a byte, an fp32 scale per 128 x 128 block (DeepSeek-V3,
# Qwen3-FP8).
SCALED = {
    "int4": ("gemm.w4a16", "triton-w4a16",
             lambda M, N, K, config=None: _described(w4a16.describe, M, N, K, G=INT4_GROUP, config=config),
             f"int4-g{INT4_GROUP}", lambda N, K: N * K // 2 + N * (K // INT4_GROUP) * 2, _dequant_int4),
    "fp8-block": ("gemm.fp8_block", "triton-fp8-block",
                  lambda M, N, K, config=None: _described(fp8_block.describe, M, N, K, b=128, config=config),
                  "fp8-block128", lambda N, K: N * K + (-(-N // 128)) * (-(-K // 128)) * 4, None),
}


def _gemlite(inp):
    lin = gemlite_peer.int4_linear(inp["wq"], inp["s"], None, inp["x"].dtype)
    return lambda: lin(inp["x"])


def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return "cuBLASLt's block-scaled fp8 GEMM needs an sm90 GPU"
    return None


def _sm89():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        return "torch._scaled_mm fp8 needs an sm89+ GPU"
    return None


def cases(quick: bool) -> list[BenchCase]:
    arch = hw.local_arch()
    out = []
    for fmt in (None, "fp8", "int8", "int4"):
        for K, N in SHAPES + ([] if quick else MORE_SHAPES):
            # the formats whose scale changes along K time a prefill chunk in the quick grid too: the
            # route from M = 128 (their own kernel, dequant-cublas, scaled-mm-block) rests on it
            for M in (MS_FULL if fmt == "int4" or not quick else MS):
                out += [_case(arch, M, N, K, f) for f in (SCALED if fmt == "int4" else (fmt,))]
    return out + _act_quant_cases(arch) + _gated_cases(arch) + _add_cases(arch)


def model_cases(model_specs: dict, quick: bool) -> list[BenchCase]:
    """The grid's cases at a model's own GEMM widths (``model_specs``: {op: [spec]} of its op map):
    each distinct (N, K) in each weight format its GEMMs run, so that `opmap bench --model` and the
    report time the model's projections (a router of 128 columns, an MLA down-projection of 576) and
    not Llama's. The grid's M, or with ``quick`` (the report's) a decode row and a prefill chunk
    (MS_MODEL_QUICK) where the fixed grid has no case of that width."""
    arch = hw.local_arch()
    out = []
    specs = model_specs.get("gemm", [])
    for K, N, wd in sorted({(s.k, s.n, s.weight_dtype) for s in specs if s.n and s.k}):
        fmt = None if wd in ("bf16", "fp16", "fp32") else wd
        grid = (K, N) in SHAPES or not quick
        for M in (MS_FULL if fmt in SCALED and grid else MS if grid else MS_MODEL_QUICK):
            out.append(_case(arch, M, N, K, fmt))
    return out


def _case(arch, M, N, K, fmt) -> BenchCase:
    """One case of the grid: M x N x K with the weight in ``fmt`` (None: bf16)."""
    if fmt in SCALED:
        return _scaled_case(arch, M, N, K, fmt)
    wbytes = N * K * (1 if fmt else 2) + (N * 4 if fmt else 0)
    nbytes = wbytes + M * K * 2 + M * N * 2
    flops = 2.0 * M * N * K
    wd = fmt or "bf16"
    name = "triton-wo" if fmt else "triton-decode"
    provs = [Provider("opmap-triton", _ours(name, bool(fmt)), backend=("gemm", name),
                      describe=_described(triton_gemm.describe, M, N, K, quantised=bool(fmt)))]
    if M <= 16 and N <= NARROW_N:
        provs += [Provider(f"opmap-triton[{_tag(c)}]", _ours(name, bool(fmt), c), backend=("gemm", name))
                  for c in NARROW_VARIANTS]
    if fmt is None:
        provs.append(Provider("cublas", _cublas, backend=("gemm", "cublas")))  # marked where selected
    else:
        provs += [Provider("cublas-bf16-weights", _cublas), Provider("dequant+cublas", _dequant_cublas)]
        if M <= wo_wgmma.MAX_M:
            provs += _gluon_rows(M, N, K)
        if M >= 128:  # its backend serves M >= 128 only
            provs.append(Provider("opmap-dequant-cublas", _ours("dequant-cublas", True),
                                  backend=("gemm", "dequant-cublas")))
        if fmt == "fp8":
            # the backend serves bf16 activations from M >= 128 (marked there when selected);
            # below, the row is timed as a peer
            provs.append(Provider("scaled-mm-fp8-act", _scaled_mm, available=_sm89,
                                  backend=("gemm", "scaled-mm") if M >= 128 else None))
    return BenchCase(
        op="gemm", case=f"M={M},N={N},K={K},w={wd},dtype=bf16", flops=flops, bytes=float(nbytes),
        setup=_setup(M, N, K, fmt), providers=provs,
        bound="compute" if flops / nbytes > RIDGE else "memory", graph=True,
        spec=GemmSpec(arch=arch, phase="decode" if M <= 64 else "prefill", m=M, n=N, k=K,
                      dtype="bf16", weight_dtype=wd),
        tags=("gemm",))


def _gated_cases(arch) -> list[BenchCase]:
    """Llama-3-8B's gate/up at decode M: the GEMM with its SiLU * mul in the epilogue (linear_act,
    one launch: what the engine's decode runs, EngineConfig.fuse_gated) beside the GEMM then the
    activation kernel (two launches) and cuBLAS then the activation kernel."""
    K, N = SHAPES[0]

    def fused(inp):
        fn = registry.get("gemm", "triton-decode").fn("linear_act")
        return lambda: fn(inp["x"], inp["w"])

    def apart(inp):
        fn = registry.get("gemm", "triton-decode").fn("linear")
        return lambda: silu_mul(fn(inp["x"], inp["w"]))

    out = []
    for M in (1, 16, 32):
        nbytes = N * K * 2 + M * K * 2 + M * N // 2 * 2
        out.append(BenchCase(
            op="gemm.gated", case=f"M={M},N={N},K={K},act=silu,dtype=bf16", flops=2.0 * M * N * K, bytes=float(nbytes),
            setup=_setup(M, N, K, None),
            providers=[Provider("opmap-triton", fused, backend=("gemm", "triton-decode")),
                       Provider("opmap-triton linear, then silu_mul", apart),
                       Provider("cublas, then silu_mul", lambda inp: (lambda: silu_mul(F.linear(inp["x"], inp["w"]))))],
            bound="memory", graph=True,
            spec=GemmSpec(arch=arch, phase="decode", m=M, n=N, k=K, dtype="bf16", weight_dtype="bf16"),
            tags=("gemm",)))
    return out


# DeepSeek-V2-Lite's shared expert down projection (two shared experts of 1408: K 2816), where the
# engine sums the routed experts' output into the GEMM (EngineConfig.fuse_shared_add)
ADD_SHAPE = (2816, 2048)


def _add_setup(M, N, K):
    base = _setup(M, N, K, None)

    def setup(device):
        inp = base(device)
        inp["add"] = torch.randn(M, N, device=device, dtype=inp["x"].dtype)
        return inp

    return setup


def _add_cases(arch) -> list[BenchCase]:
    """The shared expert's down GEMM with the routed output as its addend (linear_add, one launch:
    triton-decode's epilogue at decode M, cuBLAS's addmm) beside the GEMM then a torch add (two
    launches: EngineConfig.fuse_shared_add=False)."""
    K, N = ADD_SHAPE

    def ours(name):
        def make(inp):
            fn = registry.get("gemm", name).fn("linear_add")
            return lambda: fn(inp["x"], inp["w"], inp["add"])
        return make

    def apart(name):
        def make(inp):
            fn = registry.get("gemm", name).fn("linear")
            return lambda: fn(inp["x"], inp["w"]) + inp["add"]
        return make

    out = []
    for M in (1, 16, 64, 256):
        nbytes = N * K * 2 + M * K * 2 + 2 * M * N * 2
        provs = [Provider("cublas", ours("cublas"), backend=("gemm", "cublas")),
                 Provider("cublas, then add", apart("cublas"))]
        if M <= 64:
            provs = [Provider("opmap-triton", ours("triton-decode"), backend=("gemm", "triton-decode")),
                     Provider("opmap-triton linear, then add", apart("triton-decode"))] + provs
        out.append(BenchCase(
            op="gemm.add", case=f"M={M},N={N},K={K},add=1,dtype=bf16", flops=2.0 * M * N * K, bytes=float(nbytes),
            setup=_add_setup(M, N, K), providers=provs, bound="memory" if M <= 64 else "compute", graph=True,
            spec=GemmSpec(arch=arch, phase="decode" if M <= 64 else "prefill", m=M, n=N, k=K, dtype="bf16",
                          weight_dtype="bf16"),
            tags=("gemm",)))
    return out

