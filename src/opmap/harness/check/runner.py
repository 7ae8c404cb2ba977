"""`opmap check`: collect the CheckCases of every family, filter them to what was asked (a model
preset's selected backends plus the references, named backends, ops, sections), run them with a
progress bar, print one table per section and write JSON / Markdown.

A case that raises is a failure with the exception as its figure; a family whose cases module
fails to import is a failure too (it would otherwise silently shrink the checklist).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from rich.table import Table

from opmap.core import hw, registry
from opmap.harness.check import sanitizer as san
from opmap.harness.check.base import SECTIONS, CheckCase
from opmap.harness.check.cases import FAMILIES
from opmap.harness.check.cases.engine import own_parity
from opmap.harness.check.cases.model_shapes import cases as shape_cases
from opmap.harness.check.fingerprint import fingerprint
from opmap.harness.check.result import Result, progress_bar
from opmap.harness.check.workers import run_parallel
from opmap.harness.names import closest
from opmap.harness.output import environment, gpu_slug, result_stem, short_error, wide_console
from opmap.harness.workpool import default_workers as gpu_workers
from opmap.model import presets
from opmap.model.hf import resolve_model


def local_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def collect(device: str, quick: bool, families=FAMILIES) -> tuple[list, list]:
    """(family, case) pairs from every family's cases module, and load failures as Results."""
    out, errors = [], []
    for fam in families:
        modname = f"opmap.harness.check.cases.{fam}"
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name == modname:
                continue  # the family has no check cases (yet); `missing_families` reports it
            errors.append(_load_error(fam, e))
            continue
        except Exception as e:
            errors.append(_load_error(fam, e))
            continue
        try:
            for c in mod.cases(device, quick):
                if c.device in ("any", device) and (c.quick or not quick):
                    out.append((fam, c))
        except Exception as e:
            errors.append(_load_error(fam, e))
    return out, errors


def missing_families(families=FAMILIES) -> list[str]:
    return [f for f in families if importlib.util.find_spec(f"opmap.harness.check.cases.{f}") is None]


def _load_error(fam: str, e: Exception) -> Result:
    return Result("parity", fam, "-", "(loading the family's check cases)", False,
                  f"{type(e).__name__}: {e}"[:300], family=fam)


@dataclass
class Targets:
    """What a model preset asks of the selector on this device."""

    pairs: set  # (op, backend name): chosen in prefill or decode, plus every op's reference
    ops: set
    choices: list  # (phase, op, label, Choice or None, error or None, entry the step calls)
    cfg: presets.ModelConfig


def model_targets(model: str, arch: Optional[str] = None) -> Targets:
    """The model's step maps as the engine resolves them on ``arch`` with its defaults
    (``opmap.engine.opset.planned_maps``: bf16 with CUDA-graph decode on a GPU, fp32 and eager on
    the CPU): the rows the engine calls, each with its choice or the reason none serves."""
    # the engine's op sets load only when a model is asked about
    from opmap.engine.opset import planned_maps

    cfg = resolve_model(model)[0]
    arch = arch or hw.local_arch()
    pairs, ops, choices = set(), set(), []
    for phase, rows in planned_maps(cfg, arch).items():
        for r in rows:
            ops.add(r.op)
            # The op's references (MLA's is "mla-reference"): their parity cases are the oracle's.
            pairs.update((r.op, b.name) for b in registry.backends(r.op)
                         if b.name == "reference" or b.name.endswith("-reference"))
            if r.choice is not None:
                pairs.add((r.op, r.backend.name))
            choices.append((phase, r.op, r.label, r.choice, r.error, r.entry))
    return Targets(pairs, ops, choices, cfg)


def _known(found, **given) -> None:
    """A --op / --backend / --section value no case on this device has is a ValueError naming the
    closest ones (a misspelt filter used to check nothing and say only that nothing matched)."""
    if not found:  # nothing collected at all (the load errors say why): no name to check against
        return
    for what, values in given.items():
        have = sorted({getattr(c, what[:-1]) for _, c in found})
        bad = [v for v in values or () if v not in have]
        if bad:
            raise ValueError(f"no check case has {what[:-1]} {', '.join(map(repr, bad))} here "
                             f"({what}: {', '.join(have)}). {closest(bad, have)}")


def keep(case: CheckCase, targets: Optional[Targets], backends=None, ops=None, sections=None) -> bool:
    if sections and case.section not in sections:
        return False
    if ops and case.op not in ops:
        return False
    if backends and case.backend not in backends:
        return False
    if targets is not None:
        cfg = targets.cfg
        if "mla" in case.tags and not cfg.is_mla or "moe" in case.tags and not cfg.is_moe:
            return False
        model = _case_fields(case.case).get("model")
        if model in presets.PRESETS and presets.PRESETS[model].arch != cfg.arch:
            return False  # a case about another architecture (e.g. an engine case of another preset)
        if case.backend == "-":
            # Not about one backend (e.g. an end-to-end or statistics case): kept when it is about
            # an op of the model, or about no registry op at all (engine cases).
            return case.op in targets.ops or case.op not in registry.ops()
        return (case.op, case.backend) in targets.pairs
    return True


def _case_fields(case: str) -> dict:
    out = {}
    for part in case.replace(" ", ",").split(","):
        k, sep, v = part.partition("=")
        if sep:
            out[k.strip()] = v.strip()
    return out


def run_case(fam: str, c: CheckCase) -> Result:
    t0 = time.perf_counter()
    try:
        o = c.run()
        r = Result(c.section, c.op, c.backend, c.case, bool(o.passed), o.figure, o.value, o.limit, family=fam)
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
        r = Result(c.section, c.op, c.backend, c.case, False,
                   f"raised {type(e).__name__}: {e}{where}"[:400], family=fam)
    r.seconds = time.perf_counter() - t0
    return r


def run(selected: list, progress: bool = True) -> list[Result]:
    results = []
    if not progress:
        return [run_case(f, c) for f, c in selected]
    with progress_bar() as prog:
        task = prog.add_task("", total=len(selected))
        for fam, c in selected:
            prog.update(task, description=c.title[:70])
            results.append(run_case(fam, c))
            prog.advance(task)
    return results


# ---- output ---------------------------------------------------------------------------------

def print_tables(results: list[Result], console=None) -> None:
    console = console or wide_console()
    for sec, title in SECTIONS.items():
        rows = [r for r in results if r.section == sec]
        if not rows:
            continue
        t = Table(title=f"{title} ({sum(r.passed for r in rows)}/{len(rows)} pass)", title_justify="left")
        t.add_column("case")
        t.add_column("figure")
        t.add_column("result", no_wrap=True)
        t.add_column("s", justify="right")
        for r in rows:
            verdict = "[green]pass[/green]" if r.passed else "[bold red]FAIL[/bold red]"
            t.add_row(r.title, r.figure, verdict, f"{r.seconds:.2f}")
        console.print(t)


def sources_line(extra: dict) -> str:
    """The sanitizer verdicts' source fingerprints, for the Markdown report ("" without them)."""
    src = extra.get("sanitizer_sources")
    if not src:
        return ""
    return ("Sanitizer verdicts are of these sources (harness/check/fingerprint.py): "
            + ", ".join(f"{f} `{h}`" for f, h in src.items()) + "\n\n")


def to_markdown(results: list[Result], heading: str = "##") -> str:
    out = []
    for sec, title in SECTIONS.items():
        rows = [r for r in results if r.section == sec]
        if not rows:
            continue
        out += [f"{heading} {title} ({sum(r.passed for r in rows)}/{len(rows)} pass)", "",
                "| case | figure | result |", "|---|---|---|"]
        for r in rows:
            fig = r.figure.replace("|", "\\|").replace("\n", " ")
            out.append(f"| `{r.title}` | {fig} | {'pass' if r.passed else '**FAIL**'} |")
        out.append("")
    return "\n".join(out)


def summary(results: list[Result]) -> dict:
    return {"passed": sum(r.passed for r in results), "failed": sum(not r.passed for r in results),
            "total": len(results)}


def as_json(results: list[Result], extra: Optional[dict] = None) -> dict:
    d = {"environment": environment(), **(extra or {}), "summary": summary(results),
         "results": [asdict(r) for r in results]}
    return d


def unrunnable(ops=None, backends=None) -> list:
    """One note per reason some registered backends cannot run in this process (no GPU, Triton
    without TRITON_INTERPRET=1, a package not installed): no case of theirs ran, and the report
    says so instead of leaving them out unnamed."""
    by_reason: dict = {}
    for op in registry.ops():
        if ops and op not in ops:
            continue
        for b in registry.backends(op):
            if backends and b.name not in backends:
                continue
            why = b.available() if b.available else None
            if why:
                by_reason.setdefault(why, set()).add(b.name)
    return [f"not exercised here ({why}): {', '.join(sorted(names))}" for why, names in sorted(by_reason.items())]


def default_workers(device: str) -> int:
    """Worker processes for a GPU check: most of a GPU case's time is compiling its Triton kernels
    on one CPU core (a cold cache), so cases run side by side, one process each, up to 8 or the
    cores there are. On a CPU one process (the cases are single-threaded and the cores shared)."""
    return gpu_workers() if device == "cuda" else 1


def selection(model, backends, ops, sections, quick: bool, device: str) -> tuple:
    """(selected (family, case) pairs, load-failure Results, notes, Targets or None): what a check
    with these filters runs on ``device``, in its order (the worker processes rebuild it)."""
    targets = model_targets(model) if model else None
    found, errors = collect(device, quick)
    _known(found, ops=ops, backends=backends, sections=sections)
    selected = [(f, c) for f, c in found if keep(c, targets, backends, ops, sections)]
    notes = []
    if model and (sections is None or "parity" in sections) and (ops is None or "e2e" in ops):
        case, note = own_parity(model, device)
        if case is not None:
            selected.insert(0, ("engine", case))
        if note:
            notes.append(note)
    if targets is not None and (sections is None or "parity" in sections):
        made = [(c.op, c) for c in shape_cases(targets.cfg, targets.choices, device)
                if keep(c, None, backends, ops, sections)]
        selected += made
        if not made:
            notes.append(f"no case at the model's own shapes: the backends selected on this {device} are the "
                         "references (a GPU's Triton / cuBLAS / ... selections get one per operator)")
    return selected, errors, notes, targets


class OnceFilter(logging.Filter):
    """Lets each distinct log message through once."""

    def __init__(self):
        super().__init__()
        self.seen: set = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def check(model=None, backends=None, ops=None, sections=None, quick=True, device=None, progress=True,
          sanitizer=False, timeout=300.0, console=None, jobs=4, resume=None, batch=6,
          reuse=(), workers: Optional[int] = None) -> tuple[list[Result], dict]:
    """Run the checklist; returns the results and facts for the JSON (selection, notes).
    ``workers``: processes that run the cases at once on a GPU (default ``default_workers``)."""
    device = device or local_device()
    selected, errors, notes, targets = selection(model, backends, ops, sections, quick, device)
    sources = None
    n = default_workers(device) if workers is None else workers
    if device == "cuda" and n > 1 and len(selected) > 1:
        ran = run_parallel(selected, n, dict(model=model, backends=backends, ops=ops, sections=sections,
                                             quick=quick, device=device), progress)
    else:
        once = OnceFilter()  # the engines the cases build say the same thing (their page-capped length) each time
        engine_log = logging.getLogger("opmap.engine")
        engine_log.addFilter(once)
        try:
            ran = run(selected, progress)
        finally:
            engine_log.removeFilter(once)
    results = list(errors) + ran
    if targets is not None:
        for phase, op, label, ch, err, *_ in targets.choices:
            if err is not None:
                results.append(Result("parity", op, "-", f"select {label} [{phase}]", False,
                                      "no backend: " + short_error(err), family="select"))
    if sanitizer:
        if device != "cuda":
            notes.append("--sanitizer: compute-sanitizer needs a GPU; no case was run under it")
        else:
            gpu = [(f, c) for f, c in selected if san.wants_sanitizer(c)]
            results += san.run_all(gpu, quick, timeout, progress, jobs, batch=batch, state=resume, reuse=reuse)
            # What the verdicts (run now or resumed) were computed from: resumed ones count only
            # at these fingerprints, so every sanitizer line of the report is of this code.
            sources = {f: fingerprint(f) for f in sorted({f for f, _ in gpu})}
    notes += unrunnable(ops, backends)
    missing = missing_families()
    if missing:
        notes.append("families without check cases: " + ", ".join(missing))
    extra = {"device": device, "quick": quick, "model": model, "notes": notes,
             "selection": [{"phase": p, "op": op, "label": lb, "backend": ch.name if ch else None,
                            "why": ch.why() if ch else err} for p, op, lb, ch, err, *_ in
                           (targets.choices if targets else [])]}
    if sources is not None:
        extra["sanitizer_sources"] = sources
    return results, extra


def main(args) -> int:
    console = wide_console()
    try:
        results, extra = check(args.model, args.backend, args.op, args.section, args.quick,
                               sanitizer=args.sanitizer, timeout=args.timeout, console=console,
                               jobs=args.jobs, resume=getattr(args, "resume", None),
                               batch=getattr(args, "batch", 6), reuse=getattr(args, "reuse", None) or (),
                               workers=getattr(args, "workers", None))
    except ValueError as e:  # unknown preset, or a filter that names nothing
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_tables(results, console)
    for n in extra["notes"]:
        console.print(f"note: {n}", highlight=False)
    s = summary(results)
    if args.json:
        extra["command"] = " ".join(sys.argv)
        with open(args.json, "w") as f:
            json.dump(as_json(results, extra), f, indent=1)
        console.print(f"wrote {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("# opmap check\n\n" + sources_line(extra) + to_markdown(results))
        console.print(f"wrote {args.markdown}")
    if args.out:
        stem = result_stem(args.out, gpu_slug(hw.detect().name) + (f"-{args.model}" if args.model else ""))
        extra["command"] = " ".join(sys.argv)
        stem.with_suffix(".json").write_text(json.dumps(as_json(results, extra), indent=1))
        stem.with_suffix(".md").write_text(f"# opmap check{' --model ' + args.model if args.model else ''}\n\n"
                                           + sources_line(extra) + to_markdown(results))
        console.print(f"wrote {stem}.json and {stem}.md")
    if not results:
        console.print("no check case matched (nothing was checked)")
        return 1
    console.print(f"opmap check: {s['passed']} of {s['total']} cases pass, {s['failed']} fail",
                  highlight=False)
    return 0 if s["failed"] == 0 else 1
