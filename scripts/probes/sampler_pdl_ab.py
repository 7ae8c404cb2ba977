"""The sampler's six passes with and without PDL, in one process each (OPMAP_PDL is read at
import): B=1 and B=64 top-k + top-p, B=64 min-p, graph-replayed as the bench times them.
Usage: OPMAP_PDL=0|1 python3 scripts/probes/sampler_pdl_ab.py"""
import os

import torch

from opmap.bench.cases.sampling import FILTERS, _setup
from opmap.bench.timing import time_calls
from opmap.ops.sampling.sampler import sample

for B, f in ((1, "top_k+top_p"), (64, "top_k+top_p"), (64, "min_p"), (64, "top_p")):
    inp = _setup(B, 128256, FILTERS[f])(torch.device("cuda"))
    args = (inp["x"], inp["T"], inp["k"], inp["p"], inp["mp"], inp["seeds"], inp["pos"])
    t = time_calls([lambda: sample(*args)], graph=True)
    print(f"OPMAP_PDL={os.environ.get('OPMAP_PDL', '1')} B={B} {f}: {t} us", flush=True)
