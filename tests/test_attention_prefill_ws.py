"""The warp-specialized prefill (ops/attention/prefill_ws.py, config WS=1) against the fp32
reference in the interpreter (which runs the loop as a plain one): pages holding whole key tiles,
lengths at page and tile edges, chunked prefill over a cached prefix, shared and shuffled pages,
NaN in every slot past a length, GQA / MQA / MHA, causal and not, window, soft cap, LSE, q as a
strided view of a fused QKV projection; more query blocks than sequences need (the ones past a
sequence run no tile); and what it refuses."""
import pytest
import torch

from opmap.contract import InputError
from opmap.ops.attention import prefill as P
from opmap.ops.attention import reference as R
from opmap.ops.attention.testing import make_paged, make_query

from test_attention_kernels import F16, _check, _ref
from test_attention_prefill_tma import CASES

WS = dict(WS=1)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_ws_prefill_matches_reference(case, monkeypatch):
    from opmap.ops.attention import prefill_tma, prefill_ws

    calls = []
    real = prefill_ws.launch
    monkeypatch.setattr(prefill_ws, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(prefill_tma, "launch", lambda *a, **k: pytest.fail("the TMA kernel ran instead"))
    _, seq, ql, page, hq, hk, d, causal, win, cap = case
    pc = make_paged(seq, hk, d, page, dtype=F16, shared=True, poison=True,
                    generator=torch.Generator().manual_seed(sum(seq) + 1))
    q, cu = make_query(ql, hq, d, dtype=F16)
    kw = dict(scale=d ** -0.5, causal=causal, window=win, soft_cap=cap, return_lse=True)
    out, lse = P.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, config=WS, **kw)
    ref, ref_lse = _ref(R.prefill, q, pc, cu, pc.seq_lens, pc.block_tables, **kw)
    _check(out, lse, ref, ref_lse, F16, False)
    assert calls == [1]


def test_ws_prefill_reads_q_from_a_fused_projection():
    """q as the first columns of a [T, (hq + 2 hk) * d] QKV output: row stride past hq * d."""
    hq, hk, d = 4, 2, 32
    pc = make_paged([70, 3], hk, d, 16, dtype=F16, poison=True, generator=torch.Generator().manual_seed(5))
    qkv = torch.randn(73, (hq + 2 * hk) * d, generator=torch.Generator().manual_seed(6)).to(F16)
    q = qkv[:, : hq * d].view(73, hq, d)
    cu = torch.tensor([0, 70, 73], dtype=torch.int32)
    kw = dict(scale=d ** -0.5, causal=True, return_lse=True)
    out, lse = P.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, config=WS, **kw)
    ref, ref_lse = _ref(R.prefill, q.contiguous(), pc, cu, pc.seq_lens, pc.block_tables, **kw)
    _check(out, lse, ref, ref_lse, F16, False)


def test_ws_prefill_refuses_what_it_cannot_read():
    pc = make_paged([40, 9], 2, 64, 16, dtype=F16)
    q, cu = make_query([40, 9], 8, 64, dtype=F16)
    kw = dict(scale=0.125, config=WS)
    with pytest.raises(InputError, match="config.*heads adjacent"):
        P.prefill(q.transpose(0, 1).contiguous().transpose(0, 1), pc.k_cache, pc.v_cache, cu, pc.seq_lens,
                  pc.block_tables, **kw)
    p8 = make_paged([40, 9], 2, 64, 8, dtype=F16)
    with pytest.raises(InputError, match="config.*page size 8 is not a multiple of BLOCK_N 16"):
        P.prefill(q, p8.k_cache, p8.v_cache, cu, p8.seq_lens, p8.block_tables, **kw)
    f8 = make_paged([40, 9], 2, 64, 16, fp8=True)
    with pytest.raises(InputError, match="config.*bf16/fp16"):
        P.prefill(q, f8.k_cache, f8.v_cache, cu, f8.seq_lens, f8.block_tables, **kw, **f8.kw)
