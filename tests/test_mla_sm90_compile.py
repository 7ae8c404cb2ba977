"""The MLA decode's TMA kernel (ops/mla/decode_tma.py) compiles for sm90 on this CPU-only machine
at the config the bench times, (BLOCK_H 16, BLOCK_N 64, 4 warps, 2 stages): its latent tiles come
by TMA (cp.async.bulk.tensor), its dots run on wgmma (keys as rows), and it fits the registers
with no stack. The pointer kernel at 16 heads has 255 registers and a stack frame (docs/mla.md).
Runs in a subprocess because the interpreter (TRITON_INTERPRET=1) replaces @triton.jit here."""
from sm90_compile import needs_ptxas, run

SCRIPT = r'''
from opmap.ops.mla import decode_tma as t

sig = {"QN": "*bf16", "QP": "*bf16", "KV_DESC": "tensordesc<bf16[1,64,256]>", "PE_DESC": "tensordesc<bf16[1,64,64]>",
       "SEQ_LENS": "*i32", "TABLES": "*i32", "O": "*bf16", "LSE": "*fp32", "PO": "*fp32", "PLSE": "*fp32",
       "sm_scale": "fp32", "H": "i32", "R": "i32", "DR": "i32", "MAXP": "i32", "NPAGES": "i32", "SPLIT_MIN": "i32"}
for x in ["s_qnb", "s_qnh", "s_qpb", "s_qph", "s_tb", "s_ob", "s_oh", "s_pob", "s_poh", "s_pos", "s_plb", "s_plh"]:
    sig[x] = "i32"
ce = dict(BLOCK_H=16, BLOCK_RH=256, R_CHUNKS=2, BLOCK_DR=64, BLOCK_N=64, NUM_SPLITS=4, PAGE=64)
for x in ce:
    sig[x] = "constexpr"
k = compile_sm90(t._mla_decode_tma_kernel, sig, ce, {"num_warps": 4, "num_stages": 2}, (0, 1, 4, 5, 6, 7, 8, 9))
print("RESULT " + json.dumps({**usage(k), "tma": k.asm["ptx"].count("cp.async.bulk.tensor")}))
'''


@needs_ptxas
def test_tma_kernel_builds_on_wgmma_without_spilling():
    r = run(SCRIPT)
    assert r["stack"] == 0 and r["local"] == 0 and r["reg"] <= 232, r
    assert r["wgmma"] >= 5 and r["tma"] >= 3, r  # 3 dots and 2 value dots per tile; 3 boxes per tile
    assert r["shared"] <= 227 * 1024, r
