"""Triton prefill / decode / mixed against the fp32 reference, in the interpreter (fp16/fp32).

Each case is one point of the issue's grid (batch {1, 3, 17}; KV length {1, page-1, page,
page+1, 300}; a sequence with no new query tokens inside a varlen batch; page size {1, 16};
heads 8/8, 8/2, 8/1; head dim 64 and 128; shuffled and shared pages in a cache of many pages;
window, soft-cap, split-KV and fp8 KV on and off), chosen so that every value appears without
running the full product in the interpreter.
"""
import pytest
import torch

from opmap.kernels.attention import decode as D
from opmap.kernels.attention import prefill as P
from opmap.ops.attention import reference as R
from opmap.kernels.attention.mixed import mixed
from opmap.harness.fixtures.attention import make_paged, make_query
from opmap.core.tolerance import assert_close, cosine

F16, F32 = torch.float16, torch.float32


def _ref(fn, q, pc, *args, **kw):
    """The reference on fp32 copies of the inputs (fp8 caches stay fp8: the reference dequantises)."""
    kc, vc = pc.k_cache, pc.v_cache
    if kc.dtype != torch.float8_e4m3fn:
        kc, vc = kc.float(), vc.float()
    return fn(q.float(), kc, vc, *args, **kw)


def _check(out, lse, ref, ref_lse, dtype, fp8):
    # fp16 runs cast the softmax weights to fp16 for the PV product; fp8 adds its own rounding of
    # the fp16 query-side product (the cache values themselves are exact in both).
    scale = 1.0 if dtype == F32 else (4.0 if fp8 else 2.0)
    assert_close(out, ref, dtype, scale=scale)
    assert cosine(out, ref) >= 0.9999, "cosine"  # small outputs can hide under the absolute bound
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "LSE -inf pattern"
    assert_close(lse[fin], ref_lse[fin], F32, scale=100.0 if dtype == F16 else 10.0, what="lse")


DECODE = [
    # id, seq_lens, page, heads, kv_heads, head_dim, dtype, window, soft_cap, fp8, workspace
    ("b1-300-split", [300], 16, 8, 2, 64, F16, None, None, False, dict(min_chunk=16)),
    ("b3-page-edges-mha", [15, 16, 17], 16, 8, 8, 128, F32, None, None, False, dict(max_splits=1)),
    ("b17-mqa-window-split", [1, 0, 300, 15, 16, 17, 2, 31, 33, 64, 100, 1, 5, 250, 7, 0, 48], 16, 8, 1, 64,
     F16, 20, None, False, dict(min_chunk=32)),
    ("b3-page1-cap-fp8", [1, 5, 300], 1, 8, 2, 64, F16, None, 30.0, True, dict(min_chunk=64)),
    ("b3-d128-fp8-split-window", [300, 17, 1], 16, 8, 2, 128, F16, 50, None, True, dict(min_chunk=16)),
    ("b3-d16-tiny-preset", [33, 1, 16], 16, 4, 2, 16, F16, None, None, False, dict(min_chunk=16)),
    ("b3-no-workspace-group6", [300, 0, 16], 16, 6, 1, 64, F32, None, 10.0, False, None),
    # 383 keys in 24 splits of 16 (min_chunk 16, up to the workspace's 32)
    ("b1-24-splits", [383], 16, 8, 1, 64, F16, None, None, False, dict(min_chunk=16)),
]


@pytest.mark.parametrize("case", DECODE, ids=[c[0] for c in DECODE])
def test_decode(case):
    _, seq, page, hq, hk, d, dt, win, cap, fp8, ws = case
    pc = make_paged(seq, hk, d, page, dtype=dt, fp8=fp8, shared=True, poison=True)
    q, _ = make_query([1] * len(seq), hq, d, dtype=dt)
    w = D.make_workspace(len(seq), hq, d, device="cpu", **ws) if ws is not None else None
    out, lse = D.decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=d ** -0.5, window=win,
                        soft_cap=cap, return_lse=True, workspace=w, **pc.kw)
    ref, ref_lse = _ref(R.decode, q, pc, pc.seq_lens, pc.block_tables, scale=d ** -0.5, window=win,
                        soft_cap=cap, return_lse=True, **pc.kw)
    _check(out, lse, ref, ref_lse, dt, fp8)
    assert torch.all(out[pc.seq_lens == 0] == 0)


@pytest.mark.parametrize("cap", [None, 30.0])
def test_decode_fp8_cache_queries_at_the_edge_of_fp16(cap):
    """On fp8 caches the decode's dots run in fp16 (the GPU converts the tiles with
    cvt.rn.f16x2.e4m3x2; kernels/attention/fp8.py), q divided by a power of two where it would not fit
    fp16: queries up to 6e4 (factor 2 here) give the reference's result, with and without a soft
    cap."""
    seq = [300, 17, 1]
    pc = make_paged(seq, 2, 64, 16, dtype=F16, fp8=True, shared=True, poison=True)
    q, _ = make_query([1] * 3, 8, 64, dtype=F32)
    q = (q * 6e4 / q.abs().max()).half()
    s = 64 ** -0.5 / 2e4  # scores as at unit queries
    w = D.make_workspace(3, 8, 64, device="cpu", min_chunk=16)
    ref, ref_lse = _ref(R.decode, q, pc, pc.seq_lens, pc.block_tables, scale=s, soft_cap=cap, return_lse=True,
                        **pc.kw)
    out, lse = D.decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=s, soft_cap=cap,
                        return_lse=True, workspace=w, **pc.kw)
    _check(out, lse, ref, ref_lse, F16, True)


def test_decode_fixed_split_is_batch_invariant():
    """Rows of a sub-batch are bitwise equal to the same rows run inside a larger batch."""
    seq = [300, 17, 0, 64, 129]
    pc = make_paged(seq, 2, 64, 16, dtype=F16, shared=True)
    q, _ = make_query([1] * 5, 8, 64, dtype=F16)
    kw = dict(device="cpu", batch_invariant=True, split_tokens=64, max_seq_len=pc.block_tables.shape[1] * 16)
    full = D.decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.125,
                    workspace=D.make_workspace(5, 8, 64, **kw))
    sub = [3, 0]
    part = D.decode(q[sub], pc.k_cache, pc.v_cache, pc.seq_lens[sub], pc.block_tables[sub], scale=0.125,
                    workspace=D.make_workspace(2, 8, 64, **kw))
    assert torch.equal(part, full[sub])
    ref = _ref(R.decode, q, pc, pc.seq_lens, pc.block_tables, scale=0.125)
    assert_close(full, ref, F16, scale=2.0)


@pytest.mark.parametrize("split_tokens,window", [(16, None), (48, None), (16, 100)])
def test_combine_many_splits(split_tokens, window):
    """_combine_kernel at many splits, a count that is no power of two (up to 38 here, in tiles of
    splits), with a window and lengths at the split edges: equal to the reference, LSE too, and
    the same bits on a second launch and for a sub-batch (fixed splits are batch invariant)."""
    seq = [600, 17, 0, 64, 129, 48, 1]
    pc = make_paged(seq, 2, 64, 16, dtype=F16, shared=True, poison=True)
    q, _ = make_query([1] * len(seq), 8, 64, dtype=F16)
    kw = dict(device="cpu", split_tokens=split_tokens, max_seq_len=pc.block_tables.shape[1] * 16)
    run = lambda idx: D.decode(q[idx], pc.k_cache, pc.v_cache, pc.seq_lens[idx], pc.block_tables[idx],  # noqa: E731
                               scale=0.125, window=window, return_lse=True,
                               workspace=D.make_workspace(len(idx), 8, 64, **kw))
    every = list(range(len(seq)))
    out, lse = run(every)
    again = run(every)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
    sub = [3, 0, 4]
    part = run(sub)
    assert torch.equal(part[0], out[sub]) and torch.equal(part[1], lse[sub])
    ref, ref_lse = _ref(R.decode, q, pc, pc.seq_lens, pc.block_tables, scale=0.125, window=window, return_lse=True)
    _check(out, lse, ref, ref_lse, F16, False)


PREFILL = [
    # id, seq_lens, q_lens, page, heads, kv_heads, head_dim, dtype, causal, window, soft_cap, fp8
    ("b1-300-chunk", [300], [100], 16, 8, 2, 64, F16, True, None, None, False),
    ("b3-chunked-zero-q-mha", [15, 16, 17], [5, 0, 17], 16, 8, 8, 128, F32, True, None, None, False),
    ("b17-mqa-mixed-lens", [1, 16, 40, 15, 17, 3, 33, 2, 9, 20, 1, 6, 12, 18, 7, 4, 30],
     [1, 3, 0, 15, 1, 3, 2, 2, 9, 1, 1, 0, 5, 18, 7, 1, 4], 16, 8, 1, 64, F16, True, 6, None, False),
    ("b3-page1-cap-fp8", [1, 40, 21], [1, 20, 21], 1, 8, 2, 64, F16, True, None, 20.0, True),
    ("b3-d128-fp8-window", [70, 17, 33], [70, 3, 10], 16, 8, 2, 128, F16, True, 25, None, True),
    ("b2-d32", [40, 9], [12, 9], 16, 4, 2, 32, F16, True, None, None, False),
    ("b3-noncausal-group3", [20, 33, 5], [20, 1, 4], 16, 6, 2, 64, F32, False, None, None, False),
]


@pytest.mark.parametrize("case", PREFILL, ids=[c[0] for c in PREFILL])
def test_prefill(case):
    _, seq, ql, page, hq, hk, d, dt, causal, win, cap, fp8 = case
    pc = make_paged(seq, hk, d, page, dtype=dt, fp8=fp8, shared=True, poison=True)
    q, cu = make_query(ql, hq, d, dtype=dt)
    out, lse = P.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, scale=d ** -0.5,
                         causal=causal, window=win, soft_cap=cap, return_lse=True, **pc.kw)
    ref, ref_lse = _ref(R.prefill, q, pc, cu, pc.seq_lens, pc.block_tables, scale=d ** -0.5, causal=causal,
                        window=win, soft_cap=cap, return_lse=True, **pc.kw)
    _check(out, lse, ref, ref_lse, dt, fp8)
    if len(seq) == 3:  # without return_lse the same kernel runs without the LSE store
        plain = P.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, scale=d ** -0.5,
                          causal=causal, window=win, soft_cap=cap, **pc.kw)
        assert torch.equal(plain, out)


MIXED = [
    # id, seq_lens, q_lens, dtype, window, soft_cap, fp8, workspace
    ("fp16", [40, 17, 1, 300, 16], [8, 1, 1, 1, 0], F16, None, None, False, None),
    ("split-window-cap-fp8", [300, 33, 200, 5], [1, 9, 1, 5], F16, 50, 20.0, True, dict(min_chunk=16)),
]


@pytest.mark.parametrize("case", MIXED, ids=[c[0] for c in MIXED])
def test_mixed_batch(case):
    """A chunked-prefill step: prefill chunks (prefill kernel) and decode tokens (split-KV decode
    kernel, rows found through cu_seqlens) in one varlen batch, a one-token prompt and a sequence
    with no new token included."""
    _, seq, ql, dt, win, cap, fp8, ws = case
    pc = make_paged(seq, 2, 64, 16, dtype=dt, fp8=fp8, shared=True, poison=True)
    q, cu = make_query(ql, 8, 64, dtype=dt)
    w = D.make_workspace(len(seq), 8, 64, device="cpu", **ws) if ws else None
    kw = dict(scale=0.125, window=win, soft_cap=cap, return_lse=True, **pc.kw)
    out, lse = mixed(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, workspace=w, **kw)
    ref, ref_lse = _ref(R.mixed, q, pc, cu, pc.seq_lens, pc.block_tables, **kw)
    _check(out, lse, ref, ref_lse, dt, fp8)


def test_prefill_is_batch_invariant():
    """A sequence's prefill rows do not depend on the other sequences of the batch (bitwise)."""
    seq, ql = [40, 17, 33], [12, 17, 5]
    pc = make_paged(seq, 2, 64, 16, dtype=F16, shared=True)
    q, cu = make_query(ql, 8, 64, dtype=F16)
    full = P.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, scale=0.125)
    one = P.prefill(q[12:29], pc.k_cache, pc.v_cache, torch.tensor([0, 17], dtype=torch.int32), pc.seq_lens[1:2],
                    pc.block_tables[1:2], scale=0.125)
    assert torch.equal(one, full[12:29])


@pytest.mark.parametrize("win,cap", [(None, None), (50, 30.0)])
def test_page_prefetch_changes_nothing(win, cap):
    """PREFETCH=1 (page ids loaded one key tile ahead, the default) and PREFETCH=0 (loaded in the
    tile's own iteration) compute the same thing in the same order: bitwise equal outputs, over
    tiles that cross pages, both prefill loops (unmasked and masked tiles) and split-KV decode."""
    from opmap.kernels.attention import prefill as Pf

    seq = [300, 17, 1, 64, 129]
    pc = make_paged(seq, 2, 64, 16, dtype=F16, shared=True, poison=True)
    kw = dict(scale=0.125, window=win, soft_cap=cap, return_lse=True, **pc.kw)
    q, cu = make_query([40, 17, 1, 0, 129], 8, 64, dtype=F16)
    runs = [Pf.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, causal=True,
                       config=dict(PREFETCH=p), **kw) for p in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    qd, _ = make_query([1] * len(seq), 8, 64, dtype=F16)
    ws = D.make_workspace(len(seq), 8, 64, device="cpu", min_chunk=32)
    runs = [D.decode(qd, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, workspace=ws,
                     config=dict(PREFETCH=p), **kw) for p in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    ref = _ref(R.decode, qd, pc, pc.seq_lens, pc.block_tables, **kw)
    _check(runs[1][0], runs[1][1], ref[0], ref[1], F16, False)


# NaN and inf queries on purpose: the interpreter's NumPy warns on the rows they reach
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_decode_fp8_cache_non_finite_query_stays_in_its_head():
    """The fp16 path's query factor comes from finite magnitudes only: an inf or NaN in one head's
    query makes that head's output non-finite, as in the reference, and leaves the other heads of
    its program (the same KV head) equal to the reference."""
    seq = [300, 17]
    pc = make_paged(seq, 2, 64, 16, dtype=F16, fp8=True, shared=True, poison=True)
    q, _ = make_query([1] * 2, 8, 64, dtype=F16)
    q[0, 1, 3], q[1, 4, 0] = float("nan"), float("inf")
    w = D.make_workspace(2, 8, 64, device="cpu", min_chunk=16)
    out = D.decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.125, workspace=w, **pc.kw)
    ref = _ref(R.decode, q, pc, pc.seq_lens, pc.block_tables, scale=0.125, **pc.kw)
    bad = torch.zeros(2, 8, dtype=torch.bool)
    bad[0, 1] = bad[1, 4] = True
    assert not torch.isfinite(out[bad]).all(), "the non-finite heads"
    assert_close(out[~bad], ref[~bad], F16, scale=4.0)


def test_fp16_dots_only_for_fp8_caches_and_16_bit_queries():
    """Which decodes take the fp16-dot path (kernels/attention/fp8.py): fp8 caches with fp16 or bf16
    queries, unless the config turns it off; fp32 queries keep their IEEE dots."""
    from opmap.kernels.attention.fp8 import fp16_dots

    f8 = torch.float8_e4m3fn
    assert fp16_dots(f8, torch.bfloat16) and fp16_dots(f8, torch.float16)
    assert not fp16_dots(f8, torch.float32) and not fp16_dots(f8, torch.bfloat16, enabled=False)
    assert not fp16_dots(torch.bfloat16, torch.bfloat16) and not fp16_dots(torch.float16, torch.float16)


def test_gluon_fp8_decode_refuses_what_it_cannot_serve():
    """decode_fp8 (the gluon-fp8 backend) checks on the tensors what its backend declares, and a call
    it cannot serve is an InputError naming the argument (never another kernel): a 16-bit cache,
    another head dim, fp32 queries, 17 query heads per KV head, cache rows not 16-byte aligned,
    then (everything else right) a device that cannot run Gluon (this CPU, the interpreter)."""
    from opmap.core.contract import InputError
    from opmap.kernels.attention import decode_fp8 as F

    fp8 = torch.float8_e4m3fn
    kc = torch.zeros(4, 16, 8, 128, dtype=fp8)
    q = torch.zeros(2, 32, 128, dtype=torch.float16)
    strided = torch.zeros(4, 16, 8, 136, dtype=fp8)[..., :128]  # 136-byte rows: not 16-byte aligned
    for args, arg, what in [((q, kc.half(), kc.half()), "k_cache", "float8_e4m3fn"),
                            ((q[..., :64], kc[..., :64], kc[..., :64]), "q", "128"),
                            ((q.float(), kc, kc), "q", "float16 or bfloat16"),
                            ((torch.zeros(2, 136, 128, dtype=torch.float16), kc, kc), "q", "at most 16"),
                            ((q, strided, strided), "k_cache", "16-byte aligned"),
                            ((q, kc, kc), "q", "sm89 or newer")]:
        with pytest.raises(InputError, match=what) as e:
            F.check_inputs(*args)
        assert e.value.arg == arg
    pc = make_paged([40, 3], 8, 128, 16, fp8=True)
    qd, _ = make_query([1, 1], 32, 128, dtype=F16)
    with pytest.raises(InputError, match="sm89 or newer"):  # the entry too, before any launch
        F.decode(qd, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.1, **pc.kw)
    with pytest.raises(InputError, match="config"):  # its tiles are fixed: config= takes no key
        F.decode(qd, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.1, config=dict(BLOCK_N=32),
                 **pc.kw)


@pytest.mark.parametrize("case", [c for c in PREFILL if c[-1]], ids=[c[0] for c in PREFILL if c[-1]])
def test_fp8_prefill_converted_once(case, monkeypatch):
    """An fp8 prefill with many query rows a sequence converts the pages its block tables name once
    (times the per-KV-head scales, into q's dtype) and runs the 16-bit kernel on them: the
    reference's result, windows, caps and NaN past the lengths included. The row threshold is
    lowered here so that the small cases take that path; the scratch cap and fp32 queries keep the
    in-kernel conversion."""
    _, seq, ql, page, hq, hk, d, dt, causal, win, cap, fp8 = case
    monkeypatch.setattr(P, "CONVERT_MIN_ROWS", 1)
    calls = []
    real = P._converted
    monkeypatch.setattr(P, "_converted", lambda *a: calls.append(a[0].shape) or real(*a))
    pc = make_paged(seq, hk, d, page, dtype=dt, fp8=True, shared=True, poison=True)
    q, cu = make_query(ql, hq, d, dtype=dt)
    kw = dict(scale=d ** -0.5, causal=causal, window=win, soft_cap=cap, return_lse=True, **pc.kw)
    out, lse = P.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, **kw)
    assert len(calls) == 2  # K and V
    ref, ref_lse = _ref(R.prefill, q, pc, cu, pc.seq_lens, pc.block_tables, **kw)
    _check(out, lse, ref, ref_lse, dt, True)
    assert not P._convert_once(q.float(), pc.k_cache, pc.v_cache, pc.block_tables, q.shape[0], False)
    assert not P._convert_once(q, pc.k_cache, pc.v_cache, pc.block_tables, q.shape[0], True)  # mixed steps
    monkeypatch.setattr(P, "CONVERT_MAX_BYTES", 1)
    assert not P._convert_once(q, pc.k_cache, pc.v_cache, pc.block_tables, q.shape[0], False)
