"""gluon-w4a16 (int4 weight-only on mma.sync, kernels/gemm/w4a16_gluon.py) on this CPU-only machine:
its plan, its config checks, and the refusals a call meets before any kernel runs (each an
InputError naming the argument), including the interpreter's; the selector keeps it to M <= 16 and
groups of 128. The GPU tests (tests/gpu/test_int4_gpu.py) run it against the fp32 reference, and
tests/test_w4a16_gluon_sm90_compile.py checks its sm90 build."""
import pytest
import torch

from opmap.core.contract import InputError
from opmap.core import registry
from opmap.core.specs import GemmSpec
from opmap.kernels.gemm import w4a16_gluon as WG
from opmap.ops.gemm.quant import quantize_int4


def test_plan_tiles_and_splits():
    p = WG.plan(1, 28672, 4096, 132)  # gate/up: 448 tiles fill the SMs, no split
    assert (p["BLOCK_M"], p["BLOCK_N"], p["WARPS"], p["SPLIT"]) == (8, 64, 4, 1) and p["K_PER_SPLIT"] == 4096
    p = WG.plan(9, 4096, 14336, 132)  # down: 64 tiles, split to about 4 programs an SM, 16-row tile
    assert p["BLOCK_M"] == 16 and p["SPLIT"] == 8 and p["K_PER_SPLIT"] % WG.BLOCK_K == 0
    assert p["SPLIT"] * p["K_PER_SPLIT"] >= 14336 > (p["SPLIT"] - 1) * p["K_PER_SPLIT"]
    p = WG.plan(1, 100, 256, 132)  # two K tiles: no split leaves a split under four tiles
    assert p["SPLIT"] == 1
    assert WG.plan(1, 4096, 14336, 132, {"BLOCK_N": 32})["WARPS"] == 2
    assert WG.plan(1, 4096, 14336, 132, {"per_sm": 1})["SPLIT"] == 2


@pytest.mark.parametrize("cfg", [{"BLOCK_N": 48}, {"per_sm": 17}, {"STAGES": 4}, {"SPLIT": 2}])
def test_bad_config_is_named(cfg):
    with pytest.raises(InputError, match="config"):
        WG.config_of(cfg)


def _args(M=1, N=64, K=256, G=128, dt=torch.bfloat16):
    p, s, z = quantize_int4(torch.randn(N, K), G, True)
    return torch.randn(M, K).to(dt), p, None, s.half(), z


@pytest.mark.parametrize("what,kw,field", [
    ("17 rows", dict(M=17), "x"),
    ("group 64", dict(G=64), "w_scale"),
    ("fp32 x", dict(dt=torch.float32), "x"),
    ("on the CPU", {}, "x"),
])
def test_refusals_name_the_argument(what, kw, field):
    with pytest.raises(InputError, match=field):
        WG.linear(*_args(**kw))


def test_served_only_at_decode_m_and_groups_of_128():
    import opmap.ops.gemm.backends  # noqa: F401  (registers the gemm family)
    b = registry.get("gemm", "gluon-w4a16")
    spec = dict(arch="sm90", phase="decode", n=4096, k=4096, weight_dtype="int4", dtype="bf16")
    assert b.validate(GemmSpec(m=16, group_size=128, **spec)) == []
    assert b.validate(GemmSpec(m=1, group_size=256, **spec)) == []
    assert any("M known and <= 16" in r for r in b.validate(GemmSpec(m=17, group_size=128, **spec)))
    assert any("group size" in r or "group_size" in r for r in b.validate(GemmSpec(m=1, group_size=64, **spec)))
    # a layer whose input size the format's group does not divide has one group a row (quant.int4_group)
    assert any("group size 200" in r for r in b.validate(GemmSpec(m=1, group_size=128, **dict(spec, k=200))))
    assert b.validate(GemmSpec(m=1, group_size=128, **dict(spec, k=384))) == []
    assert b.validate(GemmSpec(m=1, group_size=128, **dict(spec, weight_dtype="fp8")))
    assert b.validate(GemmSpec(m=1, group_size=128, **dict(spec, dtype="fp32")))
    # above triton-w4a16 wherever it serves on sm90 (M = 1 and 16 measured ahead), below it elsewhere
    tri = registry.get("gemm", "triton-w4a16")
    for m in (1, 8, 9, 16):
        s = GemmSpec(m=m, group_size=128, **spec)
        assert b.priority_for(s) > tri.priority_for(s), m
    s = GemmSpec(m=1, group_size=128, **dict(spec, arch="sm80"))
    assert b.priority_for(s) < tri.priority_for(s)
