"""Tokenizers: a checkpoint's tokenizer.json (``tokenizers`` library), or, for a preset with random
weights and no tokenizer, bytes as token ids (UTF-8 bytes 0..255; larger ids decode as ``<id>``),
so that ``opmap run --model tiny-llama3 --prompt ...`` works end to end."""
from __future__ import annotations


class HFTokenizer:
    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


class ByteTokenizer:
    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str) -> list:
        return [b % self.vocab for b in text.encode("utf-8")]

    def decode(self, ids: list) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                buf.append(i)
            else:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(f"<{i}>")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


def make_tokenizer(path, vocab: int):
    from .weights import load_tokenizer

    t = load_tokenizer(path)
    return HFTokenizer(t) if t is not None else ByteTokenizer(vocab)
