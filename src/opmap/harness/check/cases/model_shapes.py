"""Check cases at the model's own shapes: every operator of the model's prefill and decode step
whose selected backend is not the reference, run at that operator's widths (hidden size, heads,
head dim, page size, intermediate size, experts, vocabulary) against the fp32 reference on the
same inputs. They come from `opmap check --model` and `opmap report` (runner.check), not from a
family's fixed grid; on a CPU the selected backends are the references and none is made."""
from __future__ import annotations

import torch

from opmap.core import registry
from opmap.core.tolerance import compare
from opmap.harness.check.base import CheckCase, Outcome
from opmap.harness.check.cases.gemm import DEFAULT_TILES
from opmap.harness.fixtures.attention import make_paged, make_query
from opmap.ops.rope.reference import cos_sin_cache

_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ROWS = {"decode": 5, "prefill": 37, "mixed": 37}  # rows of a step (tokens), odd on purpose


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _t(shape, dt, dev, seed, scale=1.0):
    return (torch.randn(shape, generator=_gen(seed)) * scale).to(dev, dt)


def _inputs(op, spec, cfg, dev, phase, entry=None):
    """(entry, kwargs builder) of one operator at its spec's shapes, or None where not covered;
    ``entry``: the function the step calls, where it is not the op's plain one (linear_act)."""
    dt = _DT.get(getattr(spec, "dtype", "bf16"), torch.bfloat16)
    R = ROWS[phase]
    if op == "rmsnorm":
        H = spec.hidden
        if spec.fused_add:
            return "add_rmsnorm", lambda: dict(x=_t((R, H), dt, dev, 1), residual=_t((R, H), dt, dev, 2),
                                               weight=_t((H,), dt, dev, 3, 0.1) + 1, eps=cfg.rms_eps)
        return "rmsnorm", lambda: dict(x=_t((R, H), dt, dev, 1), weight=_t((H,), dt, dev, 3, 0.1) + 1, eps=cfg.rms_eps)
    if op == "activation":
        return spec.kind, lambda: dict(x=_t((R, 2 * spec.hidden), dt, dev, 4))
    if op == "gemm":
        if spec.weight_dtype != spec.dtype:
            return None  # quantised weights: the quantisation gates check those
        m = spec.m or R
        def build():
            a = dict(x=_t((m, spec.k), dt, dev, 5), w=_t((spec.n, spec.k), dt, dev, 6, spec.k ** -0.5),
                     bias=_t((spec.n,), dt, dev, 7) if spec.bias else None)
            if entry == "linear_act":  # the gate/up GEMM with the model's gated activation in its epilogue
                a["act"] = cfg.activation
            elif entry == "linear_add":  # the shared expert's down GEMM with the routed output as addend
                a["add"] = _t((m, spec.n), dt, dev, 11)
            return a

        return (entry if entry in ("linear_act", "linear_add") else "linear"), build
    if op == "rope":
        D, heads, kv = spec.head_dim, cfg.heads, (1 if cfg.is_mla else cfg.kv_heads)
        return "rope", lambda: dict(q=_t((R, heads, D), dt, dev, 8), k=_t((R, kv, D), dt, dev, 9),
                                    positions=torch.randint(0, 4000, (R,), generator=_gen(10)).to(dev),
                                    cos_sin=cos_sin_cache(spec.rotary_dim or D, 4096, cfg.rope_theta, cfg.rope_scaling,
                                                          device=dev), style=spec.style)
    if op == "attention" and spec.kind != "mla" and phase in ("decode", "prefill"):
        lens = [37, 300, 1] if phase == "decode" else [40, 85]
        q_lens = [1] * len(lens) if phase == "decode" else [40, 17]
        win = cfg.window_of(0) if spec.sliding_window else None

        def build():
            pc = make_paged(lens, spec.num_kv_heads, spec.head_dim, spec.page_size, dtype=dt, device=dev,
                            generator=_gen(11))
            q, cu = make_query(q_lens, spec.num_heads, spec.head_dim, dtype=dt, device=dev, generator=_gen(12))
            kw = dict(q=q, k_cache=pc.k_cache, v_cache=pc.v_cache, seq_lens=pc.seq_lens, block_tables=pc.block_tables,
                      scale=spec.head_dim ** -0.5, window=win, soft_cap=cfg.attn_soft_cap)
            if phase == "prefill":
                kw["cu_seqlens_q"] = cu
            return kw
        return phase, build
    if op == "sampling":
        V = spec.vocab
        return "sample", lambda: dict(logits=_t((4, V), torch.float32, dev, 13, 3.0),
                                      temperature=torch.zeros(4, device=dev),
                                      top_k=torch.zeros(4, dtype=torch.int32, device=dev),
                                      top_p=torch.ones(4, device=dev), min_p=torch.zeros(4, device=dev),
                                      seeds=torch.arange(4, device=dev), positions=torch.arange(4, device=dev))
    if op == "moe":
        E, H, Im = spec.num_experts, spec.hidden, spec.intermediate
        return "moe", lambda: dict(x=_t((R, H), dt, dev, 14), router_logits=_t((R, E), torch.float32, dev, 15),
                                   w13=_t((E, 2 * Im, H), dt, dev, 16, H ** -0.5), w2=_t((E, H, Im), dt, dev, 17, Im ** -0.5),
                                   top_k=spec.top_k, router="sigmoid" if spec.router == "sigmoid_grouped" else "softmax",
                                   renormalize=cfg.norm_topk_prob, n_group=cfg.n_group, topk_group=cfg.topk_group,
                                   routed_scaling=cfg.routed_scaling,
                                   score_bias=_t((E,), torch.float32, dev, 18, 0.1) if cfg.router_bias else None)
    return None


def _case(op, backend, entry, build, dt):
    def run():
        ref_name = "mla-reference" if backend.startswith("mla-") else "reference"
        ours, ref = registry.get(op, backend).fn(entry), registry.get(op, ref_name).fn(entry)
        a, b = build(), build()
        if op == "gemm" and backend in DEFAULT_TILES:  # no autotuning: a few compiles a shape
            got = ours(**a, config=DEFAULT_TILES[backend])
        else:
            got = ours(**a)
        want = ref(**b)
        if op == "rope":  # in place on q, k
            got, want = (a["q"], a["k"]), (b["q"], b["k"])
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        if op == "sampling":
            same = bool(torch.equal(got[0].cpu(), want[0].cpu()))
            return Outcome(same, f"greedy tokens {'equal' if same else 'differ from'} the reference's", float(same), 1.0)
        errs = [compare(g, w, dt, scale=2.0) for g, w in zip(got, want) if g.is_floating_point()]
        worst = max(errs, key=lambda e: e.worst_ratio)
        return Outcome(all(e.ok for e in errs), str(worst), worst.worst_ratio, 1.0)

    return run


def cases(cfg, choices, device: str) -> list:
    """One case per distinct (op, spec, backend) of the model's step maps whose backend is not a
    reference, a spec that differs only in its phase counted once (e.g. the LM head at one row in
    prefill and decode). ``choices``: (phase, op, label, Choice or None, error[, entry]) as
    runner.model_targets gives."""
    out, seen = [], set()
    for phase, op, label, ch, _, *entry in choices:
        if ch is None or "reference" in ch.name:
            continue
        entry = entry[0] if entry else None
        spec = ch.spec if op == "attention" else ch.spec.replace(phase="decode")  # attention's entry is its phase
        key = (op, spec, ch.name, getattr(ch.spec, "m", None) or ROWS[phase], entry)  # the rows its inputs get
        if key in seen:
            continue
        seen.add(key)
        made = _inputs(op, ch.spec, cfg, device, phase, entry)
        if made is None or made[0] not in registry.get(op, ch.name).impl:
            continue
        entry, build = made
        dt = _DT.get(getattr(ch.spec, "dtype", "bf16"), torch.bfloat16)
        out.append(CheckCase("parity", op, ch.name, f"model={cfg.name},{label} [{phase}],{ch.spec.describe()}",
                             _case(op, ch.name, entry, build, dt), device=device, tags=("model-shapes",)))
    return out
