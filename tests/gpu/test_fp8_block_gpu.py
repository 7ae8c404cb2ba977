"""Block-wise fp8 weight-only linear on the GPU, bf16: triton-fp8-block at decode and prefill M on
DeepSeek-V3's and Llama-3-8B's projection shapes (128 x 128 blocks, partial ones at N = 576 and
32001), its split-K path in a CUDA graph, and dequant-cublas at many rows, against the fp32
reference; the selector's choice on this GPU."""
import pytest
import torch

import opmap
from opmap.core.hw import local_arch
from opmap.core.select import select
from opmap.core.specs import GemmSpec
from opmap.core.tolerance import assert_close
from opmap.kernels.gemm import fp8_block
from opmap.ops.gemm.quant import dequantize_fp8_block, quantize_fp8_block
from opmap.kernels.gemm import dequant_cublas

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _case(M, N, K, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    wq, s = quantize_fp8_block(torch.randn(N, K, device="cuda", generator=g) / K ** 0.5, 128)
    return torch.randn(M, K, device="cuda", generator=g).to(BF16), wq, s


def _ref(x, wq, s, rounded=False):
    """``rounded``: the weight rounded to x's dtype first (as the FOLD=1 kernel rounds it)."""
    w = dequantize_fp8_block(wq, s)
    return (x.float() @ (w.to(x.dtype).float() if rounded else w).t()).to(x.dtype)


@pytest.mark.parametrize("M", [1, 7, 32, 64, 65, 1024])
@pytest.mark.parametrize("N,K", [(24576, 7168), (7168, 18432), (576, 7168), (32001, 4096), (4096, 14336)])
def test_triton_fp8_block_bf16(M, N, K):
    x, wq, s = _case(M, N, K, seed=M + N)
    # the plan folds the block scale into the weight (rounded to bf16) at every M
    assert_close(fp8_block.linear(x, wq, None, s), _ref(x, wq, s, rounded=True), BF16, scale=2.0,
                 what=f"M={M} N={N} K={K}")


@pytest.mark.parametrize("sub,fold", [(2, 0), (4, 0), (1, 1), (2, 1)])
@pytest.mark.parametrize("M,N,K", [(1, 24576, 7168), (1, 7168, 18432), (64, 4096, 14336), (5, 576, 4000),
                                   (1024, 4096, 4000)])
def test_sub_tiles_an_iteration(sub, fold, M, N, K):
    """config SUB: K tiles a loop iteration, their block scales loaded first; K = 4000 ends in a partial
    block inside the last iteration's tiles; FOLD: the block scale on the weight before the MMA."""
    x, wq, s = _case(M, N, K, seed=M * sub + 1 + fold)
    out = fp8_block.linear(x, wq, None, s, config={"SUB": sub, "FOLD": fold})
    assert_close(out, _ref(x, wq, s, rounded=bool(fold)), BF16, scale=2.0, what=f"SUB={sub} FOLD={fold} M={M} N={N} K={K}")


def test_split_k_graph_replay():
    x, wq, s = _case(1, 576, 7168)
    fp8_block.linear(x, wq, None, s)  # the eager call makes the graph counters
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fp8_block.linear(x, wq, None, s)
    for i in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert_close(out, _ref(x, wq, s, rounded=True), BF16, scale=2.0, what=f"replay {i}")


@pytest.mark.parametrize("M", [128, 2048])
def test_dequant_cublas_block(M):
    x, wq, s = _case(M, 7168, 2048, seed=M)
    assert_close(dequant_cublas.linear(x, wq, None, s), _ref(x, wq, s), BF16, scale=2.0, what=f"M={M}")


def test_selection_on_this_gpu():
    spec = GemmSpec(arch=local_arch(), phase="decode", m=1, n=7168, k=2048, weight_dtype="fp8-block", group_size=128)
    assert select("gemm", spec).backend.name == "triton-fp8-block"
    x, wq, s = _case(1, 7168, 2048)
    assert_close(opmap.linear(x, wq, None, s), _ref(x, wq, s), BF16, scale=2.0, what="opmap.linear")


@pytest.mark.parametrize("M,N,K", [(128, 7168, 2048), (1000, 576, 7168), (4096, 4096, 14336), (129, 4096, 4096),
                                   (3, 1024, 2048)])
def test_scaled_mm_block_quality_and_selection(M, N, K):
    """scaled-mm-block quantises x per token and 128-channel group: its output against the fp32
    product of x and the dequantised weight (the fp8-activation gate of the check suite, cosine >=
    0.998) and against quantising x by the PyTorch reference then multiplying in fp32 (tight)."""
    from opmap.kernels.gemm import act_quant, scaled_mm
    from opmap.ops.gemm.quant import quantize_act_fp8_group
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("cuBLASLt's block-scaled fp8 GEMM is sm90's")
    x, wq, s = _case(M, N, K, seed=M)
    out = scaled_mm.linear_block(x, wq, None, s)
    ref = _ref(x, wq, s)
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0)
    assert cos >= 0.998, cos
    xq, xs = quantize_act_fp8_group(x, 128)
    q, qs = act_quant.quantize_act_fp8_group(x, 128)
    assert torch.equal(q.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(qs, xs)  # bitwise
    xd = (xq.float().view(M, K // 128, 128) * xs[..., None]).view(M, K)
    assert_close(out, (xd @ dequantize_fp8_block(wq, s).t()).to(BF16), BF16, scale=2.0, what=f"M={M}")
    # bias, and the empty batch
    b = torch.randn(N, device="cuda", dtype=BF16)
    assert_close(scaled_mm.linear_block(x, wq, b, s), out + b, BF16, scale=2.0, what="bias")
    assert scaled_mm.linear_block(x[:0], wq, None, s).shape == (0, N)
    # through the public op, the backend named (a prefill step); below MANY_ROWS known rows the
    # backend refuses the call, naming why (the kernel above runs there: rows padded to 4)
    if M >= 128:
        assert_close(opmap.linear(x, wq, None, s, backend="scaled-mm-block", phase="prefill"), out, BF16, scale=1.0,
                     what="opmap.linear")
    else:
        with pytest.raises(Exception, match="quantised per token group here only"):
            opmap.linear(x, wq, None, s, backend="scaled-mm-block", phase="prefill")
    # K = 1152: nine block scales a row, not a whole number of four: refused, naming w
    from opmap.core.contract import InputError
    x9, w9, s9 = _case(128, 256, 1152)
    with pytest.raises(InputError, match="w"):
        scaled_mm.linear_block(x9, w9, None, s9)


def test_gemlite_peer_matches_the_int4_reference():
    """The W4A16 peer row of the benchmark computes what our int4 layout holds (else its timing is
    of a different product)."""
    from opmap.ops.gemm.quant import dequantize_int4, quantize_int4
    from opmap.peers.gemm import gemlite_peer
    why = gemlite_peer.available()
    if why:
        pytest.skip(why)
    g = torch.Generator(device="cuda").manual_seed(7)
    for M in (1, 64, 512):
        w = torch.randn(4096, 4096, device="cuda", generator=g) / 64
        wq, sc, _ = quantize_int4(w, 128)
        x = torch.randn(M, 4096, device="cuda", dtype=BF16, generator=g)
        lin = gemlite_peer.int4_linear(wq, sc.half(), None, BF16)
        # gemlite dequantises into the activations' dtype before its MMA: the weight rounded to bf16
        ref = (x.float() @ dequantize_int4(wq, sc.half()).to(BF16).float().t()).to(BF16)
        assert_close(lin(x), ref, BF16, scale=4.0, what=f"gemlite M={M}")
