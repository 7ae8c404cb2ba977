"""The report's pictures and its HTML: the roofline of its benchmark cases (measured on this GPU,
or, for a planned report, the baseline cases its expected times come from), the time per operator
category and phase (the engine's profile where it ran, else the expected time of each operator
call), and report.html, the Markdown with the pictures inline (one file to send)."""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Optional

from opmap.harness.bench.report import roofline_png
from opmap.harness.plan import BASELINES, GPU_OF_ARCH


def _plt():
    # heavy: matplotlib, for the pictures only
    import matplotlib

    matplotlib.use("Agg")
    # pyplot after the backend is chosen
    import matplotlib.pyplot as plt

    return plt


def _baseline_ceilings(arch: str) -> Optional[dict]:
    gpu = GPU_OF_ARCH.get(arch)
    folder = BASELINES / gpu if gpu else None
    for f in sorted(folder.glob("*.json")) if folder and folder.is_dir() else []:
        c = (json.loads(f.read_text()).get("environment") or {}).get("ceilings")
        if c:
            return c
    return None


def roofline(doc: dict, path: Path) -> Optional[str]:
    """None when written, else why not."""
    b = doc.get("bench") or {}
    if b.get("results"):
        return roofline_png(b, path)
    rows = {(r["expected"]["case"], r["expected"]["provider"]): r["expected"]
            for ph in doc["operators"].values() for r in ph if r.get("expected")}
    c = _baseline_ceilings(doc["arch"])
    if not rows or not c:
        return "no benchmark ran and no baseline case backs an expected time"
    env = {"ceilings": c, "gpu": f"{doc['baseline_gpu'].upper()} baseline, the cases behind the expected times",
           "date": doc["environment"]["date"]}
    return roofline_png({"environment": env, "results": list(rows.values())}, path)


PHASE_COLOURS = {"prefill": "C0", "decode": "C1", "mixed": "C2"}  # the report's step maps


def phases(doc: dict, path: Path) -> Optional[str]:
    """Stacked time per category and phase (the engine's profile), else the expected time of each
    operator call per phase (the nearest baseline case)."""
    prof = ((doc.get("engine") or {}).get("profile") or {}).get("phases")
    plt = _plt()
    if prof:
        fig, ax = plt.subplots(figsize=(8, 4))
        cats = sorted({c for p in prof.values() for c in p["categories"]})
        bottom = [0.0] * len(prof)
        for c in cats:
            vals = [p["categories"].get(c, 0.0) / max(p["steps"], 1) for p in prof.values()]
            ax.bar(list(prof), vals, bottom=bottom, label=c)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("GPU ms per step")
        ax.set_title("engine profile: GPU time per operator category and phase")
        ax.legend(fontsize=7)
    else:
        # the expected time of each call at the model's shape (plan.scaled); a call without one
        # has no bar, and the operator map says why
        items = [(ph, r["label"], r["scaled"]["us"]) for ph, rs in doc["operators"].items() for r in rs
                 if (r.get("scaled") or {}).get("us") is not None]
        if not items:
            return "the engine did not run here and no operator has an expected time"
        fig, ax = plt.subplots(figsize=(8, 0.25 * len(items) + 1.2))
        labels = [f"{ph}: {lb}" for ph, lb, _ in items]
        ax.barh(labels, [us for _, _, us in items], color=[PHASE_COLOURS.get(ph, "C3") for ph, _, _ in items])
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel(f"expected us per call ({doc['baseline_gpu'].upper()} baseline cases scaled to this model's "
                      "shapes; calls without an estimate left out)")
        ax.set_title("expected time of each operator call, per phase")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write(doc: dict, out: Path) -> dict:
    """{name: file name, or the reason it is missing} for roofline.png and phases.png in ``out``."""
    figs = {}
    try:
        _plt()
    except ImportError:
        return {n: "matplotlib is not installed" for n in ("roofline", "phases")}
    for name, fn in (("roofline", roofline), ("phases", phases)):
        why = fn(doc, out / f"{name}.png")
        figs[name] = f"{name}.png" if why is None else f"not drawn: {why}"
    return figs


def to_html(md: str, out: Path, title: str) -> str:
    """The Markdown as one self-contained HTML page (the PNGs it links inline, as data URIs)."""
    # markdown: for report.html only
    import markdown

    body = markdown.markdown(md, extensions=["tables", "fenced_code"])

    def inline(m):
        f = out / m.group(1)
        if not f.is_file():
            return m.group(0)
        return f'src="data:image/png;base64,{base64.b64encode(f.read_bytes()).decode()}"'

    body = re.sub(r'src="([\w.-]+\.png)"', inline, body)
    css = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;line-height:1.4}"
           "table{border-collapse:collapse;font-size:13px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 6px;"
           "vertical-align:top}th{background:#f4f4f4}code{background:#f4f4f4;padding:0 3px}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{css}</style></head>"
            f"<body>{body}</body></html>\n")
