"""Trace readers: a PyTorch profiler Chrome trace (``.json`` / ``.json.gz``, as torch.profiler,
vLLM's and SGLang's profilers and HF runs write it) and an Nsight Systems SQLite export (``nsys
export --type sqlite``), both into one list of GPU kernels. Each kernel carries the CPU op that
launched it (through the correlation id of its launch call), that op's input shapes where they were
recorded, and the host ranges open at that launch (``record_function`` / NVTX: the engine's step
and layer ranges, opmap's op ranges). A kernel replayed by ``cudaGraphLaunch`` has no launching op
of its own; where the trace holds the graph's capture, the launch recorded at the same place of
the capture lends it its op, shapes and ranges."""
from __future__ import annotations

import gzip
import json
import math
import re
import sqlite3
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from opmap.core.contract import InputError


@dataclass
class Kernel:
    name: str
    ts: float  # start, us
    dur: float  # us
    launcher: Optional[str] = None  # the innermost CPU op around the launch call
    ranges: tuple = ()  # host ranges open at the launch, outermost first
    stream: Optional[int] = None
    shapes: tuple = ()  # the launching op's input shapes, where recorded
    graph: bool = False  # replayed by cudaGraphLaunch
    launched: Optional[float] = None  # when the host launched it, us
    grid: int = 0  # thread blocks launched (0: the trace does not say)


@dataclass
class Trace:
    kernels: list
    ranges: list = field(default_factory=list)  # (name, ts, dur) host ranges
    source: str = ""
    kind: str = ""  # "chrome" or "nsys"


def _blocks(grid) -> int:
    """Thread blocks of a Chrome trace kernel's ``grid`` argument ([x, y, z]); 0 when absent."""
    if isinstance(grid, (list, tuple)) and grid and all(isinstance(g, int) and g > 0 for g in grid):
        n = 1
        for g in grid:
            n *= g
        return n
    return 0


def load(path: str, progress: bool = False) -> Trace:
    """A trace file by its content: SQLite (Nsight Systems) or JSON (Chrome, gzipped or not)."""
    p = Path(path)
    if not p.is_file():
        raise InputError("trace", repr(path), "an existing trace file")
    head = p.open("rb").read(16)
    if head.startswith(b"SQLite format 3"):
        return _nsys(p)
    return _chrome(p, progress)


# ---- Chrome traces ----------------------------------------------------------------------------

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST_RANGE_CATS = ("user_annotation", "python_function")
# Python frames (a trace recorded with_stack=True) that name an operator: the nn.Module calls
# ("nn.Module: LlamaRMSNorm_0") and the functions models call outside a module (HF's
# apply_rotary_pos_emb, the attention-interface functions, the attention-mask builders, the logits
# processors, an engine's model-runner call (vLLM's execute_model: a step); not HF's ``_sample``, the
# whole generate loop). The other frames are dropped on reading, so a
# stack-heavy trace costs no memory for them.
PY_FRAMES = re.compile(r"^nn\.Module: |apply_rotary_pos_emb|rotate_half|_attention_forward|repeat_kv|"
                       r"LogitsProcessor|\): (sample|top_k_top_p|apply_penalties)$|\): (create_causal_mask|"
                       r"create_sliding_window_causal_mask|create_block_mask|_prepare_4d_causal_attention_mask\w*)$|"
                       r"model_runner\w*\.py\(\d+\): (execute_model|run_batch|forward_batch\w*)$")


def kept(e: dict) -> bool:
    """Whether a host event is read: every one but the Python frames PY_FRAMES does not name."""
    return e.get("cat") != "python_function" or bool(PY_FRAMES.search(e.get("name", "")))
_OP_CATS = ("cpu_op", "operator")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver", "runtime")
# The runtime / driver calls a stream capture records as graph nodes, in the order the graph replays them.
_NODE_CALLS = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunchCooperativeKernel|cudaMemcpy\w*Async|"
                         r"cudaMemset\w*Async|cuMemcpy\w*Async|cuMemsetD\w*Async)")


class _Counted:
    """A binary file that reports the bytes read to a progress bar (under gzip: compressed bytes)."""

    def __init__(self, f, bar, task):
        self.f, self.bar, self.task = f, bar, task

    def read(self, n=-1):
        b = self.f.read(n)
        self.bar.update(self.task, advance=len(b))
        return b

    def __getattr__(self, name):
        return getattr(self.f, name)


def _read_json(p: Path, progress: bool, show_above: int = 50 * 2**20) -> dict:
    """The JSON of a trace, gzipped or not. Past ``show_above`` bytes on disk (and with
    ``progress``) a bar on stderr follows the read and the decompression, then the parse."""
    size = p.stat().st_size
    with p.open("rb") as raw:
        gz = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        try:
            if progress and size > show_above:  # rich only for a progress bar over a large file
                from rich.console import Console
                from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

                cols = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn())
                with Progress(*cols, console=Console(stderr=True), transient=True) as bar:
                    task = bar.add_task(f"reading {p.name}", total=size)
                    f = _Counted(raw, bar, task)
                    data = gzip.GzipFile(fileobj=f).read() if gz else f.read()
                    bar.update(task, description=f"parsing {len(data) / 2**20:.0f} MB of JSON")
                    return json.loads(data)
            return json.loads(gzip.GzipFile(fileobj=raw).read() if gz else raw.read())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError) as e:
            raise InputError("trace", p.name, f"a Chrome trace (JSON) or an Nsight Systems SQLite export ({e})") from None


def _chrome(p: Path, progress: bool) -> Trace:
    return from_chrome(_read_json(p, progress), str(p))


def from_chrome(doc, source: str) -> Trace:
    """A Chrome trace already parsed (a caller that holds the JSON need not read it again)."""
    evs = doc.get("traceEvents", doc) if isinstance(doc, dict) else doc
    if not isinstance(evs, list):
        raise InputError("trace", Path(source).name, "a Chrome trace with traceEvents")
    xs = [e for e in evs if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e and "ts" in e]
    for e in xs:
        _times(e, source)
    kernels, host, launches = [], {}, {}
    for e in xs:
        cat = e.get("cat", "")
        if cat in _GPU_CATS:
            kernels.append(e)
        elif (cat in _HOST_RANGE_CATS and kept(e)) or cat in _OP_CATS or cat in _LAUNCH_CATS:
            host.setdefault((e.get("pid"), e.get("tid")), []).append(e)
            if cat in _LAUNCH_CATS and (e.get("args") or {}).get("correlation") is not None:
                launches[e["args"]["correlation"]] = e
    context, captures = _host_context(host) if kernels else ({}, [])
    out, replays = [], {}
    for k in kernels:
        corr = (k.get("args") or {}).get("correlation")
        launch = launches.get(corr)
        op, ranges, shapes = context.get(id(launch), (None, (), ())) if launch is not None else (None, (), ())
        name = k.get("name", "")
        if k.get("cat") == "gpu_memcpy" and "Memcpy" not in name:
            name = "Memcpy " + name
        if k.get("cat") == "gpu_memset" and "Memset" not in name:
            name = "Memset " + name
        graph = launch is not None and launch.get("name", "").startswith("cudaGraphLaunch")
        out.append(Kernel(name, float(k["ts"]), float(k["dur"]), op, ranges, (k.get("args") or {}).get("stream"),
                          shapes, graph, float(launch["ts"]) if launch is not None else None,
                          _blocks((k.get("args") or {}).get("grid"))))
        if graph:
            replays.setdefault(corr, (launch["ts"], []))[1].append(out[-1])
    if captures and replays:
        _lend_captures(replays, captures)
    kind = "chrome"
    if not kernels:  # a CPU run (e.g. torch.distributed over gloo): its outermost CPU ops stand for kernels
        out, kind = _cpu_ops(host), "chrome-cpu"
    out.sort(key=lambda k: k.ts)
    ranges = [(e["name"], float(e["ts"]), float(e["dur"])) for evs_ in host.values() for e in evs_
              if e.get("cat") in _HOST_RANGE_CATS]
    return Trace(out, sorted(ranges, key=lambda r: r[1]), source, kind)


def _times(e: dict, source: str) -> None:
    """An event's ``ts`` and ``dur`` as floats, in place: finite numbers (a numeric string is read
    as one), the duration >= 0; an InputError naming the file and the event otherwise (a negative
    or unreadable time would be summed into every share of the analysis)."""
    for key in ("ts", "dur"):
        v = e[key]
        try:
            x = float(v) if not isinstance(v, bool) else math.nan
        except (TypeError, ValueError):
            x = math.nan
        if not math.isfinite(x) or (key == "dur" and x < 0):
            raise InputError(f"trace {Path(source).name}", f"event {str(e.get('name', ''))[:60]!r} with {key} {v!r}",
                             "finite times in microseconds" + (", durations >= 0" if key == "dur" else ""))
        e[key] = x


def _sweep(evs: list):
    """(event, the events open around it, outermost first) over one thread's events in time order."""
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack: list = []
    for e in evs:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] < e["ts"]:
            stack.pop()
        yield e, stack
        stack.append(e)


def _is_op(e: dict) -> bool:
    return e.get("cat") in _OP_CATS or e.get("name", "").startswith("gloo:")


def _cpu_ops(host: dict) -> list:
    """The outermost CPU op of each thread's stacks, as Kernels (stream = thread), with the host
    ranges open around it: a trace without GPU activity analysed by its host ops. The collectives
    of torch.distributed over gloo run on gloo's own threads, as ranges named gloo:<collective>:
    those count as ops of their thread."""
    out = []
    for (_, tid), evs in host.items():
        for e, stack in _sweep(evs):
            if _is_op(e) and not any(_is_op(x) for x in stack):
                ranges = tuple(x["name"] for x in stack if x.get("cat") in _HOST_RANGE_CATS)
                out.append(Kernel(e["name"], float(e["ts"]), float(e["dur"]), e["name"], ranges, tid, _dims(e)))
    return out


def _dims(op: Optional[dict]) -> tuple:
    dims = ((op or {}).get("args") or {}).get("Input Dims")
    return tuple(tuple(d) if isinstance(d, list) else () for d in dims) if isinstance(dims, list) else ()


def _host_context(host: dict) -> tuple[dict, list]:
    """id(launch event) -> (innermost CPU op, host ranges open, the op's input shapes), by a stack
    sweep per thread; and the stream captures: per capture (its end's ts, the contexts of the
    graph-node calls it recorded, in order)."""
    out, captures = {}, []
    for evs in host.values():
        cap = None
        for e, stack in _sweep(evs):
            if e.get("cat") not in _LAUNCH_CATS:
                continue
            name = e.get("name", "")
            if name.startswith("cudaStreamBeginCapture"):
                cap = []
            elif name.startswith("cudaStreamEndCapture"):
                if cap:
                    captures.append((e["ts"], cap))
                cap = None
            op = next((s for s in reversed(stack) if s.get("cat") in _OP_CATS), None)
            ctx = (op["name"] if op else None, tuple(s["name"] for s in stack if s.get("cat") in _HOST_RANGE_CATS),
                   _dims(op))
            out[id(e)] = ctx
            if cap is not None and _NODE_CALLS.match(name):
                cap.append(ctx)
    return out, sorted(captures, key=lambda c: c[0])


def _lent(r: str) -> bool:
    return bool(PY_FRAMES.search(r)) or (r.startswith("opmap::") and not r.startswith("opmap::step::"))


def _lend_captures(replays: dict, captures: list) -> None:
    """Each graph replay's kernels (one cudaGraphLaunch: one correlation id, in time order) take the
    op, ranges and shapes of the launches at the same places of a capture that recorded as many
    graph nodes: the latest such capture before the replay (an engine captures one graph per batch
    size, in one code path, so captures of equal length launch the same ops). A replay no capture
    matches keeps what its own launch tells (the ranges open at cudaGraphLaunch)."""
    for ts, ks in replays.values():
        ks.sort(key=lambda k: k.ts)
        same = [c for end, c in captures if len(c) == len(ks)]
        before = [c for end, c in captures if len(c) == len(ks) and end <= ts]
        cap = (before or same or [None])[-1]
        if cap is None:
            continue
        for k, (op, ranges, shapes) in zip(ks, cap):
            if k.launcher is None:
                k.launcher, k.shapes = op, shapes
                # the capture's frames, not its step ranges (the replay belongs to its own step)
                k.ranges = k.ranges + tuple(r for r in ranges if r not in k.ranges and _lent(r))


# ---- Nsight Systems SQLite exports --------------------------------------------------------------

def _nsys(p: Path) -> Trace:
    try:
        db = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as e:
        raise InputError("trace", p.name, f"an Nsight Systems SQLite export ({e})") from None
    if "CUPTI_ACTIVITY_KIND_KERNEL" not in tables:
        raise InputError("trace", p.name, "an Nsight Systems export with CUDA kernels (CUPTI_ACTIVITY_KIND_KERNEL)")
    strings = dict(db.execute("SELECT id, value FROM StringIds")) if "StringIds" in tables else {}
    name_col = "demangledName" if "demangledName" in _cols(db, "CUPTI_ACTIVITY_KIND_KERNEL") else "shortName"
    kcols = _cols(db, "CUPTI_ACTIVITY_KIND_KERNEL")
    grid = "gridX * gridY * gridZ" if {"gridX", "gridY", "gridZ"} <= set(kcols) else "0"
    rows = db.execute(f"SELECT start, end, {name_col}, correlationId, streamId, {grid} "
                      "FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchall()
    launches = {}
    if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
        for start, end, corr, tid in db.execute(
                "SELECT start, end, correlationId, globalTid FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
            launches[corr] = (start, tid)
    nvtx: dict = {}
    ranges = []
    if "NVTX_EVENTS" in tables:
        cols = _cols(db, "NVTX_EVENTS")
        text = "COALESCE(text, '')" + (", textId" if "textId" in cols else ", NULL")
        for start, end, t, tid_, tid in db.execute(
                f"SELECT start, end, {text}, globalTid FROM NVTX_EVENTS WHERE end IS NOT NULL AND end > start"):
            name = t or strings.get(tid_, "")
            if name:
                nvtx.setdefault(tid, []).append((start, end, name))
                ranges.append((name, start / 1e3, (end - start) / 1e3))
    for v in nvtx.values():
        v.sort()
    out = []
    for start, end, nm, corr, stream, blocks in rows:
        name = strings.get(nm, str(nm)) if isinstance(nm, int) else str(nm)
        if not (isinstance(start, int) and isinstance(end, int)) or end < start:
            raise InputError(f"trace {p.name}", f"kernel {name[:60]!r} from {start!r} to {end!r}",
                             "integer start and end times (ns), end >= start")
        open_, t = (), None
        if corr in launches:
            t, tid = launches[corr]
            spans = nvtx.get(tid, [])
            i = bisect_right(spans, (t, float("inf"), ""))
            open_ = tuple(n for s, e, n in spans[:i] if s <= t <= e)
        out.append(Kernel(name, start / 1e3, (end - start) / 1e3, None, open_, stream,
                          launched=t / 1e3 if t is not None else None, grid=blocks if isinstance(blocks, int) else 0))
    for table_, label in (("CUPTI_ACTIVITY_KIND_MEMCPY", "Memcpy"), ("CUPTI_ACTIVITY_KIND_MEMSET", "Memset")):
        if table_ in tables:
            for start, end in db.execute(f"SELECT start, end FROM {table_}"):
                out.append(Kernel(label, start / 1e3, (end - start) / 1e3))
    db.close()
    out.sort(key=lambda k: k.ts)
    return Trace(out, sorted(ranges, key=lambda r: r[1]), str(p), "nsys")


def _cols(db, table: str) -> set:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
