"""Our Triton MoE (align + grouped GEMMs + combine) against the fp32 reference, in the
interpreter on CPU (fp16 / fp32, tiny hidden sizes), at the boundaries the issue names."""
import pytest
import torch

from opmap.ops.moe import reference
from opmap.kernels.moe.align import align
from opmap.kernels.moe.common import max_padded
from opmap.ops.moe.routing import route
from opmap.core.tolerance import assert_close

triton_moe = pytest.importorskip("opmap.kernels.moe.triton_moe")


def _weights(E, H, I, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    return w13, w2


def _check_alignment(ids, E, bm):
    sorted_ids, block_expert, total = align(ids, E, bm)
    n = ids.numel()
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    padded = (counts + bm - 1) // bm * bm
    assert int(total) == int(padded.sum()) <= max_padded(n, E, bm) <= sorted_ids.numel()
    start = 0
    for e in range(E):
        seg = sorted_ids[start:start + padded[e]]
        want = (ids.flatten() == e).nonzero().flatten().to(torch.int32)
        assert torch.equal(seg[:counts[e]], want), f"expert {e}: pairs out of order or missing"
        assert (seg[counts[e]:] == n).all(), f"expert {e}: padding rows must hold the sentinel {n}"
        assert (block_expert[start // bm:(start + padded[e]) // bm] == e).all()
        start += int(padded[e])


@pytest.mark.parametrize("T,k,E,bm", [(1, 2, 8, 16), (3, 4, 4, 16), (17, 3, 8, 4), (64, 8, 32, 16),
                                      (700, 8, 16, 64)])  # 5600 pairs: several 4096-wide chunks
def test_align_random_routing(T, k, E, bm):
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    _check_alignment(ids, E, bm)


def test_align_all_pairs_on_one_expert():
    ids = torch.full((40, 1), 3, dtype=torch.int32)  # 40 pairs -> 3 blocks of 16, expert 3 only
    _check_alignment(ids, 8, 16)


def routed_case(T, H, I, E, k, dtype, kw):
    """A case's inputs: (x, logits, w13, w2, routing kwargs); ``kw``'s ``bias`` becomes a score bias,
    and where E > k + 1 the last expert receives zero tokens."""
    kw = dict(kw)
    if kw.pop("bias", False):
        kw["score_bias"] = torch.randn(E) * 0.1
    w13, w2 = _weights(E, H, I, dtype, seed=T)
    x = torch.randn(T, H).to(dtype)
    logits = torch.randn(T, E)
    if E > k + 1:
        logits[:, E - 1] = -1e4
    return x, logits, w13, w2, kw


CASES = [
    # T, H, I, E, top_k, dtype, routing kwargs
    (1, 32, 24, 8, 2, torch.float16, {}),
    (3, 40, 20, 4, 4, torch.float32, {}),  # top_k == num_experts; H, I not multiples of the tile
    (17, 48, 40, 8, 3, torch.float16, {}),
    (64, 32, 16, 16, 4, torch.float16,
     dict(router="sigmoid", n_group=4, topk_group=2, routed_scaling=2.5, bias=True)),
    (17, 33, 9, 6, 2, torch.float32, dict(renormalize=False)),
]


@pytest.mark.parametrize("T,H,I,E,k,dtype,kw", CASES, ids=[f"T{c[0]}-H{c[1]}-I{c[2]}-E{c[3]}-k{c[4]}-"
                                                           f"{str(c[5])[6:]}" for c in CASES])
# SiLU of a large negative fp16 input: exp(-x) overflows to inf, and x / (1 + inf) is the right 0
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_triton_matches_reference(T, H, I, E, k, dtype, kw):
    x, logits, w13, w2, kw = routed_case(T, H, I, E, k, dtype, kw)
    got = triton_moe.moe(x, logits, w13, w2, k, **kw)
    want = reference.moe(x.float(), logits, w13.float(), w2.float(), k, **kw)
    assert got.dtype == dtype and got.shape == (T, H)
    # fp16: the [T*k, I] intermediate is rounded to fp16 between the two GEMMs.
    assert_close(got, want, dtype, scale=2, what="triton vs reference")


def test_triton_all_tokens_on_one_expert():
    E, H, I, T = 4, 32, 16, 40  # 40 rows on one expert: several row blocks of one expert
    w13, w2 = _weights(E, H, I, torch.float16)
    x = torch.randn(T, H).half()
    logits = torch.full((T, E), -3.0)
    logits[:, 1] = 3.0
    w, ids = route(logits, 1)
    assert (ids == 1).all()
    assert_close(triton_moe.moe(x, logits, w13, w2, 1),
                 reference.moe(x.float(), logits, w13.float(), w2.float(), 1), torch.float16, scale=2)


def test_triton_empty_batch_and_strided_weights():
    E, H, I = 4, 16, 8
    w13, w2 = _weights(E, H, I, torch.float32)
    assert triton_moe.moe(torch.randn(0, H), torch.randn(0, E), w13, w2, 2).shape == (0, H)
    # Weights given transposed-in-memory (last dim not contiguous) are accepted and copied.
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)
    x, logits = torch.randn(5, H), torch.randn(5, E)
    assert_close(triton_moe.moe(x, logits, w13_t, w2, 2), reference.moe(x, logits, w13, w2, 2), torch.float32)


def test_custom_ops_opcheck():
    import opmap  # noqa: F401  (registers torch.ops.opmap.*)

    E, H, I = 4, 16, 8
    w13, w2 = _weights(E, H, I, torch.float16)
    x, logits = torch.randn(3, H).half(), torch.randn(3, E)
    torch.library.opcheck(torch.ops.opmap.moe_route.default, (logits, 2),
                          dict(router="sigmoid", n_group=2, topk_group=1, score_bias=torch.randn(E)))
    torch.library.opcheck(torch.ops.opmap.moe.default, (x, logits, w13, w2, 2))
    out = torch.ops.opmap.moe(x, logits, w13, w2, 2)
    assert_close(out, reference.moe(x.float(), logits, w13.float(), w2.float(), 2), torch.float16, scale=2)


ROUTES = [
    (5, 8, 2, {}),  # Mixtral
    (7, 128, 8, dict(renormalize=False)),  # Qwen3-MoE without norm_topk_prob
    (6, 16, 3, dict(renormalize=False, n_group=4, topk_group=2, routed_scaling=2.5)),  # DeepSeek-V2
    (9, 32, 4, dict(router="sigmoid_grouped", n_group=8, topk_group=3, routed_scaling=2.5, bias=True)),  # V3
    (4, 12, 3, dict(router="sigmoid", n_group=3, topk_group=2, bias=True)),  # groups: not a power of two
    (3, 6, 6, {}),  # top_k == experts, experts not a power of two
    (5, 8, 3, dict(router="sigmoid", n_group=8, topk_group=4, bias=True)),  # groups of one expert
]


@pytest.mark.parametrize("T,E,k,kw", ROUTES, ids=[f"T{r[0]}-E{r[1]}-k{r[2]}" for r in ROUTES])
def test_fused_routing_matches_torch_routing(T, E, k, kw):
    from opmap.kernels.moe.route_triton import route as route_triton

    kw = dict(kw)
    if kw.pop("bias", False):
        kw["score_bias"] = torch.randn(E) * 0.1
    logits = torch.randn(T, E)
    w, ids = route_triton(logits, k, **kw)
    w_ref, ids_ref = route(logits, k, **kw)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref)
    assert_close(w, w_ref, torch.float32)


def test_tile_choice_per_regime():
    from opmap.kernels.moe import grouped_gemm as gg

    for bm in (16, 32, 64, 128):
        for gated in (True, False):
            for K in (768, 4096, 32):
                got = gg._prune(gg._ALL_CONFIGS, {"K": K}, BM=bm, GATED=gated)
                table = gg._DECODE if bm <= 32 else (gg._BM64 if bm == 64 else gg._BM128)
                assert got and all(c in table[gated] for c in got)
                if K >= 256:
                    assert all(c.kwargs["BK"] <= K for c in got)


@pytest.mark.parametrize("bm", [32, 64])
def test_prefill_row_tiles(bm):
    # On a GPU prefill uses 32..128-row tiles; the interpreter defaults to 16, so force them here.
    E, H, I, T, k = 4, 32, 16, 50, 2
    w13, w2 = _weights(E, H, I, torch.float16)
    x, logits = torch.randn(T, H).half(), torch.randn(T, E)
    w, ids = route(logits, k)
    got = triton_moe.experts(x, w, ids, w13, w2, bm=bm)
    want = reference.moe(x.float(), logits, w13.float(), w2.float(), k)
    assert_close(got, want, torch.float16, scale=2)


@pytest.mark.parametrize("quantised", [False, True])
@pytest.mark.parametrize("E,k", [(64, 6), (128, 8), (8, 2), (4, 1)])
def test_token_counts_cover_every_tuning_key(E, k, quantised, monkeypatch):
    """grouped_gemm.token_counts: one count per (rows bucket, BM) key that 1..max tokens can hit
    (with the GPU's row tiles), so the engine's warm-up leaves no key for a step to tune."""
    from opmap.kernels.moe import grouped_gemm as gg
    from opmap.kernels.moe.common import next_pow2

    monkeypatch.setattr(gg, "_INTERPRETING", False)  # the GPU's tile choice
    key = lambda t: (next_pow2(t * k), gg.pick_bm(t * k, E, quantised))  # noqa: E731
    counts = gg.token_counts(2048, k, E, quantised)
    assert counts[0] == 1 and counts == sorted(set(counts)) and counts[-1] <= 2048
    assert len({key(t) for t in counts}) == len(counts)  # one count per key
    assert {key(t) for t in range(1, 2049)} == {key(t) for t in counts}
    assert len(counts) <= 2 * (next_pow2(2048 * k).bit_length())
    # quantised experts stop at 64-row tiles (the 128-row gated tile spills: test_quant_sm90_compile.py)
    if quantised:
        assert max(gg.pick_bm(t * k, E, True) for t in counts) == 64
        assert gg.pick_bm(4096 * k, 4, False) == 128 and gg.pick_bm(4096 * k, 4, True) == 64


def test_warm_up_runs_every_count():
    """triton_moe.warm_up (the engine calls it at start-up on a GPU) runs the op at every count."""
    from opmap.kernels.moe import grouped_gemm as gg

    E, H, I, k = 4, 32, 16, 2
    w13, w2 = _weights(E, H, I, torch.float16)
    seen = []
    real = triton_moe.moe
    try:
        triton_moe.moe = lambda x, logits, *a, **kw: (seen.append(x.shape[0]), real(x, logits, *a, **kw))[1]
        n = triton_moe.warm_up(w13, w2, k, 40, router="softmax", renormalize=True)
    finally:
        triton_moe.moe = real
    assert n == len(seen) and seen == gg.token_counts(40, k, E)


def test_host_helpers_match_triton():
    # The launchers use plain-int helpers instead of Triton's (slow on the host) ConstexprFunctions.
    import triton

    from opmap.kernels.moe.common import next_pow2
    for n in (0, 1, 2, 3, 8, 9, 127, 128, 129, 4097):
        assert next_pow2(n) == triton.next_power_of_2(max(1, n))


def test_checked_signature_does_not_hide_bad_input():
    # A valid call memoises its argument signature; a call that differs in anything checked
    # (shape, dtype, top_k's value or type, router) must still be validated and rejected.
    from opmap.core.contract import InputError

    E, H, I, T = 4, 32, 16, 2
    w13, w2 = _weights(E, H, I, torch.float32)
    x, logits = torch.randn(T, H), torch.randn(T, E)
    triton_moe.moe(x, logits, w13, w2, 2)
    bad = [
        dict(top_k=E + 1), dict(top_k=True), dict(router="nope"), dict(w2=w2[:, :, :-1]),
        dict(x=x.half()), dict(logits=torch.randn(T + 1, E)), dict(x=torch.randn(H, T).t()),
    ]
    for b in bad:
        a = dict(x=x, logits=logits, w13=w13, w2=w2, top_k=2, router="softmax") | b
        with pytest.raises(InputError):
            triton_moe.moe(a["x"], a["logits"], a["w13"], a["w2"], a["top_k"], router=a["router"])


def test_tuned_launch_fast_path_passes_what_the_autotuner_passes(monkeypatch):
    # The 16-bit GPU path launches the tuned GEMM through the autotuner once per key, then
    # directly with the remembered config. Both launches must reach JITFunction.run with the same
    # grid and keyword arguments (so they select the same compiled kernel). Run with the JIT
    # launch recorded instead of executed, and the tuner's choice pre-seeded (no benchmarking).
    from opmap.kernels.moe import grouped_gemm as gg

    seen = []
    monkeypatch.setattr(gg, "_INTERPRETING", False)
    monkeypatch.setattr(gg, "_BEST", {})
    monkeypatch.setattr(gg._tuned_kernel, "cache", {})
    monkeypatch.setattr(gg._grouped_gemm_kernel, "run",
                        lambda *a, grid, warmup, **kw: seen.append((grid(kw) if callable(grid) else grid, kw)))
    E, H, I, T, k, bm = 8, 256, 96, 3, 2, 16
    w13, w2 = _weights(E, H, I, torch.float16)
    x = torch.randn(T, H).half()
    inter = torch.empty(T * k, I, dtype=torch.float16)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32)
    sorted_ids, block_expert, total = align(ids, E, bm)
    for gated, (a, w, out, div, wts) in {True: (x, w13, inter, k, None),
                                         False: (inter, w2, torch.empty(T * k, H, dtype=torch.float16), 1,
                                                 torch.rand(T * k))}.items():
        seen.clear()
        n_rows, K = w.shape[1], w.shape[2]
        N = n_rows // 2 if gated else n_rows
        bucket = gg.next_pow2(T * k)
        # (the scale and zero pointers of quantised experts are ``out`` when there are none)
        key = [N, K, bucket, bm, gated] + [str(t.dtype) for t in (a, w, out, wts if wts is not None else out,
                                                                  sorted_ids, block_expert, total, out, out)]
        gg._tuned_kernel.cache[tuple(key)] = gg._DECODE[gated][1]
        for _ in range(2):
            gg.grouped_gemm(a, w, out, sorted_ids, block_expert, total, T * k, div, bm, gated=gated, weights=wts)
        assert len(seen) == 2 and len(gg._BEST) == (1 if gated else 2)
        (grid0, kw0), (grid1, kw1) = seen
        grid0 = grid0 if isinstance(grid0, tuple) else tuple(grid0)
        assert tuple(grid1) == grid0 and kw1 == kw0, (grid0, grid1, kw0, kw1)
        assert {"BN", "BK", "GROUP_M", "num_warps", "num_stages", "EVEN_K", "BM", "GATED"} <= set(kw1)


@pytest.mark.parametrize("T,E,k,kw", [
    (1, 128, 8, {}),  # Qwen3-30B-A3B decode at batch 1
    (16, 128, 8, {}),  # ... at batch 16: the largest fused tile (2048 scores)
    (3, 8, 2, {}),  # Mixtral
    (17, 64, 6, dict(routed_scaling=2.5, renormalize=False)),  # DeepSeek-V2-Lite-like, k not a power of 2
    (64, 16, 4, dict(router="sigmoid", bias=True)),  # the largest T, sigmoid with a bias
    (5, 6, 6, {}),  # top_k == experts
])
def test_fused_route_align_equals_route_then_align(T, E, k, kw):
    """Decode-sized batches route and align in one launch: the same ids, sorted pairs, blocks
    and total as route_triton then align, and the same weights (to fp32 rounding)."""
    from opmap.kernels.moe.route_align import fusable, route_align
    from opmap.kernels.moe.route_triton import route as route_triton

    kw = dict(kw)
    bias = torch.randn(E) * 0.1 if kw.pop("bias", False) else None
    g = torch.Generator().manual_seed(T * 31 + E)
    logits = torch.randn(T, E, generator=g)
    assert fusable(T, 1, E) and not fusable(T, 2, E) and not fusable(65, 1, E)
    router = kw.get("router", "softmax")
    w, ids, sorted_ids, block_expert, total = route_align(
        logits, k, router, kw.get("renormalize", True), kw.get("routed_scaling", 1.0), bias, E, 16)
    w_ref, ids_ref = route_triton(logits, k, score_bias=bias, **kw)
    assert torch.equal(ids, ids_ref)
    assert_close(w, w_ref, torch.float32)
    s_ref, b_ref, t_ref = align(ids_ref, E, 16)
    assert int(total) == int(t_ref)
    assert torch.equal(sorted_ids[:int(total)], s_ref[:int(t_ref)])
    assert torch.equal(block_expert[:int(total) // 16], b_ref[:int(t_ref) // 16])


def test_moe_routes_in_one_launch_where_the_fused_kernel_serves(monkeypatch):
    """triton_moe.moe routes and aligns in one launch (route_align.py) at a decode batch and in two
    (route_triton.py, align.py) where that kernel cannot serve (more than 64 tokens, group-limited
    routing); no switch picks between them. Both give the reference's output, and at the decode
    batch the two launches (called directly) give the same output up to fp32 rounding (the routing
    weights' softmax sums run along a tile's axis instead of a vector)."""
    from opmap.kernels.moe.route_triton import route as route_triton

    T, H, I, E, k = 5, 32, 24, 16, 4
    w13, w2 = _weights(E, H, I, torch.float32)
    g = torch.Generator().manual_seed(9)
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    calls = []
    for name in ("route_align", "route_launch"):
        real = getattr(triton_moe, name)
        monkeypatch.setattr(triton_moe, name, lambda *a, _n=name, _f=real, **kw: calls.append(_n) or _f(*a, **kw))
    a = triton_moe.moe(x, logits, w13, w2, k)
    assert calls == ["route_align"]
    assert_close(a, reference.moe(x, logits, w13, w2, k), torch.float32)
    assert_close(a, triton_moe.experts(x, *route_triton(logits, k), w13, w2), torch.float32)
    calls.clear()
    grouped = triton_moe.moe(x, logits, w13, w2, k, n_group=4, topk_group=2)
    assert calls == ["route_launch"]
    assert_close(grouped, reference.moe(x, logits, w13, w2, k, n_group=4, topk_group=2), torch.float32)
    calls.clear()
    x65, l65 = torch.randn(65, H, generator=g), torch.randn(65, E, generator=g)
    assert_close(triton_moe.moe(x65, l65, w13, w2, k), reference.moe(x65, l65, w13, w2, k), torch.float32)
    assert calls == ["route_launch"]
