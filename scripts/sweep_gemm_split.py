"""Sweep split-K for the decode GEMM (ops/gemm/triton_gemm.py) at the decode shapes of the presets,
on a GPU: for each (M, N, K) and each split count, the autotuned kernel's median time, and which
split ``plan()`` picks. Writes OUT/gemm-split.json and prints a table.

    PYTHONPATH=src python3 scripts/sweep_gemm_split.py OUT [--m 1 --m 32]

Why: at M = 1 the down projection (N=4096, K=14336) ran at 62% of the read ceiling; the
wave-quantisation model in plan() predicts which split keeps every SM streaming to the end.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from opmap import hw
from opmap.bench.timing import num_sets, time_calls
from opmap.ops.gemm import triton_gemm as tg

SHAPES = {  # name: (N, K) of the weight
    "llama3-8b qkv": (6144, 4096), "llama3-8b o": (4096, 4096), "llama3-8b gate_up": (28672, 4096),
    "llama3-8b down": (4096, 14336), "llama3-8b lm_head": (128256, 4096),
    "qwen3-8b down": (4096, 12288), "qwen3-8b gate_up": (24576, 4096),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--m", type=int, action="append", help="batch rows (default 1)")
    ap.add_argument("--splits", default="1,2,3,4,6,8")
    a = ap.parse_args()
    ceil = hw.ceilings(measure=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for m in a.m or [1]:
        for name, (n, k) in SHAPES.items():
            nbytes = 2 * (n * k + m * k + m * n)
            sets = num_sets(nbytes)
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(sets)]
            picked = tg.plan(m, n, k, sms)["SPLIT"]
            for s in [int(v) for v in a.splits.split(",")]:
                calls = [lambda x=x, w=w, s=s: tg.linear(x, w, _plan={"SPLIT": s}) for x, w in zip(xs, ws)]
                ref = xs[0].float() @ ws[0].float().t()
                err = (calls[0]().float() - ref).abs().max().item()
                t = time_calls(calls, graph=True)
                tbps = nbytes / (t.median_us * 1e-6) / 1e12
                rows.append({"shape": name, "M": m, "N": n, "K": k, "split": s, "plan_split": picked,
                             "median_us": round(t.median_us, 2), "tbps": round(tbps, 3),
                             "frac_of_read_ceiling": round(tbps / ceil.read_tbps, 3) if ceil else None,
                             "max_abs_err": err, "method": t.method})
                r = rows[-1]
                print(f"M={m:<3} {name:<20} split={s:<2} {'(plan)' if s == picked else '      '} "
                      f"{r['median_us']:8.2f} us {r['tbps']:6.3f} TB/s {r['frac_of_read_ceiling']}", flush=True)
            del xs, ws
            torch.cuda.empty_cache()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    doc = {"command": " ".join(["scripts/sweep_gemm_split.py"] + sys.argv[1:]), "sms": sms,
           "read_ceiling_tbps": ceil.read_tbps if ceil else None, "rows": rows}
    (Path(a.out) / "gemm-split.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
