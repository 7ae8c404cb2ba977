"""Each kernel's operator category, with the evidence behind it, strongest first:

1. ``range``: the host frames open at its launch (opmap's operator ranges, an engine's module
   frames and kept Python functions, record_function ranges that name an operator), or a
   library's own kernel symbol (``symbol``: a FlashInfer decode, vLLM's rms_norm, opmap's kernels
   from the registry), whichever names the operator more narrowly: a library's own kernel inside
   an attention module is still RoPE or the KV write, while a cuBLAS GEMM or a PyTorch copy
   inside a MoE block is the MoE's;
2. ``launcher``: the CPU op that launched it (``aten::_scaled_dot_product_*``, ``vllm::moe_forward``);
3. ``symbol``, generic: a GEMM is a GEMM, a copy a copy, until something narrower names them;
4. ``motif``: what only the shape of a step names: runs of launching ops that spell an operator
   (HF's RMSNorm, RoPE, unfused attention, MLA's absorbed matmuls), the blocks between two norms
   (one that routes then multiplies is a MoE block; one that holds attention owns its KV copies),
   and the sampler stage after the LM head.
What none of these names is ``unattributed``: it is reported, and feeds no diagnosis."""
from __future__ import annotations

import bisect
import functools
import re
from typing import NamedTuple

from opmap.harness.profile import ours
from opmap.harness.profile import symbols
from opmap.harness.profile.ours import OP_CATEGORY

NONE = "unattributed"
_OP_RANGE = re.compile(r"^opmap::(\w+)::")
_COPY_OPS = {"copy_", "_to_copy", "to", "contiguous", "clone"}
_CHOOSE = re.compile(r"(?i)argmax|multinomial|sampl|gumbel|exponential")
_RANDOM = re.compile(r"(?i)multinomial|exponential|SamplingFrom|gumbel|_sample_")


class Attr(NamedTuple):
    category: str
    library: str
    evidence: str  # "range" | "symbol" | "launcher" | "motif" | "none"
    final: bool  # False: a motif may still name it (a generic GEMM / copy, or nothing)


def of(k) -> Attr:
    """A kernel's attribution from what it carries alone (no motif)."""
    return _base(k.name, k.launcher, k.ranges)


@functools.lru_cache(maxsize=65536)  # one answer per (symbol, launcher, ranges): a step repeats them
def _base(name: str, launcher, ranges: tuple) -> Attr:
    sym = symbols.lookup(name)
    for r in reversed(ranges):
        m = _OP_RANGE.match(r)
        if m and m.group(1) in OP_CATEGORY:
            return Attr(OP_CATEGORY[m.group(1)], "opmap" if sym.library == "unknown" else sym.library, "range", True)
    if sym.category and not sym.generic:
        return Attr(sym.category, sym.library, "symbol", True)
    frame = _frames(ranges, sym.category == "GEMM")
    if frame:
        return Attr(frame, sym.library, "range", True)
    by_launcher = symbols.launcher_category(launcher)
    if by_launcher:
        return Attr(by_launcher, sym.library, "launcher", by_launcher not in symbols.REFINABLE)
    if sym.category:
        return Attr(sym.category, sym.library, "symbol", False)
    return Attr(NONE, sym.library, "none", False)


def _frames(ranges: tuple, gemm: bool):
    """The category the frames give a kernel its symbol leaves open: an enclosing MoE block claims
    all of it (its router, its experts' projections and activation); else the innermost frame that
    names an operator, a GEMM under a sampler frame staying a GEMM (the LM head)."""
    cats = [c for c in map(symbols.frame_category, reversed(ranges)) if c]
    if not cats:
        return None
    if "MoE" in cats:
        return "MoE"
    if gemm and cats[0] == "sampling":
        return "GEMM"
    return cats[0]


def step(kernels: list) -> list:
    """The attributions of one step's kernels (in time order), motifs applied."""
    attrs = [of(k) for k in kernels]
    if not kernels:
        return attrs
    _ambiguous(kernels, attrs)
    _spelled(kernels, attrs)
    _segments(kernels, attrs)
    _sampler(kernels, attrs)
    return attrs


def _set(attrs: list, i: int, cat: str) -> None:
    attrs[i] = Attr(cat, attrs[i].library, "motif", True)


def _ambiguous(kernels: list, attrs: list) -> None:
    """A symbol of ours that two ops share (``_combine_kernel``: split-KV decode's or MoE's) is the
    op of the kernel before it on its stream, where that is one of its candidates."""
    last: dict = {}
    for i, k in enumerate(kernels):
        cats = ours.categories(k.name) if not attrs[i].final else ()
        if len(cats) > 1 and last.get(k.stream) in cats:
            attrs[i] = Attr(last[k.stream], attrs[i].library, "motif", True)
        last[k.stream] = attrs[i].category


def _token(k, a: Attr) -> str:
    """A kernel in a motif's text: its launching op, or @<category> once evidence named it for good."""
    if a.final:
        return "@" + a.category.replace(" ", "_")
    return (k.launcher or "?").replace("aten::", "")


def _spelled(kernels: list, attrs: list) -> None:
    """The motifs of symbols.json: runs of launching ops that spell an operator; each names the
    kernels of its run that no stronger evidence named (and the GEMMs / copies it claims)."""
    idx, toks, starts, pos = [], [], [], 0
    for i, (k, a) in enumerate(zip(kernels, attrs)):
        tok = _token(k, a)
        if tok in _COPY_OPS:
            continue
        idx.append(i)
        toks.append(tok)
        starts.append(pos)
        pos += len(tok) + 1
    text = " ".join(toks) + " "
    for cat, rx, claims in symbols.motifs():
        for m in rx.finditer(text):
            lo = idx[bisect.bisect_left(starts, m.start())]
            hi = idx[bisect.bisect_left(starts, m.end()) - 1]
            for i in range(lo, hi + 1):  # the copies inside the run too (a softmax's cast back)
                a = attrs[i]
                if not a.final and a.category in (NONE, "memory copies", cat, *claims):
                    _set(attrs, i, cat)


def _is_topk(k, a: Attr) -> bool:
    return a.category == "MoE" or (k.launcher or "").endswith("::topk")


def _segments(kernels: list, attrs: list) -> None:
    """Between two norm runs of a step: a block that routes (a top-k, or a MoE kernel) and then
    runs a GEMM is a MoE block: every kernel of it no stronger evidence named, GEMMs and copies
    included. A block holding an attention kernel owns the copies copy ops launched in it (the KV
    cache's: HF's cache update is a cat)."""
    norm = [i for i, a in enumerate(attrs) if a.category == "norm"]
    bounds = [(a, b) for a, b in zip(norm, norm[1:]) if b > a + 1]
    for lo, hi in bounds:
        seg = range(lo + 1, hi)
        route = next((i for i in seg if _is_topk(kernels[i], attrs[i])), None)
        if route is not None and any(attrs[j].category in ("GEMM", "MoE") for j in range(route + 1, hi)):
            for i in seg:
                if not attrs[i].final:
                    _set(attrs, i, "MoE")
        elif any(attrs[i].category == "attention" and attrs[i].final for i in seg):
            for i in seg:  # copies a copy op launched (a fused kernel that spells cat is more likely RoPE's)
                if attrs[i].evidence == "launcher" and attrs[i].category == "memory copies":
                    _set(attrs, i, "attention")


# the top-level host operators that read a tensor's value into Python: item(), bool(tensor)
_HOST_READS = frozenset(("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero"))


def readback(k) -> bool:
    """A copy of a result to the host; on a host-only trace (its "kernels" are host operators) the
    host reading a tensor's value, item() or a stop check, where a GPU run would copy it back."""
    return ("DtoH" in k.name or "Device -> Pageable" in k.name or "Device -> Pinned" in k.name
            or k.name in _HOST_READS)


def chooses(k) -> bool:
    """A kernel that picks tokens (not the scans and reductions a sampler also runs)."""
    return bool(_CHOOSE.search(f"{k.name} {k.launcher or ''}"))


_BACKWARD = "autograd::engine::evaluate_function"  # the host op around each backward node's work


def backward(k) -> bool:
    """Work of autograd's backward pass: its node's op around the launch (or, in a host-only trace,
    the op itself)."""
    return _BACKWARD in k.name or _BACKWARD in (k.launcher or "") or any(_BACKWARD in r for r in k.ranges)


def _sampler(kernels: list, attrs: list) -> None:
    """A step's kernels after its last GEMM (the LM head) are the sampler stage when that stretch
    reads the tokens back or chooses one: those no stronger evidence named are sampling. A training
    step's stretch ends where its backward pass begins: the loss and the optimizer are no sampler."""
    last = next((i for i in range(len(kernels) - 1, -1, -1)
                 if attrs[i].category == "GEMM" and not backward(kernels[i])), None)
    if last is None:
        return
    end = next((i for i in range(last + 1, len(kernels)) if backward(kernels[i])), len(kernels))
    tail = range(last + 1, end)
    if not any(readback(kernels[i]) or chooses(kernels[i]) for i in tail):
        return
    for i in tail:
        if not attrs[i].final:
            _set(attrs, i, "sampling")


def sampler_stage(kernels: list, attrs: list) -> list:
    """Indices of the step's sampler stage: its kernels that are sampling by any evidence."""
    return [i for i, a in enumerate(attrs) if a.category == "sampling"]


def random_sampling(kernels: list, attrs: list) -> bool:
    """Whether the step draws tokens at random (multinomial, exponential draws, a sampling kernel)
    in its sampler stage, rather than taking the argmax."""
    return any(_RANDOM.search(f"{kernels[i].name} {kernels[i].launcher or ''}") for i in sampler_stage(kernels, attrs))
