"""The diagnosis rules of ``opmap profile --trace``. Each names the evidence it needs and fires only
when that evidence is in the trace; time no evidence attributes feeds none of them (shares are of
the phase's GPU busy time, but only attributed categories are counted). Each line ends with the
evidence it fired on."""
from __future__ import annotations

from opmap.harness.profile.trace import Trace


def _share(p: dict, *cats) -> float:
    return sum(p["categories"].get(c, 0.0) for c in cats) / (p["gpu_ms"] or 1e-9)


def _libs(p: dict, cat: str) -> str:
    return ", ".join(p["libraries"].get(cat, {})) or "none"


def _ev(p: dict, *cats) -> str:
    """'attention by symbol 90%, launcher 10%; GEMM by launcher 100%'."""
    parts = []
    for c in cats:
        ev = p["evidence"].get(c, {})
        total = sum(ev.values())
        if total:
            parts.append(f"{c} by " + ", ".join(f"{k} {v / total:.0%}" for k, v in ev.items()))
    return "; ".join(parts)


def rules(res: dict, trace: Trace) -> list:
    out = []
    dev = "host" if trace.kind == "chrome-cpu" else "GPU"
    for ph, p in res["phases"].items():
        out += _compute(ph, p, dev) + _kv_layout(ph, p, dev) + _idle(ph, p, dev) + _communication(ph, p, dev)
        out += _sort_sampler(ph, p) + _quant_fallback(ph, p) + _moe_loop(ph, p)
    return out + _unattributed(res, trace, dev)


def _compute(ph: str, p: dict, dev: str) -> list:
    """Prefill whose GPU time is mostly attention and GEMM kernels: the compute path."""
    s = _share(p, "attention", "GEMM")
    if ph != "prefill" or s <= 0.7:
        return []
    return [f"prefill: attention + GEMM take {s:.0%} of {dev} time -> the compute path: attention "
            f"{_libs(p, 'attention')}, GEMM {_libs(p, 'GEMM')} (fusion, parallelism, a faster attention kernel) "
            f"[evidence: {_ev(p, 'attention', 'GEMM')}]"]


def _kv_layout(ph: str, p: dict, dev: str) -> list:
    """Decode whose GPU time is mostly attention: its kernels and the KV cache's copies (copies
    that evidence ties to attention: launched in an attention module or block, or a KV write).
    Weight gathers (a MoE's) and other copies are not evidence."""
    s = _share(p, "attention")
    if ph != "decode" or s <= 0.5:
        return []
    kv = p.get("kv_copy_ms", 0.0) / (p["gpu_ms"] or 1e-9)
    return [f"decode: attention takes {s:.0%} of {dev} time (its KV-cache copies {kv:.0%}) -> the KV layout, the "
            f"paged decode kernel ({_libs(p, 'attention')}), or too small a batch [evidence: {_ev(p, 'attention')}]"]


def _idle(ph: str, p: dict, dev: str) -> list:
    """A phase whose steps leave the GPU idle: the host. Graphs are named as a cause only where no
    kernel of the phase was replayed by cudaGraphLaunch; a sampler fallback only with the sort
    rule's evidence. A host-only trace (no GPU activity: its outermost ops stand for kernels) has
    no GPU to be idle and no graphs to capture: its gaps are the host's time between operators."""
    if not p["wall_ms"] or p["idle_ms"] / p["wall_ms"] <= 0.3:
        return []
    per = p["idle_ms"] / max(p["steps"], 1)
    share = p["idle_ms"] / p["wall_ms"]
    if dev == "host":
        return [f"{ph}: the host runs no operator {share:.0%} of the step time ({per:.3f} ms a step) -> Python "
                f"between operators (this trace holds no GPU activity) [evidence: the steps' wall time against "
                f"their operators' busy time]"]
    why = ["scheduling / Python on the host"]
    why.append("CUDA graphs not captured (no kernel here replayed by cudaGraphLaunch)" if not p.get("graph_ms")
               else "the host's work between graph replays")
    if _sorts(p):
        why.append("a sampler fallback (sort-based sampling where a sorting-free kernel exists)")
    return [f"{ph}: the GPU is idle {share:.0%} of the step time ({per:.3f} ms a step) "
            f"-> the host: {'; '.join(why)} [evidence: the steps' wall time against their kernels' busy time]"]


def _communication(ph: str, p: dict, dev: str) -> list:
    """Communication the phase's other kernels do not overlap (exposed): the TP / EP layout. A run
    that overlaps its collectives with compute (expert-parallel dispatch / combine under the
    experts' GEMMs) is not told to change its layout for time it does not wait."""
    exposed = p.get("comm_exposed_ms", 0.0) / (p["gpu_ms"] or 1e-9)
    if exposed <= 0.2:
        return []
    total = p.get("comm_ms", 0.0) / (p["gpu_ms"] or 1e-9)
    # the table gives time two streams share to the kernel that began first; this counts it all
    table = _share(p, "communication")
    shared = f" with its overlap ({table:.0%} in the table)" if round(total, 2) != round(table, 2) else ""
    return [f"{ph}: communication takes {total:.0%} of {dev} time{shared}, {exposed:.0%} not overlapped by compute "
            f"({_libs(p, 'communication')}) -> the TP/EP layout, not the attention kernel "
            f"[evidence: {_ev(p, 'communication')}]"]


def _sorts(p: dict) -> bool:
    return bool(p.get("sampler_sorts")) and p.get("random_steps", 0) > 0


def _sort_sampler(ph: str, p: dict) -> list:
    """A sort in the sampler stage (after the LM head) of steps that draw tokens at random: a top-k /
    top-p sampler that sorts the vocabulary. A router's top-k or a block mask's sort is not in
    that stage; a greedy run draws nothing."""
    if not _sorts(p):
        return []
    n = sum(p["sampler_sorts"].values())
    name = next(iter(p["sampler_sorts"]))
    return [f"{ph}: sampling sorts the logits ({n} sort kernels such as {name[:50]}, in {p['random_steps']} steps that "
            "draw at random) -> a sorting-free sampler (opmap's, FlashInfer's) serves top-k / top-p without it "
            "[evidence: sort kernels after the LM head, random draws in the same stage]"]


def _quant_fallback(ph: str, p: dict) -> list:
    """A dequantise kernel feeding a dense GEMM of the same layer, in steps that ran no low-precision
    GEMM: the quantised path fell back. A KV write or an activation quantiser is no dequantiser; a
    step with an fp8 / fp4 / int8 GEMM did not fall back."""
    fb = p.get("fallbacks") or []
    if not fb:
        return []
    deq, gemm = fb[0]
    n = p.get("fallback_count", len(fb))
    return [f"{ph}: the quantised path fell back to a dequantise kernel and a bf16 GEMM ({n} times, e.g. {deq} feeds "
            f"{gemm}, and no fp8 / fp4 / int8 GEMM ran in those steps) [evidence: a dequantise kernel before a dense "
            "GEMM of its layer]"]


def _moe_loop(ph: str, p: dict) -> list:
    """MoE whose expert GEMMs are launched one expert at a time (plain mm / linear under the MoE
    block, several a step) and never as a grouped or batched GEMM: a per-expert loop."""
    g = p.get("moe_gemms") or {}
    loop, steps = g.get("per-expert", 0), max(p["steps"], 1)
    if loop / steps < 8 or g.get("grouped") or g.get("batched") or g.get("fused"):
        return []
    return [f"{ph}: MoE runs a loop of per-expert GEMMs ({loop / steps:.0f} launches a step, no grouped GEMM) -> a "
            "grouped GEMM (opmap's triton MoE, a fused_moe kernel) serves all experts in one launch "
            "[evidence: GEMMs launched by mm / linear inside the MoE block]"]


def _unattributed(res: dict, trace: Trace, dev: str) -> list:
    """Not a diagnosis: how much time no evidence names, and what would name it."""
    u = res.get("unattributed", 0.0)
    if u <= 0.05:
        return []
    frames = any(r[0].startswith("nn.Module: ") for r in trace.ranges)
    how = ("add their symbols to opmap/harness/profile/symbols.json" if frames else
           "record with torch.profiler.profile(with_stack=True, record_shapes=True) for the module frames and shapes, "
           "or emit record_function ranges")
    what = "operators" if dev == "host" else "kernels"
    return [f"{u:.0%} of {dev} time is unattributed (no frame, launching op, symbol or motif names its {what}) "
            f"-> {how}; it feeds no diagnosis line"]
