"""MoE benchmark cases: Mixtral-8x7B and Qwen3-30B-A3B expert shapes at 1, 64, 512 and 4096 tokens,
bf16, routing included in every provider's time.

FLOPs count only the routed work: 2 * T * top_k * 3 * H * I (gate, up and down per pair).
Bytes: the weights of the experts the case's routing actually hits (each read once) plus the
activations (x and router logits read, output written). The routing is drawn from a fixed CPU
seed so the hit count is known when the case is built and every input set routes the same way.

Providers, all timed in the same run on the same inputs: our Triton path (eagerly, and replayed
from a CUDA graph, which removes the launch cost of its ~10 kernels), the per-expert loop of
cuBLAS calls (eager only: it reads the expert counts on the host, so it cannot be captured), and
torch._grouped_mm (eager and graph). Prefill cases also time two dense cuBLAS GEMMs with the
same FLOPs (not an MoE: the dense-GEMM rate the prefill target is a fraction of).

The op ``moe.quant`` times the same cases with the experts quantised (int4 with a scale per 128
input channels, the layout of GPTQ / AWQ / W4A16 checkpoints; block fp8 with 128 x 128 blocks, as
DeepSeek-V3's and Qwen3-FP8's): our grouped GEMM reading them as stored (eager and graph) beside
the many-token route that dequantises them once per call (graph), and our kernel on the same experts
in bf16 (graph); bytes count the quantised experts as stored. They add 512 tokens, between the two
routes' home sizes.
"""
from __future__ import annotations

import torch

from opmap.core import hw, registry
from opmap.core.specs import MoESpec
from opmap.harness.bench.base import BenchCase, Provider
from opmap.ops.gemm.quant import INT4_GROUP
from opmap.ops.moe.reference import quantize_experts

MODELS = {  # name: (experts, top_k, hidden, intermediate)
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
}
# 512: between the decode and the prefill routes (the quantised experts' dequantising route, the
# TMA route of 16-bit ones); the 16-bit op and the quantised one at each
TOKENS = (1, 64, 512, 4096)


def _logits(T: int, E: int, seed: int) -> torch.Tensor:
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed))


def _experts_hit(logits: torch.Tensor, k: int) -> int:
    return int(logits.topk(k, dim=-1).indices.unique().numel())


def _setup(T, E, k, H, I, seed, dt=torch.bfloat16):
    def setup(device):
        w13 = (torch.randn(E, 2 * I, H, device=device, dtype=dt) / H ** 0.5)
        w2 = (torch.randn(E, H, I, device=device, dtype=dt) / I ** 0.5)
        x = torch.randn(T, H, device=device, dtype=dt)
        return dict(x=x, logits=_logits(T, E, seed).to(device), w13=w13, w2=w2, k=k)

    return setup


def _call(backend: str, quantised: bool = False, config=None):
    def make(inp):
        fn = registry.get("moe", backend).fn("moe")
        if quantised:
            return lambda: fn(inp["x"], inp["logits"], inp["q13"], inp["q2"], inp["k"], **inp["scales"])
        if config is not None:  # a tuning variant of the backend's kernel
            return lambda: fn(inp["x"], inp["logits"], inp["w13"], inp["w2"], inp["k"], config=config)
        return lambda: fn(inp["x"], inp["logits"], inp["w13"], inp["w2"], inp["k"])

    return make


def _quantised_setup(T, E, k, H, I, seed, fmt):
    dense = _setup(T, E, k, H, I, seed)

    def setup(device):
        d = dense(device)
        scales = {}
        for name, w in (("13", d["w13"]), ("2", d["w2"])):
            d[f"q{name}"], scales[f"w{name}_scale"], _ = quantize_experts(w, fmt, INT4_GROUP if fmt == "int4" else 128)
        d["scales"] = scales
        return d

    return setup


def _graphed(backend: str, quantised: bool = False, config=None):
    """A provider that captures the op in its own CUDA graph and times the replay."""
    def make(inp):
        call = _call(backend, quantised, config)(inp)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()  # compile and warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        return g.replay

    return make


def _dense_same_flops(inp):
    """Not an MoE: two dense cuBLAS GEMMs with the routed work's FLOPs (all T*k rows through one
    expert's weights), the "dense GEMM TFLOP/s" the prefill target is stated against."""
    x, w13, w2, k = inp["x"], inp["w13"], inp["w2"], inp["k"]
    rows = x.repeat_interleave(k, dim=0)
    inter = w2.shape[2]
    h = torch.empty(rows.shape[0], 2 * inter, device=x.device, dtype=x.dtype)
    y = torch.empty_like(rows)

    def run():
        torch.mm(rows, w13[0].t(), out=h)
        torch.mm(h[:, :inter], w2[0].t(), out=y)

    return run


# Tile variants of the TMA route's kernels (with --variants), as config dicts (kernels/moe/tma_moe.py)
# beside the row tile the plan does not pick
TMA_VARIANTS = {"flat=0": {"FLATTEN": 0}, "per_sm=2,s=2": {"per_sm": 2, "num_stages": 2}, "bn=64": {"BN": 64}}


def providers(prefill: bool, other_bm: int = 0) -> list[Provider]:
    """``other_bm``: the TMA route's row tile its plan does not pick for the case (a variant row)."""
    extra = [Provider("cublas-dense-same-flops", _dense_same_flops)] if prefill else []
    if prefill:
        # the many-token route: rows permuted once into contiguous expert blocks, TMA tiles
        extra += [Provider("opmap-triton-tma", _call("triton-tma"), backend=("moe", "triton-tma")),
                  Provider("opmap-triton-tma+graph", _graphed("triton-tma"), backend=("moe", "triton-tma"))]
        variants = dict(TMA_VARIANTS, **({f"bm={other_bm}": {"BM": other_bm}} if other_bm else {}))
        extra += [Provider(f"opmap-triton-tma[{tag}]+graph", _graphed("triton-tma", config=cfg),
                           backend=("moe", "triton-tma")) for tag, cfg in variants.items()]
    return extra + [
        Provider("opmap-triton", _call("triton"), backend=("moe", "triton")),
        Provider("opmap-triton+graph", _graphed("triton"), backend=("moe", "triton")),
        Provider("torch-loop", _call("torch-loop"), backend=("moe", "torch-loop")),
        # the backend's declaration says where torch._grouped_mm runs (checked before timing)
        Provider("torch-grouped-mm", _call("torch-grouped-mm"), backend=("moe", "torch-grouped-mm")),
        Provider("torch-grouped-mm+graph", _graphed("torch-grouped-mm"), backend=("moe", "torch-grouped-mm")),
    ]


def cases(quick: bool) -> list[BenchCase]:
    from opmap.kernels.moe.tma_moe import ROW_TILES, pick_bm  # the kernel module imports triton: on use

    arch = hw.local_arch()
    out = []
    for model, (E, k, H, I) in MODELS.items():
        for T in TOKENS:
            seed = 1000 + T
            hit = _experts_hit(_logits(T, E, seed), k)
            flops = 2.0 * T * k * 3 * H * I
            nbytes = hit * 3 * H * I * 2 + 2 * T * H * 2 + T * E * 4
            phase = "prefill" if T > 64 else "decode"
            out.append(BenchCase(
                op="moe", case=f"model={model},T={T},E={E},k={k},H={H},I={I},hit={hit},dtype=bf16",
                flops=flops, bytes=float(nbytes), setup=_setup(T, E, k, H, I, seed),
                providers=providers(T > 64, next(b for b in ROW_TILES if b != pick_bm(T * k, E))),
                bound="compute" if flops / nbytes > 200 else "memory",
                spec=MoESpec(arch=arch, phase=phase, num_experts=E, top_k=k, hidden=H, intermediate=I,
                             dtype="bf16", weight_dtype="bf16", tokens=T),
                tags=("moe",)))
            for fmt, wbytes in (("int4", 0.5 + 2 / INT4_GROUP), ("fp8-block", 1 + 4 / 128 ** 2)):
                qbytes = hit * 3 * H * I * wbytes + 2 * T * H * 2 + T * E * 4
                tag = f"int4-g{INT4_GROUP}" if fmt == "int4" else "fp8-block128"
                out.append(BenchCase(
                    op="moe.quant", case=f"model={model},T={T},E={E},k={k},H={H},I={I},hit={hit},w={tag},dtype=bf16",
                    flops=flops, bytes=float(qbytes), setup=_quantised_setup(T, E, k, H, I, seed, fmt),
                    providers=[Provider("opmap-triton", _call("triton", True), backend=("moe", "triton")),
                               Provider("opmap-triton+graph", _graphed("triton", True), backend=("moe", "triton")),
                               Provider("opmap-dequant-triton+graph", _graphed("dequant-triton", True),
                                        backend=("moe", "dequant-triton")),
                               Provider("opmap-triton-bf16+graph", _graphed("triton"))],
                    bound="compute" if flops / qbytes > 200 else "memory",
                    spec=MoESpec(arch=arch, phase=phase, num_experts=E, top_k=k, hidden=H, intermediate=I,
                                 dtype="bf16", weight_dtype=fmt, tokens=T, group_size=INT4_GROUP if fmt == "int4" else 128),
                    tags=("moe",)))
    return out
