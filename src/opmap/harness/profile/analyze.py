"""Any engine's trace on the operator map: each kernel's category (in this order of evidence: the
host ranges open at its launch, the CPU op that launched it, its symbol through the symbol table),
the trace split into engine steps and each step labelled prefill / decode / mixed, then per phase
the GPU time per category and library, idle time, top kernels, and the diagnosis rules."""
from __future__ import annotations

import bisect
import functools
import re
import statistics
from collections import Counter, defaultdict

from opmap.harness.profile import ours
from opmap.harness.profile import symbols
from opmap.harness.profile.ours import OP_CATEGORY as _OP_CATEGORY
from opmap.harness.profile.trace import Trace

# Host ranges that name an operator: opmap's own (opmap::<op>::<label>::<backend>), and the module
# names of HF / vLLM / SGLang layers where an engine emits them.
_OP_RANGE = re.compile(r"^opmap::(\w+)::")
# Matched innermost range first (HF's apply_rotary_pos_emb runs inside its attention module).
_MODULE_RANGES = [("RoPE", re.compile(r"(?i)rotary|apply_rotary_pos_emb|rotate_half")),
                  ("norm", re.compile(r"(?i)(layernorm|RMSNorm|_norm\b|Norm_\d+$)")),
                  ("activation", re.compile(r"nn\.Module: (SiLU|GELU|GELUTanh|PytorchGELUTanh|SiLUActivation|"
                                            r"NewGELUActivation|ACT2FN)\w*")),
                  ("MoE", re.compile(r"(?i)(sparse_moe|moe_block|SparseMoe|FusedMoE|MoE\w*_\d+$|\bexperts\b|"
                                     r"Experts_\d+$)")),
                  ("attention", re.compile(r"(?i)(self_attn|attention|Attention\w*|_attention_forward|repeat_kv)\b")),
                  ("sampling", re.compile(r"LogitsProcessor|\): (sample|top_k_top_p|apply_penalties)$"))]
# Step ranges: opmap's, vLLM's and SGLang's model-runner calls, the profiler's step marks.
_STEP = [re.compile(p) for p in (r"^opmap::step::(prefill|decode|mixed)$", r"execute_model", r"^(run_batch|forward_batch)",
                                   r"^ProfilerStep#\d+$")]
# FlashInfer's tensor-core decode (use_tensor_cores=True) launches its prefill kernel without a
# mask (MaskMode 0) on 16-row query tiles; a causal prefill has MaskMode 1.
_DECODE = re.compile(r"(?i)decode|splitkv|split_kv|paged_attention|xqa|mmha|flash_fwd_splitkv|flash_mla|flashmla|"
                     r"unified_attention|BatchPrefillWithPagedKVCacheKernel<\w+, flashinfer::KernelTraits<"
                     r"\(flashinfer::MaskMode\)0, 16u")
# Kernels that serve one phase only; cuDNN / PyTorch SDPA and FlashAttention's plain forward run
# HF's decode steps as well as its prefill, so they say nothing of the phase.
_SORT = re.compile(r"(?i)sort|radix")
_PREFILL = re.compile(r"(?i)prefill|fmha|RaggedKVCache|_prefill_tma_kernel|context_attention")


def category_of(k) -> tuple[str, str, str]:
    """(category, library, evidence) of a kernel: "range", "launcher" or "symbol"."""
    return _category(k.name, k.launcher, k.ranges)


@functools.lru_cache(maxsize=65536)  # one answer per (symbol, launcher, ranges): a step repeats them
def _category(name: str, launcher, ranges: tuple) -> tuple[str, str, str]:
    cat, lib = symbols.classify(name)
    for r in reversed(ranges):
        m = _OP_RANGE.match(r)
        if m and m.group(1) in _OP_CATEGORY:
            return _OP_CATEGORY[m.group(1)], lib if lib != "unknown" else "opmap", "range"
    if cat != "other" and lib not in ("PyTorch", "unknown", "cuBLAS", "CUTLASS", "Inductor", "CUDA"):
        return cat, lib, "symbol"  # a library's own kernel says what it is
    if cat in ("other", "GEMM", "memory copies", "sampling"):
        for r in reversed(ranges):  # innermost first
            c = next((c for c, rx in _MODULE_RANGES if rx.search(r)), None)
            if c is None:
                continue
            if cat == "GEMM" and c != "MoE":
                break  # a projection inside a layer is a GEMM; an expert's GEMM is the MoE's
            return c, lib, "range"
    by_launcher = symbols.launcher_category(launcher)
    if by_launcher and (cat in ("other", "memory copies", "GEMM") or by_launcher == "attention"):
        return by_launcher, lib, "launcher"
    return cat, lib, "symbol"


_OP_BACKEND = re.compile(r"^opmap::(\w+)::[^:]*::([\w.-]+)$")


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


def _patterns(kernels: list) -> dict:
    """id(kernel) -> (category, library, "pattern") for the kernels of one step that only the
    shape of a forward pass names (symbols.json, "motifs"): runs of launching ops that spell an
    operator, and what follows the step's last GEMM. Only kernels no range or symbol named."""
    open_ = [k for k in kernels if category_of(k)[0] in ("other", "memory copies")]
    if not open_:
        return {}
    out = {}
    seq = [(k, (k.launcher or "?").replace("aten::", "")) for k in kernels]
    seq = [(k, op) for k, op in seq if op not in ("copy_", "_to_copy", "to", "contiguous")]
    text, starts = "", []
    for _, op in seq:
        starts.append(len(text))
        text += op + " "
    for cat, rx in symbols.motifs():
        for m in rx.finditer(text):
            i = bisect.bisect_left(starts, m.start())
            j = bisect.bisect_left(starts, m.end())
            for k, _ in seq[i:j]:
                if id(k) not in out and category_of(k)[0] in ("other", "memory copies"):
                    out[id(k)] = (cat, category_of(k)[1], "pattern")
    gemms = [n for n, k in enumerate(kernels) if category_of(k)[0] == "GEMM"]
    if gemms:
        for k in kernels[gemms[-1] + 1:]:
            if id(k) not in out and category_of(k)[0] == "other":
                out[id(k)] = (symbols.after_last_gemm(), category_of(k)[1], "pattern")
    return out


def steps_of(trace: Trace) -> list[dict]:
    """Engine steps: the step ranges where the engine emits them (kernels by the range open at
    their launch), else bursts of GPU work split at host gaps. Each: name, kernels, ts, end."""
    ks = trace.kernels
    named = [r for r in trace.ranges if any(p.search(r[0]) for p in _STEP)]
    if named and ks:
        by_name: dict = {}
        starts = [r[1] for r in named]
        for k in ks:
            open_ = [r for r in k.ranges if any(p.search(r) for p in _STEP)]
            if open_:
                by_name.setdefault(_launch_step(k, named), []).append(k)
            elif trace.kind == "chrome-cpu":
                # an op of another thread (gloo's collectives): the step range its time falls in
                i = bisect.bisect_right(starts, k.ts) - 1
                if i >= 0 and k.ts <= named[i][1] + named[i][2]:
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
    chooses = [_chooses(k) for k in ks]
    sampled = any(chooses)
    parts, cur, seen = [], [], False
    for k, c in zip(ks, chooses):
        cur.append(k)
        seen = seen or c
        if ("DtoH" in k.name or "Device -> Pageable" in k.name or "Device -> Pinned" in k.name) and (seen or not sampled):
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


# The kernels that pick the tokens (not the scans and reductions the sampling category also holds,
# which metadata preparation launches too, e.g. a cumsum of page counts).
_CHOOSE = re.compile(r"(?i)argmax|multinomial|topk|top_k|sampling|gumbel|exponential")


def _chooses(k) -> bool:
    return bool(_CHOOSE.search(f"{k.name} {k.launcher or ''}"))


def _launch_step(k, named) -> tuple:
    """The step range (name, ts, dur) whose name is the innermost step range open at k's launch."""
    want = next(r for r in reversed(k.ranges) if any(p.search(r) for p in _STEP))
    cands = [r for r in named if r[0] == want and r[1] <= k.ts]
    return cands[-1] if cands else (want, k.ts, 0.0)


def label(step: dict, median_busy_us: float) -> tuple[str, str]:
    """(phase, confidence) of a step: from its range name (high), from the attention kernels it
    ran (medium), else from its GPU busy time against the run's median step (low: a prefill
    step computes over the prompt, a decode step over one token per sequence)."""
    name = step["name"] or ""
    m = re.match(r"^opmap::step::(\w+)$", name)
    if m:
        return m.group(1), "high"
    att = [k.name for k in step["kernels"] if category_of(k)[0] == "attention"]
    dec = any(_DECODE.search(n) for n in att)
    pre = any(_PREFILL.search(n) and not _DECODE.search(n) for n in att)
    if dec or pre:
        return ("mixed" if dec and pre else "decode" if dec else "prefill"), "medium"
    return ("prefill" if _busy(step["kernels"]) >= 1.15 * median_busy_us else "decode"), "low"


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


def _busy(kernels) -> float:
    """Time covered by at least one of the kernels."""
    return measure(union((k.ts, k.ts + k.dur) for k in kernels))


def analyze(trace: Trace, top: int = 5, steps=None) -> dict:
    """The per-phase breakdown (times in ms) with ``other_fraction``, ``backends`` and ``diagnosis``
    (``steps``: the trace's ``steps_of``, where the caller has them already)."""
    steps = steps_of(trace) if steps is None else steps
    median_busy = statistics.median([_busy(s["kernels"]) for s in steps]) if len(steps) > 1 else 0.0
    phases: dict = {}
    libs: dict = defaultdict(Counter)
    evidence = Counter()
    total = other = generic = 0.0
    for s in steps:
        ph, conf = label(s, median_busy)
        p = phases.setdefault(ph, {"steps": 0, "gpu_ms": 0.0, "wall_ms": 0.0, "idle_ms": 0.0,
                                   "categories": Counter(), "libraries": defaultdict(Counter), "kernels": Counter(),
                                   "confidence": Counter(), "opmap": Counter()})
        p["steps"] += 1
        p["confidence"][conf] += 1
        busy = _busy(s["kernels"]) / 1e3
        wall = (s.get("wall_end", s["end"]) - s["ts"]) / 1e3
        p["gpu_ms"] += busy
        p["wall_ms"] += wall
        p["idle_ms"] += max(wall - busy, 0.0)
        # each kernel's time not covered by an earlier one, so categories add up to the busy time
        end = float("-inf")
        named = _patterns(s["kernels"])
        for k in sorted(s["kernels"], key=lambda k: k.ts):
            t = max(k.ts + k.dur - max(k.ts, end), 0.0) / 1e3
            end = max(end, k.ts + k.dur)
            cat, lib, how = named.get(id(k)) or category_of(k)
            p["categories"][cat] += t
            p["libraries"][cat][lib] += t
            p["kernels"][k.name[:100]] += t
            be = opmap_backend(k.name, k.ranges)
            if be:
                p["opmap"][be] += t
            if cat == "sampling" and _SORT.search(k.name):
                p["sorts"] = True
            libs[cat][lib] += t
            evidence[how] += t
            total += t
            other += t if cat == "other" else 0.0
            generic += t if cat == "other" and lib == "PyTorch" else 0.0
    out_phases = {}
    for ph, p in phases.items():
        out_phases[ph] = {"steps": p["steps"], "gpu_ms": round(p["gpu_ms"], 4), "idle_ms": round(p["idle_ms"], 4),
                          "wall_ms": round(p["wall_ms"], 4),
                          "categories": {c: round(v, 4) for c, v in p["categories"].most_common()},
                          "libraries": {c: dict(v.most_common()) for c, v in p["libraries"].items()},
                          "top_kernels": [[n, round(v, 4)] for n, v in p["kernels"].most_common(top)],
                          "label_confidence": dict(p["confidence"]), "sampling_sorts": p.get("sorts", False),
                          "opmap_backends": {b: round(v, 4) for b, v in p["opmap"].most_common()}}
    res = {"source": trace.source, "kind": trace.kind, "kernels": len(trace.kernels), "steps": len(steps),
           "phases": out_phases, "other_fraction": round(other / total, 4) if total else 0.0,
           "backends": {c: [lib for lib, _ in v.most_common()] for c, v in libs.items()},
           "evidence": {k: round(v / total, 4) for k, v in evidence.items()} if total else {},
           "other_generic": round(generic / total, 4) if total else 0.0}
    res["diagnosis"] = rules(res, trace)
    return res


def rules(res: dict, trace: Trace) -> list:
    """The operator-layer playbook's rules, each line with the numbers it fired on."""
    out = []
    dev = "host" if trace.kind == "chrome-cpu" else "GPU"
    for ph, p in res["phases"].items():
        gpu = p["gpu_ms"] or 1e-9
        cats = p["categories"]
        share = lambda *cs: sum(cats.get(c, 0.0) for c in cs) / gpu  # noqa: E731
        if ph == "prefill" and share("attention", "GEMM") > 0.7:
            out.append(f"prefill: attention + GEMM take {share('attention', 'GEMM'):.0%} of {dev} time -> the compute "
                       f"path: attention {_libs(p, 'attention')}, GEMM {_libs(p, 'GEMM')} (fusion, parallelism, a faster "
                       "attention kernel)")
        if ph == "decode" and share("attention", "memory copies") > 0.5:
            out.append(f"decode: attention + memory copies take {share('attention', 'memory copies'):.0%} of {dev} time "
                       f"-> the KV layout, the paged decode kernel ({_libs(p, 'attention')}), or too small a batch")
        if p["wall_ms"] and p["idle_ms"] / p["wall_ms"] > 0.3:
            per = p["idle_ms"] / max(p["steps"], 1)
            why = ["scheduling / Python on the host", "CUDA graphs not captured"]
            if p.get("sampling_sorts"):
                why.append("a sampler fallback (sort-based sampling where a sorting-free kernel exists)")
            out.append(f"{ph}: the GPU is idle {p['idle_ms'] / p['wall_ms']:.0%} of the step time ({per:.3f} ms a step) "
                       f"-> the host: {'; '.join(why)}")
        if share("communication") > 0.2:
            out.append(f"{ph}: communication takes {share('communication'):.0%} of {dev} time "
                       f"({_libs(p, 'communication')}) -> the TP/EP layout, not the attention kernel")
        if p.get("sampling_sorts"):
            out.append(f"{ph}: sampling runs PyTorch's sort ({cats.get('sampling', 0):.3f} ms) -> a sorting-free "
                       "sampler (opmap's, FlashInfer's) serves top-k / top-p without it")
    quant = [k for k in trace.kernels if _quant_symbol(k.name)]
    q_gemm = [k for k in quant if symbols.classify(k.name)[0] in ("GEMM", "MoE") and not _DEQUANT.search(k.name)]
    if quant and not q_gemm:
        out.append(f"quantised tensors are converted ({len(quant)} kernels such as {quant[0].name[:60]}) but no fp8 / "
                   "int8 GEMM ran: the quantised path fell back to a dequantise kernel and a bf16 GEMM")
    if res["other_fraction"] > 0.1:
        generic = res.get("other_generic", 0.0)
        if generic >= 0.5 * res["other_fraction"] and any(r[0].startswith("nn.Module: ") for r in trace.ranges):
            out.append(f"{res['other_fraction']:.0%} of {dev} time is in generic PyTorch kernels launched outside every "
                       "module: the engine's own loop (HF generate's stopping checks and bookkeeping), not an operator")
        elif generic >= 0.5 * res["other_fraction"]:
            out.append(f"{res['other_fraction']:.0%} of {dev} time is in generic PyTorch kernels (elementwise, reductions) "
                       "with no operator range or module around their launch: record with "
                       "torch.profiler.profile(with_stack=True) for the module names, or emit record_function ranges")
        else:
            out.append(f"{res['other_fraction']:.0%} of {dev} time is in kernels the symbol table does not know "
                       "(opmap/harness/profile/symbols.json): add their symbols")
    return out


# opmap's weight-only GEMMs (the kernels of its quantised-only gemm backends, from the registry) and its prefill pass
# that dequantises a weight for a bf16
# GEMM (_dequant_kernel) carry no dtype in their symbols
_DEQUANT = re.compile(r"(?i)dequant")


@functools.lru_cache(maxsize=65536)
def _quant_symbol(name: str) -> bool:
    return re.search(r"(?i)e4m3|fp8|float8|int8|dequant", name) is not None or ours.low_precision_gemm(name)


def _libs(p: dict, cat: str) -> str:
    return ", ".join(p["libraries"].get(cat, {})) or "none"


def format_lines(res: dict) -> list:
    cpu = res.get("kind") == "chrome-cpu"  # no GPU activity: the host's outermost ops stand for kernels
    what, dev = ("host ops", "host") if cpu else ("kernels", "GPU")
    lines = [f"{res['source']}: {res['kernels']} {what} in {res['steps']} steps "
             f"({res['other_fraction']:.1%} of {dev} time in 'other')"]
    for ph, p in res["phases"].items():
        n = max(p["steps"], 1)
        conf = ", ".join(f"{v} {k}" for k, v in p["label_confidence"].items())
        lines.append(f"[{ph}] {p['steps']} steps (labels: {conf}); {dev} busy {p['gpu_ms'] / n:.3f} ms/step, "
                     f"idle {p['idle_ms'] / n:.3f} ms/step")
        for cat, ms in p["categories"].items():
            lines.append(f"  {cat:<14} {ms / n:9.3f} ms/step {ms / (p['gpu_ms'] or 1):6.1%}  "
                         f"[{', '.join(p['libraries'].get(cat, {}))}]")
        for name, ms in p["top_kernels"][:3]:
            lines.append(f"    {ms / n:8.3f} ms/step  {name}")
        if p.get("opmap_backends"):
            lines.append("  opmap backends: " + ", ".join(f"{b} {ms / n:.3f}" for b, ms in p["opmap_backends"].items())
                         + " ms/step")
    return lines + [f"diagnosis: {d}" for d in res["diagnosis"]]


def summary_json(res: dict) -> dict:
    """The JSON ``--json`` writes."""
    return {k: res[k] for k in ("source", "kind", "kernels", "steps", "phases", "other_fraction", "backends",
                                "diagnosis", "evidence")}

