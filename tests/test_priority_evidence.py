"""Every backend priority that ranks one backend above another rests on something stated: baseline
rows (``registry.Evidence``: bench/baselines/<gpu>/<family>.json, case and provider) or a reason that
is not a measurement (a capability, numerics, a convention, a peer the baseline run could not time),
carried by a ``registry.Basis`` (core/registry.py, "Priority conventions").

The rule, kept minimal:
- every Evidence is a timed row (``results``, not ``skipped``) of an existing baseline file whose GPU
  has the arch of the priority it backs: an H200 row says nothing of an sm80 order;
- a Basis without evidence says which kind of reason it is (``registry.NOT_MEASURED``), and a
  "not timed" one belongs to a peer that a baseline of its arch skipped because its package was
  missing; no reason quotes a figure or a commit (the rows hold the figures);
- every ``Prefer`` rule (a priority that ranks by the spec) carries a Basis;
- on every arch a baseline measured, any two backends of an op that serve a common spec with
  different priorities have a Basis on that arch on at least one side (the one that explains the
  order: the faster one's rows, or the slower one's, or the reference's convention), and never the
  same priority (the registry's order would decide silently).
On the arches no baseline measured the order is the registry's stated convention, not a measurement.

Which specs two backends both serve is searched over a grid per op: each field's default, every value
a declaration lists, both booleans, and sizes on either side of the bounds the declarations draw
(``SIZES``), reduced per pair to the values both backends accept field by field before the product.
"""
import dataclasses
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from test_figures import commit_hashes, figures

from opmap.core import registry
from opmap.core import select as sel
from opmap.core.registry import Basis, Evidence, Prefer
from opmap.core.specs import OP_SPECS, AttentionSpec

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ROOT / "bench" / "baselines"


def _load() -> dict:
    out = {}
    for path in sorted(BASELINES.glob("*/*.json")):
        d = json.loads(path.read_text())
        out[f"{path.parent.name}/{path.stem}"] = SimpleNamespace(
            arch=d["environment"]["arch"],
            rows={(r["case"], r["provider"]) for r in d.get("results", [])},
            skipped={(s["case"], s["provider"]): s["reason"] for s in d.get("skipped", [])})
    return out


FILES = _load()
MEASURED_ARCHES = sorted({f.arch for f in FILES.values()})


def evidence_problem(ev: Evidence, arch: str, files: dict = FILES):
    """Why ``ev`` does not back a priority on ``arch``, or None."""
    f = files.get(ev.baseline)
    if f is None:
        return f"no baseline file bench/baselines/{ev.baseline}.json"
    if (ev.case, ev.provider) not in f.rows:
        if (ev.case, ev.provider) in f.skipped:
            return f"{ev.baseline}: {ev.case} / {ev.provider} was skipped, not timed ({f.skipped[ev.case, ev.provider]})"
        return f"{ev.baseline}: no row with case {ev.case!r} and provider {ev.provider!r}"
    if f.arch != arch:
        return f"{ev.baseline} was measured on {f.arch}, not {arch}"
    return None


def basis_problem(basis: Basis, backend, arch: str, files: dict = FILES):
    """Why ``basis`` is not a stated reason for ``backend``'s priority on ``arch``, or None."""
    kind = next((k for k in registry.NOT_MEASURED if basis.reason.startswith(k + ":")), None)
    if not basis.reason.strip():
        return "an empty reason"
    if figures(basis.reason) or commit_hashes(basis.reason):
        return f"the reason quotes a figure or a commit (the rows hold the figures): {basis.reason!r}"
    if basis.evidence:
        if kind:
            return f"a {kind!r} reason with baseline rows: a measured reason names no other kind"
        bad = [p for p in (evidence_problem(e, arch, files) for e in basis.evidence) if p]
        return "; ".join(bad) or None
    if kind is None:
        return (f"no baseline row and no stated kind: begin the reason with one of "
                f"{', '.join(k + ':' for k in registry.NOT_MEASURED)} or cite the rows: {basis.reason!r}")
    if kind == "not timed":
        missing = [f"{name}: {why}" for name, f in files.items() if f.arch == arch
                   for (_, provider), why in f.skipped.items()
                   if provider == backend.provider and "not installed" in why]
        if not missing:
            return (f"'not timed' is for a peer that a baseline on {arch} skipped as not installed; "
                    f"no baseline skipped provider {backend.provider!r} so")
    return None


def _declared():
    """(op, backend, arch, Basis or None, where) of every basis the registry declares."""
    for op in registry.ops():
        for b in registry.backends(op):
            for arch, p in b.priority.items():
                if isinstance(p, Prefer):
                    yield op, b, arch, p.basis, "Prefer"
            for arch, basis in b.basis.items():
                yield op, b, arch, basis, "basis"


DECLARED = list(_declared())


def _id(item) -> str:
    op, b, arch, _, where = item
    return f"{op}/{b.name}/{arch}/{where}"


@pytest.mark.parametrize("item", DECLARED, ids=_id)
def test_each_basis_is_rows_or_a_stated_reason(item):
    op, b, arch, basis, where = item
    if where == "Prefer":
        assert basis is not None, (f"{op}/{b.name} on {arch}: a Prefer rule ranks by the spec, so it says why "
                                   "(Prefer(..., basis=Basis(reason, evidence)))")
        assert arch not in b.basis, f"{op}/{b.name} on {arch}: the Prefer's basis and a declared one; keep one"
    else:
        assert arch in b.priority, f"{op}/{b.name}: a basis for {arch}, which it does not serve"
    problem = basis_problem(basis, b, arch)
    assert problem is None, f"{op}/{b.name} on {arch}: {problem}"


def test_the_checks_refuse_a_made_up_row():
    """The checks above fail on rows that are not there (a made-up case, provider or file), on a row
    that was skipped, on rows of another GPU's arch, and on reasons that claim nothing or quote figures."""
    real = Evidence("h200/attention", "B=64,kv=4096,h=32/8,d=128,page=16,dtype=fp8", "opmap-triton[gl=0]")
    assert evidence_problem(real, "sm90") is None
    for fake in (dataclasses.replace(real, case="B=64,kv=4096,h=32/8,d=128,page=16,dtype=fp4"),
                 dataclasses.replace(real, provider="opmap-triton[gl=2]"),
                 dataclasses.replace(real, baseline="h300/attention"),
                 Evidence("h200/attention", "B=64,kv=4096,h=32/8,d=128,page=16,dtype=bf16", "flashinfer")):
        assert evidence_problem(fake, "sm90"), fake
    assert "measured on sm90, not sm80" in evidence_problem(real, "sm80")
    gluon = registry.get("attention", "gluon-fp8")
    fake_row = Evidence("h200/attention", "B=64,kv=4096,h=32/8,d=128,page=16,dtype=fp8", "opmap-gluon-fp8")
    assert "no row" in basis_problem(Basis("faster", (real, fake_row)), gluon, "sm90")
    assert basis_problem(Basis("faster", (real,)), gluon, "sm90") is None
    assert "no stated kind" in basis_problem(Basis("measured faster"), gluon, "sm90")
    assert "quotes a figure" in basis_problem(Basis("137 us against 240 us", (real,)), gluon, "sm90")
    assert "not installed" in basis_problem(Basis("not timed: missing there"), gluon, "sm90")
    flashinfer = registry.get("attention", "flashinfer")
    assert basis_problem(Basis("not timed: missing there"), flashinfer, "sm90") is None
    assert basis_problem(Basis("not timed: missing there"), flashinfer, "sm80")  # no sm80 baseline skipped it


# ---- which backends meet: a spec both serve ----------------------------------------------------------

# Sizes on either side of the bounds the declarations draw with a rule (a callable or a check).
SIZES = {
    "page_size": (1, 16, 64, 128, 256), "m": (None, 1, 32, 48, 64, 100, 128, 1024), "n": (4096, 16384, 4104),
    "k": (4096, 4104), "hidden": (4096, 4100), "intermediate": (14336, 1406), "num_experts": (8, 64),
    "top_k": (2, 8), "rotary_dim": (None, 64, 63), "vocab": (128256, 32001), "tokens": (None, 16, 4096),
    "shared_experts": (0, 2), "num_kv_heads": (8, 1), "head_dim": (64, 96, 128, 256), "num_heads": (32, 128),
}
# Attention's head layout as one field: (num_heads, num_kv_heads, head_dim, head_dim_v); head_dim_v
# None is head_dim, a set one an MLA latent layer (R + Dr, R).
HEADS = ((32, 8, 128, None), (32, 32, 128, None), (32, 1, 128, None), (32, 8, 64, None), (32, 8, 96, None),
         (32, 8, 256, None), (128, 8, 128, None), (256, 8, 128, None),
         (16, 1, 576, 512), (128, 1, 576, 512), (16, 1, 80, 64))
HEAD_FIELDS = ("kind", "num_heads", "num_kv_heads", "head_dim", "head_dim_v")


def _values(op: str, f: dataclasses.Field) -> list:
    vals = [f.default]
    if str(f.type) == "bool":
        vals += [False, True]
    if f.name == "phase":
        vals += ["prefill", "decode", "mixed"]
    for b in registry.backends(op):
        vals += [v for r in b.reqs if r.field == f.name and not callable(r.allowed) for v in r.allowed]
    vals += list(SIZES.get(f.name, ()))
    return list(dict.fromkeys(vals))


def _accepts(backend, field: str, value) -> bool:
    return all(r.reason(SimpleNamespace(**{field: value})) is None for r in backend.reqs if r.field == field)


def _specs(op: str, arch: str, a, b):
    """Specs of the grid on ``arch`` whose every field both ``a`` and ``b`` accept (their checks, which
    relate fields, are left to validate())."""
    cls = OP_SPECS[op]
    heads = op == "attention"
    axes = {}
    for f in dataclasses.fields(cls):
        if f.name == "arch" or (heads and f.name in HEAD_FIELDS):
            continue
        axes[f.name] = [v for v in _values(op, f) if _accepts(a, f.name, v) and _accepts(b, f.name, v)]
    if heads:
        layouts = []
        for h, hk, d, dv in HEADS:
            s = AttentionSpec(arch=arch, num_heads=h, num_kv_heads=hk, head_dim=d, head_dim_v=dv,
                              kind="mla" if dv else None)
            if all(_accepts(x, f, getattr(s, f)) for x in (a, b) for f in HEAD_FIELDS):
                layouts.append({f: getattr(s, f) for f in HEAD_FIELDS})
        axes["_heads"] = layouts
    names = list(axes)
    for combo in itertools.product(*(axes[n] for n in names)):
        kw = dict(zip(names, combo))
        kw.update(kw.pop("_heads", {}))
        try:
            yield cls(arch=arch, **kw)
        except ValueError:  # a combination the spec itself refuses
            continue


def meetings(op: str, arch: str, a, b) -> dict:
    """How ``a`` and ``b`` rank where both serve a spec: {"a above", "b above", "tie"} -> a spec."""
    out = {}
    ranked_by_spec = isinstance(a.priority.get(arch), Prefer) or isinstance(b.priority.get(arch), Prefer)
    for spec in _specs(op, arch, a, b):
        if a.validate(spec) or b.validate(spec):
            continue
        pa, pb = a.priority_for(spec), b.priority_for(spec)
        out.setdefault("tie" if pa == pb else "a above" if pa > pb else "b above", spec)
        if not ranked_by_spec or len(out) == 3:
            break
    return out


def _pairs(arch: str, op: str):
    served = [b for b in registry.backends(op) if arch in b.priority]
    return list(itertools.combinations(served, 2))


@pytest.mark.parametrize("arch,op", [(a, op) for a in MEASURED_ARCHES for op in registry.ops()])
def test_backends_that_meet_are_ordered_for_a_stated_reason(arch, op):
    met, problems = [], []
    for a, b in _pairs(arch, op):
        found = meetings(op, arch, a, b)
        if not found:
            continue  # they never serve the same spec: their priorities never compete
        met.append((a.name, b.name))
        spec = next(iter(found.values())).describe()
        if "tie" in found:
            problems.append(f"{a.name} and {b.name} both serve [{found['tie'].describe()}] at the same priority; "
                            "the registration order would choose")
        if not (a.basis_for(arch) or b.basis_for(arch)):
            problems.append(f"{a.name} and {b.name} both serve [{spec}]; give one of them a Basis for {arch} "
                            "(baseline rows, or a stated reason that is not a measurement)")
    assert met, f"{op} on {arch}: no two backends serve a common spec of the grid (at least the reference and ours do)"
    assert not problems, f"{op} on {arch}:\n" + "\n".join(problems)


def test_the_search_finds_who_meets():
    """The grid finds the pairs that compete and leaves those that never do."""
    att = {b.name: b for b in registry.backends("attention")}
    assert set(meetings("attention", "sm90", att["triton-tma"], att["triton"])) == {"a above"}
    assert set(meetings("attention", "sm90", att["flashinfer"], att["triton"])) == {"a above", "b above"}
    assert meetings("attention", "sm90", att["sdpa_cudnn"], att["triton"]) == {}  # contiguous vs paged KV
    assert meetings("attention", "sm90", att["gluon-fp8"], att["flex"]) == {}  # fp8 KV vs the same dtype
    assert meetings("attention", "sm90", att["mla-triton"], att["triton"]) == {}
    gemm = {b.name: b for b in registry.backends("gemm")}
    assert set(meetings("gemm", "sm90", gemm["dequant-cublas"], gemm["triton-wo"])) == {"a above", "b above"}
    assert {"triton-tma", "triton"} in [{a.name, b.name} for a, b in _pairs("sm90", "attention")]


def test_explain_names_the_rows_behind_the_choice():
    """`opmap select` says why the chosen backend outranks the others, with the first baseline rows."""
    spec = AttentionSpec(arch="sm90", phase="decode", kv_dtype="fp8", cuda_graph=True)
    text = sel.select("attention", spec, runtime=False).explain()
    basis = registry.get("attention", "gluon-fp8").basis_for("sm90")
    line = next(ln for ln in text.splitlines() if ln.startswith("  basis: "))
    assert basis.reason in line and "h200/attention `B=64,kv=4096,h=32/8,d=128,page=16,dtype=fp8`" in line
    assert "opmap-triton (gluon-fp8), opmap-triton[gl=0] (triton)" in line
    # nothing outranked, nothing to explain
    alone = sel.select("attention", spec.replace(num_heads=64, num_kv_heads=2), runtime=False)
    assert alone.name == "triton" and "  basis: " not in alone.explain()
