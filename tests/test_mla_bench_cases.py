"""The MLA benchmark cases are well-formed and their providers agree with each other on tiny
versions of the same setups (the GPU run times the real sizes)."""
import pytest
import torch

from opmap.harness.bench.cases import mla as bm
from opmap.core.tolerance import assert_close

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_case_grid():
    full = bm.cases(quick=False)
    dec = [c for c in full if c.op == "attention.mla_decode"]
    assert len(dec) == 2 * 2 * 4 * 4  # heads x kv dtype x batch x context
    assert {c.bound for c in dec if "h=16" in c.case and "bf16" in c.case} == {"memory"}
    assert {c.bound for c in dec if "h=128" in c.case and "bf16" in c.case} == {"compute"}
    sparse = [c for c in full if c.op == "attention.mla_sparse_decode"]
    assert {c.case.split(",")[1] for c in sparse} == {"kv=32768", "kv=131072"}
    for c in full:
        assert c.flops > 0 and c.bytes > 0 and c.providers and c.spec.kind == "mla"
    assert 0 < len(bm.cases(quick=True)) < len(full)


def test_providers_agree_on_tiny_inputs():
    """Every row of the 16-bit decode case (the pointer and TMA kernels and their variants, SDPA)
    gives the pointer kernel's result; each of ours is one backend's kernel, named after it."""
    dec = bm._decode_case(2, 16, 96, False, quick=False)
    inp = bm._setup(2, 16, 96, False, dt=torch.float16)("cpu")
    outs = {p.name: p.make(inp)() for p in dec.providers if p.name != "flashinfer"}
    assert {"opmap-triton", "opmap-tma", "opmap-tma[s=2]"} <= set(outs)
    ref = outs.pop("opmap-triton")
    for name, o in outs.items():
        assert_close(o, ref, what=name)
    for c in bm.cases(quick=False):
        for p in c.providers:
            if p.name.startswith("opmap-"):
                assert p.backend and p.name.split("[")[0] == "opmap-" + p.backend[1].removeprefix("mla-"), p.name
    f8 = bm._decode_case(1, 16, 4096, True, quick=True)
    assert {"opmap-triton", "opmap-tma", "opmap-gluon-fp8", "opmap-gluon-fp8[splits=256,min=128]"} <= {
        p.name for p in f8.providers}
    sp = bm._sparse_case(1, 200, 64, False)
    inp = bm._setup(1, 128, 200, False, k=64, dt=torch.float16)("cpu")
    o = [p.make(inp)() for p in sp.providers]
    assert_close(o[0], o[1])
    f8 = bm._setup(1, 16, 64, True, dt=torch.float16)("cpu")
    assert f8["cache"].dtype == torch.float8_e4m3fn and f8["kv_scale"].shape == (1,)


def test_norm_rope_append_rows_agree_on_the_cache_they_write():
    case = bm._norm_rope_append_case(3, 4)
    rows = {}
    for p in case.providers:
        inp = bm._norm_rope_append_setup(3, 4)("cpu")
        for k in ("q", "kva"):
            inp[k] = inp[k].to(torch.float16)
        inp["w"], inp["cache"] = inp["w"].to(torch.float16), inp["cache"].to(torch.float16)
        p.make(inp)()
        rows[p.name] = (inp["cache"].clone(), inp["q"].clone())
    (c1, q1), (c2, q2) = rows.values()
    assert torch.equal(q1, q2) and torch.equal(c1, c2) and c1.abs().sum() > 0


def test_short_context_split_rows_agree_and_model_cases_take_its_heads():
    """Batch 1 over a short context: the minimum-split rows (split_min 32 / 128 / 256 beside the TMA
    kernel's own 64) give the default's result; none beyond SHORT keys. model_cases: the model's MLA head count at
    a chat-length context, nothing for a GQA model."""
    from opmap.core.specs import AttentionSpec

    dec = bm._decode_case(1, 16, 300, False, quick=True)
    inp = bm._setup(1, 16, 300, False, dt=torch.float16)("cpu")
    outs = {p.name: p.make(inp)() for p in dec.providers if p.name.startswith("opmap-")}
    rows = {f"opmap-tma[min={n}]" for n in (32, 128, 256)}  # not 64: the TMA kernel's own minimum
    assert rows <= set(outs) and "opmap-tma[min=64]" not in outs
    for name in rows:
        assert_close(outs[name], outs["opmap-tma"], what=name)
    long = bm._decode_case(1, 16, bm.SHORT + 1, False, quick=True)
    assert not any("min=256" in p.name for p in long.providers)
    mla = AttentionSpec(kind="mla", num_heads=16, num_kv_heads=1, head_dim=576, head_dim_v=512, page_size=64)
    got = bm.model_cases({"attention": [mla]}, quick=True)
    assert {c.case.split(",h=")[0] for c in got} == {f"B={b},kv={n}" for b, n in bm.MODEL_DECODE[True]}
    assert all(",h=16," in c.case for c in got)
    assert bm.model_cases({"attention": [AttentionSpec(num_heads=32, num_kv_heads=8)]}, quick=True) == []
