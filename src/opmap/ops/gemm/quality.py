"""Quality of weight-only quantisation, measured two ways (used by check cases and tests):

- ``output_cosine``: cosine similarity of one linear layer's output, quantised weights through
  a given backend vs the fp32 reference on the unquantised weights.
- ``stack_kl``: mean KL(p_ref || p_quant) of the next-token distribution at the end of a small
  random-weight pre-norm stack (layers of RMSNorm -> up GEMM -> SiLU-and-mul -> down GEMM +
  residual, then a final norm and an LM head), every GEMM quantised, vs the same stack in
  fp32 with the original weights. Weights are drawn N(0, 1/K) so activations stay O(1); the LM
  head is scaled so that logits have a standard deviation of about 3 (a peaked, LM-like
  distribution: a uniform one would hide errors).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .quant import quantize_weight

Linear = Callable[..., torch.Tensor]  # linear(x, w, bias=None, w_scale=None)


def _fp32_linear(x, w, bias=None, w_scale=None):
    wf = w.float() if w_scale is None else w.float() * w_scale[:, None]
    return (x.float() @ wf.t()).to(x.dtype)


def output_cosine(linear: Linear, fmt: str, M: int, N: int, K: int, dtype=torch.bfloat16, device="cpu",
                  seed: int = 0) -> float:
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(device)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    ref = x.float() @ w.float().t()
    wq, s = quantize_weight(w, fmt)
    out = linear(x, wq, None, s)
    return float(torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0))


def _rms(x, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def stack_kl(linear: Linear, fmt: Optional[str], *, tokens: int = 16, hidden: int = 256, inter: int = 512,
             vocab: int = 1000, layers: int = 4, dtype=torch.bfloat16, device="cpu", seed: int = 0) -> dict:
    """Returns {"kl_mean", "kl_max", "top1_agree"} for ``fmt`` in (None = unquantised, "fp8", "int8")."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    ws = []
    for _ in range(layers):
        ws.append((rnd(2 * inter, hidden, scale=hidden ** -0.5), rnd(hidden, inter, scale=inter ** -0.5)))
    head = rnd(vocab, hidden, scale=3.0 * hidden ** -0.5)
    x0 = rnd(tokens, hidden)

    def run(lin, prep, act_dtype):
        h = x0.to(act_dtype)
        for w13, w2 in ws:
            a = lin(_rms(h), *prep(w13))
            gate, up = a.float().chunk(2, dim=-1)
            a = (torch.nn.functional.silu(gate) * up).to(act_dtype)
            h = (h.float() + lin(a, *prep(w2)).float()).to(act_dtype)
        return lin(_rms(h), *prep(head)).float()

    ref = run(_fp32_linear, lambda w: (w.float(), None, None), torch.float32)
    if fmt is None:
        out = run(linear, lambda w: (w.to(dtype), None, None), dtype)
    else:
        def prep(w):
            wq, s = quantize_weight(w.to(dtype), fmt)
            return wq, None, s

        out = run(linear, prep, dtype)
    lp_ref = torch.log_softmax(ref.double(), -1)
    lp = torch.log_softmax(out.double(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agree": float((ref.argmax(-1) == out.argmax(-1)).double().mean())}
