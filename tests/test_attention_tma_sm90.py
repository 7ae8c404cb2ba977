"""The TMA attention kernels compile for sm90 on this CPU-only machine: the prefill
(kernels/attention/prefill_tma.py) at its default tile (BLOCK_M 128, BLOCK_N 64, 8 warps, 3 stages;
d = 128, pages of 64) with its K/V tiles by TMA (cp.async.bulk.tensor) and both dots on wgmma,
no local memory (group 1 keeps an 8-byte stack frame at 255 registers). Runs in a subprocess
because the interpreter replaces @triton.jit here."""
from sm90_compile import needs_ptxas, run

SCRIPT = r'''
from opmap.kernels.attention import prefill_tma as t

res = {}
for d, group in [(128, 4), (128, 1), (64, 8)]:
    sig = {"q_ptr": "*bf16", "K_DESC": f"tensordesc<bf16[1,64,1,{d}]>", "V_DESC": f"tensordesc<bf16[1,64,1,{d}]>",
           "o_ptr": "*bf16", "lse_ptr": "*fp32", "cu_ptr": "*i32", "sl_ptr": "*i32", "bt_ptr": "*i32",
           "scale": "fp32", "soft_cap": "fp32", "window": "i32", "B": "i32"}
    for n in ["s_qt", "s_qh", "s_ot", "s_oh", "s_bt"]:
        sig[n] = "i32"
    ce = dict(GROUP=group, D=d, DV=d, PAGE=64, BLOCK_M=128, BLOCK_N=64, CAUSAL=True, HAS_WINDOW=False, HAS_CAP=False,
              RETURN_LSE=True)
    for n in ce:
        sig[n] = "constexpr"
    k = compile_sm90(t._prefill_tma_kernel, sig, ce, {"num_warps": 8, "num_stages": 3}, (0, 3, 4, 5, 6, 7))
    res[f"d{d}-g{group}"] = {**usage(k), "tma": k.asm["ptx"].count("cp.async.bulk.tensor")}
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_tma_prefill_builds_on_wgmma_without_spilling():
    res = run(SCRIPT)
    for name, r in res.items():
        # 254-255 registers (the gather kernel: 190); MHA (group 1) keeps an 8-byte stack frame
        assert r["local"] == 0 and r["stack"] <= 16, (name, r)
        assert r["shared"] <= 227 * 1024, (name, r)
        assert r["wgmma"] >= 2 and r["tma"] >= 2, (name, r)  # QK^T and PV; a K and a V box a tile
