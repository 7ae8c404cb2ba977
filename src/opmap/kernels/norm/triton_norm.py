"""RMSNorm and fused residual-add + RMSNorm in Triton (HF numerics).

One program per row (several rows when they are short). Rows up to ONE_PASS_MAX elements are
held in registers: one read of x (and of the residual), one write of the output (and of the
residual): the minimum traffic.
Wider rows take two passes over chunks (sum of squares, then normalise); the second read of
the row mostly hits L2. Row offsets are int64, so tensors over 2^31 elements are safe.

Numerics as HF LlamaRMSNorm: fp32 sum of squares, ``(x * rsqrt(mean + eps))`` cast to
x.dtype, then multiplied by the weight in fp32 and rounded once. The fused add rounds
``x + residual`` to the residual dtype, stores it, and normalises that rounded value (the
same value the next layer reads as its residual).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.kernels import pdl
from opmap.core.contract import InputError, expect
from opmap.kernels.pdl import enter
from opmap.ops.norm.validate import check_norm, check_qk_norm

ONE_PASS_MAX = 16384
CHUNK = 4096


@triton.jit
def norm_rows(v, w, H, eps, dt: tl.constexpr):
    """HF numerics on fp32 rows v[ROWS, BLOCK]: x * rsqrt(mean(x^2) + eps) rounded to dt, then
    times the fp32 weight w (broadcast to v's shape); the caller rounds once more on the store."""
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / H + eps)
    return (v * rstd[:, None]).to(dt).to(tl.float32) * w


# R (rows: the step's tokens) varies per step: not specialized (see attention decode._decode_kernel)
@triton.jit(do_not_specialize=["R"])
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, o_ptr, stride_x, stride_r, stride_o, R, H, eps,
                    HAS_RES: tl.constexpr, ONE_PASS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):
    enter(PDL)
    dt = o_ptr.dtype.element_ty
    if ONE_PASS:
        # ROWS rows per program (short rows, e.g. per-head q/k norms, would otherwise leave
        # most lanes idle and launch one program per 128 elements).
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        offs = tl.arange(0, BLOCK)
        mask = (rows[:, None] < R) & (offs[None, :] < H)
        xp = x_ptr + rows[:, None] * stride_x + offs[None, :]
        v = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            rp = r_ptr + rows[:, None] * stride_r + offs[None, :]
            s = (v + tl.load(rp, mask=mask, other=0.0).to(tl.float32)).to(dt)
            tl.store(rp, s, mask=mask)
            v = s.to(tl.float32)
        w = tl.load(w_ptr + offs, mask=offs < H, other=0.0).to(tl.float32)
        y = norm_rows(v, w[None, :], H, eps, dt)
        tl.store(o_ptr + rows[:, None] * stride_o + offs[None, :], y.to(dt), mask=mask)
    else:
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        r_row = r_ptr + row * stride_r
        o_row = o_ptr + row * stride_o
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, H, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < H
            v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                s = (v + tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
                tl.store(r_row + offs, s, mask=mask)
                v = s.to(tl.float32)
            acc += v * v
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
        # Pass 2 re-reads what pass 1 stored (the summed residual): make those stores visible.
        tl.debug_barrier()
        for start in range(0, H, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < H
            if HAS_RES:
                v = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = (v * rstd).to(dt).to(tl.float32) * w
            tl.store(o_row + offs, y.to(dt), mask=mask)


@triton.jit(do_not_specialize=["R"])
def _qk_norm_kernel(x_ptr, wq_ptr, wk_ptr, stride_t, stride_h, R, NH, HQ, D, eps,
                    ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """ROWS (token, head) rows of qk per program, normalised in place; heads < HQ take w_q."""
    enter(PDL)
    dt = x_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    t, h = rows // NH, rows % NH
    offs = tl.arange(0, BLOCK)
    mask = (rows[:, None] < R) & (offs[None, :] < D)
    p = x_ptr + t[:, None] * stride_t + h[:, None] * stride_h + offs[None, :]
    v = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    wq = tl.load(wq_ptr + offs, mask=offs < D, other=0.0).to(tl.float32)
    wk = tl.load(wk_ptr + offs, mask=offs < D, other=0.0).to(tl.float32)
    y = norm_rows(v, tl.where((h < HQ)[:, None], wq[None, :], wk[None, :]), D, eps, dt)
    tl.store(p, y.to(dt), mask=mask)


def qk_rmsnorm(qk: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, num_q_heads: int,
               eps: float = 1e-6) -> torch.Tensor:
    """Per-head RMSNorm of q and k in place, in one launch (Qwen3's q_norm and k_norm were two
    launches, and a copy each when q / k were strided views of the qkv projection): ``qk`` is
    [T, Hq + Hk, D], heads < num_q_heads use ``w_q``, the rest ``w_k``. Same numerics as rmsnorm."""
    T, NH, D = check_qk_norm(qk, w_q, w_k, num_q_heads, eps)
    expect(D <= ONE_PASS_MAX, "qk", f"head_dim {D}", f"head_dim <= {ONE_PASS_MAX}")
    R = T * NH
    if R == 0:
        return qk
    block = triton.next_power_of_2(D)
    rows, num_warps = _packing(block, R)
    _qk_norm_kernel[(triton.cdiv(R, rows),)](
        qk, w_q, w_k, qk.stride(0), qk.stride(1), R, NH, num_q_heads, D, float(eps),
        ROWS=rows, BLOCK=block, num_warps=num_warps, **pdl.launch(qk.device))
    return qk


def _packing(block: int, R: int) -> tuple:
    """(rows per program, warps) of a one-pass launch: rows shorter than 1024 are packed so that
    a program holds ~1024 elements. Not cut down to R: the rows past R are masked, and a packing
    that followed R (the step's tokens) compiled a new binary for each power of two of it."""
    rows = max(1024 // block, 1)
    return rows, min(max(block * rows // 512, 1), 16)


def _rows(t: torch.Tensor, arg: str, may_copy: bool) -> torch.Tensor:
    """[..., H] -> a [R, H] view (or, for a pure input, a copy when no view exists)."""
    H = t.shape[-1]
    try:
        return t.view(-1, H)
    except RuntimeError:
        if may_copy:
            return t.reshape(-1, H).contiguous()
        raise InputError(arg, f"strides {t.stride()}", "leading dims that flatten to one row stride") from None


def _launch(x, weight, eps, residual, out):
    H = check_norm(x, weight, eps, residual=residual, out=out)
    x2 = _rows(x, "x", may_copy=residual is None)
    r2 = _rows(residual, "residual", may_copy=False) if residual is not None else x2
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o2 = _rows(out, "out", may_copy=False)
    R = x2.shape[0]
    if R == 0:
        return out
    one_pass = H <= ONE_PASS_MAX
    block = triton.next_power_of_2(H) if one_pass else CHUNK
    rows, num_warps = _packing(block, R) if one_pass else (1, 8)
    _rmsnorm_kernel[(triton.cdiv(R, rows),)](
        x2, r2, weight, o2, x2.stride(0), r2.stride(0), o2.stride(0), R, H, float(eps),
        HAS_RES=residual is not None, ONE_PASS=one_pass, ROWS=rows, BLOCK=block, num_warps=num_warps,
        **pdl.launch(x2.device))
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out=None) -> torch.Tensor:
    """out = rmsnorm(x) * weight; ``out`` may be x itself (in place)."""
    return _launch(x, weight, eps, None, out)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                *, out=None) -> torch.Tensor:
    """``residual += x`` in place, then returns rmsnorm(residual) * weight."""
    return _launch(x, weight, eps, residual, out)
