"""Structured output through XGrammar: asynchronous compile with a cache, one matcher per request,
bitmask rows filled on the CPU, token acceptance, termination and failure states.

xgrammar is imported lazily (it is absent from the GPU machine); nothing here runs a GPU kernel
except ``apply_bitmask``, which dispatches to the ``grammar_mask`` op.

Engine usage, per step::

    so = StructuredOutput(tokenizer, vocab_size=model_vocab)       # once per tokenizer
    st = so.request(params)          # at admission: None when the request has no constraint;
                                     # compile starts now on the thread pool, shared through the cache
    st.ready()                       # non-blocking: False while compiling (skip the request this
                                     # step, the others go on); True once its matcher exists
    st.failed / st.error             # compile error, or no allowed token, or a rejected token
    buf = BitmaskBuffer(max_batch, model_vocab, device)
    # launch the forward pass of the step (asynchronous on the GPU), then, overlapping it:
    rows = buf.fill(states_by_row)   # CPU: one xgrammar fill per constrained, ready row
    bm, rows_dev = buf.upload(n_rows, rows)   # non-blocking copy to the device
    apply_bitmask(logits, bm, rows_dev)      # after the forward: Triton kernel on the GPU
    ... sample ...
    st.accept(token)                 # False -> st.failed; st.terminated -> finished ("grammar")

A request with a failure state is finished by the engine with that error; the batch goes on.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence

import torch

from opmap.core.select import select
from opmap.core.specs import spec_for

log = logging.getLogger("opmap.grammar")

__all__ = ["StructuredOutput", "GrammarState", "BitmaskBuffer", "apply_bitmask", "tokenizer_info",
           "GrammarError"]


class GrammarError(RuntimeError):
    """A structured-output request cannot go on (compile failed, no allowed token, token rejected)."""


def tokenizer_info(tokenizer, vocab_size: Optional[int] = None, stop_token_ids: Optional[Sequence[int]] = None):
    """xgrammar TokenizerInfo from a ``tokenizers.Tokenizer`` (local tokenizer.json) or an HF
    tokenizer. ``vocab_size`` is the *model's* vocabulary (the logits' width, padding included)."""
    # optional: xgrammar
    import xgrammar

    try:
        # heavy: transformers, to wrap a tokenizers.Tokenizer only
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers comes with xgrammar
        PreTrainedTokenizerFast = None
    tok = tokenizer
    if PreTrainedTokenizerFast is not None and not hasattr(tok, "backend_tokenizer"):
        tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    ids = list(stop_token_ids) if stop_token_ids else None
    return xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=ids)


def _canonical(kind: str, source: Any) -> str:
    if kind == "json_schema":
        obj = json.loads(source) if isinstance(source, str) else source
        # Whitespace-normalised, key order kept: the order of "properties" is the order in which
        # the grammar emits them, so two schemas differing only in it are different grammars.
        return json.dumps(obj, separators=(",", ":"))
    return "" if source is None else str(source)


class StructuredOutput:
    """Compiles grammars for one tokenizer on a thread pool; the cache (shared by every request
    with the same grammar) is keyed by (kind, grammar, tokenizer fingerprint)."""

    _caches: dict = {}  # tokenizer fingerprint -> {(kind, source): Future}; shared by instances
    _lock = threading.Lock()

    def __init__(self, tokenizer, vocab_size: Optional[int] = None, stop_token_ids: Optional[Sequence[int]] = None,
                 max_workers: int = 2, compile_threads: int = 4):
        # optional: xgrammar
        import xgrammar

        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = self.info.vocab_size
        self.stop_token_ids = list(self.info.stop_token_ids)
        h = hashlib.sha1(json.dumps([self.vocab_size, self.stop_token_ids]).encode())
        for t in self.info.decoded_vocab:
            h.update(t if isinstance(t, bytes) else str(t).encode())
            h.update(b"\0")
        self.fingerprint = h.hexdigest()
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=compile_threads)
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="opmap-grammar")
        with self._lock:
            self.cache = self._caches.setdefault(self.fingerprint, {})

    def _compile(self, kind: str, source: str):
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(source, any_whitespace=False)
        if kind == "json":
            return c.compile_builtin_json_grammar()
        if kind == "ebnf":
            return c.compile_grammar(source)
        if kind == "regex":
            return c.compile_regex(source)
        raise GrammarError(f"unknown grammar kind {kind!r} (json_schema, json, ebnf, regex)")

    def compile_async(self, kind: str, source: Any) -> Future:
        key = (kind, _canonical(kind, source))
        with self._lock:
            fut = self.cache.get(key)
            if fut is None:
                fut = self.pool.submit(self._compile, kind, key[1])
                self.cache[key] = fut
        return fut

    def request(self, params) -> Optional["GrammarState"]:
        """A GrammarState for a SamplingParams with a constraint (compile started), else None."""
        s = params.structured
        if s is None:
            return None
        return GrammarState(self.compile_async(*s), s[0], self.vocab_size)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=False)


class GrammarState:
    """One request's grammar: waiting -> ready -> (terminated | failed)."""

    def __init__(self, future: Future, kind: str, vocab_size: int):
        self.future, self.kind, self.vocab_size = future, kind, vocab_size
        self.matcher = None
        self.error: Optional[str] = None
        self.terminated = False

    @property
    def failed(self) -> bool:
        return self.error is not None

    def ready(self) -> bool:
        """Non-blocking: True once the grammar is compiled and the matcher made."""
        if self.matcher is not None or self.failed:
            return self.matcher is not None
        if not self.future.done():
            return False
        exc = self.future.exception()
        if exc is not None:
            self.error = f"grammar compile failed ({self.kind}): {type(exc).__name__}: {exc}"
            return False
        # optional: xgrammar
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(self.future.result())
        return True

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until compiled (tests and offline use); returns ready()."""
        try:
            self.future.exception(timeout=timeout)
        except Exception:  # a timeout: still compiling
            return False
        return self.ready()

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Fill ``bitmask[row]`` (CPU int32) with the allowed next tokens. False (and a failure
        state) when the grammar leaves no token at all."""
        if not self.ready():
            raise GrammarError(self.error or "grammar not compiled yet: call ready() before fill()")
        if self.terminated:
            self.error = "a token was asked for after the grammar terminated"
            return False
        try:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        except Exception as e:  # xgrammar raises on an inconsistent matcher: end this request only
            self.error = f"bitmask fill failed: {type(e).__name__}: {e}"
            return False
        if not bool(bitmask[row].any()):
            self.error = "grammar leaves no allowed token"
            return False
        return True

    def accept(self, token_id: int) -> bool:
        """Advance the matcher; False (and a failure state) when the grammar rejects the token."""
        if self.failed or self.matcher is None:
            return False
        if not self.matcher.accept_token(int(token_id)):
            self.error = f"token {int(token_id)} rejected by the grammar"
            return False
        self.terminated = bool(self.matcher.is_terminated())
        return True


class BitmaskBuffer:
    """A pinned CPU bitmask [max_batch, ceil(V/32)] filled by the matchers, and its device twin,
    copied without blocking. Rows of requests without a grammar are neither filled nor applied."""

    def __init__(self, max_batch: int, vocab_size: int, device="cpu"):
        self.words = (vocab_size + 31) // 32
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self.cpu = torch.full((max_batch, self.words), -1, dtype=torch.int32, pin_memory=pin)
        self.rows_cpu = torch.zeros(max_batch, dtype=torch.int32, pin_memory=pin)
        self.dev = self.cpu if not pin else torch.empty_like(self.cpu, device=self.device)
        self.rows_dev = self.rows_cpu if not pin else torch.empty_like(self.rows_cpu, device=self.device)
        self._copied = None  # CUDA event after the last upload's copies

    def fill(self, states: Sequence[Optional[GrammarState]]) -> list[int]:
        """Fill the rows of ready, live grammars; returns the rows to mask (failed rows are left
        out: their requests end with an error)."""
        if self._copied is not None:
            # The previous step's copies read these pinned pages: wait for them (normally long
            # done) before writing, so that an engine that runs ahead never races a copy.
            self._copied.synchronize()
        rows = []
        for i, st in enumerate(states):
            if st is None or st.terminated or st.failed or not st.ready():
                continue
            if st.fill(self.cpu, i):
                rows.append(i)
        return rows

    def upload(self, batch: int, rows: Sequence[int]):
        """(bitmask[batch, W], rows[R]) on the device; the copies do not block the host."""
        n = len(rows)
        if n:
            self.rows_cpu[:n] = torch.tensor(rows, dtype=torch.int32)
        if self.dev is not self.cpu:
            self.dev[:batch].copy_(self.cpu[:batch], non_blocking=True)
            self.rows_dev[:n].copy_(self.rows_cpu[:n], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self.dev[:batch], self.rows_dev[:n]


_logged: set = set()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[torch.Tensor] = None) -> str:
    """Apply through the selected ``grammar_mask`` backend; returns its name. A fall back from the
    fast path (our Triton kernel) to a slower one is logged once per backend name."""
    arch = "cpu" if logits.device.type != "cuda" else _arch(logits.device)
    dtype = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(logits.dtype, "fp32")
    choice = select("grammar_mask", spec_for("grammar_mask", arch=arch, vocab=logits.shape[1], dtype=dtype))
    name = choice.backend.name
    if name != "triton" and name not in _logged:
        _logged.add(name)
        log.warning("grammar bitmask: fast path (triton) not used on %s; falling back to %s: %s",
                    arch, name, choice.why())
    choice.backend("apply_bitmask", logits, bitmask, rows)
    return name


def _arch(device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"
