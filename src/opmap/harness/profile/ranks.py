"""Several ranks' traces of one run (tensor / expert parallel): each rank on the operator map, the
communication category per rank with the share of it that overlaps compute on the same rank, the
slowest rank of each step (stragglers), the categories merged over ranks, and the diagnosis."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from opmap.harness.profile.analyze import analyze, category_of, intersect
from opmap.harness.profile.analyze import format_lines as one
from opmap.harness.profile.steps import busy, measure, steps_of, union
from opmap.harness.profile.trace import Trace, load

SUFFIXES = (".json", ".json.gz", ".sqlite")


def trace_files(paths: list) -> list:
    """The trace files of --trace arguments: files as given, folders by their trace files (sorted)."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(str(f) for f in p.iterdir() if f.is_file() and f.name.endswith(SUFFIXES))
        else:
            out.append(str(p))
    return out


def communication(trace: Trace) -> dict:
    """ms of communication (its union over streams), the share of it overlapped by compute on the
    same rank, and the libraries."""
    comm, other, libs = [], [], Counter()
    for k in trace.kernels:
        cat, lib, _ = category_of(k)
        (comm if cat == "communication" else other).append((k.ts, k.ts + k.dur))
        if cat == "communication":
            libs[lib] += k.dur
    c, o = union(comm), union(other)
    total = measure(c)
    return {"ms": round(total / 1e3, 4), "overlap": round(intersect(c, o) / total, 4) if total else 0.0,
            "share": round(total / (measure(union(comm + other)) or 1.0), 4), "libraries": list(libs)}


def analyze_ranks(paths: list, progress: bool = False) -> dict:
    traces = [load(p, progress=progress) for p in paths]
    per = []
    for i, t in enumerate(traces):
        steps = steps_of(t)
        r = analyze(t, steps=steps)
        r["rank"] = i
        r["communication"] = communication(t)
        r["step_ms"] = [round(s["wall_ms"], 4) for s in steps]
        r["busy_ms"] = [round(busy(s["kernels"]) / 1e3, 4) for s in steps]
        per.append(r)
    n = min(len(r["step_ms"]) for r in per) if per else 0
    slowest = Counter()
    lag = []
    for s in range(n):
        times = [r["busy_ms"][s] for r in per]
        slowest[max(range(len(per)), key=lambda i: times[i])] += 1
        lag.append(max(times) - min(times))
    merged: dict = {}
    for r in per:
        for ph, p in r["phases"].items():
            m = merged.setdefault(ph, Counter())
            m.update(p["categories"])
    res = {"ranks": per, "steps": n, "slowest": dict(slowest),
           "lag_ms": round(sum(lag) / n, 4) if n else 0.0,
           "merged": {ph: {c: round(v, 4) for c, v in m.most_common()} for ph, m in merged.items()}}
    res["diagnosis"] = rules(res)
    return res


def rules(res: dict) -> list:
    out = []
    for r in res["ranks"]:
        c = r["communication"]
        if c["share"] > 0.2:
            out.append(f"rank {r['rank']}: communication takes {c['share']:.0%} of the busy time ({c['ms']:.3f} ms, "
                       f"{', '.join(c['libraries'])}), {c['overlap']:.0%} of it overlapped with compute -> the TP/EP "
                       "layout and overlapping the collectives with compute, not the attention kernel")
    if res["steps"] and len(res["ranks"]) > 1:
        rank, k = max(res["slowest"].items(), key=lambda x: x[1])
        if k > res["steps"] / 2 and res["lag_ms"] > 0:
            out.append(f"rank {rank} is the slowest in {k} of {res['steps']} steps (the ranks' busy times differ by "
                       f"{res['lag_ms']:.3f} ms a step on average) -> a straggler: its experts' load, or its device")
    return out


def format_lines(res: dict) -> list:
    lines = []
    for r in res["ranks"]:
        c = r["communication"]
        lines.append(f"== rank {r['rank']}: communication {c['ms']:.3f} ms ({c['share']:.0%} of the busy time, "
                     f"{c['overlap']:.0%} overlapped with compute)")
        lines += [ln for ln in one(r) if not ln.startswith("diagnosis: ")]
    lines.append(f"== merged over {len(res['ranks'])} ranks ({res['steps']} steps each)")
    for ph, cats in res["merged"].items():
        total = sum(cats.values()) or 1.0
        lines.append(f"[{ph}] " + ", ".join(f"{c} {v / total:.0%}" for c, v in cats.items()))
    if res["ranks"] and res["steps"]:
        lines.append("slowest rank per step: " + ", ".join(f"rank {k}: {v}" for k, v in sorted(res["slowest"].items()))
                     + f"; busy times differ by {res['lag_ms']:.3f} ms a step on average")
    diag = res["diagnosis"] + [f"rank {r['rank']}: {d}" for r in res["ranks"] for d in r["diagnosis"]]
    return lines + [f"diagnosis: {d}" for d in diag]
