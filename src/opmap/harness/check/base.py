"""What a correctness case is. Each op family lists its cases in ``opmap.harness.check.cases.<family>``
through a function ``cases(device: str, quick: bool) -> list[CheckCase]``."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

from opmap.core import hw
from opmap.core.contract import InputError

SECTIONS = {
    "parity": "Reference parity",
    "sampling": "Sampling statistics",
    "graph": "Eager vs CUDA graph",
    "boundaries": "Boundaries",
    "gqa-mla": "GQA and MLA paths",
    "quant": "Quantisation gates",
    "structured": "Structured output",
    "sanitizer": "Memory safety (compute-sanitizer)",
    "input": "Bad input is a clear error",
}


@dataclass
class Outcome:
    passed: bool
    figure: str  # the number(s) behind the verdict, e.g. "max_abs=2e-3 worst/tol=0.21"
    value: Optional[float] = None  # the headline figure (worst error ratio, p-value, cosine...)
    limit: Optional[float] = None  # what value is compared against


@dataclass
class CheckCase:
    section: str  # a key of SECTIONS
    op: str  # registry op name
    backend: str  # registry backend name ("-" when the case is not about one backend)
    case: str  # the shape as key=value pairs
    run: Callable[[], Outcome]
    device: str = "any"  # "cpu", "cuda" or "any": where the case can run
    quick: bool = True  # part of --quick
    tags: tuple = field(default_factory=tuple)  # e.g. ("gqa",), ("mla",), ("moe",)

    @property
    def title(self) -> str:
        return f"{self.op}/{self.backend} {self.case}"


def probe_errors(probes: dict) -> Outcome:
    """Run each bad-input probe; each must raise InputError naming its argument. A probe is
    `argument -> call`, or `what -> (argument, call)` where several probes blame one argument."""
    missed = []
    for what, probe in probes.items():
        arg, call = probe if isinstance(probe, tuple) else (what, probe)
        try:
            call()
            missed.append(f"{what}: no error")
        except InputError as e:
            if e.arg != arg:
                missed.append(f"{what}: error named {e.arg!r}, not {arg!r}")
    return Outcome(not missed, "; ".join(missed) or f"{len(probes)} bad inputs named their argument")


def arch_of(device: str) -> str:
    """The arch a check case asks the selector about: "cpu", or this GPU's (e.g. "sm90")."""
    if device == "cpu":
        return "cpu"
    return hw.local_arch()


def racecheck_child() -> bool:
    """True in a case's child process under compute-sanitizer racecheck (the driver sets
    OPMAP_SANITIZER_TOOL). Racecheck instruments every shared-memory access, so a case may run a
    smaller problem there with the same kernel configuration: a shared-memory race does not depend
    on how many rows or tiles the grid walks. Titles stay the same (the child finds its case by
    title); the figure says what ran."""
    return os.environ.get("OPMAP_SANITIZER_TOOL") == "racecheck"

