"""The GPU session scripts name files and bench ops that exist: a typo there costs a device call
(30 minutes of GPU time a session), and nothing else runs these scripts on the CPU machine."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [ROOT / "scripts" / n for n in ("gpu_session.sh", "gpu.sh", "gpu_env.sh", "build_flashinfer_aot.sh")]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_syntax(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_named_paths_exist(script):
    text = script.read_text()
    paths = set(re.findall(r"\b((?:scripts|tests)/[\w./-]+\.(?:py|sh))\b", text))
    assert paths, f"{script.name} names no scripts or tests"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{script.name} names files that do not exist: {missing}"


def test_bench_ops_exist():
    """Every `--op X` in gpu_session.sh selects at least one bench case (--op is a prefix)."""
    from opmap.bench.cases import attention, mla, sampling

    names = {c.op for mod in (attention, mla, sampling) for c in mod.cases(quick=True)}
    ops = set(re.findall(r"bench --quick(?: --op [\w.]+)+", (ROOT / "scripts" / "gpu_session.sh").read_text()))
    wanted = {o for line in ops for o in re.findall(r"--op ([\w.]+)", line)}
    assert wanted
    unknown = sorted(o for o in wanted if not any(n.startswith(o) for n in names))
    assert not unknown, f"bench --op selects nothing: {unknown}"


def _bench_commands(text: str) -> list:
    """(quick, ops, providers) of each `opmap.cli bench` command in the script (continuations joined)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        if "opmap.cli bench" not in line:
            continue
        cmd = line.split("opmap.cli bench", 1)[1].split(">", 1)[0]
        provs = re.findall(r'--provider "([^"]+)"', cmd) + re.findall(r"--provider ([^\s\"]+)", cmd)
        out.append(("--quick" in cmd, re.findall(r"--op ([\w.]+)", cmd), provs))
    return out


def test_bench_providers_exist():
    """Every `--provider X` in gpu_session.sh names a row that a case of the command's grid (quick
    or full) and ops has. The bench refuses an unknown one, so a wrong name costs a GPU call: the
    fourteenth session's fix14 asked the quick grid for variant rows only the full grid has."""
    from opmap.bench.runner import collect

    grids = {}
    for quick in (True, False):
        cases, errors = collect(quick=quick)
        assert not errors, errors
        grids[quick] = cases
    cmds = _bench_commands((ROOT / "scripts" / "gpu_session.sh").read_text())
    assert any(provs for _, _, provs in cmds)
    bad = []
    for quick, ops, provs in cmds:
        have = {p.name for c in grids[quick] if not ops or any(c.op.startswith(o) for o in ops)
                for p in c.providers}
        bad += [(w, "quick" if quick else "full", ops) for w in provs if w not in have]
    assert not bad, f"gpu_session.sh names bench rows its command's grid lacks: {bad}"


def test_session_parts_are_unique_and_listed():
    """Each `case` part of gpu_session.sh appears once (bash takes the first of two labels without a
    word, so an edited copy further down would never run) and is named in the usage line."""
    text = (ROOT / "scripts" / "gpu_session.sh").read_text()
    parts = re.findall(r"^  ([\w-]+)\)$", text, flags=re.M)
    dup = sorted({p for p in parts if parts.count(p) > 1})
    assert not dup, f"parts defined twice: {dup}"
    usage = re.search(r"usage: scripts/gpu_session.sh ([\w|-]+) OUTDIR", text).group(1).split("|")
    missing = sorted(set(parts) - set(usage))
    assert not missing, f"parts not in the usage line: {missing}"
