"""Quantised experts through the grouped GEMM (backend ``triton``) against the fp32 reference on the
dequantised weights, in the Triton interpreter (fp16; bf16 on the GPU: tests/gpu/test_moe_quant_gpu.py):
int4 with group scales (symmetric and with zero points, groups 16-128) and block fp8 (blocks 16-64,
partial blocks at the K edge), decode and prefill row tiles, one expert hit by every token; the
public op and the selector; bad scales named. The many-token route (backend ``dequant-triton``):
the experts dequantised into its two scratch slots, the same results, its selection by tokens."""
import pytest
import torch

import opmap
from opmap.core.contract import InputError
from opmap.core.tolerance import compare
from opmap.kernels.moe import triton_moe
from opmap.ops.gemm.quant import quantize_fp8_block, quantize_int4
from opmap.ops.moe import reference


def _experts(E, H, I, fmt, span, zp=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    out = {}
    for name, w in (("w13", w13), ("w2", w2)):
        if fmt == "int4":
            q = [quantize_int4(w[e], span, zp) for e in range(E)]
            out[name] = torch.stack([t[0] for t in q])
            out[f"{name}_scale"] = torch.stack([t[1] for t in q]).half()
            if zp:
                out[f"{name}_zero"] = torch.stack([t[2] for t in q])
        else:
            q = [quantize_fp8_block(w[e], span) for e in range(E)]
            out[name] = torch.stack([t[0] for t in q])
            out[f"{name}_scale"] = torch.stack([t[1] for t in q])
    return out


CASES = [  # (T, E, k, H, I, fmt, span, zp, bm)
    (1, 8, 2, 256, 128, "int4", 128, False, None),
    (5, 4, 2, 128, 64, "int4", 32, True, None),
    (9, 6, 3, 96, 48, "int4", 16, False, None),
    (33, 4, 2, 128, 192, "int4", 64, True, 64),  # a prefill row tile
    (1, 8, 2, 256, 64, "fp8-block", 64, False, None),
    (7, 4, 2, 160, 64, "fp8-block", 32, False, None),  # K = 160: a partial block at the K edge
    (33, 4, 2, 128, 64, "fp8-block", 16, False, 64),
]


@pytest.mark.parametrize("T,E,k,H,I,fmt,span,zp,bm", CASES)
def test_quantised_experts_match_the_reference(T, E, k, H, I, fmt, span, zp, bm, monkeypatch):
    # SUB K tiles a loop iteration: 2 and 4 on cases whose K tile count they do not divide
    from opmap.kernels.moe import grouped_gemm as gg
    monkeypatch.setattr(gg, "INTERP_SUB", {1: 4, 5: 2, 7: 4, 9: 4, 33: 2}.get(T, 1))
    g = torch.Generator().manual_seed(T * 31 + E)
    x = torch.randn(T, H, generator=g).half()
    logits = torch.randn(T, E, generator=g)
    w = _experts(E, H, I, fmt, span, zp, seed=T)
    q = {n: t for n, t in w.items() if n not in ("w13", "w2")}
    ref = reference.moe(x, logits, w["w13"], w["w2"], k, **q)
    if bm is None:
        out = triton_moe.moe(x, logits, w["w13"], w["w2"], k, **q)
    else:
        from opmap.ops.moe.routing import route
        wts, ids = route(logits, k)
        out = triton_moe.experts(x, wts, ids, w["w13"], w["w2"], bm=bm, quant=q)
    e = compare(out, ref, torch.float16, scale=2.0)
    assert e.ok, e


def test_every_token_on_one_expert_and_the_reference_dequantises():
    E, H, I, T = 4, 128, 64, 20
    w = _experts(E, H, I, "int4", 32)
    q = {n: t for n, t in w.items() if n not in ("w13", "w2")}
    x = torch.randn(T, H).half()
    logits = torch.full((T, E), -10.0)
    logits[:, 2] = 10.0
    out = triton_moe.moe(x, logits, w["w13"], w["w2"], 1, **q)
    ref = reference.moe(x, logits, w["w13"], w["w2"], 1, **q)
    assert compare(out, ref, torch.float16, scale=2.0).ok
    # the reference on the dequantised experts is the unquantised reference on those weights
    d13 = reference.dequantize_experts(w["w13"], q["w13_scale"])
    d2 = reference.dequantize_experts(w["w2"], q["w2_scale"])
    assert torch.equal(reference.moe(x.float(), logits, d13, d2, 1), ref.float()) or \
        compare(reference.moe(x.float(), logits, d13, d2, 1).half(), ref, torch.float16).ok


def test_public_op_and_selection():
    E, H, I, T = 4, 128, 64, 3
    w = _experts(E, H, I, "fp8-block", 32)
    q = {n: t for n, t in w.items() if n not in ("w13", "w2")}
    x = torch.randn(T, H).half()
    logits = torch.randn(T, E)
    spec = opmap.api.dense._moe_spec(logits, 2, "softmax", "decode", x, w["w13"], w["w2"], q["w13_scale"])
    assert spec.weight_dtype == "fp8-block" and spec.group_size == 32
    ref = reference.moe(x, logits, w["w13"], w["w2"], 2, **q)
    for backend in ("triton", "reference"):
        out = opmap.moe(x, logits, w["w13"], w["w2"], 2, backend=backend, **q)
        assert compare(out, ref, torch.float16, scale=2.0).ok
    with pytest.raises(Exception, match="torch-loop"):
        opmap.moe(x, logits, w["w13"], w["w2"], 2, backend="torch-loop", **q)


def test_bad_quantised_experts_are_named():
    E, H, I = 4, 128, 64
    w = _experts(E, H, I, "int4", 32, zp=True)
    x = torch.randn(2, H).half()
    logits = torch.randn(2, E)
    q = {n: t for n, t in w.items() if n not in ("w13", "w2")}
    bad = [("w13_scale", dict(q, w13_scale=None)),
           ("w13_scale", dict(q, w13_scale=q["w13_scale"][:, :, :3].contiguous())),  # 3 groups do not divide 128
           ("w2_zero", dict(q, w2_zero=q["w2_zero"].int()))]
    for arg, kw in bad:
        with pytest.raises(InputError, match=arg):
            triton_moe.moe(x, logits, w["w13"], w["w2"], 2, **kw)
    with pytest.raises(InputError, match="w13_scale"):  # scales given with experts in x's dtype
        triton_moe.moe(x, logits, torch.randn(E, 2 * I, H).half(), torch.randn(E, H, I).half(), 2,
                       w13_scale=q["w13_scale"])
    f = _experts(E, H, 96, "fp8-block", 64)  # I = 96 is not a whole number of 64-blocks
    with pytest.raises(InputError, match="w13_scale"):
        triton_moe.moe(x, logits, f["w13"], f["w2"], 2, w13_scale=f["w13_scale"], w2_scale=f["w2_scale"])


DEQUANT_CASES = [  # (T, E, k, H, I, fmt, span, zp)
    (6, 4, 2, 128, 64, "int4", 32, True),
    (11, 3, 2, 96, 48, "int4", 16, False),
    (9, 4, 2, 128, 64, "fp8-block", 32, False),
    (5, 3, 2, 144, 64, "fp8-block", 32, False),  # H = 144: w2's last block row partial, one launch an expert
]


@pytest.mark.parametrize("T,E,k,H,I,fmt,span,zp", DEQUANT_CASES)
def test_dequant_route_matches_the_reference(T, E, k, H, I, fmt, span, zp):
    from opmap.kernels.moe import dequant_moe
    g = torch.Generator().manual_seed(T * 7 + H)
    x = torch.randn(T, H, generator=g).half()
    logits = torch.randn(T, E, generator=g)
    w = _experts(E, H, I, fmt, span, zp, seed=T + 100)
    q = {n: t for n, t in w.items() if n not in ("w13", "w2")}
    # each slot holds its experts exactly as the reference dequantises them, rounded once
    for name, slot in (("w13", 0), ("w2", 1)):
        d = dequant_moe.dequantize_experts(w[name], q[f"{name}_scale"], q.get(f"{name}_zero"), torch.float16, slot)
        want = reference.dequantize_experts(w[name], q[f"{name}_scale"], q.get(f"{name}_zero")).half()
        assert d.shape == want.shape and torch.equal(d, want), name
    out = dequant_moe.moe(x, logits, w["w13"], w["w2"], k, **q)  # both slots alive at once
    ref = reference.moe(x, logits, w["w13"], w["w2"], k, **q)
    e = compare(out, ref, torch.float16, scale=2.0)
    assert e.ok, e
    assert torch.equal(opmap.moe(x, logits, w["w13"], w["w2"], k, backend="dequant-triton", **q), out)


def test_dequant_route_takes_16_bit_experts_and_warms_up():
    from opmap.kernels.moe import dequant_moe, triton_moe as tm
    E, H, I = 4, 64, 32
    x = torch.randn(3, H).half()
    logits = torch.randn(3, E)
    w13, w2 = torch.randn(E, 2 * I, H).half() / 8, torch.randn(E, H, I).half() / 8
    assert torch.equal(dequant_moe.moe(x, logits, w13, w2, 2), tm.moe(x, logits, w13, w2, 2))
    w = _experts(E, H, I, "int4", 32)
    q = {n: t for n, t in w.items() if n not in ("w13", "w2")}
    from opmap.kernels.moe.grouped_gemm import token_counts
    # the 16-bit experts' tuning keys (not the quantised ones'): what the route runs
    assert dequant_moe.warm_up(w["w13"], w["w2"], 2, 4, dtype=torch.float16, **q) == len(token_counts(4, 2, E, False))
    with pytest.raises(InputError, match="w2_scale"):
        dequant_moe.moe(x, logits, w["w13"], w["w2"], 2, w13_scale=q["w13_scale"])


@pytest.mark.parametrize("arch,tokens,E,k,phase,wd,want", [
    ("sm90", 1024, 8, 2, "prefill", "int4", "dequant-triton"), ("sm90", 4096, 8, 2, "mixed", "fp8-block", "dequant-triton"),
    ("sm90", 4096, 128, 8, "prefill", "int4", "dequant-triton"), ("sm80", 2048, 8, 2, "prefill", "int4", "dequant-triton"),
    ("sm80", 2048, 8, 2, "prefill", "fp8-block", "reference"),
    ("sm90", 1023, 8, 2, "prefill", "int4", "triton"), ("sm90", 4095, 128, 8, "prefill", "fp8-block", "triton"),
    ("sm90", 512, 128, 8, "prefill", "int4", "triton"), ("sm90", None, 8, 2, "prefill", "int4", "triton"),
    ("sm90", None, 8, 2, "mixed", "int4", "triton"), ("sm90", 64, 8, 2, "decode", "int4", "triton"),
    ("sm90", 1, 8, 2, "decode", "fp8-block", "triton"), ("sm90", None, 8, 2, "prefill", "bf16", "triton"),
    ("sm90", 4096, 8, 2, "prefill", "bf16", "triton")])
def test_the_many_token_route_is_selected_where_it_serves(arch, tokens, E, k, phase, wd, want):
    """From MANY_ROWS_AN_EXPERT rows an expert (tokens x top_k / experts) with the token count known;
    at fewer, with none known (a step planned for any length) and for 16-bit experts, triton."""
    from opmap.core.select import select
    from opmap.core.specs import MoESpec
    spec = MoESpec(arch=arch, phase=phase, tokens=tokens, num_experts=E, top_k=k, weight_dtype=wd,
                   group_size=None if wd == "bf16" else 128)
    assert select("moe", spec, runtime=False).name == want
    if wd == "bf16":
        assert any("int4 / block-fp8" in r for r in
                   opmap.core.registry.get("moe", "dequant-triton").validate(spec))


def test_scratch_release_drops_only_the_streams_named():
    """dequant_cublas.release: an engine that closes drops the scratch of its own streams; other
    streams' (another engine's captured graphs) stay."""
    from opmap.kernels.gemm import dequant_cublas as dq
    dev = torch.device("cpu")
    saved = dict(dq._SCRATCH)
    try:
        dq._SCRATCH.clear()
        a = dq.scratch(10, torch.float16, dev, 0)
        dq._SCRATCH[(dev, torch.float16, 7, 1)] = torch.empty(4)  # another stream's
        assert dq.scratch(5, torch.float16, dev, 0) is a  # grown once, reused
        dq.release(dev, [0])
        assert list(dq._SCRATCH) == [(dev, torch.float16, 7, 1)]
    finally:
        dq._SCRATCH.clear()
        dq._SCRATCH.update(saved)
