"""What bounds one benchmark row: runs a case of `opmap bench` (its inputs and one provider, as the
bench builds them) under Nsight Compute and prints, per kernel the call launches, the figures that
say where its time goes: duration, SM and DRAM throughput as a share of peak, tensor-pipe activity,
registers and shared memory per block, achieved occupancy, and the largest warp-stall reasons
(cycles stalled per issued instruction).

    python3 scripts/ncu_case.py --op attention.prefill --case B=1,S=8192,h=32/32,d=128,page=64,causal,dtype=bf16 \
        --provider opmap-triton [--out DIR]

Runs on a GPU machine whose runtime lets ncu read the hardware counters (``--clock-control none``:
the clocks stay as the bench ran them). The call is warmed up (compiles, autotuning, plans) outside
the profiled NVTX range, so the profile holds one steady-state call. ``--out`` keeps ncu's raw CSV.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys

RANGE = "opmap-ncu"
CHILD = "OPMAP_NCU_CHILD"
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "ComputeWorkloadAnalysis",
            "MemoryWorkloadAnalysis")
SHOW = [("gpu__time_duration.sum", "us", 1e-3), ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "SM %", 1),
        ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", "mem %", 1),
        ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "DRAM %", 1),
        ("launch__registers_per_thread", "regs", 1), ("launch__shared_mem_per_block", "smem/blk", 1),
        ("sm__warps_active.avg.pct_of_peak_sustained_active", "occupancy %", 1),
        ("launch__grid_size", "grid", 1), ("launch__block_size", "block", 1)]


def _child(args) -> int:
    import torch

    from opmap.harness.bench.runner import collect

    cases, errors = collect(quick=False)
    found = [c for c in cases if c.op == args.op and c.case == args.case]
    if not found:
        near = sorted({c.case for c in cases if c.op == args.op})[:20]
        print(f"no case {args.op} {args.case}; this op has: {near} {errors or ''}", file=sys.stderr)
        return 2
    case = found[0]
    prov = [p for p in case.providers if p.name == args.provider]
    if not prov:
        print(f"no provider {args.provider}; the case has {[p.name for p in case.providers]}", file=sys.stderr)
        return 2
    fn = prov[0].make(case.setup("cuda"))
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(RANGE)
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    return 0


def _tensor_metrics() -> list[str]:
    """The tensor-pipe activity metrics this ncu knows for the local GPU (names differ by chip)."""
    try:
        out = subprocess.run(["ncu", "--query-metrics"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    names = [ln.split()[0] for ln in out.splitlines() if ln.strip() and "pipe_tensor" in ln.split()[0]
             and "cycles_active" in ln.split()[0]]
    return [f"{n}.avg.pct_of_peak_sustained_active" for n in names]


def _summary(raw: str) -> str:
    rows = list(csv.reader(io.StringIO(raw)))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
    if start is None:
        return raw[-4000:]
    head = rows[start]
    lines = []
    for r in rows[start + 2:]:  # the row after the header holds units
        rec = dict(zip(head, r))
        name = rec.get("Kernel Name", "?")[:90]
        figs = []
        for key, label, mul in SHOW:
            v = rec.get(key, "")
            try:
                figs.append(f"{label} {float(v.replace(',', '')) * mul:.4g}")
            except ValueError:
                pass
        tensor = {k: v for k, v in rec.items() if "pipe_tensor" in k and v not in ("", "n/a")}
        figs += [f"{k.split('__')[1].split('.')[0]} {v}%" for k, v in tensor.items()]
        # WarpStateStats: cycles a warp spends stalled per issued instruction, by reason
        stalls = []
        for k, v in rec.items():
            if "issue_stalled" in k and k.endswith("per_issue_active.ratio") and "not_issued" not in k:
                try:
                    stalls.append((float(v.replace(',', '')), k.split("issue_stalled_")[1].split("_per_issue")[0]))
                except ValueError:
                    pass
        stalls.sort(reverse=True)
        lines.append(f"{name}\n  " + ", ".join(figs) + "\n  stall cycles per issued instruction: "
                     + ", ".join(f"{n} {v:.2f}" for v, n in stalls[:6]))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", required=True)
    ap.add_argument("--case", required=True)
    ap.add_argument("--provider", required=True)
    ap.add_argument("--out", help="folder for ncu's raw CSV")
    args = ap.parse_args()
    if os.environ.get(CHILD):
        return _child(args)
    metrics = _tensor_metrics()
    cmd = ["ncu", "--clock-control", "none", "--nvtx", "--nvtx-include", f"{RANGE}/", "--csv", "--page", "raw"]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += (["--metrics", ",".join(metrics)] if metrics else []) + [sys.executable, os.path.abspath(__file__)] + sys.argv[1:]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, CHILD: "1"})
    if p.returncode:
        print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
        return p.returncode
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        safe = "".join(ch if ch.isalnum() else "_" for ch in f"{args.op}_{args.case}_{args.provider}")[:150]
        with open(os.path.join(args.out, safe + ".csv"), "w") as f:
            f.write(p.stdout)
    print(f"== {args.op} {args.case} {args.provider}")
    print(_summary(p.stdout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
