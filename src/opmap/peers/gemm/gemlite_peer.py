"""gemlite (mobiusml's Triton low-bit GEMM library, the kernels behind its vLLM and HQQ integrations)
as the W4A16 peer of the gemm benchmark: the same int4 codes and group scales, packed into its own
layout once, its own selection of GEMV / split-K / GEMM kernel by M and its own tuned configs.

It is a peer, not a backend: its packed layout is not the one the loaders produce, so serving a
model through it would mean a second copy of every weight."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from opmap.ops.gemm.quant import INT4_SYM_ZERO, unpack_int4


def available() -> Optional[str]:
    """Why it cannot run here, else None."""
    if not torch.cuda.is_available():
        return "gemlite needs a CUDA GPU"
    try:
        import gemlite  # noqa: F401  optional: a peer of the benchmark only
    except ImportError:
        return "gemlite not installed (scripts/pack_wheels.sh carries it to the GPU machine)"
    return None


def int4_linear(wq: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], dtype) -> Callable:
    """A callable x -> x @ W^T on gemlite for our int4 layout (packed int32 [N, K / 8], scale [N, K / G],
    zero uint8 or None = symmetric); x of ``dtype`` (bf16 / fp16)."""
    from gemlite import DType, GemLiteLinear  # optional: the peer's package, where installed

    N, K = wq.shape[0], wq.shape[1] * 8
    G = K // scale.shape[1]
    dt = {torch.bfloat16: DType.BF16, torch.float16: DType.FP16}[dtype]
    lin = GemLiteLinear(4, group_size=G, in_features=K, out_features=N, input_dtype=dt, output_dtype=dt)
    # its format is HQQ's, W = (W_q - zero) * scale: ours with the codes unpacked
    lin.pack(unpack_int4(wq), scale.to(dtype), INT4_SYM_ZERO if zero is None else zero.to(dtype), None)
    return lin
