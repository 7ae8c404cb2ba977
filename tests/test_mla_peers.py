"""MLA peers on the CPU: the SDPA formulation against the reference; FlashInfer declared honestly."""
import pytest
import torch

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.ops.mla import reference as ref
from opmap.peers.mla import sdpa
from opmap.harness.fixtures.mla import make_cache, sparse_indices
from opmap.core.specs import AttentionSpec
from opmap.core.tolerance import assert_close

R, DR, H = 32, 16, 4


def test_sdpa_decode_and_sparse():
    g = torch.Generator().manual_seed(0)
    lens = [0, 1, 17, 50]
    pc = make_cache(lens, R, DR, 16, torch.float32, gen=g)
    qn, qp = torch.randn(4, H, R, generator=g), torch.randn(4, H, DR, generator=g)
    args = (qn, qp, pc.cache, pc.seq_lens, pc.block_tables)
    assert_close(sdpa.mla_decode(*args, scale=0.25), ref.mla_decode(*args, scale=0.25))
    idx = sparse_indices(lens, 8, gen=g)
    assert_close(sdpa.mla_sparse_decode(*args, idx, scale=0.25),
                 ref.mla_sparse_decode(*args, idx, scale=0.25))
    with pytest.raises(InputError, match="return_lse"):
        sdpa.mla_decode(*args, scale=0.25, return_lse=True)


def test_sdpa_prefill_with_prefix_and_fp8():
    g = torch.Generator().manual_seed(1)
    Dn, Dv = 8, 16
    lens, cu = [9, 30], torch.tensor([0, 9, 13], dtype=torch.int32)  # full prompt; 4 after a prefix
    for fp8 in (False, True):
        pc = make_cache(lens, R, DR, 16, torch.float32, gen=g, fp8=fp8)
        qn, qp = torch.randn(13, H, Dn, generator=g), torch.randn(13, H, DR, generator=g)
        wk, wv = torch.randn(H, Dn, R, generator=g) / 4, torch.randn(H, Dv, R, generator=g) / 4
        args = (qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables)
        for causal in (True, False):
            assert_close(sdpa.mla_prefill(*args, scale=0.2, causal=causal, kv_scale=pc.kv_scale),
                         ref.mla_prefill(*args, scale=0.2, causal=causal, kv_scale=pc.kv_scale))


def test_flashinfer_declared():
    fi = registry.get("attention", "mla-flashinfer")
    spec = AttentionSpec(kind="mla", num_heads=128, num_kv_heads=1, head_dim=576, head_dim_v=512,
                         page_size=64, arch="sm90")
    assert fi.validate(spec) == []
    assert any("R=512" in r for r in fi.validate(spec.replace(head_dim=40, head_dim_v=32)))
    assert any("phase" in r for r in fi.validate(spec.replace(phase="prefill")))
    reason = fi.available()
    assert reason is None or "flashinfer" in reason or "CUDA" in reason
