"""Backend "scaled-mm": fp8 activations x fp8 weights through ``torch._scaled_mm`` (cuBLASLt).

x (bf16/fp16) is quantised per token (row) to fp8-e4m3 on the fly by one Triton launch
(``act_quant``); the weight is fp8-e4m3 with a per-output-channel scale
(``quant.quantize_weight(w, "fp8")``). On sm90 with a bf16 output both scales go to cuBLASLt as
row-wise scales (applied in its epilogue). Elsewhere (sm89, fp16 output) the product is taken
with tensor-wise scales in fp32 and the per-channel scale is applied afterwards (one extra pass
over the output). cuBLASLt needs K and N to be multiples of 16; M is free.

``linear_block`` is the backend "scaled-mm-block": block-wise fp8 weights (a scale per 128 x 128
block, DeepSeek-V3 / Qwen3-FP8) against activations quantised per token and 128-channel group
(``act_quant.quantize_act_fp8_group``), both scales applied inside cuBLASLt's block-scaled fp8
GEMM (sm90, CUDA 12.9+): the recipe those checkpoints were trained and calibrated with.
"""
from __future__ import annotations

import torch

from opmap.core.contract import expect

from opmap.kernels.gemm.act_quant import quantize_act_fp8, quantize_act_fp8_group
from opmap.ops.gemm.quant import FP8, block_of
from opmap.ops.gemm.validate import check_linear


def linear(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None) -> torch.Tensor:
    M, N, K = check_linear(x, w, bias, w_scale, w_zero)
    expect(x.dtype in (torch.bfloat16, torch.float16), "x", f"dtype {x.dtype}", "bf16 or fp16 (scaled-mm)")
    expect(w.dtype == FP8, "w", f"dtype {w.dtype}", "float8_e4m3fn weights (scaled-mm)")
    expect(N % 16 == 0 and K % 16 == 0, "w", f"shape {tuple(w.shape)}", "N and K multiples of 16 (cuBLASLt fp8)")
    expect(x.device.type == "cuda", "x", f"device {x.device}", "a CUDA device (sm89+)")
    xq, xs = quantize_act_fp8(x)
    wt = w.t()  # [K, N] column-major, the layout cuBLASLt wants for the second operand
    rowwise = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    if rowwise:
        y = torch._scaled_mm(xq, wt, scale_a=xs, scale_b=w_scale.view(1, N), out_dtype=torch.bfloat16)
        return y if bias is None else y + bias.to(y.dtype)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    y = torch._scaled_mm(xq, wt, scale_a=one, scale_b=one, out_dtype=torch.float32)
    y = y * xs * w_scale.view(1, N)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


SCALE_BLOCK = 128  # the one block edge cuBLASLt's block scaling takes (1 x 128 for x, 128 x 128 for w)


def linear_block(x: torch.Tensor, w: torch.Tensor, bias=None, w_scale=None, w_zero=None) -> torch.Tensor:
    M, N, K = check_linear(x, w, bias, w_scale, w_zero, block=True)
    expect(x.dtype == torch.bfloat16, "x", f"dtype {x.dtype}", "bf16 (scaled-mm-block)")
    expect(w.dtype == FP8 and w_scale is not None and w_scale.dim() == 2, "w_scale",
           "a scale per output channel" if w_scale is not None else "None", "a scale per block (block-wise fp8)")
    expect(block_of(N, K, w_scale) == SCALE_BLOCK, "w_scale", f"shape {tuple(w_scale.shape)}",
           f"a scale per {SCALE_BLOCK} x {SCALE_BLOCK} block (cuBLASLt's block scaling)")
    # K in whole groups of four blocks: the weight scale's rows are then as long as the padded
    # stride (a multiple of four scales) that some torch releases' cuBLASLt path reads
    expect(K % (4 * SCALE_BLOCK) == 0 and N % 16 == 0, "w", f"shape {tuple(w.shape)}",
           f"K a multiple of {4 * SCALE_BLOCK}, N of 16 (cuBLASLt block-scaled fp8)")
    expect(x.device.type == "cuda", "x", f"device {x.device}", "a CUDA device (sm90)")
    if M == 0:
        return torch.empty((0, N), dtype=x.dtype, device=x.device)
    # rows in fours: cuBLASLt found no algorithm for M = 3 or 129 (CUBLAS_STATUS_NOT_SUPPORTED) and
    # ran M = 256; the padding rows' outputs are dropped
    xq, xs = quantize_act_fp8_group(x, SCALE_BLOCK, pad=4)
    # w_scale [N / 128, K / 128] row-major is, seen from w.t() [K, N], the 128 x 128 scale cuBLASLt reads
    y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale.t(), out_dtype=torch.bfloat16)[:M]
    return y if bias is None else y + bias.to(y.dtype)
