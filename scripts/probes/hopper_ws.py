"""Which loops Triton 3.6's Hopper warp specialization (``tl.range(..., warp_specialize=True)``,
the "autoWS" pass run for sm90) takes, compiled for sm90 on the CPU machine (no GPU needed).

Each pattern compiles in its own process: the pass aborts the process (an assertion) on loops it
does not handle. Per pattern: "specialized" (the TTGIR has ``ttg.warp_specialize``, with its
registers and wgmma count), "unchanged" (compiled, no partitions) or "compiler abort" (the
assertion's text). Thirteenth session; docs/attention.md ("Warp specialization on Hopper").

Usage: python3 scripts/probes/hopper_ws.py        (unset TRITON_INTERPRET; ~1 min)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import triton
import triton.language as tl


@triton.jit
def gemm(a_desc, a_ptr, b_desc, C, T, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
         PAGED: tl.constexpr, GATHER: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    rows = tl.load(T + pm * BM + tl.arange(0, BM))
    for k in tl.range(0, K, BK, warp_specialize=True):
        row = pm * BM
        if PAGED:  # the tile's row from a table, as a paged cache's page id
            row = tl.load(T + k // BK)
        if GATHER:  # A's rows gathered by pointer, as the MoE grouped GEMM does
            a = tl.load(a_ptr + rows[:, None] * K + k + tl.arange(0, BK)[None, :])
        else:
            a = a_desc.load([row, k])
        acc = tl.dot(a, b_desc.load([pn * BN, k]).T, acc)
    offs_m = pm * BM + tl.arange(0, BM)
    offs_n = pn * BN + tl.arange(0, BN)
    tl.store(C + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16))


@triton.jit
def _loop(q, k_desc, v_desc, L, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    """The specialized loop: K and V by descriptor, the online softmax between the two dots."""
    m_i = tl.full([BM], -1e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32) + 1.0
    acc = tl.zeros([BM, D], dtype=tl.float32)
    for n in tl.range(0, L, BN, warp_specialize=True):
        k = k_desc.load([n, 0])
        s = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        v = v_desc.load([n, 0])
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(tl.bfloat16), v, acc)
    return (acc / l_i[:, None]).to(tl.bfloat16)


@triton.jit
def attention(q_desc, k_desc, v_desc, o_desc, L, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    """q, K, V and the output by descriptor."""
    o_desc.store([0, 0], _loop(q_desc.load([0, 0]), k_desc, v_desc, L, BM, BN, D))


@triton.jit
def attention_optr(q_desc, k_desc, v_desc, o_ptr, L, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    """q, K and V by descriptor, the output by pointer."""
    offs = tl.arange(0, BM)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(o_ptr + offs, _loop(q_desc.load([0, 0]), k_desc, v_desc, L, BM, BN, D))


@triton.jit
def attention_qptr(q_ptr, k_desc, v_desc, o_ptr, L, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    """q and the output by pointer (as our prefill kernels), K and V by descriptor."""
    offs = tl.arange(0, BM)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(o_ptr + offs, _loop(tl.load(q_ptr + offs), k_desc, v_desc, L, BM, BN, D))


def _desc(shape):
    return "tensordesc<bf16[" + ",".join(map(str, shape)) + "]>"


PATTERNS = {
    # name: (kernel, signature, constexprs, options)
    "gemm 128x128x64, 4 warps, 3 stages": ("gemm", dict(PAGED=False, GATHER=False), {"num_warps": 4, "num_stages": 3}),
    "gemm, rows from a table (paged)": ("gemm", dict(PAGED=True, GATHER=False), {"num_warps": 4, "num_stages": 3}),
    "gemm, 8 warps": ("gemm", dict(PAGED=False, GATHER=False), {"num_warps": 8, "num_stages": 3}),
    "gemm, A rows gathered by pointer": ("gemm", dict(PAGED=False, GATHER=True), {"num_warps": 4, "num_stages": 3}),
    "attention, output by descriptor, 2 stages": ("attention", {}, {"num_warps": 4, "num_stages": 2}),
    "attention, output by descriptor, 3 stages": ("attention", {}, {"num_warps": 4, "num_stages": 3}),
    "attention, output by pointer, 2 stages": ("attention_optr", {}, {"num_warps": 4, "num_stages": 2}),
    "attention, output by pointer, 3 stages": ("attention_optr", {}, {"num_warps": 4, "num_stages": 3}),
    "attention, q by pointer, 2 stages": ("attention_qptr", {}, {"num_warps": 4, "num_stages": 2}),
}


def compile_one(name: str) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kern, ce, opts = PATTERNS[name]
    if kern == "gemm":
        fn = gemm
        sig = {"a_desc": _desc([128, 64]), "a_ptr": "*bf16", "b_desc": _desc([128, 64]), "C": "*bf16", "T": "*i32",
               "N": "i32", "K": "i32"}
        ce = dict(BM=128, BN=128, BK=64, **ce)
    else:
        fn = {"attention": attention, "attention_optr": attention_optr, "attention_qptr": attention_qptr}[kern]
        q = ("q_ptr", "*bf16") if kern == "attention_qptr" else ("q_desc", _desc([128, 128]))
        o = ("o_desc", _desc([128, 128])) if kern == "attention" else ("o_ptr", "*bf16")
        sig = {q[0]: q[1], "k_desc": _desc([64, 128]), "v_desc": _desc([64, 128]), o[0]: o[1], "L": "i32"}
        ce = dict(BM=128, BN=64, D=128, **ce)
    sig.update({k: "constexpr" for k in ce})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ce), target=GPUTarget("cuda", 90, 32), options=opts)
    tt = k.asm["ttgir"]
    return {"result": "specialized" if "ttg.warp_specialize(" in tt else "unchanged",
            "wgmma": tt.count("warp_group_dot "), "shared": k.metadata.shared}


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print("RESULT " + json.dumps(compile_one(sys.argv[2])))
        return 0
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for name in PATTERNS:
        p = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, env=env)
        if "RESULT " in p.stdout:
            out = json.loads(p.stdout.split("RESULT ", 1)[1])
        else:
            why = [ln for ln in p.stderr.splitlines()
                   if any(w in ln for w in ("Assertion", "UNREACHABLE", "not supported", "error:"))]
            out = {"result": "compiler abort", "why": (why[0] if why else p.stderr.strip()[-200:])[-220:]}
        print(f"{name}: {json.dumps(out)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
