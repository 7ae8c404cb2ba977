"""The child side of the benchmark's compile warm-up (``runner._warm_compiles``): rebuild the
parent's case list (``runner.select_cases``), then for each case index read from stdin build one
input set and call every provider that can run here once, so that its kernels are compiled into
the on-disk caches; answer with the counts (``workpool``). Nothing is timed."""
from __future__ import annotations

import json
import sys

import torch

from ..workpool import answer_line, child_stdout
from .runner import select_cases, why_not


def warm_case(case, device) -> tuple:
    """(providers run, providers that raised) of one case: each provider called once on one input set."""
    ran = failed = 0
    inp = case.setup(device)
    for p in case.providers:
        if why_not(p, case):
            continue
        try:
            p.make(inp)()
            if device.type == "cuda":
                torch.cuda.synchronize()
            ran += 1
        except Exception:  # the timing pass runs it again and reports the failure
            failed += 1
    del inp
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ran, failed


def main(argv=None) -> int:
    a = json.loads((argv if argv is not None else sys.argv[1:])[0])
    out = child_stdout()
    try:
        cases = select_cases(a["ops"], a["model"], a["quick"], a["providers"], a["variants"])[0]
    except Exception as e:  # answer every request with the reason
        cases, fatal = None, f"the worker could not build the case list: {type(e).__name__}: {e}"
    else:
        fatal = None if len(cases) == a["total"] else f"the worker has {len(cases)} cases, the parent {a['total']}"
    device = torch.device(a.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    for line in sys.stdin:
        k = int(line)
        if fatal:
            out.write(answer_line({"fatal": fatal}))
            continue
        try:
            ran, failed = warm_case(cases[k], device)
        except Exception as e:  # the case's setup: the timing pass reports it
            ran, failed = 0, 1
            print(f"warm-up of {cases[k].op} {cases[k].case}: {type(e).__name__}: {e}", file=sys.stderr)
        out.write(answer_line({"ran": ran, "failed": failed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
