"""`opmap bench`: every provider of every BenchCase timed in the same run on the same inputs,
as a fraction of this GPU's measured ceilings; results to bench/baselines/<gpu>/<family>.json +
.md + roofline .png, one file per op family, replaced by each run. Tuning variants of our kernels
run only with ``--variants``. On a machine without a GPU it says so and writes nothing."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import sys
import threading
import time
from typing import Callable, Optional

import torch
from rich.table import Table
from rich.text import Text

from opmap.core import hw, registry
from opmap.core.select import BackendError, select
from opmap.harness.bench import report, timing
from opmap.harness.bench.base import BenchCase, Provider
from opmap.harness.bench.cases import FAMILIES
from opmap.harness.bench.report import family_of
from opmap.harness.names import closest
from opmap.harness.output import environment, wide_console
from opmap.harness.workpool import child_cmd, default_workers, run_queue


def collect(quick: bool, families=FAMILIES, model_specs: Optional[dict] = None) -> tuple[list[BenchCase], list[dict]]:
    """Each family's cases (its module's ``cases(quick)``); with ``model_specs`` ({op: [spec]} of a
    model's op map) instead those at the model's own widths, of the families that build them
    (``model_cases(model_specs, quick)``; the others have only their fixed grid)."""
    cases, errors = [], []
    for fam in families:
        modname = f"opmap.harness.bench.cases.{fam}"
        try:
            mod = importlib.import_module(modname)
            if model_specs is None:
                built = mod.cases(quick)
            else:
                built = mod.model_cases(model_specs, quick) if hasattr(mod, "model_cases") else []
            cases += [dataclasses.replace(c, family=family_of(c.op, fam)) for c in built]
        except ModuleNotFoundError as e:
            if e.name != modname:
                errors.append({"family": fam, "error": f"{type(e).__name__}: {e}"})
        except Exception as e:
            errors.append({"family": fam, "error": f"{'model cases: ' if model_specs is not None else ''}"
                                                   f"{type(e).__name__}: {e}"})
    return cases, errors


def op_root(case: BenchCase) -> str:
    return case.op.split(".", 1)[0]


def keep(case: BenchCase, ops: Optional[list], model_ops: Optional[set], mla: Optional[bool] = None) -> bool:
    # A prefix of the op's name: "attention" takes attention.*, "attention.mla" takes
    # attention.mla_decode, attention.mla_prefill, ...
    if ops and not any(case.op.startswith(o) or op_root(case) == o for o in ops):
        return False
    kind = getattr(case.spec, "kind", None)
    if mla is not None and op_root(case) in ("attention", "kv_append") and kind in ("mla", "gqa", "mha", "mqa"):
        if (kind == "mla") != mla:
            return False  # MLA cases for an MLA model, the others for the rest
    if model_ops is not None:
        backend_ops = {p.backend[0] for p in case.providers if p.backend}
        return op_root(case) in model_ops or bool(backend_ops & model_ops) or case.op == "e2e"
    return True


def model_formats(cfg) -> set:
    """The weight / KV formats a model runs in on a GPU: bf16, and a quantised checkpoint's own
    weight format (a model's benchmarks skip the other formats' cases: `opmap bench --op gemm`
    times them)."""
    stored = (cfg.extra.get("weight_quant") or {}).get("format")
    return {"bf16"} | ({stored} if stored else set())


def in_formats(case: BenchCase, formats: Optional[set]) -> bool:
    if formats is None or case.spec is None:
        return True
    return all(getattr(case.spec, f, None) in (None, *formats) for f in ("weight_dtype", "kv_dtype"))


# The spec fields that place a benchmark case at a model's widths (not its batch or token count).
SHAPE_FIELDS = {"rmsnorm": ("hidden",), "rope": ("head_dim", "style"), "activation": ("kind", "hidden"),
                "attention": ("kind", "num_heads", "num_kv_heads", "head_dim", "page_size"),
                "kv_append": ("kind", "num_kv_heads", "head_dim", "page_size"), "gemm": ("n", "k"),
                "moe": ("num_experts", "top_k", "hidden", "intermediate"),
                "sampling": ("vocab",), "logits": ("vocab",), "grammar_mask": ("vocab",)}


def _fits(c: BenchCase, model_specs: dict) -> bool:
    """Whether the case's spec equals one of the model's on the op's SHAPE_FIELDS (or the op has no
    widths to compare)."""
    fields = SHAPE_FIELDS.get(op_root(c))
    mine = model_specs.get(op_root(c))
    if not fields or not mine or c.spec is None:
        return True
    return any(all(getattr(c.spec, f, None) == getattr(m, f, None) for f in fields if hasattr(m, f)) for m in mine)


def at_model_widths(cases: list[BenchCase], model_specs: dict) -> list[BenchCase]:
    """The cases whose spec equals one of the model's (``{op: [spec]}`` of its op map) on the op's
    SHAPE_FIELDS: a Llama-3-8B report times RMSNorm at hidden 4096, not 8192. An op (e.g.
    attention.decode) with no case at the model's widths keeps all of its cases, so that the
    report still has its rows; ``off_widths`` names those ops."""
    fit = [_fits(c, model_specs) for c in cases]
    matched = {c.op for c, f in zip(cases, fit) if f}
    return [c for c, f in zip(cases, fit) if f or c.op not in matched]


def off_widths(cases: list[BenchCase], model_specs: dict) -> list[str]:
    """The ops of ``cases`` none of whose cases is at the model's widths: their rows are another
    model's shapes, and the bench output says so."""
    ops = {c.op for c in cases}
    return sorted(op for op in ops if not any(_fits(c, model_specs) for c in cases if c.op == op))


def why_not(p: Provider, case: BenchCase) -> Optional[str]:
    """Why this provider cannot be timed on this case here (None = it can)."""
    if p.available is not None:
        r = p.available()
        if r:
            return r
    if p.backend is not None:
        op, name = p.backend
        try:
            b = registry.get(op, name)
        except KeyError as e:
            return str(e)
        if case.spec is not None:
            reasons = b.validate(_local(case.spec), runtime=True)
            if reasons:
                return "; ".join(reasons)
        elif b.available is not None and b.available():
            return b.available()
    return None


def _local(spec):
    """The case's spec on this device's arch (cases are written for sm90)."""
    return spec.replace(arch=hw.local_arch()) if hasattr(spec, "arch") else spec


def selected_backend(case: BenchCase) -> Optional[str]:
    if case.spec is None:
        return None
    ops = {p.backend[0] for p in case.providers if p.backend}
    if len(ops) != 1:
        return None
    try:
        return select(ops.pop(), _local(case.spec)).name
    except BackendError:
        return None


def run_case(case: BenchCase, ceil, device, quick: bool) -> tuple[list[dict], list[dict]]:
    recs, skipped = [], []
    runnable = []
    for p in case.providers:
        r = why_not(p, case)
        if r:
            skipped.append({"op": case.op, "case": case.case, "provider": p.name, "reason": r,
                            "family": case.family})
        else:
            runnable.append(p)
    if not runnable:
        return recs, skipped
    n = timing.num_sets(case.bytes, max_sets=4 if quick else timing.MAX_SETS)
    sets = []
    try:
        for _ in range(n):
            sets.append(case.setup(device))
    except torch.cuda.OutOfMemoryError:
        if not sets:
            raise
        torch.cuda.empty_cache()  # fewer sets: still timed, with the count recorded
    chosen = selected_backend(case)
    for p in runnable:
        t0 = time.perf_counter()
        try:
            calls = [p.make(inp) for inp in sets]
            t = timing.time_calls(calls, graph=case.graph, rep_ms=40 if quick else 100)
        except Exception as e:  # one provider failing must not hide the others' numbers
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            skipped.append({"op": case.op, "case": case.case, "provider": p.name, "family": case.family,
                            "reason": f"failed: {type(e).__name__}: {str(e)[:200]}"})
            continue
        rec = {"op": case.op, "case": case.case, "family": case.family, "provider": p.name,
               "median_us": round(t.median_us, 3),
               **timing.figures(t.median_us, case.flops, case.bytes, case.bound, ceil),
               "bound": case.bound, "flops": case.flops, "bytes": case.bytes, "method": t.method,
               "input_sets": t.sets, "backend": "/".join(p.backend) if p.backend else None,
               # a variant is a config of the backend, not what the selector runs
               "selected": bool(chosen and p.backend and p.backend[1] == chosen and not p.variant),
               # wall time of this row: compiling / autotuning, graph capture and timing (where a run's time goes)
               "seconds": round(time.perf_counter() - t0, 2)}
        note = "; ".join(x for x in (t.note, p.describe() if p.describe else "") if x)
        if note:
            rec["note"] = note
        recs.append(rec)
    del sets
    torch.cuda.empty_cache()
    return recs, skipped


def only_providers(cases: list[BenchCase], names: Optional[list]) -> list[BenchCase]:
    """The cases with only the providers named (exact names, e.g. "opmap-triton" for our default
    and not its "opmap-triton[...]" variants); cases left with none are dropped. A name no case
    has is a ValueError naming the closest ones: a misspelt or invented config row used to be
    left out without a word, and the run timed only the other rows."""
    if not names:
        return cases
    have = {p.name for c in cases for p in c.providers}
    unknown = [n for n in names if n not in have]
    if unknown:
        raise ValueError(f"no benchmark row is named {', '.join(map(repr, unknown))} in the cases selected "
                         f"({len(cases)} cases, {len(have)} provider names). {closest(unknown, have, n=4)}")
    out = []
    for c in cases:
        provs = [p for p in c.providers if p.name in names]
        if provs:
            out.append(dataclasses.replace(c, providers=provs))
    return out


def without_variants(cases: list[BenchCase]) -> list[BenchCase]:
    """The cases with their tuning variants left out (the defaults against the peers)."""
    out = []
    for c in cases:
        provs = [p for p in c.providers if not p.variant]
        if provs:
            out.append(dataclasses.replace(c, providers=provs))
    return out


@functools.lru_cache(maxsize=8)
def model_facts(model: str) -> tuple:
    """({op: [spec]} of the model's step maps, as the report lists them; whether it is MLA; the
    weight / KV formats it runs in)."""
    # the engine's op sets and the model resolver load only when a model is asked about
    from opmap.engine.opset import planned_maps
    from opmap.model.hf import resolve_model

    cfg = resolve_model(model)[0]
    specs: dict = {}
    for rows in planned_maps(cfg, hw.local_arch()).values():
        for r in rows:
            specs.setdefault(r.op, []).append(r.spec)
    return specs, cfg.is_mla, model_formats(cfg)


def select_cases(ops=None, model=None, quick=False, providers: Optional[list] = None,
                 variants: bool = False) -> tuple:
    """(cases, load errors) that ``bench`` times with these arguments, in its order (the compile
    warm-up's workers rebuild the list from the same arguments)."""
    model_ops, mla, formats, model_specs = None, None, None, {}
    if model:
        model_specs, mla, formats = model_facts(model)
        model_ops = set(model_specs)
    cases, errors = collect(quick)
    if model:
        extra, more_errors = collect(quick, model_specs=model_specs)
        have = {(c.op, c.case) for c in cases}
        cases += [c for c in extra if (c.op, c.case) not in have]
        errors += more_errors
    cases = [c for c in cases if keep(c, ops, model_ops, mla) and in_formats(c, formats)]
    if model:
        cases = at_model_widths(cases, model_specs)
    cases = only_providers(cases, providers)
    if not (variants or providers):
        cases = without_variants(cases)
    return cases, errors


def bench(ops=None, model=None, quick=False, progress=True, partial: Optional[str] = None,
          providers: Optional[list] = None, variants: bool = False, warm_workers: Optional[int] = None,
          warmed: Optional[Callable[[], Optional[dict]]] = None) -> dict:
    """Run the cases on this GPU; returns the result document (not yet written). ``partial``: a
    JSON file rewritten after every case, so a run cut off by a time limit keeps what it timed.
    ``providers``: only these providers (``only_providers``); ``variants``: also the tuning
    variants of our kernels (always when ``providers`` names them). ``warm_workers``: processes
    that first run every case's providers once, side by side, so that their kernels are compiled
    (on disk) before the one-by-one timing (default ``workpool.default_workers``; 1: none).
    ``warmed``: a warm-up already under way (``warm_in_background`` with the same arguments):
    waited for instead of running one."""
    ceil = hw.ceilings(measure=True)
    cases, errors = select_cases(ops, model, quick, providers, variants)
    n = default_workers() if warm_workers is None else warm_workers
    args = dict(ops=ops, model=model, quick=quick, providers=providers, variants=variants)
    warm = (warmed or _start_warm(cases, n, args, progress))()
    results, skipped = [], []
    device = torch.device("cuda")

    off = off_widths(cases, model_facts(model)[0]) if model else []

    def doc(**extra) -> dict:
        return {"environment": environment(ceil), "quick": quick, "model": model, "providers": providers,
                "not_at_model_widths": off,
                "variants": variants, "warm_up": warm,
                "results": results,
                "skipped": skipped, "load_errors": errors, **extra}

    for i, c in enumerate(cases):
        if progress:
            print(f"[bench {i + 1}/{len(cases)}] {c.op} {c.case}", file=sys.stderr, flush=True)
        try:
            r, s = run_case(c, ceil, device, quick)
        except Exception as e:
            r, s = [], [{"op": c.op, "case": c.case, "provider": "*", "family": c.family,
                         "reason": f"setup failed: {e}"[:300]}]
        results += r
        skipped += s
        if partial:
            with open(partial, "w") as f:
                json.dump(doc(partial=f"{i + 1} of {len(cases)} cases"), f, indent=1, default=str)
    return doc()


WARM_TIMEOUT_S = 300.0  # per case of the compile warm-up


def warm_in_background(ops=None, model=None, quick=False, warm_workers: Optional[int] = None,
                       progress: bool = True) -> Callable[[], Optional[dict]]:
    """Start the compile warm-up of ``bench(ops, model, quick)``'s cases in a thread and return
    the function that waits for it (pass it to ``bench`` as ``warmed``). ``opmap report`` runs it
    beside the GPU check: neither times anything, and both are mostly compiling."""
    cases, _ = select_cases(ops, model, quick)
    n = default_workers() if warm_workers is None else warm_workers
    return _start_warm(cases, n, dict(ops=ops, model=model, quick=quick, providers=None, variants=False), progress)


def _start_warm(cases: list, n: int, args: dict, progress: bool) -> Callable[[], Optional[dict]]:
    """``_warm_compiles`` in a thread (none for one worker or one case); returns its waiter."""
    if n <= 1 or len(cases) <= 1:
        return lambda: None
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(warm=_warm_compiles(cases, n, args, progress)), daemon=True)
    t.start()

    def wait() -> Optional[dict]:
        t.join()
        return box.get("warm")

    return wait


def _warm_compiles(cases: list, n: int, args: dict, progress: bool) -> dict:
    """Every case's providers run once in ``n`` worker processes (``bench.warm_child``), so that
    Triton's and Inductor's on-disk caches hold their kernels before the timing pass: compiling
    (our kernels, ``torch.compile`` and flex-attention peers, autotuning configs) is most of a cold
    run's time and uses one CPU core a process. Nothing is timed here; a provider that fails is
    left to the timing pass, which reports it. Returns what the warm-up did, for the result file."""
    t0, done = time.perf_counter(), {"ran": 0, "failed": 0, "workers_lost": 0}
    cmd = child_cmd("opmap.harness.bench.warm_child", args, len(cases))
    if progress:
        print(f"[bench] compiling the {len(cases)} cases' kernels in {n} worker processes", file=sys.stderr, flush=True)

    def answer(k, got, why):
        if got is None or "fatal" in got:
            done["workers_lost" if got is None else "failed"] += 1
            if progress:
                print(f"[bench] warm-up of {cases[k].op} {cases[k].case}: {why or got['fatal']}"[:300],
                      file=sys.stderr, flush=True)
            return
        done["ran"] += got["ran"]
        done["failed"] += got["failed"]

    # A case that hangs must not hold up the run: its worker is killed and the timing pass compiles it.
    run_queue(list(range(len(cases))), n, cmd, answer, timeout=WARM_TIMEOUT_S)
    return {"workers": n, "seconds": round(time.perf_counter() - t0, 2), **done}


def print_table(doc: dict, console=None) -> None:
    console = console or wide_console()
    t = Table(title="opmap bench", title_justify="left")
    for h in ("op", "case", "provider", "median us", "TB/s", "TFLOP/s", "of ceiling"):
        t.add_column(h, justify="left" if h in ("op", "case", "provider") else "right")
    f = lambda v, fmt: "" if v is None else format(v, fmt)  # noqa: E731
    for r in doc["results"]:
        # Text: rich would read a variant's "[bm=128,...]" as markup and drop it
        t.add_row(r["op"], r["case"], Text(r["provider"] + (" *" if r.get("selected") else "")),
                  f"{r['median_us']:.2f}", f(r["tbps"], ".3f"), f(r["tflops"], ".1f"),
                  f(r["frac_of_ceiling"], ".1%"))
    console.print(t)
    if any(r.get("selected") for r in doc["results"]):
        console.print("* = the backend the selector picks for the case's spec")
    for s in doc["skipped"]:
        console.print(f"not timed: {s['op']} {s['case']} {s['provider']}: {s['reason']}", highlight=False)
    for e in doc["load_errors"]:
        console.print(f"[red]bench cases of {e['family']} failed to load: {e['error']}[/red]")


def main(args) -> int:
    info = hw.detect()
    cases, errors = collect(args.quick)
    unknown = [o for o in args.op or [] if not any(keep(c, [o], None) for c in cases)]
    if unknown:  # a misspelt --op selects nothing: say so before anything is timed
        ops = sorted({c.op for c in cases})
        print(f"opmap bench: no benchmark case matches --op {', '.join(map(repr, unknown))} (an op name or a "
              f"prefix of one; ops: {', '.join(ops)}). {closest(unknown, ops)}", file=sys.stderr)
        return 2
    try:  # a --provider no case has is named before anything is timed
        selected = only_providers([c for c in cases if keep(c, args.op, None)], args.provider)
    except ValueError as e:
        print(f"opmap bench: {e}", file=sys.stderr)
        return 2
    if info.kind != "cuda":
        n = len(selected)
        print(f"opmap bench: GPU timings need a GPU, and this machine has none ({info.name}, arch cpu).\n"
              f"Nothing was timed and no result file was written ({n} benchmark cases are defined; "
              "run `opmap bench` on a CUDA GPU to time them).")
        for e in errors:
            print(f"note: bench cases of {e['family']} failed to load: {e['error']}")
        return 0
    os.makedirs(args.out, exist_ok=True)
    partial = os.path.join(args.out, "bench-partial.json")
    try:
        doc = bench(args.op, args.model, args.quick, partial=partial, providers=args.provider,
                    variants=args.variants, warm_workers=getattr(args, "warm_workers", None))
    except ValueError as e:  # a --provider only cases of other models have (--model)
        print(f"opmap bench: {e}", file=sys.stderr)
        return 2
    print_table(doc)
    if not doc["results"]:
        print("no benchmark result (no case matched, or no provider could run)")
        return 1
    written = report.write(doc, args.out, png=not args.no_png)
    os.remove(partial)  # the complete result files replace it
    for fam, paths in written.items():
        print(f"{fam}: " + ", ".join(f"{v}" for k, v in paths.items() if k != "png_skipped"))
    return 1 if doc["load_errors"] else 0
