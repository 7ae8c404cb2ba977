"""The Gluon warp-specialised prefill (kernels/attention/prefill_ws.py) compiles for sm90 on this
CPU-only machine at each tile its bench rows time: a producer partition of few registers and
consumers of many (setmaxnreg), K/V tiles by TMA (one box per page within a tile: pages of 16 give
8 boxes a 128-key tile), both products on warpgroup MMAs with one left in flight while the next
softmax runs (wgmma.wait_group 1), no stack or local memory, shared memory within the block's; and
the ping-pong build (config PINGPONG: two consumer partitions of a warpgroup each)."""
from sm90_compile import needs_ptxas, run

SCRIPT = r'''
from opmap.kernels.attention import prefill_ws as t

res = {}
L = "NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)"
for d, group, page, bn, st, feats, pp in [(128, 4, 64, 128, 2, False, 0), (128, 1, 16, 128, 2, False, 0),
                                          (128, 4, 128, 64, 3, False, 0), (64, 8, 32, 128, 3, True, 0),
                                          (128, 4, 64, 128, 2, False, 1), (64, 8, 16, 64, 3, True, 1)]:
    box = min(bn, page)
    desc = f"tensordesc<bf16[1,{box},1,64],{L}>"
    sig = {"q_ptr": "*bf16", "K_DESC": desc, "V_DESC": desc, "o_ptr": "*bf16", "lse_ptr": "*fp32", "cu_ptr": "*i32",
           "sl_ptr": "*i32", "bt_ptr": "*i32", "scale": "fp32", "soft_cap": "fp32", "window": "i32", "B": "i32"}
    for n in ["s_qt", "s_qh", "s_ot", "s_oh", "s_bt"]:
        sig[n] = "i32"
    ce = dict(GROUP=group, PAGE=page, BLOCK_M=128, BLOCK_N=bn, STAGES=st, CAUSAL=True, HAS_WINDOW=feats,
              HAS_CAP=feats, RETURN_LSE=feats, HEAD_DIM=d, SKIP_SINGLE=feats, PINGPONG=pp)
    for n in ce:
        sig[n] = "constexpr"
    warps = t.CONSUMER_WARPS // 2 if pp else t.CONSUMER_WARPS
    k = compile_gluon_sm90(t._prefill_ws_kernel, sig, ce, {"num_warps": warps}, (0, 3, 4, 5, 6, 7))
    ptx = k.asm["ptx"]
    ops = sass_ops(k)
    res[f"d{d}-g{group}-page{page}-bn{bn}-s{st}" + ("-feats" if feats else "") + ("-pp" if pp else "")] = {
        **usage(k), "regs": sorted(set(int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
        "tma": ops.get("UTMALDG.4D", 0), "d": d, "hgmma": sum(v for o, v in ops.items() if o.startswith("HGMMA")),
        "wait1": ptx.count("wgmma.wait_group.sync.aligned 1"), "boxes": bn // box, "smem_plan": t.smem_bytes(
            {"BLOCK_N": bn, "STAGES": st}, d), "pp": pp, "threads": int(re.search(r"\.reqntid (\d+)", ptx).group(1))}
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_ws_prefill_builds_warp_specialised_on_tma_and_wgmma():
    res = run(SCRIPT)
    assert len(res) == 6
    for name, r in res.items():
        assert r["local"] == 0 and r["stack"] == 0, (name, r)
        assert r["smem_plan"] <= r["shared"] <= 227 * 1024, (name, r)
        # the producer shrinks to 24 registers, the consumers grow to 240; ping-pong: three
        # warpgroups (two consumers of 128 threads and the producer's), a worker waiting at 120
        assert {24, 240} <= set(r["regs"]) and r["threads"] == 384 if r["pp"] else r["regs"] == [24, 240], (name, r)
        # a K and a V box for each page of a tile and each 64 columns (one 128-byte swizzle span)
        assert r["tma"] == 2 * r["boxes"] * r["d"] // 64, (name, r)
        assert r["hgmma"] > 0 and r["wait1"] >= 1, (name, r)
