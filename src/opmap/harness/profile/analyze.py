"""Any engine's trace on the operator map: the trace split into engine steps (``steps``), each
kernel attributed to an operator category with the evidence behind it (``attribute``), then per
phase the GPU time per category (with its evidence and libraries), the time no evidence supports,
idle time, top kernels, the facts the diagnosis rules need, and the rules (``rules``)."""
from __future__ import annotations


import functools
import re
import statistics
from collections import Counter, defaultdict

from opmap.harness.profile import attribute
from opmap.harness.profile import ours
from opmap.harness.profile import rules as diagnosis
from opmap.harness.profile import symbols
from opmap.harness.profile.steps import busy, common_launches, grid_medians, label, measure, steps_of, union
from opmap.harness.profile.trace import Trace

_OP_BACKEND = re.compile(r"^opmap::(\w+)::[^:]*::([\w.-]+)$")
_COPY = re.compile(r"(?i)memcpy|memset|copy|cat|gather|index|scatter|fill|reshape_and_cache|concat_and_cache|append")


def category_of(k) -> tuple[str, str, str]:
    """(category, library, evidence) of a kernel from what it carries alone (a step's motifs aside)."""
    a = attribute.of(k)
    return a.category, a.library, a.evidence


@functools.lru_cache(maxsize=65536)
def opmap_backend(name: str, ranges: tuple):
    """"op/backend" of a kernel opmap's engine ran: the innermost operator range open at its launch
    (``opmap::<op>::<label>::<backend>``), else the registry's owners of its symbol (a replayed CUDA
    graph has no ranges); None for a kernel that is not opmap's."""
    for r in reversed(ranges):
        m = _OP_BACKEND.match(r)
        if m:
            return f"{m.group(1)}/{m.group(2)}"
    own = ours.owners(name)
    return ", ".join(dict.fromkeys(f"{o.op}/{o.backend}" for o in own)) if own else None


def _new_phase() -> dict:
    return {"steps": 0, "gpu_ms": 0.0, "wall_ms": 0.0, "idle_ms": 0.0, "categories": Counter(),
            "evidence": defaultdict(Counter), "libraries": defaultdict(Counter), "kernels": Counter(),
            "launches": Counter(), "confidence": Counter(), "opmap": Counter(), "graph_ms": 0.0,
            "sampler_sorts": Counter(), "random_steps": 0, "fallbacks": [], "fallback_count": 0, "lowp_steps": 0,
            "kv_copy_ms": 0.0,
            "moe_gemms": Counter(), "comm_ms": 0.0, "comm_exposed_ms": 0.0}


def _step_facts(p: dict, ks: list, attrs: list) -> None:
    """What the rules need from one step: the sampler stage's sorts and whether it draws at random,
    dequantise kernels feeding a dense GEMM and whether any low-precision GEMM ran, the MoE's GEMM
    launches by kind."""
    stage = attribute.sampler_stage(ks, attrs)
    for i in stage:
        if symbols.is_sort(ks[i].name):
            p["sampler_sorts"][ks[i].name[:80]] += 1
    p["random_steps"] += attribute.random_sampling(ks, attrs)
    lowp = any(symbols.low_precision_gemm(k.name) for k in ks)
    p["lowp_steps"] += lowp
    gemm = [i for i, a in enumerate(attrs) if a.category in ("GEMM", "MoE") and symbols.lookup(ks[i].name).category
            in ("GEMM", "MoE")]
    for i, k in enumerate(ks):
        if not lowp and symbols.dequantiser(k.name):
            nxt = next((j for j in gemm if j > i), None)
            if nxt is not None and nxt - i <= 3 and _same_layer(k, ks[nxt]):
                p["fallback_count"] += 1
                if len(p["fallbacks"]) < 5:  # examples for the rule's line
                    p["fallbacks"].append((k.name[:60], ks[nxt].name[:60]))
    for i in gemm:
        if attrs[i].category == "MoE":
            lc = (ks[i].launcher or "").replace("aten::", "")
            kind = ("grouped" if "grouped" in ks[i].name.lower() or lc == "_grouped_mm" else
                    "batched" if lc in ("bmm", "baddbmm") else "per-expert" if lc in ("mm", "addmm", "linear", "matmul")
                    else "fused")
            p["moe_gemms"][kind] += 1


def _communication(ks: list, attrs: list) -> tuple[float, float]:
    """ms of a step's communication (its union over streams) and of the part of it no other kernel
    overlaps (exposed): an expert-parallel run overlaps its dispatch / combine with compute."""
    comm = union((k.ts, k.ts + k.dur) for k, a in zip(ks, attrs) if a.category == "communication")
    if not comm:
        return 0.0, 0.0
    rest = union((k.ts, k.ts + k.dur) for k, a in zip(ks, attrs) if a.category != "communication")
    total = measure(comm)
    return total / 1e3, (total - intersect(comm, rest)) / 1e3


def intersect(x: list, y: list) -> float:
    """Time two sorted lists of disjoint spans share."""
    i = j = 0
    t = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        t += max(hi - lo, 0.0)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return t


def _same_layer(a, b) -> bool:
    """Two kernels of one layer: the same innermost module frame where the trace has them."""
    fa = [r for r in a.ranges if r.startswith(("nn.Module: ", "opmap::"))]
    fb = [r for r in b.ranges if r.startswith(("nn.Module: ", "opmap::"))]
    return not fa or not fb or fa[-1] == fb[-1]


def analyze(trace: Trace, top: int = 5, steps=None) -> dict:
    """The per-phase breakdown (times in ms) with ``unattributed`` (the fraction of busy time no
    evidence supports), ``evidence``, ``backends`` and ``diagnosis`` (``steps``: the trace's
    ``steps_of``, where the caller has them already)."""
    steps = steps_of(trace) if steps is None else steps
    median_busy = statistics.median([busy(s["kernels"]) for s in steps]) if len(steps) > 1 else 0.0
    medians = grid_medians(steps)
    common = common_launches(steps)
    phases: dict = {}
    libs: dict = defaultdict(Counter)
    evidence = Counter()
    total = 0.0
    for s in steps:
        wall = s["wall_ms"]
        ph, conf = label(s, median_busy, medians, common)
        p = phases.setdefault(ph, _new_phase())
        p["steps"] += 1
        p["confidence"][conf] += 1
        b = busy(s["kernels"]) / 1e3
        p["gpu_ms"] += b
        p["wall_ms"] += wall
        p["idle_ms"] += max(wall - b, 0.0)
        ks = sorted(s["kernels"], key=lambda k: k.ts)
        attrs = attribute.step(ks)
        _step_facts(p, ks, attrs)
        comm, exposed = _communication(ks, attrs)
        p["comm_ms"] += comm
        p["comm_exposed_ms"] += exposed
        # each kernel's time not covered by an earlier one, so categories add up to the busy time
        end = float("-inf")
        for k, a in zip(ks, attrs):
            t = max(k.ts + k.dur - max(k.ts, end), 0.0) / 1e3
            end = max(end, k.ts + k.dur)
            p["categories"][a.category] += t
            p["evidence"][a.category][a.evidence] += t
            p["libraries"][a.category][a.library] += t
            p["kernels"][k.name[:100]] += t
            p["launches"][k.name[:100]] += 1
            if k.graph:
                p["graph_ms"] += t
            if a.category == "attention" and _COPY.search(k.name):
                p["kv_copy_ms"] += t
            be = opmap_backend(k.name, k.ranges)
            if be:
                p["opmap"][be] += t
            libs[a.category][a.library] += t
            evidence[a.evidence] += t
            total += t
    out_phases = {ph: _phase_out(p, top) for ph, p in phases.items()}
    none = sum(p["categories"].get(attribute.NONE, 0.0) for p in phases.values())
    res = {"source": trace.source, "kind": trace.kind, "kernels": len(trace.kernels), "steps": len(steps),
           "phases": out_phases, "unattributed": round(none / total, 4) if total else 0.0,
           "attributed": round(1 - none / total, 4) if total else 0.0,
           "backends": {c: [lib for lib, _ in v.most_common()] for c, v in libs.items() if c != attribute.NONE},
           "evidence": {k: round(v / total, 4) for k, v in evidence.most_common()} if total else {}}
    res["diagnosis"] = diagnosis.rules(res, trace)
    return res


def _phase_out(p: dict, top: int) -> dict:
    r4 = lambda d: {k: round(v, 4) for k, v in d.most_common()}  # noqa: E731
    return {"steps": p["steps"], "gpu_ms": round(p["gpu_ms"], 4), "idle_ms": round(p["idle_ms"], 4),
            "wall_ms": round(p["wall_ms"], 4), "categories": r4(p["categories"]),
            "evidence": {c: r4(v) for c, v in p["evidence"].items()},
            "libraries": {c: dict(v.most_common()) for c, v in p["libraries"].items()},
            "top_kernels": [[n, round(v, 4)] for n, v in p["kernels"].most_common(top)],
            "kernel_ms": {n: round(v, 5) for n, v in p["kernels"].most_common()},
            "launches": dict(p["launches"]), "label_confidence": dict(p["confidence"]),
            "opmap_backends": r4(p["opmap"]), "graph_ms": round(p["graph_ms"], 4),
            "kv_copy_ms": round(p["kv_copy_ms"], 4), "sampler_sorts": dict(p["sampler_sorts"]),
            "random_steps": p["random_steps"], "lowp_steps": p["lowp_steps"], "fallbacks": p["fallbacks"], "fallback_count": p["fallback_count"],
            "moe_gemms": dict(p["moe_gemms"]), "comm_ms": round(p["comm_ms"], 4),
            "comm_exposed_ms": round(p["comm_exposed_ms"], 4)}


def _evidence(p: dict, cat: str) -> str:
    ev = p["evidence"].get(cat, {})
    total = sum(ev.values()) or 1.0
    return ", ".join(f"{k} {v / total:.0%}" for k, v in ev.items())


def format_lines(res: dict) -> list:
    cpu = res.get("kind") == "chrome-cpu"  # no GPU activity: the host's outermost ops stand for kernels
    what, dev = ("host ops", "host") if cpu else ("kernels", "GPU")
    lines = [f"{res['source']}: {res['kernels']} {what} in {res['steps']} steps "
             f"({res['attributed']:.1%} of {dev} time attributed; evidence: "
             + ", ".join(f"{k} {v:.0%}" for k, v in res["evidence"].items()) + ")"]
    for ph, p in res["phases"].items():
        n = max(p["steps"], 1)
        conf = ", ".join(f"{v} {k}" for k, v in p["label_confidence"].items())
        graph = f", {p['graph_ms'] / (p['gpu_ms'] or 1):.0%} replayed from CUDA graphs" if p.get("graph_ms") else ""
        lines.append(f"[{ph}] {p['steps']} steps (labels: {conf}); {dev} busy {p['gpu_ms'] / n:.3f} ms/step, "
                     f"idle {p['idle_ms'] / n:.3f} ms/step{graph}")
        for cat, ms in p["categories"].items():
            libs = ", ".join(p["libraries"].get(cat, {})) if cat != attribute.NONE else "no evidence"
            lines.append(f"  {cat:<14} {ms / n:9.3f} ms/step {ms / (p['gpu_ms'] or 1):6.1%}  [{libs}]  "
                         f"({_evidence(p, cat)})")
        for name, ms in p["top_kernels"][:3]:
            lines.append(f"    {ms / n:8.3f} ms/step  {name}")
        if p.get("opmap_backends"):
            lines.append("  opmap backends: " + ", ".join(f"{b} {ms / n:.3f}" for b, ms in p["opmap_backends"].items())
                         + " ms/step")
    return lines + [f"diagnosis: {d}" for d in res["diagnosis"]]


def summary_json(res: dict) -> dict:
    """The JSON ``--json`` writes (per phase without the full kernel table)."""
    out = {k: res[k] for k in ("source", "kind", "kernels", "steps", "attributed", "unattributed", "backends",
                               "diagnosis", "evidence")}
    out["phases"] = {ph: {k: v for k, v in p.items() if k not in ("kernel_ms", "launches")}
                     for ph, p in res["phases"].items()}
    return out
