"""int4 weight-only linear on the GPU, bf16: triton-w4a16 at decode and prefill M on Llama-3-8B's
projections (group 128, symmetric and with zero points, odd N), its split-K path captured in a
CUDA graph and replayed with new inputs, and dequant-cublas at many rows, each against the fp32
reference; the selector's int4 choices on this GPU."""
import pytest
import torch

import opmap
from opmap.core.hw import local_arch
from opmap.core.select import select
from opmap.core.specs import GemmSpec
from opmap.core.tolerance import assert_close
from opmap.kernels.gemm import w4a16, w4a16_gluon
from opmap.ops.gemm.quant import dequantize_int4, quantize_int4
from opmap.kernels.gemm import dequant_cublas

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _case(M, N, K, G, zp, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
    p, s, z = quantize_int4(w, G, zp)
    x = torch.randn(M, K, device="cuda", generator=g).to(BF16)
    return x, p, s.half(), z


def _ref(x, p, s, z, rounded=False):
    """``rounded``: the weight rounded to x's dtype first (as the FOLD=1 kernel rounds it)."""
    w = dequantize_int4(p, s, z)
    return (x.float() @ (w.to(x.dtype).float() if rounded else w).t()).to(x.dtype)


@pytest.mark.parametrize("M", [1, 7, 32, 64, 65, 256, 1024])
@pytest.mark.parametrize("N,K", [(28672, 4096), (4096, 14336), (6144, 4096), (32001, 4096)])
@pytest.mark.parametrize("zp", [False, True])
def test_triton_w4a16_bf16(M, N, K, zp):
    if N == 32001:  # odd N with 4096 // 8 words a row; the scale stays one per 128 channels
        N = 32000 + 1
    x, p, s, z = _case(M, N, K, 128, zp, seed=M + N)
    fold = bool(w4a16._planned(M, N, K, 128, x.device, None)["FOLD"])  # then the weight is rounded to bf16
    assert_close(w4a16.linear(x, p, None, s, z), _ref(x, p, s, z, rounded=fold), BF16, scale=2.0,
                 what=f"M={M} N={N} K={K}")


@pytest.mark.parametrize("sub,fold", [(2, 0), (4, 0), (1, 1), (2, 1)])
@pytest.mark.parametrize("M,N,K,split", [(1, 28672, 4096, 0), (1, 4096, 14336, 0), (33, 6144, 4096, 3), (64, 4096, 14336, 0),
                                         (1024, 4096, 4096, 0)])
def test_sub_tiles_an_iteration(sub, fold, M, N, K, split):
    """config SUB: K tiles a loop iteration (their scales loaded first), with K ranges a whole number
    of SUB tiles and not (a split of 14336 / 128 = 112 tiles into 3 or the plan's splits); FOLD: the
    scales on the weight before the MMA."""
    x, p, s, z = _case(M, N, K, 128, True, seed=M * sub + fold)
    out = w4a16.linear(x, p, None, s, z, config={"SUB": sub, "SPLIT": split, "FOLD": fold})
    assert_close(out, _ref(x, p, s, z, rounded=bool(fold)), BF16, scale=2.0, what=f"SUB={sub} FOLD={fold} M={M} N={N} K={K}")


@pytest.mark.parametrize("G", [32, 64, 4096])
def test_group_sizes(G):
    x, p, s, z = _case(3, 4096, 4096, G, True, seed=G)
    assert_close(w4a16.linear(x, p, None, s, z), _ref(x, p, s, z), BF16, scale=2.0, what=f"G={G}")


def test_split_k_graph_replay():
    """The split path (few N tiles: the partials and the tile counters) captured in a CUDA graph
    after an eager call, replayed with new x: each replay equals the reference."""
    x, p, s, z = _case(1, 1024, 14336, 128, False)
    w4a16.linear(x, p, None, s, z)  # the eager call makes the graph counters
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = w4a16.linear(x, p, None, s, z)
    for i in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert_close(out, _ref(x, p, s, z), BF16, scale=2.0, what=f"replay {i}")


@pytest.mark.parametrize("M", [128, 2048])
def test_dequant_cublas_int4(M):
    x, p, s, z = _case(M, 14336, 4096, 128, True, seed=M)
    assert_close(dequant_cublas.linear(x, p, None, s, z), _ref(x, p, s, z), BF16, scale=2.0, what=f"M={M}")


def test_selection_on_this_gpu():
    arch = local_arch()
    for m, want in ((1, "gluon-w4a16" if arch == "sm90" else "triton-w4a16"),
                    (16, "gluon-w4a16" if arch == "sm90" else "triton-w4a16"), (17, "triton-w4a16")):
        dec = select("gemm", GemmSpec(arch=arch, phase="decode", m=m, n=4096, k=4096, weight_dtype="int4",
                                      group_size=128))
        assert dec.backend.name == want, (m, dec.backend.name)
    x, p, s, z = _case(1, 4096, 4096, 128, True)
    assert_close(opmap.linear(x, p, None, s, z), _ref(x, p, s, z), BF16, scale=2.0, what="opmap.linear")


@pytest.mark.parametrize("M", [1, 2, 7, 8, 9, 16])
@pytest.mark.parametrize("N,K", [(28672, 4096), (4096, 14336), (6144, 4096), (32001, 4096), (100, 256)])
@pytest.mark.parametrize("zp", [False, True])
def test_gluon_w4a16_bf16(M, N, K, zp):
    """gluon-w4a16 (mma.sync, the weight words loaded straight into the A fragments) against the fp32
    reference: M over the 8-row tile's edge, odd N, a K of two tiles (no split) and the plan's splits."""
    if N == 32001:
        N = 32000 + 1
    x, p, s, z = _case(M, N, K, 128, zp, seed=M * 7 + N + zp)
    assert_close(w4a16_gluon.linear(x, p, None, s, z), _ref(x, p, s, z), BF16, scale=2.0,
                 what=f"gluon-w4a16 M={M} N={N} K={K} zp={zp}")


@pytest.mark.parametrize("M", [3, 16])
@pytest.mark.parametrize("cfg", [{"BLOCK_N": 32}, {"BLOCK_N": 128}, {"per_sm": 8}, {"per_sm": 1},
                                 {"BLOCK_N": 128, "per_sm": 8}])
def test_gluon_w4a16_configs_fp16_group_256_bias_and_graph_replay(cfg, M):
    """Its tunings at both row tiles, fp16 activations, a group of 256 (two K tiles a group), a bias,
    and a CUDA graph of a split call replayed with new inputs."""
    N, K = 4096 + 48, 14336
    g = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
    p, s, z = quantize_int4(w, 256, True)
    s = s.half()
    x = torch.randn(M, K, device="cuda", generator=g).half()
    b = torch.randn(N, device="cuda", generator=g).half()
    ref = lambda: (x.float() @ dequantize_int4(p, s, z).t() + b.float()).half()  # noqa: E731
    assert_close(w4a16_gluon.linear(x, p, b, s, z, config=cfg), ref(), torch.float16, scale=2.0, what=f"{cfg}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16_gluon.linear(x, p, b, s, z, config=cfg)
    for seed in range(2):
        x.copy_(torch.randn(M, K, device="cuda", generator=g).half())
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, ref(), torch.float16, scale=2.0, what=f"{cfg} replay {seed}")


def test_gluon_w4a16_reads_a_row_strided_weight():
    """A weight whose rows sit in a wider buffer (a view, row stride 4 words past K / 8) is read by its
    stride; a stride of an odd count of words is refused naming ``w``."""
    from opmap.core.contract import InputError

    M, N, K = 1, 1000, 4096
    x, p, s, z = _case(M, N, K, 128, True, seed=11)
    wide = torch.zeros(N, K // 8 + 4, dtype=p.dtype, device=p.device)
    wide[:, : K // 8] = p
    view = wide[:, : K // 8]
    assert_close(w4a16_gluon.linear(x, view, None, s, z), _ref(x, p, s, z), BF16, scale=2.0, what="strided w")
    odd = torch.zeros(N, K // 8 + 1, dtype=p.dtype, device=p.device)[:, : K // 8]
    with pytest.raises(InputError, match="w"):
        w4a16_gluon.linear(x, odd, None, s, z)
