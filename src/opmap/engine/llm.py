"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...)) -> list[RequestOutput]``.

Bad requests (empty prompt, prompt at or over the context, token ids outside the vocabulary,
invalid sampling parameters, a constraint that cannot be compiled) end with
``finish_reason="error"`` and a message; the other requests of the batch run normally. A row
whose logits hold NaN/inf ends its request with an error state too. Running out of KV pages
preempts (free and recompute); it never fails a request that fits the cache alone.
"""
from __future__ import annotations

import gc
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from opmap.core.contract import InputError, trusted_values
from opmap.engine.params import SamplingParams
from opmap.engine.block_manager import BlockManager
from opmap.model.hf import read_json_object, resolve_model
from opmap.engine.config import EngineConfig, check_sizes, machine_memory
from opmap.engine.metrics import HOST_PARTS, GcTimer, StepStats, summarize
from opmap.engine.opset import engine_dtype
from opmap.engine.runner import CPU_PAGES, ModelRunner, device_arch
from opmap.engine.sampler import Sampler
from opmap.engine.scheduler import Scheduler
from opmap.engine.sequence import Sequence
from opmap.engine.stop import check_stop, make_checker
from opmap.engine.tokenizer import HFTokenizer, make_tokenizer
from opmap.engine.weights import SafetensorsSource, eos_token_ids
from opmap.engine.structured import BitmaskBuffer, StructuredOutput

log = logging.getLogger("opmap.engine")


@dataclass
class RequestOutput:
    index: int
    prompt: Optional[str]
    prompt_token_ids: list
    text: str
    token_ids: list
    finish_reason: str  # stop / length / error
    stop_reason: Any = None
    error: Optional[str] = None
    ttft: Optional[float] = None  # seconds from submission to the first token
    tpot: Optional[float] = None  # mean seconds per output token after the first
    latency: Optional[float] = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    logprobs: list = field(default_factory=list)


class LLM:
    def __init__(self, model: str, source=None, tokenizer=None, eos_ids: Optional[list] = None, **engine_kw):
        """``model``: a preset name or a checkpoint directory. ``source``: weights from elsewhere
        (e.g. ``StateDictSource`` of an HF model in memory) with ``model`` a preset or config."""
        self.ecfg = EngineConfig(**engine_kw)
        self.ecfg.validate()
        if isinstance(model, str):
            cfg, path = resolve_model(model)
        else:  # a ModelConfig
            cfg, path = model, None
        if source is None and path is not None:
            source = SafetensorsSource(path)
        self.cfg, self.path = cfg, path
        device, arch = device_arch(self.ecfg.device)
        check_sizes(self.ecfg, cfg, machine_memory(device), _elem_bytes(self.ecfg, cfg, arch),
                    None if device.type == "cuda" else CPU_PAGES)
        self.ecfg.for_model(cfg, arch)
        # The checkpoint's small files first: a bad tokenizer.json fails before the model is built.
        if tokenizer is not None and not isinstance(tokenizer, HFTokenizer):
            tokenizer = HFTokenizer(tokenizer)  # a tokenizers.Tokenizer
        self.tokenizer = tokenizer or make_tokenizer(path, cfg.vocab)
        self.eos_ids = list(eos_ids) if eos_ids is not None else eos_token_ids(path, cfg.vocab)
        self.runner = ModelRunner(cfg, self.ecfg, source)
        self.max_model_len = self.runner.max_model_len
        self._new_scheduling()
        self.sampler = Sampler(cfg.vocab, self.runner.device, self.runner.arch, self.ecfg.backends,
                               trace=self.ecfg.trace_ops)
        for line in self.sampler.condensed():
            log.info("%s", line)
        self._structured = None  # opmap.engine.structured.StructuredOutput, made on first use
        self._bitmask = None
        if self.ecfg.structured_output:
            self._ensure_structured()  # before gc.freeze() below: its objects are frozen too
        self.stats = StepStats()
        self.last_summary: Optional[dict] = None
        self._parts = dict.fromkeys(HOST_PARTS, 0.0)  # this step's host time by part (metrics.HOST_PARTS)
        self._pending: Optional[_Pending] = None  # the last decode step's tokens, not read back yet
        self._readback = None  # (pinned [2 * max_num_seqs] int64, CUDA event): see _Pending
        if self.runner.device.type == "cuda":
            self._readback = (torch.empty(2 * self.ecfg.max_num_seqs, dtype=torch.int64, pin_memory=True),
                              torch.cuda.Event())
        self.ahead_steps = 0  # decode steps launched before the previous step's tokens were read
        self.closed = False
        # Everything alive now (torch, transformers, the model and its graphs: a heap of hundreds of
        # thousands of objects) goes to the collector's permanent generation: a full collection
        # otherwise walks all of it inside whichever step triggered it (docs/engine.md, Decisions:
        # `gc.freeze()`). Full collections
        # are rare in a run (a 128-token generate at batch 1 or 32 triggered one generation-0
        # collection on the CPU), so this bounds an outlier rather than the mean; the summary's
        # "gc" field counts them. close() unfreezes, so a closed engine's cycles can be collected.
        gc.collect()
        gc.freeze()
        self._gc = GcTimer()  # collections during generate() go into its summary ("gc")
        gc.callbacks.append(self._gc)
        self.warmup_s = 0.0
        if self.ecfg.warmup if self.ecfg.warmup is not None else self.runner.device.type == "cuda":
            self.warmup_s = self._warm_up()

    def _new_scheduling(self) -> None:
        """An empty page allocator (and prefix cache) and the scheduler over it."""
        self.bm = BlockManager(self.runner.num_pages, self.ecfg.page_size, self.ecfg.prefix_caching)
        self.scheduler = Scheduler(self.bm, self.ecfg.max_num_seqs, self.ecfg.max_num_batched_tokens,
                                   self.ecfg.chunked_prefill, self.ecfg.max_prefill_tokens_with_decodes)

    def _warm_up(self) -> float:
        """Requests before the first real one: a 3-token prompt and one a little longer than the
        step's token budget, so that the steps run are a prefill of two sequences, a mixed step (a
        decode beside the long prompt's last chunk) and decode steps, sampled greedily and with
        top-k / top-p; then the same with 16 short prompts beside the long one (below). The kernel
        variants they launch are then compiled before any request waits on them: without it the
        first prefill and mixed steps of a run carry the JIT compiles, several times a warm step
        (docs/engine.md, Decisions: the start-up warm-up). The prefix cache and the counters
        start empty after it. Seconds taken."""
        t0 = time.perf_counter()
        g = random.Random(0)
        long = max(4, min(self.ecfg.max_num_batched_tokens + 8, self.max_model_len - 4))
        if long <= self.ecfg.max_num_batched_tokens and self.scheduler.chunked:
            # A model length within the token budget: no prompt is chunked at that budget, so the
            # warm-up steps with a smaller one to run a mixed step all the same (without it the
            # first mixed step of a run compiled its kernels, as under the report's profile with
            # max_model_len 640 against a budget of 2048: docs/engine.md, Decisions: the warm-up
            # steps with half its long prompt as budget). _new_scheduling
            # below restores the budget.
            self.scheduler.budget = max(1, long // 2)
        greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        sampled = SamplingParams(max_tokens=3, temperature=0.8, top_k=20, top_p=0.9, seed=0, ignore_eos=True)
        # Round 2: 16 short prompts of lengths 3..18 beside a long one, so that steps of 16 and 17
        # rows, 16 decode rows beside a chunk, and token counts of both residues mod 16 run too:
        # what still varies per step after the kernels stopped specializing the step's integers
        # (e.g. the MoE route-align tile over a step's tokens; without this round
        # tests/test_engine_triton.py finds Qwen3-MoE's mixed steps launching new variants).
        short = min(16, max(self.ecfg.max_num_seqs - 1, 0))
        outs = []
        for lens in ((3, long), (*range(3, 3 + short), long)):
            prompts = [[g.randrange(self.cfg.vocab) for _ in range(n)] for n in lens]
            outs += self.generate(prompts, [greedy if i % 2 == 0 else sampled for i in range(len(prompts))])
        self.warmup_steps = dict(self.stats.steps)
        if any(o.error for o in outs):  # e.g. a model length too short for the long prompt
            log.warning("warm-up: %s", "; ".join(str(o.error) for o in outs if o.error))
        self._new_scheduling()
        self.stats = StepStats()
        self.last_summary = None
        took = time.perf_counter() - t0
        log.info("warm-up (%s steps) in %.2f s", ", ".join(f"{k} {v}" for k, v in self.warmup_steps.items()), took)
        return took

    # ---- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the KV cache, CUDA graphs, weights and device buffers now (idempotent). A second
        engine in the same process is sized from what is free, so close (or del) the first one
        before building the next; ``with LLM(...) as llm:`` closes on exit."""
        if self.closed:
            return
        gc.unfreeze()  # this engine's objects (frozen at construction) must be collectable again
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        self.abort_all()
        self.runner.close()
        self.sampler = None
        self._structured = self._bitmask = self._readback = None
        self.closed = True
        free_device_memory()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests ---------------------------------------------------------------------------------
    def _make(self, i: int, prompt, params) -> Union[Sequence, RequestOutput]:
        text = prompt if isinstance(prompt, str) else None
        ids: list = []
        try:
            if isinstance(params, dict):
                params = SamplingParams(**params)
            elif isinstance(params, SamplingParams):
                params = params.checked()  # fields may have changed since construction
            else:
                raise InputError("params", type(params).__name__, "a SamplingParams or a dict of its fields")
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
            elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in prompt):
                ids = list(prompt)
            else:
                raise InputError("prompt", type(prompt).__name__, "a string or a list of token ids")
            if not ids:
                raise InputError("prompt", "an empty prompt", "at least one token")
            bad = [t for t in ids if not 0 <= t < self.cfg.vocab]
            if bad:
                raise InputError("prompt", f"token id {bad[0]}", f"ids in [0, {self.cfg.vocab})")
            if len(ids) >= self.max_model_len:
                raise InputError("prompt", f"{len(ids)} tokens",
                                 f"fewer than max_model_len={self.max_model_len} (room for one new token)")
            if params.logprobs is not None and params.logprobs > self.cfg.vocab:
                raise InputError("logprobs", params.logprobs, f"at most the vocabulary ({self.cfg.vocab})")
            beyond = [t for t in params.stop_token_ids or () if not 0 <= t < self.cfg.vocab]
            if beyond:  # such an id is never sampled: the stop would never fire
                raise InputError("stop_token_ids", f"id {beyond[0]}", f"ids in [0, {self.cfg.vocab})")
            seq = Sequence(ids, params, prompt=text, index=i)
            if params.structured is not None:
                seq.state["grammar"] = self._grammar_state(params)  # compiles in the background
            seq.state["stop"] = make_checker(seq, self.eos_ids, self.tokenizer)
            return seq
        except (InputError, ValueError, TypeError) as e:
            return RequestOutput(i, text, ids, "", [], "error", error=str(e))

    def _ensure_structured(self) -> None:
        """The grammar compiler and the bitmask buffer, made once (EngineConfig.structured_output:
        at start-up; else on the first constrained request)."""
        if self._structured is not None:
            return
        try:
            ends = self.eos_ids or getattr(self.tokenizer, "grammar_end", None)
            self._structured = StructuredOutput(self.tokenizer.tok, vocab_size=self.cfg.vocab,
                                                stop_token_ids=ends or None)
        except ImportError as e:
            raise InputError("structured output", f"unavailable ({e})", "the xgrammar package") from None
        self._bitmask = BitmaskBuffer(self.ecfg.max_num_seqs, self.cfg.vocab, self.runner.device)

    def _grammar_state(self, params):
        self._ensure_structured()
        try:
            return self._structured.request(params)
        except Exception as e:  # noqa: BLE001 - e.g. a JSON schema that is not JSON: this request's error
            raise InputError(params.structured[0], f"a constraint that does not compile ({type(e).__name__}: {e})",
                             "a valid constraint") from None

    def _output(self, s: Sequence) -> RequestOutput:
        out_ids = s.output_token_ids
        checker = s.state.get("stop")
        if s.params.stop and checker is not None:
            text = checker.text  # emitted text, cut before a stop string
        else:  # an EOS / stop token id is not part of the text
            shown = out_ids[:-1] if s.finish_reason == "stop" and isinstance(s.stop_reason, int) else out_ids
            text = self.tokenizer.decode(shown) if shown else ""
        now = time.perf_counter()
        return RequestOutput(s.index, s.prompt, s.token_ids[:s.num_prompt_tokens], text, out_ids, s.finish_reason,
                             s.stop_reason, s.error, s.ttft(), s.tpot(),
                             (s.token_times[-1] if s.token_times else now) - s.arrival, s.num_cached_tokens,
                             s.num_preemptions, s.logprobs)

    # ---- the loop -----------------------------------------------------------------------------------
    def chat(self, conversations, params=None, use_tqdm: bool = False, chat_template: Optional[str] = None) -> list:
        """Generate a reply to one conversation (a list of {"role", "content"} messages) or to each of
        a list of them. The checkpoint's chat template (tokenizer_config.json or chat_template.jinja,
        rendered by transformers' ``apply_chat_template`` with the generation prompt) makes the prompt
        tokens; ``chat_template`` (Jinja text) replaces it. A model without one is an InputError."""
        return self.generate(self.chat_prompts(conversations, chat_template), params, use_tqdm=use_tqdm)

    def chat_prompts(self, conversations, chat_template: Optional[str] = None) -> list:
        """The prompt tokens of each conversation (see ``chat``)."""
        if isinstance(conversations, list) and conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        tok = self._chat_tokenizer(chat_template)
        prompts = []
        for i, conv in enumerate(conversations):
            if not (isinstance(conv, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                   for m in conv)):
                raise InputError(f"conversations[{i}]", type(conv).__name__,
                                 'a list of {"role": ..., "content": ...} messages')
            try:
                ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
            except Exception as e:  # noqa: BLE001 - Jinja's SecurityError (the sandbox) and TemplateErrors
                from jinja2 import TemplateError  # transformers renders with Jinja, so it is installed

                if not isinstance(e, TemplateError):
                    raise
                why = ("that the Jinja sandbox stops" if type(e).__name__ == "SecurityError" else
                       "that Jinja cannot render")
                raise InputError(self._template_file(chat_template), f"a chat template {why} ({type(e).__name__}: "
                                 f"{' '.join(str(e).split())[:200]})", "a template that only formats the messages"
                                 ) from None
            prompts.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
        return prompts

    def _template_file(self, chat_template: Optional[str]) -> str:
        """Where the chat template in use comes from (for an error that names it)."""
        if chat_template is not None or self.path is None:
            return "chat_template"
        for fn in ("chat_template.jinja", "chat_template.json"):
            if os.path.isfile(os.path.join(self.path, fn)):
                return os.path.join(self.path, fn)
        return os.path.join(self.path, "tokenizer_config.json") + " chat_template"

    def _chat_tokenizer(self, chat_template: Optional[str]):
        # heavy: transformers, for a chat template only
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        fn = os.path.join(self.path, "tokenizer_config.json") if self.path is not None else None
        if fn is not None and os.path.isfile(fn):
            tc = read_json_object(fn, "a tokenizer_config.json")
            if tc.get("auto_map"):
                raise InputError(f"{fn} auto_map", repr(tc["auto_map"])[:120], "no auto_map: the tokenizer needs the "
                                 "checkpoint's own Python code, which opmap never runs (trust_remote_code is off)")
            try:
                # trust_remote_code=False: refused, never asked for on stdin
                tok = AutoTokenizer.from_pretrained(self.path, trust_remote_code=False)
            except Exception as e:  # noqa: BLE001 - transformers raises many classes for a tokenizer it cannot build
                raise InputError(fn, f"a tokenizer transformers cannot load ({type(e).__name__}: "
                                 f"{' '.join(str(e).split())[:200]})", "a tokenizer_config.json of a fast tokenizer"
                                 ) from None
        else:
            tok = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.tok)
        if chat_template is not None:
            tok.chat_template = chat_template
        if not getattr(tok, "chat_template", None):
            where = self.path or f"the preset {self.cfg.name}"
            raise InputError("chat", f"no chat template in {where}",
                             "a checkpoint with one (tokenizer_config.json chat_template or chat_template.jinja), "
                             "or chat_template=...")
        return tok

    def generate(self, prompts, params=None, use_tqdm: bool = False) -> list:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if params is not None else SamplingParams()
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InputError("params", f"{len(plist)} entries", f"one per prompt ({len(prompts)}) or a single one")
        if self.closed:
            raise RuntimeError("this LLM was closed; build a new one")
        t0 = time.perf_counter()
        gc0 = self._gc.snapshot()
        results, live = self.add_requests(prompts, plist)
        bar = _progress(len(live)) if use_tqdm else None
        self.stats = StepStats()
        try:
            while self.scheduler.has_unfinished():
                for s in self.step():
                    results[s.index] = self._output(s)
                    if bar is not None:
                        bar.update(1)
            self.drain()  # a run-ahead step of sequences that all finished
        except BaseException:
            self.abort_all()  # Ctrl-C / an error: free every page so the engine stays usable
            raise
        finally:
            if bar is not None:
                bar.close()
        outs = [results[i] for i in range(len(prompts))]
        self.last_summary = summarize(outs, time.perf_counter() - t0, self.stats, self.runner.decode_weight_bytes,
                                      self.runner.model.kv_bytes_per_page(1))
        self.last_summary["gc"] = self._gc.since(gc0)
        return outs

    def add_requests(self, prompts: list, plist: list) -> tuple:
        """Validate and queue requests: ({index: error output}, [queued sequences])."""
        results: dict = {}
        live = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            r = self._make(i, p, sp)
            if isinstance(r, RequestOutput):
                results[i] = r
            else:
                live.append(r)
                self.scheduler.add(r)
        return results, live

    def drain(self) -> list:
        """Read back the tokens of a decode step still in flight (after the last ``step()`` of a
        loop that drives the engine itself); returns the sequences that finished with them."""
        return self._resolve(self._pending) if self._pending is not None else []

    def abort_all(self) -> None:
        if self._pending is not None:  # drop the tokens in flight; remove their placeholders
            for s in self._pending.seqs:
                _drop_placeholder(s)
            self._pending = None
        for s in [*self.scheduler.running, *self.scheduler.waiting]:
            self.scheduler.finish(s, "abort")

    def step(self) -> list:
        """One engine step; returns the sequences that finished in it.

        Decode runs one step ahead when it can (``EngineConfig.async_decode``): the tokens that
        step n sampled stay on the device and feed step n+1 directly, and the host reads them
        back (append, stop checks, detokenisation) while step n+1 runs, so the GPU never waits
        for the host between decode steps. The host state then lags the device by one step: a
        placeholder token stands for each pending token while step n+1 is scheduled and is
        replaced before anything reads it (stop checks, block hashes, grammar, penalties,
        outputs). A request that stops at step n has had step n+1 computed for nothing; the cases
        where that is known in advance (max_tokens, max_model_len) run in lockstep instead."""
        if self.closed:
            raise RuntimeError("this LLM was closed; build a new one")
        sch = self.scheduler
        self._parts = dict.fromkeys(HOST_PARTS, 0.0)
        pend, done = self._pending, []
        ahead = pend is not None and self._can_run_ahead(pend)
        if pend is not None and not ahead:
            done += self._resolve(pend)
            pend = None
        if ahead:
            self.ahead_steps += 1
            for s in pend.seqs:
                s.token_ids.append(PLACEHOLDER)
        t = time.perf_counter()
        batch = sch.schedule()
        self._tick("schedule", t)
        if ahead and not (batch.is_decode and not batch.preempted and not batch.failed
                          and [it.seq for it in batch.items] == pend.seqs):
            done += self._resolve(pend)  # the batch changed after all: lockstep for this step
            pend = None
            batch.items = [it for it in batch.items if not it.seq.is_finished]  # stopped at the token just read
        self.stats.preemptions += len(batch.preempted)
        for s in batch.failed:
            if not sch.chunked and s.num_tokens > sch.budget:
                s.error = (f"prompt: got {s.num_tokens} tokens, expected at most max_num_batched_tokens "
                           f"({sch.budget}) without chunked prefill")
            else:
                s.error = (f"the sequence needs {self.bm.blocks_for(s.num_tokens)} KV pages, the cache has "
                           f"{self.bm.num_blocks}")
            sch.finish(s, "error")
            done.append(s)
        if not batch.items:
            return done
        t0 = time.perf_counter()
        phase = counted_phase(batch)
        if self.ecfg.trace_ops:
            with torch.profiler.record_function(f"opmap::step::{phase}"):
                done += self._execute(batch, pend)
        else:
            done += self._execute(batch, pend)
        kv = sum(it.start + it.num_tokens for it in batch.items) if phase == "decode" else 0
        self.stats.add(phase, time.perf_counter() - t0, kv, len(batch.items))
        self.stats.add_host(phase, self._parts)
        return done

    def _tick(self, part: str, since: float) -> float:
        """Add the time since ``since`` to this step's host ``part``; returns now."""
        now = time.perf_counter()
        self._parts[part] += now - since
        return now

    def _can_run_ahead(self, pend: "_Pending") -> bool:
        """Step n+1 may start before step n's tokens are known: the same sequences keep decoding
        (nothing admitted that would make a prefill step) and none of them is certain to stop at
        step n."""
        sch = self.scheduler
        # (Sequences finish only when their tokens are read, so none of pend.seqs has finished.)
        if sch.running != pend.seqs or (sch.waiting and len(sch.running) < sch.max_num_seqs):
            return False
        return all(s.num_output_tokens + 1 < s.params.max_tokens and s.num_tokens + 1 < self.max_model_len
                   for s in pend.seqs)

    def _execute(self, batch, pend: Optional["_Pending"] = None) -> list:
        sch, done = self.scheduler, []
        # A run-ahead batch is exactly pend.seqs in order (step() checked), so row i's input is
        # pend.ids[i].
        t = time.perf_counter()
        logits = self.runner.run(batch) if pend is None else self.runner.run(batch, dev_ids=pend.ids)
        self._tick("forward", t)
        if pend is not None:
            done += self._resolve(pend)  # the previous step's tokens, read while this step runs
        t = time.perf_counter()
        sch.update(batch)  # after the placeholders were replaced: block hashes see real tokens
        t = self._tick("schedule", t)
        sampled = [it.seq for it in batch.items if it.samples]
        if not sampled:
            return done
        grammars = [s.state.get("grammar") for s in sampled]
        mask = None
        if any(g is not None for g in grammars):
            if not self.ecfg.overlap_grammar and self.runner.device.type == "cuda":
                torch.cuda.synchronize(self.runner.device)  # serial: the forward first, then the fill
                t = self._tick("wait", t)
            for g in grammars:
                if g is not None and not g.ready():
                    g.wait()  # compiled in the background since admission; rarely still running
            rows = self._bitmask.fill(grammars)
            mask = self._bitmask.upload(len(sampled), rows) if rows else None
            t = self._tick("grammar", t)
        with trusted_values():  # each row's parameters were checked when its request was made (_make)
            ids, invalid, lps = self.sampler.launch(logits, sampled, mask)
        p = _Pending(sampled, grammars, ids, invalid, lps, self._readback)
        self._tick("sample", t)
        if self.ecfg.async_decode and batch.is_decode:
            # Read back during the next step, after it was launched: the grammar matchers, the
            # penalty counts and the stop checkers are all up to date again before that step
            # samples, so every feature works one step ahead; only the host work moves.
            self._pending = p
            return done
        return done + self._resolve(p)

    def _resolve(self, p: "_Pending") -> list:
        """Apply a step's sampled tokens to the host state: append (replacing the placeholder
        a run-ahead step put there), grammar, stop checks. Returns the finished sequences."""
        if self._pending is p:
            self._pending = None
        sch, done = self.scheduler, []
        t = time.perf_counter()
        ids, invalid = p.read()
        t = self._tick("wait", t)
        for s, g, tok, bad, lp in zip(p.seqs, p.grammars, ids, invalid, p.lps):
            _drop_placeholder(s)
            if s.is_finished:
                continue  # it ended while this step ran (or failed in the schedule): token dropped
            err = None
            if g is not None and g.failed:
                err = g.error  # no allowed token (or the compile failed)
            elif bad:
                err = "the logits of this step hold NaN or +inf (no valid token to sample)"
            else:
                s.append(tok)
                if lp is not None:
                    s.logprobs.append(lp)
                if g is not None and not g.accept(tok):
                    err = g.error
            if err:
                s.error = err
                s.state["stop"].fail(err)
                sch.finish(s, "error")
                done.append(s)
                continue
            r = check_stop(s, tok, self.max_model_len, g is not None and g.terminated)
            if r is not None:
                sch.finish(s, r[0])
                s.stop_reason = r[1]
                done.append(s)
        self._tick("readback", t)
        return done


def counted_phase(batch) -> str:
    """The phase a step counts as in the run's summary and the profile: decode when every row
    decodes (one token past its prompt), prefill when none does, mixed otherwise. A budget of a
    few tokens cuts a prompt into one-token chunks that the runner serves on the decode path
    (``Batch.is_decode``), yet they are prefill work."""
    decoding = [it.num_tokens == 1 and it.start >= it.seq.num_prompt_tokens for it in batch.items]
    if all(decoding):
        return "decode"
    return "mixed" if any(decoding) else "prefill"


# A token sampled on the device whose value the host has not read yet (token ids are >= 0).
PLACEHOLDER = -1


def _drop_placeholder(s) -> None:
    """Remove the placeholder a run-ahead step appended to ``s`` (if it is there)."""
    if s.token_ids and s.token_ids[-1] == PLACEHOLDER:
        s.token_ids.pop()


class _Pending:
    """One step's sampled tokens on their way to the host: device ids (the next step's input
    when it runs ahead) and a non-blocking copy into pinned memory with an event.

    ``readback`` is the engine's persistent (pinned [2 * max_num_seqs] buffer, event) pair: at most
    one step is pending (the previous one is always read before the next samples), so one pair
    serves every step without a per-step pinned allocation.

    The destination must be contiguous. It was ``buf[:, :B]`` of a [2, max_num_seqs] buffer, which
    is strided whenever B < max_num_seqs. PyTorch copies into a strided CPU destination through a
    contiguous temporary that is *not* pinned, and a device-to-pageable cudaMemcpyAsync returns only
    when the copy is done, i.e. after the forward pass queued before it. The host then waited a
    whole forward pass inside the sampler's launch. CUDA's sync debug mode does not flag that wait.
    In the Llama-3-8B B=1 e2e (max_num_seqs 32) that wait was most of each decode step, and the
    next step's launch could no longer overlap the GPU. The profile at max_num_seqs 1, whose slice
    is contiguous, did not show it (tests/test_engine_async.py keeps the slice contiguous)."""

    def __init__(self, seqs: list, grammars: list, ids, invalid, lps: list, readback=None):
        self.seqs, self.grammars, self.lps, self.ids = seqs, grammars, lps, ids
        both = torch.stack((ids.to(torch.int64), invalid.to(torch.int64)))
        if readback is not None:
            buf, self.event = readback
            self.host = buf[:both.numel()].view(both.shape)  # contiguous: see the docstring
            self.host.copy_(both, non_blocking=True)
            self.event.record()
        else:  # CPU: the stack is already on the host
            self.host, self.event = both, None

    def read(self) -> tuple:
        if self.event is not None:
            self.event.synchronize()
        ids, bad = self.host.tolist()
        return ids, [bool(v) for v in bad]


def _elem_bytes(ecfg: EngineConfig, cfg, arch: str) -> int:
    """Bytes of one KV cache element of an engine: fp8 (GQA models), else the model's dtype."""
    if ecfg.kv_cache_dtype == "fp8" and not cfg.is_mla:
        return 1
    return 4 if engine_dtype(ecfg, arch) == "fp32" else 2


def free_device_memory() -> None:
    """Collect garbage (engines hold reference cycles) and return cached CUDA blocks to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _progress(total: int):
    try:
        # optional: tqdm
        from tqdm import tqdm

        return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)
    except ImportError:  # tqdm is optional; rich is a dependency
        from rich.progress import Progress

        p = Progress()
        p.start()
        task = p.add_task("requests", total=total)

        class _Bar:
            def update(self, n):
                p.update(task, advance=n)

            def close(self):
                p.stop()

        return _Bar()
