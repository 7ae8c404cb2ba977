"""The one-token MoE (backend triton-gemv, kernels/moe/one_token.py) against the fp32 reference in the
interpreter (fp16 / fp32, small odd sizes: H and I off the K tile, top_k 1 to E), every routing form,
its refusals, and where the selector must and must not pick it."""
import dataclasses

import pytest
import torch

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.core.select import select
from opmap.core.specs import MoESpec
from opmap.core.tolerance import assert_close
from opmap.ops.moe import reference, routing

one_token = pytest.importorskip("opmap.kernels.moe.one_token")


def _case(E, H, I, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    x = torch.randn(1, H, generator=g).to(dtype)
    logits = torch.randn(1, E, generator=g)
    return x, logits, w13, w2


@pytest.mark.parametrize("E,k,H,I,dtype,kw", [
    (8, 2, 64, 48, torch.float16, {}),
    (4, 4, 40, 20, torch.float32, {}),  # top_k == E
    (6, 1, 33, 17, torch.float32, dict(renormalize=False)),  # one slot: no split of the down projection
    (16, 3, 300, 24, torch.float16, dict(router="sigmoid", bias=True, routed_scaling=2.5)),  # H > one K tile
    (16, 4, 32, 16, torch.float16, dict(router="sigmoid", n_group=4, topk_group=2, bias=True)),  # groups
    (12, 5, 48, 257, torch.float32, dict(n_group=3, topk_group=2, renormalize=False)),  # I > one K tile
])
def test_one_token_matches_the_reference(E, k, H, I, dtype, kw):
    x, logits, w13, w2 = _case(E, H, I, dtype, seed=E * 100 + H)
    kw = dict(kw)
    if kw.pop("bias", False):
        kw["score_bias"] = torch.randn(E, generator=torch.Generator().manual_seed(1))
    out = one_token.moe(x, logits, w13, w2, k, **kw)
    want = reference.moe(x.float(), logits, w13.float(), w2.float(), k, **kw)
    assert out.dtype == x.dtype and out.shape == (1, H)
    assert_close(out, want, dtype)
    # its route entry picks the experts torch's routing picks
    w_ref, ids_ref = routing.route(logits, k, **kw)
    w, ids = registry.get("moe", "triton-gemv").fn("route")(logits, k, **kw)
    order, order_ref = ids.argsort(-1), ids_ref.argsort(-1)
    assert torch.equal(ids.gather(-1, order), ids_ref.to(ids.dtype).gather(-1, order_ref))
    assert_close(w.gather(-1, order), w_ref.gather(-1, order_ref), torch.float32)


def test_a_strided_score_bias_routes_as_a_contiguous_one():
    x, logits, w13, w2 = _case(16, 32, 16, torch.float32, seed=11)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(2))[::2]  # stride 2
    kw = dict(router="sigmoid", score_bias=bias)
    assert_close(one_token.moe(x, logits, w13, w2, 3, **kw), reference.moe(x, logits, w13, w2, 3, **kw), torch.float32)


def test_tiles_from_config_give_the_same_result():
    x, logits, w13, w2 = _case(8, 96, 80, torch.float32, seed=3)
    base = one_token.moe(x, logits, w13, w2, 3)
    for cfg in (dict(BLOCK_N=4, BLOCK_K=32), dict(DOWN_BLOCK_N=2, BLOCK_K=16), dict(num_warps=2)):
        assert_close(one_token.moe(x, logits, w13, w2, 3, config=cfg), base, torch.float32)


def test_token_and_logits_as_rows_of_larger_tensors():
    x, logits, w13, w2 = _case(8, 64, 32, torch.float32, seed=5)
    xs = torch.cat([torch.zeros(2, 64), x]).t().contiguous().t()[2:3]  # a row of a column-major tensor
    ls = torch.cat([logits, logits, logits])[1:2]  # a row at an offset
    with pytest.raises(InputError, match="x"):  # the op's contract: stride 1 along H
        one_token.moe(xs, ls, w13, w2, 2)
    xs = torch.cat([torch.zeros(2, 64), x])[2:3]
    assert_close(one_token.moe(xs, ls, w13, w2, 2), reference.moe(x, logits, w13, w2, 2), torch.float32)


def test_refusals_name_the_argument():
    x, logits, w13, w2 = _case(8, 32, 16, torch.float32, seed=7)
    with pytest.raises(InputError, match="x"):
        one_token.moe(torch.cat([x, x]), torch.cat([logits, logits]), w13, w2, 2)
    with pytest.raises(InputError, match="config"):
        one_token.moe(x, logits, w13, w2, 2, config=dict(BLOCK_K=24))
    with pytest.raises(InputError, match="config"):
        one_token.moe(x, logits, w13, w2, 2, config=dict(TILE=16))
    with pytest.raises(InputError, match="top_k"):
        one_token.moe(x, logits, w13, w2, 9)


def test_selected_only_where_it_serves_and_not_above_triton():
    spec = MoESpec(num_experts=128, top_k=8, hidden=2048, intermediate=768, tokens=1, arch="sm90")
    assert registry.get("moe", "triton-gemv").validate(spec) == []
    # not the selector's choice until a baseline row shows it ahead
    assert select("moe", spec).backend.name == "triton"
    # it refuses what it does not serve: more tokens, an unknown count, quantised experts
    for s in (dataclasses.replace(spec, tokens=2), dataclasses.replace(spec, tokens=None),
              dataclasses.replace(spec, weight_dtype="int4", group_size=128)):
        with pytest.raises(Exception):
            select("moe", s, backend="triton-gemv")
    assert select("moe", spec, backend="triton-gemv").backend.name == "triton-gemv"
