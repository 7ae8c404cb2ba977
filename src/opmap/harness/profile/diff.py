"""Which operator moved: two analyses of the same workload (``opmap profile --trace AFTER --baseline
BEFORE``), per phase: the step time before and after and its change explained by the categories
(GPU busy per category, plus the GPU's idle time), the libraries each category ran, the kernels
that appeared or vanished (a backend switch, FA3 -> FlashInfer), and the share of GPU time replayed
from CUDA graphs (a lost graph shows as that share dropping and the idle time growing)."""
from __future__ import annotations

import re

_FAMILY = re.compile(r"^(?:void )?([^<(>]*)")
# Launch wrappers whose first template argument is the kernel (CUTLASS's, FA3's arch guard)
_WRAPPER = re.compile(r"^(?:void )?(?:cutlass::device_kernel<|cutlass::Kernel2?<|flash::enable_sm\w+<)+")


def family(name: str) -> str:
    """A kernel's name without its launch wrapper, template arguments, parameters and Inductor's
    serial number: FA3's kernel is flash::FlashAttnFwdSm90, whatever its tiles."""
    name = _WRAPPER.sub("", name.replace("(anonymous namespace)::", ""))
    m = _FAMILY.match(name)
    return re.sub(r"_\d+$", "", (m.group(1) if m else name).strip()) or name


def _per_step(p: dict, key: str) -> float:
    return p.get(key, 0.0) / max(p["steps"], 1)


def _families(p: dict) -> dict:
    out: dict = {}
    for name, ms in p.get("kernel_ms", {}).items():
        f = family(name)
        out[f] = out.get(f, 0.0) + ms / max(p["steps"], 1)
    return out


def compare(before: dict, after: dict, min_share: float = 0.005) -> dict:
    """Per phase present in both: ms per step before / after (wall, busy, idle, each category),
    libraries per category, kernel families that appeared or vanished (those above ``min_share`` of
    the phase's busy time), the graph-replayed share."""
    out = {}
    for ph in [p for p in after["phases"] if p in before["phases"]]:
        b, a = before["phases"][ph], after["phases"][ph]
        cats = list(dict.fromkeys([*b["categories"], *a["categories"]]))
        rows = {c: (b["categories"].get(c, 0.0) / max(b["steps"], 1), a["categories"].get(c, 0.0) / max(a["steps"], 1))
                for c in cats}
        fb, fa = _families(b), _families(a)
        floor_b, floor_a = min_share * _per_step(b, "gpu_ms"), min_share * _per_step(a, "gpu_ms")
        libs = {c: (list(b["libraries"].get(c, {})), list(a["libraries"].get(c, {}))) for c in cats
                if set(b["libraries"].get(c, {})) != set(a["libraries"].get(c, {}))}
        out[ph] = {
            "steps": (b["steps"], a["steps"]),
            "wall_ms": (_per_step(b, "wall_ms"), _per_step(a, "wall_ms")),
            "busy_ms": (_per_step(b, "gpu_ms"), _per_step(a, "gpu_ms")),
            "idle_ms": (_per_step(b, "idle_ms"), _per_step(a, "idle_ms")),
            "categories": rows,
            "libraries": libs,
            "appeared": sorted(((f, ms) for f, ms in fa.items() if f not in fb and ms >= floor_a), key=lambda x: -x[1]),
            "vanished": sorted(((f, ms) for f, ms in fb.items() if f not in fa and ms >= floor_b), key=lambda x: -x[1]),
            "graph_share": (b.get("graph_ms", 0.0) / (b["gpu_ms"] or 1), a.get("graph_ms", 0.0) / (a["gpu_ms"] or 1)),
        }
    return {"before": before["source"], "after": after["source"], "phases": out,
            "only_before": [p for p in before["phases"] if p not in after["phases"]],
            "only_after": [p for p in after["phases"] if p not in before["phases"]]}


def _delta(x: tuple) -> str:
    return f"{x[0]:.3f} -> {x[1]:.3f} ({x[1] - x[0]:+.3f})"


def format_lines(d: dict) -> list:
    lines = [f"before: {d['before']}", f"after:  {d['after']}"]
    for ph, p in d["phases"].items():
        wall, busy, idle = p["wall_ms"], p["busy_ms"], p["idle_ms"]
        moved = sorted(((c, v) for c, v in p["categories"].items() if abs(v[1] - v[0]) > 1e-4),
                       key=lambda x: -abs(x[1][1] - x[1][0]))
        why = ", ".join(f"{c} {v[1] - v[0]:+.3f}" for c, v in moved[:4]) or "no category"
        lines.append(f"[{ph}] {p['steps'][0]} -> {p['steps'][1]} steps; step {_delta(wall)} ms: GPU busy "
                     f"{busy[1] - busy[0]:+.3f} ({why}), GPU idle {idle[1] - idle[0]:+.3f}")
        for c, v in sorted(p["categories"].items(), key=lambda x: -max(x[1])):
            libs = p["libraries"].get(c)
            switch = f"  [{', '.join(libs[0]) or 'none'} -> {', '.join(libs[1]) or 'none'}]" if libs else ""
            lines.append(f"  {c:<14} {_delta(v)} ms/step{switch}")
        for what in ("vanished", "appeared"):
            for f, ms in p[what][:6]:
                lines.append(f"  {what:<9} {ms:8.3f} ms/step  {f[:90]}")
        g = p["graph_share"]
        if max(g) > 0 and abs(g[1] - g[0]) > 0.05:
            lines.append(f"  CUDA graphs: {g[0]:.0%} -> {g[1]:.0%} of GPU time replayed by cudaGraphLaunch"
                         + (" (graphs lost: the host now launches each kernel)" if g[1] < 0.05 else ""))
    for key, word in (("only_before", "only before"), ("only_after", "only after")):
        if d[key]:
            lines.append(f"phases {word}: {', '.join(d[key])}")
    return lines
