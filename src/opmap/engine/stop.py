"""When a request ends: EOS (unless ignore_eos), one of its stop_token_ids, one of its stop strings
(matched on the detokenised output; the text is cut before the stop string), max_tokens, or the
engine's max_model_len. Returns (finish_reason, stop_reason) or None to go on."""
from __future__ import annotations

from typing import Optional


def check_stop(seq, eos_ids: list, max_model_len: int, tokenizer) -> Optional[tuple]:
    p = seq.params
    tok = seq.token_ids[-1]
    if not p.ignore_eos and tok in eos_ids:
        return "stop", tok
    if tok in p.stop_token_ids:
        return "stop", tok
    if p.stop and tokenizer is not None:
        # Only the tail can contain a new match: decode a window wide enough for the longest stop.
        text = tokenizer.decode(seq.output_token_ids)
        window = max(len(s) for s in p.stop) + 16
        start = max(0, len(seq.text) - window)
        for s in p.stop:
            i = text.find(s, start)
            if i >= 0:
                seq.text = text[:i]
                return "stop", s
        seq.text = text
    if seq.num_output_tokens >= p.max_tokens:
        return "length", None
    if seq.num_tokens >= max_model_len:
        return "length", None
    return None
