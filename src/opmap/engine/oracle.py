"""Parity of a bf16 engine run against an fp32 oracle, for tests on a GPU and the CPU.

Comparing bf16 greedy tokens with HF transformers' bf16 greedy tokens fails on any random model
deep enough: random weights give logits whose top-2 gaps are often a few hundredths, and two
bf16 implementations of 32 layers differ by more than that (on the H200 the first run diverged
at generated position 3 with an HF top-2 gap of 0.22). The same model at real Llama-3-8B widths
(2 layers) agrees with HF to ~1e-5 relative in fp32, so the discrepancy is bf16 rounding, not a
bug.

The principled oracle is the same weights computed in fp32, teacher-forced on the engine's own
tokens. At every generated position it gives the exact logits ``L32``; HF's bf16 model on the
same tokens gives ``Lhf`` and so measures what bf16 noise is at this model and position,
``err_hf = max |Lhf - L32|``. The engine passes when its own logits are no noisier than a small
multiple of HF's (``err_ours <= k * err_hf``) and every token it chose is within bf16 noise of
the oracle's best (``L32.max() - L32[token] <= 2 * k * err_hf``: an implementation whose logits
are within ``e`` of the truth can pick a token at most ``2e`` below the best).

HF's error at one position is a single draw of bf16 noise, so a ratio taken position by
position fails whenever HF is lucky at a position where we are not: on the H200 a 12-layer
Qwen3-30B-A3B prompt had our max error 0.087 against HF's 0.094 and identical tokens, yet one
position at 2.3x HF's error there (2.2x HF's median error). The logit criterion therefore compares
the two runs' error distributions over the prompt: our largest error within ``k`` times HF's
largest (an outlier of ours larger than bf16's own outliers) and our median within ``k`` times
HF's median (an error all along the sequence). The token rule takes HF's error at the position or
its median, whichever is larger, as the noise there.

A test's prompts are pooled (``pool``) before the verdict: in an MoE model a router near a tie
sends a token to another expert under either implementation's rounding, an error of several
logits at that one position. On the H200 a 4-layer Mixtral gave HF bf16 a 3.12 outlier on one
prompt and the engine a 3.73 outlier on the other, with medians 0.18-0.39 everywhere: each prompt's
max is one draw of a rare event, and comparing maxima over all positions of all prompts (ours
3.73 against HF's 3.12) is the stable form of the same rule.
"""
from __future__ import annotations

from typing import Optional

import torch

from opmap.engine.params import SamplingParams


def generate_with_logits(llm, prompt: list, params) -> tuple:
    """(RequestOutput, fp32 logits [new tokens, vocab]) of one prompt: the rows the engine
    sampled from, copied as they come out (a replayed CUDA graph reuses its output buffer)."""
    rows = []
    run = llm.runner.run

    def capture(batch, **kw):
        out = run(batch, **kw)
        if out is not None:
            rows.append(out[0].detach().float().clone())
        return out

    llm.runner.run = capture
    try:
        out = llm.generate([prompt], params)[0]
    finally:
        llm.runner.__dict__.pop("run", None)  # back to the class's method
    return out, torch.stack(rows)


@torch.no_grad()
def compare(llm, hf_low, hf32, prompt: list, n_new: int, hf_tokens: Optional[list] = None) -> dict:
    """Figures of one prompt (see the module docstring). ``hf_low`` and ``hf32`` are HF models
    with the same weights in the engine's dtype and in fp32; ``hf_tokens``: HF's own greedy
    tokens, to report where they first differ from the engine's."""
    out, ours = generate_with_logits(llm, prompt, SamplingParams(max_tokens=n_new, temperature=0.0,
                                                                 ignore_eos=True))
    toks = out.token_ids
    dev = next(hf32.parameters()).device
    ids = torch.tensor([prompt + toks[:-1]], device=dev)
    sl = slice(len(prompt) - 1, len(prompt) - 1 + len(toks))
    l32 = hf32(ids).logits[0, sl].float()
    lhf = hf_low(ids).logits[0, sl].float()
    ours = ours.to(dev)
    best = l32.max(-1).values
    top2 = l32.topk(2, -1).values
    pick = torch.tensor(toks, device=dev)
    d = {
        "tokens": toks,
        "err_ours": (ours - l32).abs().amax(-1).tolist(),
        "err_hf": (lhf - l32).abs().amax(-1).tolist(),
        "deficit_ours": (best - l32.gather(-1, pick[:, None])[:, 0]).tolist(),
        "deficit_hf": (best - l32.gather(-1, lhf.argmax(-1, keepdim=True))[:, 0]).tolist(),
        "gap32": (top2[:, 0] - top2[:, 1]).tolist(),
        "self_consistent": ours.argmax(-1).tolist() == toks,  # greedy picked the max of its own logits
    }
    if hf_tokens is not None:
        d["first_diff_vs_hf"] = next((i for i, (a, b) in enumerate(zip(toks, hf_tokens)) if a != b), None)
    return d


_POSITIONAL = ("tokens", "err_ours", "err_hf", "deficit_ours", "deficit_hf", "gap32")


def pool(ds: list) -> dict:
    """The figures of several prompts' ``compare`` as one sequence of positions, for one verdict."""
    if not ds:
        raise ValueError("pool: no prompts' figures given")
    out = {key: [x for d in ds for x in d[key]] for key in _POSITIONAL}
    out["self_consistent"] = all(d["self_consistent"] for d in ds)
    return out


def _median(xs: list) -> float:
    return sorted(xs)[(len(xs) - 1) // 2]  # the lower median


def verdict(d: dict, k: float = 2.0) -> tuple:
    """(passed, one-line summary) of ``compare``'s figures with noise multiple ``k``."""
    n = len(d["tokens"])
    floor = max(_median(d["err_hf"]), 1e-6)
    ratio_max = max(d["err_ours"]) / max(max(d["err_hf"]), 1e-6)
    ratio_med = _median(d["err_ours"]) / floor
    worst_err = max(ratio_max, ratio_med)
    bad = [i for i in range(n) if d["deficit_ours"][i] > 2 * k * max(d["err_hf"][i], floor) + 1e-6]
    ok = d["self_consistent"] and worst_err <= k and not bad
    fd = d.get("first_diff_vs_hf")
    line = (f"{n} tokens; logit error vs fp32 oracle: ours max {max(d['err_ours']):.4f}, HF bf16 max "
            f"{max(d['err_hf']):.4f}, ratio {ratio_max:.2f}; median ours {_median(d['err_ours']):.4f}, HF {floor:.4f}, "
            f"ratio {ratio_med:.2f} (limit {k}); largest deficit of our token "
            f"{max(d['deficit_ours']):.4f} (HF bf16's own: {max(d['deficit_hf']):.4f})"
            + (f"; positions over 2k*err_hf: {bad}" if bad else "")
            + ("" if "first_diff_vs_hf" not in d else
               f"; first difference from HF bf16 greedy: {'none' if fd is None else fd}"
               + ("" if fd is None else f" (fp32 top-2 gap there {d['gap32'][fd]:.4f})")))
    return ok, line
