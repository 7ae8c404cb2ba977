"""The 16-bit MoE grouped GEMM compiles for sm90 on this CPU-only machine at every config its tuner
may keep at decode row tiles (BM 16 and 32) and at the prefill tiles, gated (gate/up with SiLU * up)
and weighted (down): none spills and each pipelines its loads (cp.async). The tuner times them on
the GPU and keeps the fastest; a config that spilled would be a slow candidate it might still keep
on a noisy measurement. Runs in a subprocess because the interpreter replaces @triton.jit here."""
from sm90_compile import needs_ptxas, run

SCRIPT = r'''
from opmap.kernels.moe import grouped_gemm as G

res = {}
sig = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "weights_ptr": "*fp32", "sorted_ptr": "*i32",
       "block_expert_ptr": "*i32", "total_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "n_pairs": "i32",
       "N": "i32", "K": "i32", "a_row_div": "i32", "rows_bucket": "i32", "stride_am": "i32", "stride_we": "i32",
       "stride_wn": "i32", "stride_om": "i32", "stride_se": "i32", "stride_sn": "i32"}
div = [i for i, n in enumerate(sig) if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K")]
for bm in (16, 32, 64, 128):
    for gated in (True, False):
        K = 2048 if gated else 768  # Qwen3-30B-A3B: hidden in, intermediate in
        for c in G._prune(G._ALL_CONFIGS, {"K": K}, BM=bm, GATED=gated):
            ce = dict(GATED=gated, WEIGHTED=not gated, EVEN_K=True, PRECISION="tf32", BM=bm, QUANT=0, SPAN=1,
                      HAS_ZERO=False, SYM_ZERO=8, ASM=False, **dict(dict(SUB=1), **c.kwargs))
            s = dict(sig, **{k: "constexpr" for k in ce})
            k = compile_sm90(G._grouped_gemm_kernel, s, ce, {"num_warps": c.num_warps, "num_stages": c.num_stages}, div)
            res[f"bm{bm}-{'gated' if gated else 'down'}-bn{c.kwargs['BN']}-bk{c.kwargs['BK']}-w{c.num_warps}-s{c.num_stages}"] = usage(k)
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_grouped_gemm_configs_compile_for_sm90_without_spills():
    from opmap.kernels.moe import grouped_gemm as G

    res = run(SCRIPT)
    # every decode candidate of both GEMMs was built (BM 16: the tuner's table, at one token)
    for gated in (True, False):
        for c in G._DECODE[gated]:
            name = f"bm16-{'gated' if gated else 'down'}-bn{c.kwargs['BN']}-bk{c.kwargs['BK']}-w{c.num_warps}-s{c.num_stages}"
            assert name in res, (name, sorted(res))
    for name, r in res.items():
        assert r["stack"] == 0 and r["local"] == 0, f"{name} spills: {r}"
        assert r["shared"] <= 227 * 1024, f"{name} needs {r['shared']} bytes of shared memory"
        assert r["async"] >= 2, f"{name}: no cp.async pipeline: {r}"


TMA_SCRIPT = r'''
from opmap.kernels.moe import tma_moe as t

res = {}
variants = [{}, {"BM": 128}, {"FLATTEN": 0}, {"per_sm": 2, "num_stages": 2}, {"BN": 64}, {"BM": 128, "FLATTEN": 0}]
for v in variants:
    p = t.plan(4096 * 8, 128, v)
    bm, bn, bk = p["BM"], p["BN"], p["BK"]
    ce = dict(PRECISION="tf32", BM=bm, BN=bn, BK=bk, GROUP_M=8, PROGRAMS=132 * p["per_sm"], FLATTEN=bool(p["FLATTEN"]))
    gate_up = {"xs_desc": f"tensordesc<bf16[{bm},{bk}]>", "w_desc": f"tensordesc<bf16[{bn},{bk}]>",
               "inter_desc": f"tensordesc<bf16[{bm},{bn}]>", "block_expert_ptr": "*i32", "total_ptr": "*i32",
               "N": "i32", "K": "i32"}
    down = {"inter_desc": f"tensordesc<bf16[{bm},{bk}]>", "w_desc": f"tensordesc<bf16[{bn},{bk}]>",
            "y_ptr": "*bf16", "weights_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
            "total_ptr": "*i32", "n_pairs": "i32", "N": "i32", "K": "i32", "stride_y": "i32"}
    for name, fn, sig in (("gate_up", t._gate_up_kernel, gate_up), ("down", t._down_kernel, down)):
        k = compile_sm90(fn, dict(sig, **{c: "constexpr" for c in ce}), ce,
                         {"num_warps": p["num_warps"], "num_stages": p["num_stages"]})
        res[f"{name}-{v}"] = dict(usage(k), tma=k.asm["ptx"].count("cp.async.bulk.tensor"),
                                  per_sm=p["per_sm"])
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_tma_route_kernels_compile_for_sm90_on_tma_and_wgmma_without_spills():
    res = run(TMA_SCRIPT)
    for name, r in res.items():
        assert r["local"] == 0 and r["stack"] == 0, (name, r)
        assert r["wgmma"] >= (2 if name.startswith("gate_up") else 1), (name, r)
        assert r["tma"] >= 2, (name, r)  # the A and B tiles arrive by TMA
        # the programs an SM the plan asks for fit its shared memory
        assert r["shared"] * r["per_sm"] <= 227 * 1024, (name, r)
