"""A trace's engine steps and their phases: the step ranges where the engine emits them (opmap's,
vLLM's and SGLang's model-runner calls, TensorRT-LLM-style ``execute_context_N(...)_generation_M(...)``
ranges, the profiler's step marks), else the host's token readbacks, else bursts of GPU work; each
step labelled prefill / decode / mixed from its range name, its attention kernels or its GPU time."""
from __future__ import annotations

import bisect
import functools
import re
import statistics
from collections import Counter
from typing import Optional

from opmap.harness.profile import attribute
from opmap.harness.profile.trace import Trace

# Step ranges: opmap's, vLLM's and SGLang's model-runner calls, a context / generation batch, the profiler's step marks.
_STEP = [re.compile(p) for p in (r"^opmap::step::(prefill|decode|mixed)$", r"execute_model", r"^(run_batch|forward_batch)",
                                   r"^execute_context_\d+\(", r"^ProfilerStep#\d+$")]
# "execute_context_1(888_788544)_generation_0(0)": 1 context (prefill) request, 0 generation (decode) requests
_PHASED = re.compile(r"^opmap::step::|^execute_context_\d+\(")
_CTX_GEN = re.compile(r"^execute_context_(\d+)\(.*_generation_(\d+)\(")
# FlashInfer's tensor-core decode (use_tensor_cores=True) launches its prefill kernel without a
# mask (MaskMode 0) on 16-row query tiles; a causal prefill has MaskMode 1.
_DECODE = re.compile(r"(?i)decode|splitkv|split_kv|paged_attention|xqa|mmha|flash_fwd_splitkv|flash_mla|flashmla|"
                     r"unified_attention|BatchPrefillWithPagedKVCacheKernel<\w+, flashinfer::KernelTraits<"
                     r"\(flashinfer::MaskMode\)0, 16u")
# Kernels that serve one phase only; cuDNN / PyTorch SDPA and FlashAttention's plain forward run
# HF's decode steps as well as its prefill, so they say nothing of the phase.
_PREFILL = re.compile(r"(?i)prefill|fmha|RaggedKVCache|_prefill_tma_kernel|context_attention")


@functools.lru_cache(maxsize=65536)
def is_step(name: str) -> bool:
    return any(p.search(name) for p in _STEP)


def steps_of(trace: Trace) -> list[dict]:
    """Engine steps: the step ranges where the engine emits them (kernels by the range open at
    their launch), else bursts of GPU work split at host gaps. Each: name, kernels, ts, end and
    wall_ms (``step_walls``)."""
    steps = _found(trace)
    for s, wall in zip(steps, step_walls(steps, trace.kernels, trace.kind != "chrome-cpu")):
        s["wall_ms"] = wall
    return steps


def _found(trace: Trace) -> list[dict]:
    """steps_of's steps before their walls."""
    ks = trace.kernels
    named = [r for r in trace.ranges if is_step(r[0])]
    if named and ks:
        by_name: dict = {}
        starts = [r[1] for r in named]
        of_name: dict = {}  # range name -> its ranges' starts and the ranges, in time order
        for r in named:
            of_name.setdefault(r[0], ([], []))
            of_name[r[0]][0].append(r[1])
            of_name[r[0]][1].append(r)
        for k in ks:
            # a range that names the phase (opmap's, a context / generation batch) over any other
            want = (next((r for r in reversed(k.ranges) if _PHASED.match(r)), None)
                    or next((r for r in reversed(k.ranges) if is_step(r)), None))
            if want is not None:
                by_name.setdefault(_launch_step(k, want, of_name), []).append(k)
            elif trace.kind == "chrome-cpu" or k.launched is not None:
                # launched by another thread while a step range was open (gloo's collectives on the
                # host; autograd's backward or a pipeline's second stream on the GPU): that step. Work
                # launched before any step's range (a warm-up still draining) stays out.
                t = k.ts if trace.kind == "chrome-cpu" else k.launched
                i = bisect.bisect_right(starts, t) - 1
                if i >= 0 and t <= named[i][1] + named[i][2]:
                    by_name.setdefault(named[i], []).append(k)
        steps = []
        for (name, ts, dur), kk in sorted(by_name.items(), key=lambda x: x[0][1]):
            steps.append({"name": name, "kernels": kk, "ts": ts, "end": max(ts + dur, max(k.ts + k.dur for k in kk))})
        if steps:
            return steps
    if not ks:
        return []
    by_sync = _split_at_readbacks(ks)
    if by_sync is not None:
        return _with_wall(by_sync)
    gaps = [b.ts - (a.ts + a.dur) for a, b in zip(ks, ks[1:])]
    cut = max(50.0, 20 * statistics.median([g for g in gaps if g > 0] or [1.0]))
    steps, cur = [], [ks[0]]
    for k, g in zip(ks[1:], gaps):
        if g > cut:
            steps.append(cur)
            cur = []
        cur.append(k)
    steps.append(cur)
    return _with_wall(steps)


def step_walls(steps: list, kernels=None, gpu: bool = True) -> list:
    """Each step's wall time in ms: its stretch of the timeline, from where it starts (its range's
    start, or where the GPU finished the work launched before the step's first kernel, whichever is
    later) to where the next one starts (the last: its end). An engine that launches a step while
    the GPU still runs the one before (one-step-ahead decode, async scheduling) opens each step's
    range about a step early; measured from the range, each step would span two of them and half
    the GPU's time would read as idle. ``kernels``: every kernel of the trace (those of no step
    too: a step cut off at the trace's start, a warm-up); default the steps'. ``gpu`` False (a
    host-only trace, whose ops nest and stand for kernels): from each step's start to its wall end,
    as found."""
    if not gpu:
        return [(s.get("wall_end", s["end"]) - s["ts"]) / 1e3 for s in steps]
    every = sorted(kernels if kernels is not None else [k for s in steps for k in s["kernels"]], key=lambda k: k.ts)
    ts = [k.ts for k in every]
    done, end = [], float("-inf")  # done[i]: the latest end among every[:i + 1]
    for k in every:
        end = max(end, k.ts + k.dur)
        done.append(end)

    def busy_before(t):
        i = bisect.bisect_left(ts, t) - 1
        return done[i] if i >= 0 else float("-inf")

    order = sorted(range(len(steps)), key=lambda i: steps[i]["ts"])
    starts = {}
    for i in order:
        s = steps[i]
        first = min((k.ts for k in s["kernels"]), default=s["ts"])
        starts[i] = max(s["ts"], min(busy_before(first), first))
    out = [0.0] * len(steps)
    for j, i in enumerate(order):
        s = steps[i]
        last = max([s.get("wall_end", s["end"])] + [k.ts + k.dur for k in s["kernels"]])
        stop = starts[order[j + 1]] if j + 1 < len(order) else last
        out[i] = max(stop - starts[i], 0.0) / 1e3
    return out


def _with_wall(steps: list) -> list:
    out = [{"name": None, "kernels": s, "ts": s[0].ts, "end": max(k.ts + k.dur for k in s)} for s in steps]
    # a step's wall time runs to the next step's start: the host's gap between them is the step's too
    for s, nxt in zip(out, out[1:]):
        s["wall_end"] = nxt["ts"]
    return out


def _split_at_readbacks(ks: list):
    """Steps of an engine that emits no step range: each step ends where the host reads a result
    back (a device-to-host copy: the sampled tokens, the stop check), the pattern of HF generate
    and of most engines' loops; where the run samples on the GPU, the first readback after the
    sampling kernels. A stretch of fewer than a quarter of the longest stretch's kernels
    (a second readback in one step, the set-up before the first forward) joins its neighbour.
    None where fewer than two steps result."""
    # Where the run samples on the GPU, only a readback after a sampling kernel ends a step: the
    # copies a step makes before it samples (FlashInfer's plan reading the page offsets, a
    # nonzero's count) are part of it.
    chooses = [attribute.chooses(k) for k in ks]
    sampled = any(chooses)
    parts, cur, seen = [], [], False
    for k, c in zip(ks, chooses):
        cur.append(k)
        seen = seen or c
        if attribute.readback(k) and (seen or not sampled):
            parts.append(cur)
            cur, seen = [], False
    if cur:
        parts.append(cur)
    if len(parts) < 2:
        return None
    small = max(len(p) for p in parts) / 4
    steps: list = []
    pending: list = []  # small stretches before the first full step
    for p in parts:
        if len(p) >= small:
            steps.append(pending + p)
            pending = []
        elif steps:
            steps[-1].extend(p)
        else:
            pending.extend(p)
    if pending:
        steps.append(pending) if not steps else steps[-1].extend(pending)
    return steps if len(steps) >= 2 else None


def _launch_step(k, want: str, of_name: dict) -> tuple:
    """The step range (name, ts, dur) named ``want`` (the innermost step range open at k's launch)
    that started last before k."""
    starts, rs = of_name.get(want, ((), ()))
    i = bisect.bisect_right(starts, k.ts if k.launched is None else k.launched) - 1
    return rs[i] if i >= 0 else (want, k.ts, 0.0)


# A kernel that launches this many times the blocks it launches in the run's median step works on
# that many times the rows: a prompt, not one token per sequence. Above the few-fold growth of a
# decode batch as requests join, far below a prompt's length.
GRID_PREFILL = 8.0


def _size(k) -> int:
    """How much work a launch covers: its thread blocks, or where the trace has no grid (a host-only
    recording's ops) the elements of its launching op's first input, which grow with the rows as
    the blocks do; 0 where neither is recorded."""
    if k.grid:
        return k.grid
    first = next((d for d in k.shapes if isinstance(d, (list, tuple)) and d), None)
    if first is None or not all(isinstance(v, int) and v > 0 for v in first):
        return 0
    return functools.reduce(lambda a, b: a * b, first, 1)


def _grids(step: dict) -> dict:
    """Kernel name -> the median size (``_size``: grid, else input elements) of its launches in the
    step, where recorded; kept in the step (``grid_medians`` and ``grown`` both read it)."""
    if "grids" not in step:
        seen: dict = {}
        for k in step["kernels"]:
            size = _size(k)
            if size:
                seen.setdefault(k.name, []).append(size)
        step["grids"] = {n: statistics.median(v) for n, v in seen.items()}
    return step["grids"]


def grid_medians(steps: list) -> dict:
    """Kernel name -> the median over the steps that ran it of its grid there, for the kernels
    that ran in at least two steps over more than one block (a one-block kernel is a scalar's,
    the same in every phase)."""
    seen: dict = {}
    for s in steps:
        for n, g in _grids(s).items():
            seen.setdefault(n, []).append(g)
    out = {n: statistics.median(v) for n, v in seen.items() if len(v) >= 2}
    return {n: g for n, g in out.items() if g >= 2}


def grown(step: dict, medians: dict, factor: float = GRID_PREFILL) -> tuple[int, float]:
    """(kernels, their share of the step's kernels that other steps ran too) whose grid here is at
    least ``factor`` times their run median: per-layer work (norms, RoPE, activations, copies)
    grows with a prompt's rows; the LM head's and the sampler's do not (the last token only)."""
    g = _grids(step)
    common = [n for n in g if n in medians]
    big = sum(g[n] >= factor * medians[n] for n in common)
    return big, big / len(common) if common else 0.0


def _launches(step: dict) -> tuple:
    """The step's launches as (kernel name, count) pairs, sorted; kept in the step."""
    if "launches" not in step:
        step["launches"] = tuple(sorted(Counter(k.name for k in step["kernels"]).items()))
    return step["launches"]


def common_launches(steps: list) -> Optional[tuple]:
    """The launches (``_launches``) that more steps ran than any other set, where at least two
    steps ran them: a decode loop repeats one set of launches, a prefill adds its own (a mask, a
    cache's set-up)."""
    top = Counter(_launches(s) for s in steps).most_common(2)
    if not top or top[0][1] < 2 or (len(top) > 1 and top[1][1] == top[0][1]):
        return None
    return top[0][0]


# Kernels whose sizes a step must share with the run's median step before the sizes, not its busy
# time, say it covers no more rows (a host-only trace's busy time varies by a fifth step to step).
SIZED_KERNELS = 3


def label(step: dict, median_busy_us: float, medians: Optional[dict] = None,
          common: Optional[tuple] = None) -> tuple[str, str]:
    """(phase, confidence) of a step: from its range name (high), from the attention kernels it
    ran (medium), from its kernels' grids against the same kernels' in the other steps (medium:
    ``medians`` from grid_medians; a prefill step's elementwise, norm and GEMM launches cover
    the prompt's rows), else from its GPU busy time against the run's median step (low: a
    prefill step computes over the prompt, a decode step over one token per sequence). A step
    over the median busy time stays decode where its launches' sizes match the median step's.
    With no sizes recorded, the run's ``common`` launches (common_launches: the decode loop's)
    decide first: a step that ran them is decode, one that ran more launches of its own (a
    prompt's set-up) is prefill, whatever their host time."""
    name = step["name"] or ""
    m = re.match(r"^opmap::step::(\w+)$", name)
    if m:
        return m.group(1), "high"
    m = _CTX_GEN.match(name)
    if m:
        ctx, gen = int(m.group(1)), int(m.group(2))
        return ("mixed" if ctx and gen else "prefill" if ctx else "decode"), "high"
    att = [k.name for k in step["kernels"] if attribute.of(k).category == "attention"]
    dec = any(_DECODE.search(n) for n in att)
    pre = any(_PREFILL.search(n) and not _DECODE.search(n) for n in att)
    if dec or pre:
        return ("mixed" if dec and pre else "decode" if dec else "prefill"), "medium"
    big, share = grown(step, medians) if medians else (0, 0.0)
    if big >= 3 and share >= 0.1:
        return "prefill", "medium"
    sized = sum(n in (medians or {}) for n in _grids(step))
    if sized < SIZED_KERNELS and common is not None:
        # No sizes: the launches say more than the time. A host op's time is wall time, which other
        # processes on the CPU stretch (decode steps of one HF loop measured 0.3x to 6x their
        # median under load); a prompt's step launches its own set-up (masks, the cache) beside
        # the loop's ops. A prefill that launches exactly the loop's ops reads as decode here:
        # record shapes to tell it apart.
        if _launches(step) == common:
            return "decode", "low"
        if sum(c for _, c in _launches(step)) > sum(c for _, c in common):
            return "prefill", "low"
    if busy(step["kernels"]) < 1.15 * median_busy_us:
        return "decode", "low"
    # longer than the median step: a prompt's rows, unless its launches are the median step's sizes
    same = sized >= SIZED_KERNELS and grown(step, medians, 2.0)[0] == 0
    return ("decode" if same else "prefill"), "low"


def union(intervals) -> list:
    """Disjoint [start, end] spans covering the given (start, end) intervals, in order."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def measure(spans: list) -> float:
    return sum(b - a for a, b in spans)


def busy(kernels) -> float:
    """Time covered by at least one of the kernels."""
    return measure(union((k.ts, k.ts + k.dur) for k in kernels))
