"""int4 codes -> 16-bit values in registers, for the kernels that read packed int4 weights
(w4a16.py, dequant_cublas.py, the MoE grouped GEMM): ``unpack(words, zero, DT, ASM)`` turns int32
words (eight 4-bit codes each, code i at bits 4i..4i+3, ``opmap.ops.gemm.quant``'s layout) into
``words.shape + [8]`` values ``code - zero`` in DT, exactly (small integers).

On the GPU (``ASM``) each word takes a handful of integer instructions: a nibble OR'd into the
mantissa of 128.0 (bf16) or 1024.0 (fp16), whose unit in the last place is 1, *is* 128 + code (or
1024 + code), so one LOP3 a pair makes two values (nibbles i and i + 4, from the word's two 16-bit
halves) and one packed subtract of 128 + zero finishes them; a shift, a mask and an int-to-float
conversion per code cost about twice the instructions (tests/test_quant_sm90_compile.py). The
interpreter, which runs no PTX, takes the shift-and-mask path. Zeros below 128 are exact (128 +
zero must be a bf16 integer); every int4 format's zero is 0..16.
"""
from __future__ import annotations

import triton
import triton.language as tl

# $8: the word, $9: the zero code; outputs $0..$7: codes 0..7 minus the zero. MAGIC is the
# pair of 16-bit constants whose mantissa the nibbles fill; the subtrahend (MAGIC | zero in both
# halves) is negated into an FMA for bf16 (a packed bf16 subtract needs sm90; FMA sm80).
_HEAD = """{ .reg .b32 t0, t1, t2, t3, m, k, one;
shl.b32 k, $9, 16;
or.b32 k, k, $9;
or.b32 k, k, MAGIC;
lop3.b32 t0, $8, 0x000f000f, MAGIC, 0xea;
shr.u32 m, $8, 4;
lop3.b32 t1, m, 0x000f000f, MAGIC, 0xea;
shr.u32 m, $8, 8;
lop3.b32 t2, m, 0x000f000f, MAGIC, 0xea;
shr.u32 m, $8, 12;
lop3.b32 t3, m, 0x000f000f, MAGIC, 0xea;
"""
_TAIL = """mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3; }"""
_SUB_F16 = "".join(f"sub.rn.f16x2 t{i}, t{i}, k;\n" for i in range(4))
_SUB_BF16 = "xor.b32 k, k, 0x80008000;\nmov.b32 one, 0x3f803f80;\n" + "".join(
    f"fma.rn.bf16x2 t{i}, t{i}, one, k;\n" for i in range(4))
ASM_BF16 = tl.constexpr((_HEAD + _SUB_BF16 + _TAIL).replace("MAGIC", "0x43004300"))
ASM_F16 = tl.constexpr((_HEAD + _SUB_F16 + _TAIL).replace("MAGIC", "0x64006400"))
_OUT = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r")


@triton.jit
def _order(o0, o1, o2, o3, o4, o5, o6, o7):
    # a last dim of 8 in code order: the joins interleave evens and odds twice over
    p = tl.join(tl.join(o0, o4), tl.join(o2, o6))
    q = tl.join(tl.join(o1, o5), tl.join(o3, o7))
    return tl.reshape(tl.join(p, q), [o0.shape[0], o0.shape[1], 8])


@triton.jit
def unpack(words, zero, DT: tl.constexpr, ASM: tl.constexpr):
    """``words`` int32 [A, B] and ``zero`` int32 (broadcastable to it) -> [A, B, 8] in DT."""
    zero = tl.broadcast_to(zero, words.shape)
    if ASM and DT == tl.bfloat16:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            ASM_BF16, _OUT, [words, zero], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        return _order(o0, o1, o2, o3, o4, o5, o6, o7)
    elif ASM and DT == tl.float16:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            ASM_F16, _OUT, [words, zero], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        return _order(o0, o1, o2, o3, o4, o5, o6, o7)
    else:
        shifts = 4 * tl.arange(0, 8)
        return (((words[:, :, None] >> shifts[None, None, :]) & 0xF) - zero[:, :, None]).to(DT)

