"""Statistics for sampler checks: chi-square with pooled tails and a total-variation bound."""
from __future__ import annotations

import torch


def chi2_tv(counts, probs, n):
    """(p-value with tails pooled to expected >= 5, TV, TV bound, draws outside the support)."""
    # heavy: scipy, for this test only
    from scipy import stats

    counts, probs = counts.double().cpu(), probs.double().cpu()
    outside = int(counts[probs == 0].sum())
    e = probs * n
    order = torch.argsort(e, descending=True)
    e, o = e[order], counts[order]
    big = e >= 5
    obs = torch.cat([o[big], o[~big].sum().reshape(1)])
    ex = torch.cat([e[big], e[~big].sum().reshape(1)])
    if ex[-1] < 5:
        obs = torch.cat([obs[:-2], (obs[-2] + obs[-1]).reshape(1)])
        ex = torch.cat([ex[:-2], (ex[-2] + ex[-1]).reshape(1)])
    pval = float(stats.chisquare(obs.numpy(), ex.numpy() * float(obs.sum() / ex.sum())).pvalue) if len(ex) > 1 else 1.0
    tv = 0.5 * float((counts / n - probs).abs().sum())
    # E[TV] <= 0.5 sum sqrt(p(1-p)/n); 1.25x that leaves room for TV's own fluctuation.
    return pval, tv, 0.625 * float(torch.sqrt(probs * (1 - probs) / n).sum()) + 1e-3, outside
