"""MLA benchmark cases (DeepSeek shapes: latent R = 512, RoPE Dr = 64, page 64, shuffled pages).

Decode: 16 heads (V2-Lite) and 128 heads (V2/V3), batch {1, 16, 64, 128}, context {1k, 4k, 16k,
32k}, latent cache bf16 and fp8-e4m3. Sparse decode: 128 heads, top-k 2048 at contexts 32k and
128k. Prefill (non-absorbed, causal): 16 and 128 heads, 4096 new tokens (and 1024 after a 3072
cached prefix).

Bytes (the minimum a decode must move): the cache rows attended to, read once (B x L x 576 x
element size; sparse: B x k rows plus the indices), plus q read and out written. FLOPs: per head
and token 2 x 576 (scores) + 2 x 512 (value). A case is "compute" bound when its FLOPs per byte
exceed the H200's ridge (~760 TFLOP/s / 4.2 TB/s = 181, TARGETS.md): 128 heads with a bf16 cache
are (242 FLOP/B), so those report TFLOP/s against the bf16 GEMM ceiling; 16 heads are memory
bound and report the fraction of the read ceiling.

Providers, same inputs, same run: ours (CUDA-graph replay, persistent workspace), with a few other
tile configurations in the full run so that one GPU run also tunes the default; PyTorch SDPA on
the latent already gathered into contiguous memory (like "cuDNN on contiguous KV" for GQA: the
gather is not timed; sparse: the torch gather of the top-k rows *is* timed, it is the op);
FlashInfer's MLA when importable (plan outside the timing).
"""
from __future__ import annotations

import torch

from opmap.bench.base import BenchCase, Provider
from opmap.specs import AttentionSpec

R, DR, PAGE = 512, 64, 64
RIDGE = 181.0  # FLOP per byte where the H200's bf16 GEMM ceiling meets its read ceiling
VARIANTS = {16: [(16, 64, 4, 2), (16, 32, 4, 3)], 128: [(32, 32, 8, 2), (64, 32, 8, 1)]}
_FP8 = torch.float8_e4m3fn


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


def _row(rows: str, config: tuple) -> str:
    """A config's bench row name: (16, 32, 4, 3, "tma") -> "opmap-triton[bh=16,bn=32,w=4,s=3,tma]"
    (``rows``: "bh" for the decode's head blocks, "bm" for the prefill's query blocks)."""
    return f"opmap-triton[{rows}={config[0]},bn={config[1]},w={config[2]},s={config[3]}" + \
        "".join("," + x for x in config[4:]) + "]"


def _ours(entry, config=None, per_sm=None, **ws_kw):
    """``per_sm``: plan the splits for that many programs per SM instead of the config's own count."""
    def make(inp):
        from opmap.ops.mla import decode as dec

        B, H, _ = inp["qn"].shape
        if per_sm:
            ws_kw["num_splits"] = dec.plan_splits(B, H, inp["qn"].device, config[0], config[2], per_sm)
        ws = dec.make_workspace(B, H, R, inp["qn"].device, config=config, **ws_kw)
        extra = (inp["indices"],) if entry == "mla_sparse_decode" else ()
        fn = getattr(dec, entry)
        return lambda: fn(inp["qn"], inp["qp"], inp["cache"], inp["seq_lens"], inp["tables"], *extra,
                          scale=inp["scale"], kv_scale=inp["kv_scale"], workspace=ws, config=config)

    return make


def _rows_of(inp, positions):
    """Flat cache rows [B, n] of token positions [B, n] through the block tables."""
    pages = inp["tables"].long().gather(1, positions.long() // PAGE)
    return pages * PAGE + positions.long() % PAGE


def _sdpa_contiguous(inp):
    from opmap.ops.mla.sdpa import mqa_latent

    B, ctx = inp["seq_lens"].shape[0], int(inp["seq_lens"][0])
    pos = torch.arange(ctx, device=inp["cache"].device).expand(B, ctx)
    lat = inp["cache"].view(-1, R + DR)[_rows_of(inp, pos)]  # gathered once, outside the timing
    return lambda: mqa_latent(inp["qn"], inp["qp"], lat, inp["scale"])


def _sdpa_sparse(inp):
    from opmap.ops.mla.sdpa import mqa_latent

    rows = _rows_of(inp, inp["indices"])
    flat = inp["cache"].view(-1, R + DR)
    return lambda: mqa_latent(inp["qn"], inp["qp"], flat[rows], inp["scale"])


def _flashinfer(inp):
    from opmap.ops.mla import flashinfer as fi

    w = fi.plan(inp["qn"], inp["qp"], inp["cache"], inp["seq_lens"], inp["tables"], scale=inp["scale"])
    return lambda: fi.run(w, inp["qn"], inp["qp"], inp["cache"])


def _spec(H, fp8, sparse=False, phase="decode"):
    return AttentionSpec(kind="mla", num_heads=H, num_kv_heads=1, head_dim=R + DR, head_dim_v=R,
                         page_size=PAGE, kv_dtype="fp8" if fp8 else "bf16", sparse=sparse, phase=phase,
                         cuda_graph=phase == "decode", arch="sm90")


def _flashinfer_available():
    from opmap import registry

    return registry.get("attention", "mla-flashinfer").available()


def _decode_case(B, H, ctx, fp8, quick):
    elt = 1 if fp8 else 2
    nbytes = B * ctx * (R + DR) * elt + B * H * (R + DR) * 2 + B * H * R * 2
    flops = 2.0 * B * H * ctx * (2 * R + DR)
    provs = [Provider("opmap-triton", _ours("mla_decode"), backend=("attention", "mla-triton"))]
    if not quick:
        provs += [Provider(_row("bh", c), _ours("mla_decode", c)) for c in VARIANTS[H]]
    if H == 16 and not fp8:
        # 16 heads: the default 4-warp program has 255 registers and a 136-byte stack frame on
        # sm90 (0.14 of the read ceiling at B=1, 0.55 at B=64); with 8 warps it compiles to 206
        # registers and no stack. At B=1 also twice the programs (256 splits of 128 keys).
        # In the quick grid too.
        provs.append(Provider("opmap-triton[bh=16,bn=32,w=8,s=3]", _ours("mla_decode", (16, 32, 8, 3))))
        # BLOCK_N 16 with 3 stages: the sm90 build keeps one tile's copy in flight (async_wait 1;
        # the default waits for every copy, async_wait 0) at 209 registers and no stack.
        provs.append(Provider("opmap-triton[bh=16,bn=16,w=4,s=3]", _ours("mla_decode", (16, 16, 4, 3))))
        if B == 1:
            provs.append(Provider("opmap-triton[splits=256,min=128]",
                                  _ours("mla_decode", num_splits=256, split_min=128)))
    if fp8:
        # The pointer kernel with Triton's own cast of the tiles to q's dtype and bf16 dots: the
        # fp8 default until the twelfth session (0.20-0.24 of the read ceiling), against today's
        # fp16 dots on tiles converted once by PTX (tests/test_mla_sm90_compile.py says what the
        # two builds do). Dropped after the twelfth session's quick grid: the fp8 cache through the
        # TMA kernel, (16, 32, 8, 3, "tma"), 292.5 us at B=64/4096 against the pointer kernel's
        # 166.8 (B=1/32k: 51.3 against 47.0).
        from opmap.ops.mla.decode import _pointer_config

        # At 128 heads the 64-head blocks' cast at every batch too: the default from B=64 since the
        # thirteenth session (767.8 against the fp16 path's 817.6 us at B=64/4096), not yet timed
        # below B=64, where the 64-head fp16 build beat the default 16-head one (221.4 against
        # 250.8 us at B=16/4096).
        for c in dict.fromkeys([_pointer_config(H, R, B)] + ([(64, 32, 8, 1)] if H >= 64 else [])):
            provs.append(Provider(_row("bh", c + ("cast",)), _ours("mla_decode", c + ("cast",))))
        if H < 64:
            # The TMA kernel on fp8 with the pointer kernel's fix (fp16 dots on tiles converted once
            # by PTX; thirteenth session, CPU): its sm90 build no longer reads the tiles byte by byte
            # (188-203 registers instead of 255, 92 KB: two programs an SM). Before the fix it was
            # slower than the pointer kernel (292.5 against 166.8 us at B=64/4096).
            for c in ((16, 32, 4, 3, "tma"), (16, 32, 8, 3, "tma")):
                provs.append(Provider(_row("bh", c), _ours("mla_decode", c)))
    if not fp8:
        # TMA loads, keys as the rows of transposed dots (ops/mla/decode_tma.py): 32-token tiles
        # at two stages (two programs per SM) and 64-token tiles (one; the default below 64 heads
        # in the ninth session: 107 us at B=64/4096 on the H200).
        provs.append(Provider("opmap-triton[bh=16,bn=32,w=4,s=2,tma]", _ours("mla_decode", (16, 32, 4, 2, "tma"))))
        provs.append(Provider("opmap-triton[bh=16,bn=64,w=4,s=2,tma]", _ours("mla_decode", (16, 64, 4, 2, "tma"))))
        # 64 heads per program with heads as rows (FlashMLA's shape: two warpgroups), at two stages:
        # the default from 64 heads until the tenth session (three since: 321.0 against 394.5 us at
        # B=64/4096). At 16 heads three quarters of its rows are padding (FlashMLA pads the same
        # way). The default below 64 heads since the tenth session is 32-token tiles at three
        # stages, two programs per SM (decode._per_sm): 94.2 us at B=64/4096 against 105.3 for the
        # 64-token tiles above. Dropped after that run: 64-token tiles on two warpgroups (139.6 us)
        # and 32-token tiles at four stages, one per SM (110.5 us).
        provs.append(Provider("opmap-triton[bh=64,bn=32,w=8,s=2,tma]", _ours("mla_decode", (64, 32, 8, 2, "tma"))))
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
    provs = [Provider("opmap-triton", _ours("mla_sparse_decode"), backend=("attention", "mla-triton"))]
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
        from opmap import registry

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
    provs = [Provider("opmap-triton", _prefill_call("mla-triton"), backend=("attention", "mla-triton")),
             Provider("torch-sdpa", _prefill_call("mla-sdpa"), backend=("attention", "mla-sdpa"))]
    # (64, 64, 8, 2): the default before the fourteenth session, whose sm90 build waits for every
    # copy at the top of each tile; at 3 stages copies stay in flight (tests/test_mla_sm90_compile.py;
    # 128 x 64 at 3 stages is the sm90 default now). "split": the tiles below the diagonal in an
    # unmasked loop of their own; "tma": the tiles through descriptors (ops/mla/prefill_tma.py).
    # In the quick grid too (their times spread by up to 2x between runs: prefill._config).
    for c in [(64, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 3, "split"), (128, 32, 8, 3, "split"),
              (64, 64, 8, 3, "split"), (128, 64, 8, 3, "tma"), (128, 32, 8, 3, "tma")]:
        provs.append(Provider(_row("bm", c), _prefill_call("mla-triton", c), backend=("attention", "mla-triton")))
    return BenchCase("attention.mla_prefill", f"new={new},prefix={prefix},h={H},Dqk=192,Dv=128,page={PAGE}",
                     flops, nbytes, _prefill_setup(H, new, prefix), provs, bound="compute",
                     spec=_spec(H, False, phase="prefill"), tags=("mla",))


def cases(quick: bool) -> list[BenchCase]:
    out = []
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
