"""The attention references against independent formulations: SDPA in fp64 on the gathered KV,
an explicit logsumexp for the LSE, and the merge of two halves for the merge reference."""
import math

import pytest
import torch
import torch.nn.functional as F

from opmap.ops.attention import reference as R
from opmap.harness.fixtures.attention import make_paged, make_query
from opmap.core.tolerance import assert_close


def sdpa64(q, k, v, q_pos, causal, window):
    """q [n, Hq, D], k/v [L, Hk, D] -> [n, Hq, D] in fp64 through SDPA with an explicit mask."""
    n, hq, d = q.shape
    L, hk, _ = k.shape
    j = torch.arange(L)[None, :]
    p = q_pos[:, None]
    ok = torch.ones(n, L, dtype=torch.bool)
    if causal:
        ok &= j <= p
    if window is not None:
        ok &= j > p - window
    o = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None],
                                       v.double().transpose(0, 1)[None], attn_mask=ok, scale=1 / math.sqrt(d),
                                       enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_prefill_vs_sdpa_fp64(heads, kv_heads, window):
    seq = [9, 17, 4, 33]
    ql = [9, 5, 0, 1]  # full prompt, chunk over a cached prefix, nothing new, a decode token
    pc = make_paged(seq, kv_heads, 64, 4, dtype=torch.float32, shared=True)
    q, cu = make_query(ql, heads, 64, dtype=torch.float32)
    out, lse = R.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, scale=1 / 8,
                         window=window, return_lse=True, acc=torch.float64)
    for b, (L, n) in enumerate(zip(seq, ql)):
        if n == 0:
            continue
        s0 = int(cu[b])
        k = R.gather_kv(pc.k_cache, pc.block_tables[b], L)
        v = R.gather_kv(pc.v_cache, pc.block_tables[b], L)
        pos = torch.arange(L - n, L)
        ref = sdpa64(q[s0:s0 + n], k, v, pos, True, window)
        assert_close(out[s0:s0 + n], ref, torch.float32, what=f"seq {b}")
        # LSE: an explicit logsumexp of the masked scores, natural log.
        g = heads // kv_heads
        s = torch.einsum("nhd,lhd->nhl", q[s0:s0 + n].double(), k.double().repeat_interleave(g, 1)) / 8
        j = torch.arange(L)
        mask = (j[None] <= pos[:, None]) & ((j[None] > pos[:, None] - window) if window else True)
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        assert_close(lse[s0:s0 + n], torch.logsumexp(s, -1), torch.float32, what="lse")


def test_noncausal_and_soft_cap_explicit():
    pc = make_paged([12], 2, 64, 16, dtype=torch.float32)
    q, cu = make_query([3], 4, 64, dtype=torch.float32)
    cap = 2.0
    out = R.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, scale=0.125, causal=False,
                    soft_cap=cap)
    k = R.gather_kv(pc.k_cache, pc.block_tables[0], 12).double()
    v = R.gather_kv(pc.v_cache, pc.block_tables[0], 12).double()
    for t in range(3):
        for h in range(4):
            s = (k[:, h // 2] @ q[t, h].double()) * 0.125
            w = torch.softmax(cap * torch.tanh(s / cap), 0)
            assert_close(out[t, h], w @ v[:, h // 2], torch.float32)


def test_decode_equals_prefill_of_last_token_and_zero_length():
    seq = [1, 16, 17, 0, 40]
    pc = make_paged(seq, 2, 64, 16, dtype=torch.float32)
    q, _ = make_query([1] * 5, 8, 64, dtype=torch.float32)
    out, lse = R.decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.125, return_lse=True)
    for b, L in enumerate(seq):
        if L == 0:
            assert torch.all(out[b] == 0) and torch.all(torch.isneginf(lse[b]))
            continue
        k = R.gather_kv(pc.k_cache, pc.block_tables[b], L)
        v = R.gather_kv(pc.v_cache, pc.block_tables[b], L)
        ref = sdpa64(q[b:b + 1], k, v, torch.tensor([L - 1]), True, None)
        assert_close(out[b:b + 1], ref, torch.float32)


def test_merge_of_two_halves_is_the_whole():
    pc = make_paged([30], 2, 64, 16, dtype=torch.float32)
    q, cu = make_query([4], 4, 64, dtype=torch.float32)
    k = R.gather_kv(pc.k_cache, pc.block_tables[0], 30)
    v = R.gather_kv(pc.v_cache, pc.block_tables[0], 30)
    pos = torch.full((4,), 10**6)
    oa, la = R.attend(q, k[:11], v[:11], pos, scale=0.125)
    ob, lb = R.attend(q, k[11:], v[11:], pos, scale=0.125)
    full, lf = R.attend(q, k, v, pos, scale=0.125, acc=torch.float64)
    o, lse = R.merge(oa, la, ob, lb)
    assert_close(o, full, torch.float32)
    assert_close(lse, lf, torch.float32)
    # A state with LSE -inf contributes nothing; two empty states give zeros.
    o2, l2 = R.merge(oa, la, torch.full_like(ob, 7.0), torch.full_like(lb, float("-inf")))
    assert_close(o2, oa, torch.float32)
    assert_close(l2, la, torch.float32)
    o3, l3 = R.merge(oa, torch.full_like(la, float("-inf")), ob, torch.full_like(lb, float("-inf")))
    assert torch.all(o3 == 0) and torch.all(torch.isneginf(l3))


def test_append_reference_skips_and_quantises():
    pc = make_paged([5, 3], 2, 64, 4, dtype=torch.float16)
    before = pc.k_cache.clone()
    k = torch.randn(3, 2, 64).half()
    v = torch.randn(3, 2, 64).half()
    slots = torch.tensor([5, -1, 0], dtype=torch.int64)
    R.append(k, v, pc.k_cache, pc.v_cache, slots)
    assert torch.equal(pc.k_cache[1, 1], k[0]) and torch.equal(pc.v_cache[0, 0], v[2])
    changed = (pc.k_cache != before).any(-1).any(-1).nonzero().tolist()
    assert changed == [[0, 0], [1, 1]]
    f8 = make_paged([5], 2, 64, 4, fp8=True)
    R.append(k.float(), v.float(), f8.k_cache, f8.v_cache, slots.int(), f8.k_scale, f8.v_scale)
    deq = f8.k_cache[1, 1].float() * f8.k_scale[:, None]
    assert torch.nn.functional.cosine_similarity(deq.flatten(), k[0].float().flatten(), 0) > 0.999
