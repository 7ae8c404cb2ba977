"""The TMA prefill (kernels/attention/prefill_tma.py, the triton-tma backend) against the fp32
reference in the interpreter: pages holding whole key tiles (BLOCK_N 16 here, pages 16 / 32 / 64),
lengths at page and tile edges, chunked prefill over a cached prefix, shared and shuffled pages, NaN
in every slot past a length, GQA / MQA / MHA, causal and not, window, soft cap, LSE; against the
gather kernel (the triton backend) on the same inputs; and what it refuses."""
import pytest
import torch

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.kernels.attention import prefill as P
from opmap.kernels.attention import prefill_tma as T
from opmap.ops.attention import reference as R
from opmap.harness.fixtures.attention import make_paged, make_query

from test_attention_kernels import F16, _check, _ref

CASES = [
    # id, seq_lens, q_lens, page, heads, kv_heads, head_dim, causal, window, soft_cap
    ("page64-edges-gqa", [63, 64, 65, 1, 129], [63, 64, 65, 1, 2], 64, 8, 2, 64, True, None, None),
    ("page16-chunked-mha", [15, 16, 17, 300, 40], [5, 16, 1, 100, 0], 16, 4, 4, 32, True, None, None),
    ("page32-mqa-window-cap", [33, 31, 200, 32], [33, 7, 50, 1], 32, 8, 1, 64, True, 20, 30.0),
    ("page16-noncausal-group4", [20, 47, 5], [20, 1, 4], 16, 8, 2, 128, False, None, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tma_prefill_matches_reference(case, monkeypatch):
    calls = []
    real = T.launch
    monkeypatch.setattr(T, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, seq, ql, page, hq, hk, d, causal, win, cap = case
    pc = make_paged(seq, hk, d, page, dtype=F16, shared=True, poison=True,
                    generator=torch.Generator().manual_seed(sum(seq)))
    q, cu = make_query(ql, hq, d, dtype=F16)
    kw = dict(scale=d ** -0.5, causal=causal, window=win, soft_cap=cap, return_lse=True)
    tma = registry.get("attention", "triton-tma").fn("prefill")
    assert tma is T.prefill  # the backend's entry is this kernel's
    out, lse = tma(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, **kw)
    ref, ref_lse = _ref(R.prefill, q, pc, cu, pc.seq_lens, pc.block_tables, **kw)
    _check(out, lse, ref, ref_lse, F16, False)
    assert calls == [1]  # the TMA kernel ran
    # the gather kernel on the same inputs: the same sums in the same order up to the tile reads
    plain, plain_lse = P.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, **kw)
    assert calls == [1]  # the gather kernel never dispatches to the TMA one
    torch.testing.assert_close(out, plain, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, plain_lse, atol=1e-4, rtol=1e-4)
    no_lse = T.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, **{**kw, "return_lse": False})
    assert torch.equal(no_lse, out)


def test_tma_prefill_bad_page_ids_read_zeros_not_memory():
    """A page id past the cache (or negative) is outside the descriptor: its keys read as zeros.
    The validators reject such tables before a launch; this is the kernel's own safety net."""
    from opmap.kernels.attention.common import kernel_config

    pc = make_paged([64], 1, 32, 64, dtype=F16, generator=torch.Generator().manual_seed(3))
    q, cu = make_query([64], 2, 32, dtype=F16)
    cfg = kernel_config("prefill_tma", 32, 2, q.device)
    for bad in (pc.k_cache.shape[0] + 5, -3):
        bt = pc.block_tables.clone()
        bt[0, 0] = bad
        out = torch.full((64, 2, 32), float("nan"), dtype=F16)
        T.launch(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, bt, out, out, cfg, scale=0.2, causal=True,
                           window=None, soft_cap=None, return_lse=False)
        assert torch.all(out == 0), bad  # zero keys and values: uniform weights over zero rows


def test_tma_prefill_refuses_what_it_cannot_read():
    """What the triton-tma backend declares its entry checks again on the tensors: an InputError
    naming the argument, never the gather kernel in its place."""
    pc = make_paged([40, 9], 2, 64, 8, dtype=F16)
    q, cu = make_query([40, 9], 8, 64, dtype=F16)
    args = (q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables)
    with pytest.raises(InputError, match="k_cache.*page size 8 is not a multiple of BLOCK_N 16"):
        T.prefill(*args, scale=0.125)
    p16 = make_paged([40, 9], 2, 64, 16, dtype=F16)
    args16 = (q, p16.k_cache, p16.v_cache, cu, p16.seq_lens, p16.block_tables)
    with pytest.raises(InputError, match="config.*page size 16 is not a multiple of BLOCK_N 32"):
        T.prefill(*args16, scale=0.125, config=dict(BLOCK_N=32))
    with pytest.raises(InputError, match="config"):  # no PREFETCH here: it always carries its page ids
        T.prefill(*args16, scale=0.125, config=dict(PREFETCH=0))
    f8 = make_paged([40, 9], 2, 64, 16, fp8=True)
    with pytest.raises(InputError, match="k_cache.*bf16/fp16"):
        T.prefill(q, f8.k_cache, f8.v_cache, cu, f8.seq_lens, f8.block_tables, scale=0.125, **f8.kw)
    q32, cu32 = make_query([40, 9], 8, 64, dtype=torch.float32)
    p32 = make_paged([40, 9], 2, 64, 16, dtype=torch.float32)
    with pytest.raises(InputError, match="k_cache.*bf16/fp16"):
        T.prefill(q32, p32.k_cache, p32.v_cache, cu32, p32.seq_lens, p32.block_tables, scale=0.125)
    n = p16.k_cache.numel()
    shifted = torch.zeros(n + 4, dtype=F16)[4:].view(p16.k_cache.shape)  # contiguous, 8 bytes off 16
    with pytest.raises(InputError, match="k_cache.*16-byte aligned"):
        T.prefill(q, shifted, shifted, cu, p16.seq_lens, p16.block_tables, scale=0.125)
    # mixed steps are the gather kernel's (triton): no mixed entry here
    assert set(registry.get("attention", "triton-tma").impl) == {"prefill"}


@pytest.mark.parametrize("seed", range(12))
def test_tma_prefill_random_shapes(seed):
    """Random batches: lengths 0-200 with chunks over cached prefixes, pages of 16 / 32 / 64, GQA
    groups 1-4, head dims 32 / 64, causal or not, window and soft cap or not; NaN in unused slots."""
    g = torch.Generator().manual_seed(1000 + seed)
    r = lambda n: int(torch.randint(0, n, (1,), generator=g))  # noqa: E731
    B = 1 + r(5)
    lens = [r(201) for _ in range(B)]
    ql = [min(n, r(n + 1) if r(2) else n) for n in lens]
    page, hk, group, d = (16, 32, 64)[r(3)], 1 + r(2), (1, 2, 4)[r(3)], (32, 64)[r(2)]
    causal = bool(r(4))
    win = (None, 1 + r(100))[r(2)] if causal else None
    cap = (None, 20.0)[r(2)]
    pc = make_paged(lens, hk, d, page, dtype=F16, shared=bool(r(2)), poison=True, generator=g)
    q, cu = make_query(ql, hk * group, d, dtype=F16, generator=g)
    kw = dict(scale=d ** -0.5, causal=causal, window=win, soft_cap=cap, return_lse=True)
    out, lse = T.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, **kw)
    ref, ref_lse = _ref(R.prefill, q, pc, cu, pc.seq_lens, pc.block_tables, **kw)
    _check(out, lse, ref, ref_lse, F16, False)
