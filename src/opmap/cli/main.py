"""The `opmap` command: env, select, matrix, check, bench, report (and run / profile from the
engine when it is importable)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Optional

from rich.console import Console
from rich.table import Table

from opmap import __version__
from opmap.cli.run import add_profile_parser, add_run_parser, positive
from opmap.core import hw, registry
from opmap.core import specs as S
from opmap.core.contract import InputError
from opmap.core.select import BackendError, select
from opmap.harness import matrix as M
from opmap.harness.output import wide_console
from opmap.model.presets import PRESETS

# Short flag names for the fields people type most (the field name works too).
ALIASES = {"heads": "num_heads", "kv_heads": "num_kv_heads", "experts": "num_experts"}


class CLIError(Exception):
    """A user error: printed without a traceback, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """A usage error in one line on stderr (argparse prints the whole usage first), exit 2."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


# ---- spec fields as flags -------------------------------------------------------------------

def _all_fields() -> dict:
    """Field name -> {op: annotation} over every spec class (one flag may mean different types
    for different ops, e.g. top_k is an int for moe and a bool for sampling)."""
    out: dict[str, dict] = {}
    for op, cls in S.OP_SPECS.items():
        for f in dataclasses.fields(cls):
            if f.name in ("arch", "phase"):
                continue
            out.setdefault(f.name, {})[op] = str(f.type)
    return out


def _convert(op: str, field: str, text: str, ftype: str):
    t = ftype.replace(" ", "")
    optional = t.startswith("Optional[")
    base = t[len("Optional["):-1] if optional else t
    if optional and text.lower() in ("none", "null", ""):
        return None
    try:
        if base == "bool":
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if base == "int":
            return int(text)
        if base == "float":
            return float(text)
    except ValueError:
        raise CLIError(f"{op}.{field}: cannot read {text!r} as {base}") from None
    return text


def add_spec_flags(p: argparse.ArgumentParser) -> None:
    fields = _all_fields()
    rev = {v: k for k, v in ALIASES.items()}
    g = p.add_argument_group("spec fields (those of the chosen op; see `opmap select OP --fields`)")
    for name, types in sorted(fields.items()):
        flags = ["--" + name.replace("_", "-")]
        if name in rev:
            flags.insert(0, "--" + rev[name].replace("_", "-"))
        is_bool = all(t == "bool" for t in types.values())
        if is_bool:
            g.add_argument(*flags, dest="f_" + name, nargs="?", const="true", metavar="BOOL")
            g.add_argument("--no-" + name.replace("_", "-"), dest="f_" + name, action="store_const",
                           const="false", help=argparse.SUPPRESS)
        else:
            # A flag that is a bool for one op and a number for another may be given bare.
            if "bool" in types.values():
                g.add_argument(*flags, dest="f_" + name, nargs="?", const="true", metavar="V")
            else:
                g.add_argument(*flags, dest="f_" + name, metavar="V")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any spec field, e.g. --set head_dim_v=512")


# `opmap select attention --kind mla`: the fields not given (DeepSeek-V2-Lite: 16 heads over one
# latent KV head of rank 512 + 64 RoPE dims, values of rank 512, 64-token pages)
MLA_DEFAULTS = {"num_heads": 16, "num_kv_heads": 1, "head_dim": 576, "head_dim_v": 512, "page_size": 64}


def spec_from_args(op: str, args, arch: str) -> S.Spec:
    if op not in S.OP_SPECS:
        raise CLIError(f"unknown op {op!r}; known ops: {', '.join(S.OP_SPECS)}")
    types = {f.name: str(f.type) for f in dataclasses.fields(S.OP_SPECS[op])}
    given: dict[str, str] = {}
    for name in _all_fields():
        v = getattr(args, "f_" + name, None)
        if v is not None:
            given[name] = v
    for item in args.set:
        k, sep, v = item.partition("=")
        if not sep:
            raise CLIError(f"--set {item!r}: expected FIELD=VALUE")
        given[ALIASES.get(k.strip(), k.strip()).replace("-", "_")] = v.strip()
    kw = {}
    for name, text in given.items():
        if name not in types or name in ("arch", "phase"):
            fields = ", ".join(f for f in types if f not in ("arch", "phase"))
            raise CLIError(f"{name!r} is not a field of the {op} spec; its fields: {fields}")
        kw[name] = _convert(op, name, text, types[name])
    if op == "attention" and kw.get("kind") == "mla":
        # the spec's defaults are a GQA layer's; for MLA, DeepSeek-V2-Lite's latent layer where not given
        for name, value in MLA_DEFAULTS.items():
            kw.setdefault(name, value)
    try:
        spec = S.spec_for(op, arch=arch, phase=args.phase, **kw)
    except (TypeError, ValueError) as e:
        raise CLIError(f"bad {op} spec: {e}") from None
    heads, kv = getattr(spec, "num_heads", None), getattr(spec, "num_kv_heads", None)
    if heads and kv and heads % kv:
        raise CLIError(f"--kv-heads {kv}: expected a divisor of --heads {heads} (each KV head serves a whole group "
                       "of query heads)")
    return spec


def arch_name(s: str) -> str:
    """An argparse type: a GPU arch as the selector names it (``smNN``) or ``cpu``."""
    if s == "cpu" or (s.startswith("sm") and s[2:].isdigit()):
        return s
    raise argparse.ArgumentTypeError(f"{s!r}: expected cpu or a GPU arch such as sm80, sm89, sm90, sm100")


def seconds(s: str) -> float:
    """An argparse type: a time limit in seconds, positive and at most a day."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a number of seconds") from None
    if not 0 < v <= DAY:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{s!r}: expected seconds in (0, {DAY}]")
    return v


DAY = 86400


def jsonl_file(s: str) -> str:
    """An argparse type: a JSON-lines file to append to (its folder exists; not a folder itself)."""
    if os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"{s!r} is a folder: expected a JSON-lines file, e.g. check/state/M.jsonl")
    folder = os.path.dirname(os.path.abspath(s))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{s!r}: the folder {folder} does not exist")
    return s


def existing_file(s: str) -> str:
    """An argparse type: a file that exists."""
    if not os.path.isfile(s):
        raise argparse.ArgumentTypeError(f"{s!r}: expected an existing file" + (" (it is a folder)" if
                                                                                 os.path.isdir(s) else ""))
    return s


# ---- commands -------------------------------------------------------------------------------

def load_registry() -> None:
    """Import every family's backends; a broken family module is an error that says which."""
    try:
        registry.load_all()
    except Exception as e:
        raise CLIError(f"loading the backend registry failed: {type(e).__name__}: {e}") from e


def cmd_env(args) -> int:
    info = hw.detect()
    out = {"device": dataclasses.asdict(info)}
    t = Table(title="opmap env", show_header=False, title_justify="left")
    for k, v in info.lines():
        t.add_row(k, v)
    if info.kind == "cuda":
        c = hw.ceilings(measure=True, refresh=args.refresh)
        out["ceilings"] = c.as_dict()
        t.add_row("HBM read ceiling", f"{c.read_tbps:.2f} TB/s (large sum)")
        t.add_row("copy ceiling", f"{c.copy_tbps:.2f} TB/s (read + write)")
        t.add_row("bf16 GEMM ceiling", f"{c.bf16_tflops:.0f} TFLOP/s (8192^3)")
        t.add_row("ceilings measured", f"{c.measured_at}, cached in {hw.cache_dir()}")
    else:
        out["ceilings"] = None
        t.add_row("ceilings", "not measured: no GPU (read / copy / GEMM ceilings need one)")
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        Console().print(t)
    return 0


def cmd_select(args) -> int:
    if args.fields:
        cls = S.OP_SPECS.get(args.op)
        if cls is None:
            raise CLIError(f"unknown op {args.op!r}; known ops: {', '.join(S.OP_SPECS)}")
        for f in dataclasses.fields(cls):
            print(f"  {f.name:<16} {str(f.type):<16} default {f.default!r}")
        return 0
    arch = args.arch or hw.local_arch()
    spec = spec_from_args(args.op, args, arch)
    print(f"spec: {args.op} [{spec.describe()}]")
    load_registry()
    if not registry.backends(args.op):
        raise CLIError(f"{args.op}: no backend can serve this spec: none is registered for this op "
                       "(families register theirs in opmap.ops.<family>.backends)")
    try:
        choice = select(args.op, spec, backend=args.backend)
    except BackendError as e:  # a usage error here: the spec asked for is one no backend serves
        print(f"opmap select: error: {_one_line(e)}", file=sys.stderr)
        return 2
    print(choice.explain())
    return 0


def cmd_models(args) -> int:
    """The presets (real shapes, random weights) and the architectures a checkpoint may have."""

    # transformers (behind the HF config parser) loads only for the commands that read a config
    from opmap.model.hf import COMMON_FIELDS, HF_TYPES, HONOURED

    t = Table(title="presets (random weights; a checkpoint directory or config.json works as --model too)",
              title_justify="left")
    for h in ("preset", "model_type", "layers", "hidden", "heads / kv", "head dim", "experts (top-k)", "attention"):
        t.add_column(h, justify="left" if h in ("preset", "model_type", "attention") else "right")
    for name, c in PRESETS.items():
        experts = f"{c.num_experts} ({c.top_k})" if c.num_experts else ""
        t.add_row(name, c.arch, str(c.layers), str(c.hidden), f"{c.heads} / {c.kv_heads}", str(c.head_dim), experts,
                  "MLA" if c.is_mla else ("GQA" if c.kv_heads < c.heads else "MHA"))
    console = wide_console()
    console.print(t)
    a = Table(title="architectures (config.json model_type): the fields read beyond the common ones, and those "
                    "refused at load", title_justify="left")
    for h in ("model_type", "fields read", "refused"):
        a.add_column(h)
    for mt in HF_TYPES:
        a.add_row(mt, *HONOURED[HF_TYPES[mt]])
    console.print(a)
    console.print("common fields: " + COMMON_FIELDS)
    return 0


def cmd_matrix(args) -> int:

    load_registry()
    arch = args.arch or hw.local_arch()
    try:
        mats = M.build(arch, args.op or None)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if args.md:
        print(M.to_markdown(mats), end="")
    else:
        M.print_rich(mats)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(M.to_markdown(mats))
        print(f"wrote {args.markdown}")
    return 0


def cmd_check(args) -> int:
    from opmap.harness.check import runner  # heavy (the cases, the engine): loaded for this command only

    return runner.main(args)


def cmd_bench(args) -> int:
    from opmap.harness.bench import runner  # heavy (the cases, the engine): loaded for this command only

    return runner.main(args)


def cmd_report(args) -> int:
    from opmap.harness import report  # heavy (the engine, matplotlib): loaded for this command only

    return report.main(args)


# ---- parser ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:

    p = _Parser(prog="opmap", description="The operator layer of LLM inference: which "
                                "kernel runs each operator, is it right, how fast against the alternatives.")
    p.add_argument("--version", action="version", version=f"opmap {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="print the traceback of an unexpected error")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("models", help="the model presets and the architectures a checkpoint may have")
    m.set_defaults(func=cmd_models)

    e = sub.add_parser("env", help="device facts and measured ceilings")
    e.add_argument("--refresh", action="store_true", help="measure the ceilings again")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_env)

    s = sub.add_parser("select", help="which backend serves a spec, and why (with every rejection)",
                       allow_abbrev=False)  # --head must not silently mean --head-dim
    s.add_argument("op", help=f"one of {', '.join(S.OP_SPECS)}")
    s.add_argument("--phase", default="decode", choices=S.PHASES)
    s.add_argument("--arch", type=arch_name, help="GPU arch such as sm90 or sm80, or cpu (default: this device)")
    s.add_argument("--backend", help="force a backend by name (error if it cannot serve the spec)")
    s.add_argument("--fields", action="store_true", help="list the spec fields of the op")
    add_spec_flags(s)
    s.set_defaults(func=cmd_select)

    m = sub.add_parser("matrix", help="capability matrix generated from the registry")
    m.add_argument("--arch", type=arch_name, help="GPU arch to show (default: this device)")
    m.add_argument("--op", action="append", help="only these ops (repeatable)")
    m.add_argument("--markdown", metavar="FILE", help="also write the matrix as Markdown")
    m.add_argument("--md", action="store_true", help="print the matrix as Markdown (every condition in its cell) "
                                                     "instead of the terminal tables")
    m.set_defaults(func=cmd_matrix)

    c = sub.add_parser("check", help="correctness checklist against the references")
    c.add_argument("--model", help="preset: check the backends the selector picks for its op map")
    c.add_argument("--backend", nargs="+", help="only cases of these backends")
    c.add_argument("--op", action="append", help="only cases of these ops")
    c.add_argument("--quick", action="store_true", help="the quick subset (under a minute on a CPU)")
    c.add_argument("--section", action="append", help="only these sections (repeatable)")
    c.add_argument("--json", metavar="FILE", help="write the results as JSON")
    c.add_argument("--markdown", metavar="FILE", help="write the results as Markdown")
    c.add_argument("--out", metavar="DIR", help="write <gpu>[-<model>].json and .md there")
    c.add_argument("--sanitizer", action="store_true",
                   help="also run each GPU case in its own process under compute-sanitizer")
    c.add_argument("--timeout", type=seconds, default=300.0, help="seconds per sanitizer case")

    c.add_argument("--workers", type=positive, metavar="N",
                   help="on a GPU, processes that run the cases at once (default: 8 or the CPU cores, fewer; "
                        "1: all in this process)")
    c.add_argument("--jobs", type=positive, default=4, help="sanitizer cases run at once")
    c.add_argument("--batch", type=positive, default=6,
                   help="sanitizer cases per child process (1: each alone; what is left of a run cut "
                        "off by a time limit is the slow cases, which then run side by side)")
    c.add_argument("--resume", metavar="FILE", type=jsonl_file,
                   help="sanitizer verdicts as JSON lines: each is appended as it finishes, and "
                        "those already there are reused (continue a run that was cut off) while their "
                        "family's sources and OPMAP_* settings are unchanged; time-outs are not kept")
    c.add_argument("--reuse", metavar="FILE", action="append", default=[], type=existing_file,
                   help="another run's sanitizer verdicts (JSON lines, as --resume writes) to reuse where "
                        "the case is the same (same key), e.g. another preset's: its GPU cases of families "
                        "that do not depend on the model are the same; repeatable; copied into --resume's file; "
                        "only verdicts of today's source fingerprint count (harness/check/fingerprint.py)")
    c.set_defaults(func=cmd_check)

    b = sub.add_parser("bench", help="time every provider of each benchmark case in one run")
    b.add_argument("--op", action="append", help="only bench ops whose name starts with this (repeatable; e.g. attention, attention.mla)")
    b.add_argument("--model", help="only the cases of the ops of this model (preset, checkpoint or config.json), "
                                    "in the formats it runs (bf16, and a quantised checkpoint's own) and at its widths "
                                    "(an op with no case at them keeps all its cases)")
    b.add_argument("--quick", action="store_true")
    b.add_argument("--provider", action="append", metavar="NAME",
                   help="only the providers of this exact name (repeatable; e.g. opmap-triton for our default "
                        "without its [config] variants, flashinfer)")
    b.add_argument("--warm-workers", type=positive, metavar="N",
                   help="processes that first run every case once, side by side, to compile its kernels before "
                        "the one-by-one timing (default: 8 or the CPU cores, fewer; 1: no warm-up)")
    b.add_argument("--variants", action="store_true",
                   help="also time the tuning variants of our kernels (rows named opmap-triton[...])")
    b.add_argument("--out", default="bench/baselines", metavar="DIR",
                   help="results go to DIR/<gpu>/<family>.{json,md,png}, replacing the files there "
                        "(default: bench/baselines, the figures the docs cite)")
    b.add_argument("--no-png", action="store_true", help="skip the roofline PNGs")
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser("report", help="the main job: the operator map of a model on this device")
    r.add_argument("--model", required=True, help="a preset (opmap models), a checkpoint directory or a config.json")
    r.add_argument("--out", metavar="DIR", help="output folder (default reports/<model>-<arch>)")
    r.add_argument("--no-check", action="store_true", help="skip the correctness lines")
    r.add_argument("--no-bench", action="store_true", help="skip the benchmarks (GPU only anyway)")
    r.add_argument("--full", action="store_true", help="full check and bench instead of --quick")
    r.add_argument("--arch", choices=["sm80", "sm89", "sm90", "sm100", "cpu"],
                   help="plan for this GPU arch from any machine: its selection and the expected times from "
                        "its committed baselines (default: this device, measured)")
    r.set_defaults(func=cmd_report)


    add_run_parser(sub)
    add_profile_parser(sub)
    return p


def main(argv: Optional[list] = None) -> int:
    """Exit status: 0 done, 1 bad input or a failed check, 2 a usage error (argparse's too), 130
    interrupted. A user mistake is one line on stderr, never a traceback; an unexpected error is
    one line too, with its traceback under -v."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    prog = f"opmap {args.command}"
    try:
        rc = args.func(args)
    except CLIError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except (InputError, BackendError) as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except OSError as e:  # a file that is not there, not readable, a disk that is full
        print(f"{prog}: error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a bug of ours: one line, the traceback with -v
        if args.verbose:
            raise
        print(f"{prog}: unexpected error: {type(e).__name__}: {_one_line(e)} (run with -v for the traceback)",
              file=sys.stderr)
        return 1
    return rc or 0


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return " ".join(lines)[:800] or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
