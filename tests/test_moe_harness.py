"""The MoE check cases pass on this device, and the bench cases are well formed (their FLOPs
count only the routed work, their bytes only the experts the routing hits)."""
import torch

from opmap.harness.bench.cases import moe as bench_moe
from opmap.harness.check.cases import moe as check_moe
from opmap.kernels.moe.tma_moe import pick_bm


def test_check_cases_pass_on_cpu():
    cs = check_moe.cases("cpu", quick=True)
    sections = {c.section for c in cs}
    assert {"parity", "boundaries", "input"} <= sections
    assert {c.backend for c in cs} >= {"reference", "torch-loop", "torch-grouped-mm"}
    # One case per (backend, section, dtype): the shapes themselves are covered by the other
    # MoE test files; this checks that the cases run and pass as `opmap check` runs them.
    seen, picked = set(), []
    for c in cs:
        key = (c.backend, c.section, c.case.rsplit("dtype=", 1)[-1])
        if key not in seen:
            seen.add(key)
            picked.append(c)
    failed = []
    for c in picked:
        o = c.run()
        if not o.passed:
            failed.append(f"{c.title}: {o.figure}")
    assert not failed, failed


def test_bench_cases_figures():
    all_cases = bench_moe.cases(quick=True)
    cs = [c for c in all_cases if c.op == "moe"]
    assert len(cs) == 8
    quant = [c for c in all_cases if c.op == "moe.quant"]
    # each token count of TOKENS with int4 and with block-fp8 experts
    assert len(quant) == 16 and {c.spec.tokens for c in quant} == {1, 64, 512, 4096}
    for c in quant:
        kv = dict(p.split("=") for p in c.case.split(","))
        T, E, k, H, I, hit = (int(kv[n]) for n in ("T", "E", "k", "H", "I", "hit"))
        per = 0.5 + 2 / 128 if kv["w"].startswith("int4") else 1 + 4 / 128 ** 2
        assert c.flops == 2 * T * k * 3 * H * I and c.bytes == hit * 3 * H * I * per + 4 * T * H + 4 * T * E
        assert c.spec.weight_dtype in ("int4", "fp8-block") and c.spec.group_size == 128
        assert {p.name for p in c.providers} == {"opmap-triton", "opmap-triton+graph", "opmap-dequant-triton+graph",
                                                 "opmap-triton-bf16+graph"}
    for c in cs:
        kv = dict(p.split("=") for p in c.case.split(","))
        T, E, k, H, I, hit = (int(kv[n]) for n in ("T", "E", "k", "H", "I", "hit"))
        assert c.flops == 2 * T * k * 3 * H * I
        assert hit <= min(E, T * k)
        assert c.bytes == hit * 3 * H * I * 2 + 4 * T * H + 4 * T * E
        names = {p.name for p in c.providers}
        assert {"opmap-triton", "torch-loop", "torch-grouped-mm"} <= names
        assert ("cublas-dense-same-flops" in names) == (T > 64)
        # the TMA route at prefill sizes, with a variant row at the row tile its plan does not pick
        assert ("opmap-triton-tma+graph" in names) == (T > 64)
        if T > 64:
            other = 128 if pick_bm(T * k, E) == 64 else 64
            assert f"opmap-triton-tma[bm={other}]+graph" in names
            assert sum(n.startswith("opmap-triton-tma[bm=") for n in names) == 1
    # The hit count is that of the routing the setup draws.
    logits = bench_moe._logits(64, 128, 1064)
    assert bench_moe._experts_hit(logits, 8) == torch.unique(logits.topk(8, -1).indices).numel()


def test_quantised_bench_setup_runs_tiny_on_cpu():
    inp = bench_moe._quantised_setup(5, 4, 2, 128, 128, 1, "int4")("cpu")
    inp = {**inp, "x": inp["x"].half()}
    out = bench_moe._call("triton", True)(inp)()
    from opmap.ops.moe import reference
    ref = reference.moe(inp["x"], inp["logits"], inp["q13"], inp["q2"], 2, **inp["scales"])
    assert torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_bench_providers_run_tiny_on_cpu():
    # fp16: the Triton interpreter mishandles bf16 (the GPU run uses bf16).
    inp = bench_moe._setup(5, 4, 2, 32, 16, 1, torch.float16)("cpu")
    outs = {}
    for p in bench_moe.providers(prefill=True):
        if "graph" in p.name:
            continue  # CUDA graphs need a GPU
        outs[p.name] = p.make(inp)()
    assert "cublas-dense-same-flops" in outs
    ref = outs["torch-loop"]
    for name in ("opmap-triton", "torch-grouped-mm"):
        torch.testing.assert_close(outs[name], ref, atol=2e-3, rtol=2e-3)
