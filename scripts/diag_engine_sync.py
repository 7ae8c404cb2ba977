"""Where the engine's host waits on the GPU during steady decode: CUDA sync debug mode "warn" with
the Python stack of every synchronising call, over decode steps of a B=1 request (after warm-up);
then the host time of each part of the sampler's launch (the e2e records put ~4.6 ms of a 5.1 ms
B=1 step in "sample" with no synchronising call found by the debug mode: which call blocks?).
PYTHONPATH=src python3 scripts/diag_engine_sync.py [layers [preset [device]]]  (CPU smoke run:
... 1 tiny-llama3 cpu; the debug mode part needs CUDA)"""
import collections
import dataclasses
import sys
import traceback
import warnings

import torch

from opmap.engine.llm import LLM
from opmap.ops.sampling.params import SamplingParams
from opmap.presets import PRESETS

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
cfg = dataclasses.replace(PRESETS[sys.argv[2] if len(sys.argv) > 2 else "llama3-8b"], layers=layers)
device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
cuda = device == "cuda"
seen = collections.Counter()


def show(message, category, filename, lineno, file=None, line=None):
    stack = [f"{f.filename.split('src/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
             if "opmap" in f.filename]
    seen[(str(message)[:80], " <- ".join(reversed(stack[-6:])))] += 1


def timed(obj, name, label, acc):
    """Wrap obj.name so that each call's host time is added to acc[label]."""
    import time

    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[label].append(time.perf_counter() - t)

    setattr(obj, name, wrapper)
    return fn


with LLM(cfg, device=device, max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=2048, num_pages=256) as llm:
    prompt = [1 + i % (cfg.vocab - 1) for i in range(512)]
    for temp in (0.0, 0.8):
        sp = SamplingParams(max_tokens=24, temperature=temp, top_k=50 if temp else 0, top_p=0.9 if temp else 1.0,
                            ignore_eos=True)
        llm.generate([prompt], sp)  # warm-up
        warnings.showwarning = show
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        llm.generate([prompt], sp)
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
        print(f"temperature {temp}: {sum(seen.values())} synchronising calls in a 24-token generation")
        for (msg, where), n in seen.most_common(12):
            print(f"  {n:4d} x {msg} at {where}")
        seen.clear()

    # Host time per call of the sampler's parts, over a steady 64-token decode at B=1.
    import opmap.engine.llm as L
    import opmap.engine.sampler as ES

    acc = collections.defaultdict(list)
    sp = SamplingParams(max_tokens=64, temperature=0.8, top_k=50, top_p=0.9, ignore_eos=True)
    llm.generate([prompt], sp)
    orig = [(ES, "_to_device", timed(ES, "_to_device", "_to_device (positions)", acc)),
            (llm.sampler, "sample", timed(llm.sampler, "sample", "sample kernels (launch)", acc)),
            (llm.sampler, "launch", timed(llm.sampler, "launch", "Sampler.launch (all)", acc)),
            (L._Pending, "__init__", timed(L._Pending, "__init__", "_Pending (readback copy)", acc))]
    # Allocator events over the same run: a cudaMalloc retry frees cached blocks (cudaFree, which
    # waits for the device) and the sync debug mode does not see it.
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    before = torch.cuda.memory_stats() if cuda else {}
    llm.generate([prompt], sp)
    after = torch.cuda.memory_stats() if cuda else {}
    print("allocator events in the 64-token run:", {k: after.get(k, 0) - before.get(k, 0) for k in keys})
    for obj, name, fn in orig:
        setattr(obj, name, fn)
    for label, xs in acc.items():
        xs = sorted(xs)
        print(f"{label}: {len(xs)} calls, median {xs[len(xs) // 2] * 1e3:.3f} ms, max {xs[-1] * 1e3:.3f} ms")
