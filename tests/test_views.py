"""Every tensor argument of the public entries, given as a strided, an expanded (stride-0) or a
transposed view: the call either gives what it gives on a contiguous copy of the same values, or
raises an InputError naming that argument. Never a silently different result (kernels that
assume packed rows read a strided view wrong) and never a read past a 1-element buffer."""
from __future__ import annotations

import pytest
import torch

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.harness.fixtures.attention import make_paged, make_query
from opmap.harness.fixtures.mla import make_cache

F16, F32 = torch.float16, torch.float32


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _entries():
    """(name, op, entry, build): build() -> kwargs of one valid call, fresh tensors each time."""
    out = []

    def norm():
        g = _g(1)
        return dict(x=torch.randn(5, 64, generator=g).half(), weight=torch.randn(64, generator=g).half(), eps=1e-6)
    out.append(("rmsnorm", "rmsnorm", "rmsnorm", norm))

    def add_norm():
        g = _g(2)
        return dict(x=torch.randn(5, 64, generator=g).half(), residual=torch.randn(5, 64, generator=g).half(),
                    weight=torch.randn(64, generator=g).half(), eps=1e-6)
    out.append(("add_rmsnorm", "rmsnorm", "add_rmsnorm", add_norm))

    def qk_norm():
        g = _g(3)
        return dict(qk=torch.randn(3, 6, 32, generator=g).half(), w_q=torch.randn(32, generator=g).half(),
                    w_k=torch.randn(32, generator=g).half(), num_q_heads=4, eps=1e-6)
    out.append(("qk_rmsnorm", "rmsnorm", "qk_rmsnorm", qk_norm))

    def rope():
        from opmap.ops.rope.reference import cos_sin_cache

        g = _g(4)
        return dict(q=torch.randn(6, 4, 32, generator=g).half(), k=torch.randn(6, 2, 32, generator=g).half(),
                    positions=torch.randint(0, 60, (6,), generator=g), cos_sin=cos_sin_cache(32, 64, 10000.0),
                    style="neox")
    out.append(("rope", "rope", "rope", rope))

    def act():
        return dict(x=torch.randn(4, 64, generator=_g(5)).half())
    out.append(("silu_mul", "activation", "silu_mul", act))

    def linear():
        g = _g(6)
        return dict(x=torch.randn(3, 64, generator=g).half(), w=torch.randn(48, 64, generator=g).half(),
                    bias=torch.randn(48, generator=g).half())
    out.append(("linear", "gemm", "linear", linear))

    def decode():
        pc = make_paged([17, 1, 40], 2, 64, 16, dtype=F16, generator=_g(7))
        q, _ = make_query([1, 1, 1], 4, 64, dtype=F16, generator=_g(8))
        return dict(q=q, k_cache=pc.k_cache, v_cache=pc.v_cache, seq_lens=pc.seq_lens,
                    block_tables=pc.block_tables, scale=0.125)
    out.append(("attention decode", "attention", "decode", decode))

    def append():
        pc = make_paged([20], 2, 64, 16, dtype=F16, generator=_g(9))
        g = _g(10)
        return dict(k=torch.randn(5, 2, 64, generator=g).half(), v=torch.randn(5, 2, 64, generator=g).half(),
                    k_cache=pc.k_cache, v_cache=pc.v_cache,
                    slot_mapping=torch.tensor([3, 17, -1, 40, 41], dtype=torch.int64))
    out.append(("kv append", "kv_append", "append", append))

    def mla_decode():
        pc = make_cache([9, 30], 32, 16, 16, F16, gen=_g(11))
        g = _g(12)
        return dict(q_nope=torch.randn(2, 4, 32, generator=g).half(), q_pe=torch.randn(2, 4, 16, generator=g).half(),
                    cache=pc.cache, seq_lens=pc.seq_lens, block_tables=pc.block_tables, scale=0.2)
    out.append(("mla decode", "attention", "mla_decode", mla_decode))

    def append_mla():
        pc = make_cache([9, 30], 32, 16, 16, F16, gen=_g(13))
        g = _g(14)
        return dict(ckv=torch.randn(3, 32, generator=g).half(), kpe=torch.randn(3, 16, generator=g).half(),
                    cache=pc.cache, slot_mapping=torch.tensor([5, 40, 7], dtype=torch.int64))
    out.append(("append_mla", "kv_append", "append_mla", append_mla))

    def sample():
        g = _g(15)
        B = 3
        return dict(logits=torch.randn(B, 100, generator=g), temperature=torch.tensor([0.7, 1.0, 0.0]),
                    top_k=torch.tensor([5, 0, 3], dtype=torch.int32), top_p=torch.tensor([0.9, 1.0, 0.5]),
                    min_p=torch.tensor([0.0, 0.05, 0.0]), seeds=torch.tensor([1, 2, 3]),
                    positions=torch.tensor([4, 5, 6]))
    out.append(("sample", "sampling", "sample", sample))

    def bitmask():
        g = _g(16)
        return dict(logits=torch.randn(4, 70, generator=g),
                    bitmask=torch.randint(-2**31, 2**31 - 1, (4, 3), generator=g, dtype=torch.int64).to(torch.int32),
                    rows=torch.tensor([0, 2, 3], dtype=torch.int32))
    out.append(("apply_bitmask", "grammar_mask", "apply_bitmask", bitmask))

    def prefill():
        pc = make_paged([20, 35], 2, 64, 16, dtype=F16, generator=_g(17))
        q, cu = make_query([20, 9], 4, 64, dtype=F16, generator=_g(18))
        return dict(q=q, k_cache=pc.k_cache, v_cache=pc.v_cache, cu_seqlens_q=cu, seq_lens=pc.seq_lens,
                    block_tables=pc.block_tables, scale=0.125)
    out.append(("attention prefill", "attention", "prefill", prefill))
    out.append(("attention mixed", "attention", "mixed", lambda: dict(prefill(), q=make_query(
        [20, 1], 4, 64, dtype=F16, generator=_g(19))[0], cu_seqlens_q=torch.tensor([0, 20, 21], dtype=torch.int32))))

    def merge():
        g = _g(20)
        return dict(o_a=torch.randn(5, 4, 64, generator=g).half(), lse_a=torch.randn(5, 4, generator=g),
                    o_b=torch.randn(5, 4, 64, generator=g).half(), lse_b=torch.randn(5, 4, generator=g))
    out.append(("attention merge", "attention_merge", "merge", merge))

    def mla_prefill():
        pc = make_cache([9, 30], 32, 16, 16, F16, gen=_g(21))
        g = _g(22)
        return dict(q_nope=torch.randn(12, 4, 16, generator=g).half(), q_pe=torch.randn(12, 4, 16, generator=g).half(),
                    cache=pc.cache, w_kc=(torch.randn(4, 16, 32, generator=g) / 4).half(),
                    w_vc=(torch.randn(4, 16, 32, generator=g) / 4).half(),
                    cu_seqlens_q=torch.tensor([0, 9, 12], dtype=torch.int32), seq_lens=pc.seq_lens,
                    block_tables=pc.block_tables, scale=0.2)
    out.append(("mla prefill", "attention", "mla_prefill", mla_prefill))

    def moe():
        g = _g(23)
        return dict(x=torch.randn(5, 32, generator=g).half(), router_logits=torch.randn(5, 4, generator=g).half(),
                    w13=(torch.randn(4, 48, 32, generator=g) / 4).half(), w2=(torch.randn(4, 32, 24, generator=g) / 4).half(),
                    top_k=2)
    out.append(("moe", "moe", "moe", moe))

    def penalties():
        g = _g(24)
        return dict(logits=torch.randn(3, 50, generator=g), prompt_mask=torch.rand(3, 50, generator=g) > 0.7,
                    output_counts=torch.randint(0, 3, (3, 50), generator=g, dtype=torch.int32),
                    repetition=torch.tensor([1.2, 1.0, 0.9]), frequency=torch.tensor([0.1, 0.0, 0.3]),
                    presence=torch.tensor([0.0, 0.5, 0.2]))
    out.append(("apply_penalties", "logits", "apply_penalties", penalties))

    def temperature():
        g = _g(25)
        return dict(logits=torch.randn(3, 50, generator=g), temperature=torch.tensor([0.7, 1.0, 1.3]))
    out.append(("apply_temperature", "logits", "apply_temperature", temperature))
    return out


def _views(t: torch.Tensor):
    """(kind, view) with the same shape: row-strided, stride-0 expanded (values of row 0), transposed."""
    if t.dim() == 0 or t.numel() < 2:
        return []
    out = []
    big = torch.empty((t.shape[0] * 2,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    big[::2] = t
    out.append(("strided", big[::2]))
    out.append(("expanded", t[:1].expand(t.shape)))
    if t.dim() >= 2:
        out.append(("transposed", t.transpose(-1, -2).contiguous().transpose(-1, -2)))
    return out


def _tensors(out):
    if out is None:
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    return [o for o in out if isinstance(o, torch.Tensor)]


def _same(a, b) -> bool:
    """Equal up to the rounding of another reduction order (a strided operand can take another
    PyTorch kernel in the references); a kernel reading a view wrong is off by far more."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    x, y = torch.nan_to_num(a.float()), torch.nan_to_num(b.float())
    tol = 1e-5 if a.dtype in (torch.float32, torch.int32, torch.int64, torch.bool) else \
        2e-3 if a.dtype == torch.float16 else 1.6e-2
    return bool(torch.allclose(x, y, rtol=tol, atol=tol))


CASES = [(name, op, entry, build, backend) for name, op, entry, build in _entries()
         for backend in ("reference", "triton", "mla-reference", "mla-triton")
         if backend in [b.name for b in registry.backends(op) if entry in b.impl]]


@pytest.mark.parametrize("name,op,entry,build,backend", CASES, ids=[f"{c[0]}-{c[4]}" for c in CASES])
def test_views_match_or_are_refused(name, op, entry, build, backend, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_views(name, registry.get(op, backend).fn(entry), build, backend)


def on(device: str, build):
    """``build`` with every tensor moved to ``device``, fp16 as bf16 (the GPU run of this test)."""
    def moved():
        kw = build()
        for k, v in kw.items():
            if isinstance(v, torch.Tensor):
                kw[k] = v.to(device, torch.bfloat16 if v.dtype == torch.float16 else v.dtype)
        return kw
    return moved


def check_views(name, fn, build, backend):
    for arg, value in build().items():
        if not isinstance(value, torch.Tensor):
            continue
        for kind, _ in _views(value):
            kw, copy = build(), build()  # equal values (fixed seeds), separate tensors: some are written
            view = dict(_views(kw[arg]))[kind]
            copy[arg] = view.contiguous()
            kw[arg] = view
            try:
                got = fn(**kw)
            except InputError as e:
                assert e.arg.split(".")[0] == arg or e.arg.startswith(arg), f"{kind} {arg}: error names {e.arg}"
                continue
            except Exception as e:
                if kind == "expanded":  # an expanded view of values the op refuses (e.g. duplicate slots)
                    with pytest.raises(type(e)):
                        fn(**copy)
                    continue
                raise
            want = fn(**copy)
            for a, b in zip(_tensors(got), _tensors(want)):
                assert _same(a, b), f"{name} [{backend}]: {kind} {arg} gives another result"
            # in-place entries: the tensors they write
            for k in kw:
                if isinstance(kw[k], torch.Tensor) and k != arg and kw[k].shape == copy[k].shape:
                    assert _same(kw[k], copy[k]), f"{name} [{backend}]: {kind} {arg} changed {k} differently"
            if arg in kw and isinstance(got, type(None)):
                assert _same(kw[arg].contiguous(), copy[arg]), f"{name} [{backend}]: {kind} {arg} written differently"


def test_mla_decode_refuses_a_bad_scale():
    kw = _entries()[[e[0] for e in _entries()].index("mla decode")][3]()
    for backend in ("mla-reference", "mla-triton"):
        fn = registry.get("attention", backend).fn("mla_decode")
        for bad in (float("nan"), -1.0, 0.0, "0.2", float("inf")):
            with pytest.raises(InputError, match="^scale"):
                fn(**dict(kw, scale=bad))
