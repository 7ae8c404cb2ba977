"""`opmap run` and `opmap profile`: argparse sub-parser factories (wired in by opmap.cli.main) and their
functions ``cli_run(args)`` / ``cli_profile(args)``."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import sys

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.engine.config import EngineConfig, SEED_LIMIT, machine_memory
from opmap.harness.names import closest


def _range(s: str) -> tuple:
    a, _, b = s.partition(":")
    lo, hi = int(a), int(b or a)
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"{s!r}: expected N or LO:HI with 1 <= LO <= HI")
    return lo, hi


def _backend(s: str) -> tuple:
    op, _, name = s.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"{s!r}: expected OP=BACKEND, e.g. attention=triton")
    registry.load_all()
    ops = sorted(registry.ops())
    if op not in ops:
        raise argparse.ArgumentTypeError(f"{s!r}: no op {op!r} (ops: {', '.join(ops)}). {closest([op], ops)}")
    names = [b.name for b in registry.backends(op)]
    if name not in names:
        raise argparse.ArgumentTypeError(f"{s!r}: op {op!r} has no backend {name!r} (backends: {', '.join(names)}). "
                                         f"{closest([name], names)}")
    return op, name


def _int_at_least(lo: int, what: str):
    """An argparse type: an integer >= ``lo`` (``what`` names it in the error)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r}: expected {what}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{s!r}: expected {what}")
        return v

    return parse


def _int_in(lo: int, hi: int, what: str):
    """An argparse type: an integer in [``lo``, ``hi``]."""
    at_least = _int_at_least(lo, what)

    def parse(s: str) -> int:
        v = at_least(s)
        if v > hi:
            raise argparse.ArgumentTypeError(f"{s!r}: expected {what}")
        return v

    return parse


positive = _int_at_least(1, "a positive integer")
_non_negative = _int_at_least(0, "an integer >= 0")


def _fraction(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a number in (0, 1]") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a number in (0, 1]")
    return v


def _out_file(s: str) -> str:
    folder = os.path.dirname(os.path.abspath(s))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{s!r}: the folder {folder} does not exist")
    return s


def _engine_args(p, model_required: bool = True) -> None:
    p.add_argument("--model", required=model_required,
                   help="a preset (e.g. llama3-8b, tiny-llama3), an HF checkpoint directory or a config.json")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    p.add_argument("--quantize", default=None, choices=["fp8", "int8", "int4"],
                   help="quantise at load the attention and dense MLP projections, fp8 / int8 with one scale per "
                        "output channel (and an LM head of its own), int4 with one per 128 input channels "
                        "(round to nearest, symmetric); router, MoE experts and embedding keep --dtype; decode runs "
                        "weight-only kernels; with fp8 on sm90 steps of >= 128 rows (prefill) also quantise the "
                        "activations per token for fp8 tensor cores")
    p.add_argument("--kv-cache-dtype", default=None, choices=["fp8"],
                   help="fp8: the KV cache in e4m3 with a scale of 1 per KV head (GQA models; values beyond "
                        "+-448 saturate); default: the model's dtype")
    p.add_argument("--max-num-seqs", type=positive, default=None,
                   help="sequences per step (default: 64, or --max-num-batched-tokens where that is smaller)")
    p.add_argument("--max-num-batched-tokens", type=positive, default=2048)
    p.add_argument("--max-prefill-tokens-with-decodes", type=positive, default=None, metavar="N",
                   help="prompt tokens a step may take while sequences decode (bounds their wait per step, "
                        "TPOT p99, at the cost of TTFT; default: the whole step budget)")
    p.add_argument("--max-model-len", type=positive, default=None)
    p.add_argument("--page-size", type=positive, default=None,
                   help="tokens per KV page (default: 64 for MLA models and on sm90 GPUs, 16 otherwise)")
    p.add_argument("--gpu-memory-fraction", type=_fraction, default=0.85)
    p.add_argument("--num-pages", type=positive, default=None, help="force the KV page count")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (decode and prefill steps run eagerly)")
    p.add_argument("--prefill-graph-tokens", type=_non_negative, default=EngineConfig.prefill_graph_tokens,
                   help="on a GPU, prefill steps of at most this many tokens are padded to 128-token buckets and "
                        "replayed from CUDA graphs captured at start-up (0: eager, unpadded prefill)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the start-up warm-up (two requests that compile the kernels of a prefill, a mixed "
                        "and a decode step; on by default on a GPU), so the first requests carry the compiles")
    p.add_argument("--lockstep", action="store_true",
                   help="read every decode step's tokens before launching the next (no one-step-ahead decode)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--backend", type=_backend, action="append", default=[], metavar="OP=NAME",
                   help="force a backend for an op (repeatable)")
    p.add_argument("--seed", type=_int_in(0, SEED_LIMIT - 1, "an integer in [0, 2**63)"), default=0,
                   help="seed of random weights and of the synthetic workload")
    p.add_argument("--num-requests", type=positive, default=None, help="synthetic workload: number of requests")
    p.add_argument("--input-len", type=_range, default=(128, 128), help="synthetic prompt length N or LO:HI")
    p.add_argument("--output-len", type=_range, default=(64, 64), help="synthetic output length N or LO:HI")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=positive, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)


def add_run_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help="generate with the engine: prompts or a synthetic workload; TTFT/TPOT report")
    _engine_args(p)
    p.add_argument("--chat", action="store_true",
                   help="each --prompt is a user message, rendered by the checkpoint's chat template")
    p.add_argument("--system", default=None, help="with --chat: a system message before each prompt")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json-schema", default=None, metavar="SCHEMA",
                     help="constrain every output to this JSON schema (a JSON string or a path to a .json file)")
    out.add_argument("--regex", default=None, help="constrain every output to this regular expression")
    p.add_argument("--quiet", action="store_true", help="print the generated texts only")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", type=_out_file, default=None, help="write the summary (and outputs) to this file")
    p.set_defaults(func=cli_run)
    return p


def add_profile_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("profile", help="GPU time per operator category and phase: of opmap's engine (--model) or "
                                       "of any engine's trace (--trace FILE)")
    _engine_args(p, model_required=False)
    p.add_argument("--trace", action="append", default=None, metavar="FILE",
                   help="analyse this trace instead of running the engine: a PyTorch profiler Chrome trace "
                        "(.json / .json.gz; vLLM, SGLang, HF transformers, opmap) or an Nsight Systems SQLite export; "
                        "repeat it (or give a folder) for the ranks of one tensor / expert parallel run")
    p.add_argument("--baseline", default=None, metavar="FILE",
                   help="with one --trace (the run after a change): the trace of the same workload before it; "
                        "prints which operator moved: ms per step of each phase and category before and after, the "
                        "kernels that appeared or vanished, the step time's change explained by the categories")
    p.add_argument("--png", type=_out_file, default=None, help="with --trace: write a timeline of the first steps")
    p.add_argument("--json", type=_out_file, default=None, help="with --trace: write the analysis as JSON")
    p.add_argument("--steps", type=positive, default=40, help="engine steps to profile")
    p.add_argument("--save-trace", type=_out_file, default=None, help="write the engine's Chrome trace here")
    p.add_argument("--kernels", type=_non_negative, default=0, metavar="N",
                   help="also list the N kernels with the most GPU time per phase (launches and us per step)")
    p.add_argument("--host-ops", type=_non_negative, default=0, metavar="N",
                   help="also list the N operators with the most host time per phase (checks, launch, Python "
                        "inside their ranges): where an eager step's host time goes")
    p.add_argument("--python", type=_non_negative, default=0, metavar="N",
                   help="then run the workload once more (fresh prompts) under cProfile and list the N Python "
                        "functions with the most own host time")
    p.add_argument("--compare", type=_backend, default=None, metavar="OP=NAME",
                   help="profile again with this backend forced and say whether the step time moved")
    p.set_defaults(func=cli_profile, num_requests=None)
    return p


def _build(args, **extra):
    # the engine, for these commands only: `opmap --help` and `opmap select` load none of it
    from opmap.engine.llm import LLM

    return LLM(args.model, dtype=args.dtype, quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype,
               max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
               max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
               page_size=args.page_size, gpu_memory_fraction=args.gpu_memory_fraction, num_pages=args.num_pages,
               enforce_eager=args.enforce_eager, prefill_graph_tokens=args.prefill_graph_tokens,
               async_decode=not args.lockstep,
               warmup=False if args.no_warmup else None,
               prefix_caching=not args.no_prefix_caching,
               chunked_prefill=not args.no_chunked_prefill, seed=args.seed,
               backends=dict(args.backend) or None, **extra)


def workload(llm, args) -> tuple:
    """(prompts, params): the given prompts, or random token prompts for --num-requests."""
    # the engine's modules load for these commands only: the CLI's start loads engine.config alone
    from opmap.engine.params import SamplingParams

    base = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.prompt and not args.num_requests:
        return list(args.prompt), SamplingParams(max_tokens=args.max_tokens, **base)
    n = args.num_requests or 8
    rng = random.Random(args.seed)
    cap = llm.max_model_len - 1
    prompts, params = [], []
    for i in range(n):
        il = min(rng.randint(*args.input_len), cap - 1)
        ol = max(1, min(rng.randint(*args.output_len), cap - il))
        prompts.append([rng.randrange(llm.cfg.vocab) for _ in range(il)])
        params.append(SamplingParams(max_tokens=ol, ignore_eos=True, seed=(args.seed + i) % SEED_LIMIT, **base))
    return prompts, params


def _check_workload(args) -> None:
    """A synthetic workload the host can hold, before the engine is built: every request's tokens
    and its state live in host memory until the run ends (an InputError naming --num-requests
    otherwise)."""
    # the model's config (transformers behind it) loads for a synthetic workload only
    from opmap.model.hf import resolve_model

    if not args.num_requests:
        return
    n = args.num_requests
    have, what = machine_memory("cpu")
    length = args.max_model_len or resolve_model(args.model)[0].max_position
    tokens = min(args.input_len[1] + args.output_len[1], length)
    need = n * (REQUEST_BYTES + TOKEN_BYTES * tokens)
    if need > have:
        raise InputError("--num-requests", n, f"at most {have // (REQUEST_BYTES + TOKEN_BYTES * tokens)} requests "
                         f"of up to {tokens} tokens: each request's state must fit {what}")


# Host memory of one request in flight: its Sequence, SamplingParams, output and stop checker, and
# each of its tokens as a Python int in two lists (prompt and output, token times and logprobs).
REQUEST_BYTES, TOKEN_BYTES = 4096, 96


def _check_sampling(args) -> None:
    """The sampling flags, as SamplingParams checks them, before an engine is built (an InputError)."""
    # the engine's modules load for these commands only: the CLI's start loads engine.config alone
    from opmap.engine.params import SamplingParams

    SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def _setup_logging(args=None) -> None:
    """The engine's log (the selector's choice of every operator, ~40 lines) at -v; warnings otherwise."""
    verbose = bool(getattr(args, "verbose", False))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s", stream=sys.stderr)


def _constraint(args) -> dict:
    """SamplingParams fields of --json-schema / --regex (a schema file is read; its errors are InputErrors)."""
    if args.regex is not None:
        return {"regex": args.regex}
    if args.json_schema is None:
        return {}
    text = args.json_schema
    if os.path.isfile(text):
        with open(text) as f:
            text = f.read()
    try:
        return {"json_schema": json.loads(text)}
    except json.JSONDecodeError as e:
        raise InputError("--json-schema", repr(args.json_schema[:60]), f"a JSON schema or a .json file ({e})") from None


def cli_run(args) -> int:
    # the engine's modules load for these commands only: the CLI's start loads engine.config alone
    from opmap.engine.metrics import format_summary
    from opmap.engine.params import SamplingParams

    if args.quiet:
        args.no_progress = True
    else:
        _setup_logging(args)
    _check_sampling(args)
    if (args.chat or args.system) and not args.prompt:
        raise InputError("--chat", "no --prompt", "at least one --prompt (each a user message)")
    if args.system and not args.chat:
        raise InputError("--system", "without --chat", "--chat (the system message goes through the chat template)")
    extra = _constraint(args)  # a bad schema fails before the model loads
    _check_workload(args)
    llm = _build(args)
    prompts, params = workload(llm, args)
    if extra:
        params = dataclasses.replace(params, **extra) if not isinstance(params, list) else \
            [dataclasses.replace(p, **extra) for p in params]
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompts = llm.chat_prompts([system + [{"role": "user", "content": p}] for p in args.prompt])
    # Warm-up at the first prompt's length with other tokens (kernels compiled and tuned for these
    # shapes, and no prefix-cache hit handed to the measured run).
    first = prompts[0] if isinstance(prompts[0], list) else llm.tokenizer.encode(prompts[0])
    llm.generate([[(t + 1) % llm.cfg.vocab for t in first] or [1]],
                 SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    if args.quiet:
        for o in outs:
            print(o.text if o.error is None else f"error: {o.error}")
        return _failed(outs)
    if args.prompt and not args.num_requests:
        if llm.path is None:
            print(f"({args.model}: random weights, so the text below is meaningless; a checkpoint directory "
                  "gives real text)")
        for o in outs:
            print(f"--- prompt {o.index}: {o.finish_reason}" + (f" ({o.error})" if o.error else ""))
            print(o.text)
    for line in format_summary(llm.last_summary, gpu=llm.runner.device.type == "cuda"):
        print(line)
    r = llm.runner
    startup = {"load_s": r.load_s, "moe_tuning_s": r.moe_warm_s, "warmup_s": llm.warmup_s}
    print("start-up: weights %.2f s, MoE kernel tuning %.2f s, warm-up %.2f s" % tuple(startup.values()))
    if args.json:
        doc = {"model": args.model, "summary": llm.last_summary, "startup": startup, "backends": llm.runner.choice_lines,
               "random_weights": llm.path is None,
               "outputs": [{"index": o.index, "finish_reason": o.finish_reason, "error": o.error, "text": o.text,
                            "token_ids": list(o.token_ids), "num_tokens": len(o.token_ids), "ttft": o.ttft,
                            "tpot": o.tpot} for o in outs]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return _failed(outs)


def _failed(outs: list) -> int:
    """Exit status of a run: 1 when a request ended in an error, which one line on stderr names
    (the first of them, and how many there were); 0 otherwise."""
    bad = [o for o in outs if o.error is not None]
    if not bad:
        return 0
    more = f" ({len(bad)} of {len(outs)} requests failed)" if len(bad) > 1 else ""
    print(f"opmap run: error: request {bad[0].index}: {bad[0].error}{more}", file=sys.stderr)
    return 1


def cli_trace(args) -> int:
    """`opmap profile --trace FILE`: another engine's trace on the operator map."""
    # the profiler view loads for this command only
    from opmap.harness.profile import analyze
    from opmap.harness.profile import plot
    from opmap.harness.profile import ranks
    from opmap.harness.profile import trace

    files = ranks.trace_files(args.trace)
    if not files:
        raise InputError("--trace", repr(args.trace), "trace files, or a folder holding them")
    if args.baseline:
        return _trace_diff(args, files)
    if len(files) > 1:
        res = ranks.analyze_ranks(files, progress=True)
        for line in ranks.format_lines(res):
            print(line)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": [analyze.summary_json(r) | {"communication": r["communication"]}
                                     for r in res["ranks"]],
                           **{k: res[k] for k in ("steps", "slowest", "lag_ms", "merged", "diagnosis")}}, f, indent=1)
            print(f"wrote {args.json}")
        return 0
    t = trace.load(files[0], progress=True)
    res = analyze.analyze(t)
    for line in analyze.format_lines(res):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(analyze.summary_json(res), f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        why = plot.timeline_png(t, args.png)
        print(f"wrote {args.png}" if why is None else f"no timeline: {why}")
    return 0


def _trace_diff(args, files: list) -> int:
    """`opmap profile --trace AFTER --baseline BEFORE`: which operator moved between two traces."""
    # the profiler view loads for this command only
    from opmap.harness.profile import analyze
    from opmap.harness.profile import diff
    from opmap.harness.profile import trace

    if len(files) != 1:
        raise InputError("--baseline", f"{len(files)} --trace files", "one --trace file (the run after the change)")
    before = analyze.analyze(trace.load(args.baseline, progress=True))
    after = analyze.analyze(trace.load(files[0], progress=True))
    d = diff.compare(before, after)
    for line in diff.format_lines(d):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"before": analyze.summary_json(before), "after": analyze.summary_json(after), "diff": d}, f,
                      indent=1)
        print(f"wrote {args.json}")
    return 0


def cli_profile(args) -> int:
    # the profiler and the engine load for this command only
    from opmap.harness import profile as P
    from opmap.engine.params import SamplingParams

    if args.trace:
        return cli_trace(args)
    if not args.model:
        raise InputError("profile", "neither --model nor --trace", "--model MODEL (run the engine) or --trace FILE")
    _setup_logging(args)
    _check_sampling(args)
    _check_workload(args)
    llm = _build(args, trace_ops=True)
    prompts, params = workload(llm, args)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    res = P.profile_engine(llm, prompts, params, args.steps, args.save_trace)
    print(f"opmap profile: {args.model}, {res['profiled_steps']} steps on {llm.runner.device} "
          f"({'CUDA graphs' if llm.runner.graphs else 'eager'} decode)")
    from opmap.harness.profile import analyze  # the profiler view loads for this command only

    # the trace's operator map as `opmap profile --trace` reads any engine's, then the engine's own view
    # (host time per part, operator ranges, graph replay)
    for line in analyze.format_lines(res["analysis"])[1:]:
        if not line.startswith("diagnosis: "):
            print(line)
    print("opmap's engine view (operator ranges; host time per step part):")
    for line in P.format_profile(res):
        print(line)
    if args.kernels:
        for line in P.format_kernels(res, args.kernels):
            print(line)
    if args.host_ops:
        for line in P.format_host_ops(res, args.host_ops):
            print(line)
    for line in P.quant_lines(llm):
        print(line)
    lines = P.diagnose(res, llm, P.phase_backends(llm))
    if args.python:
        args.seed += 1  # fresh prompts: the profiled ones would hit the prefix cache
        for line in P.python_hotspots(llm, *workload(llm, args), args.python):
            print(line)
    if args.compare:
        op, name = args.compare
        args.backend = [*args.backend, (op, name)]
        llm.close()  # the second engine is sized from free memory: release the first one's cache
        other = _build(args, trace_ops=True)
        other.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        res2 = P.profile_engine(other, *workload(other, args), args.steps, None)
        other.close()
        for ph, p in res["phases"].items():
            q = res2["phases"].get(ph)
            if not q or not p["steps"] or not q["steps"]:
                continue
            a, b = p["wall_us"] / p["steps"], q["wall_us"] / q["steps"]
            moved = (b - a) / a
            verdict = ("the bottleneck is elsewhere" if abs(moved) < 0.03
                       else ("faster" if moved < 0 else "slower"))
            lines.append(f"{ph}: forcing {op}={name} changed the step time by {moved:+.1%} "
                         f"({a / 1e3:.3f} -> {b / 1e3:.3f} ms): {verdict}")
    for line in lines + [d for d in res["analysis"]["diagnosis"] if "idle" not in d]:
        print("diagnosis: " + line)
    if args.save_trace:
        print(f"Chrome trace: {args.save_trace}")
    return 0
