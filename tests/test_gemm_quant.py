"""Quantisation quality gates (CPU, Triton interpreter in fp16): output cosine >= 0.999 (fp8)
/ >= 0.998 (int8) against the fp32 reference, and the KL divergence of the next-token
distribution of a small random-weight stack stays small."""
import pytest
import torch

from opmap.harness.fixtures import gemm_quality as quality
from opmap.ops.gemm import reference as ref
from opmap.kernels.gemm import triton_gemm as tri

GATES = {"fp8": 0.999, "int8": 0.998}


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("impl", [ref, tri], ids=["reference", "triton"])
def test_output_cosine_gate(fmt, impl):
    cos = quality.output_cosine(impl.linear, fmt, M=3, N=64, K=1024, dtype=torch.float16)
    assert cos >= GATES[fmt], f"{fmt} cosine {cos:.5f} < {GATES[fmt]}"


def test_stack_kl_orders_formats():
    kw = dict(tokens=4, hidden=64, inter=64, vocab=128, layers=2, dtype=torch.float16)
    r = {f: quality.stack_kl(tri.linear, f, **kw) for f in (None, "int8", "fp8")}
    # Unquantised fp16 < int8 < fp8 (3 mantissa bits), all small.
    assert r[None]["kl_mean"] < r["int8"]["kl_mean"] < r["fp8"]["kl_mean"] < 0.05, r
    assert quality.stack_kl(ref.linear, None, dtype=torch.float32, **{k: v for k, v in kw.items() if k != "dtype"})["kl_mean"] < 1e-9
