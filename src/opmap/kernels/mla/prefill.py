"""MLA prefill in Triton: the non-absorbed form, chunked over the cached context.

Entry ``mla_prefill`` (signature in reference.py). For the new tokens of a prefill the
non-absorbed form is the cheaper one (per head a 192-dim key and 128-dim value instead of the
576/512 latent), so K/V are expanded from the latent: ``[k_nope | v] = ckv @ [w_kc | w_vc]^T``
(one cuBLAS GEMM per chunk), while ``kpe`` stays shared by all heads and is never copied per head.

Chunking bounds memory: the context is walked in chunks of ``chunk_size`` token positions (the
same positions for every sequence of the batch); each chunk is gathered from the pages, expanded,
and attended to by ``_mla_prefill_kernel``, which *continues* the online softmax from the running
(normalised output, LSE) state of the previous chunks kept in fp32 buffers, so no separate merge
pass is needed. The plan (number of chunks, query blocks) reads ``max_q_len`` / ``max_seq_len``
from the host (give them to skip that read); prefill is therefore not CUDA-graph capturable.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect
from opmap.kernels.attention.merge import softmax_step
from opmap.core.tiles import tile_config
from opmap.ops.mla.validate import check_prefill, scale_value

CHUNK_BUDGET_BYTES = 512 * 2**20  # expanded K/V of one chunk


@triton.jit
def _tile(acc, m_i, l_i, qn, qp, KN, KP, V, b64, h, n0, end, chunk_start, qpos, qk_scale,
          s_knb, s_knn, s_knh, s_kpb, s_kpn, s_vb, s_vn, s_vh, offs_dn, offs_dr, offs_dv, mdn, mdr, mdv,
          BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """The key tile at n0 of the chunk folded into the online softmax."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n64 = offs_n.to(tl.int64)
    mn = offs_n < end
    kn = tl.load(KN + b64 * s_knb + n64[:, None] * s_knn + h * s_knh + offs_dn[None, :],
                 mask=mn[:, None] & mdn[None, :], other=0.0)
    kp = tl.load(KP + b64 * s_kpb + n64[:, None] * s_kpn + offs_dr[None, :],
                 mask=mn[:, None] & mdr[None, :], other=0.0)
    v = tl.load(V + b64 * s_vb + n64[:, None] * s_vn + h * s_vh + offs_dv[None, :],
                mask=mn[:, None] & mdv[None, :], other=0.0)
    if IEEE:
        s = tl.dot(qn, tl.trans(kn), input_precision="ieee")
        s += tl.dot(qp, tl.trans(kp), input_precision="ieee")
    else:
        s = tl.dot(qn, tl.trans(kn))
        s += tl.dot(qp, tl.trans(kp))
    s = s * qk_scale
    ok = mn[None, :]
    if CAUSAL:
        ok = ok & ((chunk_start + offs_n)[None, :] <= qpos[:, None])
    s = tl.where(ok, s, float("-inf"))
    m_i, alpha, p, l_i = softmax_step(s, m_i, l_i, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee" if IEEE else None)
    return acc, m_i, l_i


# the chunk's start and length vary per step: not specialized, so that every step launches the
# binaries the start-up compiled (attention decode._decode_kernel says why)
@triton.jit(do_not_specialize=["chunk_start", "chunk_len"])
def _mla_prefill_kernel(QN, QP, KN, KP, V, O, LSE, CU_Q, SEQ_LENS, chunk_start, chunk_len, sm_scale,
                    H, DN, DR, DV,
                    s_qnt, s_qnh, s_qpt, s_qph, s_knb, s_knn, s_knh, s_kpb, s_kpn,
                    s_vb, s_vn, s_vh, s_ot, s_oh, s_lt,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DN: tl.constexpr,
                    BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr,
                    IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    q0 = tl.load(CU_Q + b)
    qlen = tl.load(CU_Q + b + 1) - q0
    seq_len = tl.load(SEQ_LENS + b)
    if (pid_m * BLOCK_M >= qlen) | (chunk_start >= seq_len):
        return
    b64 = b.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = offs_m < qlen
    rows = (q0 + offs_m).to(tl.int64)
    qpos = seq_len - qlen + offs_m  # bottom-right aligned: the new tokens end the sequence
    offs_dn, offs_dr, offs_dv = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_DR), tl.arange(0, BLOCK_DV)
    mdn, mdr, mdv = offs_dn < DN, offs_dr < DR, offs_dv < DV
    qn = tl.load(QN + rows[:, None] * s_qnt + h * s_qnh + offs_dn[None, :], mask=mm[:, None] & mdn[None, :],
                 other=0.0)
    qp = tl.load(QP + rows[:, None] * s_qpt + h * s_qph + offs_dr[None, :], mask=mm[:, None] & mdr[None, :],
                 other=0.0)
    # continue from the previous chunks' state: (m, l, acc) = (lse, 1, o) in the exp2 domain
    lse0 = tl.load(LSE + rows * s_lt + h, mask=mm, other=float("-inf"))
    seen = lse0 > float("-inf")
    m_i = tl.where(seen, lse0 * 1.4426950408889634, -1.0e30)
    l_i = tl.where(seen, 1.0, 0.0)
    o_ptrs = O + rows[:, None] * s_ot + h * s_oh + offs_dv[None, :]
    acc = tl.load(o_ptrs, mask=mm[:, None] & mdv[None, :], other=0.0)
    acc = tl.where(seen[:, None], acc, 0.0)
    qk_scale = sm_scale * 1.4426950408889634

    end = tl.minimum(chunk_len, seq_len - chunk_start)
    if CAUSAL:  # keys past the last query of this block are never seen
        end = tl.minimum(end, seq_len - qlen + tl.minimum(pid_m * BLOCK_M + BLOCK_M, qlen) - chunk_start)
    for n0 in range(0, end, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, qn, qp, KN, KP, V, b64, h, n0, end, chunk_start, qpos, qk_scale,
                              s_knb, s_knn, s_knh, s_kpb, s_kpn, s_vb, s_vn, s_vh, offs_dn, offs_dr, offs_dv,
                              mdn, mdr, mdv, BLOCK_N, CAUSAL, IEEE)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    tl.store(o_ptrs, acc / l_safe[:, None], mask=mm[:, None] & mdv[None, :])
    tl.store(LSE + rows * s_lt + h, tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / 1.4426950408889634,
                                             float("-inf")), mask=mm)


def _config(dev: torch.device, width: int) -> dict:
    """Tiles (core/tiles.py). 64 x 64 tiles at 2 stages wait for every copy at the top of each tile
    in their sm90 build (async_wait 0: no load overlaps the dots; tests/test_mla_sm90_compile.py);
    128-row blocks at 3 stages keep copies in flight and need 168 KB of shared memory at
    DeepSeek's dims, so they are the default on sm90 only (docs/mla.md, Decisions)."""
    if dev.type != "cuda":
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if width > 128 and torch.cuda.get_device_capability(dev)[0] >= 9:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4 if width <= 128 else 8, num_stages=2)


def _chunk_size(B: int, H: int, width: int, max_seq_len: int, itemsize: int) -> int:
    per_pos = max(B * H * width * itemsize, 1)
    c = max(64, CHUNK_BUDGET_BYTES // per_pos // 64 * 64)
    return min(c, max(64, triton.cdiv(max_seq_len, 64) * 64))


def mla_prefill(q_nope, q_pe, cache, w_kc, w_vc, cu_seqlens_q, seq_lens, block_tables, *,
                scale: float, kv_scale=None, causal: bool = True, return_lse: bool = False,
                max_q_len: Optional[int] = None, max_seq_len: Optional[int] = None,
                chunk_size: Optional[int] = None, config: Optional[dict] = None):
    """``config``: tile keys replacing ``_config``'s (BLOCK_M, BLOCK_N, num_warps, num_stages;
    core/tiles.py), for tuning."""
    check_prefill(q_nope, q_pe, cache, w_kc, w_vc, cu_seqlens_q, seq_lens, block_tables, kv_scale, scale)
    T, H, Dn = q_nope.shape
    Dr, R, Dv = q_pe.shape[2], w_kc.shape[2], w_vc.shape[1]
    B = seq_lens.shape[0]
    dt, dev = q_nope.dtype, q_nope.device
    expect(cache.dtype in (dt, torch.float8_e4m3fn), "cache", f"dtype {cache.dtype}",
           f"{dt} (as q) or float8_e4m3fn")
    if max_q_len is None or max_seq_len is None:  # the plan's one host read (pass hints to skip it)
        cu = cu_seqlens_q.cpu()
        max_q_len = int((cu[1:] - cu[:-1]).max()) if B else 0
        max_seq_len = int(seq_lens.max()) if B else 0
    o = torch.zeros(T, H, Dv, dtype=torch.float32, device=dev)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=dev)
    if T and B and max_q_len and max_seq_len:
        chunk = chunk_size or _chunk_size(B, H, Dn + Dv, max_seq_len, q_nope.element_size())
        expect(chunk >= 1, "chunk_size", chunk, ">= 1")
        w = torch.cat([w_kc, w_vc], dim=1).reshape(H * (Dn + Dv), R)  # [k_nope | v] per head
        page, maxp = cache.shape[1], block_tables.shape[1]
        kscale = scale_value(kv_scale, dev) if cache.dtype == torch.float8_e4m3fn else None
        cfg = tile_config(_config(dev, Dn + Dv), config)
        BLOCK_M, BLOCK_N = cfg["BLOCK_M"], cfg["BLOCK_N"]
        expect(min(BLOCK_M, BLOCK_N) >= 16, "config", repr(config), "blocks >= 16 (tl.dot)")
        ieee = dt == torch.float32
        for c0 in range(0, max_seq_len, chunk):
            n = min(chunk, max_seq_len - c0)
            pos = c0 + torch.arange(n, device=dev)
            # positions past a sequence's end read cache page 0 (whatever the table holds there,
            # e.g. -1 padding, is never used as an index); the kernel masks them
            pidx = (pos // page).clamp(max=maxp - 1)[None, :].expand(B, n)
            own = pos[None, :] < seq_lens[:, None]
            pages = torch.where(own, block_tables.gather(1, pidx), 0).long().clamp_(0, cache.shape[0] - 1)
            rows = cache[pages, (pos % page)[None, :].expand(B, n)]  # [B, n, R + Dr]
            rows = rows.to(dt) if kscale is None else (rows.float() * kscale).to(dt)
            kv = (rows[..., :R] @ w.T).view(B, n, H, Dn + Dv)
            kp = rows[..., R:]
            kn, v = kv[..., :Dn], kv[..., Dn:]
            grid = (triton.cdiv(max_q_len, BLOCK_M), B, H)
            _mla_prefill_kernel[grid](
                q_nope, q_pe, kn, kp, v, o, lse, cu_seqlens_q, seq_lens, c0, n, float(scale),
                H, Dn, Dr, Dv, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
                kn.stride(0), kn.stride(1), kn.stride(2), kp.stride(0), kp.stride(1),
                v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), lse.stride(0),
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_DN=max(16, triton.next_power_of_2(Dn)),
                BLOCK_DR=max(16, triton.next_power_of_2(Dr)), BLOCK_DV=max(16, triton.next_power_of_2(Dv)),
                CAUSAL=causal, IEEE=ieee, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    out = o.to(dt)
    return (out, lse) if return_lse else out
