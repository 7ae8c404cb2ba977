"""MLA check cases: each runnable MLA backend against the fp32 reference (decode on 16-bit and fp8
caches, sparse decode, prefill, latent append), the reference against SDPA in fp64 on the gathered
latent, page-boundary lengths, fp8 cache quality (cosine >= 0.999 vs bf16), CUDA-graph replay after
re-planning for each decode backend with a workspace, and sparse index errors. CPU: fp32, R=32/Dr=16/H=4; GPU: bf16, R=512/Dr=64, 16 and 128 heads."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opmap.core import hw, registry
from opmap.core.specs import AttentionSpec, KVAppendSpec
from opmap.core.tolerance import compare, cosine
from opmap.harness.check.base import CheckCase, Outcome, probe_errors
from opmap.harness.fixtures.mla import make_cache, sparse_indices
from opmap.ops.mla import reference as ref

TAGS = ("mla",)


def _shape(device):
    if device == "cuda":
        return dict(R=512, Dr=64, H=16, dt=torch.bfloat16, page=64, lens=[1, 63, 64, 65, 4000, 0])
    return dict(R=32, Dr=16, H=4, dt=torch.float32, page=16, lens=[1, 15, 16, 17, 70, 0])


def _problem(device, s, seed, lens=None, page=None, fp8=False, H=None):
    lens = lens or s["lens"]
    g = torch.Generator().manual_seed(seed)
    pc = make_cache(lens, s["R"], s["Dr"], page or s["page"], s["dt"], device=device, fp8=fp8, gen=g, std=0.5)
    h = H or s["H"]
    qn = torch.randn(len(lens), h, s["R"], generator=g).to(device, s["dt"])
    qp = torch.randn(len(lens), h, s["Dr"], generator=g).to(device, s["dt"])
    return pc, qn, qp


def _vs(out, want, dt, scale=1.0) -> Outcome:
    # plus a cosine gate: long-context outputs average many rows and can fall below bf16's
    # absolute tolerance, where the elementwise bound alone would pass a wrong answer
    e = compare(out, want, dt, scale=scale)
    c = cosine(out, want)
    return Outcome(e.ok and c >= 0.9995, f"{e} cosine={c:.6f}", e.worst_ratio, 1.0)


def _decode(device, name, page, H=None, fp8=False):
    """``fp8``: an e4m3 cache against the reference on the same cache."""
    def run():
        s = _shape(device)
        pc, qn, qp = _problem(device, s, page, page=page, H=H, fp8=fp8)
        sc = (s["R"] + s["Dr"]) ** -0.5
        args = (qn, qp, pc.cache, pc.seq_lens, pc.block_tables)
        kw = dict(scale=sc, kv_scale=pc.kv_scale if fp8 else None)
        out = registry.get("attention", name)("mla_decode", *args, **kw)
        return _vs(out, ref.mla_decode(*args, **kw), s["dt"], scale=2.0 if fp8 else 1.0)

    return run


def _sparse(device, name):
    def run():
        s = _shape(device)
        lens = [3, 200, 3000] if device == "cuda" else [3, 40, 90]
        k = 2048 if device == "cuda" else 24
        pc, qn, qp = _problem(device, s, 21, lens=lens)
        idx = sparse_indices(lens, k, gen=torch.Generator().manual_seed(3), device=device)
        args = (qn, qp, pc.cache, pc.seq_lens, pc.block_tables, idx)
        out = registry.get("attention", name)("mla_sparse_decode", *args, scale=0.1)
        return _vs(out, ref.mla_sparse_decode(*args, scale=0.1), s["dt"])

    return run


def _prefill(device, name):
    def run():
        s = _shape(device)
        Dn, Dv = (128, 128) if device == "cuda" else (16, 8)
        lens, qlens = ([1500, 300, 1], [700, 300, 1]) if device == "cuda" else ([40, 7, 1], [19, 7, 1])
        pc, _, _ = _problem(device, s, 31, lens=lens)
        g = torch.Generator().manual_seed(32)
        T, H, R = sum(qlens), s["H"], s["R"]
        qn = torch.randn(T, H, Dn, generator=g).to(device, s["dt"])
        qp = torch.randn(T, H, s["Dr"], generator=g).to(device, s["dt"])
        wk = (torch.randn(H, Dn, R, generator=g) / R ** 0.5).to(device, s["dt"])
        wv = (torch.randn(H, Dv, R, generator=g) / R ** 0.5).to(device, s["dt"])
        cu = torch.tensor([0, qlens[0], qlens[0] + qlens[1], T], dtype=torch.int32, device=device)
        args = (qn, qp, pc.cache, wk, wv, cu, pc.seq_lens, pc.block_tables)
        out = registry.get("attention", name)("mla_prefill", *args, scale=192 ** -0.5)
        # K/V are rounded to the input dtype after the kv_b GEMM (as HF does): 2x tolerance
        return _vs(out, ref.mla_prefill(*args, scale=192 ** -0.5), s["dt"], scale=2.0)

    return run


def _ref_vs_sdpa(device):
    def run():
        s = _shape(device)
        pc, qn, qp = _problem(device, s, 41, lens=[1, 17, 40])
        out = ref.mla_decode(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=0.1)
        worst = 0.0
        for b, n in enumerate([1, 17, 40]):
            pos = torch.arange(n, device=device)
            rows = pc.cache[pc.block_tables[b].long()[pos // s["page"]], pos % s["page"]].double()
            q = torch.cat([qn[b], qp[b]], -1).double()[None, :, None]
            k = rows[None, None].expand(1, q.shape[1], -1, -1)
            want = F.scaled_dot_product_attention(q, k, k[..., :s["R"]], scale=0.1)[0, :, 0]
            worst = max(worst, compare(out[b], want, s["dt"]).worst_ratio)
        return Outcome(worst <= 1.0, f"worst/tol={worst:.3g}", worst, 1.0)

    return run


def _fp8_quality(device, name):
    """The backend on an fp8 cache against the fp32 reference on the 16-bit values it quantises."""
    def run():
        s = _shape(device)
        pc, qn, qp = _problem(device, s, 51, lens=[70, 300] if device == "cpu" else [1000, 5000], fp8=True)
        sc = (s["R"] + s["Dr"]) ** -0.5
        f = registry.get("attention", name).fn("mla_decode")
        q8 = f(qn, qp, pc.cache, pc.seq_lens, pc.block_tables, scale=sc, kv_scale=pc.kv_scale)
        hi = ref.mla_decode(qn, qp, pc.values.to(s["dt"]), pc.seq_lens, pc.block_tables, scale=sc)
        c = cosine(q8, hi)
        return Outcome(c >= 0.999, f"cosine={c:.5f}", c, 0.999)

    return run


def _graph_replay(name, fp8=False, H=None):
    def run():
        b = registry.get("attention", name)
        s = dict(_shape("cuda"), **({"H": H} if H else {}))
        B, page, maxp = 4, 64, 40
        P = B * maxp
        pc, qn, qp = _problem("cuda", s, 61, lens=[5] * B)
        cache = (torch.randn(P, page, s["R"] + s["Dr"], device="cuda") * 0.5).to(s["dt"])
        ks = None
        if fp8:
            ks = torch.tensor([float(cache.float().abs().max()) / 448.0], device="cuda")
            cache = (cache.float() / ks).to(torch.float8_e4m3fn)
        lens = torch.tensor([5, 64, 65, 700], dtype=torch.int32, device="cuda")
        tables = torch.randperm(P, device="cuda").view(B, maxp).to(torch.int32).contiguous()
        ws = b("make_workspace", B, s["H"], s["R"], "cuda")
        call = lambda: b("mla_decode", qn, qp, cache, lens, tables, scale=0.05, kv_scale=ks, workspace=ws)  # noqa: E731
        call()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = call()
        worst, cos = 0.0, 1.0
        for new in ([2000, 1, 0, 2559], [64, 128, 192, 256]):
            lens.copy_(torch.tensor(new, dtype=torch.int32))
            tables.copy_(torch.randperm(P, device="cuda").view(B, maxp))
            g.replay()
            want = ref.mla_decode(qn, qp, cache, lens, tables, scale=0.05, kv_scale=ks)
            worst = max(worst, compare(out, want, s["dt"], scale=2.0 if fp8 else 1.0).worst_ratio)
            cos = min(cos, cosine(out, want))
        return Outcome(worst <= 1.0 and cos >= 0.9995, f"worst/tol={worst:.3g} cosine>={cos:.6f} over 2 re-plans",
                       worst, 1.0)

    return run


def _bad_indices(device, name):
    def run():
        s = _shape(device)
        pc, qn, qp = _problem(device, s, 71, lens=[10, 20])
        f = registry.get("attention", name).fn("mla_sparse_decode")
        args = (qn, qp, pc.cache, pc.seq_lens, pc.block_tables)
        bad = {"duplicate": [[1, 1], [2, 3]], "out of range": [[0, 10], [1, 2]]}
        return probe_errors({what: ("indices", lambda i=i: f(*args, torch.tensor(i, dtype=torch.int32, device=device),
                                                             scale=0.1)) for what, i in bad.items()})

    return run


def _append(device, name, fp8):
    def run():
        s = _shape(device)
        dt = torch.float8_e4m3fn if fp8 else s["dt"]
        g = torch.Generator().manual_seed(81)
        ckv = torch.randn(9, s["R"], generator=g).to(device, s["dt"])
        kpe = torch.randn(9, s["Dr"], generator=g).to(device, s["dt"])
        scale = torch.tensor([0.25], device=device) if fp8 else None
        if fp8 and device == "cpu":  # fp8-grid values: the interpreter's fp8 rounding is not RTNE
            ckv = (ckv.float() * 4).to(dt).float().to(s["dt"]) / 4
            kpe = (kpe.float() * 4).to(dt).float().to(s["dt"]) / 4
        base = torch.randn(3, s["page"], s["R"] + s["Dr"], generator=g).to(device, dt)
        slots = torch.tensor([0, 5, -1, 17, 33, 2, 40, 47, -1], dtype=torch.int32, device=device)
        a, b = base.clone(), base.clone()
        ref.append_mla(ckv, kpe, a, slots, scale)
        registry.get("kv_append", name)("append_mla", ckv, kpe, b, slots, scale)
        same = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return Outcome(same, "bit-exact" if same else f"{int((a.view(torch.uint8) != b.view(torch.uint8)).sum())} bytes differ")

    return run


def _norm_rope_append(device, name):
    """norm_rope_append_mla against the reference entry (norm, rope, append): q_pe, kpe and the
    cache rows, a padding slot among them."""
    def run():
        s = _shape(device)
        R, Dr, dt = s["R"], s["Dr"], s["dt"]
        g = torch.Generator().manual_seed(82)
        q = torch.randn(9, 16, 32 + Dr, generator=g).to(device, dt)
        kva = torch.randn(9, R + Dr, generator=g).to(device, dt)
        w = (1 + 0.1 * torch.randn(R, generator=g)).to(device, dt)
        pos = torch.randint(0, 500, (9,), generator=g).to(device)
        inv = 1.0 / (10000 ** (torch.arange(0, Dr, 2).float() / Dr))
        cs = torch.cat([(torch.arange(512).float()[:, None] * inv).cos(),
                        (torch.arange(512).float()[:, None] * inv).sin()], 1).to(device).contiguous()
        slots = torch.tensor([0, 5, -1, 17, 33, 2, 40, 47, 9], dtype=torch.int32, device=device)
        cache = torch.zeros(3, s["page"], R + Dr, device=device, dtype=dt)
        q2, kva2, cache2 = q.clone(), kva.clone(), cache.clone()
        ref.norm_rope_append_mla(q2[..., 32:], kva2, w, 1e-6, pos, cs, "gptj", cache2, slots)
        registry.get("kv_append", name)("norm_rope_append_mla", q[..., 32:], kva, w, 1e-6, pos, cs, "gptj", cache,
                                        slots)
        e = compare(cache.float(), cache2.float(), dt)
        ok = e.ok and torch.equal(q, q2) and torch.equal(kva[:, R:], kva2[:, R:])
        return Outcome(ok, str(e) if ok else f"q_pe / kpe / cache differ from the reference ({e})")

    return run


def _runnable(op, spec):
    return [b.name for b in registry.backends(op)
            if b.name != "mla-reference" and b.name.startswith("mla-") and not b.validate(spec, runtime=True)]


def cases(device: str, quick: bool) -> list[CheckCase]:
    s = _shape(device)
    arch = "cpu" if device == "cpu" else None
    if arch is None:
        arch = hw.local_arch()
    dts = {torch.float32: "fp32", torch.bfloat16: "bf16"}[s["dt"]]
    spec = AttentionSpec(kind="mla", num_heads=s["H"], num_kv_heads=1, head_dim=s["R"] + s["Dr"],
                         head_dim_v=s["R"], page_size=s["page"], dtype=dts, kv_dtype=dts, arch=arch)
    shape = f"R={s['R']},Dr={s['Dr']},h={s['H']},dtype={dts}"
    shape128 = f"R={s['R']},Dr={s['Dr']},h=128,dtype={dts}"
    out = [CheckCase("parity", "attention", "mla-reference", f"decode vs fp64 SDPA,{shape}", _ref_vs_sdpa(device),
                     tags=TAGS)]
    narrow = _runnable("attention", spec)
    for name in narrow:
        out.append(CheckCase("gqa-mla", "attention", name, f"decode,page={s['page']},{shape}",
                             _decode(device, name, s["page"]), tags=TAGS))
    # 128 heads on the GPU: every backend serving them; in the quick run too for one that serves no
    # fewer than 64 heads (its only decode case)
    for name in _runnable("attention", spec.replace(num_heads=128)) if device == "cuda" else []:
        out.append(CheckCase("gqa-mla", "attention", name, f"decode,page={s['page']},{shape128}",
                             _decode(device, name, s["page"], H=128), tags=TAGS, quick=name not in narrow))
    for name in _runnable("attention", spec.replace(page_size=1)):
        out.append(CheckCase("boundaries", "attention", name, "decode,page=1,lens at page edges",
                             _decode(device, name, 1), tags=TAGS, quick=False))
    sparse = spec.replace(sparse=True)
    for name in _runnable("attention", sparse):
        out.append(CheckCase("gqa-mla", "attention", name, f"sparse decode,{shape}", _sparse(device, name), tags=TAGS))
        out.append(CheckCase("input", "attention", name, "sparse indices: duplicate / out of range",
                             _bad_indices(device, name), tags=TAGS))
    for name in _runnable("attention", spec.replace(phase="prefill")):
        out.append(CheckCase("gqa-mla", "attention", name, f"prefill (prefix, causal, varlen),{shape}",
                             _prefill(device, name), tags=TAGS))
    f8 = spec.replace(kv_dtype="fp8")
    for name in _runnable("attention", f8):
        out.append(CheckCase("quant", "attention", name, f"decode fp8 cache vs {dts},{shape}",
                             _fp8_quality(device, name), tags=TAGS))
        out.append(CheckCase("quant", "attention", name, f"decode fp8 cache,page={s['page']},{shape}",
                             _decode(device, name, s["page"], fp8=True), tags=TAGS))
        if device == "cuda":
            out.append(CheckCase("quant", "attention", name, f"decode fp8 cache,page={s['page']},{shape128}",
                                 _decode(device, name, s["page"], H=128, fp8=True), tags=TAGS, quick=False))
    if device == "cuda":
        for kv in (dts, "fp8"):
            graphed = spec.replace(kv_dtype=kv, cuda_graph=True)
            narrow_graphed = _runnable("attention", graphed)
            for name in narrow_graphed:
                if "make_workspace" in registry.get("attention", name).impl:
                    out.append(CheckCase("graph", "attention", name, f"decode replay after re-planning,h=16,kv={kv}",
                                         _graph_replay(name, fp8=kv == "fp8"), device="cuda", tags=TAGS))
            for name in _runnable("attention", graphed.replace(num_heads=128)):
                if name not in narrow_graphed and "make_workspace" in registry.get("attention", name).impl:
                    out.append(CheckCase("graph", "attention", name, f"decode replay after re-planning,h=128,kv={kv}",
                                         _graph_replay(name, fp8=kv == "fp8", H=128), device="cuda", tags=TAGS))
    app = KVAppendSpec(kind="mla", num_kv_heads=1, head_dim=s["R"] + s["Dr"], page_size=s["page"],
                       dtype=dts, kv_dtype=dts, arch=arch)
    for name in [b.name for b in registry.backends("kv_append")
                 if b.name.startswith("mla-") and b.name != "mla-reference" and not b.validate(app, runtime=True)]:
        for fp8 in (False, True):
            out.append(CheckCase("gqa-mla" if not fp8 else "quant", "kv_append", name,
                                 f"append_mla,kv={'fp8' if fp8 else dts}", _append(device, name, fp8), tags=TAGS))
        if "norm_rope_append_mla" in registry.get("kv_append", name).impl:
            out.append(CheckCase("gqa-mla", "kv_append", name, f"norm_rope_append_mla (one launch),kv={dts}",
                                 _norm_rope_append(device, name), tags=TAGS))
    return out
