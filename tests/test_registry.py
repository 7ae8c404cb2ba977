"""Backend records, their declarations, and the capability matrix generated from them."""
import dataclasses
import subprocess
import sys

import pytest

from opmap.harness import matrix as M
from opmap.core import registry
from opmap.core import select as sel
from opmap.core.registry import Backend, Check, Req
from opmap.core.specs import OP_SPECS, TREE, NormSpec


@pytest.fixture
def fake_norm():
    registry.load_all()
    saved = dict(registry._REGISTRY["rmsnorm"])
    registry._REGISTRY["rmsnorm"].clear()
    sel.clear_cache()
    bs = [
        Backend(op="rmsnorm", name="wide", provider="fake-a", version="1.2", priority={"sm90": 50, "cpu": 3},
                impl={"rmsnorm": "math:sqrt"},
                reqs=(Req("dtype", ("bf16", "fp16"), "16-bit activations"),
                      Req("fused_add", (False,), "no fused residual add")),
                checks=(Check("hidden a multiple of 8", lambda s: None if s.hidden % 8 == 0 else
                              f"hidden={s.hidden} not a multiple of 8", "hidden"),
                        Check("odd global rule", lambda s: None))),
        Backend(op="rmsnorm", name="any", provider="fake-b", version=lambda: "9.9", priority={"cpu": 100},
                impl={"rmsnorm": "math:sqrt"}),
        Backend(op="rmsnorm", name="broken-version", provider="fake-c",
                version=lambda: __import__("no_such_package_xyz").v, priority={"sm80": 1},
                impl={"rmsnorm": "math:sqrt"}),
    ]
    for b in bs:
        registry.register(b)
    yield {b.name: b for b in bs}
    registry._REGISTRY["rmsnorm"].clear()
    registry._REGISTRY["rmsnorm"].update(saved)
    sel.clear_cache()


def test_validate_reasons_in_tree_order(fake_norm):
    b = fake_norm["wide"]
    spec = NormSpec(arch="sm80", hidden=100, dtype="fp32", fused_add=True)
    rs = b.validate(spec)
    assert rs[0].startswith("arch=sm80 not served")
    # fused_add comes before dtype and hidden in TREE["rmsnorm"].
    assert rs[1].startswith("fused_add=True") and rs[2].startswith("dtype='fp32'") and rs[3].startswith("hidden=100")
    assert b.first_level(spec) == "arch"
    assert b.validate(NormSpec(arch="sm90", hidden=4096)) == []
    assert b.first_level(NormSpec(arch="sm90", hidden=4096)) is None


def test_register_errors_and_lookup(fake_norm):
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(fake_norm["any"])
    with pytest.raises(ValueError, match="unknown op"):
        registry.register(Backend(op="nope", name="x", provider="p", version="1", priority={}, impl={}))
    with pytest.raises(KeyError, match="registered: wide, any, broken-version"):
        registry.get("rmsnorm", "missing")
    assert registry.get("rmsnorm", "any").provider_version() == "9.9"
    assert registry.get("rmsnorm", "broken-version").provider_version().startswith("n/a (")


def test_impl_is_lazy_and_entry_errors(fake_norm):
    b = fake_norm["wide"]
    assert b._fns == {}
    assert b("rmsnorm", 16.0) == 4.0
    assert "rmsnorm" in b._fns
    with pytest.raises(KeyError, match="has no entry 'decode'"):
        b.fn("decode")


def test_matrix_generated_from_declarations(fake_norm):
    m = M.op_matrix("rmsnorm", "sm90")
    assert m.columns == TREE["rmsnorm"]
    rows = {r.backend: r for r in m.rows}
    assert [r.backend for r in m.rows][0] == "wide"  # served on sm90, highest priority first
    w = rows["wide"]
    assert w.cells["arch"] == M.Cell(M.FULL, "priority 50")
    assert w.cells["dtype"] == M.Cell(M.COND, "16-bit activations")
    assert w.cells["fused_add"].mark == M.NONE  # a bool feature declared unsupported
    assert w.cells["hidden"] == M.Cell(M.COND, "hidden a multiple of 8")
    assert w.cells["phase"] == M.Cell(M.FULL)
    assert w.other == M.Cell(M.COND, "odd global rule")
    assert rows["any"].cells["arch"].mark == M.NONE and rows["any"].priority is None
    assert rows["any"].version == "9.9"
    md = M.to_markdown([m, M.op_matrix("rmsnorm", "cpu")])
    assert "| wide | fake-a | 1.2 | ● priority 50 | ● | ○ no fused residual add | ◐ 16-bit activations |" in md
    assert md.count("## rmsnorm") == 2


def _variants(op):
    """Default spec of the op on sm90, each phase, and each boolean field flipped."""
    cls = OP_SPECS[op]
    base = cls(arch="sm90")
    out = [base] + [base.replace(phase=p) for p in ("prefill", "mixed")]
    for f in dataclasses.fields(cls):
        if str(f.type) == "bool":
            try:
                out.append(base.replace(**{f.name: not getattr(base, f.name)}))
            except ValueError:
                pass
    return out


def test_matrix_and_selector_agree_on_real_registry():
    """Every reason the selector gives falls on a column the matrix marks ◐ or ○ (never on a ●)."""
    registry.load_all()
    for mat in M.build("sm90"):
        rows = {r.backend: r for r in mat.rows}
        for b in registry.backends(mat.op):
            row = rows[b.name]
            for f, cell in row.cells.items():
                if cell.mark == M.COND:
                    assert cell.condition, f"{mat.op}/{b.name}.{f}: conditional without its condition"
            for spec in _variants(mat.op):
                for rank, reason in b._reasons(spec, runtime=False):
                    cols = TREE[mat.op]
                    cell = row.cells[cols[rank]] if rank < len(cols) else row.other
                    assert cell.mark != M.FULL, (f"{mat.op}/{b.name}: selector says {reason!r} but the matrix "
                                                 f"shows {cols[rank] if rank < len(cols) else 'other'} as supported")


def test_every_op_with_backends_has_a_reference():
    registry.load_all()
    for op in OP_SPECS:
        bs = registry.backends(op)
        if not bs:
            continue
        ref = [b for b in bs if b.name == "reference"]
        assert ref, f"{op}: backends {[b.name for b in bs]} but no 'reference'"
        assert ref[0].priority["cpu"] == registry.REFERENCE_PRIORITY["cpu"]
        others = [b.priority["sm90"] for b in bs if b is not ref[0] and "sm90" in b.priority]
        others = [min(p.value, p.otherwise) if isinstance(p, registry.Prefer) else p for p in others]
        if others:
            assert ref[0].priority["sm90"] <= min(others), f"{op}: the reference must be last on sm90"
        for b in bs:
            for entry, target in b.impl.items():
                assert ":" in target and target.split(":")[0].startswith("opmap."), (op, b.name, entry, target)


def test_loading_the_registry_imports_no_kernel_or_peer():
    code = ("import sys; from opmap.core import registry; registry.load_all(); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('triton', 'flashinfer', 'xgrammar', "
            "'transformers')); print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing backends.py pulled in: {out.stdout.strip()}"


def test_priority_by_spec():
    """A priority may depend on the spec (registry.Prefer): the selector ranks by the spec's
    phase or head count, the matrix says when."""
    from opmap.harness import matrix
    from opmap.core.select import select
    from opmap.core.specs import AttentionSpec

    registry.load_all()
    fi = next(b for b in registry.backends("attention") if b.name == "flashinfer")
    kw = dict(arch="sm90", num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="bf16", kv_dtype="bf16")
    pre, dec = AttentionSpec(phase="prefill", **kw), AttentionSpec(phase="decode", **kw)
    assert fi.priority_for(pre) == 55 and fi.priority_for(dec) == 40
    assert fi.priority_for(AttentionSpec(phase="prefill", **dict(kw, arch="sm80"))) == 40
    assert fi.describe_priority("sm90") == "priority 55 where phase = prefill, else 40"
    assert select("attention", pre, runtime=False).backend.name == "flashinfer"
    assert select("attention", dec, runtime=False).backend.name == "triton"
    row = next(r for r in matrix.op_matrix("attention", "sm90").rows if r.backend == "flashinfer")
    assert row.priority == 55 and row.cells["arch"].condition == "priority 55 where phase = prefill, else 40"
    # FlashInfer's MLA decode first from 64 heads, ours (the TMA kernel on pages of 64) below
    mla = dict(arch="sm90", phase="decode", kind="mla", num_kv_heads=1, head_dim=576, head_dim_v=512, page_size=64,
               dtype="bf16", kv_dtype="bf16")
    assert select("attention", AttentionSpec(num_heads=128, **mla), runtime=False).backend.name == "mla-flashinfer"
    assert select("attention", AttentionSpec(num_heads=16, **mla), runtime=False).backend.name == "mla-tma"
    # under CUDA graphs (the engine's decode) FlashInfer's per-call plan is refused whatever its priority
    g = AttentionSpec(num_heads=128, cuda_graph=True, **mla)
    assert select("attention", g, runtime=False).backend.name == "mla-tma"
    # the TMA kernel's own rule: first for a 16-bit cache, and for an fp8 one from 64 heads
    tma = next(b for b in registry.backends("attention") if b.name == "mla-tma")
    assert tma.describe_priority("sm90") == "priority 52 where a 16-bit cache, or an fp8 one from 64 heads, else 45"
    assert tma.priority_for(AttentionSpec(num_heads=16, **dict(mla, kv_dtype="fp8"))) == 45
