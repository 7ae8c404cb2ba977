"""Where the engine's host waits on the GPU during steady decode: CUDA sync debug mode "warn" with
the Python stack of every synchronising call, over decode steps of a B=1 request (after warm-up).
PYTHONPATH=src python3 scripts/diag_engine_sync.py [layers]"""
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
cfg = dataclasses.replace(PRESETS["llama3-8b"], layers=layers)
seen = collections.Counter()


def show(message, category, filename, lineno, file=None, line=None):
    stack = [f"{f.filename.split('src/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
             if "opmap" in f.filename]
    seen[(str(message)[:80], " <- ".join(reversed(stack[-6:])))] += 1


with LLM(cfg, max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=2048, num_pages=256) as llm:
    prompt = list(range(1, 513))
    for temp in (0.0, 0.8):
        sp = SamplingParams(max_tokens=24, temperature=temp, top_k=50 if temp else 0, top_p=0.9 if temp else 1.0,
                            ignore_eos=True)
        llm.generate([prompt], sp)  # warm-up
        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        llm.generate([prompt], sp)
        torch.cuda.set_sync_debug_mode(0)
        print(f"temperature {temp}: {sum(seen.values())} synchronising calls in a 24-token generation")
        for (msg, where), n in seen.most_common(12):
            print(f"  {n:4d} x {msg} at {where}")
        seen.clear()
