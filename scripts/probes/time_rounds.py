"""Time one benchmark row in rounds within one process, to tell run-to-run spread by process from
spread by inputs: each round is CALLS launches between two CUDA events; with --fresh every round
sets the case's inputs up again (new allocations). Written for the MLA prefill's 128-row build,
whose quick-bench time was 443-903 us from one process to the next (fourteenth session).

    python3 scripts/probes/time_rounds.py attention.mla_prefill "new=4096,prefix=0,h=16,Dqk=192,Dv=128,page=64" opmap-triton --fresh
"""
from __future__ import annotations

import argparse
import sys

import torch

from decode_once import find


def per_kernel(fn, calls: int, top: int = 4) -> str:
    """GPU time per call of the ``top`` kernels of ``calls`` calls, under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [(getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0), e.key)
            for e in prof.key_averages()]
    rows = sorted((t, k) for t, k in rows if t > 0)[::-1][:top]
    return ", ".join(f"{k[:48]} {t / calls:.1f}" for t, k in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("op")
    ap.add_argument("case")
    ap.add_argument("provider")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--fresh", action="store_true", help="new inputs every round")
    ap.add_argument("--kernels", action="store_true",
                    help="after each timed round, the same calls under torch.profiler: GPU time per kernel "
                         "(which kernel moves when a round is slow: the attention kernel or the expansion GEMM)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("time_rounds: needs a CUDA GPU")
    case, prov = find(a.op, a.case, a.provider)
    dev = torch.device("cuda")
    fn = prov.make(case.setup(dev))
    fn()
    out = []
    for r in range(a.rounds):
        if a.fresh and r:
            fn = prov.make(case.setup(dev))
            fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(a.calls):
            fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) * 1000 / a.calls)
        if a.kernels:
            print(f"round {r}: {out[-1]:.1f} us per call; " + per_kernel(fn, a.calls), flush=True)
    print(f"{a.provider}: " + " ".join(f"{x:.1f}" for x in out) + " us per call by round")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
