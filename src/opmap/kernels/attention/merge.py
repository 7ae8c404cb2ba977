"""Merge of two partial attention states by their LSE (natural log, fp32), in Triton;
``split_sum``, the split-KV decodes' merge of n split partials (GQA ``_combine_kernel``, MLA
``_mla_merge_kernel``); and ``softmax_step``, the online-softmax update of one key tile that the
decode kernels and MLA's prefill share.

o = (o_a e^{lse_a} + o_b e^{lse_b}) / (e^{lse_a} + e^{lse_b}); a state with LSE -inf
contributes nothing, two empty states give zeros and -inf (as the reference).
One program per (token, head block); the D-vector is read once from each state.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from opmap.core.contract import expect, expect_tensor
from opmap.ops.attention import validate as V


@triton.jit
def softmax_step(s, m_i, l_i, AX: tl.constexpr, SAFE: tl.constexpr = False):
    """One key tile of the online softmax (exp2 domain): the scores ``s`` hold the keys along axis
    ``AX`` (1: rows are query heads; 0: rows are keys, the transposed dots). Returns the new running
    max, the factor that rescales the old accumulator and sum, the tile's weights and the new sum.
    The caller scales its accumulator by ``alpha`` (expanded along AX) and adds p times V.
    SAFE: a row whose max is still -inf (every key so far masked, the prefill's rows) gets weights
    and factors of 0 instead of NaN."""
    m_new = tl.maximum(m_i, tl.max(s, AX))
    m_ref = m_new
    if SAFE:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - tl.expand_dims(m_ref, AX))
    return m_new, alpha, p, l_i * alpha + tl.sum(p, AX)


@triton.jit
def split_sum(pl, po, s_pos, n, offs, mask, S_P: tl.constexpr, BLOCK_S: tl.constexpr, EXP2: tl.constexpr):
    """(acc, m, tot) over the n splits of one row: partial j at ``po + j * s_pos + offs``, its LSE
    at ``pl + j`` (log2 domain with EXP2, else natural log); the merged output is acc / tot and
    its LSE m + log(tot). All LSEs are read at once (their max, then every weight directly) and
    the partials in [BLOCK_S, len(offs)] tiles: no chain of dependent loads, where an online merge
    waited out one load per split. m is 0 when every split is empty (all weights then 0)."""
    js = tl.arange(0, S_P)
    lse = tl.load(pl + js, mask=js < n, other=float("-inf"))
    # The first tile of partials and its LSEs are loaded beside all LSEs, before their max is
    # known: up to BLOCK_S splits cost one round trip to memory, not two.
    s1 = tl.arange(0, BLOCK_S)
    m1 = s1 < n
    l1 = tl.load(pl + s1, mask=m1, other=float("-inf"))
    o1 = tl.load(po + s1[:, None] * s_pos + offs[None, :], mask=m1[:, None] & mask[None, :], other=0.0)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    tot = tl.sum(_exp(lse - m, EXP2), 0)
    acc = tl.sum(o1 * _exp(l1 - m, EXP2)[:, None], 0)
    for s0 in range(BLOCK_S, n, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        ms = ss < n
        w = _exp(tl.load(pl + ss, mask=ms, other=float("-inf")) - m, EXP2)
        o = tl.load(po + ss[:, None] * s_pos + offs[None, :], mask=ms[:, None] & mask[None, :], other=0.0)
        acc += tl.sum(o * w[:, None], 0)
    return acc, m, tot


@triton.jit
def _exp(x, EXP2: tl.constexpr):
    if EXP2:
        return tl.exp2(x)
    else:
        return tl.exp(x)


@triton.jit
def _merge_kernel(oa_ptr, la_ptr, ob_ptr, lb_ptr, o_ptr, l_ptr, H, D,
                  s_oat, s_oah, s_obt, s_obh, s_ot, s_oh, s_lat, s_lbt,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mh = h < H
    m2 = mh[:, None] & (d[None, :] < D)
    la = tl.load(la_ptr + t * s_lat + h, mask=mh, other=float("-inf"))
    lb = tl.load(lb_ptr + t * s_lbt + h, mask=mh, other=float("-inf"))
    m = tl.maximum(la, lb)
    safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - safe)
    wb = tl.exp(lb - safe)
    tot = wa + wb
    pos = tot > 0
    tot1 = tl.where(pos, tot, 1.0)
    lse = tl.where(pos, safe + tl.log(tot1), float("-inf"))
    inv = tl.where(pos, 1.0 / tot1, 0.0)
    oa = tl.load(oa_ptr + t * s_oat + h[:, None] * s_oah + d[None, :], mask=m2, other=0.0).to(tl.float32)
    ob = tl.load(ob_ptr + t * s_obt + h[:, None] * s_obh + d[None, :], mask=m2, other=0.0).to(tl.float32)
    o = oa * (wa * inv)[:, None] + ob * (wb * inv)[:, None]
    tl.store(o_ptr + t * s_ot + h[:, None] * s_oh + d[None, :], o.to(o_ptr.dtype.element_ty), mask=m2)
    tl.store(l_ptr + t * H + h, lse, mask=mh)


def merge(o_a, lse_a, o_b, lse_b):
    expect_tensor("o_a", o_a, ndim=3, dtype=V.Q_DTYPES, last_dim_contiguous=True)
    T, H, D = o_a.shape
    expect(D <= 1024, "o_a", f"head_dim {D}", "<= 1024")
    expect_tensor("o_b", o_b, dtype=o_a.dtype, shape=(T, H, D), device=o_a.device, last_dim_contiguous=True)
    expect_tensor("lse_a", lse_a, dtype=torch.float32, shape=(T, H), device=o_a.device, last_dim_contiguous=True)
    expect_tensor("lse_b", lse_b, dtype=torch.float32, shape=(T, H), device=o_a.device, last_dim_contiguous=True)
    o = torch.empty(T, H, D, dtype=o_a.dtype, device=o_a.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=o_a.device)
    if T == 0:
        return o, lse
    bd = triton.next_power_of_2(D)
    bh = max(1, min(triton.next_power_of_2(H), 4096 // bd))
    _merge_kernel[(T, triton.cdiv(H, bh))](o_a, lse_a, o_b, lse_b, o, lse, H, D,
                                           o_a.stride(0), o_a.stride(1), o_b.stride(0), o_b.stride(1),
                                           o.stride(0), o.stride(1), lse_a.stride(0), lse_b.stride(0),
                                           BLOCK_H=bh, BLOCK_D=bd, num_warps=4)
    return o, lse
