"""The symbol table: a kernel symbol -> (operator category, library), opmap's own kernels from the
registry (``ours``), other libraries' from ``symbols.json`` (data); with it, as data too, the host
frames that name an operator, the launching CPU ops -> category, the motifs of launching ops, and
the words that tell a GEMM's precision."""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import NamedTuple, Optional

from opmap.harness.profile import ours
from opmap.harness.profile.ours import OP_CATEGORY  # noqa: F401  (re-exported)

TABLE = Path(__file__).with_name("symbols.json")
# A GEMM or a copy is whichever operator's its context says: launcher evidence of these two a motif may refine.
REFINABLE = ("GEMM", "memory copies")
_SORT = re.compile(r"(?i)sort|radix")


class Sym(NamedTuple):
    category: Optional[str]  # None: the symbol says nothing by itself (an elementwise kernel)
    library: str
    generic: bool  # any operator may launch it: stronger evidence decides


@functools.lru_cache(maxsize=None)
def table() -> dict:
    d = json.loads(TABLE.read_text())
    d["compiled"] = [(r["category"], r["library"], bool(r.get("generic")), re.compile(r["pattern"])) for r in d["rules"]]
    d["by_launcher"] = {op: cat for cat, ops in d["launchers"].items() if cat != "about" for op in ops}
    d["frame_rx"] = [(r["category"], re.compile(r["pattern"])) for r in d["frames"]["rules"]]
    d["motif_rx"] = [(r["category"], re.compile(r"(?<![\w@])" + r["ops"] + r"(?![\w])"), tuple(r.get("claims", ())))
                     for r in d["motifs"]["rules"]]
    d["low_rx"] = re.compile(d["precision"]["low_precision"])
    d["dequant_rx"] = re.compile(d["precision"]["dequantise"])
    return d


def motifs() -> list:
    """(category, compiled regex over space-joined launcher names, categories it may claim)."""
    return table()["motif_rx"]


def categories() -> list:
    return list(table()["categories"])


@functools.lru_cache(maxsize=65536)  # a trace holds a few hundred distinct symbols, launched many times
def lookup(symbol: str) -> Sym:
    """What a symbol alone says. opmap's own kernels come from the registry; a symbol two of our
    ops share (``ours``) says its first op's category, generic, so the context decides."""
    cats = ours.categories(symbol)
    if cats:
        return Sym(cats[0], "opmap", len(cats) > 1)
    for cat, lib, generic, rx in table()["compiled"]:
        if rx.search(symbol):
            return Sym(cat, lib, generic)
    return Sym(None, "unknown", True)


def classify(symbol: str) -> tuple[str, str]:
    """(category, library) of a kernel symbol alone; ("unattributed", library) when it says nothing."""
    s = lookup(symbol)
    return s.category or "unattributed", s.library


def launcher_category(op_name: Optional[str]) -> Optional[str]:
    """The category a launching CPU op implies (None for ops that say nothing)."""
    return table()["by_launcher"].get(op_name) if op_name else None


@functools.lru_cache(maxsize=65536)
def frame_category(frame: str) -> Optional[str]:
    """The category a host frame names (an nn.Module, a kept Python function, an engine range)."""
    return next((c for c, rx in table()["frame_rx"] if rx.search(frame)), None)


@functools.lru_cache(maxsize=65536)
def low_precision_gemm(symbol: str) -> bool:
    """A GEMM (or MoE GEMM) kernel whose operands are fp8 / fp4 / int8: its symbol says a GEMM and
    a low precision (cuBLASLt's e4m3 kernels, TRT-LLM-gen's MxE2m1, DeepGEMM's fp8), or it is one of
    opmap's weight-only kernels (the registry's quantised-only gemm backends)."""
    if ours.owners(symbol):
        return ours.low_precision_gemm(symbol)
    s = lookup(symbol)
    return (s.category in ("GEMM", "MoE") and bool(table()["low_rx"].search(symbol))
            and not table()["dequant_rx"].search(symbol))


@functools.lru_cache(maxsize=65536)
def dequantiser(symbol: str) -> bool:
    """A kernel that turns a quantised tensor back into a dense one (its name says dequantise)."""
    return bool(table()["dequant_rx"].search(symbol))


def is_sort(symbol: str) -> bool:
    return bool(_SORT.search(symbol))
