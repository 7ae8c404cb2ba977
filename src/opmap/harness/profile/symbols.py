"""The symbol table: a kernel symbol -> (operator category, library), opmap's own kernels from the
registry (``ours``), other libraries' from ``symbols.json`` (data); and the launching CPU op ->
category for kernels whose symbol says nothing (a cuBLAS GEMM launched by ``aten::bmm`` inside
attention, an elementwise kernel under ``aten::softmax``)."""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Optional

from opmap.harness.profile import ours
from opmap.harness.profile.ours import OP_CATEGORY  # noqa: F401  (re-exported)

TABLE = Path(__file__).with_name("symbols.json")


@functools.lru_cache(maxsize=None)
def table() -> dict:
    d = json.loads(TABLE.read_text())
    d["compiled"] = [(r["category"], r["library"], re.compile(r["pattern"])) for r in d["rules"]]
    d["by_launcher"] = {op: cat for cat, ops in d["launchers"].items() if cat != "about" for op in ops}
    d["motif_rx"] = [(r["category"], re.compile(r"(?<![\w])" + r["ops"] + r"(?![\w])")) for r in d["motifs"]["rules"]]
    return d


def motifs() -> list:
    """(category, compiled regex over space-joined launcher names) of the motifs table."""
    return table()["motif_rx"]


def after_last_gemm() -> str:
    return table()["motifs"]["after_last_gemm"]["category"]


def categories() -> list:
    return list(table()["categories"])


@functools.lru_cache(maxsize=65536)  # a trace holds a few hundred distinct symbols, launched many times
def classify(symbol: str) -> tuple[str, str]:
    """(category, library) of a kernel symbol; ("other", "unknown") when no rule matches. opmap's
    own kernels come from the registry (``ours``), where a symbol two ops share takes the first."""
    cats = ours.categories(symbol)
    if cats:
        return cats[0], "opmap"
    for cat, lib, rx in table()["compiled"]:
        if rx.search(symbol):
            return cat, lib
    return "other", "unknown"


def launcher_category(op_name: Optional[str]) -> Optional[str]:
    """The category a launching CPU op implies (None for ops that say nothing)."""
    return table()["by_launcher"].get(op_name) if op_name else None
