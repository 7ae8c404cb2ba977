"""Attention on the GPU (bf16, real shapes): each of our backends' kernels (triton: gather prefill,
Triton decode, mixed; gluon-fp8: the Gluon fp8 decode and its mixed step; the TMA prefill is in
test_attention_tma_gpu.py) reached through its registered backend, KV append and merge, against the
fp32 reference, NaN-poisoned unused slots, CUDA-graph capture with re-planning, batch invariance of
the fixed-split mode, the fp8 quality gate, and the peer adapters.

Run: PYTHONPATH=src python -m pytest tests/gpu/test_attention_gpu.py -m gpu -q
"""
import pytest
import torch

from opmap.core import registry
from opmap.kernels.attention import decode as D
from opmap.kernels.attention import kv_append as A
from opmap.kernels.attention import merge as M
from opmap.kernels.attention import prefill as P
from opmap.ops.attention import reference as R
from opmap.harness.fixtures.attention import make_paged, make_query
from opmap.core.tolerance import assert_close, cosine

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF = torch.bfloat16


def _ref(fn, q, pc, *args, **kw):
    kc, vc = pc.k_cache, pc.v_cache
    if kc.dtype != torch.float8_e4m3fn:
        kc, vc = kc.float(), vc.float()
    return fn(q.float(), kc, vc, *args, **kw)


def _close(out, ref, scale=1.0, what="output"):
    # Elementwise bound plus a cosine gate: long contexts average many rows into outputs far below
    # bf16's absolute tolerance, where the bound alone would pass a wrong answer.
    assert_close(out, ref, BF, scale=scale, what=what)
    c = cosine(out, ref)
    assert c >= 0.9995, f"{what}: cosine {c:.6f}"


def _be(name):
    """A backend's entries by name (``_be("gluon-fp8")("decode", ...)``): the kernel it names."""
    return registry.get("attention", name)


def _decoders(fp8, hq, hk, d):
    """The decode backends whose kernel serves these inputs: triton always, gluon-fp8 for an fp8
    cache at head dim 128 with at most 16 query heads per KV head."""
    return ["triton"] + (["gluon-fp8"] if fp8 and d == 128 and hq // hk <= 16 else [])


def _lse_ok(lse, ref_lse):
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert_close(lse[fin], ref_lse[fin], torch.float32, scale=300.0, what="lse")


DECODE = [
    # id, seq_lens, page, heads, kv_heads, head_dim, window, soft_cap, fp8
    ("b1-32768-split", [32768], 16, 32, 8, 128, None, None, False),
    ("b8-edges-page32", [1, 15, 16, 17, 300, 4097, 8192, 0], 32, 32, 8, 128, None, None, False),
    ("b64-4096", [4096] * 64, 16, 32, 8, 128, None, None, False),
    ("b3-d256-mqa-page64", [300, 2049, 17], 64, 8, 1, 256, None, None, False),
    ("b17-d64-mha-window-cap", [1, 2, 63, 64, 65, 700, 1999, 0, 31, 5, 1024, 513, 77, 100, 2000, 3, 9], 16, 8, 8,
     64, 256, 30.0, False),
    ("b8-fp8", [1, 15, 16, 17, 300, 4097, 32768, 0], 16, 32, 8, 128, None, None, True),
    # fp8 at head dim 128: the Gluon kernel (gluon-fp8) beside the Triton one (triton): one query head
    # per KV head, pages of one key, a window and a soft cap; 16 heads per KV head in pages of 128;
    # pages of 8 around their edges; at head dim 64 the Triton kernel only
    ("b9-fp8-mha-page1-window-cap", [1, 2, 63, 64, 65, 700, 1999, 0, 31], 1, 8, 8, 128, 256, 30.0, True),
    ("b5-fp8-group16-page128", [1, 129, 4096, 300, 0], 128, 32, 2, 128, None, None, True),
    ("b6-fp8-group2-page8-cap", [23, 24, 25, 2049, 64, 65], 8, 16, 8, 128, None, 20.0, True),
    ("b3-fp8-d64", [300, 2049, 17], 16, 8, 2, 64, None, None, True),
]


@pytest.mark.parametrize("case", DECODE, ids=[c[0] for c in DECODE])
def test_decode(case):
    _, seq, page, hq, hk, d, win, cap, fp8 = case
    pc = make_paged(seq, hk, d, page, dtype=BF, fp8=fp8, shared=True, poison=True, device=DEV)
    q, _ = make_query([1] * len(seq), hq, d, dtype=BF, device=DEV)
    ref, ref_lse = _ref(R.decode, q, pc, pc.seq_lens, pc.block_tables, scale=d ** -0.5, window=win,
                        soft_cap=cap, return_lse=True, **pc.kw)
    for name in _decoders(fp8, hq, hk, d):
        be = _be(name)
        for ws in (None, be("make_workspace", len(seq), hq, d, device=DEV)):
            out, lse = be("decode", q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=d ** -0.5,
                          window=win, soft_cap=cap, return_lse=True, workspace=ws, **pc.kw)
            _close(out, ref, scale=2.0 if fp8 else 1.0, what=name)
            _lse_ok(lse, ref_lse)


PREFILL = [
    # id, seq_lens, q_lens, page, heads, kv_heads, head_dim, window, soft_cap, fp8
    ("b1-2048-full", [2048], [2048], 16, 32, 8, 128, None, None, False),
    ("b4-gqa-chunks-page64", [32768, 1000, 17, 0], [256, 1000, 1, 0], 64, 32, 8, 128, None, None, False),
    ("b2-d256-page32-window-cap", [700, 300], [700, 100], 32, 8, 2, 256, 128, 50.0, False),
    ("b2-d64-page1-mha", [100, 37], [100, 37], 1, 8, 8, 64, None, None, False),
    ("b1-fp8-chunk", [2048], [512], 16, 32, 8, 128, None, None, True),
    # fp8 with many query rows a sequence: the pages converted once, then the gather kernel on the
    # 16-bit copy; few rows keep the in-kernel conversion
    ("b4-fp8-gqa-chunks-page64", [32768, 1000, 17, 0], [256, 1000, 1, 0], 64, 32, 8, 128, None, None, True),
    ("b3-fp8-few-rows-window", [700, 300, 65], [5, 100, 1], 16, 32, 8, 128, 128, None, True),
]


@pytest.mark.parametrize("case", PREFILL, ids=[c[0] for c in PREFILL])
def test_prefill(case):
    _, seq, ql, page, hq, hk, d, win, cap, fp8 = case
    pc = make_paged(seq, hk, d, page, dtype=BF, fp8=fp8, shared=True, poison=True, device=DEV)
    q, cu = make_query(ql, hq, d, dtype=BF, device=DEV)
    out, lse = P.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, scale=d ** -0.5, window=win,
                         soft_cap=cap, return_lse=True, **pc.kw)
    ref, ref_lse = _ref(R.prefill, q, pc, cu, pc.seq_lens, pc.block_tables, scale=d ** -0.5, window=win,
                        soft_cap=cap, return_lse=True, **pc.kw)
    _close(out, ref, scale=2.0 if fp8 else 1.0)
    _lse_ok(lse, ref_lse)


@pytest.mark.parametrize("name,fp8", [("triton", False), ("triton", True), ("gluon-fp8", True)])
def test_mixed_step(name, fp8):
    """A mixed step through each backend's mixed entry: the gather prefill for the chunks and the
    backend's decode kernel (Triton or Gluon) for the one-token sequences."""
    seq, ql = [3000, 17, 1, 9000, 64], [512, 1, 1, 1, 64]
    pc = make_paged(seq, 8, 128, 16, dtype=BF, fp8=fp8, poison=True, device=DEV)
    q, cu = make_query(ql, 32, 128, dtype=BF, device=DEV)
    be = _be(name)
    ws = be("make_workspace", len(seq), 32, 128, device=DEV)
    out, lse = be("mixed", q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, scale=128 ** -0.5,
                  return_lse=True, workspace=ws, **pc.kw)
    ref, ref_lse = _ref(R.mixed, q, pc, cu, pc.seq_lens, pc.block_tables, scale=128 ** -0.5, return_lse=True,
                        **pc.kw)
    _close(out, ref, scale=2.0 if fp8 else 1.0)
    _lse_ok(lse, ref_lse)


def _rand_step(B, max_pages, num_pages, page, g, lens=None):
    if lens is None:
        lens = torch.randint(0, max_pages * page + 1, (B,), generator=g)
        lens[0] = 0
        lens[1 % B] = max_pages * page
    bt = torch.stack([torch.randperm(num_pages, generator=g)[:max_pages] for _ in range(B)]).int()
    return lens.int(), bt


@pytest.mark.parametrize("name,fixed,fp8", [("triton", False, False), ("triton", True, False), ("triton", False, True),
                                            ("gluon-fp8", False, True), ("gluon-fp8", True, True)],
                         ids=["auto-split", "fixed-split", "auto-split-fp8", "gluon-fp8", "gluon-fp8-fixed-split"])
def test_decode_cuda_graph_replan(name, fixed, fp8):
    """Capture once, then rewrite lengths / block tables / queries in place and replay: each result
    is checked against the reference (split counts change with the lengths, on the device)."""
    B, hq, hk, d, page, max_pages, num_pages = 8, 32, 8, 128, 16, 512, 4096
    g = torch.Generator().manual_seed(7)
    kc = torch.randn(num_pages, page, hk, d, generator=g).to(DEV, BF)
    vc = torch.randn(num_pages, page, hk, d, generator=g).to(DEV, BF)
    sc = {}
    if fp8:
        sc = dict(k_scale=torch.rand(hk, device=DEV) + 0.1, v_scale=torch.rand(hk, device=DEV) + 0.1)
        kc = R.quantize_fp8(kc.view(-1, hk, d), sc["k_scale"]).view(kc.shape)
        vc = R.quantize_fp8(vc.view(-1, hk, d), sc["v_scale"]).view(vc.shape)
    lens, bt = _rand_step(B, max_pages, num_pages, page, g)
    sl_buf, bt_buf = lens.to(DEV), bt.to(DEV)
    q_buf = torch.randn(B, hq, d, generator=g).to(DEV, BF)
    be = _be(name)
    ws = be("make_workspace", B, hq, d, device=DEV, batch_invariant=fixed, max_seq_len=max_pages * page)
    run = lambda: be("decode", q_buf, kc, vc, sl_buf, bt_buf, scale=d ** -0.5, return_lse=True, workspace=ws, **sc)  # noqa
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # warm-up: compiles, and checks the metadata values outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    for step in range(4):
        fixed_lens = torch.tensor([1, 16, 17, 8191, 0, 300, 4096, 5000]) if step == 3 else None
        lens, bt = _rand_step(B, max_pages, num_pages, page, g, fixed_lens)
        sl_buf.copy_(lens)
        bt_buf.copy_(bt)
        q_buf.copy_(torch.randn(B, hq, d, generator=g).to(BF))
        graph.replay()
        torch.cuda.synchronize()
        kr, vr = (kc, vc) if fp8 else (kc.float(), vc.float())
        ref, ref_lse = R.decode(q_buf.float(), kr, vr, sl_buf, bt_buf, scale=d ** -0.5, return_lse=True, **sc)
        _close(out, ref, scale=2.0 if fp8 else 1.0, what=f"replay {step}")
        _lse_ok(lse, ref_lse)


def test_prefill_and_append_cuda_graph_replan():
    T, hq, hk, d, page, num_pages = 96, 32, 8, 128, 16, 512
    g = torch.Generator().manual_seed(8)
    kc = torch.randn(num_pages, page, hk, d, generator=g).to(DEV, BF)
    vc = torch.randn(num_pages, page, hk, d, generator=g).to(DEV, BF)
    q_buf = torch.randn(T, hq, d, generator=g).to(DEV, BF)
    k_new = torch.randn(T, hk, d, generator=g).to(DEV, BF)
    cu_buf = torch.tensor([0, 40, 40, 95, 96], dtype=torch.int32, device=DEV)
    sl_buf = torch.tensor([500, 7, 55, 1000], dtype=torch.int32, device=DEV)
    bt_buf = torch.randperm(num_pages, generator=g)[:4 * 64].view(4, 64).int().to(DEV)
    slots = torch.randperm(num_pages * page, generator=g)[:T].to(DEV)
    slots[::7] = -1

    def run():
        A.append(k_new, k_new, kc, vc, slots)
        return P.prefill(q_buf, kc, vc, cu_buf, sl_buf, bt_buf, scale=d ** -0.5)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for cu, sl in (([0, 1, 2, 3, 96], [1, 16, 17, 1000]), ([0, 96, 96, 96, 96], [96, 0, 5, 1])):
        cu_buf.copy_(torch.tensor(cu))
        sl_buf.copy_(torch.tensor(sl))
        bt_buf.copy_(torch.randperm(num_pages, generator=g)[:4 * 64].view(4, 64).int())
        slots.copy_(torch.randperm(num_pages * page, generator=g)[:T])
        slots[::5] = -1
        k_new.copy_(torch.randn(T, hk, d, generator=g).to(BF))
        rk, rv = kc.clone(), vc.clone()
        R.append(k_new, k_new, rk, rv, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kc, rk) and torch.equal(vc, rv)
        ref = R.prefill(q_buf.float(), kc.float(), vc.float(), cu_buf, sl_buf, bt_buf, scale=d ** -0.5)
        _close(out, ref)


@pytest.mark.parametrize("name", ["triton", "gluon-fp8"])
def test_mixed_cuda_graph_replan(name):
    """The mix of prefill chunks and decode tokens changes between replays of one captured step
    (gluon-fp8: on an fp8 cache, its one-token sequences on the Gluon decode)."""
    T, B, hq, hk, d, page, num_pages = 64, 8, 32, 8, 128, 16, 4096
    g = torch.Generator().manual_seed(12)
    kc = torch.randn(num_pages, page, hk, d, generator=g).to(DEV, BF)
    vc = torch.randn(num_pages, page, hk, d, generator=g).to(DEV, BF)
    sc = {}
    if name == "gluon-fp8":
        sc = dict(k_scale=kc.float().abs().amax(dim=(0, 1, 3)) / 448.0, v_scale=vc.float().abs().amax(dim=(0, 1, 3)) / 448.0)
        kc = R.quantize_fp8(kc.view(-1, hk, d), sc["k_scale"]).view(kc.shape)
        vc = R.quantize_fp8(vc.view(-1, hk, d), sc["v_scale"]).view(vc.shape)
    q_buf = torch.randn(T, hq, d, generator=g).to(DEV, BF)
    cu_buf = torch.tensor([0, 57, 58, 59, 60, 61, 62, 63, 64], dtype=torch.int32, device=DEV)
    sl_buf = torch.tensor([100, 5000, 1, 17, 16, 3000, 2, 9], dtype=torch.int32, device=DEV)
    bt_buf = torch.randperm(num_pages, generator=g)[:B * 320].view(B, 320).int().to(DEV)
    be = _be(name)
    ws = be("make_workspace", B, hq, d, device=DEV)
    run = lambda: be("mixed", q_buf, kc, vc, cu_buf, sl_buf, bt_buf, scale=d ** -0.5, workspace=ws, **sc)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for cu, sl in (([0, 1, 2, 3, 4, 5, 6, 7, 64], [4096, 1, 0 + 1, 300, 17, 16, 4000, 57]),
                   ([0, 8, 16, 24, 32, 40, 48, 56, 64], [8, 16, 24, 32, 4000, 48, 56, 64]),
                   ([0, 1, 2, 3, 4, 5, 6, 7, 64], [1, 2, 3, 4096, 5, 6, 7, 64])):
        cu_buf.copy_(torch.tensor(cu))
        sl_buf.copy_(torch.tensor(sl))
        bt_buf.copy_(torch.randperm(num_pages, generator=g)[:B * 320].view(B, 320).int())
        q_buf.copy_(torch.randn(T, hq, d, generator=g).to(BF))
        graph.replay()
        torch.cuda.synchronize()
        kr, vr = (kc, vc) if sc else (kc.float(), vc.float())
        ref = R.mixed(q_buf.float(), kr, vr, cu_buf, sl_buf, bt_buf, scale=d ** -0.5, **sc)
        _close(out, ref, scale=2.0 if sc else 1.0)


@pytest.mark.parametrize("name", ["triton", "gluon-fp8"])
def test_fixed_split_batch_invariance_bitwise(name):
    g = torch.Generator().manual_seed(9)
    seq = torch.randint(1, 8192, (32,), generator=g).tolist()
    seq[5] = 0
    pc = make_paged(seq, 8, 128, 16, dtype=BF, device=DEV, shared=True, fp8=name == "gluon-fp8")
    q, _ = make_query([1] * 32, 32, 128, dtype=BF, device=DEV)
    be = _be(name)
    mk = lambda B: be("make_workspace", B, 32, 128, device=DEV, batch_invariant=True,  # noqa: E731
                      max_seq_len=pc.block_tables.shape[1] * 16)
    full = be("decode", q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.088, workspace=mk(32),
              **pc.kw)
    for sub in ([3], [7, 0, 5], list(range(0, 32, 3))):
        part = be("decode", q[sub], pc.k_cache, pc.v_cache, pc.seq_lens[sub], pc.block_tables[sub], scale=0.088,
                  workspace=mk(len(sub)), **pc.kw)
        assert torch.equal(part, full[sub]), f"rows {sub} differ from the same rows in the batch of 32"


def test_prefill_batch_invariance_bitwise():
    seq, ql = [3000, 700, 5000], [1000, 700, 33]
    pc = make_paged(seq, 8, 128, 16, dtype=BF, device=DEV, shared=True)
    q, cu = make_query(ql, 32, 128, dtype=BF, device=DEV)
    full = P.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, scale=0.088)
    one = P.prefill(q[1000:1700], pc.k_cache, pc.v_cache, torch.tensor([0, 700], dtype=torch.int32, device=DEV),
                    pc.seq_lens[1:2], pc.block_tables[1:2], scale=0.088)
    assert torch.equal(one, full[1000:1700])


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_tile_variants(fp8):
    """Every tiling of the Triton decode the benchmark's variant rows time (page-id prefetch on or
    off, one stage, 128-key tiles on 8 warps), on 16-bit and fp8 caches, gives the reference's result
    at the edges of pages and splits."""
    from opmap.harness.bench.cases.attention import VARIANTS

    seq = [1, 15, 16, 17, 300, 4097, 8192, 0]
    pc = make_paged(seq, 8, 128, 16, dtype=BF, fp8=fp8, shared=True, poison=True, device=DEV)
    q, _ = make_query([1] * len(seq), 32, 128, dtype=BF, device=DEV)
    kw = dict(scale=128 ** -0.5, return_lse=True, **pc.kw)
    ref, ref_lse = _ref(R.decode, q, pc, pc.seq_lens, pc.block_tables, **kw)
    for cfg in VARIANTS["decode"]:
        out, lse = D.decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, config=cfg, **kw)
        _close(out, ref, scale=2.0 if fp8 else 1.0, what=str(cfg))
        _lse_ok(lse, ref_lse)


@pytest.mark.parametrize("name", ["triton", "gluon-fp8"])
def test_decode_fp8_fp16_dots_with_queries_past_fp16(name):
    """fp8 caches run fp16 dots on tiles converted by cvt.rn.f16x2.e4m3x2 (kernels/attention/fp8.py
    in the Triton kernel, gluon_util in the Gluon one); bf16 queries up to 1e6, far past fp16's range
    (the kernels divide q by a power of two), at the logits of unit queries, with a soft cap too:
    finite and the reference's result."""
    seq = [1, 17, 300, 4097, 32768]
    pc = make_paged(seq, 8, 128, 16, dtype=BF, fp8=True, shared=True, poison=True, device=DEV)
    q, _ = make_query([1] * len(seq), 32, 128, dtype=torch.float32, device=DEV)
    big = 1e6 / float(q.abs().max())
    q = (q * big).to(BF)
    for cap in (None, 30.0):
        kw = dict(scale=128 ** -0.5 / big, soft_cap=cap, return_lse=True, **pc.kw)
        ref, ref_lse = _ref(R.decode, q, pc, pc.seq_lens, pc.block_tables, **kw)
        out, lse = _be(name)("decode", q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, **kw)
        assert torch.isfinite(out).all()
        _close(out, ref, scale=2.0, what=f"cap={cap}")
        _lse_ok(lse, ref_lse)


@pytest.mark.parametrize("name", ["triton", "gluon-fp8"])
def test_fp8_quality_gate(name):
    """fp8 KV (per-kv-head scales from the absolute max) against the bf16 result on random data:
    each fp8 decode kernel's backend, and the prefill (triton's gather kernel)."""
    seq = [4096] * 8
    pc = make_paged(seq, 8, 128, 16, dtype=BF, device=DEV)
    amax = lambda c: c.float().abs().amax(dim=(0, 1, 3))  # noqa: E731
    ks, vs = amax(pc.k_cache) / 448.0, amax(pc.v_cache) / 448.0
    k8 = R.quantize_fp8(pc.k_cache.view(-1, 8, 128), ks).view(pc.k_cache.shape)
    v8 = R.quantize_fp8(pc.v_cache.view(-1, 8, 128), vs).view(pc.v_cache.shape)
    q, cu = make_query([1] * 8, 32, 128, dtype=BF, device=DEV)
    a = D.decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.088)
    b = _be(name)("decode", q, k8, v8, pc.seq_lens, pc.block_tables, scale=0.088, k_scale=ks, v_scale=vs)
    c = cosine(a, b)
    print(f"fp8 decode ({name}): cosine {c:.6f}, max abs err {float((a.float() - b.float()).abs().max()):.4g}")
    assert c >= 0.999
    qp, cup = make_query([512], 32, 128, dtype=BF, device=DEV)
    one = lambda kc, vc, **kw: P.prefill(qp, kc, vc, cup, pc.seq_lens[:1], pc.block_tables[:1], scale=0.088, **kw)  # noqa
    a, b = one(pc.k_cache, pc.v_cache), one(k8, v8, k_scale=ks, v_scale=vs)
    c = cosine(a, b)
    print(f"fp8 prefill: cosine {c:.6f}, max abs err {float((a.float() - b.float()).abs().max()):.4g}")
    assert c >= 0.999


@pytest.mark.parametrize("fp8", [False, True])
def test_kv_append_bitwise(fp8):
    g = torch.Generator().manual_seed(10)
    P_, page, hk, d, T = 300, 16, 8, 128, 1000
    dt = torch.float8_e4m3fn if fp8 else BF
    kc = torch.randn(P_, page, hk, d, generator=g).to(DEV).to(dt)
    vc = kc.clone()
    qkv = (torch.randn(T, 48, d, generator=g) * 4).to(DEV, BF)
    k, v = qkv[:, 32:40], qkv[:, 40:]
    slots = torch.randperm(P_ * page, generator=g)[:T].to(DEV)
    slots[::5] = -1
    sc = dict(k_scale=torch.rand(hk, device=DEV) + 0.01, v_scale=torch.rand(hk, device=DEV) + 0.01) if fp8 else {}
    rk, rv = kc.clone(), vc.clone()
    A.append(k, v, kc, vc, slots, **sc)
    R.append(k, v, rk, rv, slots, **sc)
    assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))


def test_merge_bf16():
    g = torch.Generator().manual_seed(11)
    oa, ob = (torch.randn(333, 32, 128, generator=g).to(DEV, BF) for _ in range(2))
    la, lb = (torch.randn(333, 32, generator=g).to(DEV) * 5 for _ in range(2))
    la[0] = float("-inf")
    o, lse = M.merge(oa, la, ob, lb)
    ro, rl = R.merge(oa.float(), la, ob.float(), lb)
    assert_close(o, ro, BF)
    assert_close(lse, rl, torch.float32)


@pytest.mark.parametrize("name", ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn"])
def test_sdpa_peers_contiguous(name):
    from opmap.core.contract import InputError
    from opmap.peers.attention import sdpa

    pre = getattr(sdpa, f"{name}_prefill")
    dec = getattr(sdpa, f"{name}_decode")
    if name == "sdpa_cudnn":  # cuDNN has no kernel for a single key: a clear error, not a crash
        pc1 = make_paged([1], 8, 128, 16, dtype=BF, device=DEV)
        q1, _ = make_query([1], 32, 128, dtype=BF, device=DEV)
        with pytest.raises(InputError, match="seq_lens"):
            dec(q1, *pc1.contiguous(), pc1.seq_lens, None, scale=0.088)
    seq = [300, 128, 2] if name == "sdpa_cudnn" else [300, 128, 1]
    pc = make_paged(seq, 8, 128, 16, dtype=BF, device=DEV)
    k, v = pc.contiguous()
    q, cu = make_query(seq, 32, 128, dtype=BF, device=DEV)
    ref = _ref(R.prefill, q, pc, cu, pc.seq_lens, pc.block_tables, scale=0.088)
    _close(pre(q, k, v, cu, pc.seq_lens, None, scale=0.088), ref)
    qd, _ = make_query([1] * 3, 32, 128, dtype=BF, device=DEV)
    ref = _ref(R.decode, qd, pc, pc.seq_lens, pc.block_tables, scale=0.088)
    _close(dec(qd, k, v, pc.seq_lens, None, scale=0.088), ref)
    qc, cuc = make_query([20, 7, 1], 32, 128, dtype=BF, device=DEV)
    if name == "sdpa_cudnn":
        with pytest.raises(InputError, match="cu_seqlens_q"):
            pre(qc, k, v, cuc, pc.seq_lens, None, scale=0.088)
    else:
        ref = _ref(R.prefill, qc, pc, cuc, pc.seq_lens, pc.block_tables, scale=0.088)
        _close(pre(qc, k, v, cuc, pc.seq_lens, None, scale=0.088), ref)


def test_flex_paged_compiled():
    from opmap.peers.attention import flex

    seq, ql = [1000, 300, 17], [1000, 44, 1]
    pc = make_paged(seq, 8, 128, 16, dtype=BF, device=DEV, shared=True)
    q, cu = make_query(ql, 32, 128, dtype=BF, device=DEV)
    out, lse = flex.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, scale=0.088,
                            window=256, soft_cap=30.0, return_lse=True)
    ref, rl = _ref(R.prefill, q, pc, cu, pc.seq_lens, pc.block_tables, scale=0.088, window=256, soft_cap=30.0,
                   return_lse=True)
    _close(out, ref, scale=2.0)
    _lse_ok(lse, rl)


def test_selected_on_this_gpu():
    from opmap.core import select
    from opmap.core import specs
    from opmap.core.hw import local_arch

    arch = local_arch()
    want = {"prefill": "triton", "decode": "gluon-fp8", "mixed": "gluon-fp8"}  # an sm90 GPU, fp8 at head dim 128
    for phase in ("prefill", "decode", "mixed"):
        ch = select.select("attention", specs.AttentionSpec(arch=arch, phase=phase, kv_dtype="fp8", cuda_graph=True))
        assert ch.name == want[phase], ch.explain()
    bf16 = specs.AttentionSpec(arch=arch, phase="prefill", page_size=64, cuda_graph=True)
    assert select.select("attention", bf16).name == "triton-tma"
    assert select.select("attention", bf16.replace(phase="decode")).name == "triton"


@pytest.mark.parametrize("T,hq,hk,d,rot,page,style,fp8", [
    (1, 32, 8, 128, 128, 16, "neox", False),  # Llama-3-8B decode at batch 1
    (64, 32, 4, 128, 128, 64, "neox", False),  # Qwen3-30B-A3B decode at batch 64
    (4096, 28, 4, 128, 128, 16, "neox", False),  # Qwen2.5-7B prefill
    (300, 16, 2, 256, 64, 32, "gptj", True),  # partial rotary, GPT-J, fp8 cache
])
@pytest.mark.parametrize("config", [None, {"Q_HEADS": 0}, {"Q_HEADS": 3}, {"Q_HEADS": 8}])
def test_rope_append_equals_rope_then_append(T, hq, hk, d, rot, page, style, fp8, config):
    """The fused RoPE + KV append (one launch per layer in the engine) writes the same bits to q,
    k and both caches as the rope kernel followed by the append kernel, in bf16 on the GPU, with a
    token in one program or spread over several (config Q_HEADS)."""
    from opmap.kernels.attention.rope_append import rope_append
    from opmap.ops.rope import reference as RR
    from opmap.kernels.rope import triton_rope as TR

    g = torch.Generator(device=DEV).manual_seed(T)
    qkv = (torch.randn(T, hq + 2 * hk, d, generator=g, device=DEV) * 2).to(BF)
    P_ = triton_cdiv(T + 7, page) + 3
    pos = torch.randint(0, 100000, (T,), generator=g, device=DEV)
    cs = RR.cos_sin_cache(rot, 100000, theta=1e6, device=DEV)
    slots = torch.randperm(P_ * page, generator=g, device=DEV)[:T].to(torch.int32)
    slots[::7] = -1
    cdt = torch.float8_e4m3fn if fp8 else BF
    kc = torch.randn(P_, page, hk, d, generator=g, device=DEV).to(cdt)
    vc = torch.randn(P_, page, hk, d, generator=g, device=DEV).to(cdt)
    sc = dict(k_scale=torch.rand(hk, device=DEV) + 0.05, v_scale=torch.rand(hk, device=DEV) + 0.05) if fp8 else {}
    qkv2, kc2, vc2 = qkv.clone(), kc.clone(), vc.clone()
    views = lambda x: (x[:, :hq], x[:, hq:hq + hk], x[:, hq + hk:])  # noqa: E731
    q, k, v = views(qkv)
    q2, k2, v2 = views(qkv2)
    rope_append(q, k, v, pos, cs, style, kc, vc, slots, config=config, **sc)
    TR.rope(q2, k2, pos, cs, style)
    A.append(k2, v2, kc2, vc2, slots, **sc)
    torch.cuda.synchronize()
    for a, b in ((qkv, qkv2), (kc, kc2), (vc, vc2)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def triton_cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("T", [1, 64, 2048])
def test_qk_norm_rope_append_matches_three_launches(T):
    """Qwen3-30B-A3B's per-layer q/k norm + RoPE + KV append in one launch against qk_rmsnorm, rope
    and append (bf16): the caches and q within bf16 rounding (the norms' row sums may reduce in
    another order than qk_rmsnorm's), and most values bitwise."""
    from opmap.kernels.attention.rope_append import rope_append
    from opmap.kernels.norm import triton_norm as TN
    from opmap.ops.rope import reference as RR
    from opmap.kernels.rope import triton_rope as TR

    hq, hk, d, page = 32, 4, 128, 16
    g = torch.Generator(device=DEV).manual_seed(T)
    qkv = (torch.randn(T, hq + 2 * hk, d, generator=g, device=DEV) * 2).to(BF)
    w_q = (torch.rand(d, generator=g, device=DEV) + 0.5).to(BF)
    w_k = (torch.rand(d, generator=g, device=DEV) + 0.5).to(BF)
    P_ = triton_cdiv(T, page) + 2
    pos = torch.randint(0, 40000, (T,), generator=g, device=DEV)
    cs = RR.cos_sin_cache(d, 40960, theta=1e6, device=DEV)
    slots = torch.randperm(P_ * page, generator=g, device=DEV)[:T].to(torch.int32)
    kc = torch.zeros(P_, page, hk, d, device=DEV, dtype=BF)
    vc = torch.zeros_like(kc)
    qkv2, kc2, vc2, qkv0 = qkv.clone(), kc.clone(), vc.clone(), qkv.clone()
    views = lambda x: (x[:, :hq], x[:, hq:hq + hk], x[:, hq + hk:])  # noqa: E731
    q, k, v = views(qkv)
    q2, k2, v2 = views(qkv2)
    rope_append(q, k, v, pos, cs, "neox", kc, vc, slots, qk_norm=(w_q, w_k, 1e-6))
    TN.qk_rmsnorm(qkv2[:, :hq + hk], w_q, w_k, hq, 1e-6)
    TR.rope(q2, k2, pos, cs, "neox")
    A.append(k2, v2, kc2, vc2, slots)
    for a, b in ((qkv, qkv2), (kc, kc2)):
        assert_close(a, b, BF)
        assert (a == b).float().mean() > 0.99
    assert torch.equal(vc, vc2)
    # Spread over programs (config Q_HEADS: k / v in one, 4 or 5 q heads in each other): the same
    # bits as one program a token, the norms' row sums being each head's own either way.
    for qh in (4, 5):
        qkv3, kc3, vc3 = qkv0.clone(), torch.zeros_like(kc), torch.zeros_like(vc)
        rope_append(*views(qkv3), pos, cs, "neox", kc3, vc3, slots, qk_norm=(w_q, w_k, 1e-6), config={"Q_HEADS": qh})
        qkv4, kc4, vc4 = qkv0.clone(), torch.zeros_like(kc), torch.zeros_like(vc)
        rope_append(*views(qkv4), pos, cs, "neox", kc4, vc4, slots, qk_norm=(w_q, w_k, 1e-6), config={"Q_HEADS": 0})
        for a, b in ((qkv4, qkv3), (kc4, kc3), (vc4, vc3)):
            assert torch.equal(a, b)
        for a, b in ((qkv, qkv3), (kc, kc3), (vc, vc3)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("split_tokens", [256, 512, 2048])
def test_combine_many_splits(split_tokens):
    """_combine_kernel (all LSEs at once, tiles of splits) at the split lengths the bench compares
    at B=1 / 32768 (128, 64 and 16 splits) and beside shorter rows: equal to the reference and
    deterministic over three launches."""
    seq = [32768, 4097, 1, 300]
    pc = make_paged(seq, 8, 128, 16, dtype=BF, shared=True, poison=True, device=DEV)
    q, _ = make_query([1] * len(seq), 32, 128, dtype=BF, device=DEV)
    ws = D.make_workspace(len(seq), 32, 128, device=DEV, split_tokens=split_tokens,
                          max_seq_len=pc.block_tables.shape[1] * 16)
    runs = [D.decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=128 ** -0.5, return_lse=True,
                     workspace=ws) for _ in range(3)]
    torch.cuda.synchronize()
    assert all(torch.equal(r[0], runs[0][0]) and torch.equal(r[1], runs[0][1]) for r in runs)
    ref, ref_lse = _ref(R.decode, q, pc, pc.seq_lens, pc.block_tables, scale=128 ** -0.5, return_lse=True)
    _close(runs[0][0], ref, what=f"split_tokens={split_tokens}")
    _lse_ok(runs[0][1], ref_lse)
