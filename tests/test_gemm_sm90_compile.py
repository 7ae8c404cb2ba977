"""The dense-op Triton kernels compile for sm90 (H200) on this CPU-only machine: Triton's
ahead-of-time path lowers them to PTX and runs the bundled ptxas, so an inline-asm typo, a
layout the Hopper backend rejects, or a register spill is caught here rather than on the GPU.
Runs in a subprocess because the interpreter (TRITON_INTERPRET=1) replaces @triton.jit here."""
from sm90_compile import needs_ptxas, run

SCRIPT = r'''
from opmap.kernels.gemm import triton_gemm as g
from opmap.kernels.norm import triton_norm as n
from opmap.kernels.rope import triton_rope as r
from opmap.kernels.activation import triton_act as a

res = {}

def comp(name, fn, sig, ce, opts, div):
    res[name] = usage(compile_sm90(fn, sig, ce, opts, div))

gsig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*fp32", "b_ptr": "*bf16", "o_ptr": "*bf16", "ws_ptr": "*fp32",
        "cnt_ptr": "*i32", "a_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
        "stride_om": "i32", "stride_am": "i32", "K_PER_SPLIT": "i32",
        "W_KIND": "constexpr", "HAS_SCALE": "constexpr", "HAS_BIAS": "constexpr", "SPLIT": "constexpr",
        "EVEN_K": "constexpr", "PREC": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
GDIV = [i for i, n in enumerate(gsig) if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K", "K_PER_SPLIT")]
for name, wdt, kind, bm, bn, split, (bk, nw, ns) in [
        ("gemm-bf16-m16", "*bf16", g.W_SAME, 16, 64, 1, g.DEFAULT[(True, 64)]),
        ("gemm-fp8-m32", "*fp8e4nv", g.W_FP8, 32, 64, 1, (256, 4, 4)),
        ("gemm-int8-m16", "*i8", g.W_INT8, 16, 64, 1, (256, 4, 6)),
        ("gemm-bf16-m64", "*bf16", g.W_SAME, 64, 128, 1, g.DEFAULT[(True, 128)]),
        ("gemm-int8-m64-8warps", "*i8", g.W_INT8, 64, 128, 1, (128, 8, 4)),
        ("gemm-bf16-m64-split", "*bf16", g.W_SAME, 64, 128, 9, g.DEFAULT[(True, 128)]),
        ("gemm-fp8-m16-split", "*fp8e4nv", g.W_FP8, 16, 64, 4, g.DEFAULT[(True, 64)]),
        # config BLOCK_N 16 / 32 with a deep split (a router's few column tiles): too narrow for wgmma
        ("narrow-bf16-m16-bn16-split", "*bf16", g.W_SAME, 16, 16, 8, g.DEFAULT[(True, 64)]),
        ("narrow-fp8-m16-bn32-split", "*fp8e4nv", g.W_FP8, 16, 32, 8, g.DEFAULT[(True, 64)])]:
    s = dict(gsig, w_ptr=wdt)
    ce = {"W_KIND": kind, "HAS_SCALE": kind != g.W_SAME, "HAS_BIAS": True, "SPLIT": split, "EVEN_K": True,
          "PREC": "tf32", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    k = compile_sm90(g._gemm_kernel, s, ce, {"num_warps": nw, "num_stages": ns}, GDIV)
    res[name] = dict(usage(k), atom=k.asm["ptx"].count("atom."), bar=k.asm["ptx"].count("bar.sync"))
# linear_add: the addend's load in the epilogue, plain and after a split's sum
for split in (1, 4):
    ce = {"W_KIND": g.W_SAME, "HAS_SCALE": False, "HAS_BIAS": False, "SPLIT": split, "EVEN_K": True, "PREC": "tf32",
          "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "HAS_ADD": True}
    k = compile_sm90(g._gemm_kernel, dict(gsig, HAS_ADD="constexpr"), ce, {"num_warps": 4, "num_stages": 3}, GDIV)
    res[f"add-split{split}"] = usage(k)
for label, one, rows, blk, nw in (("one", True, 1, 8192, 16), ("rows8", True, 8, 128, 2), ("two", False, 1, n.CHUNK, 8)):
    comp(f"rmsnorm-add-{label}-pass", n._rmsnorm_kernel,
         {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "o_ptr": "*bf16", "stride_x": "i32", "stride_r": "i32",
          "stride_o": "i32", "R": "i32", "H": "i32", "eps": "fp32", "HAS_RES": "constexpr", "ONE_PASS": "constexpr",
          "ROWS": "constexpr", "BLOCK": "constexpr"},
         {"HAS_RES": True, "ONE_PASS": one, "ROWS": rows, "BLOCK": blk}, {"num_warps": nw}, (0, 1, 2, 3, 4, 5, 6, 8))
for neox in (True, False):
    comp(f"rope-{'neox' if neox else 'gptj'}", r._rope_kernel,
         {"q_ptr": "*bf16", "k_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32", "stride_qt": "i32", "stride_qh": "i32",
          "stride_kt": "i32", "stride_kh": "i32", "HQ": "i32", "HK": "i32", "HALF": "i32", "IS_NEOX": "constexpr",
          "BLOCK_H": "constexpr", "BLOCK_D": "constexpr"}, {"IS_NEOX": neox, "BLOCK_H": 32, "BLOCK_D": 64},
         {"num_warps": 4}, (0, 1, 2, 3, 4, 5, 6, 7))
comp("gelu-tanh-mul", a._act_mul_kernel, {"x_ptr": "*bf16", "o_ptr": "*bf16", "stride_x": "i32", "stride_o": "i32",
     "H": "i32", "GELU": "constexpr", "BLOCK": "constexpr"}, {"GELU": True, "BLOCK": 1024}, {"num_warps": 4}, (0, 1, 2, 3, 4))
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_kernels_compile_for_sm90_without_spills():
    res = run(SCRIPT)
    assert len(res) == 17
    for name, r in res.items():
        assert r["stack"] == 0 and r["local"] == 0, f"{name} spills: {r}"
        assert r["shared"] <= 227 * 1024, f"{name} needs {r['shared']} bytes of shared memory"
    for name in [n for n in res if n.startswith("gemm-")]:
        # weight tiles stream through a multi-stage cp.async pipeline into Hopper wgmma
        assert res[name]["async"] >= 4 and res[name]["wgmma"] >= 1, f"{name}: {res[name]}"
    for name in [n for n in res if n.startswith("narrow-")]:
        assert res[name]["async"] >= 4 and res[name]["atom"] == 2, f"{name}: {res[name]}"
    for name in [n for n in res if n.startswith("gemm-")]:
        # the split builds sum their partials in the tile's last program: one counter increment
        # and one reset, after a barrier that orders every thread's partial before the increment
        split = name.endswith("-split")
        assert res[name]["atom"] == (2 if split else 0), f"{name}: {res[name]}"
        assert not split or res[name]["bar"] >= 1, f"{name}: {res[name]}"


GLUON_SCRIPT = r'''
from opmap.kernels.gemm import wo_gluon as W
res = {}
for name, wdt, xdt, bm, bk, st, split in [("fp8-bf16-m1", "fp8e4nv", "bf16", 8, 256, 2, 1),
                                          ("fp8-fp16-m16-split", "fp8e4nv", "fp16", 16, 256, 3, 4),
                                          ("int8-bf16-m32", "i8", "bf16", 32, 128, 3, 1)]:
    sig = {"x_ptr": f"*{xdt}", "w_ptr": f"*{wdt}", "s_ptr": "*fp32", "b_ptr": f"*{xdt}", "o_ptr": f"*{xdt}",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "s_xm": "i32", "s_wn": "i32",
           "s_om": "i32", "K_PER_SPLIT": "i32"}
    ce = dict(W_INT8=wdt == "i8", HAS_SCALE=True, HAS_BIAS=True, SPLIT=split, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=bk,
              STAGES=st, PDL=True)
    sig.update({k: "constexpr" for k in ce})
    div = [i for i, n in enumerate(sig) if n.endswith("_ptr") or n.startswith("s_") or n in ("N", "K", "K_PER_SPLIT")]
    k = compile_gluon_sm90(W._wo_kernel, sig, ce, {"num_warps": W.NUM_WARPS}, div)
    res[name] = {**usage(k), "loop": loop_ops(k)}
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_weight_only_gluon_kernel_reads_fragments_from_shared_memory_in_16_bytes():
    """The weight-only Gluon GEMM (wo_gluon.py) as built for sm90: no spills, and its K loop copies
    in 16-byte async copies, reads the weight and x fragments back in 16-byte shared loads (no
    ldmatrix, no byte loads, no shared stores), converts fp8 with the packed cvt (and int8 with
    byte permutes, no I2F) and runs mma.sync."""
    res = run(GLUON_SCRIPT)
    for name, r in res.items():
        loop = r["loop"]
        assert r["stack"] == 0 and r["local"] == 0 and r["reg"] <= 128, (name, r)
        assert loop.get("LDGSTS.E.BYPASS.128", 0) > 0 and loop.get("LDS.128", 0) > 0, (name, loop)
        assert not any(op.startswith(("STS", "LDSM", "LDS.U8", "I2F")) for op in loop), (name, loop)
        assert any(op.startswith("HMMA.16816.F32") for op in loop), (name, loop)
        if name.startswith("fp8"):
            assert loop.get("F2FP.F16.E4M3.UNPACK_B", 0) > 0, (name, loop)
        else:
            assert loop.get("PRMT", 0) > 0, (name, loop)


WGMMA_SCRIPT = r'''
from opmap.kernels.gemm import wo_wgmma as V
res = {}
for name, wdt, xdt, bn, st, split in [("fp8-bf16-bn64", "fp8e4nv", "bf16", 64, 4, 1),
                                      ("fp8-fp16-bn128", "fp8e4nv", "fp16", 128, 3, 1),
                                      ("int8-bf16-bn64-split", "i8", "bf16", 64, 2, 4)]:
    sig = {"x_ptr": f"*{xdt}", "w_ptr": f"*{wdt}", "s_ptr": "*fp32", "b_ptr": f"*{xdt}", "o_ptr": f"*{xdt}",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "s_xm": "i32", "s_wn": "i32",
           "s_om": "i32", "K_PER_SPLIT": "i32"}
    ce = dict(W_INT8=wdt == "i8", HAS_SCALE=True, HAS_BIAS=True, SPLIT=split, BLOCK_M=64, BLOCK_N=bn, BLOCK_K=128,
              STAGES=st, PDL=True)
    sig.update({k: "constexpr" for k in ce})
    div = [i for i, n in enumerate(sig) if n.endswith("_ptr") or n.startswith("s_") or n in ("N", "K", "K_PER_SPLIT")]
    k = compile_gluon_sm90(V._wo_wgmma_kernel, sig, ce, {"num_warps": bn // 16}, div)
    res[name] = {**usage(k), "loop": loop_ops(k)}
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_weight_only_wgmma_kernel_converts_pairs_in_registers_for_one_warpgroup_mma_a_tile():
    """The weight-only warpgroup-MMA GEMM (wo_wgmma.py) as built for sm90: no spills; its K loop
    copies in 16-byte async copies, reads the A fragment as 16-bit pairs (the 16-bit A register
    layout) with no byte repacking (no PRMT on the fp8 path: pair conversions), stores nothing to
    shared memory, and issues its BLOCK_K / 16 MMAs as one group: one arrive, one wait (ptxas did
    not serialize them)."""
    res = run(WGMMA_SCRIPT)
    for name, r in res.items():
        loop = r["loop"]
        assert r["stack"] == 0 and r["local"] == 0 and r["reg"] <= 168, (name, r)
        assert loop.get("LDGSTS.E.BYPASS.128", 0) > 0 and loop.get("LDS.U16", 0) > 0, (name, loop)
        assert not any(op.startswith(("STS", "LDS.U8", "I2F")) for op in loop), (name, loop)
        assert sum(v for op, v in loop.items() if op.startswith("HGMMA")) == 8, (name, loop)  # 128 / 16
        assert loop.get("WARPGROUP.ARRIVE") == 1 and loop.get("WARPGROUP.DEPBAR.LE") == 1, (name, loop)
        if name.startswith("fp8"):
            assert loop.get("F2FP.F16.E4M3.UNPACK_B", 0) > 0 and "PRMT" not in loop, (name, loop)
