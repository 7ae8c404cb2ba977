"""The profiler's symbols of opmap's own kernels come from the registry (harness/profile/ours.py):
every jit kernel under src/opmap/kernels belongs to a registered backend, and the kernels of the
opmap engine fixtures map to the backend their operator range names."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from opmap.core import registry
from opmap.harness.profile import analyze
from opmap.harness.profile import ours
from opmap.harness.profile import symbols
from opmap.harness.profile import trace

SRC = Path(ours.ROOT)
DATA = Path(__file__).parent / "data" / "traces"


def _launched_kernels() -> dict:
    """symbol -> file of every @triton.jit / @gluon.jit function under src/opmap/kernels that some
    module launches (``kernel[grid](...)``); the jit helpers they call inline never reach a trace."""
    jit, launched = {}, set()
    for f in (SRC / "kernels").rglob("*.py"):
        tree = ast.parse(f.read_text())
        for n in tree.body:
            if isinstance(n, ast.FunctionDef) and any(map(ours._is_jit, n.decorator_list)):
                jit[n.name] = f
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript) and isinstance(n.func.value, ast.Name):
                launched.add(n.func.value.id)
    return {s: f for s, f in jit.items() if s in launched}


def test_every_kernel_under_kernels_maps_to_a_backend():
    kernels = _launched_kernels()
    assert len(kernels) >= 20 and "_decode_kernel" in kernels and "_fp8_decode_kernel" in kernels
    missing = {s: str(f.relative_to(SRC)) for s, f in kernels.items() if not ours.owners(s)}
    assert not missing, f"jit kernels no registered backend reaches: {missing}"
    for s in kernels:
        cat, lib = symbols.classify(s)
        assert lib == "opmap" and cat in symbols.categories(), s


def test_no_hand_kept_opmap_rules_remain_in_the_table():
    assert not [r for r in symbols.table()["rules"] if r["library"] == "opmap"]


def _impl_modules(op: str, backend: str) -> set:
    return {t.split(":")[0] for t in registry.get(op, backend).impl.values()}


def test_owners_are_the_backends_that_reach_the_definition_most_directly():
    """Every owner's impl modules reach the module defining the kernel; where some backend names
    that module in its impl, the owners are exactly those backends (the more specific); a module
    only imported (a shared helper kernel) lists every backend that imports it."""
    table = ours.table()
    for sym, owners in table.items():
        assert owners, sym
        for mod in {o.module for o in owners}:
            mine = [o for o in owners if o.module == mod]
            direct = {(o.op, o.backend) for o in mine if mod in _impl_modules(o.op, o.backend)}
            for o in mine:
                assert any(mod in ours._reach(m) for m in _impl_modules(o.op, o.backend)), (sym, o)
            if direct:
                assert direct == {(o.op, o.backend) for o in mine}, (sym, mod)


def test_one_symbol_two_definitions_lists_both_ops():
    """_combine_kernel is two kernels: the split-KV decode combine and the MoE combine."""
    mods = {}
    for f in (SRC / "kernels").rglob("*.py"):
        for n in ast.parse(f.read_text()).body:
            if isinstance(n, ast.FunctionDef) and any(map(ours._is_jit, n.decorator_list)):
                mods.setdefault(n.name, set()).add(f)
    shared = {s for s, fs in mods.items() if len(fs) > 1 and s in _launched_kernels()}
    assert shared
    for s in shared:
        assert len({o.module for o in ours.owners(s)}) == len(mods[s]), s
    assert set(ours.categories("_combine_kernel")) == {"attention", "MoE"}


def test_the_table_is_read_without_importing_triton():
    code = ("import sys; from opmap.harness.profile import ours; t = ours.table(); "
            "assert t and 'triton' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=SRC.parents[1])


def test_quantised_gemm_kernels_come_from_the_gemm_declarations():
    """A kernel that only backends declaring quantised weights launch is a low-precision GEMM,
    except their (de)quantisers (a dequantised weight feeds a dense GEMM); a kernel a dense
    backend shares is not evidence of either."""
    assert "triton-wo" in ours.quantised_gemms() and "cublas" not in ours.quantised_gemms()
    quant = [s for s in ours.table() if ours.quantised_only(s)]
    assert "_dequant_kernel" in quant
    for s in quant:
        assert ours.low_precision_gemm(s) == ("quant" not in s), s
    assert not ours.low_precision_gemm("_decode_kernel") and not ours.low_precision_gemm("nvjet_sm90_tst_64x8")


_RANGE = re.compile(r"^opmap::(\w+)::[^:]*::([\w.-]+)$")


@pytest.mark.parametrize("name", ["opmap-llama", "opmap-deepseek"])
def test_fixture_kernels_map_to_the_backend_of_their_range(name):
    """Eager steps: every kernel of ours launched inside an operator range belongs, by the registry,
    to the backend that range names (where the registry still has a backend of that name: the
    fixture was recorded before later splits). Replayed decode graphs (no range): the symbol alone
    names the backend, which the analysis reports."""
    t = trace.load(str(DATA / f"{name}.json.gz"))
    checked = 0
    for k in t.kernels:
        rng = [m.groups() for m in map(_RANGE.match, k.ranges) if m]
        if rng and ours.owners(k.name) and rng[-1][1] in {b.name for b in registry.backends(rng[-1][0])}:
            assert tuple(rng[-1]) in {(o.op, o.backend) for o in ours.owners(k.name)}, (k.name, rng[-1])
            checked += 1
    assert checked >= 5
    res = analyze.analyze(t)
    dec = res["phases"]["decode"]["opmap_backends"]
    replayed = {k.name for k in t.kernels if k.graph and ours.owners(k.name)}
    assert replayed
    for sym in replayed:
        want = ", ".join(dict.fromkeys(f"{o.op}/{o.backend}" for o in ours.owners(sym)))
        assert dec.get(want, 0) > 0, (sym, want, dec)
