"""Where the engine decides that a request ends. Stop is not a registry operator: each request
has an ``opmap.engine.stop.StopChecker`` (EOS unless ignore_eos, stop_token_ids, stop
strings on the detokenised output with the text cut before the stop string, max_tokens, grammar
termination, error states), stepped once per sampled token on the host after the step's tokens
are read back; the engine adds one rule of its own, ``max_model_len`` ("length").

The checker detokenises only requests that have stop strings (the others get a decode that
returns "", so a batch without stop strings pays no per-step detokenisation; their text is
decoded once when they finish). Reasons map to the API's finish reasons: eos / stop_token /
stop / grammar -> "stop" (``stop_reason`` = the token id, the string or "grammar"), length ->
"length", error -> "error".

Stop handling of one request: EOS, stop token ids, stop strings, max tokens, grammar
termination, and error states; incremental detokenisation that never emits half a stop string.

    sc = StopChecker(params, eos_token_ids={eos}, decode=tokenizer.decode)
    out = sc.step(token_id)              # after each sampled token
    out.text                             # new text that is safe to emit now
    out.finished, out.reason             # reason in REASONS

Rules (the engine's contract):
- ``eos``: a token of ``eos_token_ids`` ends the request unless ``params.ignore_eos``; the EOS
  token is kept in ``token_ids`` but adds no text.
- ``stop_token``: a token of ``params.stop_token_ids`` ends it likewise (kept in ids, no text).
- ``stop``: a string of ``params.stop`` found in the detokenised output ends it; the text is
  cut right before the stop string, which is never emitted (not even in part: a suffix that
  could still become a stop string is held back until it cannot).
- ``length``: ``params.max_tokens`` tokens generated (the held-back text is flushed).
- ``grammar``: the request's grammar terminated (``grammar_terminated=True`` passed to step).
- ``error``: ``fail(message)``: an invalid logits row (NaN/+inf), a grammar failure state.
Text is decoded from all output ids each step so that multi-byte characters split across tokens
come out whole: a trailing U+FFFD (an incomplete UTF-8 sequence) is held back too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from opmap.engine.params import SamplingParams

__all__ = ["StopChecker", "StepOutput", "REASONS"]

REASONS = ("eos", "stop_token", "stop", "length", "grammar", "error")


@dataclass
class StepOutput:
    text: str  # newly emittable text
    finished: bool
    reason: Optional[str] = None
    stop: Optional[str] = None  # the stop string or token id that ended it
    error: Optional[str] = None


@dataclass
class StopChecker:
    params: SamplingParams
    eos_token_ids: Iterable[int]
    decode: Callable[[list], str]
    token_ids: list = field(default_factory=list)
    text: str = ""  # all text emitted so far
    finished: bool = False
    reason: Optional[str] = None

    def __post_init__(self):
        self.eos_token_ids = frozenset(int(t) for t in self.eos_token_ids)
        self._stop_ids = frozenset(self.params.stop_token_ids)
        self._stops = list(self.params.stop)
        self._full = ""  # decoded text of the token ids that produce text

    def _finish(self, reason: str, text: str, stop=None, error=None) -> StepOutput:
        self.finished, self.reason = True, reason
        self.text += text
        return StepOutput(text, True, reason, stop, error)

    def fail(self, message: str) -> StepOutput:
        """End the request with an error state (the emitted text so far stands)."""
        return self._finish("error", "", error=message)

    def step(self, token_id: int, grammar_terminated: bool = False) -> StepOutput:
        if self.finished:
            raise RuntimeError(f"step() after the request finished ({self.reason})")
        tok = int(token_id)
        self.token_ids.append(tok)
        if tok in self.eos_token_ids and not self.params.ignore_eos:
            return self._finish("eos", self._flush(), stop=tok)
        if tok in self._stop_ids:
            return self._finish("stop_token", self._flush(), stop=tok)
        self._full = self.decode(self.token_ids)
        start = max(0, len(self.text) - max((len(s) for s in self._stops), default=0))
        hit = None
        for s in self._stops:
            i = self._full.find(s, start)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is not None:
            return self._finish("stop", self._full[len(self.text):hit[0]], stop=hit[1])
        if grammar_terminated:
            return self._finish("grammar", self._flush())
        if len(self.token_ids) >= self.params.max_tokens:
            return self._finish("length", self._flush())
        safe = len(self._full) - self._holdback(self._full)
        new = self._full[len(self.text):safe] if safe > len(self.text) else ""
        self.text += new
        return StepOutput(new, False)

    def _flush(self) -> str:
        """All text not yet emitted (the request ends: nothing can become a stop string now)."""
        new = self._full[len(self.text):]
        if new.endswith("\ufffd"):
            new = new.rstrip("\ufffd")  # an incomplete character at the very end is dropped
        return new

    def _holdback(self, full: str) -> int:
        """Characters at the end that must wait: an incomplete UTF-8 character, or the longest
        suffix that is a proper prefix of a stop string."""
        n = len(full) - len(full.rstrip("\ufffd"))
        tail = full[: len(full) - n]
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:k]):
                    best = k
                    break
        return n + best


FINISH = {"eos": "stop", "stop_token": "stop", "stop": "stop", "grammar": "stop", "length": "length",
          "error": "error"}


def _no_text(ids) -> str:
    return ""


def make_checker(seq, eos_ids, tokenizer) -> StopChecker:
    p = seq.params
    return StopChecker(p, eos_token_ids=eos_ids, decode=tokenizer.decode if p.stop else _no_text)


def check_stop(seq, token: int, max_model_len: int, grammar_terminated: bool = False):
    """Step the request's checker with its new token: (finish_reason, stop_reason) or None."""
    out = seq.state["stop"].step(token, grammar_terminated=grammar_terminated)
    if out.finished:
        stop = "grammar" if out.reason == "grammar" else out.stop
        return FINISH[out.reason], stop
    if seq.num_tokens >= max_model_len:
        return "length", None
    return None
