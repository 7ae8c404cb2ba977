"""The kernels that read int4 and block-fp8 weights compile for sm90 on this CPU-only machine
(Triton's AOT path and its bundled ptxas), at the tiles their planners choose: the dense W4A16 and
block-fp8 GEMMs at decode and 64-row tiles, and the MoE grouped GEMM at the configs its tuner
keeps for quantised experts, at the row tiles pick_bm gives them. None spills, and the int4
builds convert codes by the LOP3 path of kernels/gemm/nibbles.py (packed 16-bit subtracts, 16-byte shared stores), not a shift, an
int-to-float and a 16-bit store per code. The interpreter runs no PTX, so this and the GPU tests
are what cover that path. Runs in a subprocess because the interpreter replaces @triton.jit here."""
from sm90_compile import needs_ptxas, run

SCRIPT = r'''
import triton
from opmap.kernels.gemm import fp8_block as F, scaled_tiles as T, w4a16 as W
from opmap.kernels.moe import grouped_gemm as G

res = {}

def div_of(sig):
    return [i for i, n in enumerate(sig) if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K", "K_PER_SPLIT")]

def build(name, fn, sig, ce, warps, stages):
    s = dict(sig, **{k: "constexpr" for k in ce})
    k = compile_sm90(fn, s, ce, {"num_warps": warps, "num_stages": stages}, div_of(s))
    res[name] = {**usage(k), "loop": loop_ops(k)}

wsig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "b_ptr": "*bf16", "o_ptr": "*bf16",
        "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
        "stride_wn": "i32", "stride_sn": "i32", "stride_om": "i32", "K_PER_SPLIT": "i32"}
fsig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "o_ptr": "*bf16", "ws_ptr": "*fp32",
        "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
        "stride_om": "i32", "K_PER_SPLIT": "i32"}
# the planner's tiles (an H200's 132 SMs) at Llama-3-8B's down projection
for M, xdt, zero, sub, fold in [(1, "bf16", False, 0, 0), (16, "fp16", True, 0, 0), (64, "bf16", True, 0, 0),
                                (1, "bf16", True, 4, 0), (1, "bf16", False, 2, 0), (1, "bf16", True, 0, 1),
                                (64, "bf16", False, 0, 1), (1024, "bf16", True, 0, 1), (1024, "bf16", False, 0, 0)]:
    p = T.plan(M, 4096, 14336, 128, 132, 256, False, interp=False)
    if sub:  # the other SUB tunings (config=), at their stages
        p.update(SUB=sub, num_stages=T.stages(p["BLOCK_M"], sub))
    ce = dict(G=128, HAS_ZERO=zero, HAS_BIAS=True, SPLIT=p["SPLIT"], SYM_ZERO=8, ASM=True, SUB=p["SUB"], FOLD=fold,
              BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"])
    build(f"w4a16-m{M}-{xdt}" + (f"-sub{sub}" if sub else "") + ("-fold" if fold else ""), W._w4a16_kernel,
          dict(wsig, x_ptr=f"*{xdt}", b_ptr=f"*{xdt}", o_ptr=f"*{xdt}"), ce, p["num_warps"], p["num_stages"])
for M, fold in [(1, 0), (64, 0), (1, 1), (64, 1), (1024, 0), (1024, 1)]:
    p = T.plan(M, 4096, 14336, 128, 132, 128, True, interp=False)
    ce = dict(BLOCK=128, HAS_BIAS=False, SPLIT=p["SPLIT"], EVEN_K=True, SUB=p["SUB"], FOLD=fold, BLOCK_M=p["BLOCK_M"],
              BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"])
    build(f"fp8-block-m{M}" + ("-fold" if fold else ""), F._fp8_block_kernel, fsig, ce, p["num_warps"], p["num_stages"])
gsig = {"a_ptr": "*bf16", "w_ptr": "*i32", "out_ptr": "*bf16", "weights_ptr": "*fp32", "sorted_ptr": "*i32",
        "block_expert_ptr": "*i32", "total_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "n_pairs": "i32", "N": "i32",
        "K": "i32", "a_row_div": "i32", "rows_bucket": "i32", "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32",
        "stride_om": "i32", "stride_se": "i32", "stride_sn": "i32"}
# the tuner's quantised configs: decode rows (BM 16) and prefill (BM 64: quantised experts stop
# there, grouped_gemm.pick_bm), the gated up projection and the weighted down projection
for quant, wdt, sdt in [(1, "*i32", "*fp16"), (2, "*fp8e4nv", "*fp32")]:
    for bm in (16, 64):
        for gated in (True, False):  # gate/up with SiLU * up; down with the routing weight
            kw = dict(BM=bm, GATED=gated, QUANT=quant, SPAN=128)
            for c in G._prune(G._ALL_CONFIGS, {"K": 2048}, **kw):
                ce = dict(GATED=gated, WEIGHTED=not gated, EVEN_K=True, PRECISION="tf32", BM=bm, QUANT=quant,
                          SPAN=128, HAS_ZERO=quant == 1, SYM_ZERO=8, ASM=True, **c.kwargs)
                build(f"moe-q{quant}-bm{bm}-{'gated' if gated else 'down'}-bn{c.kwargs['BN']}-bk{c.kwargs['BK']}"
                      f"-sub{c.kwargs['SUB']}-w{c.num_warps}-s{c.num_stages}", G._grouped_gemm_kernel,
                      dict(gsig, w_ptr=wdt, s_ptr=sdt), ce, c.num_warps, c.num_stages)
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_quantised_weight_kernels_compile_for_sm90_without_spills():
    res = run(SCRIPT)
    dense = ["w4a16-m1-bf16", "w4a16-m16-fp16", "w4a16-m64-bf16", "w4a16-m1-bf16-sub4", "w4a16-m1-bf16-sub2",
             "w4a16-m1-bf16-fold", "w4a16-m64-bf16-fold", "w4a16-m1024-bf16-fold", "w4a16-m1024-bf16",
             "fp8-block-m1", "fp8-block-m64", "fp8-block-m1-fold", "fp8-block-m64-fold", "fp8-block-m1024",
             "fp8-block-m1024-fold"]
    assert all(n in res for n in dense), sorted(res)
    for q in (1, 2):
        for bm in (16, 64):
            assert any(n.startswith(f"moe-q{q}-bm{bm}-") for n in res), (q, bm, sorted(res))
    for name, r in res.items():
        # no spill traffic in the K loop anywhere; and no stack at all but on the int4 down tiles of
        # 32 columns with zero points, whose one spilled value is stored and loaded once, outside it
        assert not any(k.startswith(("STL", "LDL")) for k in r["loop"]), f"{name} spills in its loop: {r}"
        if not (name.startswith("moe-q1-bm16-down-bn32") and r["stack"] <= 32):
            assert r["stack"] == 0 and r["local"] == 0, f"{name} spills: {r}"
        assert r["shared"] <= 227 * 1024, f"{name} needs {r['shared']} bytes of shared memory"
        assert r["async"] >= 4, f"{name}: no cp.async pipeline: {r}"
    for name in [n for n in res if n.startswith(("w4a16", "moe-q1"))]:
        loop = res[name]["loop"]
        # nibbles.py: a LOP3 makes two values, a packed subtract (bf16: an FMA) finishes them
        packed = sum(v for k, v in loop.items() if k.startswith("HADD2") or k.startswith("HFMA2"))
        assert packed >= 16, f"{name}: no packed conversion: {loop}"
        assert not any(k.startswith(("I2F.BF16", "I2F.F16")) for k in loop), f"{name}: converts code by code: {loop}"
        assert "STS.U16" not in loop, f"{name}: stores the tile code by code: {loop}"
    for name in [n for n in res if n.startswith(("w4a16", "fp8-block"))]:
        assert res[name]["wgmma"] >= 1, f"{name}: no warpgroup MMA: {res[name]}"

