"""Logits processors: Triton penalties / temperature vs the reference, the reference against an
independent per-token loop, filters, logprobs, penalty state helpers, custom ops (opcheck)."""
import math

import pytest
import torch

from opmap.core.contract import InputError
from opmap.kernels.sampling import processors as P
from opmap.ops.sampling import reference as R
from opmap.engine.sampling_tensors import penalty_state, update_output_counts
from opmap.core.tolerance import assert_close

# The Triton interpreter's own NumPy deprecation and overflow noise (-inf - -inf in masked lanes).
pytestmark = [pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def _state(B, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    pm = torch.rand(B, V, generator=g) < 0.1
    cnt = (torch.randint(0, 4, (B, V), generator=g) * (torch.rand(B, V, generator=g) < 0.05)).int()
    rep = torch.tensor([1.0, 1.3, 0.8, 2.0, 1.1])[:B]
    fr = torch.tensor([0.0, 0.5, -0.2, 1.0, 0.1])[:B]
    pr = torch.tensor([0.0, 0.3, 0.1, -1.0, 0.7])[:B]
    return pm, cnt, rep, fr, pr


def test_reference_penalties_match_a_token_loop():
    B, V = 3, 40
    x = torch.randn(B, V)
    pm, cnt, rep, fr, pr = _state(B, V)
    out = x.clone()
    R.apply_penalties(out, pm, cnt, rep, fr, pr)
    for b in range(B):
        for j in range(V):
            v = float(x[b, j])
            if pm[b, j] or cnt[b, j] > 0:
                v = v / float(rep[b]) if v > 0 else v * float(rep[b])
            v -= float(fr[b]) * int(cnt[b, j]) + float(pr[b]) * (int(cnt[b, j]) > 0)
            assert math.isclose(float(out[b, j]), v, rel_tol=1e-6, abs_tol=1e-6)


@pytest.mark.parametrize("dtype,V", [(torch.float32, 3001), (torch.float16, 8193)])
def test_triton_penalties_and_temperature(dtype, V):
    B = 5
    wide = torch.randn(B, V + 9).to(dtype)
    x = wide[:, 4:V + 4]
    pm, cnt, rep, fr, pr = _state(B, V, seed=V)
    a, b = x.clone(), x.clone()
    P.apply_penalties(a, pm, cnt, rep, fr, pr)
    R.apply_penalties(b, pm, cnt, rep, fr, pr)
    assert_close(a, b)
    T = torch.tensor([0.0, 0.5, 1.0, 2.0, 0.7])
    P.apply_temperature(a, T)
    R.apply_temperature(b, T)
    assert_close(a, b)
    assert torch.equal(a[0], b[0])  # temperature 0 leaves the row alone
    before = wide.clone()
    P.apply_temperature(x, T)  # strided, in place: the columns outside the view stay as they were
    assert torch.equal(wide[:, :4], before[:, :4]) and torch.equal(wide[:, V + 4:], before[:, V + 4:])
    ref = before[:, 4:V + 4].clone()
    R.apply_temperature(ref, T)
    assert_close(x, ref)


def test_filters_and_logprobs():
    x = torch.randn(3, 64)
    k = torch.tensor([5, 0, 0], dtype=torch.int32)
    p = torch.tensor([1.0, 0.5, 1.0])
    mp = torch.tensor([0.0, 0.0, 0.3])
    out = R.apply_filters(x, k, p, mp)
    assert int(torch.isfinite(out[0]).sum()) == 5
    assert torch.equal(torch.isfinite(out), R.support_mask(x, k, p, mp))
    lp = torch.log_softmax(x, -1)
    kept = torch.exp(lp[1][torch.isfinite(out[1])])
    assert kept.sum() >= 0.5 > kept.sum() - kept.min()  # the smallest prefix reaching top_p
    assert torch.all(x[1][torch.isfinite(out[1])].min() > x[1][~torch.isfinite(out[1])])
    ids = torch.tensor([3, 7, 0])
    chosen, tv, ti = R.logprobs(x, ids, 4)
    assert_close(chosen, lp.gather(1, ids[:, None])[:, 0])
    assert torch.equal(ti, lp.topk(4, -1).indices)
    with pytest.raises(InputError, match="^n"):
        R.logprobs(x, ids, 65)


def test_penalty_state_helpers():
    mask, counts = penalty_state([[1, 2, 2], [5]], [[3, 3], []], vocab=8)
    assert mask[0].nonzero().flatten().tolist() == [1, 2] and counts[0, 3] == 2 and counts[1].sum() == 0
    update_output_counts(counts, torch.tensor([3, 6]), valid=torch.tensor([True, False]))
    assert counts[0, 3] == 3 and counts[1, 6] == 0
    with pytest.raises(InputError, match=r"^prompts\[1\]"):
        penalty_state([[1], [9]], None, vocab=8)


@pytest.mark.parametrize("fn", [P.apply_penalties, R.apply_penalties])
def test_penalty_bad_input(fn):
    B, V = 2, 16
    x = torch.randn(B, V)
    pm, cnt, rep, fr, pr = _state(B, V)
    with pytest.raises(InputError, match="^prompt_mask"):
        fn(x, pm.int(), cnt, rep, fr, pr)
    with pytest.raises(InputError, match="^output_counts"):
        fn(x, pm, cnt[:, :8], rep, fr, pr)
    with pytest.raises(InputError, match="^frequency"):
        fn(x, pm, cnt, rep, fr[:1], pr)


def test_custom_ops_opcheck():
    import opmap  # noqa: F401  (registers torch.ops.opmap.*)

    B, V = 2, 40
    x = torch.randn(B, V)
    pm, cnt, rep, fr, pr = _state(B, V)
    torch.library.opcheck(torch.ops.opmap.apply_penalties.default, (x.clone(), pm, cnt, rep, fr, pr))
    torch.library.opcheck(torch.ops.opmap.apply_temperature.default, (x.clone(), torch.tensor([0.5, 0.0])))
    args = (x, torch.tensor([1.0, 0.0]), torch.tensor([5, 0], dtype=torch.int32), torch.tensor([0.9, 1.0]),
            torch.tensor([0.0, 0.0]), torch.tensor([1, 2]), torch.tensor([0, 0]))
    torch.library.opcheck(torch.ops.opmap.sample.default, args)
    ids, invalid = torch.ops.opmap.sample(*args)
    assert torch.equal(ids, R.sample(*args)[0]) and not invalid.any()
