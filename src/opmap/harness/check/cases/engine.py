"""Engine check cases: greedy tokens equal HF transformers on the same random fp32 weights (tiny
presets, through save_pretrained and the safetensors loader; the model asked for, at its real
widths in memory); chunked prefill, prefix-cache hits
and preemption give the same tokens as the plain run; on a GPU, eager and CUDA-graph decode give
identical tokens; the one-step-ahead decode gives the outputs of lockstep decode; bad requests
fail alone with a message."""
from __future__ import annotations

import dataclasses
import tempfile

import torch

from opmap.engine.params import SamplingParams
from opmap.engine.tokenizer import byte_tokenizer
from opmap.engine.weights import StateDictSource
from opmap.harness.check.base import CheckCase, Outcome
from opmap.model.hf import make_hf_model, resolve_model, save_checkpoint
from opmap.model.presets import PRESETS

PARITY = ("tiny-llama3", "tiny-mistral", "tiny-phi3", "tiny-gemma2", "tiny-gemma3", "tiny-qwen2", "tiny-qwen3",
          "tiny-mixtral", "tiny-qwen2moe", "tiny-qwen3moe", "tiny-deepseek", "tiny-deepseek-v3")
# The fp32 weights of the engine and of HF together, at most, for the model's own parity case.
OWN_BUDGET = {"cpu": 3 * 2**30, "cuda": 48 * 2**30}
OWN_LAYERS = 2  # a preset's own parity case runs its real widths with this many layers


def _prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def _greedy(n=10):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _dev_kw(device, num_pages=64):
    # An explicit, small KV cache: these cases run a handful of short sequences, and on a GPU the
    # default (a fraction of the whole device) costs seconds of allocation and block bookkeeping.
    # The page counts below are in 16-token pages: on sm90 the default is 64 tokens, where 12 pages
    # held every sequence and the preemption case ran without preempting.
    # No start-up warm-up: it compiles ahead for timed runs, and these cases time nothing (on a GPU
    # it ran two rounds of requests per engine built here).
    return dict(device=device, dtype="fp32", num_pages=num_pages, page_size=16, warmup=False)


def _one_thread(fn):
    """Tiny CPU ops: intra-op threads only contend (a 2-core machine is shared), so run single-threaded."""
    def run():
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn()
        finally:
            torch.set_num_threads(n)

    return run


def _parity(name, device, cfg=None, checkpoint=None, in_memory=False):
    """Greedy tokens of the engine == HF's: a preset's random weights through save_pretrained and
    the safetensors loader, or (``in_memory``: a preset at its real widths, gigabytes of fp32) drawn
    on the device and handed over as a state dict, or a checkpoint directory's own weights (HF
    loads the same directory)."""
    def run():
        # the engine's runner and models, loaded when the case runs (check.runner imports this module)
        from opmap.engine.llm import LLM
        c = cfg or PRESETS[name]
        with tempfile.TemporaryDirectory() as d:
            source, model = None, d
            if checkpoint is not None:
                # heavy: transformers, for a checkpoint's own parity only
                from transformers import AutoModelForCausalLM

                # safetensors only: a pickle file (pytorch_model.bin) is never unpickled (resolve_model refuses
                # a folder that holds no other weights)
                hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, use_safetensors=True,
                                                          trust_remote_code=False).eval()
                model = checkpoint
            elif in_memory:
                hf, model = make_hf_model(c, seed=3, device=device), c
                source = StateDictSource(hf.state_dict())
            else:
                hf = save_checkpoint(c, d, seed=3)
            prompts = _prompts(c.vocab, (3, 21, 60), seed=7)
            # token-id prompts: the byte tokenizer, so a checkpoint saved without one is not reported as such
            tok = byte_tokenizer(c.vocab) if checkpoint is None else None
            with LLM(model, source=source, tokenizer=tok, max_num_batched_tokens=48, max_num_seqs=4,
                     **_dev_kw(device)) as llm:
                outs = llm.generate(prompts, _greedy())
            if device == "cuda":
                hf = hf.to("cuda")
        same = total = 0
        for p, o in zip(prompts, outs):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([p], device=hf.device), max_new_tokens=10, min_new_tokens=10,
                                  do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            same += sum(a == b for a, b in zip(o.token_ids, ref))
            total += len(ref)
            if o.token_ids != ref:
                k = next(i for i, (a, b) in enumerate(zip(o.token_ids + [-1] * 10, ref)) if a != b)
                return Outcome(False, f"prompt of {len(p)}: first difference at token {k}", float(k), float(len(ref)))
        return Outcome(True, f"{same}/{total} greedy tokens equal HF", float(same), float(total))

    # Single-threaded for the tiny CPU models only: a preset at its real widths wants every thread
    # (drawing Llama-3-8B's 2 layers, 1.5 B fp32 weights, on the CPU and saving them to disk on one
    # thread made this case the longest of the check).
    return _one_thread(run) if device == "cpu" and not in_memory else run


def _same_tokens(device, variant: str):
    def run():
        # the engine's runner and models, loaded when the case runs (check.runner imports this module)
        from opmap.engine.llm import LLM
        cfg = PRESETS["tiny-llama3"]
        prompts = _prompts(cfg.vocab, (5, 40, 77, 16, 33), seed=1)
        with LLM("tiny-llama3", max_num_batched_tokens=512, max_num_seqs=8, prefix_caching=False,
                 **_dev_kw(device)) as base:
            ref = [o.token_ids for o in base.generate(prompts, _greedy(12))]
        # 64 pages hold the 5 sequences (at most 6 pages each) with room for the cached prefixes;
        # 12 pages force preemption.
        kw = {"chunked": dict(max_num_batched_tokens=17, prefix_caching=False, **_dev_kw(device)),
              "prefix-cache": dict(prefix_caching=True, **_dev_kw(device)),
              "preemption": dict(max_num_batched_tokens=64, prefix_caching=False, **_dev_kw(device, 12))}[variant]
        with LLM("tiny-llama3", max_num_seqs=8, **kw) as llm:
            if variant == "prefix-cache":
                llm.generate(prompts, _greedy(12))  # fills the cache; the second pass hits it
            outs = llm.generate(prompts, _greedy(12))
        got = [o.token_ids for o in outs]
        extra = {"chunked": f"{llm.stats.steps['prefill'] + llm.stats.steps['mixed']} prefill steps",
                 "prefix-cache": f"{sum(o.num_cached_tokens for o in outs)} prompt tokens served from cache",
                 "preemption": f"{llm.stats.preemptions} preemptions"}[variant]
        ok = got == ref and (variant != "preemption" or llm.stats.preemptions > 0) and (
            variant != "prefix-cache" or sum(o.num_cached_tokens for o in outs) > 0)
        return Outcome(ok, f"tokens {'equal' if got == ref else 'DIFFER'}; {extra}")

    return _one_thread(run)


def _graph_vs_eager():
    def run():
        # the engine's runner and models, loaded when the case runs (check.runner imports this module)
        from opmap.engine.llm import LLM
        # Real head_dim (the Triton attention serves 64/128/256), few layers: fast and capturable.
        cfg = dataclasses.replace(PRESETS["llama3-8b"], layers=2)
        prompts = _prompts(cfg.vocab, (7, 100, 33, 1), seed=2)
        runs, captured = {}, None
        for eager in (True, False):
            # 64 pages of 16: every prompt (at most 116 tokens) fits; no memory sizing needed.
            with LLM(cfg, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024, enforce_eager=eager,
                     num_pages=64, warmup=False) as llm:
                if not eager:
                    captured = sorted(llm.runner.graphs), sorted(llm.runner.prefill_graphs)
                runs[eager] = [o.token_ids for o in llm.generate(prompts, _greedy(16))]
        ok = runs[True] == runs[False] and all(captured)
        return Outcome(ok, f"tokens {'identical' if runs[True] == runs[False] else 'DIFFER'}; decode graphs for "
                           f"batch buckets {captured[0]}, prefill graphs for token buckets {captured[1]}")

    return run


def _ahead_vs_lockstep(device):
    def run():
        # the engine's runner and models, loaded when the case runs (check.runner imports this module)
        from opmap.engine.llm import LLM
        # On a GPU the real widths with decode graphs (where the device-to-device id copy and the
        # late read-back matter); on a CPU the tiny preset.
        cfg = dataclasses.replace(PRESETS["llama3-8b"], layers=2) if device == "cuda" else PRESETS["tiny-llama3"]
        prompts = _prompts(cfg.vocab, (7, 100, 33, 1, 54, 12), seed=4)
        params = [_greedy(16), SamplingParams(max_tokens=14, temperature=0.9, top_k=40, top_p=0.9, seed=5, ignore_eos=True),
                  SamplingParams(max_tokens=12, temperature=0.8, repetition_penalty=1.2, presence_penalty=0.3, seed=6,
                                 ignore_eos=True),
                  SamplingParams(max_tokens=9, temperature=0.0, logprobs=2, ignore_eos=True),
                  SamplingParams(max_tokens=20, temperature=1.0, seed=7, stop_token_ids=list(range(0, cfg.vocab, 97))),
                  _greedy(11)]
        runs, ahead = {}, 0
        for on in (False, True):
            kw = dict(num_pages=64, warmup=False) if device == "cuda" else _dev_kw(device)
            with LLM(cfg, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024, async_decode=on, **kw) as llm:
                outs = llm.generate(prompts, params)
                runs[on] = [(o.token_ids, o.finish_reason, o.error, o.logprobs) for o in outs]
                ahead = llm.ahead_steps if on else ahead
        same = runs[True] == runs[False]
        return Outcome(same and ahead > 0, f"outputs {'identical' if same else 'DIFFER'}; {ahead} decode steps ran ahead")

    return _one_thread(run) if device != "cuda" else run


def _bad_requests(device):
    def run():
        # the engine's runner and models, loaded when the case runs (check.runner imports this module)
        from opmap.engine.llm import LLM

        with LLM("tiny-llama3", max_num_seqs=4, max_model_len=64, **_dev_kw(device)) as llm:
            outs = llm.generate([[1, 2, 3], [], list(range(1, 70)), [5, 6]], [_greedy(4), _greedy(4), _greedy(4),
                                                                              {"top_p": 0.0}])
        errs = [o.error for o in outs]
        ok = errs[0] is None and len(outs[0].token_ids) == 4 and all(e for e in errs[1:])
        return Outcome(ok, "; ".join((e or "ok").split(",")[0][:40] for e in errs))

    return _one_thread(run)


def _tags(name: str) -> tuple:
    cfg = PRESETS[name]
    return ("engine",) + (("moe",) if cfg.is_moe else ()) + (("mla",) if cfg.is_mla else ())


def own_parity(model: str, device: str):
    """(CheckCase or None, note): HF greedy parity of the model asked for itself (a checkpoint's own
    weights; a preset's real widths with OWN_LAYERS layers of random weights), where the fp32
    weights of both fit OWN_BUDGET on this device; else a note saying why it did not run."""
    cfg, path = resolve_model(model)
    what = f"model={model}"
    if path is None:
        cfg = dataclasses.replace(cfg, layers=min(cfg.layers, OWN_LAYERS))
        what += f"({cfg.layers} layers, random weights)"
    need = 2 * 4 * cfg.num_params()
    if need > OWN_BUDGET[device]:
        return None, (f"HF parity of {what} not run: its fp32 weights and HF's take {need / 2**30:.1f} GiB, "
                      f"above this {device}'s {OWN_BUDGET[device] / 2**30:.0f} GiB for it (the architecture's "
                      "stand-in on random weights ran instead)")
    return CheckCase("parity", "e2e", "-", f"engine {what},greedy,fp32,vs=HF",
                     _parity(model, device, cfg, path, in_memory=path is None), device="any", tags=("engine", "own")), None


def cases(device: str, quick: bool) -> list:
    # backend "-": not about one backend (the check runner keeps such cases for any model; the
    # moe / mla tags drop the parity cases of other architectures).
    out = [CheckCase("parity", "e2e", "-", f"engine model={n},stand-in=the architecture on random weights,greedy,fp32,vs=HF",
                     _parity(n, device), device="any", tags=_tags(n))
           for n in PARITY]
    for v in ("chunked", "prefix-cache", "preemption"):
        out.append(CheckCase("boundaries", "e2e", "-", f"engine model=tiny-llama3,{v}==plain",
                             _same_tokens(device, v), device="any", tags=("engine",)))
    out.append(CheckCase("input", "e2e", "-", "engine: empty/too long/invalid params", _bad_requests(device),
                         device="any", tags=("engine",)))
    out.append(CheckCase("graph", "e2e", "-", "engine model=llama3-8b(2 layers),bf16,eager==graph",
                         _graph_vs_eager(), device="cuda", tags=("engine",)))
    out.append(CheckCase("boundaries", "e2e", "-", "engine one-step-ahead decode==lockstep,mixed sampling",
                         _ahead_vs_lockstep(device), device="any", tags=("engine",)))
    return out
