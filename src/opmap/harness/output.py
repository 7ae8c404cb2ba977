"""What `opmap check`, `opmap bench` and `opmap report` share in their output: the console, the
environment block of a result file (device, versions, commit, command), where result files go,
and a selector error in one line. One module that all three import, so none imports another."""
from __future__ import annotations

import datetime
import importlib.util
import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

from rich.console import Console

from opmap.core import hw
from opmap.harness.check.fingerprint import code_settings


def wide_console():
    """Off a terminal (CI logs, files) rich assumes 80 columns, which wraps every figure."""
    return Console(width=None if sys.stdout.isatty() else 160)


def short_error(msg: str) -> str:
    """A BackendError in one line: each rejected candidate with the level where it fell."""
    lines = msg.splitlines()
    rej = [ln.strip()[2:].split(":", 1)[0] for ln in lines[1:] if ln.strip().startswith("- ")]
    if "no backend can serve" in lines[0]:
        return "rejected: " + ", ".join(rej) if rej else "no backend is registered for this op"
    return lines[0]


COMMIT_FILE = Path(__file__).resolve().parents[1] / "COMMIT"  # `git archive` writes the commit into it


def git_commit() -> Optional[str]:
    """The commit named in OPMAP_COMMIT, else the one a `git archive` of the tree wrote into
    opmap/COMMIT (export-subst), else HEAD of the checkout this package runs from (+dirty). The
    first two come first: a copy of the tree on another machine may sit under a .git whose HEAD is
    not the code that runs."""
    return os.environ.get("OPMAP_COMMIT") or _archived() or _git_head()


def _archived() -> Optional[str]:
    try:
        text = COMMIT_FILE.read_text().strip()
    except OSError:
        return None
    return text if len(text) == 40 and all(c in "0123456789abcdef" for c in text) else None


def _git_head() -> Optional[str]:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(ceilings=None) -> dict:
    info = hw.detect()
    return {
        "gpu": info.name if info.kind == "cuda" else None,
        "device": info.name,
        "arch": info.arch,
        "sm_count": info.sm_count,
        "driver": info.driver,
        "torch": info.torch,
        "triton": info.triton,
        "cuda": info.cuda,
        "cudnn": info.cudnn,
        "python": info.python,
        "triton_interpret": info.interpreter,
        "commit": git_commit(),
        # the switches that change what runs (OPMAP_PDL, ...): a result
        # file says which variant of the code it timed
        "settings": code_settings(),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ceilings": ceilings.as_dict() if ceilings is not None else None,
        "packages": optional_packages(),
        # host-bound figures (an eager prefill's launches, HF eager decode, compile times) follow
        # the host CPU: two H200 runs whose prefill path had not changed differed markedly in its host
        # time (docs/engine.md, "Prefill graphs")
        "host_cpu": host_cpu(),
    }


def host_cpu() -> str:
    """The host CPU's model name and core count ("" where /proc/cpuinfo has no model name)."""
    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores" if name else ""


# Optional packages that change what the selector picks (FlashInfer serves sm90 prefill when it is
# there) or what a run can do: a result file says which were importable.
OPTIONAL = (("flashinfer", "flashinfer-python"), ("xgrammar", "xgrammar"), ("transformers", "transformers"))


def optional_packages() -> dict:
    """{module: version, "installed" (no distribution metadata) or None (not importable)}, found
    without importing them."""
    out = {}
    for mod, dist in OPTIONAL:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out[mod] = None
            continue
        try:
            out[mod] = version(dist)
        except PackageNotFoundError:
            out[mod] = "installed"
    return out


def gpu_slug(name: str) -> str:
    s = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "gpu"


BASELINES = "bench/baselines"


def baseline_dir(out_dir: str, gpu: str) -> Path:
    """<out_dir>/<gpu slug>: where a GPU's figures live, one file per op family, overwritten by
    each run at the current defaults (bench/baselines/h200/attention.json, ...)."""
    d = Path(out_dir) / gpu_slug(gpu)
    d.mkdir(parents=True, exist_ok=True)
    return d


def result_stem(out_dir: str, name: str) -> Path:
    """<out_dir>/<name> for a result file that is not a baseline (a check run's JSON)."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    return d / re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")
