"""Sampling statistics: draws against the renormalised target of each filter.

The Triton sampler draws exactly the reference's tokens (test_sampling_kernel checks token
equality), and the reference's race uses the kernel's Philox stream written in PyTorch, so many
draws are made cheaply with the reference's race (one row, N positions) and tested by chi-square
(tails pooled to expected counts >= 5, alpha 1e-3, fixed seeds) and a total-variation bound. At
vocab 128256 the interpreter checks the kernel's support and tokens on a few rows; the GPU tests
(tests/gpu/test_sampling_gpu.py) repeat the statistics with the kernel's own draws at every size.
"""
import functools
import math

import pytest
import torch

from opmap.harness.check.stats import chi2_tv
from opmap.ops.sampling import reference as R
from opmap.kernels.sampling import sampler
from opmap.ops.sampling.philox import gumbel

# The Triton interpreter's own NumPy deprecation and overflow noise (-inf - -inf in masked lanes).
pytestmark = [pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

ALPHA = 1e-3




@functools.lru_cache(maxsize=4)
def _noise(V: int, n: int, seed: int) -> torch.Tensor:
    """Gumbel noise [n, V] of one request (seed) at positions 0..n-1: the kernel's stream."""
    ids = torch.arange(V).expand(n, -1)
    return gumbel(torch.full((n,), seed, dtype=torch.int64), torch.arange(n, dtype=torch.int64), ids)


def draws(x_row, T, k, p, mp, n, seed):
    """n draws of one row at positions 0..n-1: the reference race (the kernel's stream)."""
    params = [torch.tensor([T]), torch.tensor([k], dtype=torch.int32), torch.tensor([p]), torch.tensor([mp])]
    target = R.filtered_probs(x_row[None], *params)[0]
    keep = target > 0
    z = R.kernel_z(x_row[None], params[0])
    key = torch.where(keep, z + _noise(x_row.numel(), n, seed), -math.inf)
    return torch.bincount(key.argmax(-1), minlength=x_row.numel()), target


FILTERS = [dict(T=1.0, k=20, p=1.0, mp=0.0), dict(T=1.0, k=0, p=0.8, mp=0.0),
           dict(T=1.3, k=0, p=1.0, mp=0.1), dict(T=0.9, k=50, p=0.9, mp=0.02)]
CASES = ([(111, 1.0, 20000, dict(T=0.8, k=0, p=1.0, mp=0.0))] + [(111, 1.0, 20000, f) for f in FILTERS]
         + [(32001, 4.0, 4000, f) for f in FILTERS])


@pytest.mark.parametrize("V,scale,n,f", CASES,
                         ids=[f"V{c[0]}-T{c[3]['T']}-k{c[3]['k']}-p{c[3]['p']}-mp{c[3]['mp']}" for c in CASES])
def test_chi_square_and_tv(V, scale, n, f):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(V, generator=g) * scale
    if V > 1000:  # the support is small here: draw through its columns only
        counts, target = draws_support(x, f, n, seed=1234 + V)
    else:
        counts, target = draws(x, f["T"], f["k"], f["p"], f["mp"], n, seed=1234 + V)
    pval, tv, bound, outside = chi2_tv(counts, target, n)
    assert outside == 0
    assert pval > ALPHA, f"chi-square p={pval:.2e}"
    assert tv <= bound, f"TV {tv:.4f} > {bound:.4f}"


def draws_support(x_row, f, n, seed):
    params = [torch.tensor([f["T"]]), torch.tensor([f["k"]], dtype=torch.int32), torch.tensor([f["p"]]),
              torch.tensor([f["mp"]])]
    target = R.filtered_probs(x_row[None], *params)[0]
    ids = (target > 0).nonzero().flatten()
    z = R.kernel_z(x_row[None], params[0])[0, ids]
    out = R.race(z.expand(n, -1), torch.ones(n, ids.numel(), dtype=torch.bool),
                 torch.full((n,), seed, dtype=torch.int64), torch.arange(n, dtype=torch.int64), ids.expand(n, -1))
    return torch.bincount(out, minlength=x_row.numel()), target


def test_chi_square_detects_a_wrong_distribution():
    """The statistic has power: draws of T=1 tested against the T=0.8 target must fail."""
    g = torch.Generator().manual_seed(111)
    x = torch.randn(111, generator=g)
    counts, _ = draws(x, 1.0, 0, 1.0, 0.0, 20000, seed=1234 + 111)
    wrong = R.filtered_probs(x[None], torch.tensor([0.8]), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.0]))[0]
    pval, tv, bound, _ = chi2_tv(counts, wrong, 20000)
    assert pval < ALPHA and tv > bound


def test_kernel_draws_at_vocab_128256_follow_the_target_support():
    """Big vocabulary in the interpreter: exact support and the reference's tokens, few rows."""
    V = 128256
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(3, V, generator=g) * 2.0).half()  # halves of equal value: ties at the boundary
    T = torch.tensor([0.9, 1.0, 1.2])
    k = torch.tensor([50, 0, 0], dtype=torch.int32)
    p = torch.tensor([0.9, 0.95, 1.0])
    mp = torch.tensor([0.0, 0.05, 0.2])
    seeds, pos = torch.tensor([1, 2, 3]), torch.tensor([10, 20, 30])
    ids, invalid, sup = sampler.sample(x, T, k, p, mp, seeds, pos, return_support=True)
    target = R.filtered_probs(x, T, k, p, mp)
    assert torch.equal(sampler.support_from_boundary(x, T, sup), target > 0)
    assert (target.gather(1, ids[:, None]) > 0).all() and not invalid.any()
    assert torch.equal(ids, R.sample(x, T, k, p, mp, seeds, pos)[0])
    assert math.isclose(float(target.sum(-1)[0]), 1.0, rel_tol=1e-12)
