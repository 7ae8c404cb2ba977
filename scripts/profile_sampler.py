"""GPU time of each sampler kernel (torch.profiler), per bench case: where a sample() call's time
goes. Usage: PYTHONPATH=src python3 scripts/profile_sampler.py [OUT.json]"""
import json
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from opmap.bench.cases.sampling import FILTERS, _setup
from opmap.ops.sampling.sampler import sample


def kernel_times(fn, reps=20, warmup=3):
    """GPU time per call of each kernel fn launches, over reps calls, largest first."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    acc = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name[:60]] += e.device_time / reps
    return dict(sorted(acc.items(), key=lambda kv: -kv[1]))


def main():
    out = {}
    for B in (1, 64):
        for f in ("top_k", "top_p", "top_k+top_p", "min_p"):
            inp = _setup(B, 128256, FILTERS[f])(torch.device("cuda"))
            args = (inp["x"], inp["T"], inp["k"], inp["p"], inp["mp"], inp["seeds"], inp["pos"])
            for name, kw in (("default", {}), ("no B/C", dict(bracket=False)),
                             ("bl1024,w4", dict(config=(1024, 4))), ("bl2048,w8", dict(config=(2048, 8)))):
                t = kernel_times(lambda: sample(*args, **kw))
                key = f"B={B},{f},{name}"
                out[key] = t
                print(key, "total %.1f us:" % sum(t.values()), ", ".join(f"{k} {v:.1f}" for k, v in t.items()),
                      flush=True)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
