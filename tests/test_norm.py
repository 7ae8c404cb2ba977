"""RMSNorm / fused add+RMSNorm: reference vs HF LlamaRMSNorm, Triton vs reference (fp32/fp16
in the interpreter), odd shapes, in place, bad input, custom op."""
import pytest
import torch

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.ops.norm import reference as ref
from opmap.kernels.norm import triton_norm as tri
from opmap.core.tolerance import assert_close


def _hf_norm(weight, eps):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = LlamaRMSNorm(weight.shape[0], eps=eps)
    m.weight.data = weight.clone()
    return m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_matches_hf_llama_rmsnorm_bitwise(dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 5120, dtype=dtype) * 3
    w = torch.randn(5120, dtype=dtype)
    with torch.no_grad():
        hf = _hf_norm(w, 1e-5)(x)
    out = ref.rmsnorm(x, w, 1e-5)
    assert out.dtype == dtype
    # Same operations in the same order: identical bits (HF rounds to x.dtype before the weight).
    assert torch.equal(out, hf)


def test_reference_add_rmsnorm_is_add_then_hf_norm():
    torch.manual_seed(1)
    x, res = torch.randn(5, 256, dtype=torch.bfloat16), torch.randn(5, 256, dtype=torch.bfloat16)
    w = torch.randn(256, dtype=torch.bfloat16)
    res0 = res.clone()
    out = ref.add_rmsnorm(x, res, w, 1e-6)
    assert torch.equal(res, res0 + x)
    with torch.no_grad():
        assert torch.equal(out, _hf_norm(w, 1e-6)(res0 + x))


# hidden: 1, odd 4095, 5120 (one pass), 20001 (two passes, > ONE_PASS_MAX); rows include 1.
# (37, 128): short rows packed 8 per program with a partial last program (per-head q/k norm).
@pytest.mark.parametrize("shape", [(1, 1), (37, 128), (3, 4095), (2, 3, 5120), (2, 20001)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", [False, True])
def test_triton_matches_reference(shape, dtype, fused):
    torch.manual_seed(hash((shape, fused)) % 1000)
    H = shape[-1]
    x = torch.randn(shape, dtype=dtype) * 2 + 0.5
    w = torch.randn(H, dtype=dtype)
    if fused:
        r1 = torch.randn(shape, dtype=dtype)
        r2 = r1.clone()
        out = tri.add_rmsnorm(x, r1, w, 1e-6)
        exp = ref.add_rmsnorm(x, r2, w, 1e-6)
        assert_close(r1, r2, what="residual")
    else:
        out = tri.rmsnorm(x, w, 1e-6)
        exp = ref.rmsnorm(x, w, 1e-6)
    # fp16: both round x*rstd to fp16 then multiply; an fp32 rsqrt ulp can flip one rounding.
    assert_close(out, exp, scale=2.0)


def test_triton_fp32_weight_strided_rows_and_in_place():
    torch.manual_seed(3)
    big = torch.randn(6, 300, dtype=torch.float16)
    x = big[:, :257]  # row stride 300, hidden 257
    w = torch.randn(257, dtype=torch.float32)
    exp = ref.rmsnorm(x, w, 1e-5)
    assert_close(tri.rmsnorm(x, w, 1e-5), exp, scale=2.0)
    y = x.clone()
    assert tri.rmsnorm(y, w, 1e-5, out=y) is y  # in place: out aliases x
    assert_close(y, exp, scale=2.0)


def test_empty_rows():
    x = torch.empty(0, 64)
    assert tri.rmsnorm(x, torch.ones(64)).shape == (0, 64)


@pytest.mark.parametrize("impl", [ref, tri])
def test_bad_input_is_input_error(impl):
    x = torch.randn(4, 64, dtype=torch.float16)
    w = torch.randn(64, dtype=torch.float16)
    with pytest.raises(InputError, match="weight"):
        impl.rmsnorm(x, torch.randn(63, dtype=torch.float16))  # mismatched hidden size
    with pytest.raises(InputError, match="x"):
        impl.rmsnorm(x.to(torch.int32), w)  # wrong dtype
    with pytest.raises(InputError, match="weight"):
        impl.rmsnorm(x, w.to(torch.bfloat16))
    with pytest.raises(InputError, match="residual"):
        impl.add_rmsnorm(x, torch.randn(4, 65, dtype=torch.float16), w)
    with pytest.raises(InputError, match="residual"):
        impl.add_rmsnorm(x, torch.randn(4, 64, dtype=torch.float32), w)
    with pytest.raises(InputError, match="x"):
        impl.rmsnorm(torch.randn(64, 4, dtype=torch.float16).t(), torch.randn(4, dtype=torch.float16))
    with pytest.raises(InputError, match="eps"):
        impl.rmsnorm(x, w, -1.0)


def test_registry_entries_and_selection():
    from opmap.core.select import select
    from opmap.core.specs import NormSpec

    names = {b.name for b in registry.backends("rmsnorm")}
    assert {"reference", "triton", "torch-rms_norm"} <= names
    ch = select("rmsnorm", NormSpec(arch="sm90", hidden=4096, fused_add=True), runtime=False)
    assert ch.name == "triton"
    for b in registry.backends("rmsnorm"):
        for entry in ("rmsnorm", "add_rmsnorm", "qk_rmsnorm"):
            assert callable(b.fn(entry))


def test_torch_peer_close_to_reference():
    torch.manual_seed(4)
    x, w = torch.randn(3, 512, dtype=torch.float16), torch.randn(512, dtype=torch.float16)
    peer = registry.get("rmsnorm", "torch-rms_norm")
    assert_close(peer("rmsnorm", x, w, 1e-6), ref.rmsnorm(x, w, 1e-6), scale=2.0)


def test_custom_ops_opcheck():
    import opmap  # noqa: F401  (registers torch.ops.opmap.*)

    torch.manual_seed(5)
    x, w = torch.randn(2, 16), torch.randn(16)
    torch.library.opcheck(torch.ops.opmap.rmsnorm, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.opmap.add_rmsnorm, (x, torch.randn(2, 16), w, 1e-6))
    r = torch.randn(2, 16)
    r0 = r.clone()
    out = torch.ops.opmap.add_rmsnorm(x, r, w, 1e-6)
    assert_close(r, r0 + x)
    assert_close(out, ref.rmsnorm(r0 + x, w, 1e-6))


def test_bench_cases_providers_run_and_agree(monkeypatch):
    # Shrunk shapes; each eager provider runs once on the CPU and agrees with the reference
    # (torch.compile providers need a GPU toolchain and are only constructed here).
    from opmap.harness.bench.cases import norm as bench

    monkeypatch.setattr(bench, "SHAPES", [(3, 40)])
    cs = bench.cases(quick=True)
    assert {c.case for c in cs} == {"R=3,H=40,fused_add=0,dtype=bf16", "R=3,H=40,fused_add=1,dtype=bf16"}
    for c in cs:
        fused = "fused_add=1" in c.case
        assert c.bytes == (4 if fused else 2) * 3 * 40 * 2 + 80
        for p in c.providers:
            if p.name == "torch-compile":
                continue
            inp = {k: v.float() for k, v in c.setup("cpu").items()}
            res0 = inp["res"].clone() if fused else None
            out = p.make(inp)()
            want = ref.rmsnorm(inp["x"] + res0 if fused else inp["x"], inp["w"], bench.EPS)
            assert_close(out, want, scale=2.0, what=f"{p.name} {c.case}")


def _qkv(T, hq, hk, d, dtype, seed=0):
    """A fused qkv projection output [T, (hq + 2 hk) d] and the [T, hq + hk, d] view of its q, k."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (hq + 2 * hk) * d, generator=g) * 3 + 0.5).to(dtype)
    return qkv, qkv[:, :(hq + hk) * d].view(T, hq + hk, d)


@pytest.mark.parametrize("T,hq,hk,d", [(0, 4, 2, 64), (1, 4, 2, 64), (5, 8, 2, 128), (17, 4, 4, 16),
                                       (3, 6, 1, 48), (2, 32, 4, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qk_rmsnorm_in_place_matches_two_norms(T, hq, hk, d, dtype):
    """One launch for Qwen3's q_norm and k_norm on the strided view of the qkv row: equal to the
    two separate norms, in place, and the v columns untouched (odd head_dim 48, MQA, empty)."""
    g = torch.Generator().manual_seed(T * 31 + d)
    wq, wk = torch.randn(d, generator=g).to(dtype), torch.randn(d, generator=g).to(dtype)
    qkv, view = _qkv(T, hq, hk, d, dtype, seed=T)
    before = qkv.clone()
    want_q = ref.rmsnorm(before[:, :hq * d].reshape(T, hq, d), wq, 1e-6)
    want_k = ref.rmsnorm(before[:, hq * d:(hq + hk) * d].reshape(T, hk, d), wk, 1e-6)
    for impl in (tri, ref):
        x = before.clone()
        v = x[:, :(hq + hk) * d].view(T, hq + hk, d)
        assert impl.qk_rmsnorm(v, wq, wk, hq, 1e-6) is v
        assert_close(x[:, :hq * d].view(T, hq, d), want_q, scale=2.0)
        assert_close(x[:, hq * d:(hq + hk) * d].view(T, hk, d), want_k, scale=2.0)
        assert torch.equal(x[:, (hq + hk) * d:], before[:, (hq + hk) * d:])  # v untouched
    peer = registry.get("rmsnorm", "torch-rms_norm")
    x = before.clone()
    peer("qk_rmsnorm", x[:, :(hq + hk) * d].view(T, hq + hk, d), wq, wk, hq, 1e-6)
    assert_close(x[:, :hq * d].view(T, hq, d), want_q, scale=2.0)


@pytest.mark.parametrize("impl", [ref, tri])
def test_qk_rmsnorm_bad_input_is_input_error(impl):
    _, v = _qkv(3, 4, 2, 64, torch.float16)
    w = torch.randn(64, dtype=torch.float16)
    with pytest.raises(InputError, match="num_q_heads"):
        impl.qk_rmsnorm(v, w, w, 7)
    with pytest.raises(InputError, match="w_k"):
        impl.qk_rmsnorm(v, w, w[:63], 4)
    with pytest.raises(InputError, match="w_q"):
        impl.qk_rmsnorm(v, w.to(torch.bfloat16), w, 4)
    with pytest.raises(InputError, match="qk"):
        impl.qk_rmsnorm(v.reshape(3, -1), w, w, 4)  # not [T, heads, head_dim]
    with pytest.raises(InputError, match="eps"):
        impl.qk_rmsnorm(v, w, w, 4, -1.0)
