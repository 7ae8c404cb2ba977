"""The public op API: ``opmap.<op>`` dispatches through the selector and runs the same callable
as the registry entry (and as the engine); ``backend=`` forces one; ``torch.ops.opmap.<op>`` is the
same function; the decode call without a workspace reuses a cached one; bad input is an error."""
from __future__ import annotations

import pytest
import torch

import opmap
from opmap.core import registry
from opmap.api import dispatch
from opmap.core.contract import InputError
from opmap.core.select import BackendError
from test_views import _entries, _same, _tensors

# test_views' entry names -> the public function (and custom op) names
PUBLIC = {"attention decode": "attention_decode", "kv append": "kv_append", "mla decode": "mla_decode",
          "attention prefill": "attention_prefill", "attention mixed": "attention_mixed",
          "attention merge": "attention_merge", "mla prefill": "mla_prefill"}
CUSTOM = {"kv_append": "paged_kv_append"}
LSE_OPS = ("attention_decode", "attention_prefill", "attention_mixed", "mla_decode", "mla_prefill")
ENTRIES = _entries()
CASES = [(name, op, entry, build, b.name) for name, op, entry, build in ENTRIES
         for b in registry.backends(op) if entry in b.impl and b.name in ("reference", "triton", "mla-reference",
                                                                           "mla-triton")]


def _written(kw):
    return [v for v in kw.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("name,op,entry,build,backend", CASES, ids=[f"{c[0]}-{c[4]}" for c in CASES])
def test_public_op_is_the_registry_entry(name, op, entry, build, backend, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fn = getattr(opmap, PUBLIC.get(name, name))
    want_kw, got_kw = build(), build()
    want = registry.get(op, backend).fn(entry)(**want_kw)
    got = fn(**got_kw, backend=backend)
    for a, b in zip(_tensors(got), _tensors(want)):
        assert _same(a, b), f"{name} [{backend}]: output differs from the registry entry"
    for a, b in zip(_written(got_kw), _written(want_kw)):
        assert _same(a, b), f"{name} [{backend}]: a written tensor differs"


@pytest.mark.parametrize("name,op,entry,build", ENTRIES, ids=[e[0] for e in ENTRIES])
def test_default_dispatch_and_custom_op(name, op, entry, build, monkeypatch):
    """Without ``backend`` the selector's choice runs (the reference on the CPU); the custom op runs the
    same function (attention ops return the LSE as well)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    public = PUBLIC.get(name, name)
    kw_a, kw_b, kw_c = build(), build(), build()
    ref = [b for b in registry.backends(op) if entry in b.impl and "reference" in b.name][0]
    want = ref.fn(entry)(**kw_a)
    got = getattr(opmap, public)(**kw_b)
    for a, b in zip(_tensors(got), _tensors(want)):
        assert _same(a, b), name
    custom = getattr(torch.ops.opmap, CUSTOM.get(public, public))
    out = custom(**kw_c)
    first = out[0] if public in LSE_OPS else out
    for a, b in zip(_tensors(first), _tensors(want if public not in LSE_OPS else want)):
        assert _same(a, b), f"torch.ops.opmap.{public}"
    for a, b in zip(_written(kw_c), _written(kw_a)):
        assert _same(a, b), f"torch.ops.opmap.{public}: a written tensor differs"


def test_every_public_op_is_a_custom_op():
    names = set(n for n in dir(torch.ops.opmap) if not n.startswith("_"))
    for op in opmap.api.OPS:
        assert CUSTOM.get(op, op) in names, op
        assert callable(getattr(opmap, op)) and getattr(opmap, op).__doc__, op


def test_forced_backends_and_bad_input():
    kw = ENTRIES[0][3]()
    with pytest.raises(BackendError, match="not registered"):
        opmap.rmsnorm(**kw, backend="nope")
    with pytest.raises(BackendError, match="cannot serve"):  # an fp32 GEMM of 3 rows on cuBLAS-fp8
        opmap.linear(torch.randn(3, 64), torch.randn(8, 64), backend="scaled-mm")
    with pytest.raises(InputError, match="^x"):
        opmap.rmsnorm([[1.0]], kw["weight"])
    with pytest.raises(InputError, match="^q"):
        opmap.attention_decode(torch.randn(2, 64), torch.zeros(1, 16, 2, 64), torch.zeros(1, 16, 2, 64),
                               torch.ones(2, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), 0.1)


def test_decode_without_a_workspace_reuses_a_cached_one(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from opmap.harness.fixtures.attention import make_paged, make_query

    dispatch._WORKSPACES.clear()
    g = torch.Generator().manual_seed(3)
    pc = make_paged([300, 5, 64], 2, 64, 16, dtype=torch.float16, generator=g)
    q, _ = make_query([1, 1, 1], 4, 64, dtype=torch.float16, generator=g)
    args = (q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, 0.125)
    a = opmap.attention_decode(*args, backend="triton")
    assert len(dispatch._WORKSPACES) == 1
    ws = next(iter(dispatch._WORKSPACES.values()))
    assert ws.part_o.shape[0] == 4  # the batch of 3, in its power-of-two bucket
    b = opmap.attention_decode(*args, backend="triton")
    assert len(dispatch._WORKSPACES) == 1 and next(iter(dispatch._WORKSPACES.values())) is ws
    own = opmap.make_decode_workspace(3, 4, 64, device="cpu")
    c = opmap.attention_decode(*args, backend="triton", workspace=own)
    ref = registry.get("attention", "reference").fn("decode")(*args[:5], scale=0.125)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.allclose(a.float(), ref.float(), atol=2e-3)
    with pytest.raises(InputError, match="workspace"):
        opmap.attention_decode(*args, backend="reference", workspace=own)


def test_engine_runs_the_public_callables():
    from opmap.engine.opset import OpSet
    from opmap.model.presets import get_preset
    from opmap.model.step import StepSettings
    from opmap.core.specs import NormSpec

    cfg = get_preset("tiny-llama3")
    ops = OpSet(cfg, "decode", StepSettings(arch="cpu", dtype="fp32", page_size=16, m=4))
    spec = NormSpec(arch="cpu", phase="decode", hidden=cfg.hidden, dtype="fp32")
    assert ops.rmsnorm is dispatch.resolve("rmsnorm", spec, "rmsnorm")[1]


# NaN router logits on purpose
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_moe_ids_stay_in_range_for_nan_logits(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits = torch.full((3, 6), float("nan"))
    logits[1, 2] = 1.0
    for backend in ("triton", "reference"):
        w, ids = opmap.moe_route(logits, 2, backend=backend)
        assert ids.dtype == torch.int32 and bool(((ids >= 0) & (ids < 6)).all()), (backend, ids)


@pytest.mark.parametrize("name,op,entry,build", ENTRIES, ids=[e[0] for e in ENTRIES])
def test_opcheck_every_custom_op(name, op, entry, build, monkeypatch):
    """torch.library.opcheck (schema and mutation, fake tensors, autograd registration, AOT
    dispatch) on each custom op, with the selector's backend and with the Triton one forced."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    public = PUBLIC.get(name, name)
    custom = getattr(torch.ops.opmap, CUSTOM.get(public, public)).default
    torch.library.opcheck(custom, (), build())
    triton = [b.name for b in registry.backends(op) if entry in b.impl and "triton" in b.name]
    if triton:
        torch.library.opcheck(custom, (), dict(build(), backend=triton[0]))
