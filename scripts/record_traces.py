"""Record the profiler traces under tests/data/traces (run on a GPU machine, offline):
HF transformers generate with eager, SDPA and FlexAttention (Llama-3-8B layer shapes cut to 2
layers; with and without with_stack=True, which adds the nn.Module frames, and with
record_shapes), HF Mixtral-, Qwen3-MoE- and DeepSeek-V2-Lite-shaped models (MoE; MLA), batch 4 with
sampled decoding, an HF Llama forward under torch.compile and generate with a static cache (its
decode forward compiled with mode="reduce-overhead"), a FlashInfer decode loop, opmap's own engine (dense and
MLA), an HF Gemma-2 generate on the CPU (a host-only trace), three HF Llama generate calls on the
CPU in one host-only trace without shapes, and,
where Nsight Systems is installed, an SQLite export of the SDPA run. Small on purpose: each file
is a test fixture of ``opmap profile --trace``.

    python3 scripts/record_traces.py OUTDIR [--only NAME ...]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Real layer shapes (Llama-3-8B, Mixtral-8x7B, Qwen3-30B-A3B) cut to two layers: the kernels and
# their mix are the real model's, the trace stays a small fixture.
def _llama(attn: str):
    from transformers import LlamaConfig

    return _build(LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                              num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                              rope_theta=500000.0), attn)


def _mixtral():
    from transformers import MixtralConfig

    return _build(MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                                num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2),
                  "sdpa")


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    return _build(Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                                 num_experts_per_tok=8, num_hidden_layers=2, num_attention_heads=32,
                                 num_key_value_heads=4, head_dim=128, vocab_size=151936), "sdpa")


def _deepseek_v2(attn: str):
    from transformers import DeepseekV2Config

    # DeepSeek-V2-Lite: MLA without a q LoRA (kv_lora_rank 512, rope 64 + nope 128), the first
    # layer dense, then 64 routed experts (6 active) with 2 shared ones.
    return _build(DeepseekV2Config(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                                   num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16,
                                   kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                   v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                                   first_k_dense_replace=1, vocab_size=102400, topk_method="greedy"), attn)


def _build(cfg, attn: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):  # random init on the GPU: seconds, not minutes
        try:
            m = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.bfloat16)
        except TypeError:  # a transformers without the dtype argument
            m = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(torch.bfloat16)
    return m.eval()


def _save(src: str, path: str) -> None:
    """Gzip ``src`` into ``path``, without what the reader ignores (Python frames that name no
    operator, opmap.harness.profile.trace.kept; the flow arrows): a fixture, not an archive."""
    from opmap.harness.profile.trace import kept

    with open(src) as f:
        doc = json.load(f)
    evs = doc["traceEvents"] if isinstance(doc, dict) else doc
    evs[:] = [e for e in evs if e.get("cat") != "ac2g" and kept(e)]
    with gzip.open(path, "wt", compresslevel=9) as g:
        json.dump(doc, g)
    os.remove(src)


def _profiled(fn, path: str, stack: bool = False, shapes: bool = False) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm: allocator, cuBLAS handles, compiled graphs
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stack,
                 record_shapes=shapes) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path[:-3])
    _save(path[:-3], path)


def hf_generate(model, path: str, prompt: int = 128, new: int = 6, stack: bool = False, shapes: bool = False,
                batch: int = 1, sample: bool = False, **gen) -> None:
    """``generate`` of ``batch`` prompts of ``prompt`` tokens, ``new`` tokens each; greedy, or
    sampled with top-k / top-p (HF's sort-based warpers) where ``sample``."""
    ids = torch.randint(0, 32000, (batch, prompt), device="cuda")
    if sample:
        gen.update(do_sample=True, temperature=0.8, top_k=50, top_p=0.9)
    else:
        gen.update(do_sample=False)
    with torch.no_grad():
        _profiled(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                         min_new_tokens=new, **gen), path, stack, shapes)
    del model
    torch.cuda.empty_cache()


def hf_gemma2_cpu(path: str) -> None:
    """HF Gemma-2 (2 small layers) ``generate`` on the CPU, greedy, 6 new tokens, with the module
    frames: a host-only trace, whose steps end where the host reads the stop check's value (no
    device-to-host copies)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=256)
    model = Gemma2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
            model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    prof.export_chrome_trace(path[:-3])
    _save(path[:-3], path)


def hf_llama_cpu_calls(path: str) -> None:
    """HF Llama (2 small layers) on the CPU, three greedy ``generate`` calls of 32-token prompts, 8 new
    tokens each, with the module frames, in one host-only trace without shapes: 24 steps, 3 of them
    prefills; the decode steps of the later calls run the same launches as the first call's."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 1000, (1, 32))
    with torch.no_grad():
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
            for _ in range(3):
                model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    prof.export_chrome_trace(path[:-3])
    _save(path[:-3], path)


def hf_compile(path: str) -> None:
    model = _llama("sdpa")
    fwd = torch.compile(model.forward)
    ids = torch.randint(0, 32000, (1, 128), device="cuda")
    with torch.no_grad():
        _profiled(lambda: fwd(input_ids=ids, use_cache=False), path)


def hf_compile_generate(path: str) -> None:
    """``generate`` with a static cache, which compiles the decode forward itself (mode
    "reduce-overhead"). Inductor may skip the CUDA graphs (this torch does, for the cache's
    in-place updates, and logs why): the compiled kernels then launch one by one, as the trace
    shows them."""
    model = _llama("sdpa")
    ids = torch.randint(0, 32000, (1, 128), device="cuda")
    with torch.no_grad():
        _profiled(lambda: model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                         cache_implementation="static"), path)


def opmap_engine(model: str, path: str) -> None:
    tmp = path[:-3]
    cmd = [sys.executable, "-m", "opmap.cli.main", "profile", "--model", model, "--num-requests", "3", "--max-tokens",
           "6", "--steps", "10", "--save-trace", tmp]
    subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")))
    _save(tmp, path)


def nsys_sdpa(path: str) -> None:
    nsys = shutil.which("nsys")
    if nsys is None:
        print("nsys: not installed, no SQLite fixture")
        return
    with tempfile.TemporaryDirectory() as d:
        code = ("import sys; sys.path.insert(0, %r); import record_traces as R, torch; "
                "m = R._llama('sdpa'); "
                "ids = torch.randint(0, 32000, (1, 128), device='cuda'); "
                "torch.cuda.nvtx.range_push('generate'); m.generate(ids, max_new_tokens=4, do_sample=False); "
                "torch.cuda.nvtx.range_pop()") % os.path.join(ROOT, "scripts")
        subprocess.run([nsys, "profile", "-t", "cuda,nvtx", "-o", os.path.join(d, "r"), "--export", "sqlite",
                        sys.executable, "-c", code], check=True)
        shutil.copy(os.path.join(d, "r.sqlite"), path)


def flashinfer_decode(path: str) -> None:
    """Four decode steps of an engine loop written by hand: a projection, FlashInfer's paged decode
    (opmap's adapter: BatchDecodeWithPagedKVCacheWrapper, planned per call), the LM head, argmax
    and the readback of the tokens; no record_function range, as a user's own loop would be."""
    import opmap
    from opmap.harness.fixtures.attention import make_paged, make_query

    B, L = 32, 1024
    g = torch.Generator().manual_seed(0)
    pc = make_paged([L] * B, 8, 128, 16, dtype=torch.bfloat16, device="cuda", generator=g)
    q, _ = make_query([1] * B, 32, 128, dtype=torch.bfloat16, device="cuda", generator=g)
    x = torch.randn(B, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    lm = torch.randn(32000, 4096, device="cuda", dtype=torch.bfloat16) / 64

    def steps():
        for _ in range(4):
            h = x @ w.T
            out = opmap.attention_decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, 128 ** -0.5,
                                         backend="flashinfer")
            (((out.view(B, -1) + h) @ lm.T).argmax(-1)).cpu()

    with torch.no_grad():
        _profiled(steps, path)


RECORDERS = {
    "flashinfer-decode": flashinfer_decode,
    "hf-llama-sdpa": lambda p: hf_generate(_llama("sdpa"), p),
    "hf-llama-sdpa-shapes": lambda p: hf_generate(_llama("sdpa"), p, shapes=True),
    "hf-llama-sdpa-stack": lambda p: hf_generate(_llama("sdpa"), p, stack=True),
    "hf-llama-eager-stack": lambda p: hf_generate(_llama("eager"), p, stack=True),
    "hf-mixtral-sdpa": lambda p: hf_generate(_mixtral(), p),
    "hf-mixtral-sdpa-stack": lambda p: hf_generate(_mixtral(), p, stack=True),
    "hf-qwen3moe-sdpa-stack": lambda p: hf_generate(_qwen3_moe(), p, stack=True),
    "hf-llama-compile": hf_compile,
    "hf-llama-compile-static": hf_compile_generate,
    "hf-llama-flex": lambda p: hf_generate(_llama("flex_attention"), p),
    "hf-llama-sdpa-b4-sampled": lambda p: hf_generate(_llama("sdpa"), p, batch=4, sample=True),
    "hf-mixtral-sdpa-b4-sampled": lambda p: hf_generate(_mixtral(), p, batch=4, sample=True),
    "hf-deepseekv2-eager-stack": lambda p: hf_generate(_deepseek_v2("eager"), p, stack=True),
    "hf-deepseekv2-sdpa": lambda p: hf_generate(_deepseek_v2("sdpa"), p),
    "hf-gemma2-cpu": hf_gemma2_cpu,
    "hf-llama-cpu-calls": hf_llama_cpu_calls,
    "opmap-llama": lambda p: opmap_engine("tiny-llama3", p),
    "opmap-deepseek": lambda p: opmap_engine("tiny-deepseek", p),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--only", nargs="*", default=None, help="recorders to run: " + ", ".join(RECORDERS) + ", nsys")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    failed = []
    for name, rec in RECORDERS.items():
        if a.only is None or name in a.only:
            print(f"== {name}", flush=True)
            try:
                rec(os.path.join(a.out, f"{name}.json.gz"))
            except Exception as e:  # one recorder's failure (a library's change) leaves the others to run
                failed.append(name)
                print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
                torch.cuda.empty_cache()
    if a.only is None or "nsys" in a.only:
        nsys_sdpa(os.path.join(a.out, "nsys-hf-llama-sdpa.sqlite"))
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
