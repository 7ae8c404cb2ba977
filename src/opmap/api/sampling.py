"""Public ops of the sampler pipeline: logits processors, sampling, the grammar bitmask.

logits[B, V] fp32 (or 16-bit) rows; every per-row parameter is a [B] tensor on the logits'
device. Contracts in full: ``opmap.ops.sampling.reference`` and ``opmap.ops.grammar.reference``
(module docstrings). Selection and validation as in ``opmap.api.dense``.
"""
from __future__ import annotations

from typing import Optional

import torch

from opmap.core.specs import GrammarMaskSpec, LogitsSpec, SamplingSpec
from opmap.api.dispatch import arch_of, call, capturing, dt, tensor


def _vocab_spec(cls, logits, phase, **kw):
    tensor("logits", logits, 2)
    return cls(arch=arch_of(logits), phase=phase, vocab=logits.shape[1], dtype=dt(logits), cuda_graph=capturing(),
               **kw)


def apply_penalties(logits, prompt_mask, output_counts, repetition, frequency, presence, *,
                    backend: Optional[str] = None, phase: str = "decode") -> None:
    """In place on logits[B, V]: repetition (HF: divide positive, multiply negative logits of
    tokens seen in the prompt mask[B, V] bool or the output counts[B, V] int32), then frequency
    (minus count x f) and presence (minus p where count > 0); per-row [B] fp32 parameters."""
    spec = _vocab_spec(LogitsSpec, logits, phase, penalties=True)
    call("logits", spec, "apply_penalties", backend, logits, prompt_mask, output_counts, repetition, frequency,
         presence)


def apply_temperature(logits, temperature, *, backend: Optional[str] = None, phase: str = "decode") -> None:
    """In place: logits[b] /= temperature[b] (rows with temperature 0 are left as they are: greedy)."""
    call("logits", _vocab_spec(LogitsSpec, logits, phase), "apply_temperature", backend, logits, temperature)


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions, *, backend: Optional[str] = None,
           phase: str = "decode"):
    """One token per row -> (ids[B] int64, invalid[B] bool: a row with no finite logit).
    temperature[B] fp32 finite >= 0 (0 = greedy), top_k[B] int32 >= 0 (0 = off), top_p[B] fp32 in
    (0, 1] (1 = off), min_p[B] fp32 in [0, 1] (0 = off); a value out of range or NaN is an
    InputError naming the argument. seeds[B] int64 and positions[B] int64 key the random stream,
    so a seeded row draws the same token alone or in any batch."""
    spec = _vocab_spec(SamplingSpec, logits, phase, top_k=True, top_p=True, min_p=True)
    return call("sampling", spec, "sample", backend, logits, temperature, top_k, top_p, min_p, seeds, positions)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[torch.Tensor] = None, *,
                  backend: Optional[str] = None, phase: str = "decode") -> None:
    """In place: logits[r, j] = -inf where bit j % 32 of bitmask[r, j // 32] (int32) is clear;
    ``rows`` (int32/int64) maps bitmask row i to logits row rows[i]."""
    call("grammar_mask", _vocab_spec(GrammarMaskSpec, logits, phase), "apply_bitmask", backend, logits, bitmask,
         rows)
