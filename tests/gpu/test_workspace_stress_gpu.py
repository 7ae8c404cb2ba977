"""The decode calls with their cached split-KV workspaces under stress, each result checked against
the fp32 reference and every input checked unchanged after each call: CUDA graphs captured and
destroyed over and over (``torch.cuda.graph`` and ``triton.testing.do_bench_cudagraph``, whose
side stream is a new one each time), calls on changing streams, batch sizes and lengths that move
between the workspaces' batch buckets and split plans, the engine's two benchmark cases in one
process (B=64 at 4096 keys, then B=256 at 1024). GQA through ``opmap.attention_decode`` (the
workspace cached per device, stream and bucket: ``opmap.api.dispatch.workspace``) and the internal
``kernels.attention.decode.decode`` without one; MLA through ``opmap.mla_decode``.

Meant to run under compute-sanitizer memcheck too (a stray write into a freed or reused buffer, or
a stale cached one, shows as a wrong result or a changed input here and as an error there):

    PYTHONPATH=src compute-sanitizer --tool memcheck python -m pytest -m gpu -q -x \\
        tests/gpu/test_workspace_stress_gpu.py
"""
import gc

import pytest
import torch

import opmap
from opmap.core.tolerance import assert_close

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF = torch.bfloat16
HQ, HK, D, PAGE = 32, 8, 128, 16


def _case(B: int, L: int, seed: int, num_pages: int = None, varied: bool = True):
    """Queries, a paged cache and its metadata for B sequences of up to L keys (lengths varied:
    0, 1, a page boundary and its neighbours, L), pages shuffled."""
    g = torch.Generator().manual_seed(seed)
    per = -(-L // PAGE)
    num_pages = num_pages or B * per + 3
    lens = torch.full((B,), L, dtype=torch.int32)
    if varied and B > 4:
        lens[:5] = torch.tensor([0, 1, PAGE, PAGE + 1, max(L - 1, 1)])
        lens[5:] = torch.randint(1, L + 1, (B - 5,), generator=g, dtype=torch.int32)
    bt = torch.randperm(num_pages, generator=g)[:B * per].view(B, per).int()
    kc = torch.randn(num_pages, PAGE, HK, D, generator=g).to(DEV, BF)
    vc = torch.randn(num_pages, PAGE, HK, D, generator=g).to(DEV, BF)
    q = torch.randn(B, HQ, D, generator=g).to(DEV, BF)
    return q, kc, vc, lens.to(DEV), bt.to(DEV)


def _reference(q, kc, vc, sl, bt):
    """The fp32 reference, computed on the host so that the sanitizer watches only the kernels
    under test (its shadow memory for the reference's large fp32 gathers ran out on the device)."""
    return _on_host(opmap.attention_decode, q, kc, vc, sl, bt, D ** -0.5, return_lse=True, backend="reference")


def _on_host(fn, *args, **kw):
    """``fn`` on host copies of the tensors in ``args`` (floating ones in fp32); its outputs back
    on the device."""
    host = [(a.cpu().float() if a.is_floating_point() else a.cpu()) if torch.is_tensor(a) else a for a in args]
    return tuple(t.to(DEV) for t in fn(*host, **kw))


def _inputs_kept(before, args):
    for i, (a, b) in enumerate(zip(before, args)):
        assert torch.equal(a, b), f"input {i} ({tuple(b.shape)}, {b.dtype}) changed by the call"


def _check(out, lse, ref, what, scale=1.0):
    torch.cuda.synchronize()
    assert_close(out, ref[0], BF, scale=scale, what=what)
    fin = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse), fin), what
    assert_close(lse[fin], ref[1][fin], torch.float32, scale=300.0, what=f"{what} lse")


def _call(args):
    return opmap.attention_decode(*args, D ** -0.5, return_lse=True)


def test_graphs_captured_and_destroyed_with_the_cached_workspace():
    """Capture the public decode, replay with new values, destroy the graph and collect, over
    shapes that move between workspace buckets; each capture on the default capture stream reuses
    the workspace the first one made in its own (by then destroyed) graph's pool."""
    for cycle, (B, L) in enumerate([(64, 4096), (256, 1024), (3, 700), (17, 257), (64, 4096), (1, 4099),
                                    (256, 1024), (5, 33)]):
        args = _case(B, L, seed=cycle)
        before = [a.clone() for a in args]
        eager = _call(args)
        ref = _reference(*args)
        _check(*eager, ref, f"cycle {cycle} eager B={B} L={L}")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = _call(args)
        for step in range(3):
            args[0].copy_(torch.randn_like(args[0]))
            if step == 2:  # new lengths within the captured block tables: a new split plan on the device
                args[3].copy_(torch.randint(0, L + 1, (B,), device=DEV, dtype=torch.int32))
            before[0], before[3] = args[0].clone(), args[3].clone()
            graph.replay()
            _check(out, lse, _reference(*args), f"cycle {cycle} replay {step} B={B} L={L}")
            _inputs_kept(before, args)
        del graph, out, lse
        gc.collect()
        torch.cuda.empty_cache()


def test_do_bench_cudagraph_then_a_new_case():
    """The two benchmark cases in one process, as the report that found `seq_lens[0]=11720` ran
    them: the internal decode without a workspace (its partials allocated in each capture) and the
    public call, timed by ``do_bench_cudagraph`` (a graph on a fresh side stream each time), then
    the next case's metadata built and read back."""
    from triton.testing import do_bench_cudagraph

    from opmap.kernels.attention.decode import decode

    for rnd in range(3):
        for B, L in ((64, 4096), (256, 1024)):
            q, kc, vc, sl, bt = _case(B, L, seed=10 * rnd + B, varied=False)
            sl = torch.full((B,), L, dtype=torch.int32, device=DEV)  # as the benchmark built it
            before = [t.clone() for t in (q, kc, vc, sl, bt)]
            ref = _reference(q, kc, vc, sl, bt)
            for fn in (lambda: decode(q, kc, vc, sl, bt, scale=D ** -0.5, return_lse=True),
                       lambda: _call((q, kc, vc, sl, bt))):
                do_bench_cudagraph(fn, rep=20)
                torch.cuda.synchronize()
                assert int(sl.max()) == L and int(sl.min()) == L, sl  # the symptom: a page id in seq_lens
                _inputs_kept(before, (q, kc, vc, sl, bt))
                _check(*fn(), ref, f"round {rnd} B={B} L={L}")
            del q, kc, vc, sl, bt
            gc.collect()


def test_streams_change_between_calls():
    """The same inputs on the default stream and two side streams, alternating, each stream with
    its own cached workspace; and a graph captured on a side stream replayed after the others ran."""
    args = _case(64, 2048, seed=3)
    ref = _reference(*args)
    streams = [torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()]
    for i in range(9):
        s = streams[i % 3]
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out, lse = _call(args)
        torch.cuda.current_stream().wait_stream(s)
        _check(out, lse, ref, f"stream {i % 3} call {i}")
    side = streams[1]
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=side):
        out, lse = _call(args)
    for i in range(3):
        _call(_case(5, 300, seed=40 + i))  # other shapes on the default stream in between
        graph.replay()
        _check(out, lse, ref, f"side-stream graph replay {i}")


def test_shapes_change_across_buckets_eagerly():
    """Batch sizes up and down across the power-of-two buckets, lengths across page and split
    boundaries: each call against the reference, inputs unchanged."""
    for i, (B, L) in enumerate([(1, 1), (2, 16), (3, 17), (4, 8191), (7, 300), (8, 5000), (9, 64), (31, 1025),
                                (32, 2048), (33, 511), (1, 32768), (128, 129), (2, 4096)]):
        args = _case(B, L, seed=100 + i)
        before = [a.clone() for a in args]
        _check(*_call(args), _reference(*args), f"B={B} L={L}")
        _inputs_kept(before, args)


R_MLA, DR_MLA, H_MLA, PAGE_MLA = 512, 64, 16, 64


def _mla_case(B: int, L: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    per = -(-L // PAGE_MLA)
    pages = B * per + 2
    lens = torch.randint(1, L + 1, (B,), generator=g, dtype=torch.int32)
    lens[0] = L
    bt = torch.randperm(pages, generator=g)[:B * per].view(B, per).int()
    cache = (0.5 * torch.randn(pages, PAGE_MLA, R_MLA + DR_MLA, generator=g)).to(DEV, BF)
    qn = torch.randn(B, H_MLA, R_MLA, generator=g).to(DEV, BF)
    qp = torch.randn(B, H_MLA, DR_MLA, generator=g).to(DEV, BF)
    return qn, qp, cache, lens.to(DEV), bt.to(DEV)


def test_mla_decode_under_graphs_streams_and_shapes():
    """MLA's decode (its workspace made per call when none is given) captured and destroyed, on a
    side stream, and across batch sizes; each result against the MLA reference."""
    scale = (128 + DR_MLA) ** -0.5
    for cycle, (B, L) in enumerate([(64, 4096), (256, 1024), (1, 8191), (17, 300), (64, 4096)]):
        args = _mla_case(B, L, seed=cycle)
        before = [a.clone() for a in args]
        ref = _on_host(opmap.mla_decode, *args, scale, return_lse=True, backend="mla-reference")
        _check(*opmap.mla_decode(*args, scale, return_lse=True), ref, f"mla eager B={B} L={L}", scale=2.0)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            out, lse = opmap.mla_decode(*args, scale, return_lse=True)
        for _ in range(2):
            graph.replay()
            _check(out, lse, ref, f"mla replay B={B} L={L}", scale=2.0)
        _inputs_kept(before, args)
        del graph, out, lse
        gc.collect()
        torch.cuda.empty_cache()
