"""Attention benchmark cases (GQA/MHA; MLA is in mla.py): paged decode, causal prefill, a mixed
chunked-prefill step, and KV append, with the peers timed in the same run on the same data.

Decode: B in {1, 8, 32, 64, 128} x KV length in {512, 2048, 8192, 32768} (plus the
target case B=64/4096), 32 q / 8 kv heads, d=128, page 16, shuffled pages, bf16 and fp8 KV. Minimal bytes:
K and V of every sequence read once (B x L x Hk x D x 2 x element size) plus q read and out
written; FLOPs 4 x B x Hq x L x D. Memory bound: fraction of the read ceiling.
Prefill: causal, S in {512, 2048, 8192, 16384}, 32 heads d=128 (MHA), and B=4 GQA 32/8 at
S=4096; FLOPs 4 x B x Hq x D x S(S+1)/2 (causal pairs); compute bound: fraction of the bf16
GEMM ceiling.

Providers: ours on the paged cache, one row per backend whose kernel can serve the case
(``opmap-triton``: the gather prefill and the Triton decode; ``opmap-triton-tma``: the TMA prefill
on pages of 64; ``opmap-gluon-ws``: the Gluon warp-specialised prefill; ``opmap-gluon-fp8``: the Gluon decode on fp8 caches), decode under CUDA-graph replay
with a persistent workspace; also the fixed-split batch-invariant mode in the full run; PyTorch SDPA with each CUDA backend
on contiguous [B, H, S, D] K/V made from the same data outside the timing (enable_gqa; where a
backend refuses unequal head counts the provider fails with the reason, and a "repeat-kv"
variant reads K/V expanded to 32 heads); FlexAttention on the paged cache with its block mask
built outside the timing; FlashInfer when importable (plan outside the timing).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask

from opmap.core import registry
from opmap.core.specs import AttentionSpec, KVAppendSpec
from opmap.harness.bench.base import BenchCase, Provider
from opmap.ops.attention.reference import quantize_fp8
from opmap.ops.rope.reference import cos_sin_cache
from opmap.peers.attention import flex
from opmap.peers.attention.flashinfer import paged_meta, plan_workspace

HQ, HK, D, PAGE = 32, 8, 128, 16
SDPA = (("cudnn-sdpa", "CUDNN_ATTENTION"), ("torch-sdpa-flash", "FLASH_ATTENTION"),
        ("torch-sdpa-efficient", "EFFICIENT_ATTENTION"))
_FP8 = torch.float8_e4m3fn


def _paged(B, L, hk, q_lens, hq, fp8, device, dt=torch.bfloat16, page=PAGE, d=D):
    maxp = -(-L // page)
    P = B * maxp + 8
    kc = torch.randn(P, page, hk, d, device=device, dtype=dt)
    vc = torch.randn(P, page, hk, d, device=device, dtype=dt)
    inp = dict(page=page, bt=torch.randperm(P, device=device)[:B * maxp].view(B, maxp).to(torch.int32).contiguous(),
               seq_lens=torch.full((B,), L, dtype=torch.int32, device=device), scale=d ** -0.5, L=L, hq=hq, hk=hk,
               d=d, k_scale=None, v_scale=None)
    if fp8:
        ks = kc.float().abs().amax(dim=(0, 1, 3)) / 448.0
        vs = vc.float().abs().amax(dim=(0, 1, 3)) / 448.0
        kc = quantize_fp8(kc.view(-1, hk, d), ks).view(kc.shape)
        vc = quantize_fp8(vc.view(-1, hk, d), vs).view(vc.shape)
        inp.update(k_scale=ks, v_scale=vs)
    T = sum(q_lens)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    inp.update(kc=kc, vc=vc, q=torch.randn(T, hq, d, device=device, dtype=dt), cu=cu.to(device))
    return inp


def _contiguous(inp, repeat=False):
    """[B, H, S, D] K/V gathered from the pages (cached in the input set; not timed)."""
    key = "cont_rep" if repeat else "cont"
    if key not in inp:
        B, maxp = inp["bt"].shape
        L = inp["L"]
        pg = inp["page"]
        k = inp["kc"][inp["bt"].long()].view(B, maxp * pg, inp["hk"], inp["d"])[:, :L].transpose(1, 2)
        v = inp["vc"][inp["bt"].long()].view(B, maxp * pg, inp["hk"], inp["d"])[:, :L].transpose(1, 2)
        if repeat:
            g = inp["hq"] // inp["hk"]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        inp[key] = (k.contiguous(), v.contiguous())
    return inp[key]


# Alternative tiles of one backend's kernel timed with --variants (ours only), so one GPU run also
# tunes the defaults. PREFETCH=0: the page-id load inside the iteration, as before the prefetch (see
# kernels/attention/common.py): the row that measures what the pipelining change did.
# decode (the Triton kernel, 16-bit and fp8 caches): page-id prefetch where the default turns it off
# (large grids), one stage (K/V straight to registers), one stage with 128-key tiles on 8 warps, and
# no prefetch where the default has it. The Gluon fp8 kernel takes no tiles (its layouts fix them).
VARIANTS = {"decode": [dict(PREFETCH=1), dict(num_stages=1), dict(num_stages=1, BLOCK_N=128, num_warps=8),
                       dict(PREFETCH=0)],
            "prefill": [dict(BLOCK_N=128, num_stages=2), dict(BLOCK_M=64, num_warps=4), dict(BLOCK_N=32, num_warps=4),
                        dict(PREFETCH=0)],
            # the TMA kernel at two stages (its default three take 132 KB), and on one warpgroup with
            # 64-row query blocks (two programs per SM)
            "prefill_tma": [dict(num_stages=2), dict(BLOCK_M=64, num_warps=4)],
            # the Gluon warp-specialised prefill on 64-key tiles, at two and three stages, and with its
            # two consumer warpgroups in partitions of their own taking turns (ping-pong)
            "prefill_ws": [dict(BLOCK_N=64), dict(BLOCK_N=64, STAGES=3), dict(PINGPONG=1)]}


def _tag(cfg):
    short = {"BLOCK_M": "bm", "BLOCK_N": "bn", "BLOCK_H": "bh", "num_warps": "w", "num_stages": "s", "PREFETCH": "pf",
             "STAGES": "s", "PINGPONG": "pp"}
    return ",".join(f"{short[k]}={v}" for k, v in cfg.items())


def _row(backend, extra=""):
    """A backend's row name: "opmap-" + its name, then ``[extra]`` for a variant of it."""
    return f"opmap-{backend}" + (f"[{extra}]" if extra else "")


def _ours(backend, phase, fixed=False, config=None, min_chunk=None, split_tokens=None):
    def make(inp):
        b = registry.get("attention", backend)
        fn = b.fn(phase)
        kw = dict(scale=inp["scale"], k_scale=inp["k_scale"], v_scale=inp["v_scale"])
        if config:
            kw["config"] = config
        if phase == "decode":
            B = inp["q"].shape[0]
            ws = b.fn("make_workspace")(B, inp["hq"], inp["d"], device=inp["q"].device, batch_invariant=fixed,
                                        max_seq_len=inp["bt"].shape[1] * inp["page"], min_chunk=min_chunk,
                                        split_tokens=split_tokens)
            return lambda: fn(inp["q"], inp["kc"], inp["vc"], inp["seq_lens"], inp["bt"], workspace=ws, **kw)
        return lambda: fn(inp["q"], inp["kc"], inp["vc"], inp["cu"], inp["seq_lens"], inp["bt"], **kw)

    return make


def _public_decode(custom_op: bool):
    """The decode as another engine calls it: ``opmap.attention_decode`` without a workspace (the
    selector's backend, its cached workspace), or the ``torch.ops.opmap.attention_decode`` custom op."""
    def make(inp):
        import opmap  # registers torch.ops.opmap

        args = (inp["q"], inp["kc"], inp["vc"], inp["seq_lens"], inp["bt"], inp["scale"])
        fn = torch.ops.opmap.attention_decode if custom_op else opmap.attention_decode
        return lambda: fn(*args, k_scale=inp["k_scale"], v_scale=inp["v_scale"])

    return make


def _sdpa(member, repeat=False, causal=False):
    def make(inp):
        k, v = _contiguous(inp, repeat)
        B = inp["bt"].shape[0]
        q = inp["q"].view(B, -1, inp["hq"], inp["d"]).transpose(1, 2).contiguous()  # [B, Hq, S_q, D]
        gqa = k.shape[1] != q.shape[1]
        be = getattr(SDPBackend, member)

        def call():
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=inp["scale"], enable_gqa=gqa)

        return call

    return make


def _flex(inp):
    kc, vc, bt, sl, cu, q = inp["kc"], inp["vc"], inp["bt"], inp["seq_lens"], inp["cu"], inp["q"]
    T, hq, _ = q.shape
    P = kc.shape[0]
    B = sl.shape[0]
    q_lens = (cu[1:] - cu[:-1]).long()
    seq_of = torch.repeat_interleave(torch.arange(B, device=q.device), q_lens, output_size=T)
    qpos = sl.long()[seq_of] - q_lens[seq_of] + (torch.arange(T, device=q.device) - cu.long()[seq_of])
    pg = inp["page"]
    inv = flex._inverse_pages(sl, bt, P, pg)
    lens = sl.long()

    def mask_mod(b, h, qi, kv):
        s = seq_of[qi]
        lp = inv[s, kv // pg]
        pos = lp * pg + kv % pg
        return (lp >= 0) & (pos < lens[s]) & (pos <= qpos[qi])

    bm = create_block_mask(mask_mod, 1, None, T, P * pg, device=q.device)  # the plan: not timed
    Q = q.transpose(0, 1).unsqueeze(0)
    K = kc.view(1, P * pg, kc.shape[2], inp["d"]).transpose(1, 2)
    V = vc.view(1, P * pg, kc.shape[2], inp["d"]).transpose(1, 2)
    fn = flex._flex_fn(q.device.type)
    return lambda: fn(Q, K, V, block_mask=bm, scale=inp["scale"], enable_gqa=hq != kc.shape[2])


def _flashinfer(phase):
    def make(inp):
        # optional: flashinfer
        import flashinfer

        q, kc = inp["q"], inp["kc"]
        indptr, indices, last = paged_meta(inp["seq_lens"], inp["bt"], inp["page"])
        if phase == "decode":
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(plan_workspace(str(q.device), "decode"), kv_layout="NHD",
                                                              use_tensor_cores=True)
            w.plan(indptr, indices, last, inp["hq"], inp["hk"], inp["d"], inp["page"], pos_encoding_mode="NONE",
                   q_data_type=q.dtype, kv_data_type=kc.dtype, sm_scale=inp["scale"])
        else:
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(plan_workspace(str(q.device), "prefill"), kv_layout="NHD")
            w.plan(inp["cu"], indptr, indices, last, inp["hq"], inp["hk"], inp["d"], inp["page"], causal=True,
                   pos_encoding_mode="NONE", sm_scale=inp["scale"], q_data_type=q.dtype, kv_data_type=kc.dtype)
        return lambda: w.run(q, (kc, inp["vc"]))

    return make


def _fi_available():
    return registry.get("attention", "flashinfer").available()


def _spec(phase, hk, fp8, graph, page=PAGE, hq=HQ, d=D):
    return AttentionSpec(arch="sm90", phase=phase, num_heads=hq, num_kv_heads=hk, head_dim=d, page_size=page,
                         kv_dtype="fp8" if fp8 else "bf16", cuda_graph=graph)


def _decode_case(B, L, fp8, quick, hq=HQ, hk=HK, d=D, page=PAGE):
    """``hq``, ``hk``, ``d``, ``page``: the heads, head dim and page (Llama-3-8B's at the engine's
    default page unless a model's, see model_cases)."""
    elt = 1 if fp8 else 2
    nbytes = 2 * B * L * hk * d * elt + 2 * B * hq * d * 2
    # the kernel the selector picks for this case (the split-plan rows below time its plans)
    default = "gluon-fp8" if fp8 else "triton"
    provs = [Provider(_row("triton"), _ours("triton", "decode"), backend=("attention", "triton"))]
    if fp8 and d == 128:  # the Gluon kernel where it serves (fp8 at head dim 128), beside the Triton kernel on the same cache
        provs.append(Provider(_row("gluon-fp8"), _ours("gluon-fp8", "decode"), backend=("attention", "gluon-fp8")))
    # tile variants of the Triton kernel (timed with --variants only), in the quick grid too, on fp8 caches as well
    provs += [Provider(_row("triton", _tag(c)), _ours("triton", "decode", config=c), backend=("attention", "triton"))
              for c in VARIANTS["decode"]]
    if not quick:
        provs.append(Provider(_row(default, "fixed-split"), _ours(default, "decode", fixed=True), backend=("attention", default)))
    if B * hk * (L // 256) < 132:
        # Where 256-key splits leave most SMs idle, both minimum split lengths (the default
        # picks one of them by B x Hk: splitkv.auto_min_chunk): at B=1, kv=1152 the engine's
        # decode ran 40 programs of 256 keys, far above the time its bytes need (docs/attention.md,
        # Decisions: the 64-key minimum split).
        provs.append(Provider(_row(default, "chunk=64"), _ours(default, "decode", min_chunk=64), backend=("attention", default)))
        provs.append(Provider(_row(default, "chunk=256"), _ours(default, "decode", min_chunk=256), backend=("attention", default)))
    if B == 1 and L >= 16384:
        # B=1 at long context: 8 KV heads x 32 splits are 256 programs, ~2 per SM, well below the
        # read ceiling whatever the tiles (docs/attention.md, What limits speed). More splits put more
        # programs, hence more loads, in flight per SM: fixed split lengths of 512 and 256 keys
        # (64 and 128 splits) against 2048 (16), in the quick grid too.
        provs += [Provider(_row(default, f"split_tokens={n}"), _ours(default, "decode", split_tokens=n),
                           backend=("attention", default)) for n in (256, 512, 2048)]
    if (B, L) in ((64, 4096), (1, 32768)):
        # what a user's call costs beside the engine's path (the workspace row above)
        provs.append(Provider("opmap-decode-call", _public_decode(False)))
        provs.append(Provider("opmap-custom-op", _public_decode(True)))
    if not fp8:
        for name, member in SDPA:
            provs.append(Provider(name, _sdpa(member)))
        provs += [Provider(f"{n}[repeat-kv]", _sdpa(m, repeat=True)) for n, m in SDPA if n != "torch-sdpa-flash"]
        if B * L <= 64 * 8192:  # its block mask is built over (tokens x whole cache): bounded here
            provs.append(Provider("torch-flex", _flex))
        provs.append(Provider("flashinfer", _flashinfer("decode"), available=_fi_available))
    return BenchCase("attention.decode", f"B={B},kv={L},h={hq}/{hk},d={d},page={page},dtype={'fp8' if fp8 else 'bf16'}",
                     4.0 * B * hq * L * d, nbytes,
                     lambda dev: _paged(B, L, hk, [1] * B, hq, fp8, dev, page=page, d=d), provs, bound="memory",
                     graph=True, spec=_spec("decode", hk, fp8, True, page, hq, d))


def _prefill_case(B, S, hk, quick=True, page=PAGE, fp8=False, hq=HQ, d=D):
    """``fp8``: the same prefill on an e4m3 cache (scales per KV head), ours only (the peers read
    16-bit caches): the issue's bar is the bf16 row of the same shape."""
    pairs = B * S * (S + 1) / 2
    nbytes = B * S * (hq * 2 + hk * (1 if fp8 else 2)) * d * 2
    provs = [Provider(_row("triton"), _ours("triton", "prefill"), backend=("attention", "triton"))]
    if not quick and not fp8:
        provs += [Provider(_row("triton", _tag(c)), _ours("triton", "prefill", config=c), backend=("attention", "triton"))
                  for c in VARIANTS["prefill"]]
    if page % 64 == 0 and not fp8:
        # pages holding whole 64-key tiles: the TMA kernel beside the gather kernel and the peers
        provs.append(Provider(_row("triton-tma"), _ours("triton-tma", "prefill"), backend=("attention", "triton-tma")))
        provs += [Provider(_row("triton-tma", _tag(c)), _ours("triton-tma", "prefill", config=c),
                           backend=("attention", "triton-tma")) for c in VARIANTS["prefill_tma"]]
    if page >= 16 and not fp8:
        # the Gluon warp-specialised kernel (TMA boxes of one page each, so pages of 16 too)
        provs.append(Provider(_row("gluon-ws"), _ours("gluon-ws", "prefill"), backend=("attention", "gluon-ws")))
        provs += [Provider(_row("gluon-ws", _tag(c)), _ours("gluon-ws", "prefill", config=c),
                           backend=("attention", "gluon-ws")) for c in VARIANTS["prefill_ws"]]
    if not fp8:
        provs += [Provider(name, _sdpa(member, causal=True)) for name, member in SDPA]
        if hk != hq:
            provs += [Provider(f"{n}[repeat-kv]", _sdpa(m, repeat=True, causal=True)) for n, m in SDPA
                      if n != "torch-sdpa-flash"]
        if page == PAGE:  # flex's block mask over 64-token pages adds nothing the page-16 rows lack
            provs.append(Provider("torch-flex", _flex))
        provs.append(Provider("flashinfer", _flashinfer("prefill"), available=_fi_available))
    return BenchCase("attention.prefill",
                     f"B={B},S={S},h={hq}/{hk},d={d},page={page},causal,dtype={'fp8' if fp8 else 'bf16'}",
                     4.0 * hq * d * pairs, nbytes, lambda dev: _paged(B, S, hk, [S] * B, hq, fp8, dev, page=page, d=d),
                     provs, bound="compute", spec=_spec("prefill", hk, fp8, False, page, hq, d))


def _mixed_case():
    # One chunked-prefill step: a 2048-token chunk over a 6144-token prefix and 63 decode tokens.
    B, L = 64, 8192

    def setup(dev):
        inp = _paged(B, L, HK, [2048] + [1] * 63, HQ, False, dev)
        inp["seq_lens"][1:] = 4096
        return inp

    pairs = 2048 * 6144 + 2048 * 2049 / 2 + 63 * 4096
    nbytes = 2 * (8192 + 63 * 4096) * HK * D * 2 + 2 * (2048 + 63) * HQ * D * 2
    return BenchCase("attention.mixed", f"chunk=2048/8192+63x4096,h={HQ}/{HK},d={D},page={PAGE},dtype=bf16",
                     4.0 * HQ * D * pairs, nbytes, setup,
                     [Provider(_row("triton"), _ours("triton", "mixed"), backend=("attention", "triton")),
                      Provider("torch-flex", _flex)], bound="compute", spec=_spec("mixed", HK, False, False))


def _append_setup(T, fp8, hk=HK, d=D, page=PAGE, dt=torch.bfloat16):
    """``dt``: bf16 on the GPU; the CPU tests of these cases use fp16 (the interpreter mishandles bf16)."""
    def setup(dev):
        P = T // page + 64
        cdt = _FP8 if fp8 else dt
        inp = dict(k=torch.randn(T, hk, d, device=dev, dtype=dt),
                   v=torch.randn(T, hk, d, device=dev, dtype=dt),
                   kc=torch.empty(P, page, hk, d, device=dev, dtype=cdt), vc=torch.empty(P, page, hk, d, device=dev, dtype=cdt),
                   slots=torch.randperm(P * page, device=dev)[:T].contiguous(),
                   sc=dict(k_scale=torch.ones(hk, device=dev), v_scale=torch.ones(hk, device=dev)) if fp8 else {})
        return inp

    return setup


def _append(backend):
    def make(inp):
        fn = registry.get("kv_append", backend).fn("append")
        return lambda: fn(inp["k"], inp["v"], inp["kc"], inp["vc"], inp["slots"], **inp["sc"])

    return make


def _append_case(T, fp8, hk=HK, d=D, page=PAGE):
    elt = 1 if fp8 else 2
    nbytes = 2 * T * hk * d * (2 + elt) + T * 8
    return BenchCase("kv_append", f"T={T},h={hk},d={d},page={page},kv_dtype={'fp8' if fp8 else 'bf16'}", 0.0, nbytes,
                     _append_setup(T, fp8, hk, d, page),
                     [Provider("opmap-triton", _append("triton"), backend=("kv_append", "triton")),
                      Provider("torch-index-put", _append("reference"))],
                     bound="memory", graph=T <= 256,
                     spec=KVAppendSpec(arch="sm90", num_kv_heads=hk, head_dim=d, page_size=page,
                                       kv_dtype="fp8" if fp8 else "bf16"))


def _rope_append_setup(T, hq=HQ, hk=HK, d=D, page=PAGE, qk_norm=False, dt=torch.bfloat16):
    def setup(dev):
        inp = _append_setup(T, False, hk, d, page, dt)(dev)
        qkv = torch.randn(T, hq + 2 * hk, d, device=dev, dtype=dt)
        inp.update(qkv=qkv, hq=hq, hk=hk, q=qkv[:, :hq], k=qkv[:, hq:hq + hk], v=qkv[:, hq + hk:],
                   pos=torch.randint(0, 8192, (T,), device=dev), cs=cos_sin_cache(d, 8192, 500000.0, device=dev))
        if qk_norm:
            inp["norm"] = (torch.rand(d, device=dev, dtype=dt) + 0.5, torch.rand(d, device=dev, dtype=dt) + 0.5, 1e-6)
        return inp

    return setup


def _rope_append(fused, config=None):
    """One launch (``fused``: rope_append, Qwen3's q / k norms in it where the case has them) or the
    launches it replaces (qk_rmsnorm, rope, append)."""
    def make(inp):
        b = registry.get("kv_append", "triton")
        rope, app, both = registry.get("rope", "triton").fn("rope"), b.fn("append"), b.fn("rope_append")
        q, k, v, pos, cs, kc, vc, slots = (inp[n] for n in ("q", "k", "v", "pos", "cs", "kc", "vc", "slots"))
        norm = inp.get("norm")
        if fused:
            return lambda: both(q, k, v, pos, cs, "neox", kc, vc, slots, qk_norm=norm, config=config)
        qk_rmsnorm = registry.get("rmsnorm", "triton").fn("qk_rmsnorm")

        def launches():
            if norm is not None:
                qk_rmsnorm(inp["qkv"][:, :inp["hq"] + inp["hk"]], norm[0], norm[1], inp["hq"], norm[2])
            rope(q, k, pos, cs, "neox")
            app(k, v, kc, vc, slots)

        return launches

    return make


# config Q_HEADS of rope_append timed beside its default (4 q heads a program up to 64 tokens, else
# one program a token): q heads a program, 0 being one program a token.
ROPE_APPEND_Q_HEADS = (0, 16)


def _rope_append_case(T, hq=HQ, hk=HK, d=D, page=PAGE, qk_norm=False):
    # q and k read and written (twice with the norms: normalised in place, then rotated), v read,
    # both cache rows written (bf16), positions and slots.
    nbytes = T * ((4 if qk_norm else 2) * 2 * (hq + hk) * d + 2 * hk * d + 2 * 2 * hk * d + 16)
    what = "qk_norm+rope+append" if qk_norm else "rope+append"
    apart = "qk_norm, rope, then append" if qk_norm else "rope, then append"
    return BenchCase("kv_append", f"{what},T={T},h={hq}/{hk},d={d},page={page},kv_dtype=bf16", 0.0, nbytes,
                     _rope_append_setup(T, hq, hk, d, page, qk_norm),
                     [Provider("opmap-triton[rope_append, one launch]", _rope_append(True),
                               backend=("kv_append", "triton")),
                      Provider(f"opmap-triton[{apart}]", _rope_append(False))]
                     + [Provider(f"opmap-triton[rope_append, one launch, q_heads={n}]",
                                 _rope_append(True, {"Q_HEADS": n}), backend=("kv_append", "triton"))
                        for n in ROPE_APPEND_Q_HEADS if n < hq],
                     bound="memory", graph=T <= 256,
                     spec=KVAppendSpec(arch="sm90", num_kv_heads=hk, head_dim=d, page_size=page, kv_dtype="bf16"))


def cases(quick: bool) -> list[BenchCase]:
    if quick:
        grid = [(64, 4096), (1, 32768), (128, 2048)]
    else:
        grid = [(B, L) for B in (1, 8, 32, 64, 128) for L in (512, 2048, 8192, 32768)] + [(64, 4096)]
    out = [_decode_case(B, L, fp8, quick) for fp8 in (False, True) for B, L in grid]
    for S in ((8192,) if quick else (512, 2048, 8192, 16384)):
        out.append(_prefill_case(1, S, HQ, quick))
    out.append(_prefill_case(4, 4096, HK, quick))
    # Pages of 64 (TensorRT-LLM's default block, FlashMLA's page; the engine's on sm90): the TMA
    # prefill (triton-tma) beside the gather kernel and the peers
    out += [_prefill_case(1, 8192, HQ, quick, page=64), _prefill_case(4, 4096, HK, quick, page=64)]
    # fp8 caches, beside the bf16 rows of the same shapes
    out += [_prefill_case(4, 4096, HK, quick, page=p, fp8=True) for p in (PAGE, 64)]
    if not quick:
        # The engine's own prefill shapes (Llama-3-8B, one prompt: the e2e TTFT case is S=1024).
        # At S=512 with 32 heads a smaller tile (BLOCK_N=32, 4 warps) beat the default, whose 160
        # programs are fewer than the GPU holds, and lost to it at S=2048 (544 programs): these rows
        # say whether a small-grid rule holds for GQA too before it becomes the default.
        out += [_prefill_case(1, S, HK, quick) for S in (512, 1024)]
        out.append(_mixed_case())
    out += [_append_case(T, fp8) for T in ((64, 8192) if not quick else (64,)) for fp8 in (False, True)]
    # The engine's per-layer RoPE + append at decode (T = batch) and at a prefill chunk.
    out += [_rope_append_case(T) for T in ((1, 64) if quick else (1, 64, 8192))]
    return out


# A model's decode and prefill attention at its own heads (model_cases): decode at batch 1 over a
# short and a long context and at batch 32, a prefill chunk; the full grid adds batches and contexts.
MODEL_DECODE = {True: [(1, 512), (1, 4096), (32, 1024)],
                False: [(B, L) for B in (1, 8, 32, 64) for L in (512, 2048, 8192, 32768)]}
MODEL_PREFILL = {True: [(1, 2048)], False: [(1, 512), (1, 2048), (1, 8192), (4, 4096)]}


def model_cases(model_specs: dict, quick: bool) -> list[BenchCase]:
    """Decode, prefill and the RoPE + KV append at a model's own heads, head dim and page
    (``model_specs``: {op: [spec]} of its op map; GQA / MHA / MQA: MLA's are mla.py's), so that
    `opmap bench --model` times Qwen3-30B-A3B's 32 / 4 heads and not Llama-3-8B's 32 / 8. The RoPE +
    append rows (tuning rows: --variants) are timed with and without Qwen3's q / k norms in the
    launch (which of them a model runs is the report's step map); the plain append beside them."""
    geoms = sorted({(s.num_heads, s.num_kv_heads, s.head_dim, s.page_size)
                    for s in model_specs.get("attention", []) if getattr(s, "kind", "gqa") != "mla"})
    out = []
    for hq, hk, d, page in geoms:
        out += [_decode_case(B, L, fp8, quick, hq, hk, d, page) for fp8 in (False, True)
                for B, L in MODEL_DECODE[quick]]
        out += [_prefill_case(B, S, hk, quick, page, hq=hq, d=d) for B, S in MODEL_PREFILL[quick]]
        out += [_rope_append_case(T, hq, hk, d, page, norm) for norm in (False, True)
                for T in ((1, 64) if quick else (1, 64, 8192))]
        out += [_append_case(64, fp8, hk, d, page) for fp8 in (False, True)]
    return out

