"""The MLA prefill kernel with its tiles through TMA (tensor descriptors).

Same chunk loop, state continuation and masks as ``prefill._mla_prefill_kernel``; what differs is
how tiles reach shared memory: the chunk's expanded keys and values are one [B * n, H * (Dn + Dv)]
tensor (the expansion GEMM's output), so a key tile of head h is one box [BLOCK_N, Dn] at column
h * (Dn + Dv), its value tile one box [BLOCK_N, Dv] beside it, the shared RoPE keys a box of the
[B * n, Dr] rows, and the query block a box of q [T, H * Dn] (q_pe likewise). The box widths are
the head dims themselves, so they must be powers of two of at least 16 (DeepSeek: 128, 64, 128).

A tile may run past its sequence's keys in the chunk (rows of the next sequence, or past the
tensor: zeros). Those keys are masked, but their values still meet zero weights, and 0 * NaN is
NaN: ``prefill.mla_prefill`` zeroes the gathered latent rows past every sequence's length before
the expansion on this path, so every row a tile can read is finite.

One loop and no early return (a program with nothing to do runs an empty loop and writes its state
back unchanged): the shape Triton 3.6's Hopper warp specialization takes. Its warp-specialized
build compiled but failed on the H200 (an illegal address, fourteenth session), so the loop is not
specialized; docs/attention.md, "Warp specialization on Hopper".
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..attention.merge import _softmax_step


def usable(Dn: int, Dr: int, Dv: int, dtype: torch.dtype) -> str | None:
    """None when the TMA kernel can serve these head dims, else why."""
    for name, d in (("Dn", Dn), ("Dr", Dr), ("Dv", Dv)):
        if d < 16 or d > 256 or d & (d - 1):
            return f"{name}={d}: the TMA prefill's boxes are the head dims, powers of two from 16 to 256"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the TMA prefill runs bf16/fp16 queries, not {dtype}"
    return None


@triton.jit(do_not_specialize=["chunk_start", "chunk_len"])
def _mla_prefill_tma_kernel(QN_DESC, QP_DESC, KN_DESC, KP_DESC, V_DESC, O, LSE, CU_Q, SEQ_LENS, chunk_start,
                            chunk_len, sm_scale, H, s_ot, s_oh, s_lt, N_ROWS,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DN: tl.constexpr, DR: tl.constexpr,
                            DV: tl.constexpr, CAUSAL: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q0 = tl.load(CU_Q + b)
    qlen = tl.load(CU_Q + b + 1) - q0
    seq_len = tl.load(SEQ_LENS + b)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = offs_m < qlen
    rows = (q0 + offs_m).to(tl.int64)
    qpos = seq_len - qlen + offs_m  # bottom-right aligned: the new tokens end the sequence
    qn = QN_DESC.load([q0 + pid_m * BLOCK_M, h * DN])  # rows past the block's sequence: never stored
    qp = QP_DESC.load([q0 + pid_m * BLOCK_M, h * DR])
    # continue from the previous chunks' state: (m, l, acc) = (lse, 1, o) in the exp2 domain
    lse0 = tl.load(LSE + rows * s_lt + h, mask=mm, other=float("-inf"))
    seen = lse0 > float("-inf")
    m_i = tl.where(seen, lse0 * 1.4426950408889634, -1.0e30)
    l_i = tl.where(seen, 1.0, 0.0)
    o_ptrs = O + rows[:, None] * s_ot + h * s_oh + tl.arange(0, DV)[None, :]
    acc = tl.load(o_ptrs, mask=mm[:, None], other=0.0)
    acc = tl.where(seen[:, None], acc, 0.0)
    qk_scale = sm_scale * 1.4426950408889634

    end = tl.minimum(chunk_len, seq_len - chunk_start)
    if CAUSAL:  # keys past the last query of this block are never seen
        end = tl.minimum(end, seq_len - qlen + tl.minimum(pid_m * BLOCK_M + BLOCK_M, qlen) - chunk_start)
    end = tl.where(pid_m * BLOCK_M < qlen, end, 0)  # a block past its sequence: no tiles (no return)
    row0 = b * N_ROWS  # the sequence's first row in the chunk's [B * n] rows
    for n0 in tl.range(0, end, BLOCK_N):
        kn = KN_DESC.load([row0 + n0, h * (DN + DV)])
        kp = KP_DESC.load([row0 + n0, 0])
        s = tl.dot(qn, tl.trans(kn))
        s += tl.dot(qp, tl.trans(kp))
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = offs_n[None, :] < end
        if CAUSAL:
            ok = ok & ((chunk_start + offs_n)[None, :] <= qpos[:, None])
        m_i, alpha, p, l_i = _softmax_step(tl.where(ok, s * qk_scale, float("-inf")), m_i, l_i, 1)
        v = V_DESC.load([row0 + n0, h * (DN + DV) + DN])
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    tl.store(o_ptrs, acc / l_safe[:, None], mask=mm[:, None])
    tl.store(LSE + rows * s_lt + h, tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / 1.4426950408889634,
                                             float("-inf")), mask=mm)


def queries(q_nope: torch.Tensor, q_pe: torch.Tensor, block_m: int):
    """Descriptors of q_nope [T, H * Dn] and q_pe [T, H * Dr] (contiguous copies where the heads are
    not adjacent, as in a slice of a fused projection: a [T, H, Dn] copy, once per call)."""
    out = []
    for q in (q_nope, q_pe):
        T, H, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d or (q.stride(0) * q.element_size()) % 16 or q.data_ptr() % 16:
            q = q.contiguous()
        out.append(TensorDescriptor(q, [T, H * d], [q.stride(0), 1], [block_m, d]))
    return out


def launch(qd, pd, kv, kp, o, lse, cu_seqlens_q, seq_lens, chunk_start, n, scale, H, Dn, Dr, Dv, causal, bm, bn,
           warps, stages, max_q_len):
    """One chunk: ``kv`` [B, n, H, Dn + Dv] contiguous, ``kp`` [B, n, Dr] (a strided view is copied)."""
    B = seq_lens.shape[0]
    kv2 = kv.reshape(B * n, H * (Dn + Dv))
    kp2 = kp.reshape(B * n, Dr)
    if kp2.stride(1) != 1 or (kp2.stride(0) * kp2.element_size()) % 16 or kp2.data_ptr() % 16:
        kp2 = kp2.contiguous()
    kd = TensorDescriptor(kv2, list(kv2.shape), [kv2.stride(0), 1], [bn, Dn])
    vd = TensorDescriptor(kv2, list(kv2.shape), [kv2.stride(0), 1], [bn, Dv])
    pe = TensorDescriptor(kp2, list(kp2.shape), [kp2.stride(0), 1], [bn, Dr])
    _mla_prefill_tma_kernel[(triton.cdiv(max_q_len, bm), B, H)](
        qd, pd, kd, pe, vd, o, lse, cu_seqlens_q, seq_lens, chunk_start, n, float(scale), H,
        o.stride(0), o.stride(1), lse.stride(0), n,
        BLOCK_M=bm, BLOCK_N=bn, DN=Dn, DR=Dr, DV=Dv, CAUSAL=causal, num_warps=warps, num_stages=stages)
