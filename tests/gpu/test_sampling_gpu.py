"""GPU tests of the sampling stage (run with -m gpu on a CUDA machine): the Triton sampler's own
draws against the renormalised targets at vocab 111 / 32001 / 128256 (chi-square with pooled tails
at alpha 1e-3 and a TV bound), exact support at real shapes, edge cases in bf16, invalid rows,
batch invariance, eager vs CUDA-graph replay, the processors and the bitmask apply in bf16.
Needs neither xgrammar nor flashinfer."""
import math

import pytest
import torch

from opmap.kernels.grammar import bitmask as GK
from opmap.ops.grammar import reference as GR
from opmap.kernels.sampling import processors as PK
from opmap.harness.check.stats import chi2_tv
from opmap.ops.sampling import reference as R
from opmap.kernels.sampling import sampler
from opmap.core.tolerance import assert_close

pytestmark = pytest.mark.gpu
DEV = "cuda"


def rows(B, T=1.0, k=0, p=1.0, mp=0.0, seed=0):
    f = lambda v, dt=torch.float32: torch.full((B,), v, dtype=dt, device=DEV)  # noqa: E731
    return (f(T), f(k, torch.int32), f(p), f(mp), torch.full((B,), seed, dtype=torch.int64, device=DEV),
            torch.arange(B, dtype=torch.int64, device=DEV))




FILTERS = [dict(T=0.8), dict(k=20), dict(p=0.8), dict(T=1.3, mp=0.1), dict(T=0.9, k=50, p=0.9, mp=0.02)]


@pytest.mark.parametrize("V,n,scale", [(111, 40000, 1.0), (32001, 20000, 4.0), (128256, 20000, 4.0)])
@pytest.mark.parametrize("f", FILTERS, ids=str)
def test_kernel_draws_follow_the_target(V, n, scale, f):
    g = torch.Generator(device=DEV).manual_seed(V)
    x = (torch.randn(1, V, generator=g, device=DEV) * scale).to(torch.bfloat16)
    T, k, p, mp, seeds, pos = rows(n, seed=17, **f)
    ids, invalid = sampler.sample(x.expand(n, V), T, k, p, mp, seeds, pos)
    assert not invalid.any()
    target = R.filtered_probs(x, T[:1], k[:1], p[:1], mp[:1])[0]
    pval, tv, bound, outside = chi2_tv(torch.bincount(ids, minlength=V), target, n)
    assert outside == 0, "a token outside the support was drawn"
    assert pval > 1e-3, f"chi-square p={pval:.2e}"
    assert tv <= bound, f"TV {tv:.4f} > bound {bound:.4f}"


def assert_support_matches(mask, x, T, k, p, mp, tol=1e-4):
    """The kernel's support equals the fp64 reference's where counts decide (top-k) and ends at
    the same place up to ``tol`` of probability mass where fp32 sums decide (top-p, min-p cut):
    the GPU's exp and fp32 summation order differ from fp64 (2.2e-5 of the mass seen on the H200 at
    vocab 32000, against a bound of order sqrt(V) * 2^-24 per partial sum; 1e-4 leaves margin)."""
    ref = R.filtered_probs(x, T, k, p, mp) > 0
    z = x.double() / T.double()[:, None]
    zs, order = torch.sort(z, dim=-1, descending=True, stable=True)
    ms, rs = mask.gather(1, order), ref.gather(1, order)
    rank = torch.arange(x.shape[1], device=x.device)[None, :]
    kk, kr = ms.sum(1), rs.sum(1)
    assert torch.equal(ms, rank < kk[:, None]), "the kernel's support is not a prefix of the order"
    cw = torch.cumsum(torch.softmax(zs, -1), -1)
    mk, mr = cw.gather(1, (kk - 1)[:, None])[:, 0], cw.gather(1, (kr - 1)[:, None])[:, 0]
    exact = (p >= 1) & (mp <= 0)
    assert torch.equal(kk[exact], kr[exact]), "top-k support size differs"
    worst = float((mk - mr).abs().max())
    assert worst <= tol, f"support ends {worst:.2e} of mass away from the reference's"


@pytest.mark.parametrize("V", [32000, 128256, 151936])
def test_support_at_real_shapes(V):
    B = 64
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(B, V, generator=g, device=DEV) * 3
    T = torch.tensor([1.0, 0.5, 2.0, 0.7], device=DEV).repeat(B // 4)
    k = torch.tensor([50, 0, 1000, 0, 3000, 20, 0, 0], dtype=torch.int32, device=DEV).repeat(B // 8)
    p = torch.tensor([0.9, 0.95, 1.0, 0.5, 0.99, 1.0, 0.7, 1.0], device=DEV).repeat(B // 8)
    mp = torch.tensor([0.0, 0.05, 0.0, 0.0, 0.0, 0.1, 0.0, 0.3], device=DEV).repeat(B // 8)
    seeds = torch.arange(B, device=DEV) * 3 + 1
    pos = torch.arange(B, device=DEV)
    ids, invalid, sup = sampler.sample(x, T, k, p, mp, seeds, pos, return_support=True)
    mask = sampler.support_from_boundary(x, T, sup)
    assert_support_matches(mask, x, T, k, p, mp)
    assert mask.gather(1, ids[:, None]).all() and not invalid.any()
    # bf16 logits: exact ties everywhere; top-k alone is decided by counts, so it is exact.
    xb = x.to(torch.bfloat16)
    ones = torch.ones(B, device=DEV)
    ids, invalid, sup = sampler.sample(xb, ones, k, ones, ones * 0, seeds, pos, return_support=True)
    assert_support_matches(sampler.support_from_boundary(xb, ones, sup), xb, ones, k, ones, ones * 0, tol=0.0)


@pytest.mark.parametrize("V", [128256, 151936])
def test_histogram_bracket_with_values_on_bin_edges(V):
    """Pass B (the 128-bin histogram of z: 1/32 nat near the max, wider below) brackets the
    search: values exactly on bin edges of every tier and tied across them, bf16 and fp32 logits,
    top-k and top-p alone, and a row whose boundary lies below the histogram's range (z < -15.5)."""
    from opmap.kernels.sampling.sampler_jit import hist_u_edges

    u = torch.tensor(hist_u_edges(), device=DEV)
    B = 16
    g = torch.Generator(device=DEV).manual_seed(V)
    j = torch.randint(0, len(u) - 1, (B, V), generator=g, device=DEV)
    edges, width = -u[j], u[j + 1] - u[j]
    x = torch.where(torch.rand(B, V, generator=g, device=DEV) < 0.5, edges,
                    edges - width * torch.rand(B, V, generator=g, device=DEV))
    x[:, 0] = 0.0
    x[5] = torch.where(torch.arange(V, device=DEV) < 5, 0.0, -20.0 - torch.rand(V, generator=g, device=DEV))
    ones = torch.ones(B, device=DEV)
    k = torch.tensor([7, 50, 1000, 3000, 0, 40, 0, 0], dtype=torch.int32, device=DEV).repeat(2)
    p = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.9, 1.0, 0.5, 0.95], device=DEV).repeat(2)
    seeds, pos = torch.arange(B, device=DEV) + 5, torch.arange(B, device=DEV)
    for xx in (x, x.to(torch.bfloat16)):
        ids, invalid, sup = sampler.sample(xx, ones, k, p, ones * 0, seeds, pos, return_support=True)
        mask = sampler.support_from_boundary(xx, ones, sup)
        assert_support_matches(mask, xx, ones, k, p, ones * 0)
        assert mask.gather(1, ids[:, None]).all() and not invalid.any()


def test_edge_cases_bf16():
    V = 128256
    x = torch.full((4, V), -math.inf, device=DEV, dtype=torch.bfloat16)
    hot = torch.tensor([0, 77, V - 1, 4242], device=DEV)
    x[torch.arange(4, device=DEV), hot] = 1.5
    for kw in (dict(), dict(k=10, p=0.5), dict(mp=0.9), dict(T=0.0)):
        ids, invalid = sampler.sample(x, *rows(4, **kw))
        assert torch.equal(ids, hot) and not invalid.any(), kw
    y = torch.randn(4, V, device=DEV).to(torch.bfloat16)
    y[:, 9] = y[:, 900] = 20.0
    for kw in (dict(T=0.0), dict(k=1), dict(mp=1.0, T=0.0)):
        assert (sampler.sample(y, *rows(4, **kw))[0] == 9).all(), kw
    # 64 seeded draws (16 copies of the 4 rows): min_p = 1 keeps only the tied maxima.
    assert set(sampler.sample(y.repeat(16, 1), *rows(64, mp=1.0))[0].tolist()) <= {9, 900}
    base = sampler.sample(y, *rows(4))[0]
    assert torch.equal(sampler.sample(y, *rows(4, k=V))[0], base)
    assert torch.equal(sampler.sample(y, *rows(4, p=1.0))[0], base)
    eq = torch.zeros(2, V, device=DEV, dtype=torch.bfloat16)
    assert (sampler.sample(eq, *rows(2, k=7))[0] < 7).all()


def test_invalid_rows_do_not_disturb_the_batch():
    V = 32000
    x = torch.randn(6, V, device=DEV)
    params = rows(6, k=40, p=0.9, seed=3)
    clean = sampler.sample(x, *params)[0]
    x[1, 5], x[3, 100], x[4] = float("nan"), math.inf, -math.inf
    ids, invalid = sampler.sample(x, *params)
    assert invalid.tolist() == [False, True, False, True, True, False]
    assert torch.equal(ids[[0, 2, 5]], clean[[0, 2, 5]]) and (ids[[1, 3, 4]] == 0).all()


def test_fine_bracket_at_the_benchmark_shape():
    """Top-p alone at B=64 / vocab 128256 over the benchmark's logits (flat body, nuclei of
    thousands of tokens): pass B2 narrows the bracket and the values above it enter as figures.
    Exact support against the reference, the tokens of the whole-row search (bracket=False), in
    fp32 and bf16 (ties at the boundary), and batch invariant."""
    B, V = 64, 128256
    g = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(B, V, generator=g, device=DEV) * 2.0
    x[:, :200] += torch.rand(B, 200, generator=g, device=DEV) * 8
    T = torch.full((B,), 0.8, device=DEV)
    k = torch.zeros(B, dtype=torch.int32, device=DEV)
    p = torch.tensor([0.9, 0.95, 0.8, 0.99], device=DEV).repeat(B // 4)
    mp = torch.zeros(B, device=DEV)
    seeds = torch.arange(B, device=DEV) * 11 + 2
    pos = torch.arange(B, device=DEV) + 100
    for xs in (x, x.to(torch.bfloat16)):
        ids, invalid, sup = sampler.sample(xs, T, k, p, mp, seeds, pos, return_support=True)
        assert_support_matches(sampler.support_from_boundary(xs, T, sup), xs, T, k, p, mp)
        whole = sampler.sample(xs, T, k, p, mp, seeds, pos, return_support=True, bracket=False)
        assert torch.equal(ids, whole[0]) and torch.equal(sup, whole[2]) and not invalid.any()
        sub = sampler.sample(xs[5:9], T[5:9], k[5:9], p[5:9], mp[5:9], seeds[5:9], pos[5:9])[0]
        assert torch.equal(sub, ids[5:9])


def test_seeded_rows_are_batch_invariant():
    V = 128256
    g = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(64, V, generator=g, device=DEV).to(torch.bfloat16)
    T = torch.rand(64, generator=g, device=DEV) + 0.5
    k = torch.randint(0, 200, (64,), generator=g, device=DEV).to(torch.int32)
    p = torch.rand(64, generator=g, device=DEV) * 0.5 + 0.5
    mp = torch.zeros(64, device=DEV)
    seeds = torch.randint(0, 2**62, (64,), generator=g, device=DEV)
    pos = torch.randint(0, 4096, (64,), generator=g, device=DEV)
    full = sampler.sample(x, T, k, p, mp, seeds, pos)[0]
    perm = torch.randperm(64, generator=g, device=DEV)[:13]
    sub = sampler.sample(x[perm], T[perm], k[perm], p[perm], mp[perm], seeds[perm], pos[perm])[0]
    assert torch.equal(sub, full[perm])
    alone = torch.stack([sampler.sample(x[i:i + 1], T[i:i + 1], k[i:i + 1], p[i:i + 1], mp[i:i + 1], seeds[i:i + 1],
                                        pos[i:i + 1])[0][0] for i in range(8)])
    assert torch.equal(alone, full[:8])


def test_eager_equals_cuda_graph_replay():
    B, V = 32, 128256
    static = [torch.randn(B, V, device=DEV).to(torch.bfloat16)] + list(rows(B, T=0.9, k=50, p=0.9, seed=5))
    static[2][::3] = 0  # mixed rows: some without top-k
    static[1][::5] = 0.0  # greedy rows
    sampler.sample(*static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_ids, out_invalid = sampler.sample(*static)
    for step in range(3):
        new = torch.randn(B, V, device=DEV).to(torch.bfloat16)
        static[0].copy_(new)
        static[6].add_(1)  # next position
        graph.replay()
        eager, _ = sampler.sample(new, *static[1:])
        assert torch.equal(out_ids, eager), step


def test_processors_bf16():
    B, V = 8, 128256
    x = torch.randn(B, V, device=DEV).to(torch.bfloat16)
    pm = torch.rand(B, V, device=DEV) < 0.05
    cnt = (torch.randint(0, 3, (B, V), device=DEV) * (torch.rand(B, V, device=DEV) < 0.01)).int()
    rep, fr, pr = (torch.rand(B, device=DEV) + 0.5, torch.rand(B, device=DEV), torch.rand(B, device=DEV) - 0.5)
    a, b = x.clone(), x.clone()
    PK.apply_penalties(a, pm, cnt, rep, fr, pr)
    R.apply_penalties(b, pm, cnt, rep, fr, pr)
    assert_close(a, b)
    T = torch.rand(B, device=DEV) + 0.2
    PK.apply_temperature(a, T)
    R.apply_temperature(b, T)
    assert_close(a, b)


@pytest.mark.parametrize("V", [128000, 128001, 128010])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bitmask_apply_vs_masked_fill(V, dtype):
    B = 64
    wide = torch.randn(B, V + 64, device=DEV).to(dtype)
    logits = wide[:, 3:V + 3]
    allowed = torch.rand(B, V, device=DEV) < 0.5
    bm = GR.pack_bitmask(allowed)
    before = wide.clone()
    want = logits.clone().masked_fill(~allowed, -math.inf)
    GK.apply_bitmask(logits, bm)
    assert torch.equal(logits, want)
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, V + 3:], before[:, V + 3:])
    sub = before[:, 3:V + 3].clone()
    r = torch.tensor([5, 63, 0], device=DEV, dtype=torch.int32)
    GK.apply_bitmask(sub, bm, r)
    exp = before[:, 3:V + 3].clone()
    exp[r.long()] = exp[r.long()].masked_fill(~allowed[r.long()], -math.inf)
    assert torch.equal(sub, exp)


def test_bitmask_buffer_upload_and_apply():
    """The engine's path without xgrammar: pinned words -> non-blocking copy -> selected apply
    (our Triton kernel on the GPU, no fallback), only on the constrained rows."""
    from opmap.engine.structured import BitmaskBuffer, apply_bitmask

    B, V = 32, 128256
    buf = BitmaskBuffer(B, V, DEV)
    assert buf.cpu.is_pinned()
    allowed = torch.rand(B, V) < 0.01
    buf.cpu[:B] = GR.pack_bitmask(allowed)
    rows = [1, 7, 30]
    bm, r = buf.upload(B, rows)
    logits = torch.randn(B, V, device=DEV)
    want = logits.clone()
    idx = torch.tensor(rows, device=DEV)
    want[idx] = want[idx].masked_fill(~allowed[rows].to(DEV), -math.inf)
    assert apply_bitmask(logits, bm, r) == "triton"
    assert torch.equal(logits, want)
    buf.fill([None] * B)  # waits for the copies above (none pending: torch.equal synchronised)
    buf.cpu.fill_(0)  # the device copy keeps its values
    assert torch.equal(bm.cpu(), GR.pack_bitmask(allowed))
