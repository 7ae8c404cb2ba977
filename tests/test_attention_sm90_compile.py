"""The attention kernels compile for sm90 on this CPU-only machine (Triton's AOT path and its
bundled ptxas), without spills and within shared memory, and their key loops are software
pipelined: with the page ids prefetched one tile ahead (PREFETCH=1, the default) the TTGIR's
per-iteration wait lets num_stages - 1 copies stay in flight (``ttg.async_wait {num = 2}`` at 3
stages); with the page-table load inside the iteration (PREFETCH=0) Triton 3.6 waits for every
copy (num = 0), so loads and MMAs do not overlap. A refactor that loses the pipeline fails here.
Runs in a subprocess because the interpreter (TRITON_INTERPRET=1) replaces @triton.jit here."""
import torch
from sm90_compile import needs_ptxas, run

SCRIPT = r'''
from opmap.kernels.attention import prefill as P
from opmap.kernels.attention import decode as Dm
def comp(fn, sig, ce, opts):
    div = [i for i, n in enumerate(sig) if n.endswith("_ptr") or n.startswith("s_")]
    return usage(compile_sm90(fn, sig, ce, opts, div))
psig = {"q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "o_ptr": "*bf16", "lse_ptr": "*fp32", "cu_ptr": "*i32",
       "sl_ptr": "*i32", "bt_ptr": "*i32", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "scale": "fp32", "soft_cap": "fp32",
       "window": "i32", "B": "i32"}
for n in ["s_qt", "s_qh", "s_ot", "s_oh", "s_bt", "s_kp", "s_ks", "s_kh", "s_vp", "s_vs", "s_vh"]:
    psig[n] = "i32"
for n in ["GROUP", "D", "DV", "PAGE", "BLOCK_M", "BLOCK_N", "CAUSAL", "HAS_WINDOW", "HAS_CAP", "FP8", "RETURN_LSE", "IEEE", "SKIP_SINGLE", "PREFETCH"]:
    psig[n] = "constexpr"
dsig = {"q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "o_ptr": "*bf16", "lse_ptr": "*fp32", "po_ptr": "*fp32", "pl_ptr": "*fp32",
        "sl_ptr": "*i32", "bt_ptr": "*i32", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "cu_ptr": "*i32",
        "scale": "fp32", "soft_cap": "fp32", "window": "i32", "split_tokens": "i32", "max_splits": "i32", "min_chunk": "i32"}
for n in ["s_qb", "s_qh", "s_ob", "s_oh", "s_bt", "s_kp", "s_ks", "s_kh", "s_vp", "s_vs", "s_vh", "s_pob", "s_poh", "s_pos", "s_plb", "s_plh"]:
    dsig[n] = "i32"
for n in ["GROUP", "D", "DV", "PAGE", "BLOCK_H", "BLOCK_N", "HAS_WINDOW", "HAS_CAP", "FP8", "RETURN_LSE", "IEEE", "Q_FROM_CU", "PREFETCH",
          "F16", "ASM"]:
    dsig[n] = "constexpr"
out = {}
from opmap.kernels.attention.common import _default_config
import torch
for d in (64, 128):
    for pf in (0, 1):
        cfg = _default_config("prefill", d, 4, torch.device("cuda"))
        ce = dict(GROUP=4, D=d, DV=d, PAGE=16, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=True,
                  HAS_WINDOW=False, HAS_CAP=False, FP8=False, RETURN_LSE=True, IEEE=False, SKIP_SINGLE=False, PREFETCH=pf)
        out[f"prefill-d{d}-pf{pf}"] = comp(P._prefill_kernel, psig, ce, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
# fp32 (the engine checks' dtype on a GPU): its own small tiles (FMA-lowered IEEE dots, not pipelined)
cfg = _default_config("prefill", 128, 4, torch.device("cuda"), ieee=True)
ce = dict(GROUP=4, D=128, DV=128, PAGE=16, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=True, HAS_WINDOW=False,
          HAS_CAP=False, FP8=False, RETURN_LSE=False, IEEE=True, SKIP_SINGLE=False, PREFETCH=1)
s32 = {k: ("*fp32" if v.startswith("*") and k not in ("cu_ptr", "sl_ptr", "bt_ptr") else v) for k, v in psig.items()}
out["prefill-fp32"] = comp(P._prefill_kernel, s32, ce, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
for d in (128, 256):
    for fp8 in (False, True):
        for pf in (0, 1):
            cfg = _default_config("decode", d, 4, torch.device("cuda"))
            ce = dict(GROUP=4, D=d, DV=d, PAGE=16, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], HAS_WINDOW=False,
                      HAS_CAP=False, FP8=fp8, RETURN_LSE=False, IEEE=False, Q_FROM_CU=False, PREFETCH=pf, F16=fp8, ASM=fp8)
            s = dict(dsig, kc_ptr="*fp8e4nv" if fp8 else "*bf16", vc_ptr="*fp8e4nv" if fp8 else "*bf16")
            out[f"decode-d{d}-fp8{int(fp8)}-pf{pf}"] = comp(Dm._decode_kernel, s, ce,
                                                          {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
print("RESULT " + json.dumps(out))
'''


@needs_ptxas
def test_attention_kernels_compile_pipelined_for_sm90():
    res = run(SCRIPT)
    assert len(res) == 13
    for name, r in res.items():
        assert r["local"] == 0, f"{name} spills: {r}"
        assert r["shared"] <= 227 * 1024, f"{name} needs {r['shared']} bytes of shared memory"
        pipelined = any(int(n) > 0 for n in r["waits"])
        assert pipelined == name.endswith("pf1"), f"{name}: waits {r['waits']}"
    for d in (64, 128):
        assert res[f"prefill-d{d}-pf1"]["wgmma"] >= 2  # QK^T and PV on Hopper warpgroup MMAs


def test_decode_prefetch_only_while_the_grid_is_small(monkeypatch):
    """The prefetch rule the H200 measurements chose: on while B x kv_heads <= 2 x SMs; an explicit
    PREFETCH in the override always wins."""
    from opmap.kernels.attention import decode as dec

    monkeypatch.setattr(dec, "sm_count", lambda device: 132)
    monkeypatch.setattr(dec, "kernel_config", lambda kind, d, g, device, override=None:
                        {"BLOCK_H": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PREFETCH": 1, **(override or {})})
    dev = torch.device("cuda")
    assert dec.decode_config(128, 4, 32, 8, dev)["PREFETCH"] == 1    # 256 programs
    assert dec.decode_config(128, 4, 33, 8, dev)["PREFETCH"] == 1    # 264 = 2 x 132
    assert dec.decode_config(128, 4, 34, 8, dev)["PREFETCH"] == 0    # 272
    assert dec.decode_config(128, 4, 64, 8, dev)["PREFETCH"] == 0
    assert dec.decode_config(128, 4, 128, 8, dev, {"PREFETCH": 1})["PREFETCH"] == 1
    assert dec.decode_config(128, 4, 1, 8, dev, {"PREFETCH": 0})["PREFETCH"] == 0


def test_decode_min_chunk_auto_and_explicit(monkeypatch):
    """64-key splits only when B x kv_heads <= SMs / 16 (batch 1, 8 KV heads on the H200); a
    workspace's explicit min_chunk always wins (the split plan both decode kernels share)."""
    from opmap.kernels.attention import splitkv as sk

    monkeypatch.setattr(sk, "sm_count", lambda device: 132)
    assert sk.auto_min_chunk(1, 8, "cuda") == 64 and sk.auto_min_chunk(2, 8, "cuda") == 256
    assert sk.auto_min_chunk(8, 1, "cuda") == 64 and sk.auto_min_chunk(64, 8, "cuda") == 256
    bt = torch.zeros(1, 4, dtype=torch.int32)
    out = torch.empty(1, 32, 128)
    auto = sk.make_workspace(1, 32, 128, device="cpu")
    fixed = sk.make_workspace(1, 32, 128, device="cpu", min_chunk=256)
    assert sk.plan(auto, out, 1, 32, 128, 8, 16, bt, "cpu").min_chunk == 64
    assert sk.plan(fixed, out, 1, 32, 128, 8, 16, bt, "cpu").min_chunk == 256
    assert sk.plan(auto, out, 1, 32, 128, 8, 16, bt, "cpu").splits == 32  # 2 x 132 // 8 = 33, capped at 32


FP8_SCRIPT = SCRIPT.split("out = {}")[0] + r'''
from opmap.kernels.attention.common import _default_config
import torch
cfg = _default_config("decode", 128, 4, torch.device("cuda"))
res = {}
for f16 in (False, True):
    ce = dict(GROUP=4, D=128, DV=128, PAGE=16, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], HAS_WINDOW=False,
              HAS_CAP=False, FP8=True, RETURN_LSE=False, IEEE=False, Q_FROM_CU=False, PREFETCH=1, F16=f16, ASM=f16)
    s = dict(dsig, kc_ptr="*fp8e4nv", vc_ptr="*fp8e4nv")
    k = compile_sm90(Dm._decode_kernel, s, ce, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
                     [i for i, n in enumerate(s) if n.endswith("_ptr") or n.startswith("s_")])
    res["f16" if f16 else "cast"] = {**usage(k), "ops": sass_ops(k)}
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_decode_fp8_tiles_cross_shared_memory_once_in_16_bytes():
    """The d128 decode on an fp8 cache (the default config). With Triton's cast to bf16 (F16=0, the
    path of fp32 queries) the sm90 build read the 1-byte K and V tiles back from shared memory byte by byte and
    converted them element by element (e4m3 -> f16 -> bf16): at B=64 / 4096 it took 261 us against
    bf16's 260, half the bytes for nothing. The default (kernels/attention/fp8.py) converts each tile
    once, packed, and feeds the dots by ldmatrix; pipelined as before, no stack."""
    res = run(FP8_SCRIPT)
    cast, f16 = res["cast"]["ops"], res["f16"]["ops"]
    assert cast.get("LDS.U8", 0) > 0 and cast.get("F2F.BF16.F16", 0) > 0, cast  # the build this replaces
    assert f16.get("LDS.U8", 0) == 0 and f16.get("STS.U8", 0) == 0 and f16.get("F2F.BF16.F16", 0) == 0, f16
    assert 0 < f16.get("F2FP.F16.E4M3.UNPACK", 0) <= cast["F2FP.F16.E4M3.UNPACK"], (f16, cast)
    assert f16.get("LDSM.16.M88.4", 0) > 0 and f16.get("HMMA.16816.F32", 0) > 0, f16
    r = res["f16"]
    assert r["stack"] == 0 and r["local"] == 0 and any(int(w) > 0 for w in r["waits"]), r


GLUON_SCRIPT = r'''
from opmap.kernels.attention import decode_fp8 as F
sig = {"q_ptr": "*bf16", "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv", "o_ptr": "*bf16", "lse_ptr": "*fp32",
       "po_ptr": "*fp32", "pl_ptr": "*fp32", "sl_ptr": "*i32", "bt_ptr": "*i32", "ks_ptr": "*fp32", "vs_ptr": "*fp32",
       "cu_ptr": "*i32", "scale": "fp32", "soft_cap": "fp32", "window": "i32", "split_tokens": "i32",
       "max_splits": "i32", "min_chunk": "i32"}
for n in ["s_qb", "s_qh", "s_ob", "s_oh", "s_bt", "s_kp", "s_ks", "s_kh", "s_vp", "s_vs", "s_vh", "s_pob", "s_poh",
          "s_pos", "s_plb", "s_plh"]:
    sig[n] = "i32"
res = {}
for bh, cap in ((8, False), (16, True)):
    ce = dict(GROUP=bh // 2, PAGE=16, BLOCK_H=bh, HAS_WINDOW=cap, HAS_CAP=cap, RETURN_LSE=True, Q_FROM_CU=False,
              PDL=True)
    s = dict(sig, **{k: "constexpr" for k in ce})
    div = [i for i, n in enumerate(s) if n.endswith("_ptr") or n.startswith("s_")]
    k = compile_gluon_sm90(F._fp8_decode_kernel, s, ce,
                           {"num_warps": F.NUM_WARPS, **({"maxnreg": F.MAX_REGISTERS} if bh == 8 else {})}, div)
    res[f"bh{bh}"] = {**usage(k), "loop": loop_ops(k)}
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_gluon_fp8_decode_reads_each_tile_once_from_shared_memory():
    """The Gluon fp8 decode (decode_fp8.py) as built for sm90: no spills, within the 128-register cap
    (four programs an SM) for groups of up to 8 heads, and its loop (two 64-key tiles) copies each tile in 16-byte async
    copies, reads it back in 16-byte shared loads straight into the MMA fragments (no shared
    stores, no ldmatrix), converts it packed, and synchronises once a tile."""
    res = run(GLUON_SCRIPT)
    for name, r in res.items():
        assert r["stack"] == 0 and r["local"] == 0, (name, r)
        assert r["reg"] <= 128 or name == "bh16", (name, r)
        loop = r["loop"]
        assert loop.get("LDGSTS.E.BYPASS.128") == 16 and loop.get("LDS.128") == 16, (name, loop)
        assert not any(op.startswith(("STS", "LDSM", "LDS.U8")) for op in loop), (name, loop)
        assert loop.get("F2FP.F16.E4M3.UNPACK_B") == 128, (name, loop)  # 2 tiles x 16 KB / 128 threads / 2
        assert loop.get("BAR.SYNC.DEFER_BLOCKING") == 2, (name, loop)
        assert loop.get("HMMA.16816.F32", 0) > 0, (name, loop)
