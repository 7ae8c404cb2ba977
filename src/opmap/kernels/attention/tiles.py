"""The @triton.jit helpers the paged attention kernels share (gather prefill, TMA prefill,
decode, and the Gluon kernels, which call them too): page-id loads, the sequence lookup of a
prefill program, masks, score scaling, the online-softmax update and where a TMA box of keys
reads. One module that every kernel imports, so no kernel imports another."""
import triton
import triton.language as tl

from opmap.kernels.attention.merge import softmax_step


@triton.jit
def _tanh(x):
    # tanh through exp: works in the interpreter and compiles to ex2 on the GPU.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _pages(bt_row, start, hi, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page ids of the key tile at ``start`` (0 past ``hi``: never dereferenced unmasked)."""
    j = start + tl.arange(0, BLOCK_N)
    return tl.load(bt_row + j // PAGE, mask=j < hi, other=0)


@triton.jit
def _plan(E, split_tokens, max_splits, min_chunk, BLOCK_N: tl.constexpr):
    """(chunk, n): n splits of ``chunk`` keys cover the E keys a query sees."""
    n = tl.minimum(tl.maximum((E + min_chunk - 1) // min_chunk, 1), max_splits)
    auto = tl.maximum(((E + n - 1) // n + BLOCK_N - 1) // BLOCK_N * BLOCK_N, BLOCK_N)
    chunk = tl.where(split_tokens > 0, split_tokens, auto)
    return chunk, (E + chunk - 1) // chunk


@triton.jit
def _scaled(s, qk_scale, scale, soft_cap, HAS_CAP: tl.constexpr):
    """Raw scores to the exp2 domain, through the soft cap where there is one."""
    if HAS_CAP:
        return soft_cap * _tanh(s * (scale / soft_cap)) * 1.4426950408889634
    return s * qk_scale


@triton.jit
def _allowed(mj, j, qpos, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[rows, keys] mask: key j is in range (mj), at or before the query (causal), inside the window."""
    ok = mj[None, :]
    if CAUSAL:
        ok = ok & (j[None, :] <= qpos[:, None])
    if HAS_WINDOW:
        ok = ok & (j[None, :] > qpos[:, None] - window)
    return ok


@triton.jit
def _update(acc, l_i, m_i, s, v, IEEE: tl.constexpr):
    """The online softmax step of one tile of scores (exp2 domain) and its values."""
    m_new, alpha, p, l_i = softmax_step(s, m_i, l_i, 1, True)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee" if IEEE else None)
    return acc, l_i, m_new


@triton.jit
def _locate(cu_ptr, B, pid, BLOCK_Q: tl.constexpr):
    """(b, q0, q_len, local): the sequence that owns program ``pid`` (the largest b with
    cu[b] // BLOCK_Q + b <= pid), its first token, its query length and the program's block in it."""
    lo = pid * 0
    hi = pid * 0 + B - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        st = tl.load(cu_ptr + mid) // BLOCK_Q + mid
        go = st <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    b = lo
    q0 = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q0
    return b, q0, q_len, pid - (q0 // BLOCK_Q + b)


@triton.jit
def _kv_scales(ks_ptr, vs_ptr, kvh, FP8: tl.constexpr):
    """(k_mul, v_mul): an fp8 cache's per-kv-head scales, folded into the scores and the output."""
    k_mul = 1.0
    v_mul = 1.0
    if FP8:
        k_mul = tl.load(ks_ptr + kvh)
        v_mul = tl.load(vs_ptr + kvh)
    return k_mul, v_mul


@triton.jit
def _rows(L, q_len, local, kvh, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """(token, head, valid, position) of each of a program's rows: BLOCK_M // GROUP query tokens
    times the GROUP query heads of KV head ``kvh``, token-major."""
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    r = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + r // GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (tok < q_len)
    return tok, kvh * GROUP + r % GROUP, row_ok, L - q_len + tok


@triton.jit
def _kv_range(L, q_len, local, window, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr):
    """(kv_lo, full_end, kv_hi) of a query block: its keys are [kv_lo, kv_hi), and the tiles in
    [kv_lo, full_end) lie below every row's diagonal and inside L, so they need no mask."""
    first_pos = L - q_len + local * BLOCK_Q
    last_pos = L - q_len + tl.minimum((local + 1) * BLOCK_Q, q_len) - 1
    kv_hi = L
    if CAUSAL:
        kv_hi = tl.minimum(L, last_pos + 1)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    full_end = kv_lo
    if not HAS_WINDOW:
        if CAUSAL:
            full_end = tl.minimum(first_pos + 1, L) // BLOCK_N * BLOCK_N
        else:
            full_end = L // BLOCK_N * BLOCK_N
    return kv_lo, full_end, kv_hi


@triton.jit
def box_row(j, L, pidx, PAGE: tl.constexpr, BOX: tl.constexpr):
    """The first page row that a TMA box of keys [j, j + BOX) (inside page index ``pidx``) reads,
    so that no row at or past the length L is read (it may hold anything, NaN included): j's row
    if the box ends at or before L; if L falls inside it, the row that makes the box end at L (its
    rows before j are keys done already, masked by ``box_positions``; rows before the page, a
    negative row, read as zeros through the descriptor); past L, -BOX: the whole box outside the
    descriptor, zeros."""
    return tl.where(j + BOX <= L, j % PAGE, tl.where(j < L, L - BOX - pidx * PAGE, -BOX))


@triton.jit
def box_positions(start, cols, L, BOX: tl.constexpr):
    """(key position, whether the tile adds that key) of each column ``cols`` of the tile of keys
    from ``start`` (a multiple of BOX), its boxes read as ``box_row`` lays them out."""
    j = start + cols
    bs = j - cols % BOX  # the column's box
    held = (bs < L) & (bs + BOX > L)  # the box that holds L, read ending at L
    pos = tl.where(held, L - BOX + cols % BOX, j)
    return pos, pos >= bs
