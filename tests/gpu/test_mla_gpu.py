"""MLA on the GPU (bf16, DeepSeek shapes: R = 512, Dr = 64; 16 and 128 heads) against the fp32
reference, each decode kernel through its backend (mla-triton: the pointer kernel; mla-tma: the TMA
kernel; mla-gluon-fp8: the Gluon fp8 kernel; mla-gluon-ws: the Gluon warp-specialised kernel): page
sizes 1/16/64 with shuffled pages and lengths at page boundaries, 1 and 32k; fp8 cache (cosine >=
0.999 vs bf16); sparse top-k 2048; CUDA-graph replay after re-planning; chunked prefill with a
cached prefix; append bit-exact vs torch; the SDPA peer."""
import pytest
import torch

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.kernels.mla import append as ap
from opmap.kernels.mla import decode as dec
from opmap.kernels.mla import decode_fp8 as G
from opmap.kernels.mla import decode_tma as tma
from opmap.kernels.mla import prefill as pf
from opmap.ops.mla import reference as ref
from opmap.harness.fixtures.mla import make_cache, sparse_indices
from opmap.core.tolerance import assert_close, cosine

pytestmark = pytest.mark.gpu
R, DR = 512, 64
BF = torch.bfloat16
SCALE = 192 ** -0.5  # DeepSeek's softmax scale (qk_nope 128 + rope 64), before YaRN mscale


def _q(B, H, g, dt=BF):
    qn = torch.randn(B, H, R, generator=g, device="cuda").to(dt)
    qp = torch.randn(B, H, DR, generator=g, device="cuda").to(dt)
    return qn, qp


def _agree(got, want, scale=1.0, what="output"):
    """bf16 tolerance plus a cosine gate: long-context outputs are averages of many rows and can be
    smaller than bf16's absolute tolerance, where assert_close alone would not notice a wrong answer."""
    assert_close(got, want, dtype=BF, scale=scale, what=what)
    c = cosine(got, want)
    assert c >= 0.9995, f"{what}: cosine {c:.6f}"


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _be(name):
    """A backend's entries by name: ``_be("mla-tma")("mla_decode", ...)`` runs the TMA kernel."""
    return registry.get("attention", name)


def _cache(lens, page, seed, fp8=False):
    return make_cache(lens, R, DR, page, BF, device="cuda", fp8=fp8,
                      gen=torch.Generator().manual_seed(seed), std=0.5)


def _poisoned_cache(lens, seed):
    """A bf16 cache of pages of 64 with NaN in every row of a sequence's last page past its length
    (rows no kernel may read: 0 * NaN would poison the output)."""
    pc = _cache(lens, 64, seed)
    for b, n in enumerate(lens):
        if n % 64:
            pc.cache[int(pc.block_tables[b, n // 64]), n % 64:] = float("nan")
    return pc


@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_decode_bf16_pages(H, page):
    """The pointer kernel at every page size; the TMA kernel too where pages hold whole tiles."""
    lens = [1, page, page + 1, 2 * page - 1, 1000, 0, 4096 + 3]
    pc = _cache(lens, page, page + H)
    qn, qp = _q(len(lens), H, _gen(1))
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE, return_lse=True)
    for name in ["mla-triton"] + (["mla-tma"] if page % 64 == 0 else []):
        got = _be(name)("mla_decode", qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE, return_lse=True)
        _agree(got[0], want[0], what=name)
        assert_close(got[1], want[1], dtype=BF, what="lse")


@pytest.mark.parametrize("name", ["mla-triton", "mla-tma"])
@pytest.mark.parametrize("H", [16, 128])
def test_decode_long_context_split(H, name):
    lens = [32768]
    pc = _cache(lens, 64, 5)
    qn, qp = _q(1, H, _gen(2))
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE, return_lse=True)
    ws = _be(name)("make_workspace", 1, H, R, "cuda")
    assert ws.num_splits > 1  # B=1 must split the context to fill the GPU
    got = _be(name)("mla_decode", qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE, return_lse=True,
                    workspace=ws)
    _agree(got[0], want[0])
    assert_close(got[1], want[1], dtype=BF, what="lse")


TMA16 = dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=3)
TMA64 = dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=3)


@pytest.mark.parametrize("H,name,config", [(16, "mla-gluon-fp8", None), (128, "mla-gluon-fp8", None),
                                           (16, "mla-tma", TMA16), (128, "mla-tma", TMA64), (128, "mla-tma", TMA16),
                                           (16, "mla-triton", None), (128, "mla-triton", None)])
def test_decode_fp8_cosine(H, name, config):
    """Each decode kernel on an fp8 cache: the Gluon kernel (the selector's), the TMA kernel (e4m3
    tiles converted after the copy) and the pointer kernel."""
    lens = [100, 2048, 5000]
    pc = _cache(lens, 64, 6, fp8=True)
    qn, qp = _q(3, H, _gen(3))
    bf = dec.mla_decode(qn, qp, pc.values.to(BF), pc.seq_lens, pc.block_tables, scale=SCALE)
    kw = {"config": config} if config else {}
    q8 = _be(name)("mla_decode", qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE, kv_scale=pc.kv_scale,
                   **kw)
    assert cosine(q8, bf) >= 0.999
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE, kv_scale=pc.kv_scale)
    _agree(q8, want)


@pytest.mark.parametrize("H,name,config", [(16, "mla-gluon-fp8", None), (128, "mla-gluon-fp8", None),
                                           (128, "mla-triton", dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1)),
                                           (16, "mla-triton", dict(BLOCK_H=16, BLOCK_N=32, num_warps=8, num_stages=2)),
                                           (16, "mla-tma", TMA16), (128, "mla-tma", TMA64)])
def test_decode_fp8_fp16_dots_with_queries_past_fp16(H, name, config):
    """The fp8 cache's fp16 dots (tiles converted by cvt.rn.f16x2.e4m3x2) with bf16 queries up to
    1e6, far past fp16's range (the kernel divides q by a power of two): finite and the reference's
    result, at the same logits as unit queries. 64-head blocks (the pointer kernel's at B >= 64)
    keep Triton's cast and bf16 dots."""
    lens = [100, 2048, 5000]
    pc = _cache(lens, 64, 7, fp8=True)
    qn, qp = _q(3, H, _gen(5))
    big = 1e6 / float(torch.maximum(qn.abs().max(), qp.abs().max()))
    qn, qp = (qn.float() * big).to(BF), (qp.float() * big).to(BF)
    kw = dict(scale=SCALE / big, kv_scale=pc.kv_scale)
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, **kw)
    if config:
        kw["config"] = config
    got = _be(name)("mla_decode", qn, qp, pc.cache, pc.seq_lens, pc.block_tables, **kw)
    assert torch.isfinite(got).all()
    _agree(got, want)


def _captured(run):
    """(graph, its output): ``run`` warmed up on a side stream (compiles outside the capture), then
    captured."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def _gluon_calls(monkeypatch):
    """Counts launches of the Gluon fp8 kernel (decode_fp8.launch), so a test knows it ran."""
    n = [0]
    real = G.launch

    def counted(*a, **k):
        n[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(G, "launch", counted)
    return n


@pytest.mark.parametrize("H", [16, 20, 128])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_decode_fp8_gluon_lengths_pages_and_nan_past_lengths(H, page, monkeypatch):
    """The Gluon fp8 kernel against the fp32 reference at tile and page boundaries (63/64/65 keys,
    page +- 1), empty and one-key sequences, a head count that is not a multiple of its 16-head
    block, shuffled pages, NaN in every cache row past a length (never read), the scale as a
    float and as a tensor, one split and many."""
    n = _gluon_calls(monkeypatch)
    lens = [0, 1, 63, 64, 65, page - 1 if page > 1 else 2, page + 1, 2 * page, 1000, 4096 + 3]
    pc = _cache(lens, page, 40 + page + H, fp8=True)
    with torch.no_grad():
        for b, L in enumerate(lens):  # poison the slots past the length in the sequence's last page
            for j in range(L, -(-L // page) * page):
                pc.cache[pc.block_tables[b, j // page], j % page] = float("nan")
    qn, qp = _q(len(lens), H, _gen(6))
    for ks in (float(pc.kv_scale), pc.kv_scale):
        want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE, kv_scale=ks,
                              return_lse=True)
        for ws in (G.make_workspace(len(lens), H, R, "cuda", num_splits=1),
                   G.make_workspace(len(lens), H, R, "cuda", num_splits=8, split_min=64)):
            got = _be("mla-gluon-fp8")("mla_decode", qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE,
                                       kv_scale=ks, return_lse=True, workspace=ws)
            assert torch.isfinite(got[0]).all()
            _agree(got[0], want[0], what=f"splits={ws.num_splits}")
            assert_close(got[1], want[1], dtype=BF, what="lse")
    assert n[0] == 4


def test_decode_fp8_gluon_long_context_and_graph_replay(monkeypatch):
    """B=1 at 32k keys (many splits, the merge) and a captured graph replayed after the lengths,
    page tables, queries and the cache scale change."""
    n = _gluon_calls(monkeypatch)
    H = 16
    pc = _cache([32768], 64, 9, fp8=True)
    qn, qp = _q(1, H, _gen(7))
    ws = G.make_workspace(1, H, R, "cuda")
    assert ws.num_splits > 1
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE, kv_scale=pc.kv_scale)
    got = G.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE, kv_scale=pc.kv_scale,
                       workspace=ws)
    _agree(got, want)

    B, page, maxp = 4, 64, 80
    P = B * maxp + 4
    g = _gen(8)
    cache = (torch.randn(P, page, R + DR, generator=g, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    ks = torch.tensor([0.7], device="cuda")
    qn, qp = _q(B, H, g)
    seq_lens = torch.tensor([5, 64, 65, 700], dtype=torch.int32, device="cuda")
    tables = torch.randperm(P, device="cuda")[:B * maxp].view(B, maxp).to(torch.int32).contiguous()
    ws = G.make_workspace(B, H, R, "cuda")
    run = lambda: G.mla_decode(qn, qp, cache, seq_lens, tables, scale=SCALE, kv_scale=ks, workspace=ws)  # noqa: E731
    graph, out = _captured(run)
    for lens, k in (([5, 64, 65, 700], 0.7), ([4096, 1, 0, 5000], 1.3), ([3000, 2999, 64, 128], 0.05)):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        tables.copy_(torch.randperm(P, device="cuda")[:B * maxp].view(B, maxp))
        qn.copy_(torch.randn(B, H, R, generator=g, device="cuda"))
        ks.fill_(k)
        graph.replay()
        want = ref.mla_decode(qn, qp, cache, seq_lens, tables, scale=SCALE, kv_scale=ks)
        _agree(out, want, what=f"replay lens={lens}")
    assert n[0] >= 2


def test_selected_on_this_gpu():
    """The engine's MLA decode spec (pages of 64, CUDA graphs) on this sm90 GPU: the TMA kernel for a
    bf16 cache, the Gluon kernel for an fp8 one; each entry runs its own kernel."""
    from opmap.core import select, specs
    from opmap.core.hw import local_arch

    spec = specs.AttentionSpec(arch=local_arch(), kind="mla", num_heads=16, num_kv_heads=1, head_dim=R + DR,
                               head_dim_v=R, page_size=64, cuda_graph=True)
    assert select.select("attention", spec).name == "mla-tma"
    assert select.select("attention", spec.replace(kv_dtype="fp8")).name == "mla-gluon-fp8"
    assert select.select("attention", spec.replace(page_size=16)).name == "mla-triton"
    assert _be("mla-tma").fn("mla_decode") is tma.mla_decode and _be("mla-gluon-fp8").fn("mla_decode") is G.mla_decode


def test_ws_decode_fp16():
    """mla-gluon-ws on fp16 queries and an fp16 cache (the other 16-bit type; the cases above are
    bf16), 128 heads, lengths at tile edges and a split plan of eight."""
    F16 = torch.float16
    lens = [1, 63, 65, 1000, 4096 + 3]
    pc = make_cache(lens, R, DR, 64, F16, device="cuda", gen=torch.Generator().manual_seed(53), std=0.5)
    qn, qp = _q(len(lens), 128, _gen(53), F16)
    ws = _be("mla-gluon-ws")("make_workspace", len(lens), 128, R, "cuda", num_splits=8)
    got = _be("mla-gluon-ws")("mla_decode", qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE,
                              return_lse=True, workspace=ws)
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE, return_lse=True)
    assert got[0].dtype == F16
    _agree(got[0], want[0], what="fp16")
    assert_close(got[1], want[1], dtype=BF, what="lse")


@pytest.mark.parametrize("name,H", [("mla-triton", 16), ("mla-tma", 16), ("mla-gluon-ws", 128)])
def test_decode_cuda_graph_replay_after_replanning(name, H):
    """Captured once with its workspace, replayed after the lengths, page tables and queries change
    (each launch reads nothing on the host); mla-gluon-ws at the 128 heads it serves."""
    B, page, maxp = 4, 64, 80
    P = B * maxp + 4
    g = _gen(4)
    cache = (torch.randn(P, page, R + DR, generator=g, device="cuda") * 0.5).to(BF)
    qn, qp = _q(B, H, g)
    seq_lens = torch.tensor([5, 64, 65, 700], dtype=torch.int32, device="cuda")
    tables = torch.randperm(P, device="cuda")[:B * maxp].view(B, maxp).to(torch.int32).contiguous()
    ws = _be(name)("make_workspace", B, H, R, "cuda")
    run = lambda: _be(name)("mla_decode", qn, qp, cache, seq_lens, tables, scale=SCALE, workspace=ws)  # noqa: E731
    graph, out = _captured(run)
    for lens in ([5, 64, 65, 700], [4096, 1, 0, 5000], [3000, 2999, 64, 128]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        tables.copy_(torch.randperm(P, device="cuda")[:B * maxp].view(B, maxp))
        qn.copy_(torch.randn(B, H, R, generator=g, device="cuda"))
        graph.replay()
        want = ref.mla_decode(qn, qp, cache, seq_lens, tables, scale=SCALE)
        _agree(out, want, what=f"replay lens={lens}")


@pytest.mark.parametrize("ctx", [32768, 131072])
def test_sparse_decode_topk_2048(ctx):
    lens = [ctx, 1500]  # the second sequence is shorter than k: -1 padded
    pc = _cache(lens, 64, 7)
    qn, qp = _q(2, 128, _gen(5))
    idx = sparse_indices(lens, 2048, gen=torch.Generator().manual_seed(8), device="cuda")
    want = ref.mla_sparse_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, idx, scale=SCALE,
                                 return_lse=True)
    got = dec.mla_sparse_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, idx, scale=SCALE,
                                return_lse=True)
    _agree(got[0], want[0])
    assert_close(got[1], want[1], dtype=BF, what="lse")
    bad = idx.clone()
    bad[1, 0] = 1500
    with pytest.raises(InputError, match="indices"):
        dec.mla_sparse_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, bad, scale=SCALE)


def _prefill_args(H, seed):
    """A cached prefix (1000 new tokens of 3000), a whole prompt of 517 and a one-token sequence;
    DeepSeek's per-head dims (128 + 64 keys, 128 values)."""
    Dn, Dv = 128, 128
    pc = _cache([3000, 517, 64], 64, 9)
    g = _gen(seed)
    T = 1000 + 517 + 1
    qn = torch.randn(T, H, Dn, generator=g, device="cuda").to(BF)
    qp = torch.randn(T, H, DR, generator=g, device="cuda").to(BF)
    wk = (torch.randn(H, Dn, R, generator=g, device="cuda") / 16).to(BF)
    wv = (torch.randn(H, Dv, R, generator=g, device="cuda") / 16).to(BF)
    cu = torch.tensor([0, 1000, 1517, 1518], dtype=torch.int32, device="cuda")
    return (qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables)


@pytest.mark.parametrize("H,chunk", [(16, None), (128, 1024)])
def test_prefill_bf16_prefix_chunked(H, chunk):
    args = _prefill_args(H, 6)
    want = ref.mla_prefill(*args, scale=SCALE, return_lse=True)
    got = pf.mla_prefill(*args, scale=SCALE, return_lse=True, chunk_size=chunk)
    _agree(got[0], want[0], scale=2.0)  # K/V rounded to bf16 after the kv_b GEMM, as in HF
    assert_close(got[1], want[1], dtype=BF, what="lse")


@pytest.mark.parametrize("config", [None, dict(BLOCK_M=64, num_stages=2), dict(BLOCK_N=32), dict(BLOCK_M=64, num_stages=3)])
def test_prefill_configs(config):
    """The default and the bench's --variants prefill tiles on the chunked-prefix case, 16 heads."""
    args = _prefill_args(16, 7)
    want = ref.mla_prefill(*args, scale=SCALE, return_lse=True)
    for chunk in (None, 1024):
        got = pf.mla_prefill(*args, scale=SCALE, return_lse=True, chunk_size=chunk, config=config)
        _agree(got[0], want[0], scale=2.0)
        assert_close(got[1], want[1], dtype=BF, what="lse")


@pytest.mark.parametrize("fp8", [False, True])
def test_append_exact(fp8):
    g = _gen(10)
    T, P, page = 300, 8, 64
    ckv = torch.randn(T, R, generator=g, device="cuda").to(BF) * 3
    kpe = torch.randn(T, DR, generator=g, device="cuda").to(BF) * 3
    dt = torch.float8_e4m3fn if fp8 else BF
    base = torch.randn(P, page, R + DR, generator=g, device="cuda").to(dt)
    slots = torch.randperm(P * page, device="cuda")[:T].to(torch.int32)
    slots[::7] = -1
    scale = torch.tensor([0.02], device="cuda") if fp8 else None
    a, b = base.clone(), base.clone()
    ref.append_mla(ckv, kpe, a, slots, scale)
    ap.append_mla(ckv, kpe, b, slots, scale)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_sdpa_peer_matches_reference():
    from opmap.peers.mla import sdpa

    lens = [1, 64, 1000]
    pc = _cache(lens, 16, 11)
    qn, qp = _q(3, 16, _gen(7))
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE)
    _agree(sdpa.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE), want)


def test_absorbed_decode_equals_non_absorbed_prefill_bf16():
    """DeepSeek-V2-Lite shapes: W_UV(decode(q_nope W_UK)) == the non-absorbed prefill of the last token."""
    H, Dn, Dv = 16, 128, 128
    lens = [700, 4097]
    pc = _cache(lens, 64, 12)
    g = _gen(13)
    kv_b = (torch.randn(H * (Dn + Dv), R, generator=g, device="cuda") / 16).to(BF)
    wk, wv = ref.split_kv_b(kv_b, H, Dn, Dv)
    qn = torch.randn(2, H, Dn, generator=g, device="cuda").to(BF)
    qp = torch.randn(2, H, DR, generator=g, device="cuda").to(BF)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    want = ref.mla_prefill(qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables, scale=SCALE)
    q_abs = torch.einsum("bhd,hdr->bhr", qn.float(), wk.float()).to(BF)
    lat = dec.mla_decode(q_abs, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE)
    got = torch.einsum("bhr,hvr->bhv", lat.float(), wv.float())
    _agree(got, want, scale=2.0)  # q_abs and the latent output rounded to bf16
    pre = pf.mla_prefill(qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables, scale=SCALE)
    _agree(pre, want, scale=2.0)


def test_sparse_decode_cuda_graph_replay_new_indices():
    """Index validation reads the host, so it is skipped while capturing; the replay must still
    follow new indices and lengths (and masked positions cannot read outside the cache)."""
    H, B, page, maxp, k = 128, 2, 64, 64, 256
    P = B * maxp
    g = _gen(14)
    cache = (torch.randn(P, page, R + DR, generator=g, device="cuda") * 0.5).to(BF)
    qn, qp = _q(B, H, g)
    seq_lens = torch.tensor([4096, 300], dtype=torch.int32, device="cuda")
    tables = torch.randperm(P, device="cuda").view(B, maxp).to(torch.int32).contiguous()
    idx = sparse_indices([4096, 300], k, gen=torch.Generator().manual_seed(1), device="cuda")
    ws = dec.make_workspace(B, H, R, "cuda")
    run = lambda: dec.mla_sparse_decode(qn, qp, cache, seq_lens, tables, idx, scale=SCALE,  # noqa: E731
                                        workspace=ws)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed, lens in ((2, [1000, 4000]), (3, [17, 4096])):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        idx.copy_(sparse_indices(lens, k, gen=torch.Generator().manual_seed(seed), device="cuda"))
        graph.replay()
        want = ref.mla_sparse_decode(qn, qp, cache, seq_lens, tables, idx, scale=SCALE)
        _agree(out, want, what=f"sparse replay lens={lens}")


@pytest.mark.parametrize("name", ["mla-tma", "mla-triton"])
@pytest.mark.parametrize("H,lens", [(16, [32768]), (128, [1, 4099, 0, 1000]), (16, [300] * 64)])
def test_split_merge_against_reference(H, lens, name):
    """The merge launch (all LSEs at once, tiles of splits, R in blocks of 128) at the plans the
    engine makes: 128 splits at B=1 / 32768, a mixed batch with an empty sequence, B=64. Equal to
    the reference and deterministic over three launches."""
    pc = _cache(lens, 64, 11)
    qn, qp = _q(len(lens), H, _gen(3))
    ws = _be(name)("make_workspace", len(lens), H, R, "cuda")
    runs = [_be(name)("mla_decode", qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE, return_lse=True,
                      workspace=ws) for _ in range(3)]
    torch.cuda.synchronize()
    assert all(torch.equal(r[0], runs[0][0]) and torch.equal(r[1], runs[0][1]) for r in runs)
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE)
    _agree(runs[0][0], want, what=f"H={H} lens={lens[:4]}")


@pytest.mark.parametrize("H,cfg", [(16, None), (128, None), (16, dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2)),
                                   (16, dict(BLOCK_H=16, BLOCK_N=64, num_warps=4, num_stages=2)),
                                   (128, dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2)),
                                   (16, dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2)),
                                   (16, dict(BLOCK_H=16, BLOCK_N=32, num_warps=8, num_stages=3))],
                         ids=["h16-default", "h128-default", "h16-s2", "h16-bn64", "h128-keys-rows", "h16-heads-rows",
                              "h16-w8"])
def test_tma_decode_bf16(H, cfg):
    """The TMA kernel (mla-tma) at real shapes, in both dot layouts: lengths around the 64-token tiles and
    pages, a 32k context, an empty sequence; NaN in every row past a length (the tail tile must not
    read them); then a CUDA-graph replay after re-planning."""
    lens = [1, 63, 64, 65, 1000, 0, 4096 + 3, 32768]
    pc = _poisoned_cache(lens, 40 + H)
    qn, qp = _q(len(lens), H, _gen(41))
    ws = tma.make_workspace(len(lens), H, R, "cuda", config=cfg)
    run = lambda: tma.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE,  # noqa: E731
                                 return_lse=True, workspace=ws, config=cfg)
    got = run()
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE, return_lse=True)
    _agree(got[0], want[0])
    assert_close(got[1], want[1], dtype=BF, what="lse")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    # shorter or equal lengths only: the rows past the old ones hold NaN
    pc.seq_lens.copy_(torch.tensor([1, 40, 64, 64, 700, 0, 4000, 30000], dtype=torch.int32))
    graph.replay()
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE, return_lse=True)
    _agree(out[0], want[0], what="replay")


@pytest.mark.parametrize("T,H", [(1, 16), (1, 128), (37, 16)])
def test_norm_rope_append_equals_the_three_launches_bf16(T, H):
    """norm_rope_append_mla on the GPU in bf16 (DeepSeek widths: R 512, Dr 64, yarn-free cos/sin)
    against the latent norm, rope and append launches it replaces: q_pe, kpe and the cache rows
    bitwise equal, or (a compiler summing the norm's squares in another order) within one bf16
    rounding of the norm's output."""
    from opmap.core.tolerance import assert_close

    R, Dr, page = 512, 64, 64
    g = torch.Generator(device="cuda").manual_seed(T * H)
    q = torch.randn(T, H, 128 + Dr, device="cuda", generator=g).to(torch.bfloat16)
    kva = torch.randn(T, R + Dr, device="cuda", generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(R, device="cuda", generator=g)).to(torch.bfloat16)
    pos = torch.randint(0, 4000, (T,), device="cuda", generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, Dr, 2, device="cuda").float() / Dr))
    ang = torch.arange(4096, device="cuda").float()[:, None] * inv[None, :]
    cs = torch.cat([ang.cos(), ang.sin()], 1).contiguous()
    cache = torch.zeros(8, page, R + Dr, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(8 * page, device="cuda", generator=g)[:T].to(torch.int32)
    q2, kva2, cache2 = q.clone(), kva.clone(), cache.clone()
    registry.get("kv_append", "mla-triton")("norm_rope_append_mla", q[..., 128:], kva, w, 1e-6, pos, cs, "gptj",
                                            cache, slots)
    ckv = registry.get("rmsnorm", "triton")("rmsnorm", kva2[:, :R], w, 1e-6)
    registry.get("rope", "triton")("rope", q2[..., 128:], kva2[:, None, R:], pos, cs, "gptj")
    registry.get("kv_append", "mla-triton")("append_mla", ckv, kva2[:, R:], cache2, slots)
    assert torch.equal(q, q2) and torch.equal(kva[:, R:], kva2[:, R:])
    assert torch.equal(cache[..., R:], cache2[..., R:])
    assert_close(cache[..., :R].float(), cache2[..., :R].float(), torch.bfloat16, what="latent rows")


@pytest.mark.parametrize("scale", [1.0, 0.5, "tensor"])
def test_fp8_latent_append_of_16_bit_rows_equals_the_reference(scale):
    """Both MLA append kernels with bf16 rows into an fp8 latent cache (the dtypes that once left
    their fp8 helper with two return types, which no GPU build accepts): the stored bytes are the
    reference's (a correctly rounded row / scale, clamped)."""
    R, Dr, page, T = 512, 64, 64, 5
    g = torch.Generator(device="cuda").manual_seed(7)
    kva = (3 * torch.randn(T, R + Dr, device="cuda", generator=g)).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(R, device="cuda", generator=g)).to(torch.bfloat16)
    pos = torch.randint(0, 4000, (T,), device="cuda", generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, Dr, 2, device="cuda").float() / Dr))
    ang = torch.arange(4096, device="cuda").float()[:, None] * inv[None, :]
    cs = torch.cat([ang.cos(), ang.sin()], 1).contiguous()
    q = torch.randn(T, 16, Dr, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randperm(4 * page, device="cuda", generator=g)[:T].to(torch.int32)
    s = torch.tensor([0.25], device="cuda") if scale == "tensor" else scale  # a float, or [1] fp32 on the device
    tri, want = registry.get("kv_append", "mla-triton"), registry.get("kv_append", "mla-reference")
    for entry, args in (("append_mla", lambda kv, qq: (kv[:, :R], kv[:, R:])),
                        ("norm_rope_append_mla", lambda kv, qq: (qq, kv, w, 1e-6, pos, cs, "gptj"))):
        caches = [torch.zeros(4, page, R + Dr, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(2)]
        for be, cache in zip((tri, want), caches):
            be(entry, *args(kva.clone(), q.clone()), cache, slots, s)
        got, exp = caches
        if entry == "append_mla":
            assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8))
        else:  # the latent's norm may round its bf16 output once differently: one fp8 step at most
            assert torch.equal(got[..., R:].view(torch.uint8), exp[..., R:].view(torch.uint8))
            a, b = got[..., :R].float(), exp[..., :R].float()
            assert bool(((a - b).abs() <= 0.125 * b.abs() + 2.0 ** -9).all())


@pytest.mark.parametrize("H", [64, 96, 128])
@pytest.mark.parametrize("splits", [1, 8])
def test_ws_decode_lengths_nan_past_lengths_and_bad_pages(H, splits):
    """The Gluon warp-specialised decode (mla-gluon-ws) against the fp32 reference: lengths at tile
    and page edges (63/64/65, 4096 + 3), empty and one-key sequences, a 32k context, a head count
    that is not a multiple of its 64-head block, NaN in every cache row past a length (a partial tile
    is read ending at its split's end), one split and eight; a page id outside the cache reads as
    masked keys."""
    lens = [0, 1, 63, 64, 65, 1000, 4096 + 3, 32768]
    pc = _poisoned_cache(lens, 50 + H)
    qn, qp = _q(len(lens), H, _gen(51))
    ws = _be("mla-gluon-ws")("make_workspace", len(lens), H, R, "cuda", num_splits=splits)
    got = _be("mla-gluon-ws")("mla_decode", qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE,
                              return_lse=True, workspace=ws)
    want = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=SCALE, return_lse=True)
    assert torch.isfinite(got[0]).all()
    _agree(got[0], want[0], what=f"H={H} splits={splits}")
    assert_close(got[1], want[1], dtype=BF, what="lse")
    tables = pc.block_tables.clone()
    tables[5, 3] = pc.cache.shape[0] + 7  # one page of the 1000-key sequence outside the cache
    tables[5, 5] = -2
    got = _be("mla-gluon-ws")("mla_decode", qn, qp, pc.cache, pc.seq_lens, tables, scale=SCALE, workspace=ws)
    # the TMA kernel masks the keys of such pages too (docs/mla.md): the same answer, not the reference's
    same = _be("mla-tma")("mla_decode", qn, qp, pc.cache, pc.seq_lens, tables, scale=SCALE)
    assert torch.isfinite(got[5]).all()
    _agree(got[5], same[5].float(), what="pages outside the cache")
    _agree(got[:5], want[0][:5], what="the other sequences")

