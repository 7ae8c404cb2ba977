"""Benchmark output: the environment block, the JSON result file, the Markdown table and the
roofline PNG. Only measured numbers go in; nothing here invents or fills a figure."""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional


def git_commit() -> Optional[str]:
    """The commit named in OPMAP_COMMIT, else HEAD of the checkout this package runs from (+dirty).
    The variable comes first: the GPU machine's copy of the working tree carries a .git whose HEAD
    is stale (the sixth session's files all read the previous session's commit)."""
    return os.environ.get("OPMAP_COMMIT") or _git_head()


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
    from ..check.fingerprint import code_settings
    from ..hw import detect

    info = detect()
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
        # the switches that change what runs (OPMAP_PDL, OPMAP_GEMM_SPLIT_BELOW, ...): a result
        # file says which variant of the code it timed
        "settings": code_settings(),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ceilings": ceilings.as_dict() if ceilings is not None else None,
    }


def gpu_slug(name: str) -> str:
    s = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "gpu"


def result_stem(out_dir: str, gpu: str) -> Path:
    """bench/results/<date>-<gpu>; a second run on the same day gets -2, -3, ... (never overwrites)."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    base = f"{datetime.date.today().isoformat()}-{gpu_slug(gpu)}"
    stem, i = d / base, 2
    while stem.with_suffix(".json").exists():
        stem, i = d / f"{base}-{i}", i + 1
    return stem


def to_markdown(doc: dict) -> str:
    env = doc["environment"]
    c = env.get("ceilings") or {}
    out = [f"# opmap bench: {env.get('gpu') or env.get('device')} ({env.get('arch')})", "",
           f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, driver {env['driver']}, "
           f"commit `{env['commit']}`, {env['date']}", "",
           f"Command: `{env['command']}`", ""]
    if c:
        out += [f"Ceilings (measured on this GPU): read {c['read_tbps']} TB/s, copy {c['copy_tbps']} TB/s, "
                f"bf16 GEMM {c['bf16_tflops']} TFLOP/s.", ""]
    out += ["| op | case | provider | median us | TB/s | TFLOP/s | frac of ceiling | note |",
            "|---|---|---|---:|---:|---:|---:|---|"]
    f = lambda v, fmt: "" if v is None else format(v, fmt)  # noqa: E731
    for r in doc["results"]:
        prov = r["provider"] + (" (selected)" if r.get("selected") else "")
        out.append(f"| {r['op']} | `{r['case']}` | {prov} | {r['median_us']:.2f} | {f(r['tbps'], '.3f')} | "
                   f"{f(r['tflops'], '.1f')} | {f(r['frac_of_ceiling'], '.1%')} | {r.get('note', '')} |")
    if doc.get("skipped"):
        out += ["", "Not timed:", ""]
        out += [f"- {s['op']} `{s['case']}` {s['provider']}: {s['reason']}" for s in doc["skipped"]]
    return "\n".join(out) + "\n"


def roofline_png(doc: dict, path: Path) -> Optional[str]:
    """Draw the roofline; returns None when written, else why not."""
    c = (doc["environment"] or {}).get("ceilings")
    if not c:
        return "no ceilings (no GPU)"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    pts = [r for r in doc["results"] if r.get("tflops") and r.get("tbps")]
    if not pts:
        return "no result has both FLOPs and bytes"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ai = [r["tflops"] / r["tbps"] for r in pts]  # flops per byte
    lo, hi = min(ai + [0.1]) / 2, max(ai + [1e3]) * 2
    knee = c["bf16_tflops"] / c["read_tbps"]
    xs = [lo, knee, hi]
    ax.plot(xs, [min(c["bf16_tflops"], c["read_tbps"] * x) for x in xs], "k-", lw=1.5,
            label=f"roof: {c['read_tbps']:.2f} TB/s read, {c['bf16_tflops']:.0f} TFLOP/s bf16")
    provs = sorted({r["provider"] for r in pts})
    cmap = plt.get_cmap("tab10")
    for i, p in enumerate(provs):
        sel = [(a, r["tflops"]) for a, r in zip(ai, pts) if r["provider"] == p]
        ax.scatter([s[0] for s in sel], [s[1] for s in sel], color=cmap(i % 10), label=p, s=22, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per minimal byte)")
    ax.set_ylabel("achieved TFLOP/s")
    env = doc["environment"]
    ax.set_title(f"opmap roofline, {env.get('gpu')} ({env['date'][:10]})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write(doc: dict, out_dir: str, png: bool = True) -> dict:
    """Write <stem>.json, <stem>.md and (optionally) <stem>.png; returns the paths written."""
    stem = result_stem(out_dir, doc["environment"].get("gpu") or "cpu")
    paths = {"json": str(stem.with_suffix(".json")), "markdown": str(stem.with_suffix(".md"))}
    Path(paths["json"]).write_text(json.dumps(doc, indent=1, default=_default))
    Path(paths["markdown"]).write_text(to_markdown(doc))
    if png:
        why = roofline_png(doc, stem.with_suffix(".png"))
        if why is None:
            paths["png"] = str(stem.with_suffix(".png"))
        else:
            paths["png_skipped"] = why
    return paths


def _default(o):
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    return str(o)
