"""The launch-fusing kernels compile for sm90 as a GPU's JIT would specialise them, on this CPU-only
machine (Triton's AOT path and its bundled ptxas): integer arguments the JIT turns into constants at
1 (a width of 1; the M of a one-row call, which the kernels handing M to splitk.finish keep a
runtime int), 16-bit activations with an fp8 latent cache (each MLA append
kernel, whose fp8 helper once returned two types), and the GEMM's gated epilogue at the planner's
decode tiles (two warpgroup MMAs a K step, the copy pipeline kept), none spilling. The interpreter compiles none of this: a kernel that fails here fails on its first GPU call.
Runs in a subprocess because the interpreter replaces @triton.jit here."""
from sm90_compile import needs_ptxas, run

SCRIPT = r'''
from opmap.kernels.gemm import triton_gemm as TG
from opmap.kernels.mla import append as AP

res = {}
DIV = {"x_ptr", "w_ptr", "s_ptr", "b_ptr", "o_ptr", "ws_ptr", "cnt_ptr", "a_ptr", "N", "K", "stride_xm", "stride_wn",
       "stride_om", "stride_am", "K_PER_SPLIT"}

def build(name, fn, sig, ce, warps, stages=3):
    s = {n: ("constexpr" if n in ce else sig[n]) for n in fn.arg_names}
    div = [i for i, n in enumerate(fn.arg_names) if n in DIV and n not in ce]
    try:
        res[name] = usage(compile_sm90(fn, s, ce, {"num_warps": warps, "num_stages": stages}, div))
    except Exception as e:
        res[name] = {"error": f"{type(e).__name__}: {str(e)[-300:]}"}

from opmap.kernels.gemm import fp8_block as FB, w4a16 as W
# kernels whose M is 1 in a whole class of calls (decode) and goes to splitk.finish as a tensor (the
# GEMM's to its own split-K end, which takes M.to alike)
res["M_kept"] = [k.fn.__name__ for k in (W._w4a16_kernel, FB._fp8_block_kernel, TG._gemm_kernel)
                 if "M" not in k.do_not_specialize]
for scale_ptr in (False, True):
    build(f"mla-append-fp8-{scale_ptr}", AP._mla_append_kernel, dict(CKV="*bf16", KPE="*bf16", CACHE="*fp8e4nv",
          SLOTS="*i32", SCALE_PTR="*fp32", kv_scale="fp32", R="i32", DR="i32", NSLOTS="i32", s_ckv="i32", s_kpe="i32",
          s_row="i32"), dict(BLOCK_R=512, BLOCK_DR=64, FP8=True, SCALE_FROM_PTR=scale_ptr), 4)
    build(f"mla-norm-rope-append-fp8-{scale_ptr}", AP._norm_rope_append_kernel, dict(Q="*bf16", KVA="*bf16", W="*bf16",
          POS="*i64", CS="*fp32", CACHE="*fp8e4nv", SLOTS="*i32", SCALE_PTR="*fp32", kv_scale="fp32", eps="fp32",
          HQ="i32", R="i32", HALF="i32", NSLOTS="i32", s_qt="i32", s_qh="i32", s_kva="i32", s_row="i32"),
          dict(IS_NEOX=True, BLOCK_QH=64, BLOCK_R=512, BLOCK_HALF=32, FP8=True, SCALE_FROM_PTR=scale_ptr), 4)
gs = dict(x_ptr="*bf16", w_ptr="*bf16", s_ptr="*bf16", b_ptr="*bf16", o_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32",
          a_ptr="*bf16", M="i32", N="i32", K="i32", stride_xm="i32", stride_wn="i32", stride_om="i32", stride_am="i32",
          K_PER_SPLIT="i32")
base = dict(W_KIND=0, HAS_SCALE=False, HAS_BIAS=False, EVEN_K=True, PREC="tf32", PDL=True, GATED=0,
            HAS_ADD=False)
# the gated epilogue at the planner's decode tiles: Llama-3-8B's gate/up at M = 1 and 32
for M in (1, 32):
    p = TG.plan(M, 14336, 4096, 132, interp=False)
    bk, w, st = TG.DEFAULT[(p["small"], p["BLOCK_N"])]
    t = dict(base, SPLIT=p["SPLIT"], BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_K=min(bk, 128))
    build(f"gated-{M}", TG._gemm_kernel, gs, dict(t, GATED=1), w, st)
build("gated-N1", TG._gemm_kernel, gs, dict(base, SPLIT=1, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GATED=1, N=1), 4)
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_fused_kernels_compile_for_sm90_as_the_jit_specialises_them():
    res = run(SCRIPT)
    assert res.pop("M_kept") == []
    failed = {k: v["error"] for k, v in res.items() if "error" in v}
    assert not failed, failed
    for name, u in res.items():
        assert u["stack"] == 0 and u["local"] == 0, (name, u)  # no spills
    for M in (1, 32):
        u = res[f"gated-{M}"]
        assert u["wgmma"] == 2 and u["async"] > 0 and u["waits"], (M, u)
