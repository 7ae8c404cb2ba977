"""Tokenizers: a checkpoint's tokenizer.json, or, for a preset with random weights, a byte-level
``tokenizers.Tokenizer`` built here: ids 0..255 are the 256 bytes (GPT-2's byte-to-unicode
alphabet, no merges), ids 256.. are tokens ``<|id|>``, the last id is the special ``<|endoftext|>`` (the token a
structured-output grammar ends with; not an EOS of the engine: random weights would stop on it). Both are real ``tokenizers`` objects, so
text prompts, stop strings and XGrammar's vocabulary (structured output) work the same way for
presets and checkpoints."""
from __future__ import annotations

import functools

from opmap.engine.weights import load_tokenizer

END = "<|endoftext|>"


class HFTokenizer:
    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def _bytes_to_unicode() -> list:
    """GPT-2's printable stand-in character for each byte value 0..255."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


@functools.lru_cache(maxsize=8)
def byte_tokenizer(vocab: int):
    # tokenizers: loaded when a tokenizer is built, not with the engine
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _bytes_to_unicode()
    v = {c: i for i, c in enumerate(chars[:vocab])}
    v.update({f"<|{i}|>": i for i in range(256, vocab)})
    v[END] = vocab - 1  # a special token (never in decoded text) that can end a grammar
    tok = Tokenizer(models.BPE(vocab=v, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([END])
    return tok


def make_tokenizer(path, vocab: int) -> HFTokenizer:
    t = load_tokenizer(path)
    out = HFTokenizer(t if t is not None else byte_tokenizer(vocab))
    out.grammar_end = None if t is not None else [vocab - 1]
    return out
