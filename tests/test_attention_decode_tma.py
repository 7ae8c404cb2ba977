"""The TMA decode (config TMA=1; ops/attention/decode_tma.py) against the fp32 reference in the
interpreter: every decode case of test_attention_kernels with pages of 16 or more (page-1 caches
are refused), with one box per key tile (BLOCK_N 16) and several (BLOCK_N 64 over pages of 16:
four boxes, of 32: two); split plans, windows, soft caps, fp8, MQA; NaN in every unused slot;
the mixed-batch row mapping; and what it refuses."""
import pytest
import torch

from opmap.contract import InputError
from opmap.ops.attention import decode as D
from opmap.ops.attention import reference as R
from opmap.ops.attention.testing import make_paged, make_query

from test_attention_kernels import DECODE, F16, _check, _ref

CASES = [c for c in DECODE if c[2] >= 16]


@pytest.mark.parametrize("block_n", [16, 64])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tma_decode_matches_reference(case, block_n, monkeypatch):
    from opmap.ops.attention import decode_tma

    calls = []
    real = decode_tma.launch
    monkeypatch.setattr(decode_tma, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, seq, page, hq, hk, d, dt, win, cap, fp8, ws = case
    pc = make_paged(seq, hk, d, page, dtype=dt, fp8=fp8, shared=True, poison=True)
    q, _ = make_query([1] * len(seq), hq, d, dtype=dt)
    w = D.make_workspace(len(seq), hq, d, device="cpu", **ws) if ws is not None else None
    kw = dict(scale=d ** -0.5, window=win, soft_cap=cap, return_lse=True, **pc.kw)
    out, lse = D.decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, workspace=w,
                        config={"TMA": 1, "BLOCK_N": block_n}, **kw)
    assert calls == [1]
    ref, ref_lse = _ref(R.decode, q, pc, pc.seq_lens, pc.block_tables, **kw)
    _check(out, lse, ref, ref_lse, dt, fp8)
    assert torch.all(out[pc.seq_lens == 0] == 0)


@pytest.mark.parametrize("page", [16, 32, 64])
def test_tma_decode_lengths_at_box_edges_and_mixed_rows(page):
    """Lengths around the box and tile edges with 64-key tiles, split in 16-key chunks (so splits end
    inside boxes); then the same through the mixed-batch path (query rows found through cu_seqlens,
    a multi-token sequence skipped)."""
    seq = [1, 15, 16, 17, 63, 64, 65, page * 3 - 1, page * 3 + 1, 0]
    pc = make_paged(seq, 2, 64, page, dtype=F16, shared=True, poison=True,
                    generator=torch.Generator().manual_seed(page))
    q, _ = make_query([1] * len(seq), 8, 64, dtype=F16)
    cfg = {"TMA": 1, "BLOCK_N": 64}
    for ws in (None, D.make_workspace(len(seq), 8, 64, device="cpu", min_chunk=16)):
        out, lse = D.decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.125, return_lse=True,
                            workspace=ws, config=cfg)
        ref, ref_lse = _ref(R.decode, q, pc, pc.seq_lens, pc.block_tables, scale=0.125, return_lse=True)
        _check(out, lse, ref, ref_lse, F16, False)
    # mixed rows: sequence 3 has two query tokens (the prefill kernel's), the empty one none
    ql = [1] * len(seq)
    ql[3], ql[-1] = 2, 0
    qm, cu = make_query(ql, 8, 64, dtype=F16)
    outm = torch.zeros(qm.shape[0], 8, 64, dtype=F16)
    lsem = torch.zeros(qm.shape[0], 8)
    D.launch_decode(qm, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, outm, lsem, scale=0.125, window=None,
                    soft_cap=None, k_scale=None, v_scale=None, return_lse=True, config=cfg, cu_seqlens_q=cu)
    refm, refm_lse = _ref(R.mixed, qm, pc, cu, pc.seq_lens, pc.block_tables, scale=0.125, return_lse=True)
    single = torch.tensor([n == 1 for n in ql]).repeat_interleave(torch.tensor(ql))
    _check(outm[single], lsem[single], refm[single], refm_lse[single], F16, False)
    assert torch.all(outm[~single] == 0)  # the two-token sequence's rows are left to the prefill kernel


def test_tma_decode_refuses_what_it_cannot_read():
    q, _ = make_query([1, 1], 8, 64, dtype=F16)
    p1 = make_paged([20, 9], 2, 64, 1, dtype=F16)
    with pytest.raises(InputError, match="config.*page size 1 < 16"):
        D.decode(q, p1.k_cache, p1.v_cache, p1.seq_lens, p1.block_tables, scale=0.125, config={"TMA": 1})
    p64 = make_paged([20, 9], 2, 64, 64, dtype=F16)
    # BLOCK_N below the page: a tile is a part of one page, one box (allowed)
    out = D.decode(q, p64.k_cache, p64.v_cache, p64.seq_lens, p64.block_tables, scale=0.125,
                   config={"TMA": 1, "BLOCK_N": 32})
    ref = _ref(R.decode, q, p64, p64.seq_lens, p64.block_tables, scale=0.125)
    _check(out, torch.zeros(2, 8), ref, torch.zeros(2, 8), F16, False)


def test_stages_fit_shared_memory():
    """A TMA config whose buffers would not fit (d256 at 128-key tiles: 272 KB at 3 stages on sm90)
    runs at fewer stages instead of failing at launch; the default tiles keep theirs."""
    from opmap.ops.attention.tma import SMEM_BUDGET, fit_stages

    assert fit_stages(3, 128 * 512 * 2, 16 * 256 * 2, 1) == 2  # decode d256, BLOCK_N 128
    assert fit_stages(3, 64 * 256 * 2, 16 * 128 * 2, 1) == 3  # decode d128, the default tile
    assert fit_stages(3, 64 * 256 * 2, 128 * 128 * 2, 0) == 3  # prefill d128, the default tile
    assert fit_stages(3, 2 * SMEM_BUDGET, 0, 0) == 1  # never below one stage


@pytest.mark.parametrize("split_tokens,window", [(40, None), (48, 100), (16, None)])
def test_tma_decode_fixed_splits_off_the_box_grid(split_tokens, window):
    """Fixed splits whose edges fall inside a box (40 keys) and windows that start anywhere: the
    boxes stay on the 16-row grid, the rows outside [start0, end) masked; batch invariant."""
    seq = [600, 17, 0, 64, 129, 48, 1]
    pc = make_paged(seq, 2, 64, 16, dtype=F16, shared=True, poison=True)
    q, _ = make_query([1] * len(seq), 8, 64, dtype=F16)
    ws = D.make_workspace(len(seq), 8, 64, device="cpu", split_tokens=split_tokens,
                          max_seq_len=pc.block_tables.shape[1] * 16)
    kw = dict(scale=0.125, window=window, return_lse=True)
    out, lse = D.decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, workspace=ws,
                        config={"TMA": 1, "BLOCK_N": 64}, **kw)
    ref, ref_lse = _ref(R.decode, q, pc, pc.seq_lens, pc.block_tables, **kw)
    _check(out, lse, ref, ref_lse, F16, False)
    sub = [3, 0, 4]
    ws2 = D.make_workspace(len(sub), 8, 64, device="cpu", split_tokens=split_tokens,
                           max_seq_len=pc.block_tables.shape[1] * 16)
    part = D.decode(q[sub], pc.k_cache, pc.v_cache, pc.seq_lens[sub], pc.block_tables[sub], workspace=ws2,
                    config={"TMA": 1, "BLOCK_N": 64}, **kw)
    assert torch.equal(part[0], out[sub]) and torch.equal(part[1], lse[sub])
