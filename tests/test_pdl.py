"""Programmatic dependent launch (opmap.kernels.pdl): only on a CUDA sm90+ device and never in the
interpreter (on by default there, OPMAP_PDL=0 turns it off); and every PDL-aware kernel, compiled for sm90 with PDL on, carries
both griddepcontrol instructions, the wait for the predecessor before the release of the
dependents (compiled as in sm90_compile)."""
from sm90_compile import needs_ptxas, run

from opmap.kernels import pdl


def test_off_by_default_and_on_cpu(monkeypatch):
    assert pdl.launch("cpu") == {"PDL": False}  # the CPU run: interpreter or not, never PDL
    monkeypatch.setattr(pdl, "_ASKED", True)  # as if OPMAP_PDL=1 had been set at start-up
    assert not pdl.enabled("cpu")  # not a CUDA device
    assert pdl.launch("cpu") == {"PDL": False}


SCRIPT = r'''
from opmap.kernels.norm import triton_norm as n
from opmap.kernels.gemm import triton_gemm as g
from opmap.kernels.rope import triton_rope as r
from opmap.kernels.activation import triton_act as a
from opmap.kernels.attention import kv_append as kv
from opmap.kernels.attention import decode as dm
from opmap.kernels.attention import splitkv as sk

def comp(fn, sig, ce, nw=4, ns=3):
    sig = dict(sig, PDL="constexpr")
    k = compile_sm90(fn, sig, dict(ce, PDL=True), {"num_warps": nw, "num_stages": ns, "launch_pdl": True})
    ptx = k.asm["ptx"]
    return {"wait": ptx.count("griddepcontrol.wait"), "launch": ptx.count("griddepcontrol.launch_dependents"),
            "wait_first": ptx.find("griddepcontrol.wait") < ptx.find("griddepcontrol.launch_dependents")}

res = {}
res["rmsnorm"] = comp(n._rmsnorm_kernel, {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "o_ptr": "*bf16",
    "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "R": "i32", "H": "i32", "eps": "fp32", "HAS_RES": "constexpr",
    "ONE_PASS": "constexpr", "ROWS": "constexpr", "BLOCK": "constexpr"}, {"HAS_RES": True, "ONE_PASS": True, "ROWS": 1, "BLOCK": 4096})
res["qk_norm"] = comp(n._qk_norm_kernel, {"x_ptr": "*bf16", "wq_ptr": "*bf16", "wk_ptr": "*bf16", "stride_t": "i32",
    "stride_h": "i32", "R": "i32", "NH": "i32", "HQ": "i32", "D": "i32", "eps": "fp32", "ROWS": "constexpr",
    "BLOCK": "constexpr"}, {"ROWS": 8, "BLOCK": 128})
gemm_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*fp32", "b_ptr": "*bf16", "o_ptr": "*bf16", "ws_ptr": "*fp32",
    "cnt_ptr": "*i32", "a_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
    "stride_om": "i32", "stride_am": "i32", "K_PER_SPLIT": "i32", "W_KIND": "constexpr", "HAS_SCALE": "constexpr", "HAS_BIAS": "constexpr", "SPLIT": "constexpr",
    "EVEN_K": "constexpr", "PREC": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
for name, split in (("gemm", 1), ("gemm-split", 3)):
    res[name] = comp(g._gemm_kernel, gemm_sig, {"W_KIND": g.W_SAME, "HAS_SCALE": False, "HAS_BIAS": False, "SPLIT": split,
        "EVEN_K": True, "PREC": "tf32", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256})
res["rope"] = comp(r._rope_kernel, {"q_ptr": "*bf16", "k_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32", "stride_qt": "i32",
    "stride_qh": "i32", "stride_kt": "i32", "stride_kh": "i32", "HQ": "i32", "HK": "i32", "HALF": "i32", "IS_NEOX": "constexpr",
    "BLOCK_H": "constexpr", "BLOCK_D": "constexpr"}, {"IS_NEOX": True, "BLOCK_H": 32, "BLOCK_D": 64})
res["act"] = comp(a._act_mul_kernel, {"x_ptr": "*bf16", "o_ptr": "*bf16", "stride_x": "i32", "stride_o": "i32", "H": "i32",
    "GELU": "constexpr", "BLOCK": "constexpr"}, {"GELU": False, "BLOCK": 1024})
res["kv_append"] = comp(kv._append_kernel, {"k_ptr": "*bf16", "v_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16",
    "slot_ptr": "*i64", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "stride_kt": "i32", "stride_vt": "i32", "ROW_K": "constexpr",
    "ROW_V": "constexpr", "D": "constexpr", "DV": "constexpr", "BLOCK": "constexpr", "FP8": "constexpr"},
    {"ROW_K": 1024, "ROW_V": 1024, "D": 128, "DV": 128, "BLOCK": 1024, "FP8": False})
dsig = {"q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "o_ptr": "*bf16", "lse_ptr": "*fp32", "po_ptr": "*fp32",
        "pl_ptr": "*fp32", "sl_ptr": "*i32", "bt_ptr": "*i32", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "cu_ptr": "*i32",
        "scale": "fp32", "soft_cap": "fp32", "window": "i32", "split_tokens": "i32", "max_splits": "i32", "min_chunk": "i32"}
for x in ["s_qb", "s_qh", "s_ob", "s_oh", "s_bt", "s_kp", "s_ks", "s_kh", "s_vp", "s_vs", "s_vh", "s_pob", "s_poh", "s_pos", "s_plb", "s_plh"]:
    dsig[x] = "i32"
for x in ["GROUP", "D", "DV", "PAGE", "BLOCK_H", "BLOCK_N", "HAS_WINDOW", "HAS_CAP", "FP8", "RETURN_LSE", "IEEE", "Q_FROM_CU", "PREFETCH"]:
    dsig[x] = "constexpr"
res["decode"] = comp(dm._decode_kernel, dsig, dict(GROUP=4, D=128, DV=128, PAGE=16, BLOCK_H=16, BLOCK_N=64, HAS_WINDOW=False,
    HAS_CAP=False, FP8=False, RETURN_LSE=False, IEEE=False, Q_FROM_CU=False, PREFETCH=1))
res["combine"] = comp(sk._combine_kernel, {"o_ptr": "*bf16", "lse_ptr": "*fp32", "po_ptr": "*fp32", "pl_ptr": "*fp32",
    "sl_ptr": "*i32", "cu_ptr": "*i32", "window": "i32", "split_tokens": "i32", "max_splits": "i32", "min_chunk": "i32",
    "s_ob": "i32", "s_oh": "i32", "s_pob": "i32", "s_poh": "i32", "s_pos": "i32", "s_plb": "i32", "s_plh": "i32",
    "DV": "constexpr", "BLOCK_N": "constexpr", "HAS_WINDOW": "constexpr", "RETURN_LSE": "constexpr", "Q_FROM_CU": "constexpr",
    "S_P": "constexpr", "BLOCK_S": "constexpr"},
    {"DV": 128, "BLOCK_N": 64, "HAS_WINDOW": False, "RETURN_LSE": False, "Q_FROM_CU": False, "S_P": 32, "BLOCK_S": 32})
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_pdl_kernels_compile_with_both_griddepcontrol_instructions():
    res = run(SCRIPT)
    assert len(res) == 9, sorted(res)
    for name, r in res.items():
        assert r["wait"] >= 1 and r["launch"] >= 1, f"{name}: {r}"
        # waiting before releasing keeps the chain one kernel deep (the reverse order measured slower)
        assert r["wait_first"], f"{name}: {r}"
