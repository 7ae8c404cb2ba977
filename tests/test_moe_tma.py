"""The TMA MoE route (kernels/moe/tma_moe.py: permute, persistent TMA grouped GEMMs, combine) against
the fp32 reference in the interpreter (fp16 / fp32, tiny shapes), at the tile boundaries: K and N
tails inside a tile, an expert with no rows, every pair on one expert (several row blocks), one
token, top_k == num_experts, the grouped routing; and the inputs it refuses."""
import pytest
import torch

from opmap.core.contract import InputError
from opmap.core.tolerance import assert_close
from opmap.ops.moe import reference
from opmap.ops.moe.reference import quantize_experts
from test_moe_triton import _weights, routed_case

tma_moe = pytest.importorskip("opmap.kernels.moe.tma_moe")


CASES = [
    # T, H, I, E, top_k, dtype, routing kwargs, config
    (1, 32, 24, 8, 2, torch.float16, {}, None),
    (3, 40, 20, 4, 4, torch.float32, {}, None),  # top_k == num_experts; H, I inside one tile
    (37, 72, 40, 8, 3, torch.float16, {}, dict(BN=32, BK=32)),  # K and N tails of every tile
    (64, 32, 16, 16, 4, torch.float16,
     dict(router="sigmoid", n_group=4, topk_group=2, routed_scaling=2.5, bias=True), dict(BN=32, BK=32, FLATTEN=0)),
    (17, 36, 12, 6, 2, torch.float32, dict(renormalize=False), dict(BM=128, BN=32, BK=32, per_sm=2)),
]


@pytest.mark.parametrize("T,H,I,E,k,dtype,kw,config", CASES,
                         ids=[f"T{c[0]}-H{c[1]}-I{c[2]}-E{c[3]}-k{c[4]}-{str(c[5])[6:]}" for c in CASES])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_tma_route_matches_reference(T, H, I, E, k, dtype, kw, config):
    x, logits, w13, w2, kw = routed_case(T, H, I, E, k, dtype, kw)
    got = tma_moe.moe(x, logits, w13, w2, k, config=config, **kw)
    want = reference.moe(x.float(), logits, w13.float(), w2.float(), k, **kw)
    assert got.dtype == dtype and got.shape == (T, H)
    assert_close(got, want, dtype, scale=2, what="triton-tma vs reference")


def test_every_pair_on_one_expert_spans_several_row_blocks():
    # 150 pairs on expert 2 -> three 64-row blocks, the last one partly padding; with 4 programs
    # (the interpreter's) each walks several tiles of the persistent loop
    T, H, I, E = 150, 32, 16, 4
    w13, w2 = _weights(E, H, I, torch.float32)
    x = torch.randn(T, H)
    logits = torch.full((T, E), -5.0)
    logits[:, 2] = 5.0
    got = tma_moe.moe(x, logits, w13, w2, 1, config=dict(BN=32, BK=32))
    assert_close(got, reference.moe(x, logits, w13, w2, 1), torch.float32, what="one expert")


def test_no_tokens():
    w13, w2 = _weights(4, 16, 8, torch.float32)
    out = tma_moe.moe(torch.empty(0, 16), torch.empty(0, 4), w13, w2, 2)
    assert out.shape == (0, 16)


def test_refuses_what_it_cannot_read():
    w13, w2 = _weights(4, 36, 10, torch.float16)  # 10 fp16 values: 20-byte rows
    with pytest.raises(InputError, match="16 bytes"):
        tma_moe.moe(torch.randn(3, 36).half(), torch.randn(3, 4), w13, w2, 2)
    w13, w2 = _weights(4, 32, 16, torch.float32)
    q13, s13, _ = quantize_experts(w13, "int4", 16)
    q2, s2, _ = quantize_experts(w2, "int4", 16)
    with pytest.raises(InputError, match="w13_scale"):
        tma_moe.moe(torch.randn(3, 32), torch.randn(3, 4), q13, q2, 2, w13_scale=s13, w2_scale=s2)
    with pytest.raises(InputError, match="config"):
        tma_moe.moe(torch.randn(3, 32), torch.randn(3, 4), w13, w2, 2, config=dict(BM=32))
    with pytest.raises(InputError, match="config"):
        tma_moe.moe(torch.randn(3, 32), torch.randn(3, 4), w13, w2, 2, config=dict(FLATTEN=2))


def test_the_backend_declares_the_rows_it_needs():
    from opmap.core import registry
    from opmap.core.specs import MoESpec

    b = registry.get("moe", "triton-tma")
    ok = MoESpec(arch="sm90", phase="prefill", num_experts=128, top_k=8, hidden=2048, intermediate=768, dtype="bf16",
                 weight_dtype="bf16", tokens=4096)
    assert b.validate(ok) == []
    bad = MoESpec(arch="sm90", phase="prefill", num_experts=8, top_k=2, hidden=2048, intermediate=1410,
                  dtype="bf16", weight_dtype="bf16", tokens=4096)
    assert any("16-byte rows" in r for r in b.validate(bad))
    quant = MoESpec(arch="sm90", phase="prefill", num_experts=8, top_k=2, hidden=2048, intermediate=768,
                    dtype="bf16", weight_dtype="int4", group_size=128, tokens=4096)
    assert b.validate(quant)
