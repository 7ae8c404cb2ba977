"""The sampler's per-row kernel compiles for sm90 (H200) on this CPU-only machine at the launch
configuration the GPU uses (``sampler._config``): 16 warps, BLOCK 2048, the candidates of passes B
and C in registers. At 8 warps it took 200 registers; a spill at 16 (at most 128 per thread) would
put the candidate search in local memory, which the profiles that chose 16 warps did not show.
Runs in a subprocess because the interpreter (TRITON_INTERPRET=1) replaces @triton.jit here."""
from sm90_compile import needs_ptxas, run

SCRIPT = r'''
import torch
from opmap.kernels.sampling import sampler as s

block, cand, warps, _ = s._config(torch.device("cuda"))
sig = {"logits_ptr": "*fp32", "stride_row": "i32", "V": "i32", "temp_ptr": "*fp32", "topk_ptr": "*i32",
       "topp_ptr": "*fp32", "minp_ptr": "*fp32", "seed_ptr": "*i64", "pos_ptr": "*i64", "ids_ptr": "*i64",
       "invalid_ptr": "*i1", "support_ptr": "*i64", "sz_ptr": "*fp32", "si_ptr": "*i32", "cnt_ptr": "*i32",
       "part_ptr": "*fp32", "n_parts": "i32", "br_ptr": "*i32", "agg2_ptr": "*fp32", "BLOCK": "constexpr", "CAND": "constexpr",
       "WRITE_SUPPORT": "constexpr", "USE_PARTS": "constexpr", "S_P": "constexpr", "HIST": "constexpr"}
ce = {"BLOCK": block, "CAND": cand, "WRITE_SUPPORT": False, "USE_PARTS": True, "S_P": 16, "HIST": True}
k = compile_sm90(s._sample_kernel, sig, ce, {"num_warps": warps},
                 (0, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 17, 18))
res = {"warps": warps, **usage(k)}
# under PDL (on by default on sm90): the same budget, the wait ahead of the release
k = compile_sm90(s._sample_kernel, dict(sig, PDL="constexpr"), dict(ce, PDL=True), {"num_warps": warps, "launch_pdl": True},
                 (0, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 17, 18))
ptx = k.asm["ptx"]
w, l = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
res["pdl"] = {"wait_first": 0 <= w < l, **usage(k)}
print("RESULT " + json.dumps(res))
'''


@needs_ptxas
def test_per_row_kernel_fits_registers_at_its_launch_config():
    r = run(SCRIPT)
    assert r["warps"] == 16
    assert r["stack"] == 0 and r["local"] == 0, r  # no spill
    assert r["reg"] <= 128, r  # 16 warps x 32 threads x 128 fill one SM's register file
    p = r["pdl"]
    assert p["wait_first"] and p["stack"] == 0 and p["local"] == 0 and p["reg"] <= 128, p


CHUNKS = r'''
from opmap.kernels.sampling import sampler as s

flags = {"logits_ptr": "*fp32", "stride_row": "i32", "V": "i32", "temp_ptr": "*fp32", "topk_ptr": "*i32",
         "topp_ptr": "*fp32", "minp_ptr": "*fp32"}
kern = {
    "partials": (s._sample_partials_kernel, dict(flags, seed_ptr="*i64", pos_ptr="*i64", part_ptr="*fp32"), {}),
    "hist": (s._sample_hist_kernel, dict(flags, part_ptr="*fp32", n_parts="i32", hist_ptr="*i32"), {"S_P": 16}),
    "gather": (s._sample_gather_kernel, dict(flags, seed_ptr="*i64", pos_ptr="*i64", part_ptr="*fp32", n_parts="i32",
                                             br_ptr="*i32", sz_ptr="*fp32", si_ptr="*i32", cnt_ptr="*i32",
                                             hist_ptr="*i32", agg_ptr="*fp32", agg2_ptr="*fp32"),
               {"S_P": 16, "CAND": 2048}),
}
out = {}
for name, (fn, sig, extra) in kern.items():
    ce = {"CHUNK": 8192, "BLOCK": 2048, "PDL": True, **extra}
    sig = dict(sig, **{x: "constexpr" for x in ce})
    k = compile_sm90(fn, sig, ce, {"num_warps": 4, "launch_pdl": True}, [i for i, n in enumerate(sig) if n.endswith("_ptr")])
    out[name] = usage(k)
print("RESULT " + json.dumps(out))
'''


@needs_ptxas
def test_chunk_passes_keep_the_next_block_in_flight_without_spilling():
    """Passes A, B and C at their launch config (4 warps, chunks of 8192, PDL) hold the next block's
    load across the current block (sampler_jit's _ahead) within registers: no stack, and at most
    160 registers, so three 4-warp programs still fit on an SM (pass A: 138; B: 72; C: 96)."""
    r = run(CHUNKS)
    for name, u in r.items():
        assert u["stack"] == 0 and u["local"] == 0 and u["reg"] <= 160, (name, u)
