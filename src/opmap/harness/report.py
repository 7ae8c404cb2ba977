"""`opmap report --model PRESET`, the main job: for one model on this device, every call of one
prefill, decode and mixed step as the engine makes it (its step map resolved with the engine's
defaults, ``opmap.engine.opset.planned_maps``) with the backend the selector picks and why; the
answers to the report's four questions (attention paths, where the sampler pipeline lives and how
it falls back, MoE grouped vs loop, quantised paths); the quick correctness check of those
backends; on a GPU the benchmarks of those ops (and the engine's TTFT / TPOT when it is there).
Writes report.md and report.json."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from rich.console import Console

from opmap.core import hw, registry
from opmap.core.select import BackendError, Choice, select
from opmap.core.specs import AttentionSpec
from opmap.engine.config import EngineConfig
from opmap.harness import plan, report_figures
from opmap.harness.bench import runner as bench_runner
from opmap.harness.bench.report import to_markdown as bench_md
from opmap.harness.check import runner
from opmap.harness.check.result import Result
from opmap.harness.check.runner import to_markdown as check_md
from opmap.harness.output import environment, short_error
from opmap.model import presets
from opmap.model.hf import resolve_model
from opmap.model.step import QUANTISED_MIXED_ROWS
from opmap.ops.gemm.quant import INT4_GROUP, int4_group
from opmap.ops.moe.backends import MANY_ROWS_AN_EXPERT, QUANT_EXPERTS, many_tokens


def _row_dict(phase: str, r) -> dict:
    """One row of the operator map: a resolved slot of the step map (``opmap.model.step``)."""
    d = {"phase": phase, "key": r.key, "op": r.op, "label": r.label, "entry": r.entry, "spec": r.spec.describe()}
    if r.choice is None:
        return {**d, "backend": None, "error": r.error}
    ch, b = r.choice, r.backend
    return {**d, "backend": b.name, "provider": b.provider, "version": b.provider_version(), "why": ch.why(),
            "fallbacks": [c.name for c in ch.trace[1:] if c.valid],
            "rejected": [{"name": c.name, "level": c.level, "reasons": list(c.reasons)}
                         for c in ch.trace if not c.valid],
            "planned_only": not ch.runtime, "without_optional": _without_optional(ch),
            "one_launch_for": [f.label for f in r.folded]}


def _try(op: str, spec) -> tuple[Optional[Choice], Optional[str]]:
    try:
        return select(op, spec), None
    except BackendError as e:
        return None, short_error(str(e))


_BUILT_IN = ("torch", "opmap-triton")  # providers every opmap install has (Triton where the GPU runs it)


def _optional(b) -> bool:
    """A backend of a package opmap does not depend on (FlashInfer, XGrammar, ...)."""
    return b.available is not None and not any(b.provider.startswith(p) for p in _BUILT_IN)


def _without_optional(ch: Choice) -> Optional[str]:
    """Where a planned choice needs an optional package: the backend chosen without it."""
    if ch.runtime or not _optional(ch.backend):
        return None
    nxt = next((c.name for c in ch.trace[1:] if c.valid and not _optional(registry.get(ch.op, c.name))), None)
    return nxt or "none"


def _name(ch: Optional[Choice], err: Optional[str]) -> str:
    if not ch:
        return f"no backend ({err})"
    alt = _without_optional(ch)
    tail = f"; if {ch.backend.provider} is installed there, else `{alt}`" if alt else ""
    return f"`{ch.name}` ({ch.backend.provider}{tail})"


def questions(cfg: presets.ModelConfig, arch: str, maps: dict) -> list[dict]:
    """The report questions, each answered from the selector (never from prose written here).
    ``maps``: {phase: resolved rows} (``opmap.engine.opset.planned_maps``)."""
    find = lambda phase, op: [(r.label, r.spec) for r in maps[phase] if r.op == op]  # noqa: E731
    qs = []
    # 1. Attention paths.
    (pl, ps), (dl, ds) = find("prefill", "attention")[0], find("decode", "attention")[0]
    pc, pe = _try("attention", ps)
    dc, de = _try("attention", ds)
    contiguous, ce = _try("attention", ds.replace(paged=False))
    lines = [f"prefill ({pl}): {_name(pc, pe)}"]
    if arch != "cpu" and not ps.cuda_graph:  # the engine's padded prefill steps replay CUDA graphs
        gc, ge = _try("attention", ps.replace(cuda_graph=True))
        lines.append(f"prefill steps of up to {EngineConfig.prefill_graph_tokens} tokens"
                     f"{' (one sequence)' if cfg.is_mla else ''}, replayed from CUDA graphs: {_name(gc, ge)}")
    lines += [f"decode ({dl}, paged, page {ds.page_size}): {_name(dc, de)}",
              f"decode on contiguous KV (not paged): {_name(contiguous, ce)}"]
    if pc and dc:
        lines.append("paged decode runs the same backend as prefill" if pc.name == dc.name else
                     f"paged decode runs a different backend from prefill ({dc.name} vs {pc.name})")
    if cfg.is_mla:
        mla = ds
    else:  # DeepSeek-V2 shapes: 16 heads over a 512-rank latent plus a 64-dim RoPE part
        mla = AttentionSpec(arch=arch, phase="decode", kind="mla", num_heads=16, num_kv_heads=1, head_dim=576,
                            head_dim_v=512, page_size=ds.page_size, cuda_graph=ds.cuda_graph)
    mc, me = _try("attention", mla)
    sc, se = _try("attention", mla.replace(sparse=True))
    lines.append(f"MLA decode ({'this model' if cfg.is_mla else 'DeepSeek-V2 shapes'}): {_name(mc, me)}")
    lines.append(f"sparse MLA decode: {_name(sc, se)}")
    qs.append({"question": "Which attention backend runs prefill and which decode; is paged decode the same "
                           "path; does MLA have its own?", "answer": lines})
    # 2. Sampler pipeline.
    lines = []
    for op in ("logits", "grammar_mask", "sampling"):
        for lb, spec in find("decode", op):
            ch, err = _try(op, spec)
            if ch is None:
                lines.append(f"{lb}: {_name(ch, err)}")
                continue
            fb = [c.name for c in ch.trace[1:] if c.valid]
            lines.append(f"{lb}: `{ch.name}` ({ch.backend.provider}); when it cannot serve, the next valid "
                         f"by priority: {', '.join(fb) or 'none'}")
    lines.append("the engine runs these once per step (prefill and decode alike) on the fp32 logits, after the "
                 "forward pass and outside its CUDA graph")
    lines.append(_stop_line())
    lines.append("a forced backend (argument or OPMAP_<OP>_BACKEND) that cannot serve raises BackendError: "
                 "there is no silent fallback")
    qs.append({"question": "Where do logits processors, the grammar bitmask, sampling and stop live, and how "
                           "does each fall back?", "answer": lines})
    # 3. MoE.
    if cfg.is_moe:
        lines = []
        for phase in ("prefill", "decode"):
            for lb, spec in find(phase, "moe"):
                ch, err = _try("moe", spec)
                lines.append(f"{phase}: {_name(ch, err)}: {_moe_kind(ch) if ch else ''}")
    else:
        lines = ["dense model: no MoE layer"]
    qs.append({"question": "Is MoE a grouped GEMM or a loop of per-expert GEMMs?", "answer": lines})
    # 4. Quantised paths, asked of the selector with the model's own decode / prefill GEMM shapes.
    lines = []
    own = find("decode", "gemm")[0][1].weight_dtype
    own = own if own in QUANT_FORMATS + ("fp8-block",) else None  # the checkpoint's own format first

    def as_format(g, wd):
        return g if wd == g.weight_dtype else g.replace(
            weight_dtype=wd, group_size=int4_group(g.k, INT4_GROUP) if wd == "int4" else None)

    formats = ([own] if own else []) + [f for f in QUANT_FORMATS if f != own]
    for phase in ("decode", "prefill"):
        lb, g = find(phase, "gemm")[0]
        for wd in formats:
            ch, err = _try("gemm", as_format(g, wd))
            line = (f"{phase} {lb} (m={g.m or 'any'}) with {wd} weights{' (this checkpoint)' * (wd == own)}: "
                    f"{_name(ch, err)}")
            if ch is not None and ch.name == "dequant-cublas":
                line += (f" -> dequantise then {g.dtype} GEMM: one pass writes the weight in {g.dtype} per call, "
                         "then cuBLAS")
            lines.append(line)
    if "mixed" in maps:
        lb, g = find("mixed", "gemm")[0]
        for wd in formats:
            lines.append(f"mixed {lb} with {wd} weights{' (this checkpoint)' * (wd == own)}, by the step's rows: "
                         f"{_by_rows(as_format(g, wd))}")
    if cfg.is_moe:
        lines += _quantised_experts(find, _try)
    kv8, e8 = _try("attention", ds.replace(kv_dtype="fp8"))
    lines.append(f"decode attention with fp8 KV: {_name(kv8, e8)}")
    lines.append("which kernel symbols actually run (a dequantise kernel then a bf16 GEMM = fallback) needs a "
                 "GPU profile: `opmap profile` on a GPU")
    qs.append({"question": "With quantised weights or KV, which kernels run?", "answer": lines})
    return qs


QUANT_FORMATS = ("fp8", "int8", "int4")  # the weight-only formats the report asks the selector about


def _quantised_experts(find, try_) -> list:
    """The MoE backend for the routed experts in each quantised format: at decode, at a prefill step
    (its token count unknown when planned) and at a call of as many tokens as give each expert
    MANY_ROWS_AN_EXPERT rows, with a dequantise-then-16-bit route named as such."""
    out = []
    (_, dec), (_, pre) = find("decode", "moe")[0], find("prefill", "moe")[0]
    many = many_tokens(pre.num_experts, pre.top_k)
    for wd in QUANT_EXPERTS:
        group = int4_group(pre.hidden, INT4_GROUP) if wd == "int4" else 128
        for what, spec in (("decode", dec), ("a prefill step", pre), (f"a call of {many} tokens", pre.replace(tokens=many))):
            ch, err = try_("moe", spec.replace(weight_dtype=wd, group_size=group))
            line = f"MoE ({what}) with {wd} experts: {_name(ch, err)}"
            if ch is not None and ch.name == "dequant-triton":
                line += (f" -> dequantise then {spec.dtype} grouped GEMM: one pass writes every expert's weights in "
                         f"{spec.dtype} per call (from {MANY_ROWS_AN_EXPERT} rows an expert)")
            out.append(line)
    return out


def _by_rows(g) -> str:
    """The backend of a quantised GEMM in each span of rows at which the engine plans its mixed steps
    (model.step.QUANTISED_MIXED_ROWS; M unknown between MANY_ROWS / 2 and MANY_ROWS), equal
    neighbours merged: "1-32: `gluon-wo` ...; 33-64: ...; >= 128: ..."."""
    *small, many = QUANTISED_MIXED_ROWS
    spans, lo = [], 1
    for m in small:
        spans.append((lo, m, m))
        lo = m + 1
    spans += [(lo, many - 1, None), (many, None, many)]
    out: list = []
    for lo, hi, m in spans:
        name = _name(*_try("gemm", g.replace(m=m)))
        if out and out[-1][2] == name:
            out[-1][1] = hi
        else:
            out.append([lo, hi, name])
    return "; ".join(f"{lo}-{hi}: {name}" if hi else f">= {lo}: {name}" for lo, hi, name in out)


def _stop_line() -> str:
    """Stop is not a registry op: where the engine checks it, in one sentence."""
    return ("stop: not a registry op; on the host, after each step's tokens are read back, one "
            "`opmap.engine.stop.StopChecker` per request (EOS, stop ids, stop strings on the "
            "detokenised text, max_tokens, grammar end) and the engine's max_model_len")


def _moe_kind(ch: Choice) -> str:
    text = f"{ch.name} {ch.backend.notes}".lower()
    if "loop" in text:
        return "a loop of per-expert GEMMs (declared: " + (ch.backend.notes or ch.name) + ")"
    if "group" in text:
        return "a grouped GEMM (declared: " + (ch.backend.notes or ch.name) + ")"
    return "not declared by the backend (notes: " + (ch.backend.notes or "none") + ")"


E2E_PROMPT, E2E_NEW = 1024, 128  # the end-to-end target case: batch 1, prompt 1024, 128 new tokens


def _engine_section(model: str, on_gpu: bool) -> dict:
    """TTFT / TPOT of the engine on random weights of the preset's shapes (GPU only), and the
    profile summary when the engine offers one."""
    if not on_gpu:
        return {"status": "skipped", "why": "TTFT / TPOT are measured on a GPU; this machine has none"}
    try:
        from opmap.engine import llm as _  # noqa: F401  (importable, else the section says why)
    except Exception as e:
        return {"status": "unavailable", "why": f"the engine cannot be imported ({type(e).__name__}: {e})"[:400]}
    status = Console(stderr=True).status(f"engine: loading {model}")  # tens of seconds: say what runs
    status.start()
    try:
        t = time.perf_counter()
        out = _engine_run(model, status)
        out["seconds"] = {"run": round(time.perf_counter() - t, 2)}
        if out["status"] == "ok":
            status.update(f"engine: profiling a batch-8 workload of {model}")
            t = time.perf_counter()
            out["profile"] = _profile_summary(model)
            out["seconds"]["profile"] = round(time.perf_counter() - t, 2)
        return out
    finally:
        status.stop()


def _engine_run(model: str, status) -> dict:
    # the engine, for this section only (importing the report loads none of it)
    from opmap.engine.llm import LLM
    from opmap.engine.metrics import format_summary
    from opmap.engine.params import SamplingParams

    llm = None
    try:
        llm = LLM(model)
        status.update(f"engine: batch-1 run of {model} (TTFT / TPOT)")
        n = min(E2E_PROMPT, llm.max_model_len - E2E_NEW - 1)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, llm.cfg.vocab, (n,), generator=g).tolist()
        greedy = dict(temperature=0.0, ignore_eos=True)
        llm.generate([prompt[:32]], SamplingParams(max_tokens=8, **greedy))  # compile, capture graphs
        llm.generate([prompt], SamplingParams(max_tokens=E2E_NEW, **greedy))
        d = dict(llm.last_summary)
        return {"status": "ok", "workload": f"batch 1, prompt {n}, {E2E_NEW} new tokens, greedy, random weights",
                "summary": d, "lines": format_summary(d)}
    except Exception as e:
        return {"status": "failed", "why": f"{type(e).__name__}: {e}"[:400]}
    finally:
        if llm is not None:
            llm.close()  # the profile builds its own engine: free this one's KV cache and weights first


def _profile_summary(model: str) -> dict:
    try:
        from opmap.harness import profile  # the profiler view, when the engine side provides it
    except Exception as e:
        return {"status": "unavailable", "why": f"no opmap.harness.profile ({type(e).__name__}: {e})"[:300]}
    fn = getattr(profile, "report_summary", None)
    if fn is None:
        return {"status": "unavailable", "why": "opmap.harness.profile has no report_summary(model)"}
    try:
        return {"status": "ok", **fn(model)}
    except Exception as e:
        return {"status": "failed", "why": f"{type(e).__name__}: {e}"[:300]}


def build(model: str, run_check: bool = True, run_bench: bool = True, full: bool = False,
          progress: bool = True, arch: Optional[str] = None) -> dict:
    """``arch``: plan for that GPU arch instead of this device's (the selection for it and, per
    operator, the expected time from that GPU's committed baselines; nothing runs)."""
    t0 = time.perf_counter()
    cfg = resolve_model(model)[0]
    registry.load_all()
    here = hw.local_arch()
    arch = arch or here
    planned = arch != here
    on_gpu = hw.detect().kind == "cuda" and not planned
    from opmap.engine.opset import planned_maps  # the engine's modules load when a report is built

    # The engine's op sets with its defaults on this arch: the rows printed are the calls it makes.
    maps = planned_maps(cfg, arch)
    doc = {"model": model, "arch": arch, "planned": planned,
           "config": {k: v for k, v in vars(cfg).items() if k != "extra"},
           "environment": environment(hw.ceilings(measure=True) if on_gpu else None),
           "operators": {ph: [_row_dict(ph, r) for r in m] for ph, m in maps.items()},
           "questions": questions(cfg, arch, maps)}
    gpu, rows = plan.load_rows(arch)
    doc["baseline_gpu"] = gpu
    for ph, m in maps.items():
        # the step's rows: decode's batch; prefill and mixed are planned at any row count, their
        # expected times at the end-to-end case's prompt
        tokens = next((r.spec.m for r in m if r.op == "gemm" and r.spec.m), E2E_PROMPT)
        for row, r in zip(doc["operators"][ph], m):
            # the LM head runs on the rows that sample: one per sequence of the end-to-end case
            n = 1 if r.key == "lm_head" else tokens
            row["expected"] = (plan.expected(r.op, r.spec, row["backend"], rows, n, r.entry)
                               if row["backend"] and rows else None)
            if row["backend"] and rows:
                row["scaled"] = plan.scaled(r.op, r.spec, row["expected"], n)
            if planned and row["backend"]:
                row["version"] = None  # the target's library, not this machine's: unknown here
    if planned:
        why = f"planned for {arch} on this {here} machine: nothing runs here"
        doc["engine"] = {"status": "skipped", "why": why}
        doc["seconds"] = round(time.perf_counter() - t0, 2)
        return doc
    parts = doc["part_seconds"] = {"plan": round(time.perf_counter() - t0, 2)}  # where the time went

    def done(part: str, t: float) -> None:
        parts[part] = round(time.perf_counter() - t, 2)
        if progress:
            print(f"report: {part} took {parts[part]} s", file=sys.stderr, flush=True)
    warmed = None
    if run_bench and on_gpu:
        # The bench's compile warm-up runs beside the check (neither times anything; both mostly
        # compile), so the bench part is its timing pass alone.
        warmed = bench_runner.warm_in_background(model=model, quick=not full, progress=False)
    if run_check:
        t = time.perf_counter()
        results, extra = runner.check(model=model, quick=not full, progress=progress)
        doc["check"] = {"summary": runner.summary(results), "notes": extra["notes"],
                        "results": [vars(r) for r in results]}
        done("check", t)
    if run_bench and on_gpu:
        t = time.perf_counter()
        doc["bench"] = bench_runner.bench(model=model, quick=not full, progress=progress, warmed=warmed)
        done("bench", t)
    elif run_bench:
        doc["bench"] = {"status": "skipped", "why": "GPU timings need a GPU; this machine has none"}
    t = time.perf_counter()
    doc["engine"] = _engine_section(model, on_gpu)
    if on_gpu:
        done("engine", t)
        parts.update({f"engine {k}": v for k, v in doc["engine"].get("seconds", {}).items()})
    doc["seconds"] = round(time.perf_counter() - t0, 2)
    return doc


def to_markdown(doc: dict) -> str:
    env, cfg = doc["environment"], doc["config"]
    where = (f"planned for {doc['arch']} (on {env['device']})" if doc.get("planned")
             else f"on {env['device']} ({env['arch']})")
    out = [f"# opmap report: {doc['model']} {where}", "", "## Summary", ""] + summary_lines(doc)[1:] + ["",
           f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, commit `{env['commit']}`, "
           f"{env['date']}. Command: `{env['command']}`", "",
           f"Model: {cfg['arch']}, hidden {cfg['hidden']}, {cfg['layers']} layers, {cfg['heads']} heads / "
           f"{cfg['kv_heads']} KV heads, head dim {cfg['head_dim']}, vocab {cfg['vocab']}"
           + (f", {cfg['num_experts']} experts top-{cfg['top_k']}" if cfg["num_experts"] else "")
           + (f", MLA latent {cfg['kv_lora_rank']} + rope {cfg['qk_rope_dim']}" if cfg["kv_lora_rank"] else ""), ""]
    if env.get("ceilings"):
        c = env["ceilings"]
        out += [f"Ceilings: read {c['read_tbps']} TB/s, copy {c['copy_tbps']} TB/s, bf16 GEMM "
                f"{c['bf16_tflops']} TFLOP/s.", ""]
    gpu = doc.get("baseline_gpu")
    exp_head = f"expected on {gpu.upper()} (its baseline, at this model's shape)" if gpu else "expected"
    if doc.get("planned"):
        seen = next((r["expected"]["versions"] for rows in doc["operators"].values() for r in rows
                     if (r.get("expected") or {}).get("versions")), None)
        out += [f"Library versions: those installed on the {doc['arch']} machine, unknown here"
                + (f" (its baseline ran {', '.join(f'{k} {v}' for k, v in seen.items())})" if seen else "") + ".", ""]
    for ph, rows in doc["operators"].items():
        out += [f"## Operator map, {ph}", "", f"| # | operator | op | backend | why | {exp_head} |",
                "|---|---|---|---|---|---|"]
        for i, r in enumerate(rows, 1):
            if r["backend"] is None:
                out.append(f"| {i} | {r['label']} | {r['op']} | **none** | no backend can serve "
                           f"({_md(short_error(r['error']))}) | |")
                continue
            exp = plan.describe(r.get("expected"), r.get("scaled")) if gpu else f"no baseline for {doc.get('arch')}"
            alt = f"; if installed there, else `{r['without_optional']}`" if r.get("without_optional") else ""
            why = r["why"] + (f"; one launch for {', '.join(r['one_launch_for'])}" if r.get("one_launch_for") else "")
            version = f" {r['version']}" if r.get("version") else ""
            out.append(f"| {i} | {r['label']} | {r['op']} | `{r['backend']}` ({r['provider']}{version}{alt}) | "
                       f"{_md(why)} | {_md(exp)} |")
        out.append("")
    out += _rejections(doc)
    figs = doc.get("figures") or {}
    if figs:
        cap = {"roofline": "Roofline of the benchmark cases" + (" (the baseline cases behind the expected times)"
                                                                 if doc.get("planned") or "bench" not in doc
                                                                 or "results" not in doc.get("bench", {}) else ""),
               "phases": "Time per operator and phase" + ("" if (doc.get("engine") or {}).get("profile") else
                                                          " (expected, at this model's shapes; a call without an "
                                                          "estimate has no bar: the operator map says why)")}
        out += ["## Pictures", ""]
        for name, f in figs.items():
            out += [f"![{cap[name]}]({f})", ""] if f.endswith(".png") else [f"- {cap[name]}: {f}", ""]
    out += ["## Questions", ""]
    for q in doc["questions"]:
        out += [f"**{q['question']}**", ""] + [f"- {_md(a)}" for a in q["answer"]] + [""]
    if "check" in doc:
        s = doc["check"]["summary"]
        out += [f"## Correctness ({s['passed']} of {s['total']} pass)", ""]
        out.append(check_md([Result(**r) for r in doc["check"]["results"]], heading="###"))
        out += [f"- note: {n}" for n in doc["check"]["notes"]] + [""]
    b = doc.get("bench")
    if b is not None:
        out += ["## Benchmarks", ""]
        if "results" in b:
            out += ["The cases of this model's operators in the formats it runs (bf16, and a quantised "
                    "checkpoint's own); other weight and KV formats: `opmap bench --op gemm` / `--op attention`.", ""]
            out.append(bench_md(b).split("\n", 2)[2])
        else:
            out += [f"Not run: {b['why']}.", ""]
    e = doc["engine"]
    out += ["## Engine (TTFT / TPOT, profile)", ""]
    if e["status"] == "ok":
        out += [f"Workload: {e['workload']}.", ""] + [f"- {ln}" for ln in e["lines"]]
        p = e["profile"]
        out += [""] + ([f"- {ln}" for ln in p.get("lines", [])] if p["status"] == "ok"
                       else [f"Profile: not available ({p['why']})."])
    else:
        out += [f"Not run: {e['why']}."]
    parts = _parts_text(doc)
    out += ["", f"Report built in {doc['seconds']} s" + (f" ({parts})." if parts else ".")]
    return "\n".join(out) + "\n"


def _rejections(doc: dict) -> list:
    """The details the operator maps leave out: per phase and operator, each backend the selector
    rejected and its reasons."""
    out = ["## Rejected backends", "", "Per operator of each map above, the backends that cannot serve it and why.", ""]
    for ph, rows in doc["operators"].items():
        out += [f"### {ph}", ""]
        for i, r in enumerate(rows, 1):
            rej = r.get("rejected") or []
            if not rej:
                continue
            out.append(f"- {i}. {r['label']} ({r['op']}):")
            out += [f"    - {x['name']} at {x['level']}: {_md('; '.join(x['reasons']))}" for x in rej]
        out.append("")
    return out


def summary_lines(doc: dict) -> list:
    """One screen: the four answers, the largest expected share per phase, correctness, diagnosis."""
    cfg = doc["config"]
    where = f"planned for {doc['arch']}" if doc.get("planned") else f"on {doc['environment']['device']}"
    out = [f"opmap report: {doc['model']} ({cfg['arch']}, {cfg['layers']} layers) {where}"]
    for q in doc["questions"]:
        out.append(f"- {q['question']}")
        out += [f"    {a}" for a in q["answer"][:3]]
    gpu = doc.get("baseline_gpu")
    calls = [r for rows in doc["operators"].values() for r in rows if r.get("backend")]
    n = sum(1 for r in calls if (r.get("scaled") or {}).get("us") is not None)
    out.append(f"- expected times: {n} of {len(calls)} operator calls, each scaled to this model's shape from the "
               f"nearest measured case of its backend in the {gpu.upper()} baseline; the others say why not (the "
               "operator map below)" if gpu else f"- expected times: no baseline for {doc.get('arch')}")
    if "check" in doc:
        s = doc["check"]["summary"]
        out.append(f"- correctness: {s['passed']} of {s['total']} checks pass" + (f", {s['failed']} fail" if s["failed"] else ""))
    e = doc.get("engine", {})
    prof = e.get("profile") or {}
    shares = []
    for ph, p in (prof.get("phases") or {}).items():
        cats = p.get("categories") or {}
        if cats:
            top = max(cats, key=cats.get)
            shares.append(f"{ph} {top} {cats[top] / sum(cats.values()):.0%}")
    if shares:
        out.append(f"- largest GPU-time share ({prof.get('workload', 'profiled run')}): " + "; ".join(shares))
    rules = prof.get("diagnosis") or []
    if rules:
        out.append(f"- diagnosis: {rules[0]}")
    elif e.get("status") != "ok":
        out.append(f"- engine: {e.get('why', 'not run')}")
    return out


def _parts_text(doc: dict) -> str:
    """"check 12.3 s, bench 45.6 s, ...": where the report's time went ("" for a planned report)."""
    return ", ".join(f"{k} {v} s" for k, v in (doc.get("part_seconds") or {}).items())


def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def main(args) -> int:
    cfg = resolve_model(args.model)[0]  # a bad --model is an InputError: one line, exit 1
    arch = args.arch or hw.local_arch()
    out = Path(args.out or f"reports/{cfg.name}-{arch}")
    doc = build(args.model, run_check=not args.no_check, run_bench=not args.no_bench, full=args.full,
                arch=arch)
    out.mkdir(parents=True, exist_ok=True)
    doc["figures"] = report_figures.write(doc, out)
    (out / "report.json").write_text(json.dumps(doc, indent=1, default=str))
    md = to_markdown(doc)
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(report_figures.to_html(md, out, f"opmap report: {doc['model']}"))
    for line in summary_lines(doc):
        print(line)
    pngs = [f for f in doc["figures"].values() if f.endswith(".png")]
    parts = _parts_text(doc)
    print(f"wrote {out / 'report.md'}, report.html (pictures inline), report.json" + (", " if pngs else "")
          + ", ".join(pngs) + f" in {doc['seconds']} s" + (f" ({parts})" if parts else ""))
    failed = doc.get("check", {}).get("summary", {}).get("failed", 0)
    missing = sum(r["backend"] is None for rows in doc["operators"].values() for r in rows)
    return 1 if failed or missing else 0
