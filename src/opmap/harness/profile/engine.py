"""`opmap profile`: engine steps under torch.profiler, GPU time per operator category and phase.

Every engine step runs inside a range ``opmap::step::<phase>`` and every operator call inside
``opmap::<op>::<label>::<backend>`` (also an NVTX range, for Nsight Systems). The Chrome trace
the profiler writes is then read back: a GPU kernel belongs to the step whose host range contains
its start (a step ends by reading its sampled tokens on the host, so its kernels are done by then)
and to the operator whose GPU-projected range contains it; a kernel outside any operator range (a
replayed CUDA graph, the sampler's internals) is classified by its symbol. On a CPU the operator
ranges themselves are timed (host time of the reference ops).
"""
from __future__ import annotations

import bisect
import cProfile
import json
import os
import pstats
import tempfile
from collections import Counter, defaultdict

from opmap.core.contract import dtype_name
from opmap.core import hw
from opmap.harness.profile import analyze
from opmap.harness.profile import trace
from opmap.harness.profile.symbols import OP_CATEGORY, classify

CATEGORIES = ("attention", "GEMM", "norm", "RoPE", "activation", "MoE", "sampling", "grammar", "communication",
              "quantise", "memory copies", "other")


def categorize(symbol: str, moe: bool = True) -> str:
    """A kernel symbol's category through the symbol table (symbols.json). ``_combine_kernel`` is
    both opmap's MoE combine and its split-KV decode combine: MoE in MoE models, else attention's.
    A symbol that says nothing alone is "other" here (the operator ranges name the rest)."""
    if symbol == "_combine_kernel":
        return "MoE" if moe else "attention"
    cat = classify(symbol)[0]
    return "other" if cat == "unattributed" else cat


def _op_of(name: str):
    """'opmap::gemm::QKV proj::cublas' -> ('gemm', 'QKV proj', 'cublas')."""
    parts = name.split("::")
    return tuple(parts[1:4]) if len(parts) >= 4 and parts[0] == "opmap" and parts[1] != "step" else None


def analyse(trace: dict, moe: bool = True) -> dict:
    """Per phase: steps, host wall, GPU busy and idle, time per category with kernels and backends."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in evs if e.get("cat") == "user_annotation" and e["name"].startswith("opmap::step::")]
    steps.sort(key=lambda e: e["ts"])
    kernels = [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu_ops = [e for e in evs if e.get("cat") == "gpu_user_annotation" and _op_of(e["name"])]
    cpu_ops = [e for e in evs if e.get("cat") == "user_annotation" and _op_of(e["name"])]
    on_gpu = bool(kernels)
    phases: dict = {}
    starts = [s["ts"] for s in steps]

    def step_of(ts):
        i = bisect.bisect_right(starts, ts) - 1
        if i >= 0 and ts <= steps[i]["ts"] + steps[i]["dur"]:
            return steps[i]
        return None

    for s in steps:
        ph = phases.setdefault(s["name"].split("::")[2], {
            "steps": 0, "wall_us": 0.0, "busy_us": 0.0, "by_category": Counter(), "symbols": defaultdict(Counter),
            "launches": Counter(), "grids": defaultdict(Counter), "grid_launches": defaultdict(Counter),
            "host_ops": Counter(), "host_calls": Counter(), "host_api": Counter(),
            "host_api_calls": Counter(),
            "backends": defaultdict(set)})
        ph["steps"] += 1
        ph["wall_us"] += s["dur"]
    gpu_ops.sort(key=lambda e: e["ts"])
    op_starts = [o["ts"] for o in gpu_ops]
    own = _exclusive(kernels)
    for ev in (kernels if on_gpu else cpu_ops):
        s = step_of(ev["ts"])
        if s is None:
            continue
        ph = phases[s["name"].split("::")[2]]
        if on_gpu:
            j = bisect.bisect_right(op_starts, ev["ts"]) - 1
            owner = gpu_ops[j] if j >= 0 and ev["ts"] <= gpu_ops[j]["ts"] + gpu_ops[j]["dur"] else None
            op = _op_of(owner["name"]) if owner else None
            cat = OP_CATEGORY.get(op[0], "other") if op else categorize(ev["name"], moe)
            sym = ev["name"]
        else:
            op = _op_of(ev["name"])
            cat, sym = OP_CATEGORY.get(op[0], "other"), f"{op[1]} (host)"
        t = own[id(ev)] if on_gpu else ev["dur"]
        ph["by_category"][cat] += t
        ph["symbols"][cat][sym[:90]] += t
        ph["launches"][sym[:90]] += 1
        grid = (ev.get("args") or {}).get("grid") if on_gpu else None
        if grid:  # one symbol, several GEMMs (QKV, O, router): their launch grids tell them apart
            ph["grids"][sym[:90]][str(grid)] += t
            ph["grid_launches"][sym[:90]][str(grid)] += 1
        if op:
            ph["backends"][cat].add(op[2])
    for ev in cpu_ops:  # host time inside each operator's range: validation, launch, Python
        s = step_of(ev["ts"])
        if s is not None:
            op = _op_of(ev["name"])
            d, label = phases[s["name"].split("::")[2]], f"{op[1]} [{op[2]}]"
            d["host_ops"][label] += ev["dur"]
            d["host_calls"][label] += 1
    # CUDA runtime / driver calls on the host (kernel launches, allocations, copies, waits): the part
    # of an operator's host time that is not Python
    for ev in evs:
        if ev.get("cat") in ("cuda_runtime", "cuda_driver"):
            s = step_of(ev["ts"])
            if s is not None:
                d = phases[s["name"].split("::")[2]]
                d["host_api"][ev["name"]] += ev["dur"]
                d["host_api_calls"][ev["name"]] += 1
    for ph, d in phases.items():
        steps_of_ph = [s for s in steps if s["name"].endswith("::" + ph)]
        d["busy_us"] = _union_inside(kernels, steps_of_ph) if on_gpu else sum(d["by_category"].values())
        d["idle_us"] = max(d["wall_us"] - d["busy_us"], 0.0) if on_gpu else None
    return {"on_gpu": on_gpu, "phases": phases}


def _exclusive(kernels: list) -> dict:
    """Each kernel's GPU time not already covered by an earlier-starting one (by id). Under PDL a
    kernel starts before the one it depends on has finished and waits inside (griddepcontrol.wait),
    so the profiler's durations overlap: summed as they are, a decode step's kernel time comes to
    well over its busy GPU time. These times add up
    to the busy time, and the waiting is counted once, for the kernel being waited on."""
    out, end = {}, float("-inf")
    for k in sorted(kernels, key=lambda e: e["ts"]):
        stop = k["ts"] + k["dur"]
        out[id(k)] = max(stop - max(k["ts"], end), 0.0)
        end = max(end, stop)
    return out


def _union_inside(kernels: list, steps: list) -> float:
    total = 0.0
    for s in steps:
        a, b = s["ts"], s["ts"] + s["dur"]
        iv = sorted((max(k["ts"], a), min(k["ts"] + k["dur"], b)) for k in kernels if a <= k["ts"] <= b)
        end = a
        for x, y in iv:
            if y > end:
                total += y - max(x, end)
                end = y
    return total


def diagnose(res: dict, llm, phase_backends: dict) -> list:
    """Rules from the measured breakdown (and the engine's state) to what to look at next."""
    out = []
    ph = res["phases"]
    if not res["on_gpu"]:
        out.append("CPU run: category times are host times of the reference operators; GPU idle and graph "
                   "replay do not apply here")
    d = ph.get("decode")
    if d and res["on_gpu"] and d["busy_us"] > 0:
        cat = d["by_category"]
        share = (cat["attention"] + cat["memory copies"]) / d["busy_us"]
        if share > 0.5:
            out.append(f"decode: attention + copies take {share:.0%} of GPU time -> check the KV layout and the paged "
                       f"decode kernel ({', '.join(sorted(d['backends'].get('attention', ()))) or 'graph-replayed'}), "
                       f"or the batch is too small to fill the GPU")
        if cat["GEMM"] / d["busy_us"] > 0.5:
            quant = llm.runner.weight_format  # --quantize or the checkpoint's own format
            floor = _weight_floor_ms(llm)
            per = cat["GEMM"] / d["steps"] / 1e3
            of = f", {per / floor:.2f}x" if floor else ""
            extra = (f" (weight-read floor {floor:.3f} ms/step{of}" + (f", {quant} weights" if quant else "") + ")"
                     if floor else "")
            nxt = ("the weight-only kernel is below its bytes' rate (docs/dense.md, what bounds it)" if quant
                   else "weight-bandwidth bound; a faster decode GEMM or fp8 weights move it")
            out.append(f"decode: GEMM takes {cat['GEMM'] / d['busy_us']:.0%} of GPU time, {per:.3f} ms/step{extra}: {nxt}")
    host = (res.get("host_ms") or {}).get("decode")
    if d and res["on_gpu"] and host and d["steps"]:
        work = sum(v for k, v in host.items() if k != "wait")
        gpu = d["busy_us"] / d["steps"] / 1e3
        if work > gpu:
            big = max((k for k in host if k != "wait"), key=lambda k: host[k])
            out.append(f"decode: host work {work:.3f} ms/step exceeds the GPU's {gpu:.3f} ms/step -> host-bound; "
                       f"the largest part is '{big}' ({host[big]:.3f} ms; times under the profiler)")
    for name, p in ph.items():
        if res["on_gpu"] and p["wall_us"] > 0 and p["idle_us"] / p["wall_us"] > 0.3:
            why = ["host-side scheduling / Python overhead"]
            r = llm.runner
            if name == "decode" and (not r.use_graphs or len(r.graphs) < len(r.buckets)):
                why.append("decode CUDA graphs not captured" + (
                    f" ({len(r.graph_errors)} buckets failed: {next(iter(r.graph_errors.values()))[:80]})"
                    if r.graph_errors else f" ({r.graphs_off_reason})"))
            if name == "prefill" and r.prefill_buckets and len(r.prefill_graphs) < len(r.prefill_buckets):
                why.append("prefill CUDA graphs not captured" + (
                    f" ({len(r.prefill_graph_errors)} buckets failed: "
                    f"{next(iter(r.prefill_graph_errors.values()))[:80]})" if r.prefill_graph_errors
                    else f" ({r.prefill_graphs_off})"))
            if phase_backends.get(("sampling", "decode")) == "reference":
                why.append("sampler fallback (sampling runs the reference host loop)")
            if any("grammar" in s.state for s in llm.scheduler.running):
                why.append("grammar bitmask filled on the CPU critical path")
            out.append(f"{name}: GPU idle {p['idle_us'] / p['wall_us']:.0%} of the step time -> " + "; ".join(why))
    return out


def _weight_floor_ms(llm):
    """Read time of one decode step's weights at the measured ceiling; quantised projections count
    their bytes as stored (ModelRunner.decode_weight_bytes)."""
    c = hw.ceilings(measure=False)
    r = llm.runner
    wb = r.decode_weight_bytes(r.max_seqs)
    return wb / (c.read_tbps * 1e12) * 1e3 if c else None


def profile_engine(llm, prompts: list, params, steps: int, trace_path=None) -> dict:
    """Run up to ``steps`` engine steps of a workload under torch.profiler, then finish it unprofiled."""
    import torch  # heavy: loaded when the engine is profiled, not when a trace is read
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    plist = params if isinstance(params, list) else [params] * len(prompts)
    from opmap.engine.metrics import StepStats  # the engine loads only when it is profiled

    llm.add_requests(prompts, plist)
    n = 0
    llm.stats = StepStats()
    with profile(activities=acts) as prof:
        while llm.scheduler.has_unfinished() and n < steps:
            llm.step()
            n += 1
    host = llm.stats.host_ms_per_step()
    while llm.scheduler.has_unfinished():
        llm.step()
    llm.drain()
    path = trace_path or os.path.join(tempfile.mkdtemp(prefix="opmap-profile-"), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        doc = json.load(f)
    res = analyse(doc, moe=llm.cfg.is_moe)
    graph_backends(res, llm)
    res["analysis"] = analyze.analyze(trace.from_chrome(doc, path))  # what `opmap profile --trace` makes of it
    if trace_path is None:
        os.remove(path)
    res["profiled_steps"] = n
    res["host_ms"] = host  # host time per step and part, under the profiler (which slows the host)
    res["trace"] = trace_path
    return res


def quant_lines(llm) -> list:
    """Which backend runs each quantised layer, per phase, and the fallbacks: a layer whose
    backend dequantises the weight for a GEMM in the model's dtype, and checkpoint tensors
    dequantised at load because no kernel takes them quantised ([] for an unquantised engine)."""
    r = llm.runner
    fmt, dn = r.weight_format, dtype_name(r.dtype)
    out = []
    if fmt:
        by = {}
        for label, c in _choices(r):
            if c.op == "gemm" and c.spec.weight_dtype == fmt:
                by.setdefault((c.spec.phase, c.backend.name), []).append(label)
        for (phase, name), labels in by.items():
            line = f"{fmt} weights, {phase}: {', '.join(dict.fromkeys(labels))} run `{name}`"
            # the fp32 reference is the one registered gemm backend that dequantises the weight
            # (triton-wo and the gluon-wo kernels convert tiles in registers, scaled-mm reads fp8 and
            # quantises the activations)
            if name == "reference":
                line += (f" -> fallback: the weight is dequantised for a {dn} GEMM on every call "
                         "(twice the weight bytes of a weight-only kernel, or more)")
            elif name == "dequant-cublas":
                line += (f" -> dequantise then {dn} GEMM: one pass writes each weight in {dn} per call, then "
                         "cuBLAS (the many-row path where scaled-mm does not serve it, docs/dense.md)")
            elif name == "scaled-mm":  # the engine's activations are its dtype: scaled-mm quantises them
                line += (" -> fp8 activations: each row quantised per token to fp8 for fp8 tensor cores (W8A8 "
                         "dynamic; the many-row path on sm90, docs/dense.md)")
            out.append(line)
    eq = getattr(r.model, "expert_quant", None)
    if eq:  # routed experts kept quantised: the MoE backend reads them as stored
        by = {}
        for _, c in _choices(r):
            if c.op == "moe":
                by.setdefault(c.backend.name, []).append(c.spec.phase)
        for name, phases in by.items():
            line = (f"{eq[0]} routed experts, {', '.join(dict.fromkeys(phases))}: MoE runs `{name}`"
                    + (" on them as stored" if name != "dequant-triton" else ""))
            if name == "reference":
                line += " -> fallback: every expert dequantised for an fp32 loop on every call"
            elif name == "dequant-triton":
                line += (f" -> dequantise then {dn} grouped GEMM: one pass writes every expert's weights in {dn} "
                         "per call (the many-rows-an-expert route, docs/moe.md)")
            out.append(line)
    deq = r.model.dequantised
    if deq:
        out.append(f"{len(deq)} quantised checkpoint tensors were dequantised to {dn} at load "
                   f"({', '.join(deq[:3])}{' ...' if len(deq) > 3 else ''}) -> fallback: their GEMMs read "
                   f"{dn} weights (no {fmt or 'quantised'} kernel for them)")
    if llm.ecfg.kv_cache_dtype:
        att = {c.backend.name for _, c in _choices(r) if c.op == "attention"}
        out.append(f"{llm.ecfg.kv_cache_dtype} KV cache: attention `{'`, `'.join(sorted(att))}` reads the quantised "
                   "pages with a scale per KV head")
    return out


def graph_backends(res: dict, llm) -> None:
    """A replayed CUDA graph has no operator ranges, so its kernels carry no backend: name the
    backend the runner's op set chose for each such category, marked "(graph)"."""
    r = llm.runner
    # the op sets whose steps were captured: each decode bucket's, and the padded prefill buckets'
    # (those from many_tokens on run their own set)
    sets = {"decode": [r.decode_ops[b] for b in r.graphs if b in r.decode_ops], "prefill": []}
    if r.prefill_graphs:
        padded_of = getattr(r, "padded_ops_of", None)
        sets["prefill"] = list({id(o): o for o in (padded_of(tb) if padded_of else r.padded_ops
                                                 for tb in r.prefill_graphs)}.values())
    for name, p in res["phases"].items():
        named = {cat for cat, names in p["backends"].items() if names}  # by their ranges: left as they are
        for ops in sets.get(name, []):
            for _, _, c in ops.choices:
                cat = OP_CATEGORY.get(c.op)
                if cat and p["by_category"].get(cat) and cat not in named:
                    p["backends"].setdefault(cat, set()).add(f"{c.backend.name} (graph)")


def _choices(runner):
    """(label, Choice) of every op set of the runner: padded prefill (graph-replayed where
    captured), prefill, mixed (and, with quantised weights, those planned per row count; with
    quantised experts, those of many-token steps), each decode bucket."""
    extra = [getattr(runner, "padded_ops", None), *runner.ops.values(), *getattr(runner, "mixed_rows", {}).values(),
             *getattr(runner, "many_token_ops", {}).values()]
    for ops in [*(o for o in extra if o is not None), *runner.decode_ops.values()]:
        for label, _, c in ops.choices:
            yield label, c


def phase_backends(llm) -> dict:
    out = {}
    for _, c in _choices(llm.runner):
        out.setdefault((c.op, c.spec.phase), c.backend.name)
    for _, c in llm.sampler.choices:
        out.setdefault((c.op, "decode"), c.backend.name)
    return out


def format_kernels(res: dict, top: int = 20) -> list:
    """Per phase, the kernels by GPU time: launches per step, us per step, us per launch (what
    the per-layer accounting in docs/engine.md was read from)."""
    lines = []
    for name, p in res["phases"].items():
        n = max(p["steps"], 1)
        what = "kernels by GPU time" if res["on_gpu"] else "operators by host time (CPU run)"
        lines.append(f"[{name}] {what} ({p['steps']} steps)")
        times = sum(p["symbols"].values(), Counter())  # per symbol, over the categories
        for sym, t in times.most_common(top):
            k = p["launches"][sym]
            lines.append(f"  {t / n:9.1f} us/step {k / n:7.1f} launches/step {t / k:8.2f} us each  {sym}")
            grids = p.get("grids", {}).get(sym, {})
            if 1 < len(grids) <= MAX_GRIDS:  # a few launch shapes of one symbol: each its own line
                for g, tg in grids.most_common():
                    kg = p["grid_launches"][sym][g]
                    lines.append(f"  {'':9} {tg / n:9.1f} us/step {kg / n:7.1f} launches/step {tg / kg:8.2f} us each"
                                 f"  grid {g}")
    return lines


# A symbol launched with more grids than this in a phase (prefill steps of many token counts) keeps
# its one line; up to it, each grid (a decode step's QKV, O and router GEMMs) gets a line of its own.
MAX_GRIDS = 6


def format_host_ops(res: dict, top: int = 20) -> list:
    """Per phase, the operators by host time inside their ranges (argument checks, launch, Python):
    what an eager step whose GPU waits on the host spends it on (captured decode steps replay a
    graph and have no such ranges), then the CUDA API calls of the step (launches, allocations,
    waits)."""
    lines = []
    for name, p in res["phases"].items():
        n = max(p["steps"], 1)
        total = sum(p["host_ops"].values())
        if total:
            lines.append(f"[{name}] operators by host time ({p['steps']} steps; {total / n / 1e3:.3f} ms/step in "
                         f"operator ranges of {p['wall_us'] / n / 1e3:.3f} ms/step host wall)")
        lines += _per_call(p["host_ops"], p["host_calls"], n, top)
        if p["host_api"]:
            lines.append(f"[{name}] CUDA API calls by host time ({sum(p['host_api'].values()) / n / 1e3:.3f} ms/step)")
            lines += _per_call(p["host_api"], p["host_api_calls"], n, top)
    return lines


def _per_call(times: Counter, calls: Counter, steps: int, top: int) -> list:
    return [f"  {t / steps:9.1f} us/step {calls[label] / steps:7.1f} calls/step {t / calls[label]:8.2f} us each  {label}"
            for label, t in times.most_common(top)]


def python_hotspots(llm, prompts: list, params, top: int = 20) -> list:
    """The Python functions with the most own host time over one run of the workload under cProfile
    (no torch profiler): what the host time of eager steps is made of below the operator ranges
    (argument checks, launcher code, allocation). cProfile slows each Python call; the ranking is
    the figure, the times are upper bounds."""
    from opmap.engine.metrics import StepStats  # the engine loads only when it is profiled

    llm.stats = StepStats()
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, params)
    prof.disable()
    steps = ", ".join(f"{v} {k}" for k, v in llm.stats.steps.items() if v)
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (primitive calls, calls, own, cumulative, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    total = sum(v[2] for v in stats.values())
    lines = [f"Python functions by own host time (cProfile over {steps} steps; {total * 1e3:.1f} ms in all)"]
    for (file, line, fn), (_, calls, own, cum, _) in rows:
        where = f"{_short(file)}:{line}({fn})" if line else fn
        lines.append(f"  {own * 1e3:9.2f} ms {calls:8d} calls {own / max(calls, 1) * 1e6:8.2f} us each "
                     f"(cum. {cum * 1e3:8.2f} ms)  {where}")
    return lines


def _short(path: str) -> str:
    """A source path from the package root on (opmap/..., torch/..., triton/...)."""
    for root in ("opmap", "torch", "triton", "transformers"):
        i = path.rfind(f"/{root}/")
        if i >= 0:
            return path[i + 1:]
    return os.path.basename(path)


def format_profile(res: dict) -> list:
    lines = []
    if res["on_gpu"]:
        lines.append("GPU times per kernel exclude what overlaps an earlier kernel (PDL launches early), so the "
                     "categories add up to the busy time")
    for name, p in res["phases"].items():
        n = max(p["steps"], 1)
        head = f"[{name}] {p['steps']} steps, {p['wall_us'] / n / 1e3:.3f} ms/step host wall"
        if res["on_gpu"]:
            head += f", GPU busy {p['busy_us'] / n / 1e3:.3f} ms/step, idle {p['idle_us'] / n / 1e3:.3f} ms/step"
        lines.append(head)
        if res.get("host_ms", {}).get(name):
            from opmap.engine.metrics import host_line  # the engine loads only when it is profiled

            lines.append("  host: " + host_line(res["host_ms"][name]))
        total = sum(p["by_category"].values()) or 1.0
        for cat in CATEGORIES:
            t = p["by_category"].get(cat, 0.0)
            if not t:
                continue
            be = ",".join(sorted(p["backends"].get(cat, ()))) or "graph/unattributed"
            top = ", ".join(s for s, _ in p["symbols"][cat].most_common(3))
            lines.append(f"  {cat:<14} {t / n / 1e3:9.3f} ms/step {t / total:6.1%}  [{be}]  {top}")
    return lines


def report_summary(model: str) -> dict:
    """The profile of a short batch-8 workload on random weights (for `opmap report`)."""
    # the engine (and torch) load only when it is profiled, not when a trace is read
    import torch
    from opmap.engine.llm import LLM
    from opmap.engine.params import SamplingParams

    # A fixed small cache (8 x 544 tokens, with room to spare): the caller may still hold another
    # engine, whose KV cache would leave a from-free-memory sizing nothing.
    with LLM(model, trace_ops=True, max_num_seqs=8, num_pages=8 * 40, max_model_len=640) as llm:
        g = torch.Generator().manual_seed(0)
        n = min(512, llm.max_model_len - 40)
        prompts = [torch.randint(0, llm.cfg.vocab, (n,), generator=g).tolist() for _ in range(8)]
        sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        res = profile_engine(llm, prompts, sp, steps=40)
        rules = diagnose(res, llm, phase_backends(llm))
        lines = format_profile(res) + quant_lines(llm) + rules
    phases = {ph: {"steps": p["steps"], "categories": p["categories"]} for ph, p in res["analysis"]["phases"].items()}
    return {"workload": f"batch 8, prompt {n}, 32 new tokens, first 40 steps", "lines": lines, "phases": phases,
            "diagnosis": rules}
