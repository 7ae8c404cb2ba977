"""Block-wise fp8 weight-only linear (DeepSeek-V3 / Qwen3-FP8 layout: e4m3 with one fp32 scale per
b x b block, partial blocks at the edges): triton-fp8-block and the many-row dequant-cublas route
against the fp32 reference on fresh random inputs: blocks 16 / 32 / 64 / 128, N and K not whole
blocks, M at 0, 1, tile edges and the split-K path, fp16 and fp32 activations, bias, config;
bad inputs are InputErrors naming the argument."""
import pytest
import torch

import opmap
from opmap.core.contract import InputError
from opmap.core.tolerance import assert_close
from opmap.kernels.gemm import fp8_block
from opmap.ops.gemm.quant import block_of, dequantize_fp8_block, quantize_fp8_block
from opmap.kernels.gemm import dequant_cublas


def _case(M, N, K, b, dt=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    wq, s = quantize_fp8_block(w, b)
    return torch.randn(M, K, generator=g).to(dt), wq, s


def _ref(x, wq, s, bias=None, rounded=False):
    """``rounded``: the weight rounded to x's dtype first (as the FOLD=1 kernel rounds it)."""
    w = dequantize_fp8_block(wq, s)
    y = x.float() @ (w.to(x.dtype).float() if rounded else w).t()
    return (y + bias.float() if bias is not None else y).to(x.dtype)


def test_block_quantisation_and_its_edge():
    w = torch.randn(70, 100)
    wq, s = quantize_fp8_block(w, 32)
    assert s.shape == (3, 4) and block_of(70, 100, s) == 32
    rel = (dequantize_fp8_block(wq, s) - w).abs() / w.abs().clamp_min(1e-3)
    assert float(rel.median()) < 0.05  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("M,N,K,b", [(1, 96, 256, 64), (3, 50, 200, 32), (17, 130, 96, 16), (70, 40, 256, 128),
                                     (1, 64, 2048, 128), (33, 129, 130, 16), (2, 32001 // 100, 64, 32)])
@pytest.mark.parametrize("dt", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_kernel_matches_reference(M, N, K, b, dt):
    x, wq, s = _case(M, N, K, b, dt, seed=M + N + K)
    bias = torch.randn(N).to(dt)
    # the plan folds the block scale into the weight (rounded to x's dtype) at every M
    assert fp8_block._planned(M, N, K, b, torch.device("cpu"), None)["FOLD"] == 1
    assert_close(fp8_block.linear(x, wq, bias, s), _ref(x, wq, s, bias, rounded=True), dt, scale=4.0,
                 what=f"M={M} N={N} K={K}")


@pytest.mark.parametrize("split", [1, 3])
def test_k_splits(split):
    x, wq, s = _case(2, 64, 1024, 64, seed=split)
    y = fp8_block.linear(x, wq, None, s, config={"SPLIT": split})
    assert_close(y, _ref(x, wq, s, rounded=True), torch.float16, scale=4.0, what=f"split {split}")


def test_dequant_cublas_and_api():
    x, wq, s = _case(130, 48, 100, 32, torch.float32, seed=2)
    assert_close(dequant_cublas.linear(x, wq, None, s), _ref(x, wq, s), torch.float32, scale=2.0, what="dq")
    assert_close(opmap.linear(x, wq, None, s), _ref(x, wq, s), torch.float32, scale=2.0, what="opmap.linear")


def test_empty_config_and_bad_inputs():
    x, wq, s = _case(0, 64, 128, 32)
    assert fp8_block.linear(x, wq, None, s).shape == (0, 64)
    x, wq, s = _case(3, 64, 128, 32)
    with pytest.raises(InputError, match="BLOCK_K"):
        fp8_block.linear(x, wq, None, s, config={"BLOCK_K": 64})  # does not divide the 32-wide blocks
    with pytest.raises(InputError, match="w_scale"):
        opmap.linear(x, wq, None, torch.ones(3, 3))  # no block edge gives this shape
    with pytest.raises(InputError, match="w_scale"):
        fp8_block.linear(x, wq, None, torch.ones(64))  # a scale per channel: not this kernel's
    with pytest.raises(InputError, match="w_scale"):
        fp8_block.linear(x, wq, None, s.half())
    assert "BLOCK_K 32" in fp8_block.describe(3, 64, 128, "cpu", 32)


@pytest.mark.parametrize("sub,split,fold", [(2, 1, 0), (4, 1, 0), (4, 2, 0), (1, 1, 1), (4, 2, 1)])
def test_sub_tiles_an_iteration(sub, split, fold):
    """config SUB: K tiles a loop iteration, their block scales loaded first; K = 400 ends in a partial
    block and the iterations in tiles past K; FOLD: the block scale on the weight before the MMA."""
    x, wq, s = _case(5, 48, 400, 32, seed=sub + split + fold)
    out = fp8_block.linear(x, wq, None, s, config={"SUB": sub, "SPLIT": split, "FOLD": fold})
    assert_close(out, _ref(x, wq, s, rounded=bool(fold)), torch.float16, scale=2.0,
                 what=f"SUB={sub} SPLIT={split} FOLD={fold}")
    assert ("scale before the MMA" in fp8_block.describe(5, 48, 400, "cpu", 32, config={"FOLD": fold})) == bool(fold)
