"""Programmatic dependent launch (opmap.ops.pdl): only on a CUDA sm90+ device and never in the
interpreter (on by default there, OPMAP_PDL=0 turns it off); and every PDL-aware kernel, compiled for sm90 with PDL on, carries
both griddepcontrol instructions, the wait for the predecessor before the release of the
dependents; the decode GEMM's optional L2 prefetch of its weight slice ahead of the wait (compiled
as in sm90_compile)."""
from sm90_compile import needs_ptxas, run

from opmap.ops import pdl


def test_off_by_default_and_on_cpu(monkeypatch):
    assert pdl.launch("cpu") == {"PDL": False}  # the CPU run: interpreter or not, never PDL
    monkeypatch.setattr(pdl, "_ASKED", True)  # as if OPMAP_PDL=1 had been set at start-up
    assert not pdl.enabled("cpu")  # not a CUDA device
    assert pdl.launch("cpu") == {"PDL": False}


SCRIPT = r'''
from opmap.ops.norm import triton_norm as n
from opmap.ops.gemm import triton_gemm as g
from opmap.ops.rope import triton_rope as r
from opmap.ops.activation import triton_act as a
from opmap.ops.attention import kv_append as kv, decode as dm

def comp(fn, sig, ce, nw=4, ns=3):
    sig = dict(sig, PDL="constexpr")
    k = compile_sm90(fn, sig, dict(ce, PDL=True), {"num_warps": nw, "num_stages": ns, "launch_pdl": True})
    ptx = k.asm["ptx"]
    return {"wait": ptx.count("griddepcontrol.wait"), "launch": ptx.count("griddepcontrol.launch_dependents"),
            "prefetch": ptx.count("prefetch.global.L2"),
            "wait_first": ptx.find("griddepcontrol.wait") < ptx.find("griddepcontrol.launch_dependents")}

res = {}
res["rmsnorm"] = comp(n._rmsnorm_kernel, {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "o_ptr": "*bf16",
    "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "R": "i32", "H": "i32", "eps": "fp32", "HAS_RES": "constexpr",
    "ONE_PASS": "constexpr", "ROWS": "constexpr", "BLOCK": "constexpr"}, {"HAS_RES": True, "ONE_PASS": True, "ROWS": 1, "BLOCK": 4096})
res["qk_norm"] = comp(n._qk_norm_kernel, {"x_ptr": "*bf16", "wq_ptr": "*bf16", "wk_ptr": "*bf16", "stride_t": "i32",
    "stride_h": "i32", "R": "i32", "NH": "i32", "HQ": "i32", "D": "i32", "eps": "fp32", "ROWS": "constexpr",
    "BLOCK": "constexpr"}, {"ROWS": 8, "BLOCK": 128})
res["gemm"] = comp(g._gemm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*fp32", "b_ptr": "*bf16", "o_ptr": "*bf16",
    "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32", "K_PER_SPLIT": "i32",
    "W_KIND": "constexpr", "HAS_SCALE": "constexpr", "HAS_BIAS": "constexpr", "SPLIT": "constexpr", "EVEN_K": "constexpr",
    "PREC": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
    {"W_KIND": g.W_SAME, "HAS_SCALE": False, "HAS_BIAS": False, "SPLIT": 1, "EVEN_K": True, "PREC": "tf32",
     "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256})
res["splitk"] = comp(g._splitk_reduce, {"ws_ptr": "*fp32", "s_ptr": "*fp32", "b_ptr": "*bf16", "o_ptr": "*bf16", "M": "i32",
    "N": "i32", "stride_om": "i32", "SPLIT": "constexpr", "HAS_SCALE": "constexpr", "HAS_BIAS": "constexpr", "BLOCK": "constexpr"},
    {"SPLIT": 3, "HAS_SCALE": False, "HAS_BIAS": False, "BLOCK": 1024})
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
res["combine"] = comp(dm._combine_kernel, {"o_ptr": "*bf16", "lse_ptr": "*fp32", "po_ptr": "*fp32", "pl_ptr": "*fp32",
    "sl_ptr": "*i32", "cu_ptr": "*i32", "window": "i32", "split_tokens": "i32", "max_splits": "i32", "min_chunk": "i32",
    "s_ob": "i32", "s_oh": "i32", "s_pob": "i32", "s_poh": "i32", "s_pos": "i32", "s_plb": "i32", "s_plh": "i32",
    "DV": "constexpr", "BLOCK_N": "constexpr", "HAS_WINDOW": "constexpr", "RETURN_LSE": "constexpr", "Q_FROM_CU": "constexpr",
    "S_P": "constexpr", "BLOCK_S": "constexpr"},
    {"DV": 128, "BLOCK_N": 64, "HAS_WINDOW": False, "RETURN_LSE": False, "Q_FROM_CU": False, "S_P": 32, "BLOCK_S": 32})
from opmap.ops.moe import grouped_gemm as gg, align as al, route_triton as rt
res["moe_grouped_gemm"] = comp(gg._grouped_gemm_kernel, {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
    "weights_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "total_ptr": "*i32", "n_pairs": "i32", "N": "i32",
    "K": "i32", "a_row_div": "i32", "rows_bucket": "i32", "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32",
    "stride_om": "i32", "GATED": "constexpr", "WEIGHTED": "constexpr", "EVEN_K": "constexpr", "PRECISION": "constexpr",
    "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "GROUP_M": "constexpr"},
    dict(GATED=True, WEIGHTED=False, EVEN_K=True, PRECISION="tf32", BM=16, BN=32, BK=128, GROUP_M=8))
res["moe_combine"] = comp(gg._combine_kernel, {"y_ptr": "*bf16", "out_ptr": "*bf16", "H": "i32", "top_k": "i32",
    "stride_y": "i32", "stride_o": "i32", "BH": "constexpr"}, {"BH": 1024})
res["moe_align"] = comp(al._align_kernel, {"ids_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
    "total_ptr": "*i32", "n_pairs": "i32", "E": "i32", "BM": "constexpr", "E_POW2": "constexpr", "CHUNK": "constexpr"},
    {"BM": 16, "E_POW2": 128, "CHUNK": 1024})
res["moe_route"] = comp(rt._route_kernel, {"logits_ptr": "*bf16", "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i32",
    "E": "i32", "stride_l": "i32", "routed_scaling": "fp32", "TOP_K": "constexpr", "K_POW2": "constexpr", "E_POW2": "constexpr",
    "SIGMOID": "constexpr", "HAS_BIAS": "constexpr", "N_GROUP": "constexpr", "G_POW2": "constexpr", "TOPK_GROUP": "constexpr",
    "RENORM": "constexpr"}, dict(TOP_K=8, K_POW2=8, E_POW2=128, SIGMOID=False, HAS_BIAS=False, N_GROUP=1, G_POW2=1,
    TOPK_GROUP=1, RENORM=True))
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_pdl_kernels_compile_with_both_griddepcontrol_instructions(monkeypatch):
    # the decode GEMM's optional L2 prefetch of its weight slice ahead of the wait (off by default)
    monkeypatch.setenv("OPMAP_GEMM_PREFETCH_LINES", "16")
    res = run(SCRIPT)
    assert len(res) == 13
    for name, r in res.items():
        assert r["wait"] >= 1 and r["launch"] >= 1, f"{name}: {r}"
        # waiting before releasing keeps the chain one kernel deep (the reverse order measured slower)
        assert r["wait_first"], f"{name}: {r}"
    assert res["gemm"]["prefetch"] >= 1, res["gemm"]


GEMM_ONLY = SCRIPT.split("res[\"splitk\"]")[0] + "print(\"RESULT \" + json.dumps(res))\n"


@needs_ptxas
def test_gemm_prefetch_off_by_default(monkeypatch):
    monkeypatch.delenv("OPMAP_GEMM_PREFETCH_LINES", raising=False)
    res = run(GEMM_ONLY)
    assert res["gemm"]["prefetch"] == 0 and res["gemm"]["wait_first"], res["gemm"]


def test_prefetch_lines_must_be_a_power_of_two():
    # in a child: importing the module again in this process would replace its kernels
    import os
    import subprocess
    import sys
    env = dict(os.environ, OPMAP_GEMM_PREFETCH_LINES="12")
    out = subprocess.run([sys.executable, "-c", "import opmap.ops.gemm.triton_gemm"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "OPMAP_GEMM_PREFETCH_LINES must be 0 or a power of two, got 12" in out.stderr


def test_moe_kernels_follow_their_own_switch(monkeypatch):
    """OPMAP_PDL_MOE (read at import): off by default, "1" as the other kernels, "late" waits
    without the early release (PDL == 2)."""
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    assert pdl.launch("cuda") == {"PDL": 1, "launch_pdl": True}
    assert pdl.launch("cuda", moe=True) == {"PDL": False}
    for env, want in (("1", pdl._ON), ("late", pdl._LATE)):
        monkeypatch.setattr(pdl, "_MOE", {"1": pdl._ON, "late": pdl._LATE}[env])
        assert pdl.launch("cuda", moe=True) is want
    assert pdl._LATE["PDL"] == 2


LATE_SCRIPT = r'''
from opmap.ops.moe import grouped_gemm as gg
sig = {"y_ptr": "*bf16", "out_ptr": "*bf16", "H": "i32", "top_k": "i32", "stride_y": "i32", "stride_o": "i32",
       "BH": "constexpr", "PDL": "constexpr"}
k = compile_sm90(gg._combine_kernel, sig, {"BH": 1024, "PDL": 2}, {"num_warps": 4, "launch_pdl": True})
ptx = k.asm["ptx"]
print("RESULT " + json.dumps({"wait": ptx.count("griddepcontrol.wait"), "launch": ptx.count("griddepcontrol.launch_dependents")}))
'''


@needs_ptxas
def test_late_release_waits_without_releasing():
    r = run(LATE_SCRIPT)
    assert r == {"wait": 1, "launch": 0}, r
