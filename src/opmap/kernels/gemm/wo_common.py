"""What the weight-only Gluon kernels share (wo_gluon.py: mma.sync, backend ``gluon-wo``;
wo_wgmma.py: Hopper wgmma, backend ``gluon-wo-wgmma``): the exact weight conversions, the async
copy of a tile and the split-K tail with its epilogue (@gluon.jit), and on the host their
launchers' input contract, tuning dict, pipeline choice and split-K geometry."""
from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

from opmap.core.contract import dtype_name, expect
from opmap.core.tiles import tile_config
from opmap.kernels.gemm.splitk import counters
from opmap.kernels.gluon_util import e4m3_to_f16, sm_figures
from opmap.ops.gemm.validate import check_linear

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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
def origin(K, K_PER_SPLIT, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
    """(pid_n, pid_m, pid_k, n0, m0, k0, k_end) of a program of a split-K grid (N tiles, M tiles, splits)."""
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    k0 = pid_k * K_PER_SPLIT
    return pid_n, pid_m, pid_k, pid_n * BLOCK_N, pid_m * BLOCK_M, k0, gl.minimum(k0 + K_PER_SPLIT, K)


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


# ---- the launchers' host side ------------------------------------------------------------------

# config= keys (0: the plan's choice): output channels a program, programs an SM that K splits aim
# for, the K tile, and the pipeline depth
CONFIG = {"BLOCK_N": 0, "per_sm": 0, "BLOCK_K": 0, "STAGES": 0}


def config_of(config) -> dict:
    """The fields a call's ``config`` fixes, checked (an empty dict for none)."""
    if config is None:
        return {}  # the plan's defaults: no checks on the path of every call
    cfg = tile_config(CONFIG, config)
    expect(cfg["STAGES"] in (0, 2, 3, 4), "config", f"STAGES={cfg['STAGES']}", "2, 3 or 4")
    expect(cfg["BLOCK_K"] in (0, 64, 128, 256), "config", f"BLOCK_K={cfg['BLOCK_K']}", "64, 128 or 256")
    expect(cfg["BLOCK_N"] in (0, 64, 128), "config", f"BLOCK_N={cfg['BLOCK_N']}", "64 or 128")
    return {k: v for k, v in cfg.items() if v}


def check_inputs(x, w, bias, w_scale, max_m: int, gpu: str, gpu_ok, w_zero=None) -> tuple:
    """linear's contract (validate.check_linear) and what the Gluon kernels add: fp8 / int8
    weights, bf16 / fp16 activations, at most ``max_m`` rows, 16-byte aligned rows, a compiled
    run on a GPU that ``gpu_ok(device)`` accepts (``gpu`` names it). Returns (M, N, K)."""
    M, N, K = check_linear(x, w, bias, w_scale, w_zero)
    expect(w.dtype in (torch.float8_e4m3fn, torch.int8), "w", f"dtype {dtype_name(w.dtype)}",
           "fp8 or int8 (weight-only; dense weights go to cublas or triton-decode)")
    expect(x.dtype in (torch.bfloat16, torch.float16), "x", f"dtype {dtype_name(x.dtype)}", "bf16 or fp16")
    expect(M <= max_m, "x", f"{M} rows", f"at most {max_m} rows (triton-wo serves any M)")
    expect(K % 16 == 0, "x", f"K = {K}", "a multiple of 16 (16-byte rows for the async copies)")
    expect(x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0, "x", f"row stride {x.stride(0)}, address {x.data_ptr()}",
           "rows 16-byte aligned (row stride a multiple of 8, address of 16)")
    expect(w.stride(0) % 16 == 0 and w.data_ptr() % 16 == 0, "w", f"row stride {w.stride(0)}, address {w.data_ptr()}",
           "rows 16-byte aligned (row stride a multiple of 16, address of 16)")
    on_gpu = x.device.type == "cuda" and not INTERPRETED
    expect(on_gpu and gpu_ok(x.device), "x", f"device {x.device}{' under TRITON_INTERPRET=1' if INTERPRETED else ''}",
           f"a CUDA tensor on {gpu}, compiled (Gluon kernels do not run in the Triton interpreter)")
    return M, N, K


def pipeline(shapes, cfg: dict, bn: int, bm: int, tiles: int, K: int, sms: int, smem_per_sm: int, per_sm: int):
    """(BLOCK_K, STAGES, SPLIT): K split until the programs number about ``per_sm`` an SM, each
    split keeping >= 4 tiles of K; then the first of ``shapes`` (deepest first) whose programs fit
    on the GPU in one wave by shared memory, else the first (many waves: the LM heads). A second
    wave of a few programs cost more than a shallower pipeline (docs/dense.md, Decisions)."""
    shapes = [(bk, st) for bk, st in shapes if cfg.get("BLOCK_K", bk) == bk and cfg.get("STAGES", st) == st] or [
        (cfg.get("BLOCK_K", 256), cfg.get("STAGES", 3))]
    choice = None
    for bk, st in shapes:
        split = max(1, min(per_sm * sms // tiles, triton.cdiv(K, bk) // 4))
        smem = st * bk * (bn + 2 * bm) + 1024  # the weight and x stages, and what the SM keeps a program
        fits = (smem_per_sm // smem) * sms >= tiles * split
        if choice is None or fits:
            choice = (bk, st, split)
        if fits:
            break
    return choice


def geometry(M: int, N: int, K: int, p: dict, out: torch.Tensor) -> tuple:
    """(K_PER_SPLIT, SPLIT, grid, workspace, counters) of a plan ``p``: the splits that have K left
    (rounding K_PER_SPLIT up can empty the last ones); one split needs no workspace or counters."""
    bk = p["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(K, bk), p["SPLIT"]) * bk
    split = triton.cdiv(K, k_per_split)
    grid = (triton.cdiv(N, p["BLOCK_N"]), triton.cdiv(M, p["BLOCK_M"]), split)
    if split == 1:
        return k_per_split, split, grid, out, out  # never read with one split
    ws = torch.empty((split, M, N), dtype=torch.float32, device=out.device)
    return k_per_split, split, grid, ws, counters(grid[0] * grid[1], out.device)


def nothing_to_multiply(M: int, N: int, K: int, bias, out) -> bool:
    """Fills ``out`` of a call with no products (M, N or K zero) and says so."""
    if M and N and K:
        return False
    if M and N:
        out.zero_()
        if bias is not None:
            out += bias.to(out.dtype)
    return True


def describe(name: str, plan, M: int, N: int, K: int, device, config=None) -> str:
    """One line of a kernel's plan for a call (``plan``: the kernel module's plan function)."""
    p = plan(M, N, K, *sm_figures(torch.device(device)), config=config_of(config))
    return (f"{name}: BLOCK_N {p['BLOCK_N']}, BLOCK_M {p['BLOCK_M']}, BLOCK_K {p['BLOCK_K']}, "
            f"{p['STAGES']} stages, {p['SPLIT']} K split{'s' if p['SPLIT'] > 1 else ''}")


def prepare(plan, x, w, bias, w_scale, config, max_m: int, gpu: str, gpu_ok, w_zero=None) -> tuple:
    """What both weight-only Gluon kernels' calls share before their launch: the contract
    (``check_inputs``), the output, the plan of the kernel's own ``plan`` function and the split-K
    geometry. Returns (out, grid, args, constexprs, plan); grid None when there is nothing to multiply
    (``out`` is then filled). Each kernel module launches its own kernel with them, so that every
    launch names its kernel (the PDL tests read the launch sites)."""
    M, N, K = check_inputs(x, w, bias, w_scale, max_m, gpu, gpu_ok, w_zero)
    cfg = config_of(config)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if nothing_to_multiply(M, N, K, bias, out):
        return out, None, (), {}, None
    p = plan(M, N, K, *sm_figures(x.device), config=cfg)
    k_per_split, split, grid, ws, cnt = geometry(M, N, K, p, out)
    args = (x, w, w_scale, bias if bias is not None else out, out, ws, cnt, M, N, K, x.stride(0), w.stride(0),
            out.stride(0), k_per_split)
    consts = dict(W_INT8=w.dtype == torch.int8, HAS_SCALE=True, HAS_BIAS=bias is not None, SPLIT=split,
                  BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"], STAGES=p["STAGES"])
    return out, grid, args, consts, p
