"""The child side of the benchmark's compile warm-up (``runner._warm_compiles``): rebuild the
parent's case list (``runner.select_cases``), then for each case index read from stdin build one
input set and call every provider that can run here once, so that its kernels are compiled into
the on-disk caches; answer with the counts (``workpool.serve``). Nothing is timed."""
from __future__ import annotations

import sys

import torch

from opmap.harness.workpool import serve
from opmap.harness.bench.runner import select_cases, why_not


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


def _warm(case) -> dict:
    try:
        ran, failed = warm_case(case, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    except Exception as e:  # the case's setup: the timing pass reports it
        ran, failed = 0, 1
        print(f"warm-up of {case.op} {case.case}: {type(e).__name__}: {e}", file=sys.stderr)
    return {"ran": ran, "failed": failed}


def main(argv=None) -> int:
    return serve(argv, lambda a: select_cases(a["ops"], a["model"], a["quick"], a["providers"], a["variants"])[0],
                 _warm, "case list")


if __name__ == "__main__":
    sys.exit(main())
