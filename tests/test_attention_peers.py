"""Peer adapters on the CPU where they run there: FlexAttention (eager) over the paged cache, and
SDPA's FlashAttention backend (PyTorch's CPU flash kernel) on contiguous KV. The CUDA-only SDPA
backends (cuDNN, memory-efficient) and compiled flex are checked in tests/gpu."""
import warnings

import pytest
import torch

from opmap.core import registry

from opmap.core import select

from opmap.core import specs
from opmap.core.contract import InputError
from opmap.peers.attention import flex
from opmap.peers.attention import sdpa
from opmap.ops.attention import reference as R
from opmap.harness.fixtures.attention import make_paged, make_query
from opmap.core.tolerance import assert_close

warnings.filterwarnings("ignore", message=".*flex_attention.*")


def test_flex_paged_prefill_and_decode():
    seq, ql = [17, 40, 0, 5], [17, 6, 0, 1]
    pc = make_paged(seq, 2, 64, 16, dtype=torch.float32, shared=True)
    q, cu = make_query(ql, 8, 64, dtype=torch.float32)
    kw = dict(scale=0.125, return_lse=True, window=9, soft_cap=5.0)
    out, lse = flex.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, **kw)
    ref, rl = R.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, **kw)
    assert_close(out, ref, torch.float32, scale=4.0)
    assert_close(lse, rl, torch.float32, scale=4.0, what="lse (flex returns natural log)")
    qd, _ = make_query([1] * 4, 8, 64, dtype=torch.float32)
    out, lse = flex.decode(qd, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.125, return_lse=True)
    ref, rl = R.decode(qd, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.125, return_lse=True)
    assert_close(out, ref, torch.float32, scale=4.0)
    assert torch.all(out[2] == 0) and torch.all(torch.isneginf(lse[2]))
    dup = pc.block_tables.clone()
    dup[1, 1] = dup[1, 0]  # a page listed twice in one sequence cannot be a flex mask: refused
    with pytest.raises(InputError, match="block_tables"):
        flex.decode(qd, pc.k_cache, pc.v_cache, pc.seq_lens, dup, scale=0.125)
    with pytest.raises(InputError, match="k_cache"):
        f8 = make_paged([5], 2, 64, 16, fp8=True)
        flex.prefill(q[:5], f8.k_cache, f8.v_cache, cu[:2].clone(), f8.seq_lens, f8.block_tables, scale=0.1,
                     k_scale=f8.k_scale, v_scale=f8.v_scale)


def test_sdpa_flash_adapter_on_contiguous_kv():
    seq, ql = [17, 40, 0, 5], [17, 0, 0, 1]
    pc = make_paged(seq, 2, 64, 16, dtype=torch.float32)
    k, v = pc.contiguous()
    q, cu = make_query(ql, 8, 64, dtype=torch.float32)
    ref = R.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, scale=0.125)
    out = sdpa.sdpa_flash_prefill(q, k, v, cu, pc.seq_lens, None, scale=0.125)
    assert_close(out, ref, torch.float32, scale=4.0)
    with pytest.raises(InputError, match="soft_cap"):
        sdpa.sdpa_flash_prefill(q, k, v, cu, pc.seq_lens, None, scale=0.125, soft_cap=3.0)
    with pytest.raises(InputError, match="k_cache"):
        sdpa.sdpa_flash_prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, None, scale=0.125)


def test_selector_and_declarations():
    reg = {b.name: b for b in registry.backends("attention")}
    for name in ("reference", "triton", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flex", "flashinfer"):
        assert name in reg
    dec = specs.AttentionSpec(arch="sm90", phase="decode", kv_dtype="fp8", cuda_graph=True)
    ch = select.select("attention", dec, runtime=False)
    assert ch.name == "gluon-fp8"  # fp8 at head dim 128: the Gluon kernel's backend
    assert select.select("attention", dec.replace(kv_dtype="bf16"), runtime=False).name == "triton"
    assert any(c.name == "sdpa_cudnn" and c.level == "paged" for c in ch.trace)
    contig = specs.AttentionSpec(arch="sm90", phase="prefill", paged=False)
    assert select.select("attention", contig, runtime=False).name == "sdpa_cudnn"
    chunked = specs.AttentionSpec(arch="sm90", phase="mixed", paged=False)
    assert select.select("attention", chunked, runtime=False).name == "sdpa_flash"
    assert select.select("attention", specs.AttentionSpec(arch="cpu"), runtime=False).name == "reference"
    assert reg["flashinfer"].available is not None
    for op in ("kv_append", "attention_merge"):
        assert select.select(op, specs.spec_for(op, arch="sm90"), runtime=False).name == "triton"
