"""Timing on the GPU: the median of CUDA-event times of single calls after warm-up, with the L2
emptied by a read before each call, inputs rotated past the L2 and, for small launches, CUDA-graph
replay.

The L2 is emptied by *reading* a buffer of twice its size, not by writing one (as
``triton.testing.do_bench`` does with 256 MB of zeros): after a write the L2 is full of dirty
lines, and the timed call would start by writing them back, tens of MB that no decode step pays
(a large part of a small decode GEMM's time; docs/harness.md, `opmap bench`).

Rotation: the case's ``setup(device)`` is called several times to build independent input sets
whose bytes together exceed a few times the L2 size, and each timed call uses the next set, so a
call never finds its inputs left in L2 by the previous one. The number of sets is capped so small
cases do not allocate thousands of copies; the read before each call covers those.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from opmap.core import hw

MAX_SETS = 16
L2_FACTOR = 3  # rotate through at least this many L2 sizes of input


@dataclass
class Timing:
    median_us: float
    method: str  # "events" or "events+graph"
    sets: int
    note: str = ""


def l2_bytes() -> int:
    return hw.detect().l2_bytes or 50 * 2**20


def num_sets(case_bytes: float, max_sets: int = MAX_SETS) -> int:
    if case_bytes <= 0:
        return max_sets
    return max(1, min(max_sets, math.ceil(L2_FACTOR * l2_bytes() / case_bytes)))


def _cycle(calls: list[Callable[[], object]]) -> Callable[[], None]:
    n = len(calls)
    if n == 1:
        return calls[0]
    state = [0]

    def fn():
        i = state[0]
        state[0] = i + 1 if i + 1 < n else 0
        calls[i]()

    return fn


def _graphs(calls: list[Callable[[], object]]) -> list[Callable[[], None]]:
    """One CUDA graph per input set; replay has no per-launch CPU cost."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:  # warm-up outside capture (compiles, autotunes, allocates workspaces)
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    # A call that synchronises with the host (boolean-mask indexing, .item()) cannot be captured,
    # and a failed capture leaves the CUDA RNG in capture mode: every later torch.randn in the
    # process then raises "Offset increment outside graph capture" (on the H200 one uncapturable
    # peer took every later case of the run with it). Such calls are found eagerly instead.
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for c in calls[:1]:
            c()
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
    out = []
    for c in calls:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            c()
        out.append(g.replay)
    torch.cuda.synchronize()
    return out


_flush_buffer: Optional[torch.Tensor] = None


def _l2_flush() -> Callable[[], None]:
    """A read of twice the L2's bytes (a max: one value written), which leaves no dirty line."""
    global _flush_buffer
    n = 2 * l2_bytes() // 4
    if _flush_buffer is None or _flush_buffer.numel() != n:
        _flush_buffer = torch.zeros(n, dtype=torch.int32, device="cuda")
    buf = _flush_buffer
    return lambda: torch.amax(buf)


def _median_ms(fn: Callable[[], None], warmup_ms: float, rep_ms: float, max_reps: int = 2000) -> float:
    flush = _l2_flush()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush()
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)  # ms a call, the flush included
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    reps = max(5, min(max_reps, int(rep_ms / est)))
    # the flush also gives the host a lead: the timed call is queued before the flush ends
    return hw.median_ms(fn, reps, before=flush)


def time_calls(calls: list[Callable[[], object]], graph: bool = False, warmup_ms: float = 25,
               rep_ms: float = 100) -> Timing:
    """Median time of one call, cycling through ``calls`` (one per input set)."""
    note = ""
    method = "events"
    fns = calls
    if graph:
        try:
            fns = _graphs(calls)
            method = "events+graph"
        except Exception as e:  # not capturable (a host sync inside): time it eagerly, and say so
            torch.cuda.synchronize()
            note = f"graph capture failed ({type(e).__name__}: {str(e)[:120]}); timed eagerly"
    ms = _median_ms(_cycle(fns), warmup_ms, rep_ms)
    return Timing(ms * 1e3, method, len(calls), note)


def figures(median_us: float, flops: float, nbytes: float, bound: str, ceil) -> dict:
    """TB/s, TFLOP/s and the fraction of the ceiling that bounds the case."""
    t = median_us * 1e-6
    tbps = nbytes / t / 1e12 if nbytes else None
    tflops = flops / t / 1e12 if flops else None
    frac: Optional[float] = None
    if ceil is not None:
        if bound == "compute" and tflops is not None:
            frac = tflops / ceil.bf16_tflops
        elif tbps is not None:
            frac = tbps / ceil.read_tbps
    r = lambda v: None if v is None else float(f"{v:.4g}")  # significant figures: tiny cases stay visible  # noqa: E731
    return {"tbps": r(tbps), "tflops": r(tflops), "frac_of_ceiling": r(frac)}
