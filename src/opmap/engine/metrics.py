"""Run metrics: TTFT / TPOT percentiles, throughput, and the bandwidth decode achieved.

Decode bandwidth: each decode step reads every weight once (MoE: the experts the batch routes
to are not tracked, so all of them are counted: an upper bound on bytes) plus the KV of every
sequence; bytes over the measured step time (host wall clock between the step's start and its
sampled tokens reaching the host, so launch and sampling overheads are included).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


def percentile(xs: list, q: float):
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class StepStats:
    steps: dict = field(default_factory=lambda: {"prefill": 0, "mixed": 0, "decode": 0})
    seconds: dict = field(default_factory=lambda: {"prefill": 0.0, "mixed": 0.0, "decode": 0.0})
    decode_kv_tokens: int = 0  # sum over decode steps of the KV tokens read
    decode_rows: int = 0
    preemptions: int = 0
    # Host time per phase and part of a step (HOST_PARTS), seconds summed over the steps.
    host: dict = field(default_factory=dict)
    longest: dict = field(default_factory=dict)  # phase -> the longest step (seconds)

    def add(self, phase: str, seconds: float, kv_tokens: int = 0, rows: int = 0) -> None:
        self.steps[phase] += 1
        self.seconds[phase] += seconds
        self.longest[phase] = max(self.longest.get(phase, 0.0), seconds)
        if phase == "decode":
            self.decode_kv_tokens += kv_tokens
            self.decode_rows += rows

    def add_host(self, phase: str, parts: dict) -> None:
        mine = self.host.setdefault(phase, {})
        for k, v in parts.items():
            mine[k] = mine.get(k, 0.0) + v

    def host_ms_per_step(self) -> dict:
        return {ph: {k: v / self.steps[ph] * 1e3 for k, v in parts.items()}
                for ph, parts in self.host.items() if self.steps.get(ph)}


class GcTimer:
    """A ``gc.callbacks`` hook: how many collections of each generation ran and how long they took
    (a full collection of a large heap lands inside whichever engine step triggered it)."""

    def __init__(self):
        self.count, self.seconds = [0, 0, 0], [0.0, 0.0, 0.0]
        self._t0 = None
        self._clock = time.perf_counter  # bound now: the hook also runs during interpreter shutdown

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = self._clock()
        elif self._t0 is not None:
            dt = self._clock() - self._t0
            g = min(int(info.get("generation", 2)), 2)
            self.count[g] += 1
            self.seconds[g] += dt
            self._t0 = None

    def snapshot(self) -> tuple:
        return list(self.count), list(self.seconds)

    def since(self, snap: tuple) -> dict:
        c0, s0 = snap
        return {"collections": [a - b for a, b in zip(self.count, c0)],
                "ms": [round((a - b) * 1e3, 3) for a, b in zip(self.seconds, s0)]}


# The parts of an engine step's host time, in step order. "wait" is the host blocked on the GPU
# (reading a step's sampled tokens back); everything else is host work. When the host work of a
# decode step exceeds the GPU time of a step, the GPU waits for the host.
HOST_PARTS = ("schedule", "forward", "grammar", "sample", "readback", "wait")


def host_line(parts: dict) -> str:
    """One phase's host ms per step by part: work, waiting, and the parts."""
    work = sum(v for k, v in parts.items() if k != "wait")
    items = ", ".join(f"{k} {parts[k]:.3f}" for k in HOST_PARTS if parts.get(k))
    return f"{work:.3f} ms of work + {parts.get('wait', 0.0):.3f} ms waiting on the GPU ({items} ms)"


def format_host(per_step: dict) -> list:
    return [f"{ph} host per step: {host_line(parts)}" for ph, parts in per_step.items()]


def summarize(outputs: list, wall_s: float, stats: StepStats, weight_bytes, kv_bytes_per_token: float) -> dict:
    """``weight_bytes(rows)``: the weight bytes a decode step of ``rows`` sequences reads
    (ModelConfig.decode_weight_bytes; for MoE it grows with the rows)."""
    ok = [o for o in outputs if o.error is None]
    ttft = [o.ttft * 1e3 for o in ok if o.ttft is not None]
    tpot = [o.tpot * 1e3 for o in ok if o.tpot is not None]
    out_tok = sum(len(o.token_ids) for o in ok)
    in_tok = sum(len(o.prompt_token_ids) for o in ok)
    d = {
        "requests": len(outputs), "errors": len(outputs) - len(ok),
        "input_tokens": in_tok, "output_tokens": out_tok, "wall_s": wall_s,
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99),
        "output_tok_per_s": out_tok / wall_s if wall_s > 0 else None,
        "total_tok_per_s": (out_tok + in_tok) / wall_s if wall_s > 0 else None,
        "steps": dict(stats.steps), "step_seconds": dict(stats.seconds), "preemptions": stats.preemptions,
        "host_ms_per_step": stats.host_ms_per_step(),
        "step_ms_max": {k: v * 1e3 for k, v in stats.longest.items()},
    }
    n, t = stats.steps["decode"], stats.seconds["decode"]
    if n and t > 0:
        d["decode_step_ms"] = t / n * 1e3
        d["decode_rows_mean"] = stats.decode_rows / n
        d["decode_weight_tbps"] = weight_bytes(d["decode_rows_mean"]) * n / t / 1e12
        d["decode_kv_tbps"] = kv_bytes_per_token * stats.decode_kv_tokens / t / 1e12
    return d


def format_summary(d: dict, gpu: bool = True) -> list:
    """``gpu=False`` (a CPU run): no bandwidth figures and no "waiting on the GPU", which say
    nothing there."""
    f = lambda v, unit="", nd=2: "n/a" if v is None else f"{v:.{nd}f}{unit}"  # noqa: E731
    lines = [
        f"requests {d['requests']} ({d['errors']} errors), {d['input_tokens']} prompt + {d['output_tokens']} "
        f"generated tokens in {d['wall_s']:.2f} s",
        f"TTFT p50 {f(d['ttft_ms_p50'], ' ms')}  p99 {f(d['ttft_ms_p99'], ' ms')}",
        f"TPOT p50 {f(d['tpot_ms_p50'], ' ms')}  p99 {f(d['tpot_ms_p99'], ' ms')}",
        f"throughput {f(d['output_tok_per_s'], ' tok/s', 1)} generated, {f(d['total_tok_per_s'], ' tok/s', 1)} total",
        "steps: " + ", ".join(f"{k} {v} ({d['step_seconds'][k]:.2f} s)" for k, v in d["steps"].items())
        + f"; preemptions {d['preemptions']}",
    ]
    if "decode_step_ms" in d and gpu:
        lines.append(f"decode: {d['decode_step_ms']:.3f} ms/step, weights read at {d['decode_weight_tbps']:.3f} TB/s "
                     f"(at {d['decode_rows_mean']:.1f} rows a step; MoE: the experts they are expected to hit), "
                     f"KV at {d['decode_kv_tbps']:.3f} TB/s (host wall clock per step)")
    elif "decode_step_ms" in d:
        lines.append(f"decode: {d['decode_step_ms']:.3f} ms/step")
    if gpu:
        lines += format_host(d.get("host_ms_per_step") or {})
    else:
        lines += [f"{ph} host per step: {sum(v for k, v in parts.items() if k != 'wait'):.3f} ms"
                  for ph, parts in (d.get("host_ms_per_step") or {}).items()]
    if d.get("step_ms_max"):
        lines.append("longest step: " + ", ".join(f"{k} {v:.3f} ms" for k, v in d["step_ms_max"].items()))
    if d.get("gc"):
        n, ms = d["gc"]["collections"], d["gc"]["ms"]
        lines.append(f"garbage collection: {n[0]}/{n[1]}/{n[2]} collections of generation 0/1/2, "
                     f"{sum(ms):.3f} ms in all")
    return lines
