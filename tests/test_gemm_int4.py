"""int4 weight-only linear (W4A16): the packed layout (ops/gemm/quant.py), the Triton kernel
(triton-w4a16) and the many-row route (dequant-cublas) against the fp32 reference on fresh random
inputs: group sizes 16 / 32 / 128 / one a row, symmetric and with zero points, odd N (vocab
32001), M at 0, 1, tile edges and the split-K path, fp16 and fp32 activations, bias, config
overrides, the public API and torch.ops.opmap; bad inputs are InputErrors naming the argument."""
import pytest
import torch

import opmap
from opmap.core.contract import InputError
from opmap.core.tolerance import assert_close
from opmap.kernels.gemm import w4a16
from opmap.ops.gemm.quant import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from opmap.kernels.gemm import dequant_cublas


def _case(M, N, K, G, zp, dt=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    p, s, z = quantize_int4(w, G, zp)
    x = torch.randn(M, K, generator=g).to(dt)
    return x, p, s, z


def _ref(x, p, s, z, bias=None, rounded=False):
    """``rounded``: the weight rounded to x's dtype first (the FOLD=1 kernels round it as a dequantised
    weight is)."""
    w = dequantize_int4(p, s, z)
    y = x.float() @ (w.to(x.dtype).float() if rounded else w).t()
    return (y + bias.float() if bias is not None else y).to(x.dtype)


def _folds(M, N, K, G) -> bool:
    """Whether the kernel's plan puts the scale on the weight before the MMA (then it rounds the
    weight to x's dtype, as the rounded reference does)."""
    return bool(w4a16._planned(M, N, K, G, torch.device("cpu"), None)["FOLD"])


def test_pack_roundtrip_and_nibble_order():
    u = torch.randint(0, 16, (5, 24), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(u)), u)
    one = torch.zeros(1, 8, dtype=torch.uint8)
    one[0, 3] = 0xF  # column 3 of a word: bits 12..15
    assert int(pack_int4(one)[0, 0]) == 0xF << 12
    one[0, 7] = 0x8  # the top nibble: a negative int32
    assert int(pack_int4(one)[0, 0]) == (0xF << 12) + (0x8 << 28) - 2**32


@pytest.mark.parametrize("zp", [False, True])
def test_quantize_int4_error_is_half_a_step(zp):
    w = torch.randn(16, 256)
    p, s, z = quantize_int4(w, 32, zp)
    err = (dequantize_int4(p, s, z) - w).abs().view(16, 8, 32)
    assert bool((err <= 0.5 * s[..., None] + 1e-6).all())


@pytest.mark.parametrize("M,N,K,G,zp", [(1, 96, 256, 64, False), (3, 50, 512, 128, True), (17, 64, 128, 128, False),
                                        (70, 40, 256, 32, True), (1, 64, 2048, 2048, False), (2, 33, 1024, 16, True),
                                        (16, 32001 // 64, 256, 128, False), (33, 129, 512, 256, True)])
@pytest.mark.parametrize("dt", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_kernel_matches_reference(M, N, K, G, zp, dt):
    x, p, s, z = _case(M, N, K, G, zp, dt, seed=M * N + K)
    bias = torch.randn(N).to(dt)
    y = w4a16.linear(x, p, bias, s, z)
    assert_close(y, _ref(x, p, s, z, bias, rounded=_folds(M, N, K, G)), dt, scale=4.0, what=f"M={M} N={N} K={K} G={G}")


@pytest.mark.parametrize("split", [1, 2, 5])
def test_k_splits_sum_in_order(split):
    """The split-K partials (summed in split order by the last program of a tile) give the
    unsplit result, whatever the split count; a split count beyond the tiles leaves none empty."""
    x, p, s, z = _case(3, 64, 1024, 64, True, seed=split)
    y1 = w4a16.linear(x, p, None, s, z, config={"SPLIT": 1})
    y = w4a16.linear(x, p, None, s, z, config={"SPLIT": split})
    assert_close(y, y1, torch.float16, scale=1.0, what=f"split {split}")
    assert_close(y, _ref(x, p, s, z), torch.float16, scale=2.0, what="reference")


def test_scale_dtypes_and_vocab_rows():
    """Scales stored as the checkpoint has them (fp16 / bf16 / fp32) are read as they are; N = 32001."""
    x, p, s, z = _case(2, 32001, 128, 32, False, seed=4)
    for sd in (torch.float16, torch.bfloat16, torch.float32):
        y = w4a16.linear(x, p, None, s.to(sd), z)
        assert_close(y, _ref(x, p, s.to(sd).float(), z), torch.float16, scale=2.0, what=str(sd))


def test_empty_and_config():
    x, p, s, z = _case(0, 64, 128, 32, False)
    assert w4a16.linear(x, p, None, s, z).shape == (0, 64)
    x, p, s, z = _case(5, 64, 256, 64, False)
    y = w4a16.linear(x, p, None, s, z, config={"BLOCK_K": 32, "BLOCK_N": 32})
    assert_close(y, _ref(x, p, s, z), torch.float16, scale=2.0, what="config tile")
    with pytest.raises(InputError, match="BLOCK_K"):
        w4a16.linear(x, p, None, s, z, config={"BLOCK_K": 128})  # does not divide the group of 64
    with pytest.raises(InputError, match="config"):
        w4a16.linear(x, p, None, s, z, config={"TILE": 3})
    assert "BLOCK_K 64" in w4a16.describe(5, 64, 256, "cpu", 64)


def test_dequant_cublas_route():
    for zp in (False, True):
        x, p, s, z = _case(130, 48, 256, 32, zp, torch.float32, seed=9)
        assert_close(dequant_cublas.linear(x, p, None, s, z), _ref(x, p, s, z), torch.float32, scale=2.0, what="dq")


def test_dequant_cublas_reads_a_row_strided_weight():
    """A weight whose rows are a view of wider ones (row stride above K / 8) is read at its stride."""
    x, p, s, z = _case(130, 24, 256, 64, True, torch.float32, seed=5)
    wide = torch.zeros(24, 40, dtype=torch.int32)
    wide[:, :32] = p
    view = wide[:, :32]
    assert view.stride(0) == 40
    assert_close(dequant_cublas.linear(x, view, None, s, z), _ref(x, p, s, z), torch.float32, scale=2.0, what="dq")
    assert_close(w4a16.linear(x.half(), view, None, s, z), _ref(x.half(), p, s, z, rounded=_folds(130, 24, 256, 64)),
                 torch.float16, scale=4.0, what="w4a16")


def test_zero_points_with_a_dense_weight_are_named():
    x = torch.randn(2, 64)
    with pytest.raises(InputError, match="w_zero"):
        opmap.linear(x, torch.randn(8, 64), None, None, torch.zeros(8, 2, dtype=torch.uint8), backend="cublas")


def test_public_api_and_custom_op():
    x, p, s, z = _case(4, 64, 256, 128, True, seed=3)
    want = _ref(x, p, s, z)
    assert_close(opmap.linear(x, p, None, s, z), want, torch.float16, scale=2.0, what="opmap.linear")
    assert_close(torch.ops.opmap.linear(x, p, None, s, z), want, torch.float16, scale=2.0, what="torch.ops")
    sym = _case(4, 64, 256, 128, False, seed=3)
    assert_close(opmap.linear(*sym[:2], None, sym[2]), _ref(*sym), torch.float16, scale=2.0, what="symmetric")


@pytest.mark.parametrize("bad,words", [
    (lambda x, p, s, z: (x, p[:, :-1], None, s, z), "w"),  # K / 8 words does not match x
    (lambda x, p, s, z: (x, p, None, None, z), "w_scale"),
    (lambda x, p, s, z: (x, p, None, s[:, :3], z), "w_scale"),  # 3 groups do not divide K = 256
    (lambda x, p, s, z: (x, p, None, s, z.int()), "w_zero"),
    (lambda x, p, s, z: (x, p, None, s, z[:, :1].contiguous()), "w_zero"),
    (lambda x, p, s, z: (x.to(torch.int8), p, None, s, z), "x"),
])
def test_bad_inputs_are_named(bad, words):
    x, p, s, z = _case(2, 32, 256, 64, True)
    args = bad(x, p, s, z)
    with pytest.raises(InputError, match=words):
        opmap.linear(*args, backend="triton-w4a16")


def test_group_not_a_multiple_of_16_is_refused():
    x, p, s, z = _case(2, 32, 64, 8, False)
    with pytest.raises(InputError, match="group"):
        w4a16.linear(x, p, None, s, z)
    with pytest.raises(InputError, match="group_size"):
        quantize_int4(torch.randn(4, 60), 12)


@pytest.mark.parametrize("sub,split,fold", [(2, 1, 0), (4, 1, 0), (4, 3, 0), (2, 5, 0), (1, 1, 1), (4, 3, 1)])
def test_sub_tiles_an_iteration(sub, split, fold):
    """config SUB: K tiles a loop iteration, their group scales (and zeros) loaded first; K ranges of
    a split that are not a whole number of SUB tiles end in masked tiles (K = 448: 7 tiles of 64);
    FOLD: the scales on the weight before the MMA."""
    x, p, s, z = _case(3, 40, 448, 64, True, seed=sub * 10 + split + fold)
    out = w4a16.linear(x, p, None, s, z, config={"SUB": sub, "SPLIT": split, "FOLD": fold})
    assert_close(out, _ref(x, p, s, z, rounded=bool(fold)), torch.float16, scale=2.0,
                 what=f"SUB={sub} SPLIT={split} FOLD={fold}")
    for bad in ({"SUB": 3}, {"FOLD": 2}):
        with pytest.raises(InputError, match="config"):
            w4a16.linear(x, p, None, s, z, config=bad)


def test_dequant_cublas_names_a_group_of_no_whole_words():
    """K = 64 with 16 groups: 4 channels a group, not whole 8-code words."""
    x, p, s, z = _case(2, 16, 64, 16, False)
    with pytest.raises(InputError, match="w_scale"):
        dequant_cublas.linear(x, p, None, torch.ones(16, 16), None)


def test_plan_folds_splits_and_stages():
    """scaled_tiles.plan's choices, stated here rather than read back from it: int4 keeps the scale
    after the MMA below 64-row tiles and folds it (two K tiles an iteration) from there; block fp8
    folds at every M; int4 at M <= 32 with few N tiles splits at least DEEP_SPLIT ways at two
    stages, a shape the ordinary rule splits deeper keeps its split; a SPLIT given by config gets
    the stages of its tiling."""
    from opmap.kernels.gemm import scaled_tiles as T
    p = lambda M, N, K, fp8=False: T.plan(M, N, K, 128, 132, 128 if fp8 else 256, fp8, interp=False)  # noqa: E731
    assert (p(1, 28672, 4096)["FOLD"], p(32, 28672, 4096)["FOLD"], p(64, 28672, 4096)["FOLD"]) == (0, 0, 1)
    assert (p(64, 28672, 4096)["SUB"], p(1, 28672, 4096)["SUB"], p(1024, 4096, 4096)["SUB"]) == (2, 1, 1)
    assert all(p(m, 4096, 14336, True)["FOLD"] == 1 for m in (1, 16, 64, 1024))
    down = p(1, 4096, 14336)
    assert (down["SPLIT"], down["num_stages"]) == (T.DEEP_SPLIT, 2)
    assert p(1, 1024, 8192)["SPLIT"] == 16  # 16 N tiles: the ordinary rule's deeper split
    assert p(1, 28672, 4096)["SPLIT"] == 1 and p(64, 4096, 14336)["SPLIT"] != T.DEEP_SPLIT
    assert p(1, 4096, 14336, True)["SPLIT"] != T.DEEP_SPLIT  # block fp8: no deep split
