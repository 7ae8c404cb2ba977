"""Every numeric flag of every `opmap` command, read from the argparse parsers themselves, at 0, -1,
NaN, a huge value and a word: each invocation ends within a time limit, and either succeeds or
exits 1 or 2 with one line on stderr; never a traceback, never "unexpected error"."""
import argparse
import json
import signal
import time

import pytest

from opmap.cli import main as cli

VALUES = ("0", "-1", "nan", str(10 ** 30), "abc")
LIMIT = 120  # seconds per invocation: refusals are instant, a valid value runs a tiny model briefly


def _subparsers() -> dict:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _numeric(action, spec_fields: dict) -> bool:
    """A flag that takes a number: its type reads "1" or "0.5" as one (an int, a float, or a range
    of ints), or it is a spec field of an int or float type for some op."""
    if not action.option_strings or action.nargs == 0 or isinstance(action, argparse._HelpAction):
        return False
    if action.dest.startswith("f_"):
        return any(t.replace("Optional[", "").rstrip("]") in ("int", "float")
                   for t in spec_fields.get(action.dest[2:], {}).values())
    if action.type is None:
        return False
    for probe in ("1", "0.5"):
        try:
            v = action.type(probe)
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool) or (
                isinstance(v, tuple) and all(isinstance(x, int) for x in v)):
            return True
    return False


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    f = tmp_path_factory.mktemp("trace") / "t.json"
    ev = [{"name": "ampere_sgemm_128x64_tn", "ph": "X", "cat": "kernel", "ts": 10 * i, "dur": 5, "pid": 0, "tid": 7}
          for i in range(4)]
    f.write_text(json.dumps({"traceEvents": ev}))
    return str(f)


def _base(command: str, flag: str, trace: str) -> list:
    """A quick invocation of ``command`` that ``flag`` is added to (the flag given last wins)."""
    if command == "run":
        return ["run", "--model", "tiny-llama3", "--prompt", "hi", "--max-tokens", "2", "--max-model-len", "64",
                "--no-progress"]
    if command == "profile":
        if flag in ("--steps", "--kernels", "--host-ops", "--python"):  # what only the engine's profile reads
            return ["profile", "--model", "tiny-llama3", "--num-requests", "2", "--input-len", "4", "--output-len",
                    "2", "--max-model-len", "64", "--steps", "4"]
        return ["profile", "--trace", trace]  # the engine flags parse the same as run's
    if command == "check":
        return ["check", "--quick", "--op", "rmsnorm", "--backend", "reference"]
    if command == "bench":
        return ["bench", "--op", "rmsnorm", "--quick"]
    raise AssertionError(command)


def _cases() -> list:
    fields = cli._all_fields()
    out = []
    for command, p in sorted(_subparsers().items()):
        for a in p._actions:
            if not _numeric(a, fields):
                continue
            flag = next(s for s in a.option_strings if s.startswith("--"))
            out += [(command, flag, v) for v in VALUES]
    return out


CASES = _cases()


def test_the_flags_come_from_the_parsers():
    flags = {(c, f) for c, f, _ in CASES}
    for want in (("run", "--max-num-seqs"), ("run", "--num-requests"), ("run", "--page-size"), ("run", "--seed"),
                 ("run", "--gpu-memory-fraction"), ("run", "--input-len"), ("run", "--temperature"),
                 ("profile", "--kernels"), ("profile", "--steps"), ("check", "--timeout"), ("check", "--batch"),
                 ("check", "--workers"), ("bench", "--warm-workers"), ("select", "--head-dim"),
                 ("select", "--heads")):
        assert want in flags, want
    assert ("run", "--model") not in flags and ("select", "--kind") not in flags


class _TooLong(BaseException):
    """Raised by the alarm: not an Exception, so the command's own error handling does not take it."""


def _alarm(signum, frame):
    raise _TooLong()


def _invoke(argv) -> tuple:
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(LIMIT)
    t0 = time.perf_counter()
    try:
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code
    except _TooLong:
        pytest.fail(f"opmap {' '.join(argv)} ran past {LIMIT} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return rc, time.perf_counter() - t0


def _select_base(flag: str) -> list:
    """`opmap select OP` for the first op whose spec has the field of ``flag``."""
    fields = cli._all_fields()
    name = next(n for n in fields if "--" + n.replace("_", "-") == flag or
                ("--" + {v: k for k, v in cli.ALIASES.items()}.get(n, "").replace("_", "-")) == flag)
    op = next(op for op, t in fields[name].items() if "int" in t or "float" in t)
    return ["select", op, "--arch", "sm90"]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("command,flag,value", CASES)
def test_a_numeric_flag_at_an_edge(command, flag, value, trace, tmp_path, capsys):
    base = _select_base(flag) if command == "select" else _base(command, flag, trace)
    if command == "bench":
        base += ["--out", str(tmp_path)]
    rc, took = _invoke(base + [flag, value])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    text = "\n".join(err)
    assert "Traceback" not in text and "unexpected error" not in text, text[-2000:]
    assert rc in (0, 1, 2), (rc, text[-2000:])
    if rc != 0:
        assert len(err) == 1 and err[0].startswith(f"opmap {command}: error: "), err
