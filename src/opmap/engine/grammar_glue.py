"""Structured output in the engine (json_schema / json_object / grammar / regex): one XGrammar
matcher per constrained request, the token bitmask of the constrained rows filled per step, the
matcher advanced with each accepted token, grammar completion as a stop.

Only the bitmask *apply* is an opmap operator (``grammar_mask``, through the selector, in
``sampler.py``); compiling and matching are XGrammar's. The vocabulary given to XGrammar is the
model's tokenizer.json (through transformers' fast-tokenizer wrapper) or, for random-weight
presets, the byte tokenizer's (ids 0..255 = bytes). When xgrammar is missing, a constrained
request ends with an error naming the cause and the rest of the batch runs.
"""
from __future__ import annotations

from typing import Optional

from ..contract import InputError


class GrammarGlue:
    def __init__(self, tokenizer, vocab: int, device):
        self.tokenizer, self.vocab, self.device = tokenizer, vocab, device
        self._compiler = None

    def _xgr(self):
        try:
            import xgrammar
        except ImportError as e:
            raise InputError("structured output", f"unavailable ({e})", "the xgrammar package") from None
        return xgrammar

    def _tokenizer_info(self, xgr):
        tok = getattr(self.tokenizer, "tok", None)
        if tok is not None:
            from transformers import PreTrainedTokenizerFast

            return xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok),
                                                      vocab_size=self.vocab)
        # Byte tokenizer: ids 0..255 are those bytes; larger ids decode as "<id>" and stay usable.
        vocab = [bytes([i]) for i in range(min(256, self.vocab))] + [f"<{i}>".encode() for i in range(256, self.vocab)]
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab)

    def attach(self, seq) -> None:
        """Compile the request's constraint and give it a matcher (InputError when impossible)."""
        xgr = self._xgr()
        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(self._tokenizer_info(xgr))
        kind, source = seq.params.structured
        c = self._compiler
        try:
            if kind == "json_schema":
                import json

                src = source if isinstance(source, str) else json.dumps(source)
                compiled = c.compile_json_schema(src, any_whitespace=False)
            elif kind == "json":
                compiled = c.compile_builtin_json_grammar()
            elif kind == "ebnf":
                compiled = c.compile_grammar(source)
            else:
                compiled = c.compile_regex(source)
        except Exception as e:  # noqa: BLE001 - a bad schema / grammar is this request's error
            raise InputError(kind, f"a constraint that does not compile ({type(e).__name__}: {str(e)[:200]})",
                             "a valid constraint") from None
        # Completion of the grammar ends the request (random-weight presets have no EOS token).
        seq.state["matcher"] = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)

    @staticmethod
    def active(seqs) -> bool:
        return any("matcher" in s.state for s in seqs)

    def fill(self, seqs) -> Optional[tuple]:
        """(bitmask[B, ceil(V/32)] int32 on the device, rows int64) of the constrained rows."""
        import torch

        rows = [i for i, s in enumerate(seqs) if "matcher" in s.state]
        if not rows:
            return None
        xgr = self._xgr()
        bitmask = xgr.allocate_token_bitmask(len(seqs), self.vocab)
        for i in rows:
            seqs[i].state["matcher"].fill_next_token_bitmask(bitmask, i)
        return (bitmask.to(self.device, non_blocking=True),
                torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True))

    def advance(self, seq, token: int) -> Optional[str]:
        m = seq.state.get("matcher")
        if m is None or m.accept_token(int(token)):
            return None
        return f"token {token} rejected by the grammar matcher"

    def terminated(self, seq) -> bool:
        m = seq.state.get("matcher")
        return m is not None and m.is_terminated()
