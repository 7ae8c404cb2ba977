"""@gluon.jit helpers the Gluon kernels share (ops/attention/decode_fp8.py, ops/gemm/wo_gluon.py):
Gluon kernels cannot call @triton.jit functions, so these restate pdl.enter and fp8.e4m3_to_f16."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def enter(PDL: gl.constexpr):
    """pdl.enter for Gluon: wait for the predecessor, then release the dependents."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def e4m3_to_f16(x):
    """e4m3 -> fp16, exact, two elements an instruction (cvt.rn.f16x2.e4m3x2, sm89+)."""
    return gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi;\n"
        "mov.b32 {lo, hi}, $2;\n"
        "cvt.rn.f16x2.e4m3x2 $0, lo;\n"
        "cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4)
