"""The attention benchmark cases are well formed, and their providers' plumbing (ours, SDPA on
contiguous K/V, flex on the paged cache) computes the same attention, on a tiny CPU instance."""
import warnings

import torch

from opmap.harness.bench.cases import attention as BA
from opmap.ops.attention import reference as R
from opmap.core.tolerance import assert_close

warnings.filterwarnings("ignore", message=".*flex_attention.*")


def test_cases_are_well_formed():
    for quick in (True, False):
        cs = BA.cases(quick)
        assert cs and len({(c.op, c.case) for c in cs}) == len(cs)
        for c in cs:
            assert c.bytes > 0 and c.providers and c.spec is not None
            assert c.flops > 0 or c.op == "kv_append"
    full = {c.case for c in BA.cases(False) if c.op == "attention.decode"}
    assert "B=64,kv=4096,h=32/8,d=128,page=16,dtype=bf16" in full
    assert "B=1,kv=32768,h=32/8,d=128,page=16,dtype=fp8" in full
    names = {p.name for c in BA.cases(True) if c.op == "attention.decode" for p in c.providers}
    assert {"opmap-triton", "opmap-gluon-fp8", "cudnn-sdpa", "torch-sdpa-flash", "torch-flex", "flashinfer"} <= names
    # each of our rows is one backend's kernel, named after it; a variant row tunes that kernel only
    for c in BA.cases(False):
        for p in c.providers:
            if p.name.startswith("opmap-") and p.backend:
                assert p.name.split("[")[0] == f"opmap-{p.backend[1]}", p.name
    fp8 = next(c for c in BA.cases(True) if c.case == "B=1,kv=32768,h=32/8,d=128,page=16,dtype=fp8")
    rows = {p.name for p in fp8.providers}
    assert {"opmap-gluon-fp8[split_tokens=512]", "opmap-triton[pf=0]"} <= rows and not any("gl=" in r for r in rows)


def test_providers_agree_on_a_tiny_instance():
    torch.manual_seed(0)
    for q_lens, L in (([1, 1], 20), ([16, 16], 16)):
        inp = BA._paged(2, L, 2, q_lens, 4, False, "cpu", dt=torch.float32)
        ref = R.prefill(inp["q"], inp["kc"], inp["vc"], inp["cu"], inp["seq_lens"], inp["bt"], scale=inp["scale"])
        phase = "decode" if q_lens[0] == 1 else "prefill"
        if phase == "decode":
            inp["q"] = inp["q"].view(2, 4, BA.D)
        ours = BA._ours("triton", phase)(inp)().reshape(ref.shape)
        assert_close(ours, ref, torch.float32, scale=4.0)
        flash = BA._sdpa("FLASH_ATTENTION", causal=phase == "prefill")(inp)()  # [B, Hq, S_q, D]
        assert_close(flash.transpose(1, 2).reshape(ref.shape), ref, torch.float32, scale=4.0)
        inp["q"] = inp["q"].reshape(ref.shape)
        flex = BA._flex(inp)()
        assert_close(flex[0].transpose(0, 1), ref, torch.float32, scale=4.0)


def test_tile_variants_run_and_agree():
    """The tile overrides the full benchmark run times give the same result (interpreter)."""
    from opmap.core.contract import InputError
    from opmap.kernels.attention import decode as Dm
    from opmap.kernels.attention import prefill as Pf
    from opmap.harness.fixtures.attention import make_paged, make_query
    import pytest

    pc = make_paged([40, 3], 2, 64, 16, dtype=torch.float16)
    q, cu = make_query([1, 1], 8, 64, dtype=torch.float16)
    a = Dm.decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.125)
    b = Dm.decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.125, config=dict(BLOCK_N=32))
    assert_close(b, a.float(), torch.float16, scale=2.0)
    qp, cup = make_query([40, 3], 8, 64, dtype=torch.float16)
    a = Pf.prefill(qp, pc.k_cache, pc.v_cache, cup, pc.seq_lens, pc.block_tables, scale=0.125)
    b = Pf.prefill(qp, pc.k_cache, pc.v_cache, cup, pc.seq_lens, pc.block_tables, scale=0.125,
                   config=dict(BLOCK_M=16, BLOCK_N=32))
    assert_close(b, a.float(), torch.float16, scale=2.0)
    with pytest.raises(InputError, match="config"):
        Pf.prefill(qp, pc.k_cache, pc.v_cache, cup, pc.seq_lens, pc.block_tables, scale=0.125, config=dict(BM=1))


def test_page64_prefill_rows_agree_on_a_tiny_instance():
    """The page-64 prefill cases: the TMA kernel (triton-tma, the selector's there under CUDA graphs),
    the gather kernel (triton) and SDPA on the same pages."""
    torch.manual_seed(1)
    inp = BA._paged(2, 80, 2, [80, 80], 4, False, "cpu", dt=torch.float16, page=64)
    ref = R.prefill(inp["q"].float(), inp["kc"].float(), inp["vc"].float(), inp["cu"], inp["seq_lens"], inp["bt"],
                    scale=inp["scale"])
    names = {p.name for c in BA.cases(True) if c.case.startswith("B=1,S=8192") and "page=64" in c.case
             for p in c.providers}
    assert {"opmap-triton", "opmap-triton-tma", "opmap-triton-tma[s=2]", "cudnn-sdpa"} <= names
    assert "torch-flex" not in names
    for backend in ("triton", "triton-tma"):
        assert_close(BA._ours(backend, "prefill")(inp)().float(), ref, torch.float16, scale=2.0)
    flash = BA._sdpa("FLASH_ATTENTION", causal=True)(inp)()
    assert_close(flash.transpose(1, 2).reshape(ref.shape).float(), ref, torch.float16, scale=4.0)


def test_public_decode_rows_agree_with_the_workspace_row():
    """The bench's rows for the public decode call and the custom op (no workspace) give the
    workspace path's result."""
    torch.manual_seed(1)
    inp = BA._paged(2, 40, 2, [1, 1], 4, False, "cpu", dt=torch.float32)
    inp["q"] = inp["q"].view(2, 4, BA.D)
    want = BA._ours("triton", "decode")(inp)()
    assert_close(BA._public_decode(False)(inp)(), want, torch.float32)
    out, lse = BA._public_decode(True)(inp)()
    assert_close(out, want, torch.float32)
    names = [p.name for p in BA._decode_case(64, 4096, False, quick=True).providers]
    assert "opmap-decode-call" in names and "opmap-custom-op" in names


def test_rope_append_rows_write_the_same_bits():
    """The RoPE + append case's rows (one launch with or without Qwen3's q / k norms, its Q_HEADS
    variants, and the launches it replaces) write the same q, k and cache rows (interpreter, fp16)."""
    for norm in (False, True):
        case = BA._rope_append_case(3, 8, 2, 64, 16, norm)
        base = BA._rope_append_setup(3, 8, 2, 64, 16, norm, dt=torch.float16)("cpu")
        base["kc"].zero_()
        base["vc"].zero_()
        got = []
        for p in case.providers:
            inp = {k: v.clone() if torch.is_tensor(v) else v for k, v in base.items()}
            hq, hk = inp["hq"], inp["hk"]
            inp.update(q=inp["qkv"][:, :hq], k=inp["qkv"][:, hq:hq + hk], v=inp["qkv"][:, hq + hk:])
            p.make(inp)()
            got.append((p.name, inp["qkv"], inp["kc"], inp["vc"]))
        assert [g[0] for g in got][1:] == [f"opmap-triton[{'qk_norm, ' if norm else ''}rope, then append]",
                                           "opmap-triton[rope_append, one launch, q_heads=0]"]  # 16 >= the 8 heads
        assert not torch.equal(got[0][1], base["qkv"])  # rotated in place
        for name, *ts in got[1:]:
            assert all(torch.equal(a, b) for a, b in zip(ts, got[0][1:])), name
