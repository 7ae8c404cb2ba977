"""Quantised experts (int4 group scales, block fp8) through the grouped GEMM on the GPU, bf16, at
Qwen3-30B-A3B's and DeepSeek-V3's expert shapes, decode and prefill token counts (the tuned tiles
with BK cut to the group / block), against the fp32 reference on the dequantised experts; the
decode call replayed from a CUDA graph; the many-token route (dequant-triton) on the same cases and
captured in a graph whose replays see new routing and new expert weights."""
import pytest
import torch

import opmap
from opmap.core.tolerance import assert_close
from opmap.ops.gemm.quant import quantize_fp8_block, quantize_int4
from opmap.ops.moe import reference

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _experts(E, H, I, fmt, span, zp=False):
    g = torch.Generator(device="cuda").manual_seed(E + H + I)
    out = {}
    for name, (n, k) in (("w13", (2 * I, H)), ("w2", (H, I))):
        w = torch.randn(E, n, k, device="cuda", generator=g) / k ** 0.5
        if fmt == "int4":
            q = [quantize_int4(w[e], span, zp) for e in range(E)]
            out[name], out[f"{name}_scale"] = torch.stack([t[0] for t in q]), torch.stack([t[1] for t in q]).half()
            if zp:
                out[f"{name}_zero"] = torch.stack([t[2] for t in q])
        else:
            q = [quantize_fp8_block(w[e], span) for e in range(E)]
            out[name], out[f"{name}_scale"] = torch.stack([t[0] for t in q]), torch.stack([t[1] for t in q])
    return out


@pytest.mark.parametrize("backend", ["triton", "dequant-triton"])
@pytest.mark.parametrize("T", [1, 16, 300, 4096])
@pytest.mark.parametrize("fmt,span,zp,E,H,I,k", [("int4", 128, False, 128, 2048, 768, 8),
                                                  ("int4", 32, True, 16, 1024, 512, 4),
                                                  ("fp8-block", 128, False, 64, 2048, 768, 6)])
def test_quantised_experts_bf16(T, fmt, span, zp, E, H, I, k, backend):
    w = _experts(E, H, I, fmt, span, zp)
    q = {n: t for n, t in w.items() if n not in ("w13", "w2")}
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", generator=g).to(BF16)
    logits = torch.randn(T, E, device="cuda", generator=g)
    out = opmap.moe(x, logits, w["w13"], w["w2"], k, backend=backend, phase="decode" if T <= 64 else "prefill", **q)
    ref = reference.moe(x, logits, w["w13"], w["w2"], k, **q)
    assert_close(out, ref, BF16, scale=2.0, what=f"{backend} {fmt} T={T}")


def test_quantised_decode_graph_replay():
    w = _experts(32, 1024, 256, "int4", 128)
    q = {n: t for n, t in w.items() if n not in ("w13", "w2")}
    x = torch.randn(4, 1024, device="cuda", dtype=BF16)
    logits = torch.randn(4, 32, device="cuda")
    opmap.moe(x, logits, w["w13"], w["w2"], 2, backend="triton", **q)  # tunes outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = opmap.moe(x, logits, w["w13"], w["w2"], 2, backend="triton", **q)
    for i in range(3):
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference.moe(x, logits, w["w13"], w["w2"], 2, **q), BF16, scale=2.0, what=f"replay {i}")


def test_dequant_route_graph_replay_sees_new_weights():
    """The route's dequantisation runs inside the captured graph: a replay after the quantised
    experts change in place uses the new ones."""
    E, H, I, k, T = 16, 1024, 512, 2, 256
    w = _experts(E, H, I, "int4", 128)
    q = {n: t for n, t in w.items() if n not in ("w13", "w2")}
    x = torch.randn(T, H, device="cuda", dtype=BF16)
    logits = torch.randn(T, E, device="cuda")
    opmap.moe(x, logits, w["w13"], w["w2"], k, backend="dequant-triton", **q)  # tunes outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = opmap.moe(x, logits, w["w13"], w["w2"], k, backend="dequant-triton", **q)
    for i in range(2):
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))
        q["w2_scale"].mul_(1.5)
        graph.replay()
        ref = reference.moe(x, logits, w["w13"], w["w2"], k, **q)
        assert_close(out, ref, BF16, scale=2.0, what=f"replay {i}")
