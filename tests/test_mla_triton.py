"""MLA Triton kernels (interpreter, fp32/fp16, small rank/heads plus one real-rank case) against
the fp32 reference: page boundaries, shuffled pages, split-KV, fp8 cache, sparse indices,
workspace reuse after re-planning, chunked prefill with a cached prefix, append. The pointer
kernel is the mla-triton backend's (decode.py), the TMA kernel mla-tma's (decode_tma.py); the Gluon
fp8 kernel (mla-gluon-fp8, decode_fp8.py) does not run here: its refusals and split plan are
checked, its numbers by tests/gpu/test_mla_gpu.py."""
import pytest
import torch

from opmap.core import registry
from opmap.core import select
from opmap.core.contract import InputError
from opmap.core.specs import AttentionSpec
from opmap.kernels.mla import append as ap
from opmap.kernels.mla import common
from opmap.kernels.mla import decode as dec
from opmap.kernels.mla import decode_tma as tma
from opmap.kernels.mla import prefill as pf
from opmap.ops.mla import reference as ref
from opmap.harness.fixtures.mla import make_cache, sparse_indices
from opmap.core.tolerance import assert_close, cosine

R, DR, H = 32, 16, 4
# the interpreter converts 1-element arrays to scalars in loop bounds (numpy deprecation noise)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _q(B, dt, g, h=H, r=R, dr=DR):
    return torch.randn(B, h, r, generator=g).to(dt), torch.randn(B, h, dr, generator=g).to(dt)


def _check(out, want, dt):
    assert_close(out[0], want[0], what="out")
    assert_close(out[1], want[1], dtype=dt, what="lse")


@pytest.mark.parametrize("dt,page,splits", [(torch.float32, 1, 1), (torch.float32, 16, 3),
                                            (torch.float16, 64, 1), (torch.float16, 16, 4)])
def test_decode_matches_reference(dt, page, splits):
    g = torch.Generator().manual_seed(page + splits)
    lens = [0, 1, page - 1 or 2, page, page + 1, 3 * page + 5]
    pc = make_cache(lens, R, DR, page, dt, gen=g)
    qn, qp = _q(len(lens), dt, g)
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.2, return_lse=True)
    ws = dec.make_workspace(len(lens), H, R, "cpu", num_splits=splits, split_min=16)
    got = dec.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.2, return_lse=True,
                         workspace=ws)
    _check(got, want, dt)
    assert torch.all(got[0][0] == 0) and torch.all(torch.isinf(got[1][0]))  # length 0


def test_decode_real_rank_tiny_length():
    g = torch.Generator().manual_seed(7)
    lens = [1, 65]
    pc = make_cache(lens, 512, 64, 64, torch.float16, gen=g)
    qn, qp = _q(2, torch.float16, g, h=16, r=512, dr=64)
    s = 576 ** -0.5
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=s, return_lse=True)
    ws = dec.make_workspace(2, 16, 512, "cpu", num_splits=2, split_min=32)
    _check(dec.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=s, return_lse=True,
                          workspace=ws), want, torch.float16)


def test_workspace_reused_after_replanning():
    """The plan lives on the device: the same workspace serves new lengths and new page tables."""
    g = torch.Generator().manual_seed(8)
    ws = dec.make_workspace(3, H, R, "cpu", num_splits=4, split_min=8)
    for lens in ([5, 40, 17], [64, 0, 9]):
        pc = make_cache(lens, R, DR, 16, torch.float32, gen=g)
        qn, qp = _q(3, torch.float32, g)
        want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.3, return_lse=True)
        _check(dec.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.3,
                              return_lse=True, workspace=ws), want, torch.float32)


def test_decode_fp8_cache():
    g = torch.Generator().manual_seed(9)
    lens = [33, 70]
    pc = make_cache(lens, R, DR, 16, fp8=True, gen=g)
    qn, qp = _q(2, torch.float16, g)
    s = (R + DR) ** -0.5
    for ks in (pc.kv_scale, float(pc.kv_scale)):  # tensor (graph-safe) and Python float scales
        want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=s, kv_scale=ks)
        got = dec.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=s, kv_scale=ks)
        assert_close(got, want)
    unq = dec.mla_decode(qn, qp, pc.values.half(), pc.seq_lens, pc.block_tables, scale=s)
    assert cosine(got, unq) >= 0.999


def test_decode_fp8_cache_queries_at_the_edge_of_fp16():
    """On an fp8 cache the pointer kernel's dots run in fp16 (the GPU converts the tiles with
    cvt.rn.f16x2.e4m3x2), with q divided by a power of two where it would not fit fp16: queries up to
    6e4 (factor 2 here) give the reference's result; so do 64-head blocks, which keep Triton's cast
    and dots in q's own dtype."""
    g = torch.Generator().manual_seed(19)
    lens = [33, 70, 1]
    pc = make_cache(lens, R, DR, 16, fp8=True, gen=g)
    qn, qp = _q(3, torch.float32, g)
    top = torch.maximum(qn.abs().max(), qp.abs().max())
    qn, qp = (qn * 6e4 / top).half(), (qp * 6e4 / top).half()  # scores of ~1 at this scale
    s = 3e-5
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=s, kv_scale=pc.kv_scale,
                          return_lse=True)
    got = dec.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=s, kv_scale=pc.kv_scale,
                         return_lse=True)
    _check(got, want, torch.float16)
    _check(dec.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=s, kv_scale=pc.kv_scale,
                          return_lse=True, config=dict(BLOCK_H=64)), want, torch.float16)
    with pytest.raises(InputError, match="config"):
        dec.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=s, kv_scale=pc.kv_scale,
                       config=dict(FAST=1))


def test_sparse_decode_and_its_errors():
    g = torch.Generator().manual_seed(10)
    lens = [3, 40, 90]
    pc = make_cache(lens, R, DR, 16, torch.float16, gen=g)
    qn, qp = _q(3, torch.float16, g)
    idx = sparse_indices(lens, 24, gen=g)
    want = ref.mla_sparse_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, idx, scale=0.2,
                                 return_lse=True)
    ws = dec.make_workspace(3, H, R, "cpu", num_splits=3, split_min=8)
    got = dec.mla_sparse_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, idx, scale=0.2,
                                return_lse=True, workspace=ws, config=dict(BLOCK_H=16, BLOCK_N=8, num_warps=4, num_stages=1))
    _check(got, want, torch.float16)
    # every position of every sequence = the dense result
    full = torch.full((3, 90), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        full[b, :n] = torch.arange(n, dtype=torch.int32).flip(0)
    dense = dec.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.2)
    assert_close(dec.mla_sparse_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, full, scale=0.2),
                 dense)
    dup = idx.clone()
    dup[2, 0], dup[2, 1] = 11, 11
    with pytest.raises(InputError, match="twice"):
        dec.mla_sparse_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, dup, scale=0.2)
    oob = idx.clone()
    oob[0, 3] = 3  # sequence 0 has 3 tokens: positions 0..2
    with pytest.raises(InputError, match=r"indices\[0, 3\] = 3"):
        dec.mla_sparse_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, oob, scale=0.2)
    with pytest.raises(InputError, match="indices"):
        dec.mla_sparse_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, idx.long(), scale=0.2)


def test_decode_bad_inputs():
    g = torch.Generator().manual_seed(11)
    pc = make_cache([5], R, DR, 16, torch.float32, gen=g)
    qn, qp = _q(1, torch.float16, g)
    with pytest.raises(InputError, match="cache"):  # fp32 cache under fp16 queries
        dec.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.2)
    small = dec.make_workspace(1, 2, R, "cpu", num_splits=2)
    with pytest.raises(InputError, match="workspace"):
        dec.mla_decode(qn, qp, pc.cache.half(), pc.seq_lens, pc.block_tables, scale=0.2, workspace=small)
    with pytest.raises(InputError, match="block_tables"):
        dec.mla_decode(qn, qp, pc.cache.half(), pc.seq_lens, pc.block_tables.long(), scale=0.2)


@pytest.mark.parametrize("dt,chunk", [(torch.float32, None), (torch.float16, 24)])
def test_prefill_matches_reference(dt, chunk):
    g = torch.Generator().manual_seed(12)
    Dn, Dv = 16, 8
    lens, qlens = [7, 40, 16, 1], [7, 19, 1, 1]  # whole prompt, prefix + chunk, decode-like rows
    pc = make_cache(lens, R, DR, 16, dt, gen=g)
    T = sum(qlens)
    qn, qp = torch.randn(T, H, Dn, generator=g).to(dt), torch.randn(T, H, DR, generator=g).to(dt)
    wk = (torch.randn(H, Dn, R, generator=g) / 4).to(dt)
    wv = (torch.randn(H, Dv, R, generator=g) / 4).to(dt)
    cu = torch.tensor([0, 7, 26, 27, 28], dtype=torch.int32)
    for causal in (True, False):
        want = ref.mla_prefill(qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables, scale=0.2,
                               causal=causal, return_lse=True)
        got = pf.mla_prefill(qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables, scale=0.2,
                             causal=causal, return_lse=True, chunk_size=chunk)
        # fp16 K/V are rounded after the expansion GEMM, as in HF's kv_b_proj: 2x the fp16 tolerance
        assert_close(got[0], want[0], scale=2.0 if dt == torch.float16 else 1.0)
        assert_close(got[1], want[1], dtype=dt, what="lse")
    with pytest.raises(InputError, match="seq_lens"):
        pf.mla_prefill(qn, qp, pc.cache, wk, wv, cu, torch.tensor([7, 18, 16, 1], dtype=torch.int32),
                       pc.block_tables, scale=0.2)


@pytest.mark.parametrize("config", [dict(BLOCK_M=32), dict(BLOCK_N=32), dict(BLOCK_M=32, num_stages=2)])
def test_prefill_configs_match_reference(config):
    """Other tiles: queries at 16-row block edges over prefixes, chunk starts inside and past a
    block's diagonal, a one-token and a whole-prompt sequence, causal and not."""
    g = torch.Generator().manual_seed(21)
    Dn, Dv = 16, 16
    lens, qlens = [17, 100, 33, 1], [17, 40, 1, 1]
    pc = make_cache(lens, R, DR, 16, torch.float16, gen=g)
    T = sum(qlens)
    qn, qp = torch.randn(T, H, Dn, generator=g).half(), torch.randn(T, H, DR, generator=g).half()
    wk, wv = (torch.randn(H, Dn, R, generator=g) / 4).half(), (torch.randn(H, Dv, R, generator=g) / 4).half()
    cu = torch.tensor([0, 17, 57, 58, 59], dtype=torch.int32)
    for causal in (True, False):
        want = ref.mla_prefill(qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables, scale=0.2,
                               causal=causal, return_lse=True)
        for chunk in (None, 48):
            got = pf.mla_prefill(qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables, scale=0.2,
                                 causal=causal, return_lse=True, chunk_size=chunk, config=config)
            assert_close(got[0], want[0], scale=2.0)
            assert_close(got[1], want[1], dtype=torch.float16, what="lse")
    with pytest.raises(InputError, match="config"):
        pf.mla_prefill(qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables, scale=0.2,
                       config=dict(SPLIT=1))


def test_prefill_fp8_cache_prefix():
    g = torch.Generator().manual_seed(13)
    Dn, Dv, lens = 16, 16, [50]
    pc = make_cache(lens, R, DR, 16, fp8=True, gen=g)
    qn, qp = torch.randn(10, H, Dn, generator=g).half(), torch.randn(10, H, DR, generator=g).half()
    wk, wv = (torch.randn(H, Dn, R, generator=g) / 6).half(), (torch.randn(H, Dv, R, generator=g) / 6).half()
    cu = torch.tensor([0, 10], dtype=torch.int32)
    args = (qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables)
    want = ref.mla_prefill(*args, scale=0.2, kv_scale=pc.kv_scale)
    assert_close(pf.mla_prefill(*args, scale=0.2, kv_scale=pc.kv_scale, max_q_len=10, max_seq_len=50,
                                chunk_size=32), want, scale=2.0)


@pytest.mark.parametrize("dt", [torch.float16, torch.float8_e4m3fn])
def test_append_matches_reference(dt):
    g = torch.Generator().manual_seed(14)
    ckv, kpe = torch.randn(7, R, generator=g).half(), torch.randn(7, DR, generator=g).half()
    scale = None
    if dt == torch.float8_e4m3fn:
        # values on the fp8 grid times a power-of-two scale: the interpreter's fp32->fp8 rounding
        # is not round-to-nearest-even (the GPU test checks general values); one beyond +-448 clamps
        scale = torch.tensor([0.25])
        ckv = (ckv.float() * 8).to(dt).float().half() * 0.25
        kpe = (kpe.float() * 8).to(dt).float().half() * 0.25
        ckv[0, 0] = 1000.0
    base = torch.randn(4, 16, R + DR, generator=g).to(dt)
    c_ref, c_tri = base.clone(), base.clone()
    slots = torch.tensor([0, 63, -1, 5, 17, 18, 40], dtype=torch.int32)
    ref.append_mla(ckv, kpe, c_ref, slots, scale)
    ap.append_mla(ckv, kpe, c_tri, slots, scale)
    assert torch.equal(c_ref.float(), c_tri.float())
    with pytest.raises(InputError, match="slot_mapping"):
        ap.append_mla(ckv, kpe, c_tri, slots + 64, scale)
    with pytest.raises(InputError, match="kpe"):
        ap.append_mla(ckv, kpe[:3], c_tri, slots, scale)


def test_custom_ops_opcheck():
    import opmap  # noqa: F401  (registers torch.ops.opmap.*)

    g = torch.Generator().manual_seed(15)
    r, dr, h = 16, 16, 2
    pc = make_cache([3, 17], r, dr, 16, torch.float32, gen=g)
    qn, qp = torch.randn(2, h, r, generator=g), torch.randn(2, h, dr, generator=g)
    torch.library.opcheck(torch.ops.opmap.mla_decode.default,
                          (qn, qp, pc.cache, pc.seq_lens, pc.block_tables, 0.3))
    idx = sparse_indices([3, 17], 4, gen=g)
    torch.library.opcheck(torch.ops.opmap.mla_sparse_decode.default,
                          (qn, qp, pc.cache, pc.seq_lens, pc.block_tables, idx, 0.3))
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    wk, wv = torch.randn(h, 16, r, generator=g), torch.randn(h, 16, r, generator=g)
    qn3, qp3 = torch.randn(3, h, 16, generator=g), torch.randn(3, h, dr, generator=g)
    torch.library.opcheck(torch.ops.opmap.mla_prefill.default,
                          (qn3, qp3, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables, 0.3))
    torch.library.opcheck(torch.ops.opmap.append_mla.default,
                          (torch.randn(2, r), torch.randn(2, dr), pc.cache.clone(),
                           torch.tensor([4, -1], dtype=torch.int32)))


def test_append_scale_keyword_alias():
    """docs/OPS_API.md names the fp8 scale of append_mla ``scale``; both names work, not both at once."""
    g = torch.Generator().manual_seed(16)
    ckv = ((torch.randn(3, R, generator=g) * 4).to(torch.float8_e4m3fn).float() / 4).half()
    kpe = ((torch.randn(3, DR, generator=g) * 4).to(torch.float8_e4m3fn).float() / 4).half()
    slots = torch.tensor([1, 2, 3], dtype=torch.int32)
    a = torch.zeros(2, 4, R + DR, dtype=torch.float8_e4m3fn)
    b = a.clone()
    s = torch.tensor([0.25])
    ap.append_mla(ckv, kpe, a, slots, scale=s)
    ref.append_mla(ckv, kpe, b, slots, kv_scale=s)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    with pytest.raises(InputError, match="scale"):
        ap.append_mla(ckv, kpe, a, slots, s, scale=s)


def test_prefill_padded_step_with_bucket_hints():
    """The engine's padded MLA prefill step (runner.prefill_bucket): one prompt, then a padding
    sequence up to the token bucket, with the bucket as both length hints (the fixed plan of its
    CUDA graph): the prompt's rows are those of the unpadded call."""
    g = torch.Generator().manual_seed(23)
    Dn, Dv = 16, 16
    pc = make_cache([37, 27], R, DR, 16, torch.float16, gen=g)  # a 37-token prompt, padding to 64
    qn, qp = torch.randn(64, H, Dn, generator=g).half(), torch.randn(64, H, DR, generator=g).half()
    wk, wv = (torch.randn(H, Dn, R, generator=g) / 4).half(), (torch.randn(H, Dv, R, generator=g) / 4).half()
    cu = torch.tensor([0, 37, 64], dtype=torch.int32)
    got = pf.mla_prefill(qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables, scale=0.2, max_q_len=64,
                         max_seq_len=64)
    want = ref.mla_prefill(qn[:37], qp[:37], pc.cache, wk, wv, cu[:2], pc.seq_lens[:1], pc.block_tables[:1],
                           scale=0.2)
    assert_close(got[:37], want, scale=2.0)


def test_prefill_empty_sequence_with_padding_table_row():
    """A sequence with no new tokens and no pages may carry -1 padding in its table row."""
    g = torch.Generator().manual_seed(17)
    pc = make_cache([20, 0], R, DR, 16, torch.float32, gen=g)
    tables = pc.block_tables.clone()
    tables[1] = -1
    qn, qp = torch.randn(4, H, 8, generator=g), torch.randn(4, H, DR, generator=g)
    wk, wv = torch.randn(H, 8, R, generator=g) / 4, torch.randn(H, 8, R, generator=g) / 4
    cu = torch.tensor([0, 4, 4], dtype=torch.int32)
    args = (qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, tables)
    assert_close(pf.mla_prefill(*args, scale=0.2), ref.mla_prefill(*args, scale=0.2))


def test_decode_configs_and_split_plans_follow_the_h200_grid(monkeypatch):
    """The TMA kernel (mla-tma): 64-head blocks from 64 heads, below 64 16-head blocks with 32-token
    tiles at three stages, two programs per SM; the pointer kernel (mla-triton): 64-head blocks only
    at batch >= 64; each backend's workspace plans its own kernel's wave, so B=64 x 128 heads on the
    TMA kernel does not split."""
    monkeypatch.setattr(common, "sm_count", lambda device: 132)
    tma128, tma16 = tma.default_config(128), tma.default_config(16)
    assert tma128 == dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=3) and tma.per_sm(tma128) == 1
    assert tma16 == dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=3) and tma.per_sm(tma16) == 2
    assert tma.per_sm(dict(tma16, num_stages=4)) == 1 and tma.per_sm(dict(tma16, num_stages=2)) == 2
    assert tma.per_sm(dict(tma16, BLOCK_N=64, num_stages=2)) == 1
    assert dec.default_config(128, 512, 64) == dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1)
    assert dec.default_config(128, 512, 16) == dec.default_config(16, 512, 128) == dict(
        BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2)
    assert common.plan_splits(64, 128, "cuda", 64, 8) == 1 and common.plan_splits(64, 128, "cuda", 64, 4) == 2
    assert common.plan_splits(1, 16, "cuda") == 128 and common.plan_splits(16, 128, "cuda") == 2
    assert tma.make_workspace(64, 128, 512, "cpu").num_splits == 1
    assert tma.make_workspace(64, 16, 512, "cpu", config=dict(BLOCK_N=64, num_stages=2)).num_splits == 2
    assert dec.make_workspace(64, 16, 512, "cpu").num_splits == 4  # 4-warp programs, two an SM
    assert dec.make_workspace(64, 128, 512, "cpu").num_splits == 1  # 64-head blocks on 8 warps
    with pytest.raises(InputError, match="config"):
        tma.make_workspace(4, 16, 512, "cpu", config=dict(TMA=1))  # no kernel switch in a config
    # The merge: whole latent rows at B=64 x 16 heads (1024 programs), blocks of 128 at B=1.
    assert common.merge_block_r(64, 16, 512, "cuda") == 512 and common.merge_block_r(1, 16, 512, "cuda") == 128


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("whole_rows", [False, True])
def test_split_merge_many_splits(sparse, whole_rows, monkeypatch):
    """The merge launch with a split count that is not a power of two (37, in tiles of splits) and
    the real rank 512, in 4 blocks of 128 per head or whole rows (the tile a large batch gets):
    equal to the reference, a length-0 sequence zero with LSE -inf, one whose plan uses a single
    split, and two launches bitwise equal."""
    monkeypatch.setattr(common, "merge_block_r", lambda B, H, R, device: 512 if whole_rows else 128)
    g = torch.Generator().manual_seed(21)
    lens = [0, 5, 40, 900]
    pc = make_cache(lens, 512, 64, 16, torch.float16, gen=g)
    qn, qp = _q(len(lens), torch.float16, g, h=4, r=512, dr=64)
    idx = sparse_indices(lens, 300, gen=g) if sparse else None
    ws = dec.make_workspace(len(lens), 4, 512, "cpu", num_splits=37, split_min=8)
    if sparse:
        run = lambda: dec.mla_sparse_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, idx, scale=0.05,  # noqa: E731
                                            return_lse=True, workspace=ws)
        want = ref.mla_sparse_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, idx, scale=0.05, return_lse=True)
    else:
        run = lambda: dec.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.05,  # noqa: E731
                                     return_lse=True, workspace=ws)
        want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.05, return_lse=True)
    a, b = run(), run()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    _check(a, want, torch.float16)
    assert torch.all(a[0][0] == 0) and torch.isinf(a[1][0]).all()


def _poison_past_lengths(pc, page):
    """NaN in every cache row past a sequence's length in its last page: a kernel that reads a
    tile's rows beyond the length without masking them turns the output into NaN."""
    for b, n in enumerate(pc.seq_lens.tolist()):
        if n % page:
            pc.cache[int(pc.block_tables[b, n // page]), n % page:] = float("nan")


@pytest.mark.parametrize("bh", [4, 64], ids=["keys-rows", "heads-rows"])
@pytest.mark.parametrize("page,splits,bn", [(16, 1, 16), (16, 3, 16), (64, 2, 32), (32, 4, 16), (64, 3, 64)])
def test_tma_decode_matches_reference(page, splits, bn, bh):
    """The TMA kernel (mla-tma): the latent tiles through tensor descriptors, the partial last tile
    of each split read so that it ends at the length; lengths around the page and tile edges,
    shuffled pages; both dot layouts (keys as rows below 64 heads per block); the pointer kernel
    (mla-triton) on the same inputs."""
    g = torch.Generator().manual_seed(40 + page + splits)
    lens = [0, 1, bn - 1, bn, bn + 1, page - 1, page, page + 1, 3 * page + 5]
    pc = make_cache(lens, R, DR, page, torch.float16, gen=g)
    _poison_past_lengths(pc, page)
    qn, qp = _q(len(lens), torch.float16, g)
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.2, return_lse=True)
    ws = dec.make_workspace(len(lens), H, R, "cpu", num_splits=splits, split_min=bn)
    got = tma.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.2, return_lse=True,
                         workspace=ws, config=dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=4, num_stages=2))
    _check(got, want, torch.float16)
    assert torch.all(got[0][0] == 0) and torch.all(torch.isinf(got[1][0]))  # length 0
    plain = dec.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.2, return_lse=True,
                           workspace=ws, config=dict(BLOCK_H=16, BLOCK_N=bn, num_warps=4, num_stages=2))
    assert_close(got[0], plain[0], dtype=torch.float16, what="tma vs pointer kernel")


@pytest.mark.parametrize("bh", [4, 64], ids=["keys-rows", "heads-rows"])
@pytest.mark.parametrize("page,splits,bn,tensor_scale", [(16, 1, 16, True), (64, 3, 32, False), (32, 2, 16, True)])
def test_tma_decode_fp8_cache(page, splits, bn, tensor_scale, bh):
    """The TMA kernel on an fp8 cache: e4m3 tiles through the descriptors, converted before the dots,
    the cache scale (a [1] tensor or a float) on the scores and the output; rows past a length hold
    NaN and are never read."""
    g = torch.Generator().manual_seed(60 + page + splits)
    lens = [0, 1, bn - 1, bn + 1, page, page + 1, 2 * page + 7]
    pc = make_cache(lens, R, DR, page, fp8=True, gen=g)
    _poison_past_lengths(pc, page)
    qn, qp = _q(len(lens), torch.float16, g)
    ks = pc.kv_scale if tensor_scale else float(pc.kv_scale)
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.2, kv_scale=ks, return_lse=True)
    ws = dec.make_workspace(len(lens), H, R, "cpu", num_splits=splits, split_min=bn)
    got = tma.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.2, kv_scale=ks, return_lse=True,
                         workspace=ws, config=dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=4, num_stages=2))
    _check(got, want, torch.float16)
    assert torch.all(got[0][0] == 0) and torch.all(torch.isinf(got[1][0]))  # length 0


@pytest.mark.parametrize("cfg", [dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2),
                                 dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2)], ids=["keys-rows", "heads-rows"])
def test_tma_decode_real_rank_two_halves(cfg):
    """R = 512 is read as two 256-wide TMA boxes with an accumulator each."""
    g = torch.Generator().manual_seed(44)
    lens = [1, 63, 64, 200]
    pc = make_cache(lens, 512, 64, 64, torch.float16, gen=g)
    _poison_past_lengths(pc, 64)
    qn, qp = _q(len(lens), torch.float16, g, h=16, r=512, dr=64)
    s = 576 ** -0.5
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=s, return_lse=True)
    ws = dec.make_workspace(len(lens), 16, 512, "cpu", num_splits=2, split_min=32)
    _check(tma.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=s, return_lse=True,
                          workspace=ws, config=cfg), want, torch.float16)


def test_tma_decode_refuses_what_it_cannot_read():
    """What the mla-tma backend declares its entry checks again on the tensors: an InputError naming
    the argument, never the pointer kernel in its place; sparse decode is not its entry."""
    g = torch.Generator().manual_seed(45)
    pc = make_cache([20, 9], R, DR, 16, torch.float16, gen=g)
    qn, qp = _q(2, torch.float16, g)
    args = (qn, qp, pc.cache, pc.seq_lens, pc.block_tables)
    with pytest.raises(InputError, match="cache.*page size 16 is not a multiple of BLOCK_N 32"):
        tma.mla_decode(*args, scale=0.2)
    with pytest.raises(InputError, match="config.*page size 16 is not a multiple of BLOCK_N 32"):
        tma.mla_decode(*args, scale=0.2, config=dict(BLOCK_N=32))
    assert "mla_sparse_decode" not in registry.get("attention", "mla-tma").impl
    with pytest.raises(InputError, match="config"):
        tma.mla_decode(*args, scale=0.2, config=(4, 16, 4, 2))  # the config is a dict
    with pytest.raises(InputError, match="config"):
        tma.mla_decode(*args, scale=0.2, config=dict(BLOCK_N=48))
    with pytest.raises(InputError, match="config"):
        tma.mla_decode(*args, scale=0.2, config=dict(TMA=0))  # the kernel is the backend, not a key
    big = make_cache([20, 9], R, DR, 64, torch.float16, gen=g)
    with pytest.raises(InputError, match="config.*page size 64 is not a multiple of BLOCK_N 128"):
        tma.mla_decode(qn, qp, big.cache, big.seq_lens, big.block_tables, scale=0.2, config=dict(BLOCK_N=128))
    f32 = make_cache([20, 9], R, DR, 64, torch.float32, gen=g)
    with pytest.raises(InputError, match="q_nope.*bf16/fp16"):
        tma.mla_decode(qn.float(), qp.float(), f32.cache, f32.seq_lens, f32.block_tables, scale=0.2)
    with pytest.raises(InputError, match="config"):
        dec.mla_decode(qn, qp, big.cache, big.seq_lens, big.block_tables, scale=0.2, config=dict(TMA=1))


MLA_SPEC = dict(arch="sm90", kind="mla", num_kv_heads=1, dtype="fp16", cuda_graph=True)


@pytest.mark.parametrize("h", [16, 64])
def test_selection_gives_each_kernel_its_specs(h):
    """On sm90 the selector names the kernel that runs: the TMA kernel (mla-tma) on pages of 64 for a
    16-bit cache, and for an fp8 one from 64 heads only; the Gluon kernel (mla-gluon-fp8) for fp8 at
    DeepSeek's dims; the pointer kernel (mla-triton) on other pages, for sparse decode, for fp8 below
    64 heads at other dims; the rejected ones say why. Each CPU-runnable kernel gives the
    reference's result on such a spec's inputs."""
    g = torch.Generator().manual_seed(46)
    lens = [1, 31, 33, 70]
    qn, qp = _q(len(lens), torch.float16, g, h=h)
    for page, fp8, sparse, want_backend, why_not in [
            (64, False, False, "mla-tma", None), (16, False, False, "mla-triton", "page_size=16"),
            (64, True, False, "mla-tma" if h >= 64 else "mla-triton", None),
            (64, False, True, "mla-triton", "sparse"), (32, False, False, "mla-triton", "page_size=32")]:
        spec = AttentionSpec(num_heads=h, head_dim=R + DR, head_dim_v=R, page_size=page,
                             kv_dtype="fp8" if fp8 else "fp16", sparse=sparse, **MLA_SPEC)
        ch = select.select("attention", spec, runtime=False)
        assert ch.name == want_backend, ch.explain()
        tma_row = next(c for c in ch.trace if c.name == "mla-tma")
        if why_not:
            assert any(why_not in r for r in tma_row.reasons), tma_row
        gluon = next(c for c in ch.trace if c.name == "mla-gluon-fp8")
        assert gluon.reasons  # R = 32, Dr = 16 (and a 16-bit cache where not fp8)
        pc = make_cache(lens, R, DR, page, torch.float16, fp8=fp8, gen=g)
        kw = dict(scale=0.2, return_lse=True, kv_scale=pc.kv_scale if fp8 else None)
        b = registry.get("attention", want_backend)
        if sparse:
            idx = sparse_indices(lens, 16, gen=g)
            got = b("mla_sparse_decode", qn, qp, pc.cache, pc.seq_lens, pc.block_tables, idx, **kw)
            want = ref.mla_sparse_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, idx, **kw)
        else:
            got = b("mla_decode", qn, qp, pc.cache, pc.seq_lens, pc.block_tables, **kw)
            want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, **kw)
        _check(got, want, torch.float16)
    real = AttentionSpec(num_heads=h, head_dim=576, head_dim_v=512, page_size=64, kv_dtype="fp8", **MLA_SPEC)
    assert select.select("attention", real, runtime=False).name == "mla-gluon-fp8"
    assert select.select("attention", real.replace(kv_dtype="fp16"), runtime=False).name == "mla-tma"
    assert select.select("attention", real.replace(dtype="fp32", kv_dtype="fp8"), runtime=False).name == "mla-triton"


def test_fp8_gluon_kernel_refuses_what_it_cannot_serve_and_plans_its_splits(monkeypatch):
    """The Gluon fp8 decode (decode_fp8.py, mla-gluon-fp8) serves dense decode of an fp8 cache at
    R = 512, Dr = 64 with 16-bit queries on a compiled sm89+ GPU: anything else is an InputError
    naming the argument (another kernel is another backend). Its workspace plans its own 16-head
    programs, two an SM."""
    from opmap.kernels.mla import decode_fp8 as G

    monkeypatch.setattr(common, "sm_count", lambda device: 132)  # the H200's, whatever the device
    f8 = torch.float8_e4m3fn
    qn, qp, cache = torch.empty(2, 16, 512), torch.empty(2, 16, 64), torch.empty(4, 64, 576).to(f8)
    bf = dict(q_nope=qn.bfloat16(), q_pe=qp.bfloat16())
    for kw, arg, what in [(dict(bf, cache=cache.bfloat16()), "cache", "float8_e4m3fn"),
                          (dict(q_nope=qn, q_pe=qp, cache=cache), "q_nope", "float16 or bfloat16"),
                          (dict(q_nope=bf["q_nope"][..., :256], q_pe=bf["q_pe"], cache=cache[..., :320]), "cache",
                           "R = 512, Dr = 64"),
                          (dict(bf, cache=cache), "q_nope", "sm89 or newer")]:  # no CUDA device here
        with pytest.raises(InputError, match=what) as e:
            G.check_inputs(**kw)
        assert e.value.arg == arg
    assert G.make_workspace(64, 16, 512, "cpu").num_splits == 2 * 132 // 64  # 16-head programs, two an SM
    assert G.make_workspace(64, 128, 512, "cpu").num_splits == max(1, 2 * 132 // (64 * 8))
    with pytest.raises(InputError, match="config"):
        G.make_workspace(64, 16, 512, "cpu", config=dict(BLOCK_N=32))  # its tiles are fixed
    assert set(registry.get("attention", "mla-gluon-fp8").impl) == {"mla_decode", "make_workspace"}
