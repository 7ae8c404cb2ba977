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
