"""GEMM (linear) check cases: every runnable backend against the fp32 reference (dense and
weight-only fp8 / int8, decode M and a prefill M, vocab-sized odd N, K not a multiple of the
tile, split K); quantisation gates (section "quant": output cosine >= 0.999 fp8 / >= 0.998
int8 against the fp32 reference on the unquantised weights, and the mean KL divergence of the
next-token distribution of a small random-weight layer stack, with figures); bad input."""
from __future__ import annotations

import contextlib

import torch

from opmap.core import registry
from opmap.harness.check.base import CheckCase, Outcome, probe_errors, arch_of
from opmap.core.specs import GemmSpec
from opmap.core.tolerance import compare

_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
COSINE_GATE = {"fp8": 0.999, "int8": 0.998, "fp8-act": 0.998}
# Limits for the stack's mean KL (nats). Seen on CPU (fp32 reference stack, 4 layers, vocab
# 1000): bf16 ~3e-4, int8 ~1e-3, fp8 ~1e-2; the limits leave ~4x headroom.
KL_LIMIT = {None: 2e-3, "int8": 5e-3, "fp8": 4e-2}


def _inputs(device, M, N, K, dtype, fmt, bias, seed):
    from opmap.ops.gemm.quant import quantize_weight

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    if fmt is None:
        return x, w, b, None
    wq, s = quantize_weight(w, fmt)
    return x, wq, b, s


@contextlib.contextmanager
def default_tiles():
    """Our kernels with their default tile config: correctness does not depend on the autotuned
    BLOCK_K / stages, and autotuning every shape here would cost ~3 compiles per shape."""
    from opmap.kernels.gemm import triton_gemm

    old = triton_gemm.AUTOTUNE
    triton_gemm.AUTOTUNE = False
    try:
        yield
    finally:
        triton_gemm.AUTOTUNE = old


def _parity(backend, device, M, N, K, dtype, fmt, bias=False):
    def run():
        from opmap.ops.gemm import reference

        x, w, b, s = _inputs(device, M, N, K, dtype, fmt, bias, M + N + K)
        with default_tiles():
            out = registry.get("gemm", backend)("linear", x, w, b, s)
        e = compare(out, reference.linear(x, w, b, s), dtype, scale=2.0)
        return Outcome(e.ok, str(e), e.worst_ratio, 1.0)

    return run


def _cosine(backend, device, fmt, M, N, K, dtype):
    def run():
        from opmap.harness.fixtures import gemm_quality as quality

        fn = registry.get("gemm", backend).fn("linear")
        with default_tiles():
            cos = quality.output_cosine(fn, fmt.replace("-act", ""), M, N, K, dtype, device)
        gate = COSINE_GATE[fmt]
        return Outcome(cos >= gate, f"cosine {cos:.6f} (gate {gate})", cos, gate)

    return run


def _kl(backend, device, fmt, dtype, dims):
    def run():
        from opmap.harness.fixtures import gemm_quality as quality

        fn = registry.get("gemm", backend).fn("linear")
        with default_tiles():
            r = quality.stack_kl(fn, fmt, dtype=dtype, device=device, **dims)
        lim = KL_LIMIT[fmt]
        return Outcome(r["kl_mean"] <= lim, f"mean KL {r['kl_mean']:.2e} nats (max {r['kl_max']:.2e}), "
                       f"top-1 agreement {r['top1_agree']:.3f}; limit {lim:g}", r["kl_mean"], lim)

    return run


def _bad_input(backend, device):
    def run():
        from opmap.ops.gemm.quant import quantize_weight

        fn = registry.get("gemm", backend).fn("linear")
        x = torch.randn(4, 64, device=device)
        wq, s = quantize_weight(torch.randn(32, 64, device=device), "int8")
        probes = {"w": lambda: fn(x, torch.randn(32, 63, device=device)),
                  "x": lambda: fn(x.to(torch.int32), torch.randn(32, 64, device=device)),
                  "w_scale": lambda: fn(x, wq, None, s[:31]),
                  "bias": lambda: fn(x, torch.randn(32, 64, device=device), torch.randn(31, device=device))}
        return probe_errors(probes)

    return run


def _ok(name, arch, **spec):
    return not registry.get("gemm", name).validate(GemmSpec(arch=arch, **spec), runtime=True)


def cases(device: str, quick: bool) -> list[CheckCase]:
    arch = arch_of(device)
    cpu = device == "cpu"
    dtypes = ("fp32", "fp16") if cpu else ("bf16",)
    # Decode M's, a prefill M; the interpreter gets small N/K, the GPU Llama-3-8B MLP shapes.
    decode = [(1, 96, 256), (3, 130, 200), (17, 64, 96), (64, 80, 128)] if cpu else \
        [(1, 28672, 4096), (16, 28672, 4096), (64, 28672, 4096), (1, 4096, 14336), (64, 4096, 14336)]
    prefill = (1000, 48, 64) if cpu else (1000, 4096, 4096)
    vocab = (3, 32001, 16) if cpu else (3, 32001, 4096)
    odd_k = (5, 72, 95) if cpu else (17, 5120, 4095)
    out = []
    for dt in dtypes:
        d = _DT[dt]
        for name, fmt in (("cublas", None), ("triton-decode", None), ("triton-wo", "int8"), ("triton-wo", "fp8"),
                          ("dequant-cublas", "int8"), ("dequant-cublas", "fp8")):
            wd = fmt or dt
            for M, N, K in decode + [prefill]:
                if _ok(name, arch, m=M, n=N, k=K, dtype=dt, weight_dtype=wd):
                    out.append(CheckCase("parity", "gemm", name, f"M={M},N={N},K={K},w={wd},dtype={dt}",
                                         _parity(name, device, M, N, K, d, fmt, bias=M == 3),
                                         quick=(M, N) in ((1, 96), (64, 80), (1000, 48), (1, 28672), (64, 4096))))
            bnd = [("vocab-sized odd N", vocab, not cpu), ("odd N", (3, 1001, 32), True),
                   ("K not a tile multiple", odd_k, True), ("prefill rows, odd N and K", (129, 1001, 95), False)]
            for label, (M, N, K), q in bnd:  # 32001 columns take seconds in the interpreter
                if _ok(name, arch, m=M, n=N, k=K, dtype=dt, weight_dtype=wd):
                    out.append(CheckCase("boundaries", "gemm", name, f"{label},M={M},N={N},K={K},w={wd},dtype={dt}",
                                         _parity(name, device, M, N, K, d, fmt, bias=True), quick=q))
    # Quantisation gates, figures reported.
    qdt = torch.float16 if cpu else torch.bfloat16
    qname = "fp16" if cpu else "bf16"
    M, N, K = (3, 64, 1024) if cpu else (16, 4096, 4096)
    dims = dict(tokens=8, hidden=128, inter=128, vocab=512, layers=2) if cpu else \
        dict(tokens=64, hidden=1024, inter=2048, vocab=32000, layers=4)
    dim_s = ",".join(f"{k}={v}" for k, v in dims.items())
    for fmt in ("fp8", "int8"):
        for name in ("reference", "triton-wo"):
            if _ok(name, arch, m=M, n=N, k=K, dtype=qname, weight_dtype=fmt):
                out.append(CheckCase("quant", "gemm", name, f"output cosine vs fp32,{fmt},M={M},N={N},K={K},dtype={qname}",
                                     _cosine(name, device, fmt, M, N, K, qdt)))
                out.append(CheckCase("quant", "gemm", name, f"stack next-token KL,{fmt},{dim_s},dtype={qname}",
                                     _kl(name, device, fmt, qdt, dims)))
    if _ok("triton-decode", arch, m=dims["tokens"], n=dims["hidden"], k=dims["hidden"], dtype=qname, weight_dtype=qname):
        out.append(CheckCase("quant", "gemm", "triton-decode", f"stack next-token KL,unquantised,{dim_s},dtype={qname}",
                             _kl("triton-decode", device, None, qdt, dims)))
    if _ok("scaled-mm", arch, m=M, n=N, k=K, dtype="bf16", weight_dtype="fp8", act_dtype="fp8"):
        out.append(CheckCase("quant", "gemm", "scaled-mm", f"output cosine vs fp32,fp8 act x fp8 w,M={M},N={N},K={K}",
                             _cosine("scaled-mm", device, "fp8-act", M, N, K, torch.bfloat16)))
        out.append(CheckCase("quant", "gemm", "scaled-mm", f"stack next-token KL,fp8 act x fp8 w,{dim_s}",
                             _kl("scaled-mm", device, "fp8", torch.bfloat16, dims)))
    for name in ("reference", "cublas", "triton-decode", "triton-wo"):
        out.append(CheckCase("input", "gemm", name, "K mismatch, wrong dtype, scale shape, bias shape",
                             _bad_input(name, device)))
    return out
