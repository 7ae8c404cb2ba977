"""GEMM (linear) check cases: every runnable backend against the fp32 reference (dense and
weight-only fp8 / int8 / int4 (group scales, with and without zero points), decode M and a prefill M, vocab-sized odd N, K not a multiple of the
tile, split K; each weight-only kernel through its own backend: triton-wo, gluon-wo at M <= 32,
gluon-wo-wgmma at 32 < M <= 64, dequant-cublas); quantisation gates (section "quant": output cosine >= 0.999 fp8 / >= 0.998
int8 against the fp32 reference on the unquantised weights, and the mean KL divergence of the
next-token distribution of a small random-weight layer stack, with figures); bad input."""
from __future__ import annotations

import functools

import torch

from opmap.core import registry
from opmap.core.specs import GemmSpec
from opmap.core.tolerance import compare
from opmap.harness.check.base import CheckCase, Outcome, probe_errors, arch_of
from opmap.harness.fixtures import gemm_quality as quality
from opmap.ops.gemm import reference
from opmap.ops.gemm.quant import quantize_fp8_block, quantize_int4, quantize_weight

_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
COSINE_GATE = {"fp8": 0.999, "int8": 0.998, "fp8-act": 0.998, "int4": 0.99, "fp8-block": 0.999, "fp8-block-act": 0.998}
# Limits for the stack's mean KL (nats). Seen on CPU (fp32 reference stack, 4 layers, vocab
# 1000): bf16 ~3e-4, int8 ~1e-3, fp8 ~1e-2; the limits leave ~4x headroom. int4 is the format's
# own loss (round to nearest, a scale per 128 channels, on Gaussian random weights: ~0.2-0.3
# nats, cosine ~0.993 on CPU and GPU dims): its limits catch a broken kernel, not the format.
KL_LIMIT = {None: 2e-3, "int8": 5e-3, "fp8": 4e-2, "int4": 1.0, "fp8-block": 4e-2}


def _inputs(device, M, N, K, dtype, fmt, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    if fmt is None:
        return x, w, b, None
    wq, s = quantize_weight(w, fmt)
    return x, wq, b, s


# The Triton kernel with its default tile (config AUTOTUNE=0): correctness does not depend on the
# autotuned BLOCK_K / stages, and autotuning every shape here would cost a few compiles per shape.
DEFAULT_TILES = {"triton-decode": {"AUTOTUNE": 0}, "triton-wo": {"AUTOTUNE": 0}}
# Rows of the quantisation gates' GEMMs where the backend serves only some M (the others: the case's)
QUANT_ROWS = {"gluon-wo": lambda m: min(m, 32), "gluon-wo-wgmma": lambda m: 64}
WEIGHT_ONLY = ("triton-wo", "gluon-wo", "gluon-wo-wgmma", "dequant-cublas")


def _linear(backend):
    """The backend's linear entry, with the default tile where its kernel autotunes."""
    fn = registry.get("gemm", backend).fn("linear")
    return functools.partial(fn, config=DEFAULT_TILES[backend]) if backend in DEFAULT_TILES else fn


def _parity(backend, device, M, N, K, dtype, fmt, bias=False, act=None):
    """``act``: the gated entry linear_act (w [N, K] the gate rows then the up rows) against the
    reference's, else linear."""
    def run():
        x, w, b, s = _inputs(device, M, N, K, dtype, fmt, bias, M + N // 2 + K if act else M + N + K)
        if act:
            fn = registry.get("gemm", backend).fn("linear_act")
            out, want = fn(x, w, b, s, act=act, config=DEFAULT_TILES[backend]), reference.linear_act(x, w, b, s, act=act)
        else:
            out, want = _linear(backend)(x, w, b, s), reference.linear(x, w, b, s)
        e = compare(out, want, dtype, scale=2.0)
        return Outcome(e.ok, str(e), e.worst_ratio, 1.0)

    return run


def _cosine(backend, device, fmt, M, N, K, dtype):
    def run():
        cos = quality.output_cosine(_linear(backend), fmt.replace("-act", ""), M, N, K, dtype, device)
        gate = COSINE_GATE[fmt]
        return Outcome(cos >= gate, f"cosine {cos:.6f} (gate {gate})", cos, gate)

    return run


def _kl(backend, device, fmt, dtype, dims):
    def run():
        r = quality.stack_kl(_linear(backend), fmt, dtype=dtype, device=device, **dims)
        lim = KL_LIMIT[fmt]
        return Outcome(r["kl_mean"] <= lim, f"mean KL {r['kl_mean']:.2e} nats (max {r['kl_max']:.2e}), "
                       f"top-1 agreement {r['top1_agree']:.3f}; limit {lim:g}", r["kl_mean"], lim)

    return run


def _bad_input(backend, device):
    def run():
        fn = registry.get("gemm", backend).fn("linear")
        x = torch.randn(4, 64, device=device)
        wq, s = quantize_weight(torch.randn(32, 64, device=device), "int8")
        probes = {"w": lambda: fn(x, torch.randn(32, 63, device=device)),
                  "x": lambda: fn(x.to(torch.int32), torch.randn(32, 64, device=device)),
                  "w_scale": lambda: fn(x, wq, None, s[:31]),
                  "bias": lambda: fn(x, torch.randn(32, 64, device=device), torch.randn(31, device=device))}
        return probe_errors(probes)

    return run


def _scaled_parity(backend, device, M, N, K, span, fmt, dtype, zp=False):
    """A weight whose scale changes along K against the reference: int4 (a scale per ``span`` input
    channels, fp16 as checkpoints store it; zero points where ``zp``) or fp8-block (``span`` x
    ``span`` blocks)."""
    def run():
        g = torch.Generator().manual_seed(M + N + K + span)
        x = torch.randn(M, K, generator=g).to(device, dtype)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device)
        if fmt == "int4":
            wq, s, z = quantize_int4(w, span, zp)
            s = s.half() if dtype != torch.float32 else s
        else:
            (wq, s), z = quantize_fp8_block(w, span), None
        b = torch.randn(N, generator=g).to(device, dtype)
        args = (x, wq, b, s) + ((z,) if z is not None else ())
        e = compare(registry.get("gemm", backend).fn("linear")(*args), reference.linear(*args), dtype, scale=4.0)
        return Outcome(e.ok, str(e), e.worst_ratio, 1.0)

    return run


def _int4_bad_input(backend, device):
    def run():
        fn = registry.get("gemm", backend).fn("linear")
        x = torch.randn(4, 64, device=device)
        wq, s, z = quantize_int4(torch.randn(32, 64, device=device), 32, True)
        probes = {"w": lambda: fn(x, wq[:, :-1], None, s, z), "w_scale": lambda: fn(x, wq, None, torch.cat([s, s[:, :1]], 1), z),
                  "w_zero": lambda: fn(x, wq, None, s, z.int())}
        return probe_errors(probes)

    return run


def _int4_cases(arch, device, cpu) -> list:
    dt, dn = (torch.float16, "fp16") if cpu else (torch.bfloat16, "bf16")
    shapes = [(1, 96, 256, 64), (3, 50, 512, 128), (64, 40, 256, 32), (129, 1001, 256, 128)] if cpu else \
        [(1, 28672, 4096, 128), (16, 4096, 14336, 128), (64, 6144, 4096, 128), (1, 32001, 4096, 128),
         (1024, 4096, 4096, 128), (3, 4096, 4096, 32)]
    out = []
    for name in ("triton-w4a16", "gluon-w4a16", "dequant-cublas"):
        for M, N, K, G in shapes:
            for zp in (False, True):
                if _ok(name, arch, m=M, n=N, k=K, dtype=dn, weight_dtype="int4", group_size=G):
                    out.append(CheckCase("parity", "gemm", name, f"M={M},N={N},K={K},w=int4-g{G}{'-zp' * zp},dtype={dn}",
                                         _scaled_parity(name, device, M, N, K, G, "int4", dt, zp), quick=M in (1, 129, 1024)))
        if _ok(name, arch, m=4 if name != "dequant-cublas" else 128, n=32, k=64, dtype="fp32", weight_dtype="int4",
               group_size=32):
            out.append(CheckCase("input", "gemm", name, "int4: words for another K, scale groups, zero dtype",
                                 _int4_bad_input(name, device)))
    M, N, K = (3, 64, 1024) if cpu else (16, 4096, 4096)
    dims = dict(tokens=8, hidden=128, inter=128, vocab=512, layers=2) if cpu else \
        dict(tokens=64, hidden=1024, inter=2048, vocab=32000, layers=4)
    dim_s = ",".join(f"{k}={v}" for k, v in dims.items())
    for name in ("triton-w4a16", "gluon-w4a16"):
        if _ok(name, arch, m=M, n=N, k=K, dtype=dn, weight_dtype="int4", group_size=128):
            out.append(CheckCase("quant", "gemm", name, f"output cosine vs fp32,int4-g128,M={M},N={N},K={K},dtype={dn}",
                                 _cosine(name, device, "int4", M, N, K, dt)))
    if _ok("triton-w4a16", arch, m=M, n=N, k=K, dtype=dn, weight_dtype="int4", group_size=128):
        out.append(CheckCase("quant", "gemm", "triton-w4a16", f"stack next-token KL,int4-g128,{dim_s},dtype={dn}",
                             _kl("triton-w4a16", device, "int4", dt, dims)))
    return out


def _block_cases(arch, device, cpu) -> list:
    dt, dn = (torch.float16, "fp16") if cpu else (torch.bfloat16, "bf16")
    shapes = [(1, 96, 256, 64), (3, 50, 200, 32), (64, 130, 96, 16), (129, 100, 160, 32)] if cpu else \
        [(1, 24576, 7168, 128), (16, 7168, 18432, 128), (64, 4096, 4096, 128), (1, 32001, 4096, 128),
         (1024, 4096, 4096, 128), (3, 576, 7168, 128), (200, 576, 7168, 128)]
    out = []
    for name in ("triton-fp8-block", "dequant-cublas"):
        for M, N, K, b in shapes:
            if _ok(name, arch, m=M, n=N, k=K, dtype=dn, weight_dtype="fp8-block", group_size=b):
                out.append(CheckCase("parity", "gemm", name, f"M={M},N={N},K={K},w=fp8-block{b},dtype={dn}",
                                     _scaled_parity(name, device, M, N, K, b, "fp8-block", dt),
                                     quick=M in (1, 129, 1024)))
    # Quality gates; scaled-mm-block quantises the activations too (fp8 per 128-channel group), so it
    # is held to the fp8-activation gate, at the many rows it serves.
    M, N, K = (3, 64, 1024) if cpu else (16, 4096, 4096)
    dims = dict(tokens=8, hidden=128, inter=128, vocab=512, layers=2) if cpu else \
        dict(tokens=64, hidden=1024, inter=2048, vocab=32000, layers=4)
    for name, gate, rows, tokens in (("triton-fp8-block", "fp8-block", M, dims["tokens"]),
                                     ("scaled-mm-block", "fp8-block-act", 256, 256)):
        kd = dict(dims, tokens=tokens)
        if _ok(name, arch, m=rows, n=N, k=K, dtype=dn, weight_dtype="fp8-block", group_size=128):
            out.append(CheckCase("quant", "gemm", name, f"output cosine vs fp32,fp8-block128,M={rows},N={N},K={K},dtype={dn}",
                                 _cosine(name, device, gate, rows, N, K, dt)))
        if _ok(name, arch, m=kd["tokens"], n=kd["hidden"], k=kd["hidden"], dtype=dn, weight_dtype="fp8-block",
               group_size=128):
            kd_s = ",".join(f"{k}={v}" for k, v in kd.items())
            out.append(CheckCase("quant", "gemm", name, f"stack next-token KL,fp8-block128,{kd_s},dtype={dn}",
                                 _kl(name, device, "fp8-block", dt, kd)))
    return out


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
        for name, fmt in [("cublas", None), ("triton-decode", None)] + [(b, f) for b in WEIGHT_ONLY
                                                                        for f in ("int8", "fp8")]:
            wd = fmt or dt
            for M, N, K in decode + [prefill]:
                if _ok(name, arch, m=M, n=N, k=K, dtype=dt, weight_dtype=wd):
                    out.append(CheckCase("parity", "gemm", name, f"M={M},N={N},K={K},w={wd},dtype={dt}",
                                         _parity(name, device, M, N, K, d, fmt, bias=M == 3),
                                         quick=(M, N) in ((1, 96), (64, 80), (1000, 48), (1, 28672), (64, 4096))))
            bnd = [("vocab-sized odd N", vocab, not cpu), ("odd N", (3, 1001, 32), True),
                   ("K not a tile multiple", odd_k, True), ("prefill rows, odd N and K", (129, 1001, 95), False),
                   ("odd rows above 32, odd N", (33, 1001, 80) if cpu else (48, 1001, 4112), False)]
            for label, (M, N, K), q in bnd:  # 32001 columns take seconds in the interpreter
                if _ok(name, arch, m=M, n=N, k=K, dtype=dt, weight_dtype=wd):
                    out.append(CheckCase("boundaries", "gemm", name, f"{label},M={M},N={N},K={K},w={wd},dtype={dt}",
                                         _parity(name, device, M, N, K, d, fmt, bias=True), quick=q))
    # The gated epilogue (linear_act): decode rows, an N half off the tile, K splits, per-channel weights
    gated = [(1, 48, 256, None, False, "silu"), (3, 65, 200, None, True, "gelu_tanh"), (17, 40, 96, "int8", True, "silu"),
             (1, 70, 256, "fp8", False, "silu")] if cpu else \
        [(1, 14336, 4096, None, False, "silu"), (16, 14336, 4096, None, True, "silu"), (1, 14336, 4096, "fp8", False, "silu"),
         (48, 1409, 4112, None, True, "gelu_tanh")]
    for dt in dtypes:
        for M, I, K, fmt, bias, act in gated:
            name = "triton-wo" if fmt else "triton-decode"
            wd = fmt or dt
            if _ok(name, arch, m=M, n=2 * I, k=K, dtype=dt, weight_dtype=wd):
                out.append(CheckCase("parity", "gemm", name, f"linear_act ({act}),M={M},I={I},K={K},w={wd},dtype={dt}",
                                     _parity(name, device, M, 2 * I, K, _DT[dt], fmt, bias, act), quick=M == 1))
    # Quantisation gates, figures reported.
    qdt = torch.float16 if cpu else torch.bfloat16
    qname = "fp16" if cpu else "bf16"
    M, N, K = (3, 64, 1024) if cpu else (16, 4096, 4096)
    dims = dict(tokens=8, hidden=128, inter=128, vocab=512, layers=2) if cpu else \
        dict(tokens=64, hidden=1024, inter=2048, vocab=32000, layers=4)
    dim_s = ",".join(f"{k}={v}" for k, v in dims.items())
    for fmt in ("fp8", "int8"):
        for name in ("reference", "triton-wo", "gluon-wo", "gluon-wo-wgmma"):
            rows = QUANT_ROWS.get(name, lambda m: m)
            m, kd = rows(M), dict(dims, tokens=rows(dims["tokens"]))
            kd_s = ",".join(f"{k}={v}" for k, v in kd.items())
            if _ok(name, arch, m=m, n=N, k=K, dtype=qname, weight_dtype=fmt):
                out.append(CheckCase("quant", "gemm", name, f"output cosine vs fp32,{fmt},M={m},N={N},K={K},dtype={qname}",
                                     _cosine(name, device, fmt, m, N, K, qdt)))
            if _ok(name, arch, m=kd["tokens"], n=kd["hidden"], k=kd["hidden"], dtype=qname, weight_dtype=fmt):
                out.append(CheckCase("quant", "gemm", name, f"stack next-token KL,{fmt},{kd_s},dtype={qname}",
                                     _kl(name, device, fmt, qdt, kd)))
    if _ok("triton-decode", arch, m=dims["tokens"], n=dims["hidden"], k=dims["hidden"], dtype=qname, weight_dtype=qname):
        out.append(CheckCase("quant", "gemm", "triton-decode", f"stack next-token KL,unquantised,{dim_s},dtype={qname}",
                             _kl("triton-decode", device, None, qdt, dims)))
    if _ok("scaled-mm", arch, m=M, n=N, k=K, dtype="bf16", weight_dtype="fp8", act_dtype="fp8"):
        out.append(CheckCase("quant", "gemm", "scaled-mm", f"output cosine vs fp32,fp8 act x fp8 w,M={M},N={N},K={K}",
                             _cosine("scaled-mm", device, "fp8-act", M, N, K, torch.bfloat16)))
        out.append(CheckCase("quant", "gemm", "scaled-mm", f"stack next-token KL,fp8 act x fp8 w,{dim_s}",
                             _kl("scaled-mm", device, "fp8", torch.bfloat16, dims)))
    for name in ("reference", "cublas", "triton-decode", "triton-wo", "gluon-wo", "gluon-wo-wgmma"):
        if name.startswith("gluon") and not _ok(name, arch, m=4 if name == "gluon-wo" else 40, n=32, k=64,
                                                  dtype="bf16", weight_dtype="int8"):
            continue  # a Gluon kernel runs compiled on its GPUs only
        out.append(CheckCase("input", "gemm", name, "K mismatch, wrong dtype, scale shape, bias shape",
                             _bad_input(name, device)))
    return out + _int4_cases(arch, device, cpu) + _block_cases(arch, device, cpu)
