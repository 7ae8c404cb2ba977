"""What the weight-only Gluon kernels share (wo_gluon.py: mma.sync, wo_wgmma.py: Hopper wgmma):
the exact weight conversions, the async copy of a tile, and the split-K tail with its epilogue."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

from opmap.kernels.gluon_util import e4m3_to_f16


@gluon.jit
def i8_to_f32(x):
    """int8 -> fp32, exact: each byte (offset by 128) under 2^23's exponent, minus 2^23 + 128."""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 t, a0, a1, a2, a3;\n"
        "xor.b32 t, $4, 0x80808080;\n"
        "prmt.b32 a0, t, 0x4B000000, 0x7540;\n"
        "prmt.b32 a1, t, 0x4B000000, 0x7541;\n"
        "prmt.b32 a2, t, 0x4B000000, 0x7542;\n"
        "prmt.b32 a3, t, 0x4B000000, 0x7543;\n"
        "sub.f32 $0, a0, 0f4B000080;\n"
        "sub.f32 $1, a1, 0f4B000080;\n"
        "sub.f32 $2, a2, 0f4B000080;\n"
        "sub.f32 $3, a3, 0f4B000080; }",
        "=r,=r,=r,=r,r", [x], dtype=gl.float32, is_pure=True, pack=4)


@gluon.jit
def operand(w, xdt: gl.constexpr, W_INT8: gl.constexpr):
    """A weight fragment in x's dtype, exactly."""
    if W_INT8:
        return i8_to_f32(w).to(xdt)
    if xdt == gl.float16:
        return e4m3_to_f16(w)
    return e4m3_to_f16(w).to(gl.float32).to(xdt)


@gluon.jit
def issue(buf, ptr, r0, k, R, k_end, s_r, BLOCK_R: gl.constexpr, BLOCK_K: gl.constexpr, COPY: gl.constexpr,
          ALIGN: gl.constexpr, COMMIT: gl.constexpr):
    """Async copies of rows [r0, r0 + BLOCK_R) x columns [k, k + BLOCK_K) of a row-major operand
    (its row stride a multiple of ALIGN elements) into ``buf``; COMMIT closes the copy group."""
    rr = r0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, COPY))
    rk = k + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, COPY))
    ok = (rr < R)[:, None] & (rk < k_end)[None, :]
    cp.async_copy_global_to_shared(buf, ptr + gl.multiple_of(rr.to(gl.int64) * s_r, ALIGN)[:, None] + rk[None, :],
                                   mask=ok)
    if COMMIT:
        cp.commit_group()


@gluon.jit
def finish(acc, s_ptr, b_ptr, o_ptr, ws_ptr, cnt_ptr, M, N, s_om, n0, m0, pid_n, pid_m, pid_k,
           HAS_SCALE: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, BLOCK_N: gl.constexpr,
           BLOCK_M: gl.constexpr, LAYOUT: gl.constexpr):
    """The epilogue of an out^T tile ``acc`` [BLOCK_N, BLOCK_M] (fp32, ``LAYOUT``): scaled, biased and
    stored; with split K, partials [SPLIT, M, N] fp32 that the tile's last program sums in split
    order (deterministic) before the epilogue."""
    rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
    rm = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, LAYOUT))
    n_ok = rn < N
    mask = n_ok[:, None] & (rm < M)[None, :]
    if SPLIT == 1:
        _epilogue(acc, s_ptr, b_ptr, o_ptr, rn, rm, n_ok, mask, s_om, HAS_SCALE, HAS_BIAS)
    else:
        part = ws_ptr + rm[None, :].to(gl.int64) * N + rn[:, None]
        mn = M.to(gl.int64) * N
        gl.store(part + pid_k * mn, acc, mask=mask)
        gl.thread_barrier()  # every thread's partial is written before the counter moves
        tile = cnt_ptr + pid_m * gl.num_programs(0) + pid_n
        if gl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, LAYOUT)
            for s in range(SPLIT):  # .cg: the other splits' partials are in L2, never in this SM's L1
                acc += gl.load(part + s * mn, mask=mask, other=0.0, cache_modifier=".cg")
            _epilogue(acc, s_ptr, b_ptr, o_ptr, rn, rm, n_ok, mask, s_om, HAS_SCALE, HAS_BIAS)
            gl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _epilogue(acc, s_ptr, b_ptr, o_ptr, rn, rm, n_ok, mask, s_om, HAS_SCALE: gl.constexpr, HAS_BIAS: gl.constexpr):
    if HAS_SCALE:
        acc = acc * gl.load(s_ptr + rn, mask=n_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc = acc + gl.load(b_ptr + rn, mask=n_ok, other=0.0).to(gl.float32)[:, None]
    gl.store(o_ptr + rm[None, :].to(gl.int64) * s_om + rn[:, None], acc.to(o_ptr.dtype.element_ty), mask=mask)
