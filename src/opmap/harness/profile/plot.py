"""A timeline PNG of the first steps of a trace: one bar per kernel, coloured by category."""
from __future__ import annotations

from typing import Optional

from opmap.harness.profile import attribute
from opmap.harness.profile.steps import steps_of
from opmap.harness.profile.trace import Trace


def timeline_png(trace: Trace, path: str, steps: int = 4) -> Optional[str]:
    """Draw it; returns None when written, else why not."""
    try:  # matplotlib is optional: the timeline is drawn only where it is installed
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use("Agg"): no display needed
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    chosen = steps_of(trace)[:steps]
    if not chosen:
        return "no GPU kernel in the trace"
    t0 = chosen[0]["ts"]
    attrs = {id(k): a.category for s in chosen for k, a in zip(s["kernels"], attribute.step(s["kernels"]))}
    cats = sorted(set(attrs.values()))
    cmap = plt.get_cmap("tab10")
    color = {c: cmap(i % 10) for i, c in enumerate(cats)}
    fig, ax = plt.subplots(figsize=(11, 2.8))
    for s in chosen:
        for k in s["kernels"]:
            ax.barh(0, k.dur / 1e3, left=(k.ts - t0) / 1e3, color=color[attrs[id(k)]], height=0.6)
        ax.axvline((s["ts"] - t0) / 1e3, color="k", lw=0.5, alpha=0.4)
    ax.set_yticks([])
    ax.set_xlabel("ms from the first step's start")
    ax.set_title(f"GPU kernels of the first {len(chosen)} steps")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=color[c]) for c in cats], labels=cats, fontsize=7,
              loc="upper right", ncol=min(len(cats), 5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
