"""The repository's layout rules that a refactor can break without any other test noticing: no
import cycle inside src/opmap (function-level imports included), few environment switches, and
no file that speaks of how the work was done."""
import re
import subprocess
from pathlib import Path

from opmap.harness.check import fingerprint

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _modules() -> dict:
    mods = {}
    for path in (SRC / "opmap").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict) -> set:
    """The opmap modules a module imports (function-level imports included): the names the
    sanitizer's fingerprint follows, each cut to the longest existing module."""
    out = set()
    for t in fingerprint._imports(path, (SRC / "opmap",)):
        while t and t not in mods:
            t = t.rpartition(".")[0]
        # a module's parent packages are imported before it: an edge to one is no cycle
        if t and t != name and t.startswith("opmap") and not name.startswith(t + "."):
            out.add(t)
    return out


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert graph["opmap.kernels.attention.prefill"] >= {"opmap.kernels.attention.tiles"}  # the walk sees imports
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _cycles(graph) == []


def _tracked(*paths) -> list:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", *paths], capture_output=True, text=True)
    return [ROOT / p for p in out.stdout.split()] if out.returncode == 0 else []


def test_few_environment_switches():
    names = set()
    for path in (SRC / "opmap").rglob("*.py"):
        names.update(re.findall(r"OPMAP_[A-Z0-9_]+", path.read_text()))
    assert len(names) <= 6, sorted(names)


def test_the_project_speaks_of_itself_only():
    files = [p for p in _tracked("src", "docs", "README.md", "tests", "scripts") if p.is_file()
             and p.suffix in (".py", ".md", ".sh", ".txt", ".toml")]
    if not files:  # not a git checkout (an sdist): nothing to look at
        return
    bad = [f"{p.relative_to(ROOT)}: {ln.strip()[:80]}" for p in files if p.name != "test_layout.py"
           for ln in p.read_text(errors="replace").splitlines()
           if re.search(r"session|device minute", ln, re.I) and "start_new_session" not in ln]
    assert not bad, bad[:10]
    assert not _tracked("*.whl")


def test_import_registers_the_custom_ops():
    code = ("import opmap, torch; names = [n for n in dir(torch.ops.opmap) if not n.startswith('_')]; "
            "print(len(names), ' '.join(sorted(names)))")
    out = subprocess.run([__import__("sys").executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(__import__("os").environ, PYTHONPATH=str(SRC)))
    assert out.returncode == 0, out.stderr
    n, names = out.stdout.split(" ", 1)
    assert int(n) >= 15, names
    for op in ("rmsnorm", "rope", "linear", "moe", "attention_decode", "attention_prefill", "mla_decode", "sample",
               "apply_bitmask"):
        assert op in names.split(), (op, names)
