"""gluon-w4a16 compiles for sm90 on this CPU-only machine (Gluon's AOT path and Triton's bundled
ptxas) at the tiles its plan and its config give, and the build is what the kernel's docstring
claims: the packed words reach the MMA without shared memory (none beyond the split-K tail's
barrier word, no shared load, store or barrier in the K loop), each word's codes come from the LOP3 /
packed-subtract path of kernels/gemm/nibbles.py (no int-to-float code by code), and the K loop stays
near its count of instructions a word (about 31 at 8 rows, 43 at 16), so that a change that adds work
a code shows here. The GPU tests run it for values."""
from sm90_compile import needs_ptxas, run

SCRIPT = r'''
from opmap.kernels.gemm import w4a16_gluon as WG

res = {}
sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "b_ptr": "*bf16", "o_ptr": "*bf16",
       "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "s_xm": "i32", "s_wn": "i32",
       "s_sn": "i32", "s_om": "i32", "K_PER_SPLIT": "i32"}
div = [i for i, n in enumerate(sig) if n.endswith("_ptr") or n.startswith("s_") or n in ("N", "K", "K_PER_SPLIT")]
for name, xdt, zero, M, cfg, split, bias in [
        ("bf16-m1", "bf16", False, 1, None, 1, False), ("bf16-m1-zero-split", "bf16", True, 1, None, 8, True),
        ("fp16-m4-zero", "fp16", True, 4, None, 1, False), ("bf16-m16-zero", "bf16", True, 16, None, 1, False),
        ("bf16-m1-bn128", "bf16", False, 1, {"BLOCK_N": 128}, 1, False),
        ("bf16-m1-bn32-split", "bf16", False, 1, {"BLOCK_N": 32}, 2, False)]:
    p = WG.plan(M, 4096, 14336, 132, cfg)
    s = dict(sig, x_ptr=f"*{xdt}", b_ptr=f"*{xdt}", o_ptr=f"*{xdt}")
    ce = dict(G=128, HAS_ZERO=zero, HAS_BIAS=bias, SPLIT=split, SYM_ZERO=8, BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"],
              WARPS=p["WARPS"], PDL=True)
    k = compile_gluon_sm90(WG._w4a16_mma_kernel, dict(s, **{c: "constexpr" for c in ce}), ce,
                           {"num_warps": p["WARPS"]}, div)
    loop = loop_ops(k)
    words = p["BLOCK_N"] * 16 / (p["WARPS"] * 32)  # a thread's words a K tile (one loop iteration)
    res[name] = {**usage(k), "loop": loop, "per_word": sum(loop.values()) / words}

print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_gluon_w4a16_builds_keep_the_weight_out_of_shared_memory():
    res = run(SCRIPT)
    assert len(res) == 6, sorted(res)
    for name, r in res.items():
        loop = r["loop"]
        assert r["local"] == 0, f"{name}: {r}"
        assert r["shared"] <= 16, f"{name}: the tile passes through shared memory: {r}"
        assert not any(op.startswith(("STS", "LDS", "BAR")) for op in loop), f"{name}: {loop}"
        hmma = sum(v for op, v in loop.items() if op.startswith("HMMA.16816"))
        assert hmma >= 8, f"{name}: no mma.sync in the K loop: {loop}"
        packed = sum(v for op, v in loop.items() if op.startswith(("HADD2", "HFMA2")))
        assert packed >= 32, f"{name}: no packed conversion: {loop}"
        assert not any(op.startswith(("I2F", "I2FP")) for op in loop), f"{name}: converts code by code: {loop}"
        assert r["per_word"] <= 44, f"{name}: {r['per_word']:.1f} instructions a word: {loop}"
