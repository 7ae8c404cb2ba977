"""Linear: reference vs an fp64 matmul, Triton (dense / int8 / fp8, split-K, the fp8
bit-decoding path) vs reference at odd shapes, bad input, registry (each weight-only kernel its
own backend, selected where it must be and rejected with its reason elsewhere), the Gluon
launchers' plans and contracts (their kernels run on the GPU only), custom op."""
import pytest
import torch

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.ops.gemm import quant
from opmap.ops.gemm import reference as ref
from opmap.core.select import select
from opmap.core.specs import GemmSpec
from opmap.kernels.gemm import splitk
from opmap.kernels.gemm import triton_gemm as tri
from opmap.kernels.gemm import wo_common, wo_gluon, wo_wgmma
from opmap.core.tolerance import assert_close


def _inputs(M, N, K, dtype, fmt, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    if fmt is None:
        return x, w, b, None
    wq, s = quant.quantize_weight(w, fmt)
    return x, wq, b, s


def test_reference_matches_fp64_matmul():
    x, wq, b, s = _inputs(5, 33, 70, torch.float32, "int8", True, 0)
    exp = x.double() @ (wq.double() * s.double()[:, None]).t() + b.double()
    assert_close(ref.linear(x, wq, b, s), exp.float())


# M covers decode sizes and a prefill size; N includes a vocab-like odd width (interpreter:
# small K); K includes widths that are not multiples of the K tile.
@pytest.mark.parametrize("M,N,K", [(1, 32001, 16), (3, 130, 200), (17, 64, 95), (64, 96, 128), (1000, 40, 48)])
@pytest.mark.parametrize("fmt", [None, "int8", "fp8"])
def test_triton_matches_reference(M, N, K, fmt):
    if fmt == "int8" and N == 32001:
        N = 4097  # the vocab-sized N is covered by the dense and fp8 runs (seconds each here)
    for dtype in ([torch.float16, torch.float32] if M == 3 else [torch.float16]):
        x, w, b, s = _inputs(M, N, K, dtype, fmt, bias=M % 2 == 1, seed=M + N)
        assert_close(tri.linear(x, w, b, s), ref.linear(x, w, b, s), scale=2.0)


@pytest.mark.parametrize("fmt", [None, "fp8"])
def test_triton_split_k(fmt):
    # Few N tiles -> split K; the partials are reduced deterministically with scale and bias.
    x, w, b, s = _inputs(2, 48, 1024 + 64, torch.float16, fmt, bias=True, seed=7)
    p = tri.plan(2, 48, 1088, sms=8)
    p["SPLIT"] = 3
    out = tri.linear(x, w, b, s, _plan=p)
    assert_close(out, ref.linear(x, w, b, s), scale=2.0)
    assert torch.equal(out, tri.linear(x, w, b, s, _plan=p))  # deterministic
    assert tri.plan(1, 2048, 8192, sms=132)["SPLIT"] > 1  # 32 tiles for 132 SMs: split
    assert tri.plan(1, 4096, 14336, sms=132)["SPLIT"] == 1  # 64 tiles: no split won on the H200
    assert tri.plan(1, 28672, 4096, sms=132)["SPLIT"] == 1  # enough N tiles already
    # weight-only at M <= 32: 4 splits below one tile an SM, 2 below four tiles an SM
    assert tri.plan(1, 4096, 14336, sms=132, quantised=True)["SPLIT"] == 4
    assert tri.plan(16, 6144, 4096, sms=132, quantised=True)["SPLIT"] == 4
    assert tri.plan(1, 28672, 4096, sms=132, quantised=True)["SPLIT"] == 2
    assert tri.plan(1, 128256, 4096, sms=132, quantised=True)["SPLIT"] == 1  # 2004 tiles: no split
    assert tri.plan(1, 4096, 2048, sms=132, quantised=True)["SPLIT"] == 2  # >= 4 K-blocks of 256 a split
    # M 33-64: as before
    assert tri.plan(64, 4096, 14336, sms=132, quantised=True)["SPLIT"] == 9  # 32 tiles: the dense rule
    assert tri.plan(64, 28672, 4096, sms=132, quantised=True)["SPLIT"] == 1
    assert tri.plan(64, 28672, 4096, sms=132)["BLOCK_N"] == 128  # x re-reads halved at M = 64
    # an over-asked split shrinks to the splits that have K left (no empty programs)
    p = dict(tri.plan(2, 48, 1088, sms=8), SPLIT=40)
    assert_close(tri.linear(x, w, b, s, _plan=p), ref.linear(x, w, b, s), scale=2.0)



def test_split_k_counters_reset_and_grow():
    # The tile's last split sums the partials and resets its counter: every call starts from
    # zeros, also when a grid of several M and N tiles outgrows the buffer (a bigger one is made,
    # the old one kept alive for graphs captured with it).
    x, w, b, s = _inputs(40, 700, 1088, torch.float16, "fp8", bias=True, seed=11)
    p = dict(tri.plan(40, 700, 1088, sms=8), BLOCK_M=16, BLOCK_N=64, SPLIT=3)  # 3 x 11 tiles
    splitk._COUNTERS.clear()
    first = tri.linear(x[:1], w, b, s, _plan=dict(p, BLOCK_M=16))  # 11 tiles: the default buffer
    small = splitk._COUNTERS[(x.device, 0)]
    out = tri.linear(x, w, b, s, _plan=p)
    assert_close(out, ref.linear(x, w, b, s), scale=2.0)
    assert_close(first, ref.linear(x[:1], w, b, s), scale=2.0)
    grown = splitk._COUNTERS[(x.device, 0)]
    assert grown.numel() >= 33 and any(r is small for r in splitk._RETIRED)
    assert not grown.any() and not small.any()
    assert torch.equal(out, tri.linear(x, w, b, s, _plan=p)) and not grown.any()

def test_captured_split_k_calls_take_graph_counters_made_before_the_capture(monkeypatch):
    # A call inside a CUDA-graph capture never makes counters (they would come from the graph's
    # pool uninitialised and aliased): it takes the device's graph counters, which the eager call
    # before made and zeroed, and names the warm-up it needs when there are none or too few.
    x, w, b, s = _inputs(40, 700, 1088, torch.float16, "fp8", bias=True, seed=12)
    p = dict(tri.plan(40, 700, 1088, sms=8), BLOCK_M=16, BLOCK_N=64, SPLIT=3)  # 3 x 11 tiles
    monkeypatch.setattr(splitk, "_GRAPH_COUNTERS", {})
    monkeypatch.setattr(splitk, "_COUNTERS", {})
    capturing = [True]
    monkeypatch.setattr(splitk, "capturing", lambda device: capturing[0])
    with pytest.raises(RuntimeError, match="run it once outside the capture first"):
        tri.linear(x, w, b, s, _plan=p)
    assert not splitk._COUNTERS and not splitk._GRAPH_COUNTERS  # nothing made inside the capture
    capturing[0] = False
    eager = tri.linear(x, w, b, s, _plan=p)
    graph = splitk._GRAPH_COUNTERS[x.device]
    assert graph is not splitk._COUNTERS[(x.device, 0)] and graph.numel() >= 33 and not graph.any()
    capturing[0] = True
    assert torch.equal(tri.linear(x, w, b, s, _plan=p), eager) and not graph.any()
    assert splitk._GRAPH_COUNTERS[x.device] is graph and len(splitk._COUNTERS) == 1
    with pytest.raises(RuntimeError, match="6000 output tiles"):
        splitk.counters(6000, x.device)


def test_triton_fp8_bit_decoding_path():
    # The path used on GPUs without an fp8 conversion instruction (sm80): covers every
    # fp8 byte that quantisation can produce, subnormals and both signs included.
    vals = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8)
    vals = vals[(vals & 0x7F) != 0x7F]  # drop the two NaN encodings
    wq = vals.view(torch.float8_e4m3fn).reshape(2, -1)[:, :112].contiguous()
    s = torch.tensor([0.5, 2.0])
    x = torch.randn(3, 112, dtype=torch.float16)
    p = tri.plan(3, 2, 112, sms=8)
    p["W_KIND"] = tri.W_FP8_BITS
    assert_close(tri.linear(x, wq, None, s, _plan=p), ref.linear(x, wq, None, s), scale=2.0)


def test_quantize_weight_roundtrip_and_zero_rows():
    torch.manual_seed(0)
    w = torch.randn(5, 300, dtype=torch.bfloat16)
    w[2] = 0
    for fmt, dt, tol in (("fp8", torch.float8_e4m3fn, 0.07), ("int8", torch.int8, 0.005)):
        wq, s = quant.quantize_weight(w, fmt)
        assert wq.dtype == dt and s.dtype == torch.float32 and s.shape == (5,)
        back = quant.dequantize_weight(wq, s)
        assert torch.isfinite(back).all() and torch.all(back[2] == 0)
        rel = (back - w.float()).abs().amax(1) / w.float().abs().amax(1).clamp_min(1e-9)
        assert float(rel.max()) <= tol
        # the largest magnitude of each row is represented exactly
        assert torch.allclose(back.abs().amax(1), w.float().abs().amax(1), rtol=1e-2)


@pytest.mark.parametrize("impl", [ref, tri])
def test_bad_input_is_input_error(impl):
    x = torch.randn(4, 64, dtype=torch.float16)
    w = torch.randn(32, 64, dtype=torch.float16)
    wq, s = quant.quantize_weight(w, "int8")
    with pytest.raises(InputError, match="w"):
        impl.linear(x, torch.randn(32, 63, dtype=torch.float16))  # mismatched K
    with pytest.raises(InputError, match="w"):
        impl.linear(x, w.float())  # dtype differs from x and is not a quantised format
    with pytest.raises(InputError, match="x"):
        impl.linear(x.to(torch.int32), w)
    with pytest.raises(InputError, match="x"):
        impl.linear(x[None], w)  # 3-D
    with pytest.raises(InputError, match="w_scale"):
        impl.linear(x, wq)  # quantised weight without its scale
    with pytest.raises(InputError, match="w_scale"):
        impl.linear(x, wq, None, s[:31])  # scale of the wrong shape
    with pytest.raises(InputError, match="w_scale"):
        impl.linear(x, wq, None, s[:, None])
    with pytest.raises(InputError, match="w_scale"):
        impl.linear(x, wq, None, s.half())
    with pytest.raises(InputError, match="w_scale"):
        impl.linear(x, w, None, s)  # a scale for dense weights
    with pytest.raises(InputError, match="bias"):
        impl.linear(x, w, torch.randn(31, dtype=torch.float16))


def test_registry_declarations():
    names = {b.name for b in registry.backends("gemm")}
    assert {"reference", "cublas", "triton-decode", "triton-wo", "gluon-wo", "gluon-wo-wgmma", "dequant-cublas",
            "scaled-mm"} <= names
    assert select("gemm", GemmSpec(arch="sm90", m=1), runtime=False).name == "triton-decode"
    assert select("gemm", GemmSpec(arch="sm90", m=4096), runtime=False).name == "cublas"
    assert select("gemm", GemmSpec(arch="sm90", m=1, weight_dtype="int8"), runtime=False).name == "gluon-wo"
    fp8act = GemmSpec(arch="sm90", m=64, weight_dtype="fp8", act_dtype="fp8")
    assert select("gemm", fp8act, runtime=False).name == "scaled-mm"
    sm = registry.get("gemm", "scaled-mm")
    assert any("multiple of 16" in r for r in sm.validate(fp8act.replace(n=32001)))
    assert any("arch" in r for r in sm.validate(fp8act.replace(arch="sm80")))
    # cuBLAS never silently takes a quantised weight
    assert registry.get("gemm", "cublas").validate(GemmSpec(weight_dtype="fp8"))


# (arch, m, phase, weight dtype, activation dtype, K) -> the weight-only kernel planned there: each
# kernel is its own backend, the M bounds of docs/dense.md's Decisions (mma.sync up to 32, the
# warpgroup MMAs to 64 on sm90, the many-row routes from 128 or a prefill step), and the Triton
# kernel wherever no Gluon kernel serves (sm80, fp32 activations, K not a multiple of 16, M unknown).
@pytest.mark.parametrize("arch,m,phase,wd,dtype,k,want", [
    ("sm90", 1, "decode", "fp8", "bf16", 4096, "gluon-wo"), ("sm90", 32, "decode", "int8", "fp16", 4096, "gluon-wo"),
    ("sm89", 16, "decode", "fp8", "bf16", 4096, "gluon-wo"), ("sm90", 33, "decode", "fp8", "bf16", 4096, "gluon-wo-wgmma"),
    ("sm90", 64, "decode", "int8", "bf16", 4096, "gluon-wo-wgmma"), ("sm89", 48, "decode", "fp8", "bf16", 4096, "triton-wo"),
    ("sm90", 65, "decode", "fp8", "bf16", 4096, "triton-wo"), ("sm90", 127, "mixed", "int8", "bf16", 4096, "triton-wo"),
    ("sm90", None, "mixed", "fp8", "bf16", 4096, "triton-wo"), ("sm90", None, "decode", "int8", "bf16", 4096, "triton-wo"),
    ("sm80", 1, "decode", "int8", "bf16", 4096, "triton-wo"), ("sm90", 1, "decode", "fp8", "fp32", 4096, "triton-wo"),
    ("sm90", 16, "decode", "fp8", "bf16", 4104, "triton-wo"), ("sm90", 48, "decode", "int8", "bf16", 4100, "triton-wo"),
    ("sm90", 128, "mixed", "fp8", "bf16", 4096, "scaled-mm"), ("sm90", 128, "mixed", "int8", "bf16", 4096, "dequant-cublas"),
    ("sm90", None, "prefill", "fp8", "bf16", 4096, "scaled-mm"), ("sm89", 1024, "prefill", "fp8", "bf16", 4096, "dequant-cublas")])
def test_each_weight_only_kernel_is_selected_where_it_serves(arch, m, phase, wd, dtype, k, want):
    spec = GemmSpec(arch=arch, m=m, phase=phase, k=k, dtype=dtype, weight_dtype=wd)
    assert select("gemm", spec, runtime=False).name == want


def test_the_gluon_backends_say_why_they_cannot_serve():
    """Rejected with the reason, in words, where their kernels cannot run: M out of range or
    unknown, an arch without the instructions, fp32 activations, K not a multiple of 16, and at run
    time the interpreter (these tests run in it) or a process without a GPU."""
    wo, wg = registry.get("gemm", "gluon-wo"), registry.get("gemm", "gluon-wo-wgmma")
    base = GemmSpec(arch="sm90", m=16, weight_dtype="fp8")
    assert not wo.validate(base) and not wg.validate(base.replace(m=48))
    assert any("M known and <= 32" in r for r in wo.validate(base.replace(m=33)))
    assert any("M known and <= 32" in r for r in wo.validate(base.replace(m=None)))
    assert any("32 < M <= 64" in r for r in wg.validate(base.replace(m=32)))
    assert any("32 < M <= 64" in r for r in wg.validate(base.replace(m=65)))
    assert any("arch=sm80 not served" in r for r in wo.validate(base.replace(arch="sm80")))
    assert any("arch=sm89 not served" in r for r in wg.validate(base.replace(arch="sm89", m=48)))
    assert any("bf16 / fp16 activations" in r for r in wo.validate(base.replace(dtype="fp32")))
    assert any("not a multiple of 16" in r for r in wg.validate(base.replace(m=48, k=4100)))
    assert any("weight-only" in r for r in wo.validate(base.replace(weight_dtype="bf16")))
    assert any("act_dtype" in r for r in wo.validate(base.replace(act_dtype="fp8")))
    runtime = wo.validate(base, runtime=True)
    assert runtime and ("TRITON_INTERPRET=1" in runtime[0] or "no CUDA device" in runtime[0])
    # selected for the local device here (the interpreter), the Triton kernel serves instead
    assert select("gemm", base, runtime=True).name == "triton-wo"
    choice = select("gemm", base.replace(m=48), runtime=False)
    assert choice.name == "gluon-wo-wgmma" and "m=48 not supported" in choice.explain()


def test_gluon_launchers_check_their_contract_before_any_launch():
    """Each Gluon launcher raises InputError naming the argument for what its kernel cannot take
    (the registry routes such calls to triton-wo); the CPU tensors here fail on the device last."""
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    wq, s = quant.quantize_weight(torch.randn(32, 64), "int8")
    for lin, rows in ((wo_gluon.linear, 33), (wo_wgmma.linear, 65)):
        with pytest.raises(InputError, match="^x: got 3 dims"):
            lin(x[None], wq, None, s)  # linear's shared contract first
        with pytest.raises(InputError, match="^w: got dtype bf16"):
            lin(x, torch.randn(32, 64, dtype=torch.bfloat16))
        with pytest.raises(InputError, match="^x: got dtype fp32"):
            lin(x.float(), wq, None, s)
        with pytest.raises(InputError, match=f"^x: got {rows} rows"):
            lin(torch.randn(rows, 64, dtype=torch.bfloat16), wq, None, s)
        with pytest.raises(InputError, match="^x: got K = 40"):
            lin(x[:, :40], wq[:, :40].contiguous(), None, s)
        with pytest.raises(InputError, match="^x: got row stride 66"):
            lin(torch.randn(4, 66, dtype=torch.bfloat16)[:, :64], wq, None, s)
        with pytest.raises(InputError, match="^w: got row stride 72"):
            lin(x, torch.zeros(32, 72, dtype=torch.int8)[:, :64], None, s)
        with pytest.raises(InputError, match="^x: got device cpu") as e:
            lin(x, wq, None, s)
        assert "Triton interpreter" in str(e.value)
    with pytest.raises(InputError, match="config"):
        wo_common.config_of({"GLUON": 0})  # a config never picks another kernel: that is a backend


def test_cublas_peer_rejects_quantised_weight():
    x = torch.randn(2, 32)
    wq, s = quant.quantize_weight(torch.randn(16, 32), "fp8")
    with pytest.raises(InputError, match="w"):
        registry.get("gemm", "cublas")("linear", x, wq, None, s)
    w = torch.randn(16, 32)
    assert_close(registry.get("gemm", "cublas")("linear", x, w), ref.linear(x, w))


def test_custom_op_opcheck():
    import opmap  # noqa: F401  (registers torch.ops.opmap.*)

    x, wq, b, s = _inputs(2, 16, 32, torch.float32, "int8", True, 3)
    torch.library.opcheck(torch.ops.opmap.linear, (x, wq, b, s))
    assert_close(torch.ops.opmap.linear(x, wq, b, s), ref.linear(x, wq, b, s))


def test_bench_cases_providers_run_and_agree(monkeypatch):
    from opmap.harness.bench.cases import gemm as bench
    from opmap.harness.bench.runner import why_not

    monkeypatch.setattr(bench, "SHAPES", [(64, 48)])
    monkeypatch.setattr(bench, "MS", (1, 3))
    monkeypatch.setattr(bench, "ACT_QUANT_MS", (5,))
    every = bench.cases(quick=True)
    cs = [c for c in every if c.op == "gemm"]
    assert len(cs) == 6
    aq = [c for c in every if c.op == "gemm.act_quant"]
    assert [c.case for c in aq] == ["M=5,K=64,dtype=bf16"] and aq[0].bytes == 5 * 64 * 3 + 5 * 4
    x = aq[0].setup("cpu")["x"].half()
    (q1, s1), (q2, s2) = (p.make({"x": x})() for p in aq[0].providers)
    # the same codes (the interpreter's e4m3 rounding quirks aside: tests/test_act_quant.py)
    assert torch.equal(s1, s2) and (q1.float() == q2.float()).float().mean() > 0.9
    for c in cs:
        fmt = None if "w=bf16" in c.case else c.case.split("w=")[1].split(",")[0]
        wbytes = 48 * 64 * (1 if fmt else 2) + (48 * 4 if fmt else 0)
        assert c.bytes == wbytes + int(c.case.split(",")[0][2:]) * (64 + 48) * 2
        names = {p.name for p in c.providers}
        if fmt:  # each weight-only kernel its own row, named after its backend (M <= 32: the mma.sync one)
            assert {"opmap-triton", "opmap-gluon-wo", "opmap-gluon-wo[s=2]"} <= names
            assert not names & {"opmap-gluon-wo-wgmma", "opmap-dequant-cublas"}
        for p in c.providers:
            if why_not(p, c):
                assert p.name.startswith(("scaled-mm", "opmap-gluon"))  # an sm89+ GPU only, compiled
                continue
            raw = c.setup("cpu")
            inp = {k: (v.half() if v.dtype == torch.bfloat16 else v) for k, v in raw.items()}
            out = p.make(inp)()
            if fmt is None or "bf16" in p.name:
                want, tol = ref.linear(inp["x"], inp["w"]), 2.0  # dense, or the bf16-weight baseline
            elif "act" in p.name:  # fp8 activations too: its own quantisation error on top
                want, tol = ref.linear(inp["x"], inp["w"]), 60.0
            else:  # weight-only: exactly the quantised weight's product (fp8 vs bf16 quality is
                # gated by the check's quant section, not by a tolerance that random draws exceed)
                want, tol = ref.linear(inp["x"], inp["wq"], None, inp["s"]), 2.0
            assert_close(out, want, scale=tol, what=f"{p.name} {c.case}")


@pytest.mark.parametrize("M,N,K", [(130, 33, 70), (128, 300, 257), (0, 16, 32), (200, 1, 16)])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_dequant_cublas_matches_reference(M, N, K, fmt):
    """Prefill's weight-only path: the weight dequantised once (rounded to x's dtype) into the
    shared scratch, then the dense GEMM; odd N and K around the dequantisation tiles."""
    from opmap.kernels.gemm import dequant_cublas as dq

    for dtype in (torch.float16, torch.float32):
        x, w, b, s = _inputs(M, N, K, dtype, fmt, bias=M % 2 == 0, seed=M + N + K)
        assert_close(dq.linear(x, w, b, s), ref.linear(x, w, b, s), scale=2.0)
    # the dequantised weight itself: every element the reference's, rounded once
    x, w, b, s = _inputs(4, N, K, torch.float32, fmt, False, 1)
    assert torch.equal(dq.dequantize(w, s, torch.float32), (w.float() * s[:, None]).float())


def test_dequant_cublas_declarations():
    from opmap.core.specs import GemmSpec

    b = registry.get("gemm", "dequant-cublas")
    assert not b.validate(GemmSpec(arch="sm90", m=1024, weight_dtype="fp8"))
    assert not b.validate(GemmSpec(arch="sm90", m=None, weight_dtype="int8"))
    assert any("M >= 128" in r for r in b.validate(GemmSpec(arch="sm90", m=64, weight_dtype="fp8")))
    assert any("sm89" in r for r in b.validate(GemmSpec(arch="sm80", m=256, weight_dtype="fp8")))
    assert b.validate(GemmSpec(arch="sm90", m=256))  # dense weights are cuBLAS's
    with pytest.raises(InputError, match="w"):
        b("linear", torch.randn(2, 32), torch.randn(16, 32))


def test_describe_names_the_plan_and_the_tuned_config(monkeypatch):
    # What a benchmark row's note says ran: the tiles, the K splits as linear() rounds them, and the
    # autotuner's choice for the shape class once it has one.
    import types

    import triton

    assert tri.describe(1, 48, 8192, "cpu", quantised=True) == "BLOCK_N 64, BLOCK_M 16, 8 K splits, BLOCK_K 64 (fixed)"
    plan = tri.plan
    monkeypatch.setattr(tri, "plan", lambda *a, **k: plan(*a, **dict(k, interp=False)))  # as on a GPU
    monkeypatch.setattr(tri, "_TUNED", {})
    assert tri.describe(3, 4096, 4096, "cpu") == "BLOCK_N 64, BLOCK_M 16, 1 K split"  # not tuned yet
    tri._TUNED[True] = types.SimpleNamespace(best_config=triton.Config({"BLOCK_K": 128}, num_warps=4, num_stages=6))
    assert tri.describe(3, 4096, 4096, "cpu").endswith("BLOCK_K 128, 4 warps, 6 stages (autotuned)")
    # config fixes the tile (AUTOTUNE=0: the shape class's default; a field: that field)
    assert tri.describe(3, 4096, 4096, "cpu", config={"AUTOTUNE": 0}).endswith("BLOCK_K 256, 4 warps, 3 stages (config)")
    assert tri.describe(3, 4096, 4096, "cpu", config={"num_stages": 5}).endswith("BLOCK_K 256, 4 warps, 5 stages (config)")


def test_triton_config_tunes_the_tile_of_its_one_kernel():
    """config= is the Triton kernel's tile (BLOCK_K, warps, stages, AUTOTUNE), checked; the result
    does not depend on it."""
    x, w, b, s = _inputs(3, 40, 200, torch.float16, "int8", bias=True, seed=5)
    want = ref.linear(x, w, b, s)
    for cfg in (None, {"AUTOTUNE": 0}, {"BLOCK_K": 16}, {"BLOCK_K": 32, "num_warps": 8}):
        assert_close(tri.linear(x, w, b, s, config=cfg), want, scale=2.0, what=str(cfg))
    for bad in ({"BLOCK_K": 512}, {"AUTOTUNE": 2}, {"GLUON": 0}, {"BLOCK_K": 48}, {"BLOCK_N": 48}, {"BLOCK_N": 256},
                {"SPLIT": -1}):
        with pytest.raises(InputError, match="config"):
            tri.linear(x, w, b, s, config=bad)


@pytest.mark.parametrize("fmt", [None, "fp8"])
@pytest.mark.parametrize("M,N,K", [(1, 128, 2048), (5, 33, 1000), (16, 200, 512)])
def test_config_block_n_and_split_replace_the_plan_at_decode(fmt, M, N, K):
    """config BLOCK_N / SPLIT (a router's narrow tiles and deep K splits) give the reference's result,
    plain and gated (ragged N, K not a multiple of the splits' tile), and describe() names them; at
    prefill M the planner's tile stays."""
    x, w, b, s = _inputs(M, N, K, torch.float16, fmt, bias=True, seed=N)
    want = ref.linear(x, w, b, s)
    for cfg in ({"BLOCK_N": 16}, {"BLOCK_N": 32, "SPLIT": 8}, {"SPLIT": 3}, {"BLOCK_N": 16, "SPLIT": 16}):
        assert_close(tri.linear(x, w, b, s, config=cfg), want, scale=2.0, what=str(cfg))
        if N % 2 == 0:
            got = tri.linear_act(x, w, b, s, config=cfg)
            h = want.float()
            assert_close(got, (torch.nn.functional.silu(h[:, :N // 2]) * h[:, N // 2:]), scale=4.0, what=str(cfg))
    assert tri.describe(M, N, K, "cpu", quantised=fmt is not None, config={"BLOCK_N": 32, "SPLIT": 2}).startswith(
        "BLOCK_N 32, BLOCK_M 16, 2 K splits")
    assert tri.describe(128, N, K, "cpu", config={"BLOCK_N": 32, "SPLIT": 2}) == tri.describe(128, N, K, "cpu")


@pytest.mark.parametrize("arch,m,n,k,want", [
    ("sm90", 1, 4096, 14336, "triton-decode"), ("sm90", 32, 6144, 4096, "triton-decode"),
    ("sm90", 33, 4096, 4096, "cublas"), ("sm90", 64, 4096, 14336, "cublas"),
    ("sm90", 64, 28672, 4096, "triton-decode"), ("sm90", 64, 128256, 4096, "triton-decode"),
    ("sm90", 65, 28672, 4096, "cublas"), ("sm80", 64, 4096, 14336, "triton-decode")])
def test_decode_gemm_selection_follows_the_measured_m_and_n_bounds(arch, m, n, k, want):
    """sm90 (docs/dense.md, Decisions): the small-M Triton GEMM up to M = 32, and up to 64 on the
    wide projections (N >= 16384); cuBLAS elsewhere."""
    from opmap.core.select import select
    from opmap.core.specs import GemmSpec

    choice = select("gemm", GemmSpec(arch=arch, phase="decode", m=m, n=n, k=k))
    assert choice.name == want
    if arch == "sm90" and m <= 64:  # the explanation states the rule where triton-decode can serve
        assert "priority 50 where M <= 32 or N >= 16384, else 30" in choice.explain()


def test_bench_marks_the_cublas_row_where_it_is_selected(monkeypatch):
    from opmap.core import hw
    from opmap.harness.bench.cases import gemm as bench
    from opmap.harness.bench.runner import selected_backend

    monkeypatch.setattr(hw, "local_arch", lambda: "sm90")  # the bench selects on the local arch
    by_case = {c.case: c for c in bench.cases(quick=True)}
    case = by_case["M=64,N=4096,K=14336,w=bf16,dtype=bf16"]
    assert {p.name: p.backend for p in case.providers}["cublas"] == ("gemm", "cublas")
    assert selected_backend(case) == "cublas"
    assert selected_backend(by_case["M=64,N=28672,K=4096,w=bf16,dtype=bf16"]) == "triton-decode"


def test_weight_only_gluon_plan_takes_the_deepest_pipeline_that_fits_one_wave():
    """wo_gluon.plan on an H200's figures (132 SMs, 228 KiB an SM): splits K towards four programs an
    SM, then the deepest (BLOCK_K, STAGES) whose programs all fit at once; the LM heads (many waves)
    keep the first; config= fixes fields and refuses values the kernel does not take."""
    W = wo_gluon

    def p(M, N, K, cfg=None):
        return W.plan(M, N, K, 132, 228 * 1024, wo_common.config_of(cfg))

    assert p(1, 28672, 4096) == dict(BLOCK_M=8, BLOCK_N=64, BLOCK_K=256, STAGES=2, SPLIT=1)  # 448 programs
    assert p(1, 6144, 4096) == dict(BLOCK_M=8, BLOCK_N=64, BLOCK_K=256, STAGES=3, SPLIT=4)  # 384 fit 3 an SM
    assert p(1, 4096, 14336) == dict(BLOCK_M=8, BLOCK_N=64, BLOCK_K=256, STAGES=2, SPLIT=8)  # 512: 4 an SM
    assert p(32, 28672, 4096) == dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, STAGES=3, SPLIT=1)
    assert p(1, 128256, 4096)["STAGES"] == 3 and p(1, 128256, 4096)["SPLIT"] == 1
    assert p(1, 28672, 4096, {"STAGES": 3}) == dict(BLOCK_M=8, BLOCK_N=64, BLOCK_K=128, STAGES=3, SPLIT=1)
    assert p(1, 28672, 4096, {"BLOCK_K": 256, "STAGES": 3})["STAGES"] == 3  # fixed: two waves, as asked
    for bad in ({"STAGES": 1}, {"BLOCK_K": 512}, {"BLOCK_N": 32}, {"TILE": 3}, {"GLUON": 0}):
        with pytest.raises(InputError):
            wo_common.config_of(bad)


def test_weight_only_wgmma_plan_one_warpgroup_a_program_and_two_on_the_lm_heads():
    """The warpgroup-MMA kernel's plan (gluon-wo-wgmma): 64-row x tiles, 64 output channels (one
    warpgroup) and about four programs an SM, 128 channels on N >= 65536; config= fixes BLOCK_N."""
    V = wo_wgmma

    def p(M, N, K, cfg=None):
        return V.plan(M, N, K, 132, 228 * 1024, wo_common.config_of(cfg))

    assert p(64, 6144, 4096) == dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, STAGES=2, SPLIT=5)
    assert p(33, 4096, 14336) == dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, STAGES=2, SPLIT=8)
    assert p(64, 24576, 4096) == dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, STAGES=3, SPLIT=1)
    assert p(64, 128256, 4096) == dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, STAGES=3, SPLIT=1)
    assert p(64, 28672, 4096, {"BLOCK_N": 128})["BLOCK_N"] == 128
    assert p(64, 28672, 4096, {"STAGES": 3})["STAGES"] == 3
    assert p(5, 28672, 4096)["BLOCK_M"] == 64  # any M <= 64 runs one 64-token tile


def test_bench_times_narrow_tiles_where_few_column_tiles_run():
    """The narrow-tile / deep-split rows (config BLOCK_N, SPLIT) at decode M on a router's width,
    not on Llama's wide projections nor at M = 64."""
    from opmap.harness.bench.cases import gemm as bench
    from opmap.core.specs import GemmSpec

    narrow = {f"opmap-triton[{bench._tag(c)}]" for c in bench.NARROW_VARIANTS}
    assert narrow == {"opmap-triton[split=8]", "opmap-triton[bn=32,split=8]", "opmap-triton[bn=16,split=8]"}
    cases = bench.model_cases({"gemm": [GemmSpec(n=128, k=2048), GemmSpec(n=5120, k=2048)]}, quick=True)
    rows = {(c.spec.m, c.spec.n): {p.name for p in c.providers} for c in cases}
    assert narrow <= rows[(1, 128)]
    assert not narrow & rows[(1, 5120)] and not narrow & rows[(256, 128)]
    assert not any(narrow & {p.name for p in c.providers} for c in bench.cases(quick=True) if c.spec.n > 512)


@pytest.mark.parametrize("fmt,M,N,K,split", [(f, *c) for f in (None, "fp8", "int8") for c in
                                             ((1, 64, 256, None), (5, 70, 200, 3), (16, 128, 512, 2))]
                         + [(None, 3, 40, 0, None)])
def test_linear_add_sums_the_addend_before_the_one_rounding(fmt, M, N, K, split):
    """linear_add: add + x @ w.T (+ bias) rounded once (the reference's fp32 sum), in the Triton
    epilogue after a K split too, and on cuBLAS (addmm; dense weights, no bias); K = 0 gives add (+ bias)."""
    from opmap.peers.gemm import torch_peer

    x, w, b, s = _inputs(M, N, K, torch.float16, fmt, bias=True, seed=M + N)
    add = torch.randn(M, N).half()
    want = ref.linear_add(x, w, add, b, s)
    assert torch.equal(want, (ref._linear32(x, w, b, s, None) + add.float()).half())
    got = tri.linear_add(x, w, add, b, s, _plan={"SPLIT": split} if split else None)
    assert_close(got, want, scale=2.0)
    if fmt is None and K:
        xf, wf, af = x.float(), w.float(), add.float()
        assert_close(torch_peer.linear_add(xf, wf, af), ref.linear_add(xf, wf, af), scale=2.0)


def test_linear_add_refuses_a_bad_addend():
    from opmap.peers.gemm import torch_peer

    x, w, b, s = _inputs(3, 40, 64, torch.float16, None, bias=True, seed=1)
    for bad in (torch.randn(3, 41).half(), torch.randn(3, 40), torch.randn(40, 3).half().t()):
        for fn in (tri.linear_add, ref.linear_add, torch_peer.linear_add):
            with pytest.raises(InputError, match="^add"):
                fn(x, w, bad)
    with pytest.raises(InputError, match="^bias"):
        torch_peer.linear_add(x, w, torch.randn(3, 40).half(), b)


def test_bench_add_rows_compute_the_same_sum():
    """The linear_add bench case (DeepSeek-V2-Lite's shared down width): its rows, one launch and
    the GEMM then an add, on a tiny CPU instance in fp16 (the interpreter mishandles bf16), agree;
    opmap-triton only at decode M, where its backend serves."""
    from opmap.harness.bench.cases import gemm as bench

    cases = [c for c in bench.cases(quick=True) if c.op == "gemm.add"]
    assert {c.spec.m for c in cases} == {1, 16, 64, 256}
    for c in cases:
        assert ("opmap-triton" in {p.name for p in c.providers}) == (c.spec.m <= 64)
        assert (c.spec.n, c.spec.k) == (bench.ADD_SHAPE[1], bench.ADD_SHAPE[0])
    case = next(c for c in cases if c.spec.m == 1)
    inp = {k: v[:, :96].half().contiguous() if k != "w" else v[:40, :96].half().contiguous()
           for k, v in bench._setup(3, 40, 96, None)("cpu").items()}
    inp["add"] = torch.randn(3, 40).half()
    outs = {p.name: p.make(dict(inp, x=inp["x"].float(), w=inp["w"].float(), add=inp["add"].float())
                           if p.name.startswith("cublas") else inp)() for p in case.providers}
    want = ref.linear_add(inp["x"], inp["w"], inp["add"]).float()
    for name, o in outs.items():
        assert_close(o.float(), want, torch.float16, scale=2.0, what=name)  # two roundings where apart


def test_planner_splits_k_deeper_only_where_few_programs_run():
    """Below a quarter of the SMs busy at the 1024-deep K splits (a router's 1-3 column tiles), K
    splits of one 256-deep block up to that quarter; projections with enough programs keep their plan."""
    plan = lambda n, k, m=1: tri.plan(m, n, k, 132, interp=False)["SPLIT"]  # noqa: E731
    assert plan(128, 2048) == 8  # Qwen3-30B-A3B's router: 2 tiles x 8 splits, was 2 x 2
    assert plan(64, 2048) == 8 and plan(160, 5120) == 11  # DeepSeek-V2-Lite's and a 160-expert router
    assert plan(2048, 4096) == 4 and plan(5120, 2048) == 1 and plan(28672, 4096) == 1  # O, QKV, gate/up
    assert plan(128, 512) == 2  # a short K: one 256-deep block a split at most
    assert plan(128, 2048, m=128) == 1  # prefill rows: no split
