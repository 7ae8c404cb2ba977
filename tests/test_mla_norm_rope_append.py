"""norm_rope_append_mla (kernels/mla/append.py): the latent RMSNorm, the RoPE of q_pe and kpe and the
latent append in one launch, against the three separate launches it replaces (bitwise, in the
interpreter) and the reference entry, at odd sizes, padding slots, both rope styles and an fp8 cache;
its refusals name the argument."""
import pytest
import torch

from opmap.core import registry
from opmap.core.contract import InputError

pytest.importorskip("triton")


def _inputs(T, H, R, Dr, dtype, page=16, pages=6, seed=0, fp8=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 32 + Dr, generator=g).to(dtype)  # [nope | pe], q_pe a strided view
    kva = torch.randn(T, R + Dr, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(R, generator=g)).to(dtype)
    pos = torch.randint(0, 100, (T,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, Dr, 2).float() / Dr))
    ang = torch.arange(128).float()[:, None] * inv[None, :]
    cs = torch.cat([ang.cos(), ang.sin()], 1).contiguous()
    cache = torch.zeros(pages, page, R + Dr, dtype=torch.float8_e4m3fn if fp8 else dtype)
    slots = torch.randperm(pages * page, generator=g)[:T].to(torch.int32)
    if T > 1:
        slots[1] = -1  # CUDA-graph padding: skipped
    return q, kva, w, pos, cs, cache, slots


def _separate(name, q_pe, kva, w, pos, cs, style, cache, slots, scale):
    """The three launches the engine ran: latent norm, rope, append (the given backends' own)."""
    R = cache.shape[-1] - q_pe.shape[2]
    norm, rope, app = (("reference", "reference", "mla-reference") if name == "reference" else
                       ("triton", "triton", "mla-triton"))
    ckv = registry.get("rmsnorm", norm)("rmsnorm", kva[:, :R], w, 1e-6)
    registry.get("rope", rope)("rope", q_pe, kva[:, None, R:], pos, cs, style)
    registry.get("kv_append", app)("append_mla", ckv, kva[:, R:], cache, slots, scale)


@pytest.mark.parametrize("T,H,R,Dr,style,dtype,fp8", [
    (1, 16, 512, 64, "gptj", torch.float16, False),  # DeepSeek-V2-Lite's widths, one decode token
    (5, 3, 40, 16, "neox", torch.float32, False),  # odd heads; R not a power of two
    (7, 128, 24, 8, "gptj", torch.float16, True),  # 128 heads (several head blocks); fp8 cache
    (0, 4, 32, 16, "gptj", torch.float16, False),  # no tokens
])
@pytest.mark.parametrize("name", ["mla-triton", "mla-reference"])
def test_one_launch_equals_the_three(T, H, R, Dr, style, dtype, fp8, name):
    q, kva, w, pos, cs, cache, slots = _inputs(T, H, R, Dr, dtype, fp8=fp8)
    scale = torch.tensor([0.05]) if fp8 else None
    q2, kva2, cache2 = q.clone(), kva.clone(), cache.clone()
    registry.get("kv_append", name)("norm_rope_append_mla", q[..., 32:], kva, w, 1e-6, pos, cs, style, cache,
                                    slots, scale)
    _separate("reference" if name == "mla-reference" else "triton", q2[..., 32:], kva2, w, pos, cs, style,
              cache2, slots, scale)
    assert torch.equal(q, q2)  # q_pe rotated in place, q_nope untouched
    assert torch.equal(kva[:, -Dr:], kva2[:, -Dr:])
    assert torch.equal(cache.view(torch.uint8), cache2.view(torch.uint8))
    if T > 1:  # the padding slot wrote nothing: every written row is one of the kept slots
        written = (cache.view(-1, R + Dr).float() != 0).any(1).nonzero().flatten()
        assert set(written.tolist()) <= set(slots[slots >= 0].tolist())


def test_refusals_name_the_argument():
    q, kva, w, pos, cs, cache, slots = _inputs(3, 4, 32, 16, torch.float32)
    fn = registry.get("kv_append", "mla-triton").fn("norm_rope_append_mla")
    with pytest.raises(InputError, match="weight"):
        fn(q[..., 32:], kva, w[:-1], 1e-6, pos, cs, "gptj", cache, slots)
    with pytest.raises(InputError, match="cos_sin"):
        fn(q[..., 32:], kva, w, 1e-6, pos, cs[:, :4].contiguous(), "gptj", cache, slots)
    with pytest.raises(InputError, match="kva"):
        fn(q[..., 32:], kva[:2], w, 1e-6, pos, cs, "gptj", cache, slots)
    with pytest.raises(InputError, match="slot_mapping"):
        fn(q[..., 32:], kva, w, 1e-6, pos, cs, "gptj", cache, slots.clamp(min=0) + 1000)
