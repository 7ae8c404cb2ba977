"""Where the host time of an eager prefill step goes (twelfth session: Llama-3-8B, B=1, a 1024-token
prompt; the e2e bench's step had 28.7 ms of host work in `forward` and no wait, this probe's
18.2-18.5 ms and 4-6 ms of waiting). Builds the engine as the e2e bench does (no prefix caching:
the prompts repeat), runs each prompt shape a few times to warm up, then times generate with
``--new`` tokens (1: only the prefill; 128: the e2e's B=1 case) on prompts over the whole vocabulary
(as the e2e's) or ids below 1000, printing the prefill step's host parts and TTFT; then one
generate under cProfile (functions by own and by cumulative time).
Thirteenth session: after 128-token generates the prefill took 23 ms, after 1-token ones 30-44 ms.
One guess is the GPU's clocks (a GPU just busy with decode steps runs the prefill faster), so each
timed line also shows the SM clock read by nvidia-smi just before that generate, and ``--idle S``
sleeps S seconds before each timed generate.
Usage: python3 scripts/probes/host_prefill.py [--model llama3-8b] [--len 1024] [--batch 1]
             [--new 1 --new 128] [--idle 0 --idle 1] [--profile-new 1]"""
import argparse
import cProfile
import pstats
import shutil
import subprocess
import time

import torch

from opmap.engine.llm import LLM
from opmap.ops.sampling.params import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="llama3-8b")
ap.add_argument("--len", type=int, default=1024)
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--new", type=int, action="append", help="new tokens per request (repeatable; default 1)")
ap.add_argument("--idle", type=float, action="append", help="seconds idle before each timed generate (repeatable; default 0)")
ap.add_argument("--profile-new", type=int, default=1, help="new tokens of the profiled generate (0: none)")
a = ap.parse_args()
g = torch.Generator().manual_seed(0)
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # a tiny preset runs on a CPU
llm = LLM(a.model, max_num_seqs=32, max_num_batched_tokens=4096, max_model_len=4096, prefix_caching=False)
V = llm.runner.cfg.vocab


def prompts(low_ids: bool):
    hi = min(1000, V) if low_ids else V
    return [torch.randint(10, hi, (a.len,), generator=g).tolist() for _ in range(a.batch)]


def sm_clock() -> str:
    """The SM clock now (MHz), by nvidia-smi; '' where there is none."""
    if not shutil.which("nvidia-smi"):
        return ""
    r = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True)
    return f", SM clock {r.stdout.strip()} MHz before" if r.returncode == 0 else ""


for new, idle in [(n, i) for n in a.new or [1] for i in a.idle or [0.0]]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for low in (True, False):
        for _ in range(2):
            llm.generate(prompts(low), params)
        for _ in range(3):
            sync()
            time.sleep(idle)
            clock = sm_clock()
            t = time.perf_counter()
            llm.generate(prompts(low), params)
            sync()
            d = llm.last_summary
            host = {k: round(v, 2) for k, v in (d.get("host_ms_per_step", {}).get("prefill") or {}).items() if v}
            print(f"new={new} idle={idle}s ids<{min(1000, V) if low else V}: generate "
                  f"{1e3 * (time.perf_counter() - t):.2f} ms, TTFT {d['ttft_ms_p50']:.2f} ms; prefill host ms {host}{clock}")
if a.profile_new:
    pr = cProfile.Profile()
    params = SamplingParams(max_tokens=a.profile_new, temperature=0.0, ignore_eos=True)
    p = prompts(False)
    pr.enable()
    llm.generate(p, params)
    sync()
    pr.disable()
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(60)
