"""Benchmark output: the environment block, the JSON result file, the Markdown table and the
roofline PNG. Only measured numbers go in; nothing here invents or fills a figure."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from opmap.harness.output import baseline_dir


def to_markdown(doc: dict) -> str:
    env = doc["environment"]
    c = env.get("ceilings") or {}
    title = f"opmap bench, {doc['family']}" if doc.get("family") else "opmap bench"
    out = [f"# {title}: {env.get('gpu') or env.get('device')} ({env.get('arch')})", "",
           f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, driver {env['driver']}, "
           f"commit `{env['commit']}`, {env['date']}", "",
           f"Command: `{env['command']}`", ""]
    if env.get("host_cpu"):  # absent from files written before the environment recorded it
        out += [f"Host CPU: {env['host_cpu']}.", ""]
    pk = env.get("packages")
    if pk:  # absent from files written before the environment recorded them
        out += ["Optional packages: " + ", ".join(f"{m} {v or 'not installed'}" for m, v in pk.items()) + ".", ""]
    if c:
        out += [f"Ceilings (measured on this GPU): read {c['read_tbps']} TB/s, copy {c['copy_tbps']} TB/s, "
                f"bf16 GEMM {c['bf16_tflops']} TFLOP/s.", ""]
    if doc.get("quick"):
        out += ["The quick grid (`--quick`).", ""]
    if doc.get("not_at_model_widths"):
        out += [f"No case at {doc.get('model')}'s own widths for {', '.join(doc['not_at_model_widths'])}: "
                "their rows are at other models' widths.", ""]
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
        # heavy and optional: matplotlib, for the roofline only
        import matplotlib

        matplotlib.use("Agg")
        # pyplot after the backend is chosen
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


def family_of(op: str, module: str) -> str:
    """The baseline file a result belongs to: its cases module, with the MLA ops and the KV append
    in files of their own."""
    if op.startswith("attention.mla") or (module == "mla" and op != "kv_append"):
        return "mla"
    if op == "kv_append":
        return "kv_append"
    return module


def split_by_family(doc: dict) -> dict:
    """{family: document}: the run's environment with the results and skips of that family."""
    fams = {}
    for key in ("results", "skipped"):
        for r in doc.get(key, []):
            fams.setdefault(r.get("family") or "other", {"results": [], "skipped": []})[key].append(r)
    out = {f: {**{k: v for k, v in doc.items() if k not in ("results", "skipped")}, "family": f, **parts}
           for f, parts in fams.items()}
    for sub in out.values():  # a family's file names only its own ops off the model's widths
        ops = {r["op"] for key in ("results", "skipped") for r in sub[key]}
        if sub.get("not_at_model_widths"):
            sub["not_at_model_widths"] = [o for o in sub["not_at_model_widths"] if o in ops]
    return out


def write(doc: dict, out_dir: str, png: bool = True) -> dict:
    """Write <out_dir>/<gpu>/<family>.json, .md and (optionally) .png for every family the run
    timed, replacing what was there; returns {family: paths written}."""
    d = baseline_dir(out_dir, doc["environment"].get("gpu") or "cpu")
    written = {}
    for fam, sub in sorted(split_by_family(doc).items()):
        stem = d / fam
        paths = {"json": str(stem.with_suffix(".json")), "markdown": str(stem.with_suffix(".md"))}
        Path(paths["json"]).write_text(json.dumps(sub, indent=1, default=_default) + "\n")
        Path(paths["markdown"]).write_text(to_markdown(sub))
        if png:
            why = roofline_png(sub, stem.with_suffix(".png"))
            if why is None:
                paths["png"] = str(stem.with_suffix(".png"))
            else:
                paths["png_skipped"] = why
        written[fam] = paths
    return written


def _default(o):
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    return str(o)
