"""Run one benchmark row a few times, for a profiler: the case's inputs, the provider's callable,
warm-up launches outside the profiled range and then RUNS launches inside it
(torch.cuda.profiler.start/stop, so that `ncu --profile-from-start off` sees only those).

    ncu --clock-control none --profile-from-start off --section WarpStateStats ... \\
        python3 scripts/probes/decode_once.py attention.decode "B=64,kv=4096,h=32/8,d=128,page=16,dtype=fp8" opmap-triton

The case and provider names are the bench's (`opmap bench` prints them); the full grid is searched
when the quick one lacks the case. Written to find what bounds the fp8 decodes (docs/attention.md,
docs/mla.md, thirteenth session): they run at bf16's time per token for half the bytes.
"""
from __future__ import annotations

import argparse
import sys

import torch

from opmap.bench.runner import collect


def find(op: str, case: str, provider: str):
    """The case and provider, from the quick grid or else the full one (which has the variants)."""
    names = []
    for quick in (True, False):
        cases, _ = collect(quick)
        for c in cases:
            if c.op == op and c.case == case:
                for p in c.providers:
                    if p.name == provider:
                        return c, p
                names += [p.name for p in c.providers]
    if names:
        sys.exit(f"{op} {case}: no provider {provider!r}; it has {sorted(set(names))}")
    sys.exit(f"no bench case {op} {case!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("op")
    ap.add_argument("case")
    ap.add_argument("provider")
    ap.add_argument("--warmup", type=int, default=3, help="launches before the profiled range")
    ap.add_argument("--runs", type=int, default=1, help="launches inside it")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_once: needs a CUDA GPU")
    case, prov = find(a.op, a.case, a.provider)
    fn = prov.make(case.setup(torch.device("cuda")))
    for _ in range(a.warmup):  # compiles and autotunes outside the range
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(a.runs):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"{a.op} {a.case} {a.provider}: {a.warmup} warm-up and {a.runs} profiled launches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
