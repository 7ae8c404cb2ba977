"""Structured output in the engine: one matcher per constrained request, a bitmask per step for
the constrained rows, the matcher advanced with each accepted token, termination as a stop.

The grammar compiler and matchers come from ``opmap.ops.grammar.structured`` (the XGrammar glue
of the grammar family); this class is the engine's only seam with it. When that module (or
xgrammar under it) is missing, a constrained request ends with an error naming the cause and the
rest of the batch runs.
"""
from __future__ import annotations

from typing import Optional

from ..contract import InputError


class GrammarGlue:
    def __init__(self, tokenizer, vocab: int, device):
        self.tokenizer, self.vocab, self.device = tokenizer, vocab, device
        self._backend = None  # the structured-output module, imported on first use
        self._compiler = None

    def _load(self):
        if self._backend is None:
            try:
                from ..ops.grammar import structured
            except ImportError as e:
                raise InputError("structured output", f"unavailable ({e})",
                                 "opmap.ops.grammar.structured with xgrammar installed") from None
            self._backend = structured
        return self._backend

    def attach(self, seq) -> None:
        """Compile the request's constraint and give it a matcher (InputError when impossible)."""
        mod = self._load()
        kind, source = seq.params.structured
        if self._compiler is None:
            tok = getattr(self.tokenizer, "tok", None)
            if tok is None:
                raise InputError("structured output", "a model without tokenizer.json",
                                 "a checkpoint with a tokenizer (the grammar is compiled against its vocabulary)")
            self._compiler = mod.make_compiler(tok, self.vocab)
        try:
            seq.state["matcher"] = mod.make_matcher(self._compiler, kind, source)
        except Exception as e:  # noqa: BLE001 - a bad schema / grammar is the request's error
            raise InputError(kind, f"a constraint that does not compile ({type(e).__name__}: {e})",
                             "a valid constraint") from None

    @staticmethod
    def active(seqs) -> bool:
        return any("matcher" in s.state for s in seqs)

    def fill(self, seqs) -> Optional[tuple]:
        """(bitmask[B, ceil(V/32)] int32 on the device, rows int64) of the constrained rows."""
        mod = self._load()
        rows = [i for i, s in enumerate(seqs) if "matcher" in s.state]
        if not rows:
            return None
        bitmask = mod.fill_bitmask([seqs[i].state["matcher"] for i in rows], rows, len(seqs), self.vocab,
                                   self.device)
        import torch

        return bitmask, torch.tensor(rows, dtype=torch.int64, device=self.device)

    def advance(self, seq, token: int) -> Optional[str]:
        m = seq.state.get("matcher")
        if m is None:
            return None
        if not self._load().accept(m, token):
            return f"token {token} rejected by the grammar matcher"
        return None

    def terminated(self, seq) -> bool:
        m = seq.state.get("matcher")
        return m is not None and self._load().is_terminated(m)
