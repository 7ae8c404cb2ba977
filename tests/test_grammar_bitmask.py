"""Grammar bitmask apply: Triton kernel and the xgrammar peer vs the reference and vs an
independent masked_fill of a per-token mask, at vocab 128000 / 128001 / 128010, strided logits,
fp32 / fp16 (bf16 on the GPU), row subsets, bad input, opcheck."""
import math

import pytest
import torch

from opmap.core.contract import InputError
from opmap.kernels.grammar import bitmask as K
from opmap.ops.grammar import reference as R

# The Triton interpreter's own NumPy deprecation and overflow noise (-inf - -inf in masked lanes).
pytestmark = [pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def _case(V, dtype, B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(B, V + 13, generator=g).to(dtype)
    logits = wide[:, 5:V + 5]  # row stride V + 13
    allowed = torch.rand(B, V, generator=g) < 0.3
    return wide, logits, allowed


def _masked_fill(logits, allowed, rows=None):
    out = logits.clone()
    sel = torch.zeros(logits.shape[0], dtype=torch.bool)
    sel[rows if rows is not None else slice(None)] = True
    return out.masked_fill(~allowed & sel[:, None], -math.inf)


def test_pack_roundtrip_and_bit_order():
    allowed = torch.zeros(1, 70, dtype=torch.bool)
    allowed[0, [0, 31, 32, 69]] = True
    words = R.pack_bitmask(allowed)
    assert words.shape == (1, 3) and words.dtype == torch.int32
    assert words[0, 0] == (1 | -(2**31)) and words[0, 1] == 1 and words[0, 2] == 1 << 5
    assert torch.equal(R.unpack_bitmask(words, 70), allowed)


@pytest.mark.parametrize("V", [128000, 128001, 128010])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_apply_matches_masked_fill(V, dtype):
    wide, logits, allowed = _case(V, dtype, seed=V)
    bm = R.pack_bitmask(allowed)
    before = wide.clone()
    want = _masked_fill(logits, allowed)
    K.apply_bitmask(logits, bm)
    assert torch.equal(logits, want)
    assert torch.equal(wide[:, :5], before[:, :5]) and torch.equal(wide[:, V + 5:], before[:, V + 5:])
    ref = before[:, 5:V + 5].clone()
    R.apply_bitmask(ref, bm)
    assert torch.equal(ref, want)


@pytest.mark.parametrize("impl", ["triton", "reference", "xgrammar"])
def test_row_subset_leaves_other_rows_alone(impl):
    if impl == "xgrammar":
        pytest.importorskip("xgrammar")
        from opmap.peers.grammar.xgrammar_apply import apply_bitmask as fn
    else:
        fn = K.apply_bitmask if impl == "triton" else R.apply_bitmask
    V = 128001
    _, logits, allowed = _case(V, torch.float32, B=4, seed=1)
    rows = torch.tensor([3, 1], dtype=torch.int32)
    want = _masked_fill(logits, allowed, rows.long())
    fn(logits, R.pack_bitmask(allowed), rows)
    assert torch.equal(logits, want)
    fn(logits, R.pack_bitmask(allowed), torch.empty(0, dtype=torch.int64))  # nothing to do
    assert torch.equal(logits, want)


@pytest.mark.parametrize("fn", [K.apply_bitmask, R.apply_bitmask])
def test_bad_input(fn):
    logits = torch.randn(2, 100)
    bm = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(InputError, match="^bitmask"):
        fn(logits, bm[:, :3])
    with pytest.raises(InputError, match="^bitmask"):
        fn(logits, bm.long())
    with pytest.raises(InputError, match="^logits"):
        fn(logits.int(), bm)
    with pytest.raises(InputError, match="^rows"):
        fn(logits, bm, torch.tensor([0, 2]))
    with pytest.raises(InputError, match="^rows"):
        fn(logits, bm, torch.tensor([0.0]))


def test_custom_op_opcheck():
    import opmap  # noqa: F401  (registers torch.ops.opmap.*)

    logits = torch.randn(3, 70)
    bm = R.pack_bitmask(torch.rand(3, 70) < 0.5)
    torch.library.opcheck(torch.ops.opmap.apply_bitmask.default, (logits.clone(), bm, None))
    torch.library.opcheck(torch.ops.opmap.apply_bitmask.default, (logits.clone(), bm, torch.tensor([2])))
    out = logits.clone()
    torch.ops.opmap.apply_bitmask(out, bm)
    assert torch.equal(out, _masked_fill(logits, R.unpack_bitmask(bm, 70)))


@pytest.mark.parametrize("impl", ["triton", "reference", "xgrammar"])
def test_padding_bits_never_write_past_the_row(impl):
    """The last word's bits past V must not reach memory after the row (xgrammar's CPU apply
    does unless the adapter sets those bits)."""
    if impl == "xgrammar":
        pytest.importorskip("xgrammar")
        from opmap.peers.grammar.xgrammar_apply import apply_bitmask as fn
    else:
        fn = K.apply_bitmask if impl == "triton" else R.apply_bitmask
    for V in (5, 31, 33):
        buf = torch.randn(3, 64)
        before = buf.clone()
        logits = buf[:, :V]
        bm = torch.full((3, (V + 31) // 32), 1, dtype=torch.int32)  # only token 0 (and 32) allowed
        fn(logits, bm)
        assert torch.equal(buf[:, V:], before[:, V:]), (impl, V)
        assert torch.isinf(logits[:, 1:]).sum() == 3 * (V - 1) - (3 if V > 32 else 0)
