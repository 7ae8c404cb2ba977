"""Dense-layer ops on the GPU (bf16, real model shapes): RMSNorm / fused add, RoPE,
activations, linear (dense small-M, weight-only fp8 / int8 through each kernel's backend:
triton-wo, gluon-wo, gluon-wo-wgmma, dequant-cublas; scaled-mm) against the fp32 references;
quantisation gates; int64 offsets on a tensor over 2^31 elements; CUDA-graph capture of the
decode GEMMs and their shared split-K counters; the custom ops under torch.compile.
Run with: PYTHONPATH=src python -m pytest tests/gpu/test_dense_gpu.py -m gpu -q
"""
import pytest
import torch

import opmap
from opmap.core import registry
from opmap.core.hw import local_arch
from opmap.core.select import select
from opmap.core.specs import GemmSpec
from opmap.ops.activation import reference as act_ref
from opmap.kernels.activation import triton_act
from opmap.harness.fixtures import gemm_quality as quality
from opmap.ops.gemm import quant
from opmap.kernels.gemm import splitk, triton_gemm, wo_gluon
from opmap.ops.gemm import reference as gemm_ref
from opmap.kernels.gluon_util import hopper
from opmap.ops.norm import reference as norm_ref
from opmap.kernels.norm import triton_norm
from opmap.ops.rope import reference as rope_ref
from opmap.kernels.rope import triton_rope
from opmap.core.tolerance import assert_close, cosine

pytestmark = pytest.mark.gpu
DEV = "cuda"
# fp8 x fp8 GEMMs (torch._scaled_mm, cuBLASLt) exist from sm89: below it there is no route to test
needs_scaled_mm = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                     reason="torch._scaled_mm needs sm89+")
BF16 = torch.bfloat16
DEFAULT_TILE = {"AUTOTUNE": 0}  # the Triton kernel's default tile: no autotuning across a grid of shapes


def _backend(name):
    return registry.get("gemm", name).fn("linear")


@pytest.fixture(autouse=True)
def _exact_fp32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must not run in TF32
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _randn(*shape, dtype=BF16, scale=1.0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


# ---- RMSNorm ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rows,H", [(1, 4096), (64, 8192), (8192, 8192), (17, 5120), (33, 4095), (3, 262145),
                                    (131071, 128)])  # last: per-head q/k norm, 8 rows per program
@pytest.mark.parametrize("fused", [False, True])
def test_rmsnorm_bf16(rows, H, fused):
    x, w = _randn(rows, H, seed=1), _randn(H, seed=2)
    if fused:
        r1 = _randn(rows, H, seed=3)
        r2 = r1.clone()
        out, exp = triton_norm.add_rmsnorm(x, r1, w, 1e-5), norm_ref.add_rmsnorm(x, r2, w, 1e-5)
        assert torch.equal(r1, r2)  # x + residual rounded once to bf16, identically
    else:
        out, exp = triton_norm.rmsnorm(x, w, 1e-5), norm_ref.rmsnorm(x, w, 1e-5)
    assert_close(out, exp)


@pytest.mark.parametrize("T", [1, 7, 4096])
def test_qk_rmsnorm_bf16_in_place_on_the_qkv_view(T):
    """Qwen3-8B heads (32 q + 8 k, d=128): one launch on the strided view of the qkv row equals
    the reference's two norms, and the v columns (NaN) are neither read nor written."""
    hq, hk, d = 32, 8, 128
    qkv = _randn(T, (hq + 2 * hk) * d, seed=T)
    qkv[:, (hq + hk) * d:] = float("nan")
    wq, wk = _randn(d, seed=7), _randn(d, seed=8)
    want = norm_ref.qk_rmsnorm(qkv[:, :(hq + hk) * d].clone().view(T, hq + hk, d), wq, wk, hq, 1e-6)
    triton_norm.qk_rmsnorm(qkv[:, :(hq + hk) * d].view(T, hq + hk, d), wq, wk, hq, 1e-6)
    assert_close(qkv[:, :(hq + hk) * d].view(T, hq + hk, d), want)
    assert bool(qkv[:, (hq + hk) * d:].isnan().all())


def test_rmsnorm_over_2pow31_elements_int64_offsets():
    # 524289 rows of 4096 bf16 = 2^31 + 4096 elements (4 GiB), normalised in place (out=x) so
    # that memory stays near 4 GiB. Rows whose offsets overflow int32 are checked.
    H = 4096
    rows = 2 ** 31 // H + 1
    x = torch.empty(rows, H, dtype=BF16, device=DEV)
    x.normal_(generator=torch.Generator(device=DEV).manual_seed(4))
    assert x.numel() > 2 ** 31
    w = _randn(H, seed=5)
    check = torch.tensor([0, 1, rows // 2, 2 ** 31 // H - 1, 2 ** 31 // H, rows - 1], device=DEV)
    before = x[check].clone()
    torch.cuda.synchronize()
    triton_norm.rmsnorm(x, w, 1e-6, out=x)
    torch.cuda.synchronize()
    assert_close(x[check], norm_ref.rmsnorm(before, w, 1e-6))
    del x
    torch.cuda.empty_cache()


# ---- RoPE ------------------------------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
        "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}


@pytest.mark.parametrize("T,Hq,Hk,D,r,scaling,style", [
    (16384, 32, 8, 128, 128, LLAMA3, "neox"),
    (64, 32, 8, 128, 128, LLAMA3, "gptj"),
    (1, 32, 8, 128, 128, None, "neox"),
    (1000, 16, 16, 192, 64, YARN, "gptj"),  # DeepSeek-V2: rope on 64 of 192 dims
])
def test_rope_bf16(T, Hq, Hk, D, r, scaling, style):
    max_pos = 131072
    cs = rope_ref.cos_sin_cache(r, max_pos, 500000.0, scaling, device=DEV)
    qkv = _randn(T, (Hq + 2 * Hk) * D, seed=6)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D: (Hq + Hk) * D].view(T, Hk, D)
    pos = torch.randint(0, max_pos, (T,), device=DEV, generator=torch.Generator(device=DEV).manual_seed(7))
    q2, k2, v0 = q.clone(), k.clone(), qkv[:, (Hq + Hk) * D:].clone()
    triton_rope.rope(q, k, pos, cs, style)
    rope_ref.rope(q2, k2, pos, cs, style)
    assert_close(q, q2)
    assert_close(k, k2)
    assert torch.equal(qkv[:, (Hq + Hk) * D:], v0)


# ---- activations -----------------------------------------------------------------------------

@pytest.mark.parametrize("rows,H", [(1, 14336), (64, 14336), (1000, 4095), (4096, 768)])
@pytest.mark.parametrize("entry", ["silu_mul", "gelu_tanh_mul"])
def test_activation_bf16(rows, H, entry):
    x = _randn(rows, 2 * H, scale=3.0, seed=8)
    assert_close(getattr(triton_act, entry)(x), getattr(act_ref, entry)(x))


# ---- linear ----------------------------------------------------------------------------------

def _lin_inputs(M, N, K, fmt, bias=False, seed=9):
    x = _randn(M, K, seed=seed)
    w = _randn(N, K, scale=K ** -0.5, seed=seed + 1)
    b = _randn(N, seed=seed + 2) if bias else None
    if fmt is None:
        return x, w, b, None, w
    wq, s = quant.quantize_weight(w, fmt)
    return x, wq, b, s, w


# Llama-3-8B MLP shapes at decode sizes (N=4096 takes the split-K path), a vocab-sized odd N
# at an odd M, and a prefill-sized M through the general tile.
@pytest.mark.parametrize("M,N,K", [(1, 28672, 4096), (17, 28672, 4096), (64, 28672, 4096),
                                   (1, 4096, 14336), (64, 4096, 14336), (3, 32001, 4096), (1000, 5120, 4095)])
@pytest.mark.parametrize("fmt", [None, "fp8", "int8"])
def test_linear_bf16(M, N, K, fmt):
    # The Triton kernel (triton-decode, triton-wo) at every M with its default tile config (no
    # autotuning across this grid spares many compiles; the autotuned path is exercised by the
    # CUDA-graph tests below and by the benchmarks).
    x, w, b, s, w_orig = _lin_inputs(M, N, K, fmt, bias=M == 3)
    out = triton_gemm.linear(x, w, b, s, config=DEFAULT_TILE)
    assert_close(out, gemm_ref.linear(x, w, b, s))
    if fmt:
        exp = x.float() @ w_orig.float().t() + (b.float() if b is not None else 0)
        gate = {"fp8": 0.999, "int8": 0.998}[fmt]
        assert cosine(out, exp) >= gate


@pytest.mark.parametrize("M,N,K,split", [(1, 2048, 2816, 0), (3, 2049, 2816, 3), (64, 2048, 2816, 0), (16, 130, 4096, 4)])
@pytest.mark.parametrize("fmt", [None, "fp8"])
def test_linear_add_rounds_the_sum_once(M, N, K, split, fmt):
    """linear_add (DeepSeek's shared down with the routed output as addend): triton-decode's epilogue
    (split K too) and cuBLAS's addmm give the reference's add + x @ w.T rounded once, in bf16; under a
    CUDA graph replayed with a new addend the Triton call follows it."""
    x, w, b, s, _ = _lin_inputs(M, N, K, fmt, bias=False)
    add = torch.randn(M, N, device=DEV, dtype=BF16)
    want = gemm_ref.linear_add(x, w, add, None, s)
    got = triton_gemm.linear_add(x, w, add, None, s, _plan={"SPLIT": split} if split else None)
    assert_close(got, want)
    if fmt is None:
        assert_close(registry.get("gemm", "cublas").fn("linear_add")(x, w, add), want)
    triton_gemm.linear_add(x, w, add, None, s)  # tunes this shape before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_gemm.linear_add(x, w, add, None, s)
    add.copy_(torch.randn(M, N, device=DEV, dtype=BF16))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, gemm_ref.linear_add(x, w, add, None, s))


@pytest.mark.parametrize("M,N,K", [(1, 100, 4112), (5, 4097, 4096), (16, 6144, 4096), (32, 1000, 2048),
                                   (32, 28672, 4096), (8, 32001, 1040),
                                   # the warpgroup-MMA kernel (wo_wgmma.py) on sm90
                                   (33, 200, 160), (48, 4097, 4096), (64, 6144, 4096), (64, 129, 4112),
                                   (57, 28672, 4096), (64, 32001, 1040)])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dt", [BF16, torch.float16], ids=["bf16", "fp16"])
def test_weight_only_gluon_kernel(M, N, K, fmt, dt):
    """The weight-only Gluon kernels through their backends (gluon-wo at M <= 32 on sm89+,
    gluon-wo-wgmma above it on sm90, each the selector's choice there) at odd N and K tails (K a
    multiple of 16, not of the tile) and odd M, with bias, in bf16 and fp16 activations: the
    reference's result, the Triton kernel's (triton-wo) within rounding, the quality gate against
    the unquantised weight; every tuning the benchmark's variant rows time gives the same."""
    from opmap.harness.bench.cases.gemm import GLUON

    wgmma = M > wo_gluon.MAX_M
    if wgmma and not hopper(torch.device(DEV)):
        pytest.skip("gluon-wo-wgmma: warpgroup MMAs are sm90's (triton-wo serves 32 < M <= 64 elsewhere)")
    _, name, _, variants = GLUON[wgmma]
    spec = GemmSpec(arch=local_arch(), m=M, n=N, k=K, dtype="bf16" if dt == BF16 else "fp16", weight_dtype=fmt)
    assert select("gemm", spec).name == name
    x, w, b, s, w_orig = _lin_inputs(M, N, K, fmt, bias=True, seed=M + N)
    x, b = x.to(dt), b.to(dt)
    lin = _backend(name)
    out = lin(x, w, b, s)
    ref = gemm_ref.linear(x, w, b, s)
    assert_close(out, ref)
    if dt == BF16:
        assert_close(out, triton_gemm.linear(x, w, b, s, config=DEFAULT_TILE), scale=0.5)
    exp = x.float() @ w_orig.float().t() + b.float()
    assert cosine(out, exp) >= {"fp8": 0.999, "int8": 0.998}[fmt]
    for cfg in variants if dt == BF16 else ():
        assert_close(lin(x, w, b, s, config=cfg), ref, what=str(cfg))


def test_weight_only_gluon_every_e4m3_and_int8_value():
    """Each e4m3 code (but NaN) and each int8 value reaches the dots exactly: w [4, 64] holds them
    all, x is the identity, so out^T = w (x of 64 rows: gluon-wo-wgmma on sm90; of 32 rows, the
    first 32 columns: gluon-wo)."""
    codes = torch.arange(256, device=DEV, dtype=torch.int32)
    codes = torch.nn.functional.pad(codes[(codes & 0x7F) != 0x7F], (0, 2)).to(torch.uint8)  # 254 codes, 2 zeros
    w8 = codes.view(torch.float8_e4m3fn).reshape(4, 64).contiguous()
    wi = torch.arange(-128, 128, device=DEV, dtype=torch.int32).to(torch.int8).reshape(4, 64).contiguous()
    for w in (w8, wi):
        for dt in (BF16, torch.float16):
            for rows in (64, 32) if hopper(torch.device(DEV)) else (32,):
                eye = torch.eye(64, device=DEV, dtype=dt)[:rows]
                got = _backend("gluon-wo-wgmma" if rows > 32 else "gluon-wo")(eye, w, None, torch.ones(4, device=DEV))
                assert torch.equal(got.t().float(), w[:, :rows].float()), (w.dtype, dt, rows)


@pytest.mark.parametrize("M,N,K", [(1024, 28672, 4096), (256, 4096, 14336), (129, 32001, 4095)])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_dequant_cublas_bf16(M, N, K, fmt):
    """Prefill's weight-only path in bf16 at Llama-3-8B shapes and an odd vocab-sized N / odd K:
    the reference's result, the quality gate against the unquantised weight; two layers' weights
    in a row share the scratch (the second overwrites the first, in stream order)."""
    from opmap.kernels.gemm import dequant_cublas

    x, w, b, s, w_orig = _lin_inputs(M, N, K, fmt, bias=True)
    out = dequant_cublas.linear(x, w, b, s)
    assert_close(out, gemm_ref.linear(x, w, b, s))
    exp = x.float() @ w_orig.float().t() + b.float()
    assert cosine(out, exp) >= {"fp8": 0.999, "int8": 0.998}[fmt]
    x2, w2, _, s2, _ = _lin_inputs(M, N // 2, K, fmt, seed=21)
    again = dequant_cublas.linear(x2, w2, None, s2)
    assert_close(again, gemm_ref.linear(x2, w2, None, s2))
    assert torch.equal(dequant_cublas.linear(x, w, b, s), out)


@pytest.mark.parametrize("M,N,K", [(1, 28672, 4096), (64, 4096, 14336), (5, 1000, 4095)])
def test_fp8_conversion_paths_agree(M, N, K):
    # The integer bit decoding of fp8 (the path of GPUs before sm89) and Triton's cast (default) give
    # identical weights; outputs agree to the accumulation order of the two compiled kernels.
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's fp8 cast needs sm89+")
    x, wq, _, s, _ = _lin_inputs(M, N, K, "fp8", seed=21)
    asm = triton_gemm.linear(x, wq, None, s, config=DEFAULT_TILE, _plan={"W_KIND": triton_gemm.W_FP8_BITS})
    native = triton_gemm.linear(x, wq, None, s, config=DEFAULT_TILE, _plan={"W_KIND": triton_gemm.W_FP8})
    assert_close(asm, native, scale=0.25)
    assert_close(asm, gemm_ref.linear(x, wq, None, s))
    # every e4m3 byte through the bit-decoding path: w = diag-like rows hitting each code once
    codes = torch.arange(256, device=DEV, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)
    wall = codes.view(torch.float8_e4m3fn).reshape(2, 127)
    wall = torch.nn.functional.pad(wall.view(torch.uint8), (0, 1)).view(torch.float8_e4m3fn).contiguous()
    eye = torch.eye(128, device=DEV, dtype=BF16)
    got = triton_gemm.linear(eye, wall, None, torch.ones(2, device=DEV),
                             _plan={"W_KIND": triton_gemm.W_FP8_BITS})
    assert torch.equal(got.t().float(), wall.float())


@needs_scaled_mm
def test_scaled_mm_fp8_activations():
    from opmap.kernels.gemm import scaled_mm

    for M, N, K in [(1, 28672, 4096), (64, 4096, 14336), (1000, 4096, 4096)]:
        x, wq, _, s, w = _lin_inputs(M, N, K, "fp8")
        out = scaled_mm.linear(x, wq, None, s)
        # fp8 activations and weights: both carry ~2.5% rms rounding, hence a looser gate.
        assert cosine(out, x.float() @ w.float().t()) >= 0.998
        assert cosine(out, gemm_ref.linear(x, wq, None, s)) >= 0.999


@pytest.mark.parametrize("M,K", [(1, 17), (7, 4096), (300, 14336), (3, 5000), (5, 16384), (4, 20001), (0, 64)])
def test_act_quant_kernel_bitwise_against_torch(M, K):
    """The Triton per-token fp8 quantiser against quant.quantize_act_fp8: scales exactly, codes
    bitwise (the kernel divides with IEEE rounding as PyTorch does), a zero row."""
    from opmap.kernels.gemm import act_quant
    from opmap.ops.gemm import quant

    x = torch.randn(M, K, device=DEV, dtype=BF16) * 5
    if M > 2:
        x[2] = 0
        x[1, 0] = 1e4  # one outlier sets the row's scale
    q, s = act_quant.quantize_act_fp8(x)
    q_ref, s_ref = quant.quantize_act_fp8(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("tokens", [32, 64])
def test_quant_stack_kl_on_gpu(tokens):
    # through opmap.linear: the kernels the selector picks at this M (on sm90 gluon-wo at 32 rows,
    # gluon-wo-wgmma at 64; the dense stack on triton-decode)
    res = {f: quality.stack_kl(opmap.linear, f, tokens=tokens, hidden=1024, inter=2048, vocab=32000,
                               layers=4, device=DEV) for f in (None, "int8", "fp8")}
    assert res["int8"]["kl_mean"] < 0.01 and res["fp8"]["kl_mean"] < 0.05, res
    assert res[None]["kl_mean"] < res["fp8"]["kl_mean"], res


@needs_scaled_mm
def test_prefill_route_scaled_mm_quality_and_selection():
    """fp8 weights at M >= 128 on sm90 go to scaled-mm (activations quantised per token): the
    selector says so, and the quantisation gates hold through it (the stack's next-token KL under
    the check suite's fp8 limit, within 2x the weight-only kernel's; output cosine >= 0.998)."""
    from opmap.harness.check.cases.gemm import COSINE_GATE, KL_LIMIT
    from opmap.kernels.gemm import scaled_mm
    from opmap.core.select import select
    from opmap.core.specs import GemmSpec

    spec = dict(arch="sm90", n=4096, k=4096, dtype="bf16", weight_dtype="fp8")
    # the route is declared for sm90 (runtime=False: what the selector picks there, on any GPU)
    for m, phase, want in ((None, "prefill", "scaled-mm"), (256, "mixed", "scaled-mm"), (64, "decode", "gluon-wo-wgmma"),
                           (None, "mixed", "triton-wo")):
        assert select("gemm", GemmSpec(m=m, phase=phase, **spec), runtime=False).backend.name == want
    dims = dict(tokens=256, hidden=1024, inter=2048, vocab=32000, layers=4, device=DEV)
    w8a8 = quality.stack_kl(scaled_mm.linear, "fp8", **dims)["kl_mean"]
    wo = quality.stack_kl(triton_gemm.linear, "fp8", **dims)["kl_mean"]
    assert w8a8 <= KL_LIMIT["fp8"] and w8a8 <= 2 * wo, (w8a8, wo)
    cos = quality.output_cosine(scaled_mm.linear, "fp8", 1024, 4096, 4096, device=DEV)
    assert cos >= COSINE_GATE["fp8-act"], cos


@pytest.mark.parametrize("backend,fmt", [("triton-decode", None), ("triton-wo", "fp8"), ("gluon-wo", "fp8")])
def test_decode_linear_cuda_graph_replay(backend, fmt):
    lin = _backend(backend)  # the Triton kernel autotuned (no config)
    x, w, _, s, _ = _lin_inputs(1, 28672, 4096, fmt)
    eager = lin(x, w, None, s)  # compiles and autotunes outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = lin(x, w, None, s)
    x.copy_(_randn(1, 4096, seed=99))
    g.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, eager)
    assert_close(out, gemm_ref.linear(x, w, None, s))


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("backends", [("gluon-wo",) * 3, ("triton-wo",) * 3, ("gluon-wo", "triton-wo", "gluon-wo")],
                         ids=["gluon", "triton", "mixed"])
def test_split_k_chain_in_cuda_graph_replays(fmt, backends):
    # Three split-K GEMMs back to back (under PDL where it is on), each tile's partials summed by
    # its last program through counters shared by the stream (and by the kernels: splitk.py):
    # replayed many times, every output matches its eager call bit for bit, and the counters are
    # back at zero.
    shapes = [(4096, 14336), (6144, 4096), (4096, 4096)]  # down, QKV, O: K split at M = 1
    layers = [_lin_inputs(1, n, k, fmt, bias=i == 1, seed=40 + i) for i, (n, k) in enumerate(shapes)]
    assert all(wo_gluon.plan(1, n, k, 132)["SPLIT"] > 1 for n, k in shapes)
    assert all(triton_gemm.plan(1, n, k, 132, interp=False, quantised=True)["SPLIT"] > 1 for n, k in shapes)
    lins = [_backend(b) for b in backends]

    def chain(x0):
        a = lins[0](x0, *layers[0][1:4])
        q = lins[1](a, *layers[1][1:4])
        return [a, q, lins[2](q[:, :4096], *layers[2][1:4])]  # a strided x

    x0 = layers[0][0]
    chain(x0)  # compiles and autotunes outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = chain(x0)
    _replays_match_eager(g.replay, outs, chain, x0, range(100, 120))
    assert_close(outs[2], gemm_ref.linear(outs[1][:, :4096], *layers[2][1:4]))
    _counters_back_at_zero()


def _replays_match_eager(replay, outs, chain, x0, seeds):
    """For each seed: new inputs in x0, ``replay()``, and each graph output equal to the eager chain's, bit for bit."""
    for seed in seeds:
        x0.copy_(_randn(*x0.shape, seed=seed))
        replay()
        want = chain(x0.clone())
        torch.cuda.synchronize()
        for got, exp in zip(outs, want):
            assert torch.equal(got, exp), seed


def _counters_back_at_zero():
    assert all(not c.any() for c in [*splitk._COUNTERS.values(), *splitk._GRAPH_COUNTERS.values()])


def test_split_k_graphs_in_a_shared_pool_keep_their_counters(monkeypatch):
    # The engine's layout: graphs captured one after another in one memory pool, a first one
    # without split-K GEMMs whose temporaries it fills at each replay (a prefill graph), then one
    # of split-K GEMMs (a decode graph). Replaying the first between replays of the second leaves
    # the second's outputs equal to eager calls: its counters were made before the capture, not
    # inside it, where the pool could hand them the first graph's temporaries.
    monkeypatch.setattr(splitk, "_COUNTERS", {})
    monkeypatch.setattr(splitk, "_GRAPH_COUNTERS", {})
    shapes = [(4096, 14336), (6144, 4096)]
    layers = [_lin_inputs(1, n, k, "fp8", bias=False, seed=60 + i) for i, (n, k) in enumerate(shapes)]
    lin = _backend("gluon-wo")  # the decode path of fp8 weights at one row

    def chain(x0):
        a = lin(x0, *layers[0][1:4])
        return [a, lin(a, *layers[1][1:4])]

    def scribble():  # small temporaries, freed at the end of the capture, written at each replay
        return torch.stack([torch.full((4096,), -1, dtype=torch.int32, device="cuda").sum() for _ in range(64)])

    x0 = layers[0][0]
    chain(x0)  # compiles and makes the counters outside the captures
    scribble()
    first, second = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(first):
        scribble()
    with torch.cuda.graph(second, pool=first.pool()):
        outs = chain(x0)
    _replays_match_eager(lambda: (first.replay(), second.replay()), outs, chain, x0, range(200, 210))
    _counters_back_at_zero()


def test_custom_ops_under_torch_compile():
    import opmap  # noqa: F401  (registers torch.ops.opmap.*)

    def block(x, res, w):
        h = torch.ops.opmap.add_rmsnorm(x, res, w, 1e-6)
        return torch.ops.opmap.silu_mul(h)

    x, w = _randn(8, 256, seed=10), _randn(256, seed=11)
    r1, r2 = _randn(8, 256, seed=12), _randn(8, 256, seed=12)
    out = torch.compile(block, fullgraph=True)(x, r1, w)
    exp = act_ref.silu_mul(norm_ref.add_rmsnorm(x, r2, w, 1e-6))
    assert_close(r1, r2)
    assert_close(out, exp)


def test_decode_layer_ops_capture_in_one_cuda_graph():
    # add+RMSNorm -> QKV linear -> RoPE (in place on views of qkv) -> gate/up linear (fp8) ->
    # SiLU*mul -> down linear, captured once and replayed on new inputs: no host sync anywhere
    # (the linears through opmap.linear: the backends the selector picks at 8 rows).
    T, H, Hq, Hk, D, I = 8, 1024, 8, 2, 128, 2048
    g = torch.Generator(device=DEV).manual_seed(30)
    mk = lambda *s, scale=1.0: (torch.randn(*s, device=DEV, generator=g) * scale).to(BF16)  # noqa: E731
    x, res, wn = mk(T, H), mk(T, H), mk(H)
    wqkv = mk((Hq + 2 * Hk) * D, H, scale=H ** -0.5)
    w13q, s13 = quant.quantize_weight(mk(2 * I, H, scale=H ** -0.5), "fp8")
    w2 = mk(H, I, scale=I ** -0.5)
    cs = rope_ref.cos_sin_cache(D, 4096, 500000.0, LLAMA3, device=DEV)
    pos = torch.arange(T, device=DEV) * 37

    def layer(impl_norm, impl_rope, impl_act, lin, x, res):
        h = impl_norm.add_rmsnorm(x, res, wn, 1e-6)
        qkv = lin(h, wqkv)
        q = qkv[:, : Hq * D].view(T, Hq, D)
        k = qkv[:, Hq * D: (Hq + Hk) * D].view(T, Hk, D)
        impl_rope.rope(q, k, pos, cs, "neox")
        a = impl_act.silu_mul(lin(h, w13q, None, s13))
        return qkv, lin(a, w2)

    run = lambda x, res: layer(triton_norm, triton_rope, triton_act, opmap.linear, x, res)  # noqa: E731
    run(x.clone(), res.clone())  # compile outside the capture
    xs, rs = x.clone(), res.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qkv_out, out = run(xs, rs)
    x2, r2 = mk(T, H), mk(T, H)
    xs.copy_(x2)
    rs.copy_(r2)
    graph.replay()
    torch.cuda.synchronize()
    r_ref = r2.clone()
    qkv_ref, out_ref = layer(norm_ref, rope_ref, act_ref, gemm_ref.linear, x2, r_ref)
    assert_close(rs, r_ref)
    assert_close(qkv_out, qkv_ref)
    assert cosine(out, out_ref) > 0.9999


@pytest.mark.parametrize("M,I,K,fmt", [(1, 14336, 4096, None), (16, 14336, 4096, None), (32, 1409, 4096, None),
                                       (1, 14336, 4096, "fp8")])
def test_linear_act_bf16_equals_the_gemm_then_the_activation(M, I, K, fmt):
    """The gated epilogue on the GPU (autotuned tiles, K splits at M = 1) against the GEMM then the
    activation kernel (the same rounding steps; the summation order may differ with the tile) and
    the fp32 reference, then captured in a CUDA graph and replayed on a new x."""
    g = torch.Generator(device=DEV).manual_seed(M + I)
    x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(2 * I, K, device=DEV, generator=g) / K ** 0.5).to(torch.bfloat16)
    s = None
    if fmt:
        w, s = quant.quantize_weight(w.float(), fmt)
    y = triton_gemm.linear_act(x, w, None, s)
    assert_close(y, triton_act.silu_mul(triton_gemm.linear(x, w, None, s)), torch.bfloat16, scale=2.0)
    assert_close(y, gemm_ref.linear_act(x, w, None, s), torch.bfloat16, scale=2.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_gemm.linear_act(x, w, None, s)
    x.copy_(torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16))
    graph.replay()
    assert_close(out, gemm_ref.linear_act(x, w, None, s), torch.bfloat16, scale=2.0)

