"""A NaN in a query comes out NaN in both outputs of a decode (the attention output and its LSE),
in the reference and every backend that runs here, whether the keys are split or not; the other
heads and sequences are untouched. (The Triton decode gave LSE -inf for that head.)"""
import math

import pytest
import torch

import opmap
from opmap.core import registry
from opmap.core.contract import InputError
from opmap.core.select import BackendError

# The interpreter's NumPy computes the NaN rows as the GPU does, and warns about them; and its own
# scalar conversion of a one-element array.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")]

B, H, HK, D, PAGES, PAGE = 2, 4, 2, 16, 8, 16
SEQ_LENS = torch.tensor([20, 33], dtype=torch.int32)
TABLES = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)


def _backends(entry: str) -> list:
    registry.load_all()
    return [b.name for b in registry.backends("attention") if entry in b.impl]


def _check(out, lse, ref_out, ref_lse):
    nan = torch.zeros(B, H, dtype=torch.bool)
    nan[0, 1] = True
    assert torch.isnan(out[0, 1]).all() and torch.isnan(lse[0, 1]), lse
    torch.testing.assert_close(out[~nan], ref_out[~nan], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[~nan], ref_lse[~nan], atol=2e-5, rtol=2e-5)


def _runs(fn):
    """The backend's outputs, or None where it does not serve this device or spec (it says so)."""
    try:
        return fn()
    except BackendError as e:
        assert "cannot serve" in str(e), e
        return None


@pytest.mark.parametrize("backend", _backends("decode"))
@pytest.mark.parametrize("split_tokens", [None, 16])
def test_attention_decode_nan_query(backend, split_tokens):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, D, generator=g)
    q[0, 1, 3] = math.nan
    kc, vc = torch.randn(PAGES, PAGE, HK, D, generator=g), torch.randn(PAGES, PAGE, HK, D, generator=g)
    ws = None
    if split_tokens:  # several splits per sequence: the combine kernel merges the NaN partials
        from opmap.kernels.attention.splitkv import make_workspace

        ws = make_workspace(B, H, D, device="cpu", max_seq_len=48, split_tokens=split_tokens)
    ref = opmap.attention_decode(q, kc, vc, SEQ_LENS, TABLES, 0.25, return_lse=True, backend="reference")
    got = _runs(lambda: opmap.attention_decode(q, kc, vc, SEQ_LENS, TABLES, 0.25, return_lse=True, backend=backend,
                                               workspace=ws if backend == "triton" else None))
    if got is not None:
        _check(*got, *ref)


def test_some_attention_backend_runs_here():
    assert {"reference", "triton"} <= set(_backends("decode"))


@pytest.mark.parametrize("backend", _backends("mla_decode"))
def test_mla_decode_nan_query(backend):
    g = torch.Generator().manual_seed(1)
    R, DR = 32, 16
    qn, qp = torch.randn(B, H, R, generator=g), torch.randn(B, H, DR, generator=g)
    qn[0, 1, 3] = math.nan
    cache = torch.randn(PAGES, PAGE, R + DR, generator=g)
    ref = opmap.mla_decode(qn, qp, cache, SEQ_LENS, TABLES, 0.25, return_lse=True, backend="mla-reference")
    try:
        got = _runs(lambda: opmap.mla_decode(qn, qp, cache, SEQ_LENS, TABLES, 0.25, return_lse=True, backend=backend))
    except InputError as e:  # a backend without an LSE: its output alone
        assert e.arg == "return_lse", e
        out = _runs(lambda: opmap.mla_decode(qn, qp, cache, SEQ_LENS, TABLES, 0.25, backend=backend))
        got = None if out is None else (out, ref[1])
    if got is not None:
        _check(*got, *ref)
