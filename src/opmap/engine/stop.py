"""Where the engine decides that a request ends. Stop is not a registry operator: each request
has an ``opmap.ops.sampling.stop.StopChecker`` (EOS unless ignore_eos, stop_token_ids, stop
strings on the detokenised output with the text cut before the stop string, max_tokens, grammar
termination, error states), stepped once per sampled token on the host after the step's tokens
are read back; the engine adds one rule of its own, ``max_model_len`` ("length").

The checker detokenises only requests that have stop strings (the others get a decode that
returns "", so a batch without stop strings pays no per-step detokenisation; their text is
decoded once when they finish). Reasons map to the API's finish reasons: eos / stop_token /
stop / grammar -> "stop" (``stop_reason`` = the token id, the string or "grammar"), length ->
"length", error -> "error".
"""
from __future__ import annotations

from ..ops.sampling.stop import StopChecker

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
