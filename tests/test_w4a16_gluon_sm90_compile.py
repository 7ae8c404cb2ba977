"""gluon-w4a16 compiles for sm90 on this CPU-only machine (Gluon's AOT path and Triton's bundled
ptxas) at the tiles its plan and its config give, and the build is what the kernel's docstring
claims: the packed words reach the MMA without shared memory (none beyond the split-K tail's
barrier word, no shared load, store or barrier in the K loop), each word's codes come from the LOP3 /
packed-subtract path of kernels/gemm/nibbles.py (no int-to-float code by code), and the K loop stays
near its count of instructions a word (about 31 at 8 rows, 43 at 16), so that a change that adds work
a code shows here. With config STAGES the packed words alone cross shared memory (16-byte async copies
in, 8-byte fragment reads out, no shared store), in a layout whose reads and copies have no bank
conflicts (gl.bank_conflicts). The GPU tests run it for values."""
from sm90_compile import needs_ptxas, run

PROBE = """
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from opmap.kernels.gemm.w4a16_gluon import STAGED


@gluon.jit
def probe(p, SALT: gl.constexpr):  # SALT: a new build each run (static_print runs at compile time only)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    A_WORDS: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    sm = gl.allocate_shared_memory(gl.int32, [64, 16], STAGED)
    t = gl.zeros([64, 16], gl.int32, A_WORDS)
    c = gl.zeros([64, 16], gl.int32, gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0]))
    gl.static_print("CONFLICTS", gl.bank_conflicts(t.type, sm.type), gl.bank_conflicts(c.type, sm.type))
    sm.store(c)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, A_WORDS))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, A_WORDS))
    gl.store(p + rows[:, None] * 16 + cols[None, :], sm.load(A_WORDS))
"""

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
        ("bf16-m1-bn32-split", "bf16", False, 1, {"BLOCK_N": 32}, 2, False),
        ("bf16-m1-s4", "bf16", False, 1, {"STAGES": 4}, 1, False),
        ("bf16-m1-zero-split-s8", "bf16", True, 1, {"STAGES": 8}, 4, True),
        ("bf16-m16-zero-s4", "bf16", True, 16, {"STAGES": 4}, 1, False)]:
    p = WG.plan(M, 4096, 14336, 132, cfg)
    s = dict(sig, x_ptr=f"*{xdt}", b_ptr=f"*{xdt}", o_ptr=f"*{xdt}")
    ce = dict(G=128, HAS_ZERO=zero, HAS_BIAS=bias, SPLIT=split, SYM_ZERO=8, BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"],
              WARPS=p["WARPS"], STAGES=p["STAGES"], PDL=True)
    k = compile_gluon_sm90(WG._w4a16_mma_kernel, dict(s, **{c: "constexpr" for c in ce}), ce,
                           {"num_warps": p["WARPS"]}, div)
    loop = loop_ops(k)
    words = p["BLOCK_N"] * 16 / (p["WARPS"] * 32)  # a thread's words a K tile (one loop iteration)
    copies = [l for l in k.asm["ptx"].splitlines() if "cp.async." in l and "shared.global" in l]
    res[name] = {**usage(k), "loop": loop, "per_word": sum(loop.values()) / words, "stages": p["STAGES"],
                 "copies16": all(", 0x10" in l for l in copies) and bool(copies),
                 "tile_bytes": p["BLOCK_N"] * 64}

# the staged weight's shared layout against the fragment reads and the async copies' writes (a probe
# kernel in a file of its own: @gluon.jit reads its source)
import contextlib, importlib.util, io, tempfile
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(PROBE)
spec = importlib.util.spec_from_file_location("w4a16_gluon_probe", f.name)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
probe = mod.probe
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    compile_gluon_sm90(probe, {"p": "*i32", "SALT": "constexpr"}, {"SALT": os.getpid()}, {"num_warps": 4}, [0])
res["conflicts"] = [int(v) for v in buf.getvalue().split("CONFLICTS", 1)[1].split()[:2]]
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_gluon_w4a16_builds_keep_the_weight_out_of_shared_memory():
    res = run(f"PROBE = {PROBE!r}\n" + SCRIPT)
    assert res.pop("conflicts") == [0, 0], "the staged weight's swizzle: bank conflicts of the fragment reads / copies"
    assert len(res) == 9, sorted(res)
    for name, r in res.items():
        loop = r["loop"]
        assert r["local"] == 0, f"{name}: {r}"
        if r["stages"]:  # the packed words alone cross shared memory: 16-byte async copies in, fragment reads out
            assert r["tile_bytes"] * r["stages"] <= r["shared"] <= r["tile_bytes"] * r["stages"] + 16, f"{name}: {r}"
            assert loop.get("LDGSTS.E.BYPASS.128", 0) >= 2 and loop.get("LDS.64", 0) >= 4, f"{name}: {loop}"
            assert r["copies16"], f"{name}: an async copy of under 16 bytes (the prologue's or the loop's)"
            assert not any(op.startswith("STS") for op in loop), f"{name}: {loop}"
        else:
            assert r["shared"] <= 16, f"{name}: the tile passes through shared memory: {r}"
            assert not any(op.startswith(("STS", "LDS", "BAR")) for op in loop), f"{name}: {loop}"
        hmma = sum(v for op, v in loop.items() if op.startswith("HMMA.16816"))
        assert hmma >= 8, f"{name}: no mma.sync in the K loop: {loop}"
        packed = sum(v for op, v in loop.items() if op.startswith(("HADD2", "HFMA2")))
        assert packed >= 32, f"{name}: no packed conversion: {loop}"
        assert not any(op.startswith(("I2F", "I2FP")) for op in loop), f"{name}: converts code by code: {loop}"
        assert r["per_word"] <= 44, f"{name}: {r['per_word']:.1f} instructions a word: {loop}"
