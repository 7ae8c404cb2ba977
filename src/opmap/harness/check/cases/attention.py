"""Attention (MHA/GQA/MQA) check cases: every runnable backend against the fp32 reference
(decode, chunked varlen prefill, mixed, page edges, window + soft-cap, fp8 caches; the TMA prefill
on 64-token pages), the reference against SDPA in fp64, fp8 KV quality (cosine >= 0.999 vs the
16-bit cache), CUDA-graph replay after re-planning and fixed-split batch invariance of each decode
backend with a workspace, KV append and LSE merge, and bad input.
CPU: fp32, 4/2 heads, d=64 (interpreter); GPU: bf16, 32/8 heads, d=128. Paged backends get the
paged cache; contiguous-only backends (SDPA) get the same data as [B, S, Hk, D]."""
from __future__ import annotations


import torch
import torch.nn.functional as F

from opmap.core import hw, registry
from opmap.core.specs import AttentionSpec, KVAppendSpec, MergeSpec
from opmap.core.tolerance import compare, cosine
from opmap.harness.check.base import CheckCase, Outcome, probe_errors, racecheck_child
from opmap.harness.fixtures.attention import make_paged, make_query
from opmap.ops.attention import reference as R
from opmap.ops.attention.reference import quantize_fp8
from opmap.ops.rope import reference as RR

DT = {"cpu": (torch.float32, "fp32"), "cuda": (torch.bfloat16, "bf16")}


# Under compute-sanitizer racecheck (the sanitizer driver sets OPMAP_SANITIZER_TOOL for its
# children) the longest sequences are capped: racecheck instruments every shared-memory access, so
# the 32k-key case took over 150 s per case on the H200, and a shared-memory race does not depend
# on how many key tiles a program walks. memcheck keeps the full lengths (address arithmetic does).
_RACECHECK = racecheck_child()


def _shape(device):
    if device == "cuda":
        if _RACECHECK:
            return dict(hq=32, hk=8, d=128, page=16, lens=[1, 15, 16, 17, 1025, 0, 300, 2049],
                        chunk=[1, 3, 16, 17, 512, 0, 1, 256], whole=[1, 15, 16, 17, 512, 0, 300, 256])
        return dict(hq=32, hk=8, d=128, page=16, lens=[1, 15, 16, 17, 4097, 0, 300, 32768],
                    chunk=[1, 3, 16, 17, 512, 0, 1, 256], whole=[1, 15, 16, 17, 2048, 0, 300, 1000])
    return dict(hq=4, hk=2, d=64, page=16, lens=[1, 15, 16, 17, 70, 0], chunk=[1, 3, 16, 5, 20, 0],
                whole=[1, 15, 16, 17, 70, 0])


def _vs(out, want, dt, scale=1.0) -> Outcome:
    e = compare(out, want, dt, scale=scale)
    c = cosine(out, want)
    return Outcome(e.ok and c >= 0.9995, f"{e} cosine={c:.6f}", e.worst_ratio, 1.0)


def _inputs(device, seed, lens, qlens, fp8=False, page=None, dtype=None):
    s = _shape(device)
    dt = dtype or DT[device][0]
    g = torch.Generator().manual_seed(seed)
    pc = make_paged(lens, s["hk"], s["d"], page or s["page"], dtype=dt, fp8=fp8, device=device, shared=True,
                    poison=fp8, generator=g)
    q, cu = make_query(qlens, s["hq"], s["d"], dtype=dt, device=device, generator=g)
    return s, pc, q, cu


def _ref(fn, q, pc, *a, **kw):
    kc, vc = pc.k_cache, pc.v_cache
    if kc.dtype != torch.float8_e4m3fn:
        kc, vc = kc.float(), vc.float()
    return fn(q.float(), kc, vc, *a, **kw)


def _call(name, entry, paged, q, pc, cu, **kw):
    b = registry.get("attention", name)
    kw.update(pc.kw)  # an fp8 cache's scales
    if paged:
        kc, vc, bt = pc.k_cache, pc.v_cache, pc.block_tables
    else:  # [B, S, Hk, D]: a paged cache with one page of S tokens per sequence, in order
        (kc, vc) = pc.contiguous(q.dtype)
        bt = torch.arange(kc.shape[0], dtype=torch.int32, device=q.device)[:, None]
    if entry == "decode":
        return b("decode", q, kc, vc, pc.seq_lens, bt, **kw)
    return b(entry, q, kc, vc, cu, pc.seq_lens, bt, **kw)


def _decode(device, name, paged, page=None, feats=False, fp8=False):
    """``fp8``: an e4m3 cache (NaN in its unused slots) against the reference on the same cache."""
    def run():
        s = _shape(device)
        s, pc, q, _ = _inputs(device, 11, s["lens"], [1] * len(s["lens"]), page=page, fp8=fp8)
        kw = dict(scale=s["d"] ** -0.5, window=(40 if feats else None), soft_cap=(30.0 if feats else None))
        out = _call(name, "decode", paged, q, pc, None, **kw)
        return _vs(out, _ref(R.decode, q, pc, pc.seq_lens, pc.block_tables, **kw, **pc.kw), q.dtype,
                   scale=2.0 if fp8 else 1.0)

    return run


def _prefill(device, name, paged, entry="prefill", feats=False, fp8=False, page=None):
    def run():
        s = _shape(device)
        # cuDNN SDPA takes whole prompts only (no bottom-right mask, declared); the rest get chunks
        # over cached prefixes, a zero-token sequence and decode tokens in one varlen batch. Pages of
        # 64 (the TMA prefill's): lengths at the 64-key tile edges too.
        lens, ql = (s["whole"], s["whole"]) if name == "sdpa_cudnn" else (s["lens"], s["chunk"])
        if page == 64:
            lens, ql = [1, 63, 64, 65, 1025, 0, 300], [1, 3, 64, 65, 512, 0, 1]
        s, pc, q, cu = _inputs(device, 12, lens, ql, fp8=fp8, page=page)
        kw = dict(scale=s["d"] ** -0.5, window=(40 if feats else None), soft_cap=(30.0 if feats else None))
        out = _call(name, entry, paged, q, pc, cu, **kw)
        return _vs(out, _ref(R.prefill, q, pc, cu, pc.seq_lens, pc.block_tables, **kw, **pc.kw), q.dtype,
                   scale=2.0 if fp8 else 1.0)

    return run


def _ref_vs_sdpa(device):
    def run():
        s, pc, q, cu = _inputs(device, 13, [40, 17], [9, 17], dtype=torch.float32)
        out = R.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, scale=0.1, acc=torch.float64)
        worst = 0.0
        for b, (L, n) in enumerate(zip([40, 17], [9, 17])):
            k = R.gather_kv(pc.k_cache, pc.block_tables[b], L).double().transpose(0, 1)[None]
            v = R.gather_kv(pc.v_cache, pc.block_tables[b], L).double().transpose(0, 1)[None]
            s0 = int(cu[b])
            qq = q[s0:s0 + n].double().transpose(0, 1)[None]
            mask = torch.arange(L, device=q.device)[None] <= torch.arange(L - n, L, device=q.device)[:, None]
            want = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=0.1, enable_gqa=True)
            worst = max(worst, compare(out[s0:s0 + n], want[0].transpose(0, 1), torch.float32).worst_ratio)
        return Outcome(worst <= 1.0, f"worst/tol={worst:.3g}", worst, 1.0)

    return run


def _fp8_quality(device, name, entry):
    """The backend on the fp8 copy of a cache against the fp32 reference on the 16-bit cache."""
    def run():
        s = _shape(device)
        lens = [70, 300] if device == "cpu" else ([300, 1000] if _RACECHECK else [1000, 5000])
        s, pc, q, cu = _inputs(device, 14, lens, [1, 1] if entry == "decode" else [20, 64])
        hk, d = s["hk"], s["d"]
        ks = pc.k_cache.float().abs().amax(dim=(0, 1, 3)) / 448.0
        vs = pc.v_cache.float().abs().amax(dim=(0, 1, 3)) / 448.0
        k8 = quantize_fp8(pc.k_cache.view(-1, hk, d), ks).view(pc.k_cache.shape)
        v8 = quantize_fp8(pc.v_cache.view(-1, hk, d), vs).view(pc.v_cache.shape)
        f = registry.get("attention", name).fn(entry)
        mid = () if entry == "decode" else (cu,)
        hi = getattr(R, entry)(q.float(), pc.k_cache.float(), pc.v_cache.float(), *mid, pc.seq_lens, pc.block_tables,
                               scale=d ** -0.5)
        lo = f(q, k8, v8, *mid, pc.seq_lens, pc.block_tables, scale=d ** -0.5, k_scale=ks, v_scale=vs)
        c = cosine(lo, hi)
        err = float((lo.float() - hi.float()).abs().max())
        return Outcome(c >= 0.999, f"cosine={c:.5f} max_abs={err:.3g}", c, 0.999)

    return run


def _graph_replay(name, fp8=False):
    """The backend's decode captured once with its workspace, replayed after lengths and block tables
    are rewritten in place (fp8: an e4m3 cache with per-kv-head scales)."""
    def run():
        b = registry.get("attention", name)
        B, hq, hk, d, page, maxp, P = 4, 32, 8, 128, 16, 300, 2000
        g = torch.Generator().manual_seed(15)
        kc = torch.randn(P, page, hk, d, generator=g).to("cuda", torch.bfloat16)
        vc = torch.randn(P, page, hk, d, generator=g).to("cuda", torch.bfloat16)
        sc = {}
        if fp8:
            sc = dict(k_scale=kc.float().abs().amax(dim=(0, 1, 3)) / 448.0,
                      v_scale=vc.float().abs().amax(dim=(0, 1, 3)) / 448.0)
            kc = R.quantize_fp8(kc.view(-1, hk, d), sc["k_scale"]).view(kc.shape)
            vc = R.quantize_fp8(vc.view(-1, hk, d), sc["v_scale"]).view(vc.shape)
        q = torch.randn(B, hq, d, generator=g).to("cuda", torch.bfloat16)
        lens = torch.tensor([5, 64, 65, 700], dtype=torch.int32, device="cuda")
        tables = torch.randperm(P, generator=g)[:B * maxp].view(B, maxp).int().to("cuda")
        ws = b("make_workspace", B, hq, d, device="cuda")
        call = lambda: b("decode", q, kc, vc, lens, tables, scale=0.088, workspace=ws, **sc)  # noqa: E731
        call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        worst, cos = 0.0, 1.0
        kr, vr = (kc, vc) if fp8 else (kc.float(), vc.float())
        for new in ([4800, 1, 0, 2559], [16, 17, 4799, 300]):
            lens.copy_(torch.tensor(new, dtype=torch.int32))
            tables.copy_(torch.randperm(P, generator=g)[:B * maxp].view(B, maxp))
            graph.replay()
            want = R.decode(q.float(), kr, vr, lens, tables, scale=0.088, **sc)
            worst = max(worst, compare(out, want, torch.bfloat16, scale=2.0 if fp8 else 1.0).worst_ratio)
            cos = min(cos, cosine(out, want))
        return Outcome(worst <= 1.0 and cos >= 0.9995, f"worst/tol={worst:.3g} cosine>={cos:.6f} over 2 re-plans",
                       worst, 1.0)

    return run


def _batch_invariance(device, name, fp8=False):
    def run():
        b = registry.get("attention", name)
        s = _shape(device)
        s, pc, q, _ = _inputs(device, 16, s["lens"], [1] * len(s["lens"]), fp8=fp8)
        width = pc.block_tables.shape[1] * s["page"]
        ws = lambda B: b("make_workspace", B, s["hq"], s["d"], device=device, batch_invariant=True,  # noqa: E731
                         split_tokens=32 if device == "cpu" else None, max_seq_len=width)
        full = b("decode", q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.1,
                 workspace=ws(q.shape[0]), **pc.kw)
        sub = [4, 0]
        part = b("decode", q[sub], pc.k_cache, pc.v_cache, pc.seq_lens[sub], pc.block_tables[sub], scale=0.1,
                 workspace=ws(2), **pc.kw)
        same = torch.equal(part, full[sub])
        return Outcome(same, "sub-batch rows bitwise equal" if same else "sub-batch rows differ")

    return run


def _bad_input(device, name):
    def run():
        s, pc, q, cu = _inputs(device, 17, [20, 5], [20, 5])
        f = registry.get("attention", name).fn("prefill")
        bad_bt = pc.block_tables.clone()
        bad_bt[0, 0] = pc.k_cache.shape[0]
        probes = {
            "page id out of range": ("block_tables", lambda: f(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, bad_bt,
                                                                scale=0.1)),
            "length beyond pages owned": ("seq_lens", lambda: f(
                q, pc.k_cache, pc.v_cache, cu, pc.seq_lens * 0 + 10 ** 5, pc.block_tables, scale=0.1)),
            "heads not divisible": ("q", lambda: f(q[:, :3], pc.k_cache, pc.v_cache, cu, pc.seq_lens,
                                                   pc.block_tables, scale=0.1)),
            "wrong dtype": ("seq_lens", lambda: f(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens.long(),
                                                  pc.block_tables, scale=0.1)),
        }
        return probe_errors(probes)

    return run


def _append(device, name, fp8):
    def run():
        s = _shape(device)
        g = torch.Generator().manual_seed(18)
        dt = DT[device][0]
        cdt = torch.float8_e4m3fn if fp8 else dt
        k = torch.randn(9, s["hk"], s["d"], generator=g).to(device, dt)
        v = torch.randn(9, s["hk"], s["d"], generator=g).to(device, dt)
        sc = dict(k_scale=torch.rand(s["hk"], generator=g).to(device) + 0.1,
                  v_scale=torch.rand(s["hk"], generator=g).to(device) + 0.1) if fp8 else {}
        base = torch.randn(3, s["page"], s["hk"], s["d"], generator=g).to(device).to(cdt)
        slots = torch.tensor([0, 5, -1, 17, 33, 2, 40, 47, -1], dtype=torch.int64, device=device)
        ak, av, bk, bv = base.clone(), base.clone(), base.clone(), base.clone()
        R.append(k, v, ak, av, slots, **sc)
        registry.get("kv_append", name)("append", k, v, bk, bv, slots, **sc)
        same = torch.equal(ak.view(torch.uint8), bk.view(torch.uint8)) and torch.equal(av.view(torch.uint8),
                                                                                      bv.view(torch.uint8))
        return Outcome(same, "bit-exact" if same else "bytes differ")

    return run


def _rope_append(device, name, qk_norm=False):
    """The fused entry against the backend's own rope then append (bitwise; with Qwen3's q/k norm
    first, within the dtype's rounding: the norms' row sums may reduce in another order) and the
    fp32-math reference composition (tolerance)."""
    def run():
        s = _shape(device)
        g = torch.Generator().manual_seed(20)
        dt = DT[device][0]
        T, hq, hk, d = 9, s["hq"], s["hk"], s["d"]
        qkv = torch.randn(T, hq + 2 * hk, d, generator=g).to(device, dt)
        pos = torch.tensor([0, 1, 15, 16, 17, 1000, 4095, 7, 3], device=device)
        cs = RR.cos_sin_cache(d, 4096, theta=500000.0, device=device)
        base = torch.randn(3, s["page"], hk, d, generator=g).to(device, dt)
        slots = torch.tensor([0, 5, -1, 17, 33, 2, 40, 47, -1], dtype=torch.int64, device=device)
        wq = (torch.rand(d, generator=g) + 0.5).to(device, dt)
        wk = (torch.rand(d, generator=g) + 0.5).to(device, dt)
        norm = dict(qk_norm=(wq, wk, 1e-6)) if qk_norm else {}
        runs = []
        for how in ("fused", "separate", "reference"):
            x, kc, vc = qkv.clone(), base.clone(), base.clone()
            q, k, v = x[:, :hq], x[:, hq:hq + hk], x[:, hq + hk:]
            if how == "fused":
                registry.get("kv_append", name)("rope_append", q, k, v, pos, cs, "neox", kc, vc, slots, **norm)
            elif how == "separate":
                if qk_norm:
                    registry.get("rmsnorm", name)("qk_rmsnorm", x[:, :hq + hk], wq, wk, hq, 1e-6)
                registry.get("rope", name)("rope", q, k, pos, cs, "neox")
                registry.get("kv_append", name)("append", k, v, kc, vc, slots)
            else:  # in fp32 copies of the same rounded inputs (.float() of fp32 is no copy)
                x, kc, vc = (t.to(torch.float32, copy=True) for t in (qkv, base, base))
                if qk_norm:  # the norms round to dt as HF's do; the reference of it is in dt
                    xs = qkv.clone()
                    registry.get("rmsnorm", "reference")("qk_rmsnorm", xs[:, :hq + hk], wq, wk, hq, 1e-6)
                    x = xs.to(torch.float32, copy=True)
                R.rope_append(x[:, :hq], x[:, hq:hq + hk], x[:, hq + hk:], pos, cs, "neox", kc, vc, slots)
            runs.append((x, kc, vc))
        (xa, ka, va), (xb, kb, vb), (xr, kr, vr) = runs
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in ((xa, xb), (ka, kb), (va, vb)))
        e_sep = compare(torch.cat([xa.flatten(), ka.flatten()]), torch.cat([xb.flatten(), kb.flatten()]), dt)
        e = compare(torch.cat([xa.flatten(), ka.flatten()]), torch.cat([xr.flatten(), kr.flatten()]), dt)
        ok = (same or (qk_norm and e_sep.ok)) and e.ok and torch.equal(va.float(), vr)
        what = "bitwise equal" if same else f"vs the separate launches {e_sep}"
        return Outcome(ok, f"{what}; vs fp32 reference: {e}", e.worst_ratio, 1.0)

    return run


def _merge(device, name):
    def run():
        dt = DT[device][0]
        g = torch.Generator().manual_seed(19)
        oa, ob = (torch.randn(17, 8, 64, generator=g).to(device, dt) for _ in range(2))
        la, lb = (torch.randn(17, 8, generator=g).to(device) * 4 for _ in range(2))
        la[0] = float("-inf")
        o, lse = registry.get("attention_merge", name)("merge", oa, la, ob, lb)
        ro, rl = R.merge(oa.float(), la, ob.float(), lb)
        e1, e2 = compare(o, ro, dt), compare(lse, rl, torch.float32)
        return Outcome(e1.ok and e2.ok, f"out {e1}; lse {e2}", max(e1.worst_ratio, e2.worst_ratio), 1.0)

    return run


def _runnable(op, spec, skip=("reference",)):
    return [b.name for b in registry.backends(op)
            if b.name not in skip and not b.name.startswith("mla-") and not b.validate(spec, runtime=True)]


def cases(device: str, quick: bool) -> list[CheckCase]:
    s = _shape(device)
    arch = "cpu" if device == "cpu" else hw.local_arch()
    dts = DT[device][1]
    base = AttentionSpec(arch=arch, num_heads=s["hq"], num_kv_heads=s["hk"], head_dim=s["d"], page_size=s["page"],
                         dtype=dts, kv_dtype=dts)
    shape = f"h={s['hq']}/{s['hk']},d={s['d']},page={s['page']},dtype={dts}"
    out = [CheckCase("parity", "attention", "reference", "prefill vs fp64 SDPA,gqa,chunk", _ref_vs_sdpa(device))]
    for paged in (True, False):
        sp = base.replace(paged=paged)
        kind = "" if paged else ",contiguous"
        for name in _runnable("attention", sp.replace(phase="decode")):
            out.append(CheckCase("parity", "attention", name, f"decode,{shape}{kind}", _decode(device, name, paged)))
        for name in _runnable("attention", sp.replace(phase="prefill")):
            out.append(CheckCase("parity", "attention", name, f"prefill varlen,{shape}{kind}",
                                 _prefill(device, name, paged)))
        for name in _runnable("attention", sp.replace(phase="mixed")):
            out.append(CheckCase("gqa-mla", "attention", name, f"mixed,{shape}{kind}",
                                 _prefill(device, name, paged, entry="mixed"), quick=False))
        feat = sp.replace(sliding_window=True, soft_cap=True)
        for name in _runnable("attention", feat.replace(phase="decode")):
            out.append(CheckCase("boundaries", "attention", name, f"decode window+soft-cap,{shape}{kind}",
                                 _decode(device, name, paged, feats=True), quick=False))
        for name in _runnable("attention", feat.replace(phase="prefill")):
            out.append(CheckCase("boundaries", "attention", name, f"prefill window+soft-cap,{shape}{kind}",
                                 _prefill(device, name, paged, feats=True), quick=False))
    for name in _runnable("attention", base.replace(phase="decode", page_size=1)):
        out.append(CheckCase("boundaries", "attention", name, "decode,page=1,lens at page edges",
                             _decode(device, name, True, page=1), quick=False))
    for entry in ("decode", "prefill"):
        for name in _runnable("attention", base.replace(phase=entry, kv_dtype="fp8")):
            out.append(CheckCase("quant", "attention", name, f"{entry} fp8 KV vs {dts},{shape}",
                                 _fp8_quality(device, name, entry)))
    # fp8 caches against the reference on the same cache (the GPU shape: head dim 128, where the
    # Gluon decode serves; NaN in the unused slots), decode and the mixed step's decode tokens
    f8 = base.replace(kv_dtype="fp8")
    for name in _runnable("attention", f8.replace(phase="decode")):
        out.append(CheckCase("quant", "attention", name, f"decode fp8 KV,{shape}", _decode(device, name, True, fp8=True)))
    for name in _runnable("attention", f8.replace(phase="mixed")):
        out.append(CheckCase("quant", "attention", name, f"mixed fp8 KV,{shape}",
                             _prefill(device, name, True, entry="mixed", fp8=True), quick=False))
    for name in _runnable("attention", base.replace(batch_invariant=True)):
        if "make_workspace" not in registry.get("attention", name).impl:
            continue
        out.append(CheckCase("boundaries", "attention", name, "decode fixed-split batch invariance",
                             _batch_invariance(device, name)))
    for name in _runnable("attention", f8.replace(batch_invariant=True)):
        if "make_workspace" in registry.get("attention", name).impl and name != "triton":
            out.append(CheckCase("boundaries", "attention", name, "decode fixed-split batch invariance,kv=fp8",
                                 _batch_invariance(device, name, fp8=True)))
    if "triton" in _runnable("attention", base.replace(phase="prefill")):
        out.append(CheckCase("input", "attention", "triton", "page id / length / heads / dtype errors",
                             _bad_input(device, "triton")))
    for name in _runnable("attention", base.replace(phase="prefill", page_size=64)):
        if name not in _runnable("attention", base.replace(phase="prefill")):  # served at pages of 64 only
            out.append(CheckCase("boundaries", "attention", name,
                                 f"prefill at 64-key tile edges,h={s['hq']}/{s['hk']},d={s['d']},page=64,dtype={dts}",
                                 _prefill(device, name, True, page=64), quick=False))
    if device == "cuda":
        for kv in ("bf16", "fp8"):
            for name in _runnable("attention", base.replace(kv_dtype=kv, cuda_graph=True)):
                if "make_workspace" in registry.get("attention", name).impl:
                    out.append(CheckCase("graph", "attention", name, f"decode replay after re-planning,h=32/8,kv={kv}",
                                         _graph_replay(name, fp8=kv == "fp8"), device="cuda"))
    app = KVAppendSpec(arch=arch, num_kv_heads=s["hk"], head_dim=s["d"], page_size=s["page"], dtype=dts, kv_dtype=dts)
    for name in _runnable("kv_append", app):
        out.append(CheckCase("parity", "kv_append", name, f"append,kv={dts}", _append(device, name, False)))
        if "rope_append" in registry.get("kv_append", name).impl:
            out.append(CheckCase("parity", "kv_append", name, f"rope_append (one launch),h={s['hq']}/{s['hk']},"
                                 f"kv={dts}", _rope_append(device, name)))
            out.append(CheckCase("parity", "kv_append", name, f"q/k norm + rope_append (one launch),"
                                 f"h={s['hq']}/{s['hk']},kv={dts}", _rope_append(device, name, qk_norm=True)))
    if device == "cuda":  # the interpreter's fp8 rounding differs (see tests/test_kv_append.py)
        for name in _runnable("kv_append", app.replace(kv_dtype="fp8")):
            out.append(CheckCase("quant", "kv_append", name, "append,kv=fp8", _append(device, name, True)))
    for name in _runnable("attention_merge", MergeSpec(arch=arch, num_heads=8, head_dim=64, dtype=dts)):
        out.append(CheckCase("parity", "attention_merge", name, f"merge,dtype={dts}", _merge(device, name)))
    return out
