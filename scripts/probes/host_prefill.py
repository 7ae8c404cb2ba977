"""Where the host time of an eager prefill step goes (twelfth session: Llama-3-8B, B=1, a 1024-token
prompt: 29 ms of host work in forward against 20.7 ms of GPU busy time, so TTFT is host-bound).
Runs the prompt a few times to warm up, then once under cProfile and prints the functions by own
time and by cumulative time.
Usage (GPU): python3 scripts/probes/host_prefill.py [--model llama3-8b] [--len 1024] [--batch 1]"""
import argparse
import cProfile
import pstats
import time

import torch

from opmap.engine.llm import LLM
from opmap.ops.sampling.params import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="llama3-8b")
ap.add_argument("--len", type=int, default=1024)
ap.add_argument("--batch", type=int, default=1)
a = ap.parse_args()
g = torch.Generator().manual_seed(0)
# As the e2e bench builds it; no prefix caching (repeated prompts would be served from the cache).
llm = LLM(a.model, max_num_seqs=32, max_num_batched_tokens=4096, max_model_len=4096, prefix_caching=False)
prompts = [torch.randint(10, 1000, (a.len,), generator=g).tolist() for _ in range(a.batch)]
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
for _ in range(3):
    llm.generate(prompts, params)
for _ in range(3):
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    print(f"one generate (prefill + 1 token): {1e3 * (time.perf_counter() - t):.2f} ms; "
          f"host ms by part {llm.last_summary.get('host_ms_per_step', {}).get('prefill')}")
pr = cProfile.Profile()
pr.enable()
llm.generate(prompts, params)
torch.cuda.synchronize()
pr.disable()
st = pstats.Stats(pr)
st.sort_stats("tottime").print_stats(45)
st.sort_stats("cumulative").print_stats(60)
