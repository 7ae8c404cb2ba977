"""The public op API on the GPU: the selector's backend for bf16 CUDA tensors, the decode call's
cached workspace under CUDA-graph capture, and the custom op under torch.compile(fullgraph=True)."""
import pytest
import torch

import opmap
from opmap.core import registry
from opmap.harness.fixtures.attention import make_paged, make_query

pytestmark = pytest.mark.gpu


def _decode_args(B, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    pc = make_paged([L] * B, 8, 128, 16, dtype=torch.bfloat16, generator=g, device="cuda")
    q, _ = make_query([1] * B, 32, 128, dtype=torch.bfloat16, generator=g, device="cuda")
    return q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, 128 ** -0.5


@pytest.mark.parametrize("B,L", [(1, 4099), (3, 700), (64, 257)])
def test_public_decode_matches_the_reference_and_replays_in_a_graph(B, L):
    args = _decode_args(B, L)
    ref = registry.get("attention", "reference").fn("decode")(*args[:5], scale=args[5])
    eager = opmap.attention_decode(*args)
    assert (eager.float() - ref.float()).abs().max().item() < 2e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # the capture stream has no cached workspace yet: made during capture
        out = opmap.attention_decode(*args)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    args[0].copy_(torch.randn_like(args[0]))  # new queries, same graph
    g.replay()
    want = opmap.attention_decode(*args)
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_custom_decode_under_torch_compile():
    args = _decode_args(2, 300, seed=1)
    f = torch.compile(lambda q: torch.ops.opmap.attention_decode(q, *args[1:])[0] * 2, fullgraph=True)
    want = opmap.attention_decode(*args) * 2
    assert torch.equal(f(args[0]), want)


def test_public_ops_pick_the_gpu_backends():
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    ref = registry.get("rmsnorm", "reference").fn("rmsnorm")(x, w, 1e-6)
    assert torch.allclose(opmap.rmsnorm(x, w).float(), ref.float(), atol=2e-2, rtol=2e-2)
    from opmap.api.dispatch import resolve
    from opmap.core.specs import NormSpec

    b, _ = resolve("rmsnorm", NormSpec(arch=opmap.api.dispatch.arch_of(x), hidden=4096, dtype="bf16"), "rmsnorm")
    assert b.name == "triton"
