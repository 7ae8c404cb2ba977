"""The fused RoPE + paged KV append (kv_append entry "rope_append") against the two launches it
replaces (Triton rope then Triton append: bitwise, interpreter) and the fp32-math reference
composition: NeoX and GPT-J, partial rotary, GQA/MQA/MHA, page sizes 1 and 16, slot -1, strided
q/k/v (slices of a fused qkv), fp8 caches, zero tokens, bad input."""
import pytest
import torch

from opmap.core.contract import InputError
from opmap.kernels.attention import kv_append as A
from opmap.ops.attention import reference as AR
from opmap.kernels.attention.rope_append import rope_append
from opmap.ops.rope import reference as RR
from opmap.kernels.rope import triton_rope as TR

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
FP8 = torch.float8_e4m3fn


def _case(T, hq, hk, d, rot, page, dtype, cache_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, hq + 2 * hk, d, generator=g) * 2).to(dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    P = 32
    pos = torch.randint(0, 4000, (T,), generator=g)
    cs = RR.cos_sin_cache(rot, 4096, theta=500000.0)
    slots = torch.randperm(P * page, generator=g)[:T].to(torch.int32)
    if T > 2:
        slots[1] = -1
    kc = torch.randn(P, page, hk, d, generator=g).to(cache_dtype)
    vc = torch.randn(P, page, hk, d, generator=g).to(cache_dtype)
    sc = {}
    if cache_dtype == FP8:
        sc = dict(k_scale=torch.rand(hk, generator=g) + 0.05, v_scale=torch.rand(hk, generator=g) + 0.05)
    return qkv, q, k, v, pos, cs, kc, vc, slots, sc


def _views(qkv, hq, hk):
    return qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]


@pytest.mark.parametrize("q_heads", [None, 0])  # the default (decode sizes: 4 q heads a program), one program a token
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("T,hq,hk,d,rot,page,dtype,cache_dtype", [
    (5, 8, 2, 64, 64, 16, torch.float32, torch.float32),
    (17, 8, 8, 128, 64, 1, torch.float16, torch.float16),  # partial rotary, MHA, page 1
    (3, 8, 1, 64, 32, 16, torch.float16, FP8),  # MQA, fp8 cache
    (1, 4, 2, 128, 128, 16, torch.float32, torch.float32),
])
def test_fused_equals_the_two_launches(style, T, hq, hk, d, rot, page, dtype, cache_dtype, q_heads):
    qkv, q, k, v, pos, cs, kc, vc, slots, sc = _case(T, hq, hk, d, rot, page, dtype, cache_dtype)
    qkv2, kc2, vc2 = qkv.clone(), kc.clone(), vc.clone()
    q2, k2, v2 = _views(qkv2, hq, hk)
    qkv3, kc3, vc3 = qkv.clone(), kc.clone(), vc.clone()
    q3, k3, v3 = _views(qkv3, hq, hk)
    rope_append(q, k, v, pos, cs, style, kc, vc, slots, config=None if q_heads is None else {"Q_HEADS": q_heads}, **sc)
    TR.rope(q2, k2, pos, cs, style)
    A.append(k2, v2, kc2, vc2, slots, **sc)
    for a, b in ((qkv, qkv2), (kc, kc2), (vc, vc2)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    AR.rope_append(q3, k3, v3, pos, cs, style, kc3, vc3, slots, **sc)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(qkv.float(), qkv3.float(), atol=tol, rtol=tol)
    if cache_dtype != FP8:
        assert torch.allclose(kc.float(), kc3.float(), atol=tol, rtol=tol)
        assert torch.equal(vc, vc3)


def test_zero_tokens_and_all_skipped():
    qkv, q, k, v, pos, cs, kc, vc, slots, sc = _case(0, 4, 2, 64, 64, 16, torch.float32, torch.float32)
    before = kc.clone()
    rope_append(q, k, v, pos, cs, "neox", kc, vc, slots)
    assert torch.equal(kc, before)
    qkv, q, k, v, pos, cs, kc, vc, slots, sc = _case(4, 4, 2, 64, 64, 16, torch.float32, torch.float32)
    before, q0 = kc.clone(), q.clone()
    rope_append(q, k, v, pos, cs, "neox", kc, vc, torch.full_like(slots, -1))
    assert torch.equal(kc, before) and not torch.equal(q, q0)  # q still rotated (padded rows too)


@pytest.mark.parametrize("bad,arg", [("style", "style"), ("slot", "slot_mapping"), ("pos", "positions"),
                                     ("dtype", "k_cache"), ("vshape", "v")])
def test_bad_input_names_the_argument(bad, arg):
    qkv, q, k, v, pos, cs, kc, vc, slots, sc = _case(4, 4, 2, 64, 64, 16, torch.float32, torch.float32)
    style = "neox"
    if bad == "style":
        style = "llama"
    elif bad == "slot":
        slots = slots.clone()
        slots[0] = kc.shape[0] * kc.shape[1]
    elif bad == "pos":
        pos = pos.clone()
        pos[0] = cs.shape[0]
    elif bad == "dtype":
        kc, vc = kc.half(), vc.half()
    elif bad == "vshape":
        v = v[:2]
    with pytest.raises(InputError, match=f"^{arg}"):
        rope_append(q, k, v, pos, cs, style, kc, vc, slots)


@pytest.mark.parametrize("q_heads", [None, 0])
@pytest.mark.parametrize("T,hq,hk,d,dtype", [(5, 8, 2, 64, torch.float32), (17, 4, 4, 128, torch.float16),
                                             (1, 8, 1, 64, torch.float16)])
def test_qk_norm_fused_equals_three_launches(T, hq, hk, d, dtype, q_heads):
    """qk_norm=(w_q, w_k, eps): Qwen3's per-head norms, RoPE and the append in one launch, equal to
    qk_rmsnorm, rope and append one after another (bitwise on the interpreter; the GPU test allows
    one rounding step, the norms' row sums may take another reduction order there)."""
    from opmap.kernels.norm import triton_norm as TN

    qkv, q, k, v, pos, cs, kc, vc, slots, sc = _case(T, hq, hk, d, d, 16, dtype, dtype, seed=T)
    g = torch.Generator().manual_seed(1)
    w_q, w_k = (torch.rand(d, generator=g) + 0.5).to(dtype), (torch.rand(d, generator=g) + 0.5).to(dtype)
    qkv2, kc2, vc2 = qkv.clone(), kc.clone(), vc.clone()
    q2, k2, v2 = _views(qkv2, hq, hk)
    qkv3, kc3, vc3 = qkv.clone(), kc.clone(), vc.clone()
    q3, k3, v3 = _views(qkv3, hq, hk)
    rope_append(q, k, v, pos, cs, "neox", kc, vc, slots, qk_norm=(w_q, w_k, 1e-6),
                config=None if q_heads is None else {"Q_HEADS": q_heads})
    TN.qk_rmsnorm(qkv2[:, :hq + hk], w_q, w_k, hq, 1e-6)
    TR.rope(q2, k2, pos, cs, "neox")
    A.append(k2, v2, kc2, vc2, slots)
    for a, b in ((qkv, qkv2), (kc, kc2), (vc, vc2)):
        assert torch.equal(a, b)
    AR.rope_append(q3, k3, v3, pos, cs, "neox", kc3, vc3, slots, qk_norm=(w_q, w_k, 1e-6))
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert torch.allclose(qkv.float(), qkv3.float(), atol=tol, rtol=tol)
    assert torch.allclose(kc.float(), kc3.float(), atol=tol, rtol=tol)


def test_qk_norm_bad_weights_name_the_argument():
    qkv, q, k, v, pos, cs, kc, vc, slots, sc = _case(3, 4, 2, 64, 64, 16, torch.float32, torch.float32)
    w = torch.ones(64)
    for bad, arg in (((w[:32], w, 1e-6), "w_q"), ((w, w.half(), 1e-6), "w_k"), ((w, w, -1.0), "eps"),
                     ([w, w, 1e-6], "qk_norm")):
        with pytest.raises(InputError, match=f"^{arg}"):
            rope_append(q, k, v, pos, cs, "neox", kc, vc, slots, qk_norm=bad)


@pytest.mark.parametrize("q_heads", [1, 3, 8, 64])
@pytest.mark.parametrize("T,hq,hk,d,rot,cache_dtype,norm", [
    (4, 8, 2, 64, 64, torch.float16, False), (4, 8, 2, 64, 64, torch.float16, True),
    (1, 5, 1, 128, 128, FP8, True), (1, 5, 1, 128, 64, FP8, False),  # partial rotary: no q / k norms
    (3, 8, 8, 64, 32, torch.float16, False)])
def test_q_heads_split_gives_the_same_bits(q_heads, T, hq, hk, d, rot, cache_dtype, norm):
    """config Q_HEADS n: a token's k / v in one program and its q heads n a program (a partial last
    group where n does not divide the heads, n above the head count clamped) write what one program
    a token writes, with and without the q / k norms, partial rotary, an fp8 cache and a skipped slot."""
    qkv, q, k, v, pos, cs, kc, vc, slots, sc = _case(T, hq, hk, d, rot, 16, torch.float16, cache_dtype, seed=q_heads)
    g = torch.Generator().manual_seed(2)
    kw = dict(qk_norm=((torch.rand(d, generator=g) + 0.5).half(), (torch.rand(d, generator=g) + 0.5).half(), 1e-6)
              if norm else None, **sc)
    qkv2, kc2, vc2 = qkv.clone(), kc.clone(), vc.clone()
    rope_append(q, k, v, pos, cs, "neox", kc, vc, slots, config={"Q_HEADS": 0}, **kw)
    rope_append(*_views(qkv2, hq, hk), pos, cs, "neox", kc2, vc2, slots, config={"Q_HEADS": q_heads}, **kw)
    for a, b in ((qkv, qkv2), (kc, kc2), (vc, vc2)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("config", [{"Q_HEAD": 4}, {"Q_HEADS": -1}, {"Q_HEADS": 2.0}, [4]])
def test_bad_q_heads_config_names_the_config(config):
    qkv, q, k, v, pos, cs, kc, vc, slots, sc = _case(2, 4, 2, 64, 64, 16, torch.float32, torch.float32)
    with pytest.raises(InputError, match="^config"):
        rope_append(q, k, v, pos, cs, "neox", kc, vc, slots, config=config)
