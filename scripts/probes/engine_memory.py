"""Where an engine's GPU memory goes after its KV cache is sized (the eleventh session: a second
engine sized from free memory ran out of memory in its start-up warm-up). Builds the GPU test's
engine (Llama-3-8B shapes, 2 layers, 256 sequences, 2048-token steps) without the warm-up, prints
what is allocated at each stage, then runs the warm-up and prints its peak above what was
allocated before it, against the activation peak the KV plan reserved and the margin.
Usage (GPU): python3 scripts/probes/engine_memory.py"""
import dataclasses
import logging

import torch

from opmap.engine.kv_plan import margin_bytes
from opmap.engine.llm import LLM
from opmap.presets import PRESETS

logging.basicConfig(level=logging.INFO, format="%(message)s")
GiB = 2**30
cfg = dataclasses.replace(PRESETS["llama3-8b"], layers=2)
a = LLM(cfg, gpu_memory_fraction=0.85, max_num_seqs=256, max_num_batched_tokens=2048, enforce_eager=True, warmup=False)
r = a.runner


def nbytes(x) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(nbytes(v) for v in x)
    if dataclasses.is_dataclass(x):
        return sum(nbytes(getattr(x, f.name)) for f in dataclasses.fields(x))
    return 0


kv, ws = nbytes(r.kv), nbytes(r.workspace)
print(f"KV cache {kv / GiB:.3f} GiB; decode workspaces ({len(r.workspace)} buckets) {ws / GiB:.3f} GiB")
torch.cuda.synchronize()
before = torch.cuda.memory_allocated()
free, total = torch.cuda.mem_get_info()
print(f"allocated {before / GiB:.3f} GiB, free {free / GiB:.3f} GiB; margin {margin_bytes(total) / GiB:.2f} GiB")
torch.cuda.reset_peak_memory_stats()
a._warm_up()
torch.cuda.synchronize()
print(f"warm-up peak above what was allocated before it: {(torch.cuda.max_memory_allocated() - before) / GiB:.3f} GiB; "
      f"left allocated after it: {(torch.cuda.memory_allocated() - before) / GiB:.3f} GiB")
