"""The selector: traces in tree order, priority per arch, memoisation, forced backends (argument
and environment) with their errors, runtime availability. Uses test-local fake attention
backends (the real ones are swapped out for the test and put back after)."""
import pytest

from opmap.core import registry

from opmap.core import select as sel

from opmap.core import specs as S
from opmap.core.registry import Backend, Check, Req
from opmap.core.specs import AttentionSpec, NormSpec


def _fake(name, priority, reqs=(), checks=(), available=None):
    return Backend(op="attention", name=name, provider="fake", version="0.0", priority=priority,
                   impl={"decode": "math:sqrt"}, reqs=reqs, checks=checks, available=available)


@pytest.fixture
def fake_attention():
    registry.load_all()
    saved = dict(registry._REGISTRY["attention"])
    registry._REGISTRY["attention"].clear()
    sel.clear_cache()
    fakes = [
        _fake("fast-paged", {"sm90": 80, "sm80": 60},
              reqs=(Req("kind", ("gqa", "mha", "mqa"), "no MLA"),
                    Req("kv_dtype", ("bf16", "fp16"), "16-bit KV only"),
                    Req("page_size", lambda p: p in (16, 32, 64), "page_size in {16, 32, 64}"))),
        _fake("fp8-decode", {"sm90": 70},
              reqs=(Req("phase", ("decode",), "decode only"),),
              checks=(Check("head_dim <= 128", lambda s: None if s.head_dim <= 128 else
                            f"head_dim={s.head_dim} > 128", "head_dim"),)),
        _fake("eager-only", {"sm90": 90, "sm80": 90, "cpu": 5},
              reqs=(Req("cuda_graph", (False,), "no CUDA-graph capture"),)),
        _fake("mla-only", {"sm90": 95}, reqs=(Req("kind", ("mla",), "MLA only"),)),
        _fake("needs-pkg", {"sm90": 60, "cpu": 120}, available=lambda: "package 'nope' is not installed"),
        _fake("fallback", {"sm90": 1, "sm80": 1, "cpu": 100}),
    ]
    for b in fakes:
        registry.register(b)
    yield {b.name: b for b in fakes}
    registry._REGISTRY["attention"].clear()
    registry._REGISTRY["attention"].update(saved)
    sel.clear_cache()


EXAMPLE = dict(arch="sm90", phase="decode", num_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
               kv_dtype="fp8", cuda_graph=True)


def test_issue_example_trace(fake_attention):
    # The spec of `opmap select attention --phase decode ... --kv-dtype fp8 --cuda-graph --arch sm90`.
    ch = sel.select("attention", AttentionSpec(**EXAMPLE), runtime=False)
    assert ch.name == "fp8-decode"
    assert ch.forced_by is None and not ch.runtime
    by = {c.name: c for c in ch.trace}
    assert [c.name for c in ch.trace][0] == "fp8-decode"
    assert set(by) == set(fake_attention)  # every candidate is in the trace
    assert by["fast-paged"].level == "kv_dtype" and "16-bit KV only" in by["fast-paged"].reasons[0]
    assert by["eager-only"].level == "cuda_graph"
    assert by["mla-only"].level == "kind"
    # Not runtime: availability is not consulted for another device, so needs-pkg stays valid.
    assert by["needs-pkg"].valid
    text = ch.explain()
    assert "planned for another device" in text and "at kv_dtype" in text


def test_priority_and_levels_follow_tree(fake_attention):
    spec = AttentionSpec(arch="sm90", phase="prefill", kind="mla", num_heads=16, num_kv_heads=1,
                         head_dim=576, head_dim_v=512, kv_dtype="fp8", page_size=8, cuda_graph=True)
    ch = sel.select("attention", spec, runtime=False)
    assert ch.name == "mla-only"
    by = {c.name: c for c in ch.trace}
    # fast-paged fails at kind (first in the tree) although kv_dtype and page_size fail too.
    assert by["fast-paged"].level == "kind" and len(by["fast-paged"].reasons) == 3
    assert by["fp8-decode"].level == "phase"
    assert by["fp8-decode"].reasons[1].startswith("head_dim=576")
    # Valid candidates come right after the choice, by priority.
    valid = [c.name for c in ch.trace if c.valid]
    assert valid == ["mla-only", "needs-pkg", "fallback"]
    assert "highest sm90 priority (95)" in ch.why()


def test_other_arch_and_unserved_arch(fake_attention):
    ch = sel.select("attention", AttentionSpec(arch="sm80", cuda_graph=False), runtime=False)
    assert ch.name == "eager-only"
    by = {c.name: c for c in ch.trace}
    assert by["fp8-decode"].level == "arch" and "not served" in by["fp8-decode"].reasons[0]


def test_runtime_availability(fake_attention):
    spec = AttentionSpec(arch="cpu", phase="decode", cuda_graph=True)
    ch = sel.select("attention", spec, runtime=True)
    by = {c.name: c for c in ch.trace}
    assert ch.name == "fallback"
    assert by["needs-pkg"].level == "runtime" and "not installed" in by["needs-pkg"].reasons[0]
    assert sel.select("attention", spec, runtime=False).name == "needs-pkg"


def test_memoised_per_spec(fake_attention):
    spec = AttentionSpec(**EXAMPLE)
    a = sel.select("attention", spec, runtime=False)
    info = sel._select.cache_info()
    b = sel.select("attention", AttentionSpec(**EXAMPLE), runtime=False)  # equal spec, new object
    assert a is b
    assert sel._select.cache_info().hits == info.hits + 1
    c = sel.select("attention", spec.replace(kv_dtype="bf16"), runtime=False)
    assert c is not a and c.name == "fast-paged"


def test_forced_by_argument(fake_attention):
    spec = AttentionSpec(**EXAMPLE)
    ch = sel.select("attention", spec, backend="fallback", runtime=False)
    assert ch.name == "fallback" and ch.forced_by == "argument" and ch.why() == "forced by argument"
    with pytest.raises(sel.BackendError) as e:
        sel.select("attention", spec, backend="fast-paged", runtime=False)
    msg = str(e.value)
    assert "forced backend 'fast-paged' (argument) cannot serve" in msg
    assert "16-bit KV only" in msg
    assert "backends that could: fp8-decode, needs-pkg, fallback" in msg
    with pytest.raises(sel.BackendError, match="not registered"):
        sel.select("attention", spec, backend="no-such", runtime=False)


def test_forced_by_env(fake_attention, monkeypatch):
    spec = AttentionSpec(**EXAMPLE)
    monkeypatch.setenv("OPMAP_ATTENTION_BACKEND", "eager-only")
    with pytest.raises(sel.BackendError) as e:
        sel.select("attention", spec, runtime=False)
    assert "env OPMAP_ATTENTION_BACKEND=eager-only" in str(e.value)
    assert "cuda_graph=True not supported" in str(e.value)
    # The phase-specific variable wins over the op-wide one.
    monkeypatch.setenv("OPMAP_ATTENTION_DECODE_BACKEND", "fallback")
    ch = sel.select("attention", spec, runtime=False)
    assert ch.name == "fallback" and ch.forced_by == "env OPMAP_ATTENTION_DECODE_BACKEND=fallback"
    # The argument wins over the environment.
    assert sel.select("attention", spec, backend="fp8-decode", runtime=False).forced_by == "argument"
    # Another phase sees only the op-wide variable.
    with pytest.raises(sel.BackendError, match="eager-only"):
        sel.select("attention", spec.replace(phase="prefill"), runtime=False)


def test_no_backend_lists_every_rejection(fake_attention):
    spec = AttentionSpec(arch="sm100", phase="decode")
    with pytest.raises(sel.BackendError) as e:
        sel.select("attention", spec, runtime=False)
    msg = str(e.value)
    assert msg.startswith("attention: no backend can serve")
    for name in fake_attention:
        assert f"- {name} at arch" in msg


def test_real_registry_traces_cover_every_backend():
    """Representative real specs: the trace names every registered backend, and each rejection
    carries its level and at least one reason."""
    registry.load_all()
    specs = [("attention", AttentionSpec(**EXAMPLE)),
             ("attention", AttentionSpec(arch="sm90", phase="prefill", kind="mla", num_heads=16, num_kv_heads=1,
                                         head_dim=576, head_dim_v=512)),
             ("rmsnorm", NormSpec(arch="sm90", phase="decode", hidden=4096, fused_add=True))]
    for op, spec in specs:
        names = {b.name for b in registry.backends(op)}
        assert names, f"no backend registered for {op}"
        try:
            ch = sel.select(op, spec, runtime=False)
            trace = ch.trace
        except sel.BackendError as e:
            pytest.fail(f"{op}: nothing serves a representative sm90 spec: {e}")
        assert {c.name for c in trace} == names
        for c in trace:
            if not c.valid:
                assert c.level and all(isinstance(r, str) and r for r in c.reasons)


@pytest.mark.parametrize("make,field,least", [
    (lambda v: S.GemmSpec(m=v), "m", 0), (lambda v: S.GemmSpec(n=v), "n", 1),
    (lambda v: S.AttentionSpec(head_dim=v), "head_dim", 1), (lambda v: S.NormSpec(hidden=v), "hidden", 1),
    (lambda v: S.SamplingSpec(vocab=v), "vocab", 1), (lambda v: S.MoESpec(shared_experts=v), "shared_experts", 0),
    (lambda v: S.MoESpec(top_k=v), "top_k", 1), (lambda v: S.RopeSpec(rotary_dim=v), "rotary_dim", 1)])
def test_spec_sizes_refused_below_their_least_value(make, field, least):
    assert getattr(make(least), field) == least  # the least value itself is a spec
    for bad in (least - 1, 2.5, True, "8"):
        with pytest.raises(ValueError, match=rf"\.{field}=.*expected an integer >= {least}"):
            make(bad)
    assert S.GemmSpec(m=None).m is None  # an optional size may be left unknown


# One kernel, one backend: on the real registry the selector names the kernel that runs, and each
# spec gets the kernel measured fastest for it (docs/attention.md, docs/mla.md: Decisions).
GQA = dict(arch="sm90", num_heads=32, num_kv_heads=8, head_dim=128, dtype="bf16", kv_dtype="bf16", page_size=16)
MLA = dict(arch="sm90", kind="mla", num_heads=16, num_kv_heads=1, head_dim=576, head_dim_v=512, page_size=64,
           dtype="bf16", kv_dtype="bf16", cuda_graph=True)


@pytest.mark.parametrize("fields,chosen,rejected", [
    # decode: the Triton kernel for 16-bit caches, the Gluon one for fp8 at head dim 128
    (dict(GQA, phase="decode", cuda_graph=True), "triton", {"gluon-fp8": "kv_dtype=bf16"}),
    (dict(GQA, phase="decode", kv_dtype="fp8", cuda_graph=True), "gluon-fp8",
     {"triton-tma": "phase='decode' not supported"}),
    (dict(GQA, phase="decode", kv_dtype="fp8", head_dim=64), "triton", {"gluon-fp8": "head_dim=64 not supported"}),
    (dict(GQA, phase="decode", kv_dtype="fp8", num_kv_heads=1), "triton",
     {"gluon-fp8": "32 query heads per KV head"}),
    (dict(GQA, phase="decode", kv_dtype="fp8", dtype="fp32"), "triton", {"gluon-fp8": "dtype='fp32' not supported"}),
    (dict(GQA, phase="decode", kv_dtype="fp8", arch="sm80"), "triton", {"gluon-fp8": "arch=sm80 not served"}),
    # mixed steps: the decode tokens on the fp8 cache's decode kernel
    (dict(GQA, phase="mixed", kv_dtype="fp8"), "gluon-fp8", {"triton-tma": "phase='mixed' not supported"}),
    (dict(GQA, phase="mixed"), "triton", {"gluon-fp8": "kv_dtype=bf16"}),
    # prefill: the TMA kernel where pages hold whole 64-key tiles (FlashInfer first where it can serve)
    (dict(GQA, phase="prefill", page_size=64, cuda_graph=True), "triton-tma", {"flashinfer": "cuda_graph"}),
    (dict(GQA, phase="prefill", page_size=128, cuda_graph=True), "triton-tma", {}),
    (dict(GQA, phase="prefill", cuda_graph=True), "triton", {"triton-tma": "page_size=16 not supported"}),
    (dict(GQA, phase="prefill", page_size=64, head_dim=256, cuda_graph=True), "triton",
     {"triton-tma": "head_dim=256 not supported"}),
    (dict(GQA, phase="prefill", page_size=64, kv_dtype="fp8", cuda_graph=True), "triton",
     {"triton-tma": "kv_dtype=fp8 differs from dtype=bf16"}),
    (dict(GQA, phase="prefill", page_size=64, arch="sm80", cuda_graph=True), "triton",
     {"triton-tma": "arch=sm80 not served"}),
    # MLA decode: the TMA kernel on pages of 64, the Gluon kernel for fp8 at DeepSeek's dims, the
    # pointer kernel for other pages, sparse decode and prefill
    (MLA, "mla-tma", {"mla-gluon-fp8": "kv_dtype=bf16"}),
    (dict(MLA, kv_dtype="fp8"), "mla-gluon-fp8", {}),
    (dict(MLA, kv_dtype="fp8", num_heads=128), "mla-gluon-fp8", {}),
    (dict(MLA, page_size=16), "mla-triton", {"mla-tma": "page_size=16 not supported"}),
    (dict(MLA, sparse=True), "mla-triton", {"mla-tma": "sparse=True not supported",
                                            "mla-gluon-fp8": "sparse=True not supported"}),
    (dict(MLA, phase="prefill", cuda_graph=False), "mla-triton", {"mla-tma": "phase='prefill' not supported"}),
])
def test_each_kernel_is_its_own_backend(fields, chosen, rejected):
    ch = sel.select("attention", AttentionSpec(**fields), runtime=False)
    assert ch.name == chosen, ch.explain()
    by = {c.name: c for c in ch.trace}
    for name, reason in rejected.items():
        assert not by[name].valid and any(reason in r for r in by[name].reasons), (name, by[name].reasons)
    assert f"-> {chosen} " in ch.explain()


def test_forcing_a_kernel_backend_that_cannot_serve_says_why():
    """A forced kernel never falls back: forcing the Gluon fp8 decode on a bf16 cache, or the TMA
    prefill on 16-token pages, is an error naming its reasons and the backends that could."""
    spec = AttentionSpec(phase="decode", cuda_graph=True, **GQA)
    with pytest.raises(sel.BackendError, match=r"'gluon-fp8' \(argument\) cannot serve[\s\S]*kv_dtype=bf16"
                                               r"[\s\S]*backends that could: triton"):
        sel.select("attention", spec, backend="gluon-fp8", runtime=False)
    with pytest.raises(sel.BackendError, match=r"'triton-tma'[\s\S]*page_size=16"):
        sel.select("attention", spec.replace(phase="prefill"), backend="triton-tma", runtime=False)
    # forcing the Triton kernel on an fp8 decode the Gluon one would take runs it, as asked
    assert sel.select("attention", spec.replace(kv_dtype="fp8"), backend="triton", runtime=False).name == "triton"
    # on the CPU the interpreter runs the TMA kernels when asked for (below the others)
    cpu = AttentionSpec(**dict(GQA, arch="cpu", phase="prefill", page_size=64, dtype="fp16", kv_dtype="fp16"))
    assert sel.select("attention", cpu, backend="triton-tma", runtime=False).name == "triton-tma"
    assert sel.select("attention", cpu, runtime=False).name == "reference"


def test_gluon_backends_do_not_run_in_the_interpreter(monkeypatch):
    registry.load_all()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in ("gluon-fp8", "mla-gluon-fp8"):
        assert "interpreter" in registry.get("attention", name).available()
