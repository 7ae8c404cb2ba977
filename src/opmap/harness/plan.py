"""Expected speed of an operator on a GPU this machine may not have: the nearest measured case of
the selected backend in that GPU's committed baselines (``bench/baselines/<gpu>/<family>.json``).
A figure always comes with the row it was read from; where no row fits, it says so."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

# The GPUs whose baselines are committed, by the arch the selector plans for.
GPU_OF_ARCH = {"sm90": "h200"}
BASELINES = Path(__file__).resolve().parents[3] / "bench" / "baselines"


def load_rows(arch: str, root: Path = BASELINES) -> tuple[Optional[str], list]:
    """(gpu name, result records of every family file, each with its file's commit); (None, [])
    when no baseline exists for the arch."""
    gpu = GPU_OF_ARCH.get(arch)
    folder = root / gpu if gpu else None
    if folder is None or not folder.is_dir():
        return None, []
    rows = []
    for f in sorted(folder.glob("*.json")):
        doc = json.loads(f.read_text())
        env = doc.get("environment") or {}
        for r in doc.get("results", []):
            rows.append({**r, "gpu": env.get("gpu") or gpu, "commit": env.get("commit"), "file": f"{gpu}/{f.name}",
                         "ceilings": env.get("ceilings"),
                         "versions": {k: env.get(k) for k in ("torch", "triton", "cuda") if env.get(k)}})
    return gpu, rows


def _case(case: str) -> dict:
    out = {}
    for part in case.split(","):
        k, _, v = part.partition("=")
        if _:
            try:
                out[k] = int(v)
            except ValueError:
                out[k] = v
    return out


FUSED_GEMM_ROWS = {"linear_act": "gemm.gated", "linear_add": "gemm.add"}  # gemm entry -> its bench op


def _bench_op(op: str, spec, entry: Optional[str] = None) -> str:
    """The bench's op name for a registry op and spec (attention rows are per phase and kind; the
    gated GEMM's, entry linear_act, are gemm.gated; the GEMM with an addend, linear_add, gemm.add)."""
    if entry in FUSED_GEMM_ROWS:
        return FUSED_GEMM_ROWS[entry]
    if op == "attention":
        kind = "mla_" if getattr(spec, "kind", "") == "mla" else ""
        if kind and getattr(spec, "sparse", False):
            return "attention.mla_sparse_decode"
        return f"attention.{kind}{spec.phase if spec.phase != 'mixed' or kind else 'mixed'}"
    return op


def _features(op: str, spec, rows: int) -> tuple[dict, dict]:
    """(numbers to be near, strings to equal) of the spec, in the bench cases' key names; ``rows``:
    the tokens of the step (the specs of row-wise ops do not carry them)."""
    if op == "gemm":
        return {"M": spec.m or rows, "N": spec.n, "K": spec.k}, {"w": spec.weight_dtype}
    if op == "rmsnorm":
        return {"R": rows, "H": spec.hidden}, {"fused_add": str(int(spec.fused_add))}
    if op == "rope":
        return {"T": rows, "d": spec.head_dim}, {"style": spec.style}
    if op == "activation":
        return {"R": rows, "H": spec.hidden}, {"kind": spec.kind}
    if op == "moe":
        return {"E": spec.num_experts, "H": spec.hidden, "I": spec.intermediate}, {}
    if op == "attention" and getattr(spec, "kind", "") == "mla":
        return {"h": spec.num_heads}, {"kv_dtype": spec.kv_dtype}
    if op == "attention":
        return {"d": spec.head_dim, "page": spec.page_size}, {"dtype": spec.kv_dtype}
    if op == "kv_append":
        return {"d": spec.head_dim, "page": spec.page_size}, {"kv_dtype": spec.kv_dtype}
    return {}, {}


def expected(op: str, spec, backend: str, rows: list, tokens: int = 1, entry: Optional[str] = None) -> Optional[dict]:
    """The measured row of ``backend`` nearest to ``spec`` at ``tokens`` rows (None when the
    baselines have none); ``entry``: the backend function the step calls, where its rows are
    another bench op's (``_bench_op``). A peer's rows carry no registry name, so they match by provider."""
    want = f"{op}/{backend}"
    name = _bench_op(op, spec, entry)
    mine = [r for r in rows if r["op"] == name and "[" not in r["provider"]
            and (r.get("backend") == want or (r.get("backend") is None and r["provider"] == backend))]
    if not mine:
        return None
    near, equal = _features(op, spec, tokens)

    def distance(r):
        c = _case(r["case"])
        if any(k in c and str(c[k]) != str(v) for k, v in equal.items()):
            return math.inf
        return sum(abs(math.log(max(c[k], 1) / max(v, 1))) for k, v in near.items() if isinstance(c.get(k), int))

    best = min(mine, key=distance)
    return best if distance(best) < math.inf else None


def work(op: str, spec, rows: int) -> Optional[tuple]:
    """(FLOPs, bytes) of one call of ``op`` at the model's shape and ``rows`` rows, counted as the
    bench counts its cases (harness/bench/cases); None for an op without such a count here."""
    if op == "gemm":
        M, N, K = spec.m or rows, spec.n, spec.k
        if spec.weight_dtype == "int4":  # half a byte a weight, an fp16 scale a group (bench/cases/gemm.py)
            wbytes = N * K // 2 + N * (K // (spec.group_size or K)) * 2
        else:
            quant = spec.weight_dtype in ("fp8", "int8")
            wbytes = N * K * (1 if quant else 2) + (N * 4 if quant else 0)
        return 2.0 * M * N * K, float(wbytes + M * K * 2 + M * N * 2)
    if op == "rmsnorm":
        R, H = rows, spec.hidden
        return float((5 if spec.fused_add else 4) * R * H), float((4 if spec.fused_add else 2) * R * H * 2 + H * 2)
    if op == "activation":
        return float(6 * rows * spec.hidden), float(3 * rows * spec.hidden * 2)
    return None


# How far the roofline time of a call may be from that of the baseline case it is scaled from:
# within this factor the case's achieved fraction of the ceilings is taken to carry over; beyond it
# (a launch-bound call against a bandwidth-bound case, say) no time is claimed.
SCALE_LIMIT = 8.0


def scaled(op: str, spec, r: Optional[dict], rows: int) -> dict:
    """The expected time of one call at the model's shape from the baseline row ``r``:
    {"us": ..., "how": ...}, the case's time times the ratio of the two roofline times (bytes over
    the read ceiling, FLOPs over the GEMM ceiling, the larger), or {"us": None, "why": ...}
    where that cannot be claimed (no row, no count of the op's work, a case too far from the call)."""
    if r is None:
        return {"us": None, "why": "no baseline row for this backend"}
    w, c = work(op, spec, rows), r.get("ceilings")
    if w is None or not c or not r.get("bytes"):
        return {"us": None, "why": "the nearest case is another shape, and opmap counts no bytes / FLOPs of one "
                                  f"{op} call to scale it"}

    def roof(flops, nbytes):
        return max(nbytes / (c["read_tbps"] * 1e6), flops / (c["bf16_tflops"] * 1e6))  # us

    ratio = roof(*w) / roof(r.get("flops") or 0.0, r["bytes"])
    if not 1 / SCALE_LIMIT <= ratio <= SCALE_LIMIT:
        return {"us": None, "why": f"the nearest case's roofline time is {1 / ratio:.3g}x this call's: too far to "
                                  "scale"}
    us = r["median_us"] * ratio
    how = "measured at this shape" if abs(ratio - 1) < 1e-9 else f"scaled by {ratio:.3g}x from {r['median_us']:.1f} us"
    return {"us": us, "how": how}


def describe(r: Optional[dict], s: Optional[dict] = None) -> str:
    """A baseline row (and its scaled time ``s``, from ``scaled``) in words."""
    if r is None:
        return "no baseline row for this backend"
    where = f"`{r['case']}` ({r['provider']}; {r['file']}, commit {r['commit']})"
    if s is None:
        return f"{r['median_us']:.1f} us at {where}"
    if s["us"] is None:
        return f"not estimated: {s['why']} ({r['median_us']:.1f} us at {where})"
    return f"{s['us']:.1f} us ({s['how']} at {where})"
