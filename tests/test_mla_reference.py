"""The MLA reference against independent formulations (SDPA in fp64 on gathered KV), its input
checks, and the registry declarations (MLA backends never claim GQA specs)."""
import pytest
import torch
import torch.nn.functional as F

from opmap.core import registry

from opmap.core import select
from opmap.core.contract import InputError
from opmap.ops.mla import reference as ref
from opmap.harness.fixtures.mla import make_cache, sparse_indices
from opmap.core.specs import AttentionSpec, KVAppendSpec
from opmap.core.tolerance import assert_close

R, DR, H = 32, 16, 4


def _sdpa_decode(q_nope, q_pe, vals, tables, lens, positions=None, scale=0.3):
    """fp64 SDPA over the gathered tokens, one sequence at a time."""
    out = []
    for b, n in enumerate(lens):
        pos = torch.arange(n) if positions is None else positions[b]
        page = vals.shape[1]
        rows = vals[tables[b].long()[pos // page], pos % page].double()
        q = torch.cat([q_nope[b], q_pe[b]], -1).double()[None, :, None]  # [1, H, 1, D]
        k = rows[None, None].expand(1, q.shape[1], -1, -1)
        o = F.scaled_dot_product_attention(q, k, k[..., :R], scale=scale)
        out.append(o[0, :, 0] if n or positions is not None and len(pos) else torch.zeros(q.shape[1], R))
    return torch.stack(out)


@pytest.mark.parametrize("page", [1, 16])
def test_decode_matches_sdpa(page):
    g = torch.Generator().manual_seed(0)
    lens = [1, 16, 17, 33]
    pc = make_cache(lens, R, DR, page, torch.float32, gen=g)
    qn, qp = torch.randn(4, H, R, generator=g), torch.randn(4, H, DR, generator=g)
    out, lse = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.3, return_lse=True)
    assert_close(out, _sdpa_decode(qn, qp, pc.values, pc.block_tables, lens).float())
    # lse independently: logsumexp of the raw scores of sequence 0 (a single token)
    s0 = (torch.cat([qn[0], qp[0]], -1) @ pc.values[pc.block_tables[0, 0], 0]) * 0.3
    assert_close(lse[0], s0)


def test_decode_zero_length_and_fp8():
    g = torch.Generator().manual_seed(1)
    lens = [0, 20]
    pc = make_cache(lens, R, DR, 16, fp8=True, gen=g)
    qn, qp = torch.randn(2, H, R, generator=g), torch.randn(2, H, DR, generator=g)
    # softmax scale 1/sqrt(R + Dr): a realistic temperature for the fp8 cosine gate
    out, lse = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.15,
                              kv_scale=pc.kv_scale, return_lse=True)
    assert torch.all(out[0] == 0) and torch.all(torch.isinf(lse[0]))
    exact = _sdpa_decode(qn, qp, pc.values, pc.block_tables, lens, scale=0.15)[1].float()
    cos = F.cosine_similarity(out[1].flatten(), exact.flatten(), dim=0)
    assert cos > 0.999


def test_sparse_matches_sdpa_on_subset():
    g = torch.Generator().manual_seed(2)
    lens = [5, 40, 64]
    pc = make_cache(lens, R, DR, 16, torch.float32, gen=g)
    idx = sparse_indices(lens, 8, gen=g)
    qn, qp = torch.randn(3, H, R, generator=g), torch.randn(3, H, DR, generator=g)
    out = ref.mla_sparse_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, idx, scale=0.3)
    pos = [row[row >= 0].long() for row in idx]
    assert_close(out, _sdpa_decode(qn, qp, pc.values, pc.block_tables, lens, pos).float())


def test_prefill_matches_sdpa_expanded():
    g = torch.Generator().manual_seed(3)
    Dn, Dv = 8, 12
    lens, qlens = [7, 20, 16], [7, 5, 1]  # full prompt, prompt after a cached prefix, one token
    pc = make_cache(lens, R, DR, 4, torch.float32, gen=g)
    T = sum(qlens)
    qn, qp = torch.randn(T, H, Dn, generator=g), torch.randn(T, H, DR, generator=g)
    wk, wv = torch.randn(H, Dn, R, generator=g) / 4, torch.randn(H, Dv, R, generator=g) / 4
    cu = torch.tensor([0, 7, 12, 13], dtype=torch.int32)
    out = ref.mla_prefill(qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables, scale=0.2)
    for b, (n, ql) in enumerate(zip(lens, qlens)):
        pos = torch.arange(n)
        rows = pc.values[pc.block_tables[b].long()[pos // 4], pos % 4].double()
        # HF-style non-absorbed attention: per-head keys [k_nope, k_pe], values from kv_b.
        k = torch.cat([torch.einsum("nr,hdr->hnd", rows[:, :R], wk.double()),
                       rows[:, R:][None].expand(H, -1, -1)], -1)
        v = torch.einsum("nr,hdr->hnd", rows[:, :R], wv.double())
        s0 = int(cu[b])
        q = torch.cat([qn[s0:s0 + ql], qp[s0:s0 + ql]], -1).double().transpose(0, 1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - ql, n)[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2)
        assert_close(out[s0:s0 + ql], o.transpose(0, 1).float(), what=f"seq {b}")


def test_append_roundtrip_and_skip():
    g = torch.Generator().manual_seed(4)
    cache = torch.zeros(3, 4, R + DR)
    ckv, kpe = torch.randn(5, R, generator=g), torch.randn(5, DR, generator=g)
    slots = torch.tensor([0, 11, -1, 5, 6], dtype=torch.int32)
    ref.append_mla(ckv, kpe, cache, slots)
    flat = cache.view(-1, R + DR)
    assert torch.equal(flat[11], torch.cat([ckv[1], kpe[1]]))
    assert flat[[1, 2, 3, 4, 7]].abs().sum() == 0  # the skipped token went nowhere


def test_bad_inputs_are_clear_errors():
    g = torch.Generator().manual_seed(5)
    lens = [10, 20]
    pc = make_cache(lens, R, DR, 16, torch.float32, gen=g)
    qn, qp = torch.randn(2, H, R), torch.randn(2, H, DR)
    args = (qn, qp, pc.cache, pc.seq_lens, pc.block_tables)
    dup = sparse_indices(lens, 4, gen=g)
    dup[1, :2] = torch.tensor([3, 3], dtype=torch.int32)
    with pytest.raises(InputError, match="indices.*twice"):
        ref.mla_sparse_decode(*args, dup, scale=0.3)
    oob = torch.tensor([[0, 10], [1, 2]], dtype=torch.int32)
    with pytest.raises(InputError, match=r"indices\[0, 1\] = 10"):
        ref.mla_sparse_decode(*args, oob, scale=0.3)
    with pytest.raises(InputError, match="seq_lens"):
        ref.mla_decode(qn, qp, pc.cache, torch.tensor([10, 33], dtype=torch.int32), pc.block_tables,
                       scale=0.3)
    bad_t = pc.block_tables.clone()
    bad_t[0, 0] = 99
    with pytest.raises(InputError, match="block_tables"):
        ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, bad_t, scale=0.3)
    with pytest.raises(InputError, match="q_pe"):
        ref.mla_decode(qn, qp.half(), pc.cache, pc.seq_lens, pc.block_tables, scale=0.3)
    with pytest.raises(InputError, match="cache"):
        ref.mla_decode(qn, torch.randn(2, H, 8), pc.cache, pc.seq_lens, pc.block_tables, scale=0.3)
    with pytest.raises(InputError, match="kv_scale"):
        ref.mla_decode(*args, scale=0.3, kv_scale=1.0)
    with pytest.raises(InputError, match="kv_scale"):
        ref.mla_decode(qn, qp, pc.cache.to(torch.float8_e4m3fn), pc.seq_lens, pc.block_tables, scale=0.3)
    with pytest.raises(InputError, match="slot_mapping"):
        ref.append_mla(torch.randn(1, R), torch.randn(1, DR), pc.cache, torch.tensor([10**6]))


def test_declarations_split_mla_from_gqa():
    mla = AttentionSpec(kind="mla", num_heads=16, num_kv_heads=1, head_dim=576, head_dim_v=512,
                        page_size=64, arch="sm90", cuda_graph=True)
    ch = select.select("attention", mla, runtime=False)
    assert ch.name == "mla-tma", ch.explain()  # pages of 64, a 16-bit cache: the TMA kernel's backend
    gqa = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, arch="sm90")
    for b in registry.backends("attention"):
        if b.name.startswith("mla-"):
            assert any("kind" in r for r in b.validate(gqa)), b.name
    assert select.select("attention", mla.replace(arch="cpu", cuda_graph=False),
                         runtime=False).name == "mla-reference"
    prefill = mla.replace(phase="prefill", cuda_graph=False)
    assert select.select("attention", prefill, runtime=False).name == "mla-triton"
    fi = registry.get("attention", "mla-flashinfer")
    assert fi.validate(mla.replace(kv_dtype="fp8", cuda_graph=False))
    sparse_prefill = mla.replace(phase="prefill", sparse=True, cuda_graph=False)
    assert "sparse" in " ".join(registry.get("attention", "mla-triton").validate(sparse_prefill))
    app = KVAppendSpec(kind="mla", num_kv_heads=1, head_dim=576, page_size=64, kv_dtype="fp8")
    assert select.select("kv_append", app, runtime=False).name == "mla-triton"


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_absorbed_decode_equals_non_absorbed_prefill(impl):
    """The MLA identity: for the last token, W_UV(decode(q_nope W_UK)) == non-absorbed attention."""
    import importlib

    dec = importlib.import_module("opmap.ops.mla.reference" if impl == "reference" else "opmap.kernels.mla.decode")
    pre = importlib.import_module("opmap.ops.mla.reference" if impl == "reference" else "opmap.kernels.mla.prefill")
    g = torch.Generator().manual_seed(6)
    Dn, Dv, lens = 8, 12, [9, 33]
    pc = make_cache(lens, R, DR, 16, torch.float32, gen=g)
    kv_b = torch.randn(H * (Dn + Dv), R, generator=g) / 4
    wk, wv = ref.split_kv_b(kv_b, H, Dn, Dv)
    qn, qp = torch.randn(2, H, Dn, generator=g), torch.randn(2, H, DR, generator=g)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    want = pre.mla_prefill(qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables, scale=0.2)
    lat = dec.mla_decode(torch.einsum("bhd,hdr->bhr", qn, wk).contiguous(), qp, pc.cache, pc.seq_lens,
                         pc.block_tables, scale=0.2)
    assert_close(torch.einsum("bhr,hvr->bhv", lat, wv), want)
