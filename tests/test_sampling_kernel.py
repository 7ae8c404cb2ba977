"""Triton sampler vs the reference: exact support, same tokens, edge cases, invalid rows,
batch invariance, dtypes/strides, bad input. Small shapes: the interpreter runs one program per
row at a time."""
import math

import pytest
import torch
import triton
import triton.language as tl

from opmap.core.contract import InputError
from opmap.ops.sampling import reference as R
from opmap.kernels.sampling import sampler

# The Triton interpreter's own NumPy deprecation and overflow noise (-inf - -inf in masked lanes).
pytestmark = [pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

INF = math.inf


def _params(B, T=1.0, k=0, p=1.0, mp=0.0, seed=0):
    f = lambda v, dt=torch.float32: torch.full((B,), v, dtype=dt)  # noqa: E731
    return (f(T), f(k, torch.int32), f(p), f(mp), torch.arange(B, dtype=torch.int64) + seed,
            torch.arange(B, dtype=torch.int64) * 7 + 3)


def _random_case(seed, B, V, scale, ties):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * scale
    if ties:
        x = torch.round(x * 4) / 4
    x[torch.rand(B, V, generator=g) < 0.1] = -INF
    T = torch.rand(B, generator=g) + 0.3
    k = (torch.randint(0, V + 5, (B,), generator=g) * (torch.rand(B, generator=g) < 0.6)).int()
    k[0] = min(3000, V - 1)
    p = torch.where(torch.rand(B, generator=g) < 0.6, torch.rand(B, generator=g) * 0.98 + 0.01, torch.ones(B))
    mp = torch.where(torch.rand(B, generator=g) < 0.4, torch.rand(B, generator=g) * 0.3, torch.zeros(B))
    mp[1], p[2] = 1.0, 0.999
    seeds = torch.randint(0, 2**62, (B,), generator=g)
    pos = torch.randint(0, 2**40, (B,), generator=g)
    return x, T, k, p, mp, seeds, pos


# V=5000 with top_k 3000 / top_p 0.999 keeps > 2048 candidates: the path without compaction.
# chunk 512: pass A split over programs and the histogram bracket (pass B) of the GPU path.
@pytest.mark.parametrize("chunk", [None, 512])
@pytest.mark.parametrize("seed,V,scale,ties", [(0, 111, 1.0, True), (1, 1000, 3.0, False),
                                                (2, 5000, 0.3, True), (3, 4097, 1.0, False)])
def test_support_and_tokens_match_reference(seed, V, scale, ties, chunk):
    x, T, k, p, mp, seeds, pos = _random_case(seed, 6, V, scale, ties)
    ids, invalid, sup = sampler.sample(x, T, k, p, mp, seeds, pos, return_support=True, chunk=chunk)
    mask = sampler.support_from_boundary(x, T, sup)
    ref = R.support_mask(x.double() / T.double()[:, None], k, p, mp)
    filtered = ((k > 1) & (k < V)) | (p < 1) | (mp > 0)
    for b in range(x.shape[0]):
        if filtered[b]:
            assert torch.equal(mask[b], ref[b]), f"row {b}: support {int(mask[b].sum())} vs {int(ref[b].sum())}"
        assert ref[b, ids[b]]
    rids, rinv = R.sample(x, T, k, p, mp, seeds, pos)
    assert torch.equal(ids, rids) and not invalid.any() and not rinv.any()


# Every valid edge value of each parameter, with the same tokens from the kernel and the reference:
# temperature 0, subnormal (greedy, as the GPU build flushes it to 0: validate.FLT_MIN; 1e-40's
# reciprocal overflows, 1e-38's does not), tiny, 1, huge, the largest fp32; top_k off (0, V,
# beyond V, the int32 maximum), 1 (greedy), 2, V - 1; top_p the smallest fp32 (the first token
# only), 0.3, 1 (off); min_p 0 (off), the smallest fp32 (off), 0.2, 1 (the maximum only); seeds of
# any int64 bits.
EDGE_T = (0.0, 1e-45, 1e-40, 1e-38, 1e-30, 0.5, 1.0, 1e30, 3.4e38)
EDGE_FILTERS = ((0, 1.0, 0.0), (1, 0.3, 0.2), (299, 0.3, 1e-45), (301, 1e-45, 0.0), (2**31 - 1, 1.0, 1.0),
                (2, 1.0, 0.2), (0, 0.3, 0.0), (300, 1.0, 1e-45))


@pytest.mark.parametrize("chunk", [None, 64])
def test_every_valid_edge_value_gives_the_reference_token(chunk):
    V = 300
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, V, generator=g) * 3
    x[0, 10] = x[0, 20] = x.max() + 0.5  # a tie at the maximum
    rows = [(t, *f) for t in EDGE_T for f in EDGE_FILTERS]
    B = len(rows)
    T = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    k = torch.tensor([r[1] for r in rows], dtype=torch.int64)
    p = torch.tensor([r[2] for r in rows], dtype=torch.float32)
    mp = torch.tensor([r[3] for r in rows], dtype=torch.float32)
    seeds = torch.arange(B, dtype=torch.int64) * 7919 - 2**62  # negative bits too
    pos = torch.arange(B, dtype=torch.int64) % 13
    X = x.expand(B, V).contiguous()
    ids, invalid = sampler.sample(X, T, k, p, mp, seeds, pos, chunk=chunk)
    rids, rinvalid = R.sample(X, T, k, p, mp, seeds, pos)
    assert not invalid.any() and not rinvalid.any()
    bad = (ids != rids).nonzero().flatten().tolist()
    assert not bad, [(rows[b], int(ids[b]), int(rids[b])) for b in bad[:8]]
    greedy = R.greedy_rows(T, k)
    assert greedy.tolist() == [r[0] < 2.0 ** -126 or r[1] == 1 for r in rows]
    assert set(ids[greedy].tolist()) == {10}  # the lowest id of the tie
    probs = R.filtered_probs(X, T, k, p, mp)
    assert (probs[torch.arange(B), ids] > 0).all()


def test_no_op_filters_change_nothing():
    V = 300
    x = torch.randn(4, V) * 2
    base = sampler.sample(x, *_params(4))[0]
    for kw in (dict(p=1.0), dict(k=V), dict(k=V + 10), dict(k=0, p=1.0, mp=0.0)):
        assert torch.equal(sampler.sample(x, *_params(4, **kw))[0], base), kw


def test_single_finite_logit_always_chosen():
    V = 200
    x = torch.full((6, V), -INF)
    hot = torch.tensor([0, 5, 199, 77, 128, 3])
    x[torch.arange(6), hot] = torch.randn(6)
    for kw in (dict(), dict(k=10), dict(p=0.3), dict(mp=0.5), dict(k=50, p=0.9, mp=0.1), dict(T=0.0)):
        ids, invalid = sampler.sample(x, *_params(6, **kw))
        assert torch.equal(ids, hot) and not invalid.any(), kw


def test_equal_logits_keep_lowest_ids():
    V = 100
    x = torch.full((8, V), 0.5)
    ids, _, sup = sampler.sample(x, *_params(8, k=5), return_support=True)
    assert (ids < 5).all()
    assert sampler.support_from_boundary(x, torch.ones(8), sup)[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    ids, _ = sampler.sample(x, *_params(8, p=0.1))  # 10 tokens of mass 0.01 each are needed
    assert (ids < 10).all()
    assert (sampler.sample(x, *_params(8, T=0.0))[0] == 0).all()


def test_k1_and_temperature0_are_greedy_with_ties():
    x = torch.randn(4, 500)
    x[:, 7] = x[:, 300] = x.max() + 1.0  # tie at the maximum: the lowest id wins
    for kw in (dict(T=0.0), dict(k=1), dict(k=1, p=0.5, mp=0.3), dict(T=0.0, k=40)):
        ids, _ = sampler.sample(x, *_params(4, **kw))
        assert (ids == 7).all(), kw


def test_min_p_one_keeps_only_the_maximum():
    x = torch.randn(3, 400)
    ids, _ = sampler.sample(x, *_params(3, mp=1.0))
    assert torch.equal(ids, x.argmax(-1))
    x[:, 10] = x[:, 20] = x.max() + 1
    ids, _, sup = sampler.sample(x, *_params(3, mp=1.0), return_support=True)
    assert set(ids.tolist()) <= {10, 20}
    assert sampler.support_from_boundary(x, torch.ones(3), sup).sum(-1).tolist() == [2, 2, 2]


def test_invalid_rows_are_flagged_and_others_unaffected():
    V = 150
    x = torch.randn(5, V)
    x[1, 17] = float("nan")
    x[2, 3] = INF
    x[3] = -INF
    params = _params(5, k=20, p=0.9)
    ids, invalid = sampler.sample(x, *params)
    assert invalid.tolist() == [False, True, True, True, False]
    assert ids[1:4].tolist() == [0, 0, 0]
    alone = sampler.sample(x[[0, 4]].clone(), *[t[[0, 4]] for t in params])[0]
    assert torch.equal(ids[[0, 4]], alone)
    gids, ginv = sampler.sample(x, *_params(5, T=0.0))
    assert torch.equal(ginv, invalid) and gids[1:4].tolist() == [0, 0, 0]


def test_seeded_rows_do_not_depend_on_the_batch():
    V = 256
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, V, generator=g)
    T = torch.tensor([1.0, 0.7, 0.0, 1.2, 0.9, 1.0])
    k = torch.tensor([0, 20, 0, 50, 0, 5], dtype=torch.int32)
    p = torch.tensor([1.0, 0.9, 1.0, 0.8, 0.6, 1.0])
    mp = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.1])
    seeds = torch.tensor([11, 22, 33, 44, 55, 66])
    pos = torch.tensor([0, 1, 2, 3, 4, 5])
    full = sampler.sample(x, T, k, p, mp, seeds, pos)[0]
    perm = torch.tensor([4, 2, 0, 5])
    sub = sampler.sample(x[perm], T[perm], k[perm], p[perm], mp[perm], seeds[perm], pos[perm])[0]
    assert torch.equal(sub, full[perm])
    # A different position is a different draw of the same row (the stream is keyed by it).
    draws = {int(sampler.sample(x[:1], T[:1], k[:1], p[:1], mp[:1], seeds[:1], torch.tensor([q]))[0]) for q in range(12)}
    assert len(draws) > 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dtypes_and_strided_rows(dtype):
    wide = (torch.randn(4, 1100) * 2).to(dtype)
    x = wide[:, 37:1037]  # row stride 1100, last-dim stride 1
    params = (torch.tensor([1.0, 0.5, 0.0, 2.0]), torch.tensor([0, 30, 0, 100], dtype=torch.int64),
              torch.tensor([0.9, 1.0, 1.0, 0.7]), torch.tensor([0.0, 0.1, 0.0, 0.0]),
              torch.tensor([1, 2, 3, 4]), torch.tensor([9, 8, 7, 6]))
    ids, invalid = sampler.sample(x, *params)
    rids, _ = R.sample(x, *params)
    assert torch.equal(ids, rids) and not invalid.any()


def test_empty_batch():
    ids, invalid = sampler.sample(torch.randn(0, 10), *_params(0))
    assert ids.shape == (0,) and invalid.shape == (0,)


@pytest.mark.parametrize("fn", [sampler.sample, R.sample])
def test_bad_input_names_the_argument(fn):
    x = torch.randn(3, 50)
    good = list(_params(3))
    names = ["temperature", "top_k", "top_p", "min_p", "seeds", "positions"]
    with pytest.raises(InputError, match="^logits"):
        fn(x[0], *good)
    with pytest.raises(InputError, match="^logits"):
        fn(x.int(), *good)
    with pytest.raises(InputError, match="^logits"):
        fn(torch.randn(50, 3).t(), *good)  # last dim not contiguous
    for i, name in enumerate(names):
        bad = list(good)
        bad[i] = bad[i][:2]
        with pytest.raises(InputError, match=f"^{name}"):
            fn(x, *bad)
        bad = list(good)
        bad[i] = bad[i].to(torch.float64)
        with pytest.raises(InputError, match=f"^{name}"):
            fn(x, *bad)


def test_split_pass_a_matches_the_single_pass():
    """The GPU splits pass A of a row over programs (chunks of 8192); small chunks here."""
    x, T, k, p, mp, seeds, pos = _random_case(9, 6, 1000, 1.0, True)
    x[3, :600] = -INF  # whole chunks without a finite value
    T[0], k[1], k[2], p[2], mp[2] = 0.0, 1, 0, 1.0, 0.0  # greedy rows and an unfiltered row
    one = sampler.sample(x, T, k, p, mp, seeds, pos, chunk=0)
    for chunk in (64, 256):
        split = sampler.sample(x, T, k, p, mp, seeds, pos, chunk=chunk)
        assert torch.equal(split[0], one[0]) and torch.equal(split[1], one[1]), chunk
    assert torch.equal(one[0], R.sample(x, T, k, p, mp, seeds, pos)[0])


def test_config_override_same_tokens_and_checked():
    """The (BLOCK, num_warps) override the benchmark variants use draws the same tokens."""
    from opmap.core.contract import InputError
    from opmap.kernels.sampling.sampler import sample

    g = torch.Generator().manual_seed(5)
    B, V = 3, 1000
    x = torch.randn(B, V, generator=g) * 2
    args = (x, torch.full((B,), 0.8), torch.tensor([50, 0, 7], dtype=torch.int32), torch.tensor([0.9, 0.5, 1.0]),
            torch.zeros(B), torch.arange(B) + 1, torch.arange(B))
    a = sample(*args)
    for cfg in ((256, 4), (8192, 16)):  # a block wider than the row: one masked iteration
        b = sample(*args, config=cfg)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(InputError, match="config"):
        sample(*args, config=(100, 4))


@pytest.mark.parametrize("k,p,mp", [(7, 1.0, 0.0), (40, 1.0, 0.0), (40, 0.7, 0.0), (0, 0.6, 0.0), (0, 0.97, 0.0),
                                    (40, 1.0, 0.5), (300, 1.0, 0.0), (0, 0.999, 0.0)])
def test_histogram_bracket_at_bin_edges(k, p, mp):
    """Pass B's histogram starts top-k (and top-p alone) inside one bin (1/32 nat near the max,
    wider below). Values placed exactly on bin edges of every tier, tied across them, and a
    boundary below the histogram's range (z < -15.5) must give the reference's support and tokens."""
    from opmap.kernels.sampling.sampler_jit import hist_u_edges

    u = torch.tensor(hist_u_edges())
    g = torch.Generator().manual_seed(k * 7 + int(p * 100))
    B, V = 4, 700
    j = torch.randint(0, len(u) - 1, (B, V), generator=g)  # many values on edges, many ties
    edges, width = -u[j], u[j + 1] - u[j]
    x = torch.where(torch.rand(B, V, generator=g) < 0.5, edges, edges - width * torch.rand(B, V, generator=g))
    x[:, 0] = 0.0  # z = x - 0: the edges stay exact
    x[2] = torch.where(torch.arange(V) < 5, 0.0, -20.0 - torch.rand(V, generator=g))  # boundary below -16
    x[3, 100:] = -INF
    T = torch.ones(B)
    kk, pp, mm = (torch.full((B,), v, dtype=dt) for v, dt in ((k, torch.int32), (p, torch.float32), (mp, torch.float32)))
    seeds, pos = torch.arange(B) + 11, torch.arange(B) * 5
    ids, invalid, sup = sampler.sample(x, T, kk, pp, mm, seeds, pos, return_support=True, chunk=128)
    mask = sampler.support_from_boundary(x, T, sup)
    ref = R.support_mask(x.double(), kk, pp, mm)
    for b in range(B):
        assert torch.equal(mask[b], ref[b]), f"row {b}: support {int(mask[b].sum())} vs {int(ref[b].sum())}"
    assert torch.equal(ids, R.sample(x, T, kk, pp, mm, seeds, pos)[0]) and not invalid.any()


def test_passes_b_and_c_change_no_token():
    """bracket=False (the benchmark's same-run comparison) searches from the whole row: the same
    support boundary and tokens as with the histogram bracket and the spread gather."""
    x, T, k, p, mp, seeds, pos = _random_case(4, 6, 3000, 2.0, False)
    k[3], p[3], mp[3] = 0, 0.9, 0.0  # top-p alone
    a = sampler.sample(x, T, k, p, mp, seeds, pos, return_support=True, chunk=256)
    b = sampler.sample(x, T, k, p, mp, seeds, pos, return_support=True, chunk=256, bracket=False)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_loads_ahead_change_no_bit():
    """ahead=False (one block in flight in passes A, B and C: the benchmark's same-run comparison)
    gives the same support boundary and tokens, top-k, top-p alone and min-p alone among the rows;
    chunks that end inside a block (V = 3001 over chunks of 256)."""
    x, T, k, p, mp, seeds, pos = _random_case(4, 7, 3001, 2.0, False)
    k[3], p[3], mp[3] = 0, 0.9, 0.0  # top-p alone
    k[5], p[5], mp[5] = 0, 1.0, 0.05  # min-p alone
    a = sampler.sample(x, T, k, p, mp, seeds, pos, return_support=True, chunk=256)
    b = sampler.sample(x, T, k, p, mp, seeds, pos, return_support=True, chunk=256, ahead=False)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("V", [1, 2, 3, 17])
def test_tiny_vocabularies(V):
    """Vocabularies smaller than a lane block (a one-token vocabulary included): every filter
    combination keeps the reference's support and draws its tokens."""
    g = torch.Generator().manual_seed(V)
    B = 6
    x = torch.randn(B, V, generator=g) * 2
    T = torch.tensor([0.0, 0.7, 1.0, 1.3, 1.0, 0.9])
    k = torch.tensor([0, 0, 1, 2, 0, 5], dtype=torch.int32)
    p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.3, 1.0])
    mp = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.2, 0.1])
    seeds, pos = torch.arange(B) + 3, torch.arange(B)
    ref = R.sample(x, T, k, p, mp, seeds, pos)
    for chunk in (0, 16):
        ids, invalid = sampler.sample(x, T, k, p, mp, seeds, pos, chunk=chunk)
        assert torch.equal(ids, ref[0]) and not invalid.any() and (ids < V).all()


def _keep_scratch(monkeypatch) -> list:
    """The sampler's scratch views of each call, appended as made: [(sz, part, agg, agg2),
    (si, cnt, br, hist)] per call; br holds the bracket records (sampler.BR ints per row)."""
    seen = []
    carve = sampler._carve

    def keep(dtype, device, *shapes):
        out = carve(dtype, device, *shapes)
        seen.append(out)
        return out

    monkeypatch.setattr(sampler, "_carve", keep)
    return seen


@pytest.mark.parametrize("cand", [2048, 64])
def test_fine_bracket_for_flat_top_p_rows(cand, monkeypatch):
    """Top-p alone over a flat body (the benchmark's logits: a nucleus of thousands of tokens whose
    boundary lies in a half-nat bin, more than CAND values above the bracket's lo): pass B2's fine
    histogram narrows the bracket, the gather keeps the values inside it, and the values above it
    enter the search and the draw as figures. Exact support and the reference's tokens, the same as
    without passes B and C. With fewer candidate slots the fine bracket overflows on some rows and
    those rows search the whole row instead (the fallbacks)."""
    V, B = 32768, 4
    g = torch.Generator().manual_seed(11)
    x = torch.randn(B, V, generator=g) * 2.0
    x[:, :20] += torch.rand(B, 20, generator=g) * 4
    x[3] = torch.round(x[3] * 8) / 8  # ties: values equal to the boundary
    T = torch.tensor([0.8, 0.8, 0.9, 0.8])
    k = torch.zeros(B, dtype=torch.int32)
    p = torch.tensor([0.9, 0.7, 0.8, 0.9])
    mp = torch.zeros(B)
    seeds, pos = torch.arange(B) + 5, torch.arange(B) * 3 + 1
    block, _, warps, chunk = sampler._config(torch.device("cpu"))
    monkeypatch.setattr(sampler, "_config", lambda dev: (block, cand, warps, chunk))
    seen = _keep_scratch(monkeypatch)
    ids, invalid, sup = sampler.sample(x, T, k, p, mp, seeds, pos, return_support=True, chunk=4096)
    br = seen[1][2]  # (si, cnt, br, hist): the bracket records
    over = br[:, 3] > cand  # more values above lo than candidate slots
    assert (br[:, 0] == 2).all() and over[[0, 2, 3]].all()  # row 1 (p 0.7) fits: a plain gather, in the same batch
    assert torch.equal(br[:, 5] > 0, over)  # those rows, and only those, went through the fine pass
    if cand == 2048:
        assert (br[over, 5] == 2).all()  # and were gathered inside their fine bracket
    target = R.filtered_probs(x, T, k, p, mp)
    assert torch.equal(sampler.support_from_boundary(x, T, sup), target > 0)
    assert torch.equal(ids, R.sample(x, T, k, p, mp, seeds, pos)[0]) and not invalid.any()
    whole = sampler.sample(x, T, k, p, mp, seeds, pos, return_support=True, chunk=4096, bracket=False)
    assert torch.equal(ids, whole[0]) and torch.equal(sup, whole[2])


def test_min_p_alone_is_drawn_in_the_gather(monkeypatch):
    """Min-p alone: the support {z >= log(min_p)} is known after pass A, so the spread gather races
    over it (state 3) and the per-row kernel reads no row. Same tokens as the reference and as the
    whole-row race, beside rows with other filters, with ties and an all-equal row."""
    g = torch.Generator().manual_seed(13)
    B, V = 6, 3000
    x = torch.randn(B, V, generator=g) * 2
    x[2] = torch.round(x[2] * 2) / 2  # ties
    x[3] = 0.5  # every value equal: all kept, the noise decides
    T = torch.tensor([1.0, 0.7, 1.0, 1.0, 1.3, 1.0])
    k = torch.tensor([0, 0, 0, 0, 40, 0], dtype=torch.int32)
    p = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.8])
    mp = torch.tensor([0.05, 0.3, 0.1, 0.2, 0.1, 0.0])
    seeds, pos = torch.arange(B) + 17, torch.arange(B) * 5
    seen = _keep_scratch(monkeypatch)
    ids, invalid, sup = sampler.sample(x, T, k, p, mp, seeds, pos, return_support=True, chunk=256)
    assert seen[1][2][:, 5].tolist() == [3, 3, 3, 3, 0, 0]  # min-p alone rows only
    target = R.filtered_probs(x, T, k, p, mp)
    assert torch.equal(sampler.support_from_boundary(x, T, sup), target > 0)
    assert torch.equal(ids, R.sample(x, T, k, p, mp, seeds, pos)[0]) and not invalid.any()
    whole = sampler.sample(x, T, k, p, mp, seeds, pos, chunk=256, bracket=False)[0]
    assert torch.equal(ids, whole)


@triton.jit
def _bracket_at_top(hist_ptr, agg_ptr, n_parts, lo, hi, target, S_P: tl.constexpr):
    return hi, hi, lo * 0


@triton.jit
def _bracket_at_bottom(hist_ptr, agg_ptr, n_parts, lo, hi, target, S_P: tl.constexpr):
    return lo, lo, lo * 0


@pytest.mark.parametrize("wrong", [_bracket_at_top, _bracket_at_bottom], ids=["above", "below"])
def test_a_fine_bracket_that_misses_falls_back_to_the_whole_row(wrong, monkeypatch):
    """A fine bracket that does not hold the boundary (rounding put a value in a neighbouring bin)
    must cost time, not tokens: forced here to a one-key bracket at the coarse bracket's top or
    bottom, the per-row search finds no boundary in it and searches the whole row."""
    monkeypatch.setattr(sampler, "_fine_bracket", wrong)
    V, B = 32768, 2
    g = torch.Generator().manual_seed(12)
    x = torch.randn(B, V, generator=g) * 2.0
    T, k = torch.full((B,), 0.8), torch.zeros(B, dtype=torch.int32)
    p, mp = torch.tensor([0.9, 0.9]), torch.zeros(B)
    seeds, pos = torch.arange(B) + 9, torch.arange(B) + 4
    seen = _keep_scratch(monkeypatch)
    ids, invalid, sup = sampler.sample(x, T, k, p, mp, seeds, pos, return_support=True, chunk=4096)
    assert (seen[1][2][:, 5] == 2).all()  # both rows went through the (wrong) fine bracket
    target = R.filtered_probs(x, T, k, p, mp)
    assert torch.equal(sampler.support_from_boundary(x, T, sup), target > 0)
    assert torch.equal(ids, R.sample(x, T, k, p, mp, seeds, pos)[0]) and not invalid.any()
