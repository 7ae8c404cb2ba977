"""Triton LSE merge against the reference (interpreter), including empty (-inf) states."""
import pytest
import torch

from opmap.core.contract import InputError
from opmap.kernels.attention import merge as M
from opmap.ops.attention import reference as R
from opmap.api.custom_ops import attention_merge
from opmap.core.tolerance import assert_close


@pytest.mark.parametrize("T,H,D,dtype", [(7, 8, 64, torch.float16), (3, 5, 96, torch.float32)])
def test_merge_matches_reference(T, H, D, dtype):
    g = torch.Generator().manual_seed(5)
    oa, ob = (torch.randn(T, H, D, generator=g).to(dtype) for _ in range(2))
    la, lb = (torch.randn(T, H, generator=g) * 4 for _ in range(2))
    la[0, 0] = float("-inf")
    lb[1, 1] = float("-inf")
    la[2, :] = float("-inf")
    lb[2, :] = float("-inf")
    o, lse = M.merge(oa, la, ob, lb)
    ro, rl = R.merge(oa, la, ob, lb)
    assert_close(o, ro.float(), dtype)
    assert_close(lse, rl, torch.float32)
    assert torch.all(o[2] == 0) and torch.all(torch.isneginf(lse[2]))


def test_merge_bad_input_and_opcheck():
    oa = torch.randn(2, 4, 64).half()
    la = torch.randn(2, 4)
    with pytest.raises(InputError, match="lse_b"):
        M.merge(oa, la, oa, la.half())
    with pytest.raises(InputError, match="o_b"):
        M.merge(oa, la, oa[:1], la)
    torch.library.opcheck(attention_merge, (oa, la, oa.clone(), la.clone()))
