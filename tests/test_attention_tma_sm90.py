"""The TMA attention kernels compile for sm90 on this CPU-only machine: the prefill
(ops/attention/prefill_tma.py) at its default tile (BLOCK_M 128, BLOCK_N 64, 8 warps, 3 stages;
d = 128, pages of 64) with its K/V tiles by TMA (cp.async.bulk.tensor) and both dots on wgmma,
no local memory (group 1 keeps an 8-byte stack frame at 255 registers); and the decode
(ops/attention/decode_tma.py). Runs in a subprocess because the interpreter replaces @triton.jit
here."""
from sm90_compile import needs_ptxas, run

SCRIPT = r'''
from opmap.ops.attention import prefill_tma as t

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


DECODE = r'''
from opmap.ops.attention import decode_tma as t

res = {}
for page, fp8 in [(16, False), (64, False), (16, True)]:
    sub = min(page, 64)
    dt = "fp8e4nv" if fp8 else "bf16"
    sig = {"q_ptr": "*bf16", "K_DESC": f"tensordesc<{dt}[1,{sub},1,128]>", "V_DESC": f"tensordesc<{dt}[1,{sub},1,128]>",
           "o_ptr": "*bf16", "lse_ptr": "*fp32", "po_ptr": "*fp32", "pl_ptr": "*fp32", "sl_ptr": "*i32", "bt_ptr": "*i32",
           "ks_ptr": "*fp32", "vs_ptr": "*fp32", "cu_ptr": "*i32", "scale": "fp32", "soft_cap": "fp32", "window": "i32",
           "split_tokens": "i32", "max_splits": "i32", "min_chunk": "i32"}
    for n in ["s_qb", "s_qh", "s_ob", "s_oh", "s_bt", "s_pob", "s_poh", "s_pos", "s_plb", "s_plh"]:
        sig[n] = "i32"
    ce = dict(GROUP=4, D=128, DV=128, PAGE=page, BLOCK_H=16, BLOCK_N=64, SUB=sub, HAS_WINDOW=False, HAS_CAP=False,
              FP8=fp8, RETURN_LSE=False, IEEE=False, Q_FROM_CU=False, PDL=True)
    for n in ce:
        sig[n] = "constexpr"
    div = [i for i, n in enumerate(sig) if n.endswith("_ptr") or n.startswith("s_")]
    k = compile_sm90(t._decode_tma_kernel, sig, ce, {"num_warps": 4, "num_stages": 3, "launch_pdl": True}, div)
    res[f"page{page}-fp8{int(fp8)}"] = {**usage(k), "tma": k.asm["ptx"].count("cp.async.bulk.tensor")}
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_tma_decode_builds_without_spilling():
    """The TMA decode (ops/attention/decode_tma.py) at d128, group 4, BLOCK_N 64, 3 stages: a box per
    16-token page (four K and four V copies a tile) or one per 64-key tile of a 64-token page; no
    stack, at most 128 registers. The page ids come one tile ahead, so every box is double-buffered
    (two 32 KB tiles of K and V, ~70 KB: three programs per SM, as the gather kernel); with the ids
    loaded in the box's own iteration Triton 3.6 single-buffered them (38 KB)."""
    res = run(DECODE)
    for name, r in res.items():
        assert r["stack"] == 0 and r["local"] == 0 and r["reg"] <= 128, (name, r)
        assert r["shared"] <= 75 * 1024, (name, r)
    assert res["page16-fp80"]["shared"] >= 64 * 1024 and res["page64-fp80"]["shared"] >= 64 * 1024
    assert res["page16-fp80"]["tma"] >= 8 and res["page64-fp80"]["tma"] >= 2
