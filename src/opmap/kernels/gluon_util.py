"""What the Gluon kernels share (kernels/attention/decode_fp8.py, kernels/gemm/wo_gluon.py): the device
facts their launchers ask on every call, cached, and @gluon.jit helpers. pdl.enter and
fp8.e4m3_to_f16 are restated here: their inline asm builds Triton's block types, not Gluon's
distributed ones, so they cannot be wrapped as the split plan is (decode_fp8._plan)."""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@functools.lru_cache(maxsize=None)
def sm89_or_newer(device: torch.device) -> bool:
    """Whether the kernels' packed e4m3 conversion (cvt.rn.f16x2.e4m3x2) runs on ``device``."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.lru_cache(maxsize=None)
def hopper(device: torch.device) -> bool:
    """Whether ``device`` runs warpgroup MMAs (wgmma: sm90 only; Blackwell has tcgen05 instead)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


@functools.lru_cache(maxsize=None)
def sm_figures(device: torch.device) -> tuple:
    """(SMs, shared memory an SM in bytes) of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.shared_memory_per_multiprocessor


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
