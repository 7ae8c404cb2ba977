"""The repository's layout rules that a refactor can break without any other test noticing: the
layers of src/opmap (docs/CONTRIBUTING.md) over every import, function-level ones included; no
import cycle; few environment switches; no file that speaks of how the work was done."""
import ast
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


# src/opmap's packages from the bottom up: each may import those before it, never one after it.
LAYERS = ("core", "ops", "kernels", "peers", "api", "model", "engine", "harness", "cli")
RANK = {"core": 0, "ops": 1, "kernels": 2, "peers": 2, "api": 3, "model": 4, "engine": 5, "harness": 6, "cli": 7}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _says_why(lines: list, i: int) -> bool:
    """A comment on the import's line, on a comment line above it over the run of imports it belongs
    to, or on the line that opens its block (``try:``, ``except ...:``, ``if ...:``)."""
    first = True
    while i >= 0:
        s = lines[i].strip()
        imports = s.startswith(("from ", "import "))
        if "#" in s and (s.startswith("#") or imports or (not first and s.startswith(_OPENERS))):
            return True
        if not imports:
            return False
        first = False
        i -= 1
    return False


_OPENERS = ("try", "except", "if ", "elif ", "else", "with ")


def _import_sites(mods: dict):
    """(module, line, target module, imported name or None, inside a function, reason comment) for every
    import statement of src/opmap naming an opmap module."""
    for name, path in mods.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        inner = {id(n) for f in funcs for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            reason = _says_why(lines, node.lineno - 1)
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            else:
                mod = node.module or ""
                if node.level:
                    base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                    mod = ".".join(base + ([mod] if mod else []))
                targets = [(f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod, a.name) for a in node.names]
            for target, imported in targets:
                yield name, node.lineno, target, imported, id(node) in inner, reason


def test_layers_import_only_downward():
    mods = _modules()
    up, apart = [], []
    for name, line, target, _, _, _ in _import_sites(mods):
        if not target.startswith("opmap."):
            continue
        a, b = _layer(name), _layer(target)
        if a in RANK and b in RANK and RANK[b] > RANK[a]:
            up.append(f"{name}:{line} -> {target}")
        if {a, b} == {"kernels", "peers"}:
            apart.append(f"{name}:{line} -> {target}")
    assert set(RANK) == set(LAYERS) and all(_layer(m) in RANK for m in mods if m.count(".") > 1), sorted(
        {_layer(m) for m in mods} - set(RANK))
    assert not up, up
    assert not apart, apart


def test_no_private_name_crosses_a_package():
    mods = _modules()
    bad = []
    for name, line, target, imported, _, _ in _import_sites(mods):
        if not (target.startswith("opmap") and imported and imported.startswith("_") and not imported.startswith("__")):
            continue
        home = target if mods.get(target, Path()).name == "__init__.py" else target.rpartition(".")[0]
        me = name if mods[name].name == "__init__.py" else name.rpartition(".")[0]
        if home != me:
            bad.append(f"{name}:{line} imports {imported} from {target}")
    assert not bad, bad


def test_says_why_reads_only_a_reason_that_belongs_to_the_import():
    lines = ["    x = f()  # unrelated", "    import a", "    # heavy: b", "    import b", "    import c",
             "    try:  # optional: d", "        import d", "    import e  # optional"]
    assert [_says_why(lines, i) for i in (1, 3, 4, 6, 7)] == [False, True, True, True, True]


def test_function_level_imports_say_why():
    """An import inside a function is for an optional or heavy dependency (or one that must not load
    with the module that imports it), and says which in a comment on its line or the line above."""
    mods = _modules()
    bad = sorted({f"{name}:{line}" for name, line, _, _, inner, reason in _import_sites(mods) if inner and not reason})
    assert not bad, (len(bad), bad[:40])


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
