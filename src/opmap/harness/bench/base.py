"""What a benchmark case is. Each op family lists its cases in ``opmap.harness.bench.cases.<family>``
through ``cases(quick: bool) -> list[BenchCase]``.

A case knows its FLOPs and the fewest bytes it must move (each input read once, each output
written once), so every timing is also a fraction of the measured ceiling: memory-bound cases
against the read ceiling, compute-bound ones against the bf16 GEMM ceiling.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass
class Provider:
    name: str  # e.g. "opmap-triton", "cudnn-sdpa", "cublas", "torch-sort"
    make: Callable[[Any], Callable[[], Any]]  # inputs -> a no-argument callable that runs the op once
    backend: Optional[tuple] = None  # (op, backend name) in the registry, to check it can serve the case
    available: Optional[Callable[[], Optional[str]]] = None  # reason it cannot run here, else None
    describe: Optional[Callable[[], str]] = None  # after timing: what ran (e.g. the tuned config), for the note

    @property
    def variant(self) -> bool:
        """A tuning variant of a backend ("opmap-triton[bn=32,s=3]"): timed with --variants only."""
        return "[" in self.name


@dataclass
class BenchCase:
    op: str  # e.g. "attention.decode", "gemm", "rmsnorm", "sampling", "moe", "e2e"
    case: str  # the shape as key=value pairs, e.g. "B=64,kv=4096,h=32/8,d=128,page=16,dtype=bf16"
    flops: float
    bytes: float
    setup: Callable[[Any], Any]  # device -> inputs (fresh random data; called once per rotated set)
    providers: list = field(default_factory=list)  # of Provider
    bound: str = "memory"  # "memory" (fraction of read ceiling) or "compute" (of GEMM ceiling)
    graph: bool = False  # time by CUDA-graph replay (small launches)
    spec: Any = None  # the spec the selector is asked about, when there is one
    tags: tuple = field(default_factory=tuple)
    family: str = ""  # the cases module it came from (set by runner.collect); names its baseline file
