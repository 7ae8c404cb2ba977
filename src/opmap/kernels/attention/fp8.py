"""fp8 (e4m3) KV tiles for 16-bit tensor-core dots in the decode kernels (GQA and MLA).

With Triton's own cast (``tile.to(q.dtype)``) on sm90, Triton's layout pass moves the dots'
layout changes ahead of the cast, because moving 1-byte elements through shared memory is
cheaper than moving 2-byte ones: the builds then read the tile back from shared memory one byte
at a time (``LDS.U8``) and convert it once per dot, e4m3 -> f16 -> bf16 one element at a time
(tests/test_mla_sm90_compile.py, tests/test_attention_sm90_compile.py). ``e4m3_to_f16`` converts
with sm89+'s packed instruction in inline PTX marked impure, which the layout pass does not move
ops across: the tile is copied in 16 bytes, converted once, and reaches the dots by ldmatrix.
The dots then run in fp16 (e4m3 -> fp16 is exact), so q is converted to fp16 after division by a
power of two wherever its largest magnitude would not fit (``f16_factor``; the factor goes into
the score scale).
"""
import torch
import triton
import triton.language as tl

from opmap.kernels.attention.common import interpreted


@triton.jit
def e4m3_to_f16(x):
    """4 e4m3 bytes per 32-bit register -> 4 fp16, exact (cvt.rn.f16x2.e4m3x2, sm89+). Not for the
    interpreter, which runs no PTX (its kernels cast instead)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi;\n"
        "mov.b32 {lo, hi}, $2;\n"
        "cvt.rn.f16x2.e4m3x2 $0, lo;\n"
        "cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def absmax(x):
    """Largest finite magnitude of a 2-D tile, in fp32. Non-finite entries are left out, so that an
    inf or NaN in one head's query stays in that head's output (as in the reference) instead of
    setting the factor, and so the result, of every head of the program."""
    a = tl.abs(x.to(tl.float32))
    return tl.max(tl.max(tl.where(a < float("inf"), a, 0.0), 1), 0)


@triton.jit
def f16_factor(big):
    """The power of two (>= 1; dividing by it is exact) that brings magnitudes up to ``big`` to at
    most 2^15, inside fp16's range (65504)."""
    return tl.exp2(tl.maximum(tl.ceil(tl.log2(tl.maximum(big, 1.0) / 32768.0)), 0.0))


@triton.jit
def scaled_f16(x, f):
    """``x / f`` in fp16 (``f`` from ``f16_factor``: a power of two, so the division is exact)."""
    return (x.to(tl.float32) / f).to(tl.float16)


def dot_flags(cache_dtype, q: torch.Tensor, enabled: bool = True) -> dict:
    """The kernels' F16 / ASM constexprs: fp16 dots (``fp16_dots``), on tiles converted by
    ``e4m3_to_f16`` on a GPU and by a cast in the interpreter, which runs no PTX. ``enabled``
    False keeps Triton's cast and dots in q's dtype (the MLA decode's 64-head blocks, where that
    measured faster)."""
    f16 = fp16_dots(cache_dtype, q.dtype, enabled)
    return dict(F16=f16, ASM=f16 and not interpreted(q.device))


def fp16_dots(cache_dtype, q_dtype, enabled: bool = True) -> bool:
    """Whether a decode on this cache runs fp16 dots: fp8 caches with 16-bit queries (fp32
    queries keep their IEEE dots), unless the caller keeps the cast (``enabled`` False)."""
    return enabled and cache_dtype == torch.float8_e4m3fn and q_dtype in (torch.float16, torch.bfloat16)
