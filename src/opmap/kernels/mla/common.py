"""What the MLA decode kernels (the pointer kernel in decode.py, the TMA kernel in decode_tma.py)
share: the device-side split plan and the fp8 cache scale. Both kernels import it; neither
imports the other."""
import torch
import triton
import triton.language as tl


@triton.jit
def _cache_scale(SCALE_PTR, kv_scale, FP8: tl.constexpr, SCALE_FROM_PTR: tl.constexpr):
    """An fp8 cache's scale (from a [1] tensor, graph-safe, or a float argument); 1 otherwise."""
    ks = 1.0
    if FP8:
        if SCALE_FROM_PTR:
            ks = tl.load(SCALE_PTR)
        else:
            ks = kv_scale
    return ks


def scale_args(cache, kv_scale, unused_ptr):
    """(FP8, SCALE_FROM_PTR, SCALE_PTR, kv_scale float) launch arguments of ``_cache_scale``;
    ``unused_ptr``: any tensor, passed where no scale pointer is read."""
    fp8 = cache.dtype == torch.float8_e4m3fn
    from_ptr = fp8 and isinstance(kv_scale, torch.Tensor)
    return fp8, from_ptr, kv_scale if from_ptr else unused_ptr, float(kv_scale) if fp8 and not from_ptr else 1.0


@triton.jit
def _split_range(SEQ_LENS, b, split, K_SPARSE, SPLIT_MIN, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                 SPARSE: tl.constexpr):
    """(seq_len, used splits, first token, end) of this program's split: the device-side plan."""
    seq_len = tl.load(SEQ_LENS + b)
    if SPARSE:
        total = seq_len * 0 + K_SPARSE
    else:
        total = seq_len
    # at least one split, so that an empty sequence still writes zeros and lse = -inf
    used = tl.maximum(tl.minimum(tl.cdiv(total, SPLIT_MIN), NUM_SPLITS), 1)
    chunk = tl.cdiv(tl.cdiv(total, used), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, total)
    return seq_len, used, start, end
