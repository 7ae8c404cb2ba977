"""MLA benchmark cases (DeepSeek shapes: latent R = 512, RoPE Dr = 64, page 64, shuffled pages).

Decode: 16 heads (V2-Lite) and 128 heads (V2/V3), batch {1, 16, 64, 128}, context {1k, 4k, 16k,
32k}, latent cache bf16 and fp8-e4m3. Sparse decode: 128 heads, top-k 2048 at contexts 32k and
128k. Prefill (non-absorbed, causal): 16 and 128 heads, 4096 new tokens (and 1024 after a 3072
cached prefix).

Bytes (the minimum a decode must move): the cache rows attended to, read once (B x L x 576 x
element size; sparse: B x k rows plus the indices), plus q read and out written. FLOPs: per head
and token 2 x 576 (scores) + 2 x 512 (value). A case is "compute" bound when its FLOPs per byte
exceed the H200's ridge (``RIDGE``: the FLOP per byte where its bf16 GEMM ceiling meets its read
ceiling): 128 heads with a bf16 cache are (242 FLOP/B), so those report TFLOP/s against the bf16
GEMM ceiling; 16 heads are memory bound and report the fraction of the read ceiling.

Providers, same inputs, same run: ours, one row per backend whose kernel can serve the case
(``opmap-triton``: the pointer kernel, mla-triton; ``opmap-tma``: the TMA kernel, mla-tma;
``opmap-gluon-fp8``: the Gluon fp8 kernel, mla-gluon-fp8; ``opmap-gluon-ws``: the Gluon
warp-specialised kernel, mla-gluon-ws, 16-bit caches from 64 heads), under CUDA-graph replay with a persistent
workspace, with a few other tile configurations of a kernel under ``--variants`` so that one GPU run
also tunes its defaults; PyTorch SDPA on
the latent already gathered into contiguous memory (like "cuDNN on contiguous KV" for GQA: the
gather is not timed; sparse: the torch gather of the top-k rows *is* timed, it is the op);
FlashInfer's MLA when importable (plan outside the timing).
"""
from __future__ import annotations

import inspect

import torch

from opmap.core import registry
from opmap.core.specs import AttentionSpec, KVAppendSpec
from opmap.harness.bench.base import BenchCase, Provider
from opmap.peers.mla import flashinfer as fi
from opmap.peers.mla.sdpa import mqa_latent

R, DR, PAGE = 512, 64, 64
RIDGE = 181.0  # FLOP per byte where the H200's bf16 GEMM ceiling meets its read ceiling
# Tile variants of our decode kernels (with --variants), as config dicts (core/tiles.py) over each
# kernel's defaults: the TMA kernel's tiles (mla-tma) at each head count, and the pointer kernel's
# (mla-triton) 64-head blocks at 128 heads whatever the batch.
VARIANTS = {"mla-tma": {16: [dict(BLOCK_N=64, num_stages=2), dict(num_stages=2), dict(num_warps=8),
                             dict(BLOCK_H=64, num_warps=8, num_stages=2)],
                        128: [dict(num_stages=2), dict(BLOCK_H=32, num_stages=2)]},
            "mla-triton": {16: [], 128: [dict(BLOCK_H=64, num_warps=8, num_stages=1)]}}
PREFILL_VARIANTS = [dict(BLOCK_M=64, num_stages=2), dict(BLOCK_N=32), dict(BLOCK_M=64, num_stages=3)]
_FP8 = torch.float8_e4m3fn
# Batch-1 contexts up to SHORT keys get rows at these minimum split lengths beside the default's
# (each backend's own make_workspace default).
SHORT, SHORT_SPLIT_MIN = 4096, (32, 64, 128, 256)


def _setup(B, H, ctx, fp8, k=0, dt=torch.bfloat16):
    """dt: bf16 on the GPU; the CPU test of these cases uses fp16 (the interpreter mishandles bf16)."""
    def setup(device):
        maxp = -(-ctx // PAGE)
        P = B * maxp
        vals = torch.randn(P, PAGE, R + DR, device=device, dtype=dt) * 0.5
        scale = None
        if fp8:
            scale = torch.tensor([vals.abs().max().float().item() / 448.0], device=device)
            cache = (vals.float() / scale).to(_FP8)
        else:
            cache = vals
        del vals
        tables = torch.randperm(P, device=device).view(B, maxp).to(torch.int32).contiguous()
        inp = dict(cache=cache, kv_scale=scale, tables=tables,
                   seq_lens=torch.full((B,), ctx, dtype=torch.int32, device=device),
                   qn=torch.randn(B, H, R, device=device, dtype=dt),
                   qp=torch.randn(B, H, DR, device=device, dtype=dt), scale=192 ** -0.5)
        if k:
            inp["indices"] = torch.stack([torch.randperm(ctx, device=device)[:k] for _ in range(B)]).to(torch.int32)
        return inp

    return setup


def _row(backend: str, config: dict = None, extra: str = "") -> str:
    """A backend's bench row: "opmap-" + its name without the family's "mla-" prefix, then the
    config of a variant: ("mla-tma", {"BLOCK_N": 64, "num_stages": 2}) -> "opmap-tma[bn=64,s=2]"."""
    short = {"BLOCK_H": "bh", "BLOCK_M": "bm", "BLOCK_N": "bn", "num_warps": "w", "num_stages": "s"}
    tag = ",".join([f"{short[k]}={v}" for k, v in (config or {}).items()] + ([extra] if extra else []))
    return f"opmap-{backend.removeprefix('mla-')}" + (f"[{tag}]" if tag else "")


def _ours(backend, entry="mla_decode", config=None, **ws_kw):
    def make(inp):
        b = registry.get("attention", backend)
        B, H, _ = inp["qn"].shape
        ws = b.fn("make_workspace")(B, H, R, inp["qn"].device, config=config, **ws_kw)
        extra = (inp["indices"],) if entry == "mla_sparse_decode" else ()
        kw = {"config": config} if config else {}
        fn = b.fn(entry)
        return lambda: fn(inp["qn"], inp["qp"], inp["cache"], inp["seq_lens"], inp["tables"], *extra,
                          scale=inp["scale"], kv_scale=inp["kv_scale"], workspace=ws, **kw)

    return make


def _rows_of(inp, positions):
    """Flat cache rows [B, n] of token positions [B, n] through the block tables."""
    pages = inp["tables"].long().gather(1, positions.long() // PAGE)
    return pages * PAGE + positions.long() % PAGE


def _sdpa_contiguous(inp):
    B, ctx = inp["seq_lens"].shape[0], int(inp["seq_lens"][0])
    pos = torch.arange(ctx, device=inp["cache"].device).expand(B, ctx)
    lat = inp["cache"].view(-1, R + DR)[_rows_of(inp, pos)]  # gathered once, outside the timing
    return lambda: mqa_latent(inp["qn"], inp["qp"], lat, inp["scale"])


def _sdpa_sparse(inp):
    rows = _rows_of(inp, inp["indices"])
    flat = inp["cache"].view(-1, R + DR)
    return lambda: mqa_latent(inp["qn"], inp["qp"], flat[rows], inp["scale"])


def _flashinfer(inp):
    w = fi.plan(inp["qn"], inp["qp"], inp["cache"], inp["seq_lens"], inp["tables"], scale=inp["scale"])
    return lambda: fi.run(w, inp["qn"], inp["qp"], inp["cache"])


def _spec(H, fp8, sparse=False, phase="decode"):
    return AttentionSpec(kind="mla", num_heads=H, num_kv_heads=1, head_dim=R + DR, head_dim_v=R,
                         page_size=PAGE, kv_dtype="fp8" if fp8 else "bf16", sparse=sparse, phase=phase,
                         cuda_graph=phase == "decode", arch="sm90")


def _flashinfer_available():
    return registry.get("attention", "mla-flashinfer").available()


def _decode_case(B, H, ctx, fp8, quick):
    elt = 1 if fp8 else 2
    nbytes = B * ctx * (R + DR) * elt + B * H * (R + DR) * 2 + B * H * R * 2
    flops = 2.0 * B * H * ctx * (2 * R + DR)
    provs = [Provider(_row(b), _ours(b), backend=("attention", b))
             for b in ("mla-triton", "mla-tma", *(("mla-gluon-fp8",) if fp8 else ()))]
    provs += [Provider(_row(b, c), _ours(b, config=c), backend=("attention", b))
              for b in ("mla-tma", "mla-triton") for c in VARIANTS[b][H]]
    if not fp8 and H >= 64:  # the Gluon warp-specialised kernel: 16-bit caches, 64-head blocks
        provs.append(Provider(_row("mla-gluon-ws"), _ours("mla-gluon-ws"), backend=("attention", "mla-gluon-ws")))
    if B == 1:
        default = "mla-gluon-fp8" if fp8 else "mla-tma"  # the selector's under CUDA graphs on sm90
        provs.append(Provider(_row(default, extra="splits=256,min=128"),
                              _ours(default, num_splits=256, split_min=128), backend=("attention", default)))
        if ctx <= SHORT:
            # a short context at batch 1 (a chat turn): the minimum split length sets how many
            # programs of a few tiles each run; the backend's own is its default row
            own = inspect.signature(registry.get("attention", default).fn("make_workspace")).parameters[
                "split_min"].default
            provs += [Provider(_row(default, extra=f"min={n}"), _ours(default, split_min=n),
                               backend=("attention", default)) for n in SHORT_SPLIT_MIN if n != own]
    if not fp8:
        provs.append(Provider("torch-sdpa (contiguous latent)", _sdpa_contiguous))
        provs.append(Provider("flashinfer", _flashinfer, available=_flashinfer_available))
    return BenchCase("attention.mla_decode",
                     f"B={B},kv={ctx},h={H},R={R},Dr={DR},page={PAGE},kv_dtype={'fp8' if fp8 else 'bf16'}",
                     flops, nbytes, _setup(B, H, ctx, fp8), provs,
                     bound="compute" if flops / nbytes > RIDGE else "memory", graph=True,
                     spec=_spec(H, fp8), tags=("mla",))


def _sparse_case(B, ctx, k, fp8):
    H, elt = 128, 1 if fp8 else 2
    nbytes = B * k * ((R + DR) * elt + 4) + B * H * (R + DR) * 2 + B * H * R * 2
    flops = 2.0 * B * H * k * (2 * R + DR)
    provs = [Provider(_row("mla-triton"), _ours("mla-triton", "mla_sparse_decode"), backend=("attention", "mla-triton"))]
    if not fp8:
        provs.append(Provider("torch-gather+sdpa", _sdpa_sparse))
    return BenchCase("attention.mla_sparse_decode",
                     f"B={B},kv={ctx},topk={k},h={H},page={PAGE},kv_dtype={'fp8' if fp8 else 'bf16'}",
                     flops, nbytes, _setup(B, H, ctx, fp8, k), provs,
                     bound="compute" if flops / nbytes > RIDGE else "memory", graph=True,
                     spec=_spec(H, fp8, sparse=True), tags=("mla",))


def _prefill_setup(H, new, prefix):
    def setup(device):
        inp = _setup(1, H, new + prefix, False)(device)
        g = dict(device=device, dtype=torch.bfloat16)
        inp.update(qn=torch.randn(new, H, 128, **g), qp=torch.randn(new, H, DR, **g),
                   wk=torch.randn(H, 128, R, **g) / R ** 0.5, wv=torch.randn(H, 128, R, **g) / R ** 0.5,
                   cu=torch.tensor([0, new], dtype=torch.int32, device=device))
        return inp

    return setup


def _prefill_call(backend, config=None):
    def make(inp):
        fn = registry.get("attention", backend).fn("mla_prefill")
        n = int(inp["seq_lens"][0])
        kw = {"config": config} if config else {}
        return lambda: fn(inp["qn"], inp["qp"], inp["cache"], inp["wk"], inp["wv"], inp["cu"], inp["seq_lens"],
                          inp["tables"], scale=inp["scale"], max_q_len=inp["qn"].shape[0], max_seq_len=n, **kw)

    return make


def _prefill_case(H, new, prefix):
    n = new + prefix
    # causal pairs: each new token at position p sees p + 1 keys
    pairs = new * prefix + new * (new + 1) / 2
    flops = 2.0 * H * pairs * (128 + DR + 128) + 2.0 * n * R * H * 256  # attention + kv_b expansion
    nbytes = n * (R + DR) * 2 + new * H * (128 + DR + 128) * 2 + H * 256 * R * 2
    provs = [Provider(_row("mla-triton"), _prefill_call("mla-triton"), backend=("attention", "mla-triton")),
             Provider("torch-sdpa", _prefill_call("mla-sdpa"), backend=("attention", "mla-sdpa"))]
    for c in PREFILL_VARIANTS:
        provs.append(Provider(_row("mla-triton", c), _prefill_call("mla-triton", c), backend=("attention", "mla-triton")))
    return BenchCase("attention.mla_prefill", f"new={new},prefix={prefix},h={H},Dqk=192,Dv=128,page={PAGE}",
                     flops, nbytes, _prefill_setup(H, new, prefix), provs, bound="compute",
                     spec=_spec(H, False, phase="prefill"), tags=("mla",))


def _norm_rope_append_setup(T, H):
    def setup(dev):
        g = torch.Generator(device=dev).manual_seed(T)
        inv = 1.0 / (10000 ** (torch.arange(0, DR, 2, device=dev).float() / DR))
        ang = torch.arange(8192, device=dev).float()[:, None] * inv[None, :]
        return dict(q=torch.randn(T, H, 128 + DR, device=dev, generator=g).to(torch.bfloat16),
                    kva=torch.randn(T, R + DR, device=dev, generator=g).to(torch.bfloat16),
                    w=torch.ones(R, device=dev, dtype=torch.bfloat16),
                    pos=torch.randint(0, 8192, (T,), device=dev, generator=g),
                    cs=torch.cat([ang.cos(), ang.sin()], 1).contiguous(),
                    cache=torch.zeros(-(-T // PAGE) + 1, PAGE, R + DR, device=dev, dtype=torch.bfloat16),
                    slots=torch.arange(T, device=dev, dtype=torch.int32))

    return setup


def _norm_rope_append(fused):
    def make(inp):
        q_pe, kva, w, pos, cs, cache, slots = (inp["q"][..., 128:], inp["kva"], inp["w"], inp["pos"], inp["cs"],
                                               inp["cache"], inp["slots"])
        b = registry.get("kv_append", "mla-triton")
        if fused:
            one = b.fn("norm_rope_append_mla")
            return lambda: one(q_pe, kva, w, 1e-6, pos, cs, "gptj", cache, slots)
        norm, rope, app = registry.get("rmsnorm", "triton").fn("rmsnorm"), registry.get("rope", "triton").fn("rope"), \
            b.fn("append_mla")

        def three():
            ckv = norm(kva[:, :R], w, 1e-6)
            rope(q_pe, kva[:, None, R:], pos, cs, "gptj")
            app(ckv, kva[:, R:], cache, slots)

        return three

    return make


def _norm_rope_append_case(T, H):
    """An MLA layer's step between its kv_a projection and its attention: one launch beside the
    three the engine ran (latent norm, RoPE, append)."""
    nbytes = T * (2 * 2 * H * DR + 2 * (R + DR) + 2 * (R + DR) + 16)
    flops = T * (4 * R + 3 * DR * (H + 1))  # the norm's 4 a channel; 6 a rotated pair
    return BenchCase("kv_append", f"norm+rope+append_mla,T={T},h={H},R={R},Dr={DR},page={PAGE},kv_dtype=bf16",
                     float(flops), nbytes, _norm_rope_append_setup(T, H),
                     [Provider("opmap-triton[norm_rope_append_mla, one launch]", _norm_rope_append(True),
                               backend=("kv_append", "mla-triton")),
                      Provider("three launches: norm, rope, append_mla", _norm_rope_append(False))],
                     bound="memory", graph=True,
                     spec=KVAppendSpec(arch="sm90", kind="mla", num_kv_heads=1, head_dim=R + DR, page_size=PAGE,
                                       kv_dtype="bf16"))


def cases(quick: bool) -> list[BenchCase]:
    out = [_norm_rope_append_case(T, 16) for T in (1, 64)]
    grid = ([(64, 4096), (1, 32768)] if quick else
            [(B, ctx) for B in (1, 16, 64, 128) for ctx in (1024, 4096, 16384, 32768)])
    for H in (16, 128):
        for fp8 in (False, True):
            for B, ctx in grid:
                out.append(_decode_case(B, H, ctx, fp8, quick))
    for ctx in ((32768,) if quick else (32768, 131072)):
        for B in ((1,) if quick else (1, 64)):
            for fp8 in ((False,) if quick else (False, True)):
                out.append(_sparse_case(B, ctx, 2048, fp8))
    for H, new, prefix in ([(16, 4096, 0)] if quick else [(16, 4096, 0), (128, 4096, 0), (128, 1024, 3072)]):
        out.append(_prefill_case(H, new, prefix))
    return out


# A model's MLA decode at its own head count (model_cases): batch 1 at a short and a long context
# and batch 32; the full grid's batches and contexts otherwise.
MODEL_DECODE = {True: [(1, 1024), (1, 4096), (32, 1024)],
                False: [(B, ctx) for B in (1, 16, 32, 64) for ctx in (1024, 4096, 16384, 32768)]}


def model_cases(model_specs: dict, quick: bool) -> list[BenchCase]:
    """MLA decode at a model's own head count (``model_specs``: {op: [spec]} of its op map), so that
    `opmap bench --model deepseek-v2-lite` times its 16 heads at batch 1 over a chat-length context,
    not only the fixed grid's batch 64 / 4096 and batch 1 / 32768."""
    heads = sorted({s.num_heads for s in model_specs.get("attention", []) if getattr(s, "kind", None) == "mla"})
    return [_decode_case(B, H, ctx, fp8, quick) for H in heads for fp8 in (False, True)
            for B, ctx in MODEL_DECODE[quick]]

