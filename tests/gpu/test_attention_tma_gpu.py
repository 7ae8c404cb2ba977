"""The TMA attention prefills on the GPU (kernels/attention/prefill_tma.py, the triton-tma backend;
kernels/attention/prefill_ws.py, the Gluon warp-specialised gluon-ws backend), in
their own file so that a kernel fault here cannot take the other attention GPU tests' process down
with it. Helpers and cases from test_attention_gpu."""
import pytest

from opmap.core import registry
from opmap.kernels.attention import prefill as P
from opmap.kernels.attention import prefill_tma as T
from opmap.kernels.attention import prefill_ws as W
from opmap.ops.attention import reference as R
from opmap.harness.fixtures.attention import make_paged, make_query

from test_attention_gpu import BF, DEV, _close, _lse_ok, _ref
from test_attention_gpu import test_mixed_cuda_graph_replan as _mixed_replan

pytestmark = pytest.mark.gpu


TMA_PREFILL = [
    # id, seq_lens, q_lens, page, heads, kv_heads, head_dim, window, soft_cap, causal
    ("b5-gqa-page64-edges", [63, 64, 65, 4099, 4096], [63, 64, 1, 1000, 4096], 64, 32, 8, 128, None, None, True),
    ("b2-mha-page128-chunk", [3000, 129], [700, 129], 128, 32, 32, 128, None, None, True),
    ("b2-d64-page64-window-cap", [700, 300], [700, 100], 64, 8, 2, 64, 128, 50.0, True),
    ("b3-noncausal-page64", [200, 65, 1], [200, 3, 1], 64, 16, 4, 128, None, None, False),
]


@pytest.mark.parametrize("case", TMA_PREFILL, ids=[c[0] for c in TMA_PREFILL])
def test_prefill_tma(case):
    """The TMA prefill (the triton-tma backend's entry) in bf16 on real shapes: NaN in every slot past
    a length (a partial tail tile must not read them), shared and shuffled pages; against the fp32
    reference and the gather kernel (triton)."""
    _, seq, ql, page, hq, hk, d, win, cap, causal = case
    pc = make_paged(seq, hk, d, page, dtype=BF, shared=True, poison=True, device=DEV)
    q, cu = make_query(ql, hq, d, dtype=BF, device=DEV)
    kw = dict(scale=d ** -0.5, window=win, soft_cap=cap, causal=causal, return_lse=True)
    out, lse = registry.get("attention", "triton-tma")("prefill", q, pc.k_cache, pc.v_cache, cu, pc.seq_lens,
                                                        pc.block_tables, **kw)
    ref, ref_lse = _ref(R.prefill, q, pc, cu, pc.seq_lens, pc.block_tables, **kw)
    _close(out, ref)
    _lse_ok(lse, ref_lse)
    plain, _ = P.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, **kw)
    _close(out, plain.float(), what="TMA vs gather kernel")


@pytest.mark.parametrize("page,fp8,tma", [(64, False, True), (128, False, True), (16, False, False),
                                          (64, True, False), (16, True, False)])
def test_prefill_selected_backend_runs_its_kernel(monkeypatch, page, fp8, tma):
    """On this GPU the selector (under CUDA graphs, where no peer serves) gives the TMA kernel's
    backend for bf16 pages holding whole 64-key tiles and the gather kernel's (triton) elsewhere: an
    fp8 cache, with this many query rows a sequence, is converted once (prefill._convert_once) and
    read by the gather kernel. The chosen entry runs exactly its own kernel, and is right."""
    from opmap.core import select, specs
    from opmap.core.hw import local_arch

    calls = []
    real = T.launch
    monkeypatch.setattr(T, "launch", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    spec = specs.AttentionSpec(arch=local_arch(), phase="prefill", page_size=page, kv_dtype="fp8" if fp8 else "bf16",
                               cuda_graph=True)
    ch = select.select("attention", spec)
    assert ch.name == ("triton-tma" if tma else "triton"), ch.explain()
    pc = make_paged([700, 65], 8, 128, page, dtype=BF, fp8=fp8, shared=True, poison=True, device=DEV)
    q, cu = make_query([700, 65], 32, 128, dtype=BF, device=DEV)
    kw = dict(scale=128 ** -0.5, causal=True, return_lse=True, **pc.kw)
    out, lse = ch.backend("prefill", q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, **kw)
    assert bool(calls) == tma
    ref, ref_lse = _ref(R.prefill, q, pc, cu, pc.seq_lens, pc.block_tables, **kw)
    _close(out, ref, scale=2.0 if fp8 else 1.0)
    _lse_ok(lse, ref_lse)


WS_PREFILL = TMA_PREFILL + [
    # pages smaller than a 128-key tile: several TMA boxes a tile, each a page of its own
    ("b4-gqa-page16-edges", [15, 16, 17, 2049], [15, 16, 1, 2049], 16, 32, 8, 128, None, None, True),
    ("b2-page32-d64-window", [1000, 33], [1000, 33], 32, 16, 16, 64, 200, None, True),
    ("b1-group7-page64", [513], [513], 64, 28, 4, 128, None, None, True),
]


@pytest.mark.parametrize("config", [None, {"BLOCK_N": 64}, {"BLOCK_N": 64, "STAGES": 3}, {"PINGPONG": 1},
                                    {"PINGPONG": 1, "BLOCK_N": 64, "STAGES": 3}],
                         ids=["default", "bn64", "bn64-s3", "pingpong", "pingpong-bn64-s3"])
@pytest.mark.parametrize("case", WS_PREFILL, ids=[c[0] for c in WS_PREFILL])
def test_prefill_ws(case, config):
    """The Gluon warp-specialised prefill (gluon-ws) in bf16 on real shapes, at each tile its bench
    times: NaN in every slot past a length (the box holding a length is read ending at it),
    shared and shuffled pages; against the fp32 reference and the gather kernel (triton)."""
    _, seq, ql, page, hq, hk, d, win, cap, causal = case
    pc = make_paged(seq, hk, d, page, dtype=BF, shared=True, poison=True, device=DEV)
    q, cu = make_query(ql, hq, d, dtype=BF, device=DEV)
    kw = dict(scale=d ** -0.5, window=win, soft_cap=cap, causal=causal, return_lse=True)
    out, lse = registry.get("attention", "gluon-ws")("prefill", q, pc.k_cache, pc.v_cache, cu, pc.seq_lens,
                                                      pc.block_tables, config=config, **kw)
    ref, ref_lse = _ref(R.prefill, q, pc, cu, pc.seq_lens, pc.block_tables, **kw)
    _close(out, ref)
    _lse_ok(lse, ref_lse)
    plain, _ = P.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, **kw)
    _close(out, plain.float(), what="warp-specialised vs gather kernel")


@pytest.mark.parametrize("config", [None, {"PINGPONG": 1}], ids=["default", "pingpong"])
def test_prefill_ws_fp16(config):
    """fp16 queries and caches (the kernel's other 16-bit type; the cases above are bf16) on pages of
    16, GQA, NaN in every slot past a length, a chunk, a one-token and a short prompt."""
    import torch

    seq, ql = [1000, 65, 17], [1000, 1, 17]
    pc = make_paged(seq, 8, 128, 16, dtype=torch.float16, shared=True, poison=True, device=DEV)
    q, cu = make_query(ql, 32, 128, dtype=torch.float16, device=DEV)
    kw = dict(scale=128 ** -0.5, causal=True, return_lse=True)
    out, lse = registry.get("attention", "gluon-ws")("prefill", q, pc.k_cache, pc.v_cache, cu, pc.seq_lens,
                                                      pc.block_tables, config=config, **kw)
    assert out.dtype == torch.float16
    ref, ref_lse = _ref(R.prefill, q, pc, cu, pc.seq_lens, pc.block_tables, **kw)
    _close(out, ref)
    _lse_ok(lse, ref_lse)


def test_prefill_ws_page_ids_outside_the_cache_read_zeros_and_graph_replay_matches():
    """A page id past the cache or negative reads zeros through the descriptor (never other memory);
    the launch has no host sync, so it replays under a CUDA graph to the eager output after the
    query and the cache change in place."""
    import torch

    pc = make_paged([300, 77], 8, 128, 64, dtype=BF, shared=True, poison=True, device=DEV)
    q, cu = make_query([300, 77], 32, 128, dtype=BF, device=DEV)
    args = (cu, pc.seq_lens, pc.block_tables)
    for bad in (pc.k_cache.shape[0] + 5, -3):
        bt = pc.block_tables.clone()
        bt[1, :] = bad
        out = W.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, bt, scale=0.1)
        assert torch.all(out[300:] == 0), bad
        assert torch.isfinite(out[:300]).all()
    fn = registry.get("attention", "gluon-ws").fn("prefill")
    fn(q, pc.k_cache, pc.v_cache, *args, scale=0.1)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(q, pc.k_cache, pc.v_cache, *args, scale=0.1)
    q.copy_(torch.randn_like(q))
    pc.k_cache.copy_(torch.randn_like(pc.k_cache))
    g.replay()
    torch.cuda.synchronize()
    want = fn(q, pc.k_cache, pc.v_cache, *args, scale=0.1)
    assert torch.equal(out, want)


def test_mixed_ws_cuda_graph_replan():
    """gluon-ws's mixed step (its chunks on the warp-specialised prefill, the one-token rows on the
    Triton decode): the mix changes between replays of one captured step (test_attention_gpu's case)."""
    _mixed_replan("gluon-ws")
