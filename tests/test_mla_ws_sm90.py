"""The Gluon warp-specialised MLA decode (kernels/mla/decode_ws.py) compiles for sm90 on this
CPU-only machine, one split and many: a producer partition of 24 registers and consumers of 240
(setmaxnreg), nine TMA boxes a tile (eight 64-column latent chunks at 8 KB steps of the stage and
the RoPE box), warpgroup MMAs with the scores left in flight while the value MMA's stage is
released (wgmma.wait_group 2), no stack or local memory, and shared memory within an sm90 block's
227 KB (q, two stages and the P buffer, with no layout conversion through shared memory beside
them)."""
from sm90_compile import needs_ptxas, run

SCRIPT = r'''
from opmap.kernels.mla import decode_ws as t

L = "NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)"
sig = {"QN": "*bf16", "QP": "*bf16", "KV_DESC": f"tensordesc<bf16[1,64,64],{L}>",
       "PE_DESC": f"tensordesc<bf16[1,64,64],{L}>", "SEQ_LENS": "*i32", "TABLES": "*i32", "O": "*bf16",
       "LSE": "*fp32", "PO": "*fp32", "PLSE": "*fp32", "sm_scale": "fp32", "H": "i32", "MAXP": "i32",
       "NPAGES": "i32", "SPLIT_MIN": "i32"}
for x in ["s_qnb", "s_qnh", "s_qpb", "s_qph", "s_tb", "s_ob", "s_oh", "s_pob", "s_poh", "s_pos", "s_plb", "s_plh"]:
    sig[x] = "i32"
res = {}
for splits in (1, 8):
    ce = dict(NUM_SPLITS=splits, PAGE=64, BH=t.BLOCK_H, R=t.RANK, DR=t.ROPE, BLOCK_N=t.BLOCK_N, STAGES=t.STAGES)
    s = dict(sig, **{x: "constexpr" for x in ce})
    k = compile_gluon_sm90(t._mla_decode_ws_kernel, s, ce, {"num_warps": t.CONSUMER_WARPS}, (0, 1, 4, 5, 6, 7, 8, 9))
    ptx = k.asm["ptx"]
    dst = [int(x) for x in re.findall(r"add\.s32\s+%r\d+, %r\d+, (\d+);\n(?:[^\n]*\n){0,6}?[^\n]*cp\.async\.bulk\.tensor", ptx)]
    res[splits] = {**usage(k), "plan": t.smem_bytes(),
                   "regs": sorted(set(int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
                   "tma": sass_ops(k).get("UTMALDG.3D", 0), "wait2": ptx.count("wgmma.wait_group.sync.aligned 2"),
                   "offsets": sorted(set(dst))}
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_ws_mla_decode_builds_warp_specialised_on_tma_and_wgmma():
    res = run(SCRIPT)
    for splits, r in res.items():
        assert r["local"] == 0 and r["stack"] == 0, (splits, r)
        assert r["plan"] <= r["shared"] <= 227 * 1024, (splits, r)
        assert r["regs"] == [24, 240], (splits, r)
        assert r["tma"] == 9 and r["wait2"] >= 1, (splits, r)
        # the latent boxes land 64 rows x 128 bytes apart, one column chunk after another
        assert {8192 * c for c in range(1, 8)} <= set(r["offsets"]), (splits, r)
