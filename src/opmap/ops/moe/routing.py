"""MoE routing (the ``route`` entry) and the input checks every MoE backend shares.

Routing is a few small fp32 ops on a [T, E] tensor; every backend uses this one function so
that all of them select the same experts (a different top-k at a near-tie would otherwise be
reported as a numerical error of the expert GEMMs).

Routers (``router=``):
- ``"softmax"``: scores = softmax(logits). Mixtral / Qwen-MoE (renormalize=True) and
  DeepSeek-V2 (renormalize=False, optional ``routed_scaling``). With ``n_group > 1`` the
  DeepSeek-V2 "group_limited_greedy" rule: a group's score is its best expert's score, only
  the ``topk_group`` best groups are eligible.
- ``"sigmoid"`` (alias ``"sigmoid_grouped"``, the MoESpec name): DeepSeek-V3. scores =
  sigmoid(logits); experts are *chosen* on scores + ``score_bias`` (the load-balancing
  correction, e_score_correction_bias), a group's score is the sum of its two best biased
  scores; the *weights* are the unbiased scores of the chosen experts.
Then: optional renormalisation (w / (sum w + 1e-20), as HF DeepSeek-V3; the epsilon is below
one ulp of any softmax / sigmoid top-k sum) and multiplication by ``routed_scaling``.
"""
from __future__ import annotations

from typing import Optional

import torch

from opmap.core.contract import expect, expect_in, expect_same_device, expect_tensor
from opmap.ops.gemm.quant import block_of

ROUTERS = ("softmax", "sigmoid", "sigmoid_grouped")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_top_k(router_logits, top_k) -> tuple[int, int]:
    """The router logits [T, E] and ``top_k`` in [1, E] (the public op checks them before they
    make its spec); returns (T, E)."""
    expect_tensor("router_logits", router_logits, dtype=FLOAT_DTYPES, ndim=2)
    T, E = router_logits.shape
    expect(E >= 1, "router_logits", f"shape {tuple(router_logits.shape)}", "at least one expert")
    expect(isinstance(top_k, int) and not isinstance(top_k, bool), "top_k", repr(top_k), "an int")
    expect(1 <= top_k <= E, "top_k", top_k, f"1 <= top_k <= num_experts={E}")
    return T, E


def check_route_args(router_logits, top_k, router, n_group, topk_group, score_bias) -> tuple[int, int]:
    """Validate the routing arguments; returns (T, E)."""
    T, E = check_top_k(router_logits, top_k)
    expect_in("router", router, ROUTERS)
    expect(isinstance(n_group, int) and n_group >= 1 and E % n_group == 0, "n_group", n_group,
           f"a positive divisor of num_experts={E}")
    expect(isinstance(topk_group, int) and 1 <= topk_group <= n_group, "topk_group", topk_group,
           f"1 <= topk_group <= n_group={n_group}")
    eligible = topk_group * (E // n_group)
    expect(top_k <= eligible, "top_k", top_k,
           f"<= topk_group * experts per group = {eligible} (experts eligible after group selection)")
    if score_bias is not None:
        expect_tensor("score_bias", score_bias, dtype=FLOAT_DTYPES, shape=(E,))
        expect_same_device(router_logits=router_logits, score_bias=score_bias)
    return T, E


INT4 = torch.int32  # eight 4-bit codes a word along K (opmap.ops.gemm.quant's layout)
FP8 = torch.float8_e4m3fn
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def expert_format(w13) -> Optional[str]:
    """None (weights in x's dtype), "int4" or "fp8-block", from the expert weights' dtype."""
    return {INT4: "int4", FP8: "fp8-block"}.get(getattr(w13, "dtype", None))


def _check_scales(name, w, rows, k, scale, zero, fmt):
    """A quantised expert matrix [E, rows, k] (int4: words [E, rows, k / 8]) and its scale; returns the
    group size (int4) or block edge (fp8-block)."""
    E = w.shape[0]
    sname = f"{name}_scale"
    expect(scale is not None, sname, "None", f"the scales of the {fmt} expert weights {name}")
    if fmt == "int4":
        expect_tensor(sname, scale, dtype=SCALE_DTYPES, ndim=3, contiguous=True)
        groups = scale.shape[2]
        expect(tuple(scale.shape[:2]) == (E, rows) and groups > 0 and k % groups == 0, sname,
               f"shape {tuple(scale.shape)}", f"({E}, {rows}, {k} / group_size), the group size dividing {k}")
        g = k // groups
        expect(g % 16 == 0, sname, f"group size {g}", "a multiple of 16 (a K tile inside one group)")
        if zero is not None:
            expect_tensor(f"{name}_zero", zero, dtype=(torch.uint8,), shape=tuple(scale.shape), contiguous=True)
        return g
    expect(zero is None, f"{name}_zero", "a tensor", "None (zero points are for int4 experts)")
    expect_tensor(sname, scale, dtype=(torch.float32,), ndim=3, contiguous=True)
    b = block_of(rows, k, scale[0]) if scale.shape[0] == E else 0
    expect(b > 0, sname, f"shape {tuple(scale.shape)}",
           f"one fp32 scale per b x b block: ({E}, ceil({rows} / b), ceil({k} / b)), b a power of two >= 16")
    return b


def check_moe_args(x, router_logits, w13, w2, top_k, router, n_group, topk_group, score_bias,
                   w13_scale=None, w2_scale=None, w13_zero=None, w2_zero=None) -> tuple:
    """Validate the ``moe`` entry's inputs (shared by every backend); returns (T, H, E, I).

    Expert weights are in x's dtype, or quantised with their scales: int4 (``w13`` int32
    [E, 2I, H / 8], ``w13_scale`` [E, 2I, H / G], optional uint8 ``w13_zero`` of the scale's shape;
    ``w2`` [E, H, I / 8] likewise) or block fp8 (e4m3 ``w13`` [E, 2I, H] with fp32
    ``w13_scale`` [E, ceil(2I / b), ceil(H / b)], ``w2`` alike; I a multiple of b, so that no
    block holds both gate and up rows)."""
    expect_tensor("x", x, dtype=FLOAT_DTYPES, ndim=2, last_dim_contiguous=True)
    T, H = x.shape
    fmt = expert_format(w13)
    packed = 8 if fmt == "int4" else 1
    expect_tensor("w13", w13, dtype=(x.dtype, INT4, FP8), ndim=3)
    E, two_i, H13 = w13.shape
    expect(H13 * packed == H, "w13", f"shape {tuple(w13.shape)}",
           f"(E, 2I, {H}{' / 8' if packed > 1 else ''}) (H={H}: hidden size of x)")
    expect(two_i >= 2 and two_i % 2 == 0, "w13", f"shape {tuple(w13.shape)}",
           "an even, non-zero second dimension 2I (gate rows then up rows)")
    inter = two_i // 2
    expect(inter % packed == 0, "w13", f"shape {tuple(w13.shape)}", "I a multiple of 8 for int4 experts")
    expect_tensor("w2", w2, dtype=(w13.dtype,), shape=(E, H, inter // packed))
    if fmt is None:
        for name, t in (("w13_scale", w13_scale), ("w2_scale", w2_scale), ("w13_zero", w13_zero),
                        ("w2_zero", w2_zero)):
            expect(t is None, name, "a tensor", f"None for experts in {x.dtype} (unquantised)")
    else:
        span = _check_scales("w13", w13, two_i, H, w13_scale, w13_zero, fmt)
        _check_scales("w2", w2, H, inter, w2_scale, w2_zero, fmt)
        expect(fmt == "int4" or inter % span == 0, "w13_scale", f"block edge {span}",
               f"a divisor of I={inter} (a block holding gate and up rows has no one scale)")
        expect_same_device(x=x, w13_scale=w13_scale, w2_scale=w2_scale, w13_zero=w13_zero, w2_zero=w2_zero)
    expect_tensor("router_logits", router_logits, dtype=FLOAT_DTYPES, shape=(T, E))
    expect_same_device(x=x, router_logits=router_logits, w13=w13, w2=w2)
    check_route_args(router_logits, top_k, router, n_group, topk_group, score_bias)
    return T, H, E, inter


def route(router_logits: torch.Tensor, top_k: int, *, router: str = "softmax", renormalize: bool = True,
          n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
          score_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (topk_weights [T, k] fp32, topk_ids [T, k] int32). No host synchronisation."""
    T, E = check_route_args(router_logits, top_k, router, n_group, topk_group, score_bias)
    logits = router_logits.float()
    sigmoid = router != "softmax"
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    choice = scores if score_bias is None else scores + score_bias.float()
    if n_group > 1:
        g = choice.view(T, n_group, E // n_group)
        if sigmoid:  # DeepSeek-V3: sum of the two best (biased) scores of the group
            gscore = g.topk(min(2, E // n_group), dim=-1).values.sum(-1)
        else:  # DeepSeek-V2 group_limited_greedy: the group's best score
            gscore = g.max(dim=-1).values
        gidx = gscore.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gidx, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling != 1.0:
        weights = weights * routed_scaling
    return weights, ids.to(torch.int32)
