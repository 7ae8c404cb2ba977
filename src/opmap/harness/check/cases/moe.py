"""MoE check cases: every runnable MoE backend against the fp32 reference (and the reference
against HF transformers' MixtralSparseMoeBlock), boundaries (an expert with no token, every
token on one expert, one token, top_k == experts, past the one-launch routing of ours), quantised
experts (int4 with and without zero points, block fp8) against the reference on the dequantised
experts, bad input, CUDA-graph replay of ours."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opmap.core import hw, registry
from opmap.core.specs import MoESpec
from opmap.core.tolerance import compare
from opmap.harness.check.base import CheckCase, Outcome, probe_errors, racecheck_child
from opmap.ops.moe import reference

_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _inputs(device, T, H, I, E, dtype, seed=0, hot=None, cold=None):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(device, dtype)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    logits = torch.randn(T, E, generator=g)
    if cold is not None:
        logits[:, cold] = -1e4  # this expert receives no token
    if hot is not None:
        logits[:, hot] += 100.0  # this expert is in every token's top-k
    return x, logits.to(device), w13, w2


def _outcome(out, want, dtype) -> Outcome:
    e = compare(out, want, dtype, scale=2)
    return Outcome(e.ok, str(e), e.worst_ratio, 1.0)


def _parity(backend, device, T, H, I, E, k, dtype, race_T=None, **kw):
    """``race_T``: the tokens to run under racecheck (see racecheck_child): the Qwen3-30B-A3B
    shapes at T=64 did not finish racecheck within the sanitizer's time limit."""
    def run():
        t = race_T if race_T is not None and racecheck_child() else T
        route_kw = dict(kw)
        x, logits, w13, w2 = _inputs(device, t, H, I, E, dtype, seed=T, hot=route_kw.pop("hot", None),
                                     cold=route_kw.pop("cold", None))
        out = registry.get("moe", backend)("moe", x, logits, w13, w2, k, **route_kw)
        want = reference.moe(x.float(), logits, w13.float(), w2.float(), k, **route_kw)
        o = _outcome(out, want, dtype)
        if t != T:
            o.figure = f"racecheck run at T={t}: {o.figure}"
        return o

    return run


def _quantised(backend, device, T, H, I, E, k, dtype, fmt, span, zp=False):
    """Experts quantised per expert (int4: a scale per ``span`` input channels, zero points where
    ``zp``; fp8-block: ``span`` x ``span`` blocks) against the reference on them."""
    def run():
        x, logits, w13, w2 = _inputs(device, T, H, I, E, torch.float32, seed=T + span)
        q = {}
        for name, w in (("w13", w13), ("w2", w2)):
            q[name], q[f"{name}_scale"], zero = reference.quantize_experts(w, fmt, span, zp)
            if zero is not None:
                q[f"{name}_zero"] = zero
        w13q, w2q = q.pop("w13"), q.pop("w2")
        xd = x.to(dtype)
        out = registry.get("moe", backend)("moe", xd, logits, w13q, w2q, k, **q)
        return _outcome(out, reference.moe(xd, logits, w13q, w2q, k, **q), dtype)

    return run


def _vs_hf_mixtral(device):
    def run():
        # transformers: optional and heavy, imported only where this case runs
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # the same optional package

        block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=64, intermediate_size=96, num_local_experts=8,
                                                    num_experts_per_tok=2)).eval().to(device)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.1)
            x = torch.randn(1, 19, 64, device=device)
            want = block(x)[0]
            logits = F.linear(x[0], block.gate.weight)
            out = reference.moe(x[0], logits, block.experts.gate_up_proj, block.experts.down_proj, 2)
        return _outcome(out, want, torch.float32)

    return run


def _bad_input(backend, device):
    def run():
        fn = registry.get("moe", backend).fn("moe")
        x, logits, w13, w2 = _inputs(device, 3, 16, 8, 4, torch.float32)
        probes = {"top_k": lambda: fn(x, logits, w13, w2, 5),
                  "w13": lambda: fn(x[:, :15].contiguous(), logits, w13, w2, 2),
                  "router_logits": lambda: fn(x, logits[:2], w13, w2, 2),
                  "w2": lambda: fn(x, logits, w13, w2[:, :, :7], 2)}
        return probe_errors(probes)

    return run


def _graph_replay(device, backend="triton"):
    def run():
        moe = registry.get("moe", backend).fn("moe")
        x, logits, w13, w2 = _inputs(device, 48, 256, 128, 16, torch.bfloat16)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            moe(x, logits, w13, w2, 4)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = moe(x, logits, w13, w2, 4)
        x2, l2, _, _ = _inputs(device, 48, 256, 128, 16, torch.bfloat16, seed=7, hot=2)
        x.copy_(x2)
        logits.copy_(l2)
        g.replay()
        torch.cuda.synchronize()
        return _outcome(out, reference.moe(x.float(), logits, w13.float(), w2.float(), 4), torch.bfloat16)

    return run


def _runnable(name: str, spec: MoESpec) -> bool:
    b = registry.get("moe", name)
    return not b.validate(spec, runtime=True)


def cases(device: str, quick: bool) -> list[CheckCase]:
    arch = "cpu" if device == "cpu" else hw.local_arch()
    dtypes = ("fp32", "fp16") if device == "cpu" else ("bf16",)
    small = dict(T=17, H=48, I=40, E=8, k=2)
    out = []
    out.append(CheckCase("parity", "moe", "reference", "vs HF MixtralSparseMoeBlock,T=19,H=64,I=96,E=8,k=2",
                         _vs_hf_mixtral(device), tags=("moe",)))
    for name in ("triton", "triton-tma", "torch-grouped-mm", "torch-loop"):
        for dt in dtypes:
            spec = MoESpec(arch=arch, dtype=dt, weight_dtype=dt, hidden=48, intermediate=40)
            if not _runnable(name, spec):
                continue
            d = _DT[dt]
            shape = ",".join(f"{k}={v}" for k, v in small.items()) + f",dtype={dt}"
            out.append(CheckCase("parity", "moe", name, shape, _parity(name, device, **small, dtype=d),
                                 tags=("moe",)))
            if _runnable(name, spec.replace(hidden=32, intermediate=24)):
                out.append(CheckCase("parity", "moe", name, f"deepseek-v3 routing,T=9,E=16,k=4,dtype={dt}",
                                     _parity(name, device, 9, 32, 24, 16, 4, d, router="sigmoid", n_group=4,
                                             topk_group=2, routed_scaling=2.5), tags=("moe",)))
            bnd = [("T=1,k=2", dict(T=1, H=32, I=24, E=8, k=2)),
                   ("expert with no token,T=64", dict(T=64, H=32, I=16, E=8, k=2, cold=3)),
                   ("all tokens on one expert,T=40", dict(T=40, H=32, I=16, E=4, k=1, hot=1)),
                   ("top_k == experts,T=3", dict(T=3, H=40, I=20, E=4, k=4)),
                   # ours routes and aligns in one launch up to 64 tokens, in two above
                   ("past the one-launch routing,T=65", dict(T=65, H=32, I=16, E=8, k=2))]
            for label, kw in bnd:
                if not _runnable(name, spec.replace(hidden=kw["H"], intermediate=kw["I"])):
                    continue
                out.append(CheckCase("boundaries", "moe", name, f"{label},dtype={dt}",
                                     _parity(name, device, dtype=d, **kw), tags=("moe",)))

    # Quantised experts: CPU sizes small, GPU sizes Qwen3-30B-A3B's experts and DeepSeek-V3's blocks
    qdt, qname = (torch.float16, "fp16") if device == "cpu" else (torch.bfloat16, "bf16")
    qcases = [("int4", 32, False, dict(T=5, H=128, I=64, E=8, k=2)), ("int4", 16, True, dict(T=33, H=96, I=48, E=4, k=2)),
              ("fp8-block", 32, False, dict(T=7, H=160, I=64, E=4, k=2))] if device == "cpu" else \
        [("int4", 128, False, dict(T=64, H=2048, I=768, E=128, k=8)), ("int4", 128, True, dict(T=300, H=2048, I=768, E=128, k=8)),
         ("fp8-block", 128, False, dict(T=64, H=2048, I=768, E=64, k=6)), ("fp8-block", 128, False, dict(T=1000, H=2048, I=768, E=64, k=6))]
    for name in ("triton", "dequant-triton"):
        for fmt, span, zp, kw in qcases:
            spec = MoESpec(arch=arch, dtype=qname, weight_dtype=fmt, hidden=kw["H"], intermediate=kw["I"],
                           num_experts=kw["E"], top_k=kw["k"], group_size=span)
            if _runnable(name, spec):
                shape = ",".join(f"{a}={v}" for a, v in kw.items())
                out.append(CheckCase("parity", "moe", name, f"{fmt} experts{'-zp' * zp},span={span},{shape},dtype={qname}",
                                     _quantised(name, device, dtype=qdt, fmt=fmt, span=span, zp=zp, **kw),
                                     quick=kw["T"] < 100, tags=("moe",)))
    # Errors are raised before anything launches, so every registered backend is probed.
    for name in ("reference", "triton", "triton-tma", "dequant-triton", "torch-grouped-mm", "torch-loop"):
        out.append(CheckCase("input", "moe", name, "top_k > E, hidden mismatch, wrong shapes",
                             _bad_input(name, device), tags=("moe",)))
    if device == "cuda":
        for name in ("triton", "triton-tma"):
            if _runnable(name, MoESpec(arch=arch, hidden=256, intermediate=128)):
                out.append(CheckCase("graph", "moe", name, "CUDA-graph replay with new routing,T=48,E=16,k=4",
                                     _graph_replay(device, name), device="cuda", tags=("moe",)))
        real = MoESpec(arch=arch, num_experts=128, top_k=8, hidden=2048, intermediate=768)
        for name in ("triton", "triton-tma", "torch-grouped-mm", "torch-loop"):
            if _runnable(name, real):
                out.append(CheckCase("parity", "moe", name, "qwen3-30b-a3b shapes,T=64,dtype=bf16",
                                     _parity(name, device, 64, 2048, 768, 128, 8, torch.bfloat16, race_T=8),
                                     quick=False, tags=("moe",)))
    return out

