"""Why the bench (CUDA graph, L2 flushed, input sets cycled) times the sampler's B/C path far
above its kernels' profiler sum: each factor alone. PYTHONPATH=src python3 scripts/diag_sampler_graph.py"""
import os
import sys

import torch
import triton.testing

from opmap.bench.cases.sampling import FILTERS, _setup
from opmap.bench.timing import _graphs
from opmap.ops.sampling.sampler import sample

sys.path.insert(0, os.path.dirname(__file__))
from profile_sampler import kernel_times  # noqa: E402


def prof(fn, reps=20):
    return ", ".join(f"{k[:40]} {v:.1f}" for k, v in kernel_times(fn, reps, warmup=0).items())


for B, f in ((1, "top_k+top_p"), (64, "top_k+top_p"), (64, "top_k")):
    inp = _setup(B, 128256, FILTERS[f])(torch.device("cuda"))
    args = (inp["x"], inp["T"], inp["k"], inp["p"], inp["mp"], inp["seeds"], inp["pos"])
    for bracket in (True, False):
        call = lambda: sample(*args, bracket=bracket)  # noqa: E731
        eager = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3
        g = _graphs([call])[0]
        graph = triton.testing.do_bench(g, warmup=25, rep=100, return_mode="median") * 1e3
        ids_e, _, sup_e = sample(*args, bracket=bracket, return_support=True)
        print(f"B={B} {f} bracket={bracket}: do_bench eager {eager:.1f} us, graph {graph:.1f} us", flush=True)
        print("   profiler eager:", prof(call), flush=True)
        print("   profiler graph:", prof(g), flush=True)
        print("   support (t, n) row 0:", sup_e[0].tolist(), flush=True)
