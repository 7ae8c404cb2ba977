"""Gated activations: reference vs independent formulas (torch F.silu / F.gelu tanh in fp64),
Triton vs reference at odd widths, bad input, custom ops."""
import pytest
import torch
import torch.nn.functional as F

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.ops.activation import reference as ref
from opmap.kernels.activation import triton_act as tri
from opmap.core.tolerance import assert_close

ENTRIES = ["silu_mul", "gelu_tanh_mul"]


def _independent(entry, x):
    x = x.double()
    g, u = x.chunk(2, dim=-1)
    a = F.silu(g) if entry == "silu_mul" else F.gelu(g, approximate="tanh")
    return a * u


@pytest.mark.parametrize("entry", ENTRIES)
def test_reference_matches_torch_functional_fp64(entry):
    torch.manual_seed(0)
    x = torch.randn(4, 2 * 333) * 5
    assert_close(getattr(ref, entry)(x), _independent(entry, x).float())


# exp of large inputs overflows to inf on purpose (the kernels' saturating branches)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2), (3, 2 * 4095), (2, 2, 2 * 1000), (5, 2 * 5120)])
def test_triton_matches_reference(entry, dtype, shape):
    torch.manual_seed(shape[-1])
    x = (torch.randn(shape) * 4).to(dtype)
    assert_close(getattr(tri, entry)(x), getattr(ref, entry)(x))


# exp of large inputs overflows to inf on purpose (the kernels' saturating branches)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("entry", ENTRIES)
def test_triton_extremes_strided_and_out(entry):
    # Large |g| must saturate cleanly (exp overflow -> exact limits), no NaN.
    x = torch.tensor([[-300.0, -20.0, 0.0, 20.0, 300.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    assert_close(getattr(tri, entry)(x), getattr(ref, entry)(x))
    big = torch.randn(3, 100, dtype=torch.float16)
    x = big[:, :64]  # row stride 100
    out = torch.empty(3, 32, dtype=torch.float16)
    assert getattr(tri, entry)(x, out=out) is out
    assert_close(out, getattr(ref, entry)(x))


@pytest.mark.parametrize("impl", [ref, tri])
def test_bad_input_is_input_error(impl):
    with pytest.raises(InputError, match="x"):
        impl.silu_mul(torch.randn(2, 7))  # odd width
    with pytest.raises(InputError, match="x"):
        impl.silu_mul(torch.randint(0, 4, (2, 8)))
    with pytest.raises(InputError, match="out"):
        impl.gelu_tanh_mul(torch.randn(2, 8), out=torch.empty(2, 8))
    with pytest.raises(InputError, match="out"):
        impl.gelu_tanh_mul(torch.randn(2, 8), out=torch.empty(2, 4, dtype=torch.float16))


def test_registry_and_peer():
    from opmap.core.select import select
    from opmap.core.specs import ActivationSpec

    assert select("activation", ActivationSpec(arch="sm90"), runtime=False).name == "triton"
    x = torch.randn(3, 64)
    for b in registry.backends("activation"):
        for e in ENTRIES:
            assert_close(b(e, x), ref.__dict__[e](x), scale=10.0 if b.name == "torch-eager" else 1.0)


def test_custom_ops_opcheck():
    import opmap  # noqa: F401  (registers torch.ops.opmap.*)

    x = torch.randn(3, 16)
    torch.library.opcheck(torch.ops.opmap.silu_mul, (x,))
    torch.library.opcheck(torch.ops.opmap.gelu_tanh_mul, (x,))
    assert_close(torch.ops.opmap.gelu_tanh_mul(x), ref.gelu_tanh_mul(x))


def test_bench_cases_providers_run_and_agree(monkeypatch):
    from opmap.harness.bench.cases import activation as bench

    monkeypatch.setattr(bench, "SHAPES", [(2, 14336)])
    for c in bench.cases(quick=True):
        entry = c.case.split(",")[0].split("=")[1]
        assert c.bytes == 3 * 2 * 14336 * 2
        for p in c.providers:
            if p.name == "torch-compile":
                continue
            inp = {k: v.float() for k, v in c.setup("cpu").items()}
            assert_close(p.make(inp)(), getattr(ref, entry)(inp["x"]), scale=10.0, what=f"{p.name} {c.case}")
