"""The sampler pipeline of one step: logits processors -> grammar bitmask -> sample -> (stop, in
``stop.py``). Every stage is an opmap operator resolved once through the selector:
``logits.apply_penalties``, ``grammar_mask.apply_bitmask``, ``sampling.sample``,
``logits.logprobs``. Parameters are per-row tensors built from the requests' ``SamplingParams``
(``opmap.engine.sampling_tensors.SamplingTensors``); the random stream is keyed by (seed, position),
so a seeded request draws the same tokens alone or inside any batch.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from opmap.api.dispatch import entry_of
from opmap.engine.opset import _ranged
from opmap.engine.sampling_tensors import SamplingTensors, penalty_state, to_device, update_output_counts
from opmap.model.step import resolve, sampler_slots


class Sampler:
    def __init__(self, vocab: int, device, arch: str, forced: Optional[dict] = None, trace: bool = False):
        self.vocab, self.device = vocab, torch.device(device)
        # The sampler stage of the step map (the report's rows): penalties, bitmask, sample, logprobs.
        self.choices = []
        for r in resolve(sampler_slots(vocab, arch), forced, fuse_rope_append=False):
            self.choices.append((r.entry, r.choice))
            fn = entry_of(r.choice, r.entry)[1]
            setattr(self, r.key, _ranged(fn, f"opmap::{r.op}::{r.label}::{r.backend.name}") if trace else fn)
        self._key, self._st = None, None
        # The last launch's penalty state: the next decode step adds its sampled ids on the device
        # instead of rebuilding both [B, V] tensors from every token of every row on the host
        # (at B=32 with 512-token prompts that host work took longer than the GPU's whole step).
        self._pen: Optional[_PenaltyState] = None

    def condensed(self) -> list:
        return [c.condensed() for _, c in self.choices]

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, seqs: list, mask=None):
        """The pipeline without reading the tokens back: (ids[B] and invalid[B] on the device,
        logprobs per row); the engine reads them back (``llm._Pending``). Rows that ask for
        logprobs are read here (a synchronisation).

        ``mask``: (bitmask[B, ceil(V/32)] int32, rows) on the device for the rows under a
        structured-output constraint (``opmap.engine.structured.BitmaskBuffer``), or None."""
        params = [s.params for s in seqs]
        key = tuple(s.seq_id for s in seqs)
        if key != self._key:  # steady decode keeps its batch: the per-row tensors are reused
            self._key, self._st = key, SamplingTensors.build(params, self.vocab, device=logits.device)
        st = self._st
        want_lp = [p.logprobs for p in params]
        raw = logits.clone() if any(n is not None for n in want_lp) else None
        outs = None
        if st.any_penalties:
            # (named seen, not mask: the grammar bitmask argument below is called mask)
            outs = tuple(s.num_output_tokens for s in seqs)
            pen = self._pen
            if pen is not None and pen.key == key and all(o == q + 1 for o, q in zip(outs, pen.outs)):
                # Same rows, one token each since the last launch: the ids it sampled (a row whose
                # token was not appended ended, which changes the key).
                seen, counts = pen.seen, pen.counts
                update_output_counts(counts, pen.ids)
            else:
                seen, counts = penalty_state([s.token_ids[:s.num_prompt_tokens] for s in seqs],
                                             [s.output_token_ids for s in seqs], self.vocab, device=logits.device)
            self.penalties(logits, seen, counts, st.repetition, st.frequency, st.presence)
        if mask is not None:
            self.bitmask(logits, *mask)
        positions = to_device([s.num_tokens for s in seqs], torch.int64, logits.device)
        ids, invalid = self.sample(logits, st.temperature, st.top_k, st.top_p, st.min_p, st.seeds, positions)
        self._pen = _PenaltyState(key, seen, counts, outs, ids) if outs is not None else None
        lps: list = [None] * len(seqs)
        if raw is not None:
            n = max(x for x in want_lp if x is not None)
            chosen, tv, ti = self.logprobs(raw, ids, n)
            chosen, tv, ti = chosen.tolist(), tv.tolist(), ti.tolist()
            for b, k in enumerate(want_lp):
                if k is not None:
                    lps[b] = {"token": chosen[b], "top": list(zip(ti[b][:k], tv[b][:k]))}
        return ids, invalid, lps


class _PenaltyState(NamedTuple):
    key: tuple  # the batch's sequence ids
    seen: torch.Tensor  # [B, V] bool: tokens of the prompt
    counts: torch.Tensor  # [B, V] int32: occurrences in the output, up to the launch
    outs: tuple  # output lengths at the launch
    ids: torch.Tensor  # [B] the tokens that launch sampled (on the device)
