"""User-facing sampling parameters of one request: ``SamplingParams``.

Every field is validated on construction; a value out of range raises
``opmap.core.contract.InputError`` naming the field (``InputError`` is a ``ValueError``). Fields may
be changed afterwards, so the engine checks them again when a request is made (``checked``: a
validated copy that the request keeps, so a later change reaches no queued request); a bad value
then ends that request with ``finish_reason="error"`` and the message. The engine
turns a list of these into per-row tensors with ``opmap.engine.sampling_tensors.SamplingTensors``.

Semantics (the order in which they act on a row of logits; DESIGN: processors -> grammar
bitmask -> sample -> stop):

1. penalties over the request's tokens (``logits`` op, ``apply_penalties``):
   - ``repetition_penalty`` r > 0 (1 = off): for every token seen in the prompt or the output,
     a logit l > 0 becomes l / r, else l * r (CTRL / HF / vLLM convention);
   - ``frequency_penalty`` f (0 = off): l -= f * count of the token in the *output*;
   - ``presence_penalty`` p (0 = off): l -= p if the token occurs in the *output*.
2. grammar bitmask (``grammar_mask`` op) when ``json_schema`` / ``json_object`` / ``grammar`` /
   ``regex`` is given (at most one of them).
3. sampling (``sampling`` op, ``sample``): ``temperature`` 0 = greedy (argmax, lowest id wins a
   tie), as is any temperature below the smallest normal fp32 (2**-126); otherwise
   z = l / temperature and the support is the longest prefix of the tokens in
   the order (z descending, id ascending) that satisfies all of: at most ``top_k`` tokens
   (0 = off), z >= max(z) + log(``min_p``) (0 = off), and top-p: a token is kept while the
   probability mass of the tokens ranked before it, renormalised over the top-k/min-p support,
   is < ``top_p`` (1 = off). A token is drawn from softmax(z) renormalised over that support.
   ``top_k`` = 1 is exactly greedy (ties included).
4. stop (``opmap.engine.stop``): EOS (unless ``ignore_eos``), ``stop_token_ids``,
   ``stop`` strings (matched on the detokenised text; the stop string is not emitted),
   ``max_tokens``, grammar termination.

``seed``: None draws a fresh random seed when the batch is built; a seeded request gets the same
tokens whatever else is in its batch (the random stream is keyed by (seed, position)).
``logprobs``: None = none; n in [0, MAX_LOGPROBS] = the chosen token's log-probability plus the
top-n, from the raw logits of the step (before penalties, temperature and filters); the engine
also refuses n above the model's vocabulary, for that request only.
"""
from __future__ import annotations

import math
import struct
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from opmap.core.contract import InputError
from opmap.ops.sampling.validate import FLT_MIN

__all__ = ["SamplingParams"]

# The most top-n log-probabilities a request may ask for (each one is read back to the host per step).
MAX_LOGPROBS = 1024


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _f32(v: float) -> float:
    """``v`` as the fp32 value of the per-row tensors the ops read (inf beyond fp32's range): a
    value must be valid there too, not only as a Python float."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Union[str, list, tuple, None] = None
    stop_token_ids: Union[list, tuple, None] = None
    json_schema: Union[str, dict, None] = None
    json_object: bool = False  # any JSON value (object or array at top level), no schema
    grammar: Optional[str] = None  # EBNF (GBNF dialect, as xgrammar reads it), root rule "root"
    regex: Optional[str] = None
    logprobs: Optional[int] = None
    ignore_eos: bool = False
    extra: dict = field(default_factory=dict)  # free-form, not interpreted by opmap

    def __post_init__(self):
        self.validate()

    def checked(self) -> "SamplingParams":
        """A validated copy (``InputError`` naming the first bad field): what a request keeps."""
        return dataclasses.replace(self)

    def validate(self) -> None:
        """Check every field (``InputError`` naming the first bad one); ``stop`` and
        ``stop_token_ids`` become lists."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InputError("max_tokens", repr(self.max_tokens), "an int >= 1")
        t = self.temperature
        if not _is_real(t) or math.isnan(t) or t < 0 or math.isinf(_f32(t)):
            raise InputError("temperature", repr(t), "a number >= 0, finite in fp32 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InputError("top_k", repr(self.top_k), "an int >= 0 (0 = off)")
        p = self.top_p
        if not _is_real(p) or math.isnan(p) or not (0 < p <= 1) or _f32(p) == 0:
            raise InputError("top_p", repr(p), "a number in (0, 1] that fp32 does not round to 0 (1 = off)")
        m = self.min_p
        if not _is_real(m) or math.isnan(m) or not (0 <= m <= 1):
            raise InputError("min_p", repr(m), "a number in [0, 1] (0 = off)")
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(_f32(r)) or _f32(r) < FLT_MIN:
            raise InputError("repetition_penalty", repr(r), "a number >= 2**-126, finite in fp32 (1 = off)")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(_f32(v)):
                raise InputError(name, repr(v), "a number finite in fp32 (0 = off)")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < 2**63)):
            raise InputError("seed", repr(self.seed), "None or an int in [0, 2**63)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not (self.stop is None or isinstance(self.stop, (list, tuple))
                and all(isinstance(s, str) and s for s in self.stop)):
            raise InputError("stop", repr(self.stop), "a non-empty string or a list of them")
        self.stop = list(self.stop or [])
        if not (self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple))
                and all(_is_int(s) and s >= 0 for s in self.stop_token_ids)):
            raise InputError("stop_token_ids", repr(self.stop_token_ids), "a list of ints >= 0")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.json_schema is not None and not isinstance(self.json_schema, (str, dict)):
            raise InputError("json_schema", type(self.json_schema).__name__, "a JSON string or a dict")
        for name in ("grammar", "regex"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InputError(name, repr(v), "None or a non-empty string")
        given = [n for n in ("json_schema", "grammar", "regex") if getattr(self, n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) > 1:
            raise InputError(given[1], f"{' and '.join(given)} together", "at most one structured-output constraint")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InputError("logprobs", repr(self.logprobs), f"None or an int in [0, {MAX_LOGPROBS}]")
        for name in ("ignore_eos", "json_object"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(name, repr(getattr(self, name)), "a bool")

    @property
    def greedy(self) -> bool:
        return _f32(self.temperature) < FLT_MIN or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def structured(self) -> Optional[tuple[str, Any]]:
        """(kind, source) of the structured-output constraint, or None.
        kind is one of "json_schema", "json", "ebnf", "regex"."""
        if self.json_schema is not None:
            return ("json_schema", self.json_schema)
        if self.json_object:
            return ("json", None)
        if self.grammar is not None:
            return ("ebnf", self.grammar)
        if self.regex is not None:
            return ("regex", self.regex)
        return None
