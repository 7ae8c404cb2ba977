"""End-to-end benchmark records (op ``e2e``): the engine on random bf16 weights of a preset's
shapes, and in the same run HF transformers on the same shapes twice: eager ``generate``, and with a
static cache and its decode forward compiled (``hf_static``: the best offline alternative).

Each record carries ``ttft_ms``, ``tpot_ms`` (p50 over requests), ``tok_per_s`` (generated tokens
per second over the whole run; for batch runs the decode throughput), and ``weight_floor_ms``:
the bytes of the weights one decode step must read (MoE: the experts a batch of that size routes
to in expectation, uniform routing) over this GPU's measured read ceiling. ``median_us`` is the
TPOT, ``tbps`` the weight bytes over it, so the markdown table shows the fraction of the read
ceiling a decode step reaches.

These are not ``BenchCase`` timings (a whole generate call is the unit): ``records(quick)`` runs
them; ``python -m opmap.harness.bench.cases.e2e [--quick] [--out DIR]`` writes a result file with them.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from opmap.core import hw
from opmap.engine.config import EngineConfig
from opmap.engine.metrics import format_host
from opmap.engine.params import SamplingParams
from opmap.harness.bench.cases.hf_static import StaticGreedy
from opmap.harness.bench.report import write
from opmap.harness.output import baseline_dir, environment
from opmap.model.hf import to_hf_config
from opmap.model.presets import get_preset

# "<preset>:fp8" / ":int8" / ":int4": the engine with weight-only quantisation at load
# (EngineConfig.quantize), "+fp8kv" with an fp8 KV cache too (EngineConfig.kv_cache_dtype); the floors
# count the bytes as stored (int4: half a byte and the group scales). HF runs only the unquantised model.
QUICK = [("llama3-8b", 1, 1024, 128), ("llama3-8b", 32, 512, 128), ("llama3-8b:fp8", 1, 1024, 128),
         ("llama3-8b:fp8", 32, 512, 128), ("llama3-8b:fp8+fp8kv", 32, 512, 128), ("llama3-8b:int4", 1, 1024, 128)]
FULL = QUICK + [("llama3-8b", 64, 512, 128), ("llama3-8b", 128, 512, 128), ("llama3-8b", "workload", None, None),
                ("mixtral-8x7b", 1, 512, 128), ("mixtral-8x7b", 32, 512, 128),
                ("qwen3-30b-a3b", 1, 512, 128), ("qwen3-30b-a3b", 32, 512, 128),
                ("deepseek-v2-lite", 1, 512, 128), ("deepseek-v2-lite", 32, 512, 128), ("llama3-8b", "json32", 512, 128)]
REPS_B1 = 3  # B=1 runs per case (their median by TPOT is the record; all runs are kept in it)


def cases(quick: bool) -> list:
    """No BenchCase: end-to-end runs are records (see ``records``), not per-call timings."""
    return []


def kv_bytes_per_step(cfg, batch: int, prompt: int, new: int, bytes_per_elt: float = 2.0) -> float:
    """KV-cache bytes one decode step of ``batch`` rows reads, at the mean context of the decode
    (prompt + new / 2 tokens): K and V per KV head, or MLA's latent and RoPE key."""
    per_token = (cfg.kv_lora_rank + cfg.qk_rope_dim) if cfg.is_mla else 2 * cfg.kv_heads * cfg.head_dim
    return batch * (prompt + new / 2) * cfg.layers * per_token * bytes_per_elt


def _prompts(vocab, n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _record(model, case, provider, ttft_ms, tpot_ms, tok_s, floor_ms, wbytes, ceil, note=""):
    tbps = wbytes / (tpot_ms * 1e-3) / 1e12 if tpot_ms else None
    return {"op": "e2e", "case": case, "provider": provider, "model": model,
            "median_us": round(tpot_ms * 1e3, 3) if tpot_ms else None, "tbps": tbps, "tflops": None,
            "frac_of_ceiling": tbps / ceil.read_tbps if tbps and ceil else None, "bound": "memory",
            "ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "tok_per_s": tok_s, "weight_floor_ms": floor_ms,
            "tpot_over_floor": tpot_ms / floor_ms if tpot_ms and floor_ms else None, "method": "wall clock, synced",
            "note": note}


def _engine_name(llm) -> str:
    """opmap-engine, tagged with what differs from the defaults (lockstep decode; PDL off; the
    prefill graphs' token limit). The record's environment.settings lists every OPMAP_* switch."""
    tags = ["lockstep"] if not llm.ecfg.async_decode else []
    tags += ["no-pdl"] if os.environ.get("OPMAP_PDL", "1") == "0" else []
    graphs = llm.ecfg.prefill_graph_tokens
    tags += [f"prefill-graphs={graphs}"] if graphs != EngineConfig.prefill_graph_tokens else []
    cap = llm.ecfg.max_prefill_tokens_with_decodes
    tags += [f"prefill-cap={cap}"] if cap is not None else []
    tags += [f"{k}={_show(v)}" for k, v in sorted(getattr(llm, "e2e_settings", {}).items())]
    return "opmap-engine" + (f"[{','.join(tags)}]" if tags else "")


def _show(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def engine_setting(text: str) -> tuple:
    """``--engine KEY=VALUE``: an EngineConfig field and its value (true / false / none / an int / a
    float / a string); a field EngineConfig lacks is refused naming the fields."""
    key, sep, raw = text.partition("=")
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    if not sep or key not in fields:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE with KEY an EngineConfig field "
                                         f"({', '.join(fields)})")
    low = raw.lower()
    if low in ("true", "false", "none"):
        return key, {"true": True, "false": False, "none": None}[low]
    for kind in (int, float):
        try:
            return key, kind(raw)
        except ValueError:
            pass
    return key, raw


def _engine(model, cases_of_model, ceil, out, skipped, lockstep=False, prefill_graph_tokens=None, prefill_cap=None,
            engine_kw=None):
    # the whole engine, for its rows only (importing this module loads none of it)
    from opmap.engine.llm import LLM
    base, quant, kv = split_model(model)
    cfg = get_preset(base)
    llm = LLM(base, max_num_seqs=max([32] + [b for _, b, _, _ in cases_of_model if isinstance(b, int)]),
              max_num_batched_tokens=step_budget(cases_of_model), max_model_len=min(4096, cfg.max_position),
              gpu_memory_fraction=0.9,  # HF runs after, alone
              async_decode=not lockstep, quantize=quant, kv_cache_dtype=kv,
              max_prefill_tokens_with_decodes=prefill_cap, **(engine_kw or {}),
              **({} if prefill_graph_tokens is None else {"prefill_graph_tokens": prefill_graph_tokens}))
    llm.e2e_settings = dict(engine_kw or {})  # the row's provider name tags them
    try:
        _engine_cases(llm, model, cfg, cases_of_model, ceil, out, skipped)
    finally:
        llm.close()  # frees the KV cache, graphs and weights before HF's model is built


def step_budget(cases_of_model) -> int:
    """The engine's token budget a step: every batch case's prompts in one prefill step, as HF's
    peers run them (one forward over the batch), so a TPOT counts decode steps only, not the
    chunked prefills of later requests (at B=32 / 512 on a 4096 budget those had added about a
    fifth to Llama-3-8B's decode step). At least 4096."""
    return max([4096] + [b * p for _, b, p, _ in cases_of_model if isinstance(b, int) and p])


def split_model(model: str) -> tuple:
    """"llama3-8b:fp8+fp8kv" -> ("llama3-8b", "fp8", "fp8"): (preset, weight format, KV dtype);
    a plain preset -> (preset, None, None)."""
    base, _, rest = model.partition(":")
    parts = rest.split("+") if rest else []
    kv = "fp8" if "fp8kv" in parts else None
    quant = next((p for p in parts if p in ("fp8", "int8", "int4")), None)
    return base, quant, kv


def _unquantised(model: str) -> bool:
    """A plain preset (HF runs only those; see split_model)."""
    return split_model(model)[1:] == (None, None)


def _run(llm, prompts, params) -> None:
    """llm.generate, failing on a request that ended in an error (a record of a run whose requests
    failed would time nothing): the first error names the cause."""
    outs = llm.generate(prompts, params)
    bad = [o for o in outs if o.error is not None]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(outs)} requests failed; the first: {bad[0].error}")


def _engine_cases(llm, model, cfg, cases_of_model, ceil, out, skipped):
    weight_bytes = llm.runner.decode_weight_bytes  # as stored: --quantize or the checkpoint's format
    greedy = dict(temperature=0.0, ignore_eos=True)
    warm = min(600, llm.max_model_len - 8)  # prompt + 8 new tokens within the model length
    _run(llm, _prompts(cfg.vocab, 2, warm, 9), SamplingParams(max_tokens=8, **greedy))  # compile, warm caches
    for _, b, plen, new in cases_of_model:
        if b == "workload":
            rng = random.Random(0)
            ps = [[rng.randrange(cfg.vocab) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
            sps = [SamplingParams(max_tokens=rng.randint(100, 1024), **greedy) for _ in range(256)]
            _run(llm, ps, sps)
            d = llm.last_summary
            case = f"model={model},requests=256,input=100:1024,output=100:1024"
            floor = weight_bytes(llm.ecfg.max_num_seqs) / (ceil.read_tbps * 1e12) * 1e3
            out.append(_record(model, case, _engine_name(llm), d["ttft_ms_p50"], d["tpot_ms_p50"], d["total_tok_per_s"],
                               floor, weight_bytes(llm.ecfg.max_num_seqs), ceil,
                               f"tok_per_s = total (prompt + generated); {d['preemptions']} preemptions"))
            skipped.append({"op": "e2e", "case": case, "provider": "hf-transformers-eager",
                            "reason": "HF generate has no continuous batching: 256 mixed-length requests are not comparable"})
            continue
        if b == "json32":
            case = f"model={model},B=32,prompt={plen},new={new},json_schema=half"
            try:
                import xgrammar  # noqa: F401
            except ImportError as e:
                skipped.append({"op": "e2e", "case": case, "provider": "opmap-engine",
                                "reason": f"structured output needs xgrammar ({e})"})
                continue
            ps = _prompts(cfg.vocab, 32, plen, seed=32)
            _run(llm, ps, SamplingParams(max_tokens=new, **greedy))
            plain = llm.last_summary["tpot_ms_p50"]
            schema = {"type": "array", "items": {"type": "integer"}, "minItems": 200}
            # The first constrained request pays one-time costs: imports (XGrammar's pull in
            # transformers' lazy module tables), the tokenizer info, the compiler. On the CPU the
            # first constrained run made 145 garbage collections and a repeat none; on the GPU that
            # first run was markedly slower (hundreds of collections, one of them full). Warmed
            # here like the plain cases; its time is in the note.
            t0 = time.perf_counter()
            _run(llm, _prompts(cfg.vocab, 2, 16, seed=31), SamplingParams(max_tokens=4, json_schema=schema, **greedy))
            first_use_s = time.perf_counter() - t0
            # Then the timed batch's shapes (32 rows, half constrained), as the plain cases are run
            # once before timing: kernels meet their batch sizes here, not inside a timed step.
            _run(llm, _prompts(cfg.vocab, 32, plen, seed=35),
                 [SamplingParams(max_tokens=8, json_schema=schema if i % 2 else None, **greedy) for i in range(32)])
            # Constrained rows must decode as many tokens as the plain ones, or the batch shrinks and
            # the "overhead" comes out negative (measured: a plain integer array let random-weight
            # rows close it after 3-5 tokens). 200 items take >= 400 bytes: with the byte tokenizer
            # of a random-weight preset the array cannot close within 128 tokens.
            sps = [SamplingParams(max_tokens=new, json_schema=schema if i % 2 else None, **greedy) for i in range(32)]
            # Fresh prompts of the same length: the same prompts would hit the prefix cache, skip
            # the prefill steps that the plain run interleaved with decode, and look faster.
            wb = weight_bytes(32)
            # With the bitmask fill overlapping the forward pass (the engine's way), then serial
            # (the fill waits for the forward), each on fresh prompts: what the overlap saves.
            for overlap, seed in ((True, 33), (False, 34)):
                llm.ecfg.overlap_grammar = overlap
                _run(llm, _prompts(cfg.vocab, 32, plen, seed=seed), sps)
                d = llm.last_summary
                name = _engine_name(llm) + ("" if overlap else "[serial grammar fill]")
                rec = _record(model, case, name, d["ttft_ms_p50"], d["tpot_ms_p50"], d["output_tok_per_s"],
                              wb / (ceil.read_tbps * 1e12) * 1e3, wb, ceil,
                              f"TPOT without constraints in the same run: {plain:.3f} ms; first constrained "
                              f"request (warm-up, untimed): {first_use_s:.2f} s")
                rec["structured_overhead"] = d["tpot_ms_p50"] / plain - 1 if plain else None
                out.append(_with_diagnostics(rec, d))
            llm.ecfg.overlap_grammar = True
            continue
        # Twice at least: the first run meets these shapes first (Triton autotuning, allocator
        # growth). B=1 is then run REPS_B1 times on fresh prompts: one request's TTFT is a single
        # prefill, and single B=1 runs gave TTFTs whose highest was more than half again the lowest.
        _run(llm, _prompts(cfg.vocab, b, plen, seed=b + 1000), SamplingParams(max_tokens=new, **greedy))
        runs = []
        for r in range(REPS_B1 if b == 1 else 1):
            _run(llm, _prompts(cfg.vocab, b, plen, seed=b + 100 * r), SamplingParams(max_tokens=new, **greedy))
            runs.append(llm.last_summary)
        d = sorted(runs, key=lambda x: x["tpot_ms_p50"])[len(runs) // 2]  # the median run by TPOT
        dec = d["step_seconds"]["decode"]
        tok_s = (b * (new - 1) / dec) if b > 1 and dec else d["output_tok_per_s"]
        wb = weight_bytes(b)
        floor = wb / (ceil.read_tbps * 1e12) * 1e3
        note = "tok_per_s = decode tokens / decode time" if b > 1 else "tok_per_s = generated / wall"
        if len(runs) > 1:
            tp, tt = [x["tpot_ms_p50"] for x in runs], [x["ttft_ms_p50"] for x in runs]
            note += (f"; the median of {len(runs)} runs by TPOT (TPOT {min(tp):.3f}-{max(tp):.3f} ms, "
                     f"TTFT {min(tt):.1f}-{max(tt):.1f} ms over the runs)")
        rec = _record(model, f"model={model},B={b},prompt={plen},new={new},bf16", _engine_name(llm),
                      d["ttft_ms_p50"], d["tpot_ms_p50"], tok_s, floor, wb, ceil, note)
        # The decode step's floor with the KV reads too (at B=32 and 576 cached tokens a row they
        # add about a sixth to Llama-3-8B's weight floor): what the decode step time can be compared with.
        kvb = kv_bytes_per_step(cfg, b, plen, new, 1.0 if llm.ecfg.kv_cache_dtype else 2.0)
        rec["kv_bytes_per_step"] = kvb
        rec["step_floor_ms"] = (wb + kvb) / (ceil.read_tbps * 1e12) * 1e3
        rec["runs"] = [{"ttft_ms": x["ttft_ms_p50"], "tpot_ms": x["tpot_ms_p50"]} for x in runs]
        # the tail beside the median: where prefill chunks stall running decodes, TPOT p99 and TTFT
        # p99 move apart from p50 (the trade-off a step budget makes)
        rec["ttft_ms_p99"], rec["tpot_ms_p99"] = d["ttft_ms_p99"], d["tpot_ms_p99"]
        if b > 1 and d["tpot_ms_p99"] is not None:
            rec["note"] += f"; p99 TPOT {d['tpot_ms_p99']:.3f} ms, TTFT {d['ttft_ms_p99']:.1f} ms"
        out.append(_with_diagnostics(rec, d))


def _with_diagnostics(rec: dict, d: dict) -> dict:
    """The run summary's step figures on an engine record: host wall per step and phase (a slow
    prefill vs a wait before it for TTFT, a slow decode step vs time between steps for TPOT), host
    time by part, the longest step and the collector's work."""
    rec["step_ms"] = {k: round(d["step_seconds"][k] / n * 1e3, 3) for k, n in d["steps"].items() if n}
    rec["steps"] = dict(d["steps"])
    rec["host_ms"], rec["step_ms_max"], rec["gc"] = d.get("host_ms_per_step"), d.get("step_ms_max"), d.get("gc")
    return rec


def _hf_model(cfg, attn: str):
    """The preset's HF model on the GPU in bf16, random weights (seed 0)."""
    # heavy: transformers, for the HF rows only
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(to_hf_config(cfg), dtype=torch.bfloat16,
                                                attn_implementation=attn).eval()


def _experts_note(cfg, hf) -> str:
    """"; experts <impl>" for an MoE model whose transformers release names its experts implementation."""
    impl = getattr(hf.config, "_experts_implementation", None)
    return f"; experts {impl}" if cfg.num_experts and impl else ""


def _hf(model, cases_of_model, ceil, out, skipped):
    if not _unquantised(model):
        for _, b, plen, new in cases_of_model:
            skipped.append({"op": "e2e", "case": f"model={model},B={b},prompt={plen},new={new},bf16",
                            "provider": "hf-transformers-eager",
                            "reason": "HF runs the unquantised model only: its rows are those of the bf16 preset"})
        return
    cfg = get_preset(model)
    hf = _hf_model(cfg, "eager")

    def timed(ids, n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    timed(torch.tensor(_prompts(cfg.vocab, 1, 32, 1), device="cuda"), 4)  # warm-up
    for _, b, plen, new in cases_of_model:
        if not isinstance(b, int):
            continue
        ids = torch.tensor(_prompts(cfg.vocab, b, plen, seed=b), device="cuda")
        t1 = timed(ids, 1)
        tn = timed(ids, new)
        tpot = (tn - t1) / (new - 1) * 1e3
        wb = cfg.decode_weight_bytes(b)
        out.append(_record(model, f"model={model},B={b},prompt={plen},new={new},bf16", "hf-transformers-eager",
                           t1 * 1e3, tpot, b * (new - 1) / (tn - t1), wb / (ceil.read_tbps * 1e12) * 1e3, wb, ceil,
                           "HF generate, eager attention; TTFT = generate(1 token), TPOT = (t(new) - t(1)) / (new - 1)"))
    del hf
    gc.collect()
    torch.cuda.empty_cache()


def _hf_static(model, cases_of_model, ceil, out, skipped):
    """HF transformers with a static cache and the decode forward under torch.compile
    (``hf_static.StaticGreedy``, the gpt-fast recipe): the strongest offline peer on this machine."""
    if not _unquantised(model):
        return  # the unquantised model's rows stand for it (see _hf)
    cfg = get_preset(model)
    hf = _hf_model(cfg, "sdpa")  # an MoE model's default experts implementation: the note names it
    try:
        for _, b, plen, new in cases_of_model:
            if not isinstance(b, int):
                continue
            ids = torch.tensor(_prompts(cfg.vocab, b, plen, seed=b), device="cuda")
            run = StaticGreedy(hf, b, plen + new)
            t = time.perf_counter()
            run.generate(ids, new)  # compiles the decode step and captures its graph
            compile_s = time.perf_counter() - t
            _, ttft, dec = run.generate(ids, new)
            wb = cfg.decode_weight_bytes(b)
            out.append(_record(model, f"model={model},B={b},prompt={plen},new={new},bf16", "hf-transformers-static-compile",
                               ttft * 1e3, dec / (new - 1) * 1e3, b * (new - 1) / dec,
                               wb / (ceil.read_tbps * 1e12) * 1e3, wb, ceil,
                               f"HF static cache, SDPA; decode forward under torch.compile(mode='reduce-overhead', "
                               f"fullgraph=True) in a greedy loop; prefill eager; first run (compile) {compile_s:.1f} s"
                               + _experts_note(cfg, hf)))
            del run
    finally:
        del hf
        # Dynamo's caches and the CUDA graph trees' memory pool outlive the model: without this the
        # next model's engine plans its KV cache around them, and its compiled peer shares the
        # step function's recompile limit with this one.
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()


def records(quick: bool = True, progress: bool = True, models=None, done=None, kinds=None,
            hf: bool = True, lockstep: bool = False, prefill_graph_tokens=None, isolate: bool = False,
            prefill_cap=None, engine_kw=None) -> tuple:
    """(records, skipped) of the end-to-end cases; needs a GPU. ``models`` keeps only those
    presets; ``done(out, skipped)`` is called after each provider of each model, so a caller can
    save what is finished before a long run is cut off (a compiled HF peer of an MoE model takes
    minutes to compile per batch size). ``models`` are the cases' model
    names as written: "llama3-8b" is the bf16 rows, "llama3-8b:fp8" those with fp8 weights. ``kinds`` keeps only those cases by their batch
    field: "1", "32", "64", "128", "workload", "json32". ``prefill_graph_tokens``, ``prefill_cap``
    (max_prefill_tokens_with_decodes): the engine's (None: its default). ``isolate``: each model in a child process of its own (``in_children``),
    so that no model's engine starts in what an earlier model's runs left in the process."""
    if not torch.cuda.is_available():
        return [], [{"op": "e2e", "case": "*", "provider": "*", "reason": "needs a CUDA GPU"}]
    todo = [c for c in (QUICK if quick else FULL)
            if (not models or c[0] in models) and (not kinds or str(c[1]) in kinds)]
    todo_models = list(dict.fromkeys(m for m, *_ in todo))
    if isolate and len(todo_models) > 1:
        argv = (["--quick"] if quick else []) + [x for k in kinds or [] for x in ("--case", str(k))]
        argv += ([] if hf else ["--no-hf"]) + (["--lockstep"] if lockstep else [])
        argv += [] if prefill_graph_tokens is None else ["--prefill-graph-tokens", str(prefill_graph_tokens)]
        argv += [] if prefill_cap is None else ["--max-prefill-tokens-with-decodes", str(prefill_cap)]
        argv += [x for k, v in (engine_kw or {}).items() for x in ("--engine", f"{k}={_show(v)}")]
        return in_children(todo_models, argv, done)
    ceil = hw.ceilings(measure=True)
    out, skipped = [], []
    for model in todo_models:
        mine = [c for c in todo if c[0] == model]
        engine = functools.partial(_engine, lockstep=lockstep, prefill_graph_tokens=prefill_graph_tokens,
                                   prefill_cap=prefill_cap, engine_kw=engine_kw)
        sides = (("opmap-engine", engine), ("hf-transformers-eager", _hf),
                 ("hf-transformers-static-compile", _hf_static))
        for who, fn in sides if hf else sides[:1]:
            if progress:
                print(f"[e2e] {model}: {who}", file=sys.stderr, flush=True)
            try:
                fn(model, mine, ceil, out, skipped)
            except Exception as e:  # one side failing must not hide the other's figures
                traceback.print_exc(file=sys.stderr)  # the log keeps where it failed; the record, why
                skipped.append({"op": "e2e", "case": f"model={model}", "provider": who,
                                "reason": f"failed: {type(e).__name__}: {str(e)[:300]}"})
                gc.collect()
                torch.cuda.empty_cache()
            if done is not None:
                done(out, skipped)
    return out, skipped


def in_children(models: list, argv: list, done=None) -> tuple:
    """(records, skipped) of each model run by ``python -m opmap.harness.bench.cases.e2e --child PATH --model M
    *argv`` in turn, each in a fresh process; this process never touches the GPU. A child writes
    what it finished after each side, so one that dies keeps those rows, and its exit is recorded.
    A model's figures then do not depend on what the models before it left in the process
    (docs/engine.md, Measured: engines that ended in NaN logits only after other models' runs)."""
    out, skipped = [], []
    for m in models:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "part.json"
            rc = subprocess.call([sys.executable, "-m", "opmap.harness.bench.cases.e2e", "--child", str(path), "--model", m, *argv])
            part = json.loads(path.read_text()) if path.exists() else {"results": [], "skipped": []}
        out += part["results"]
        skipped += part["skipped"]
        if rc != 0:
            skipped.append({"op": "e2e", "case": f"model={m}", "provider": "*",
                            "reason": f"the child process exited with status {rc} (its log has the cause)"})
        if done is not None:
            done(out, skipped)
    return out, skipped


def kept_rows(out_dir: str, env: dict, recs: list) -> list:
    """The rows of out_dir's e2e baseline for this GPU whose (case, provider) ``recs`` do not hold,
    each noted with the commit that measured it (rows kept before keep their first note)."""
    path = baseline_dir(out_dir, env.get("gpu") or "cpu") / "e2e.json"
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    commit = (old.get("environment") or {}).get("commit")
    have = {(r["case"], r["provider"]) for r in recs}
    kept = []
    for r in old.get("results", []):
        if (r.get("case"), r.get("provider")) in have:
            continue
        r = dict(r)
        if not r.get("measured_at"):
            r["measured_at"] = commit
            r["note"] = "; ".join(x for x in (r.get("note"), f"measured at commit {commit}") if x)
        kept.append(r)
    return kept


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="opmap end-to-end benchmark (engine vs HF transformers, eager and compiled)")
    ap.add_argument("--quick", action="store_true", help="Llama-3-8B shapes at batch 1 and 32 only")
    ap.add_argument("--out", default="bench/baselines", help="writes DIR/<gpu>/e2e.{json,md}, replacing them")
    ap.add_argument("--model", action="append",
                    help="only this model as the cases name it (repeatable): a preset's bf16 rows (llama3-8b), "
                         "or with quantisation (llama3-8b:fp8, llama3-8b:fp8+fp8kv)")
    kinds = sorted({str(c[1]) for c in FULL}, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else k))
    ap.add_argument("--case", action="append", choices=kinds,
                    help="only these cases (by batch: 1, 32, 64, 128, the 256-request workload, JSON at batch 32)")
    ap.add_argument("--no-hf", action="store_true", help="only the engine (no HF transformers runs)")
    ap.add_argument("--lockstep", action="store_true", help="engine without one-step-ahead decode")
    ap.add_argument("--prefill-graph-tokens", type=int, default=None, metavar="N",
                    help="the engine's prefill CUDA-graph token limit (default: the engine's; rows tagged when not)")
    ap.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None, metavar="N",
                    help="the engine's cap on prompt tokens in a step with decodes (rows tagged prefill-cap=N)")
    ap.add_argument("--engine", action="append", type=engine_setting, default=[], metavar="KEY=VALUE",
                    help="an EngineConfig field for the engine's rows (repeatable; rows tagged KEY=VALUE), "
                         "e.g. fuse_gated=false")
    ap.add_argument("--one-process", action="store_true",
                    help="every model in this process (default: each in a child process of its own)")
    ap.add_argument("--keep-others", action="store_true",
                    help="keep the rows of the existing DIR/<gpu>/e2e.json that this run does not measure (a "
                         "subset re-run), each noted with the commit that measured it")
    ap.add_argument("--child", metavar="PATH", help=argparse.SUPPRESS)  # in_children's: write (records, skipped) here
    a = ap.parse_args(argv)
    if a.child:
        def write_part(recs, skipped):
            Path(a.child).write_text(json.dumps({"results": recs, "skipped": skipped}, default=str))

        write_part(*records(quick=a.quick, models=a.model, done=write_part, kinds=a.case, hf=not a.no_hf,
                            lockstep=a.lockstep, prefill_graph_tokens=a.prefill_graph_tokens,
                            prefill_cap=a.max_prefill_tokens_with_decodes, engine_kw=dict(a.engine)))
        return 0

    def doc_of(recs, skipped):
        return {"environment": environment(hw.ceilings(measure=False)), "quick": a.quick, "model": None,
                "command": " ".join(["python3 -m opmap.harness.bench.cases.e2e"] + (argv if argv is not None else sys.argv[1:])),
                "results": recs, "skipped": skipped, "load_errors": []}

    def save_partial(recs, skipped):  # a run cut off by a time limit keeps what it finished
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "e2e-partial.json").write_text(json.dumps(doc_of(recs, skipped), indent=1, default=str))
        # the complete files replace the partial one

    recs, skipped = records(quick=a.quick, models=a.model, done=save_partial, kinds=a.case, hf=not a.no_hf,
                            lockstep=a.lockstep, prefill_graph_tokens=a.prefill_graph_tokens, isolate=not a.one_process,
                            prefill_cap=a.max_prefill_tokens_with_decodes, engine_kw=dict(a.engine))
    doc = doc_of(recs, skipped)
    for r in recs:
        print(f"{r['case']:<55} {r['provider']:<22} TTFT {r['ttft_ms']:.1f} ms  TPOT {r['tpot_ms']:.2f} ms  "
              f"{r['tok_per_s']:.0f} tok/s  floor {r['weight_floor_ms']:.2f} ms"
              + (f" (+KV {r['step_floor_ms']:.2f} ms)" if r.get("step_floor_ms") else "")
              + (f"  step ms {r['step_ms']}" if r.get("step_ms") else "")
              + (f"  p99 TTFT {r['ttft_ms_p99']:.1f} TPOT {r['tpot_ms_p99']:.2f}" if r.get("tpot_ms_p99") else ""))
        if r.get("host_ms"):
            print("    " + "\n    ".join(format_host(r["host_ms"])))
        if r.get("gc"):
            print(f"    longest step ms {r.get('step_ms_max')}; garbage collections {r['gc']}")
    for s in skipped:
        print(f"not run: {s['case']} {s['provider']}: {s['reason']}")
    if recs:
        if a.keep_others:
            doc["results"] = recs + kept_rows(a.out, doc["environment"], recs)
        for r in doc["results"] + skipped:
            r["family"] = "e2e"
        print(write(doc, a.out, png=False))
        (Path(a.out) / "e2e-partial.json").unlink(missing_ok=True)
    return 0 if recs else 1


if __name__ == "__main__":
    sys.exit(main())
