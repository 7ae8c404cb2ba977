"""The Gluon layouts and register moves the two fp8 decode kernels share (attention/decode_fp8.py and
mla/decode_fp8.py): four warps, each on its own 16 keys of a 64-key tile, mma.sync dots on fp16
fragments converted in registers from e4m3 bytes read 16 at a time, and V^T as the A operand of the
value dot with its 128 columns permuted so that a thread's 16 elements of a key are contiguous bytes.
A helper module: both kernels import it, neither imports the other."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

NUM_WARPS = 4
KEYS_PER_WARP = 16
COLS = 128  # the bytes of a key row one warp's fragments cover: GQA's head dim, a quarter of MLA's latent

_MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1, 1], instr_shape=[1, 16, 8])
MMA = gl.constexpr(_MMA)
A_K = gl.constexpr(gl.DotOperandLayout(0, _MMA, 16))  # K, 64 columns (16 bytes a thread)
B_Q = gl.constexpr(gl.DotOperandLayout(1, _MMA, 16))
A_V = gl.constexpr(gl.DotOperandLayout(0, _MMA, 2))
B_P = gl.constexpr(gl.DotOperandLayout(1, _MMA, 2))
# V as loaded: thread (g, t) holds keys {2t, 2t+1, 2t+8, 2t+9} x bytes 16g..16g+15 of the row.
V_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 8, 0]],
    lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]],
    warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[NUM_WARPS, KEYS_PER_WARP, COLS]))
NW = gl.constexpr(NUM_WARPS)
KW = gl.constexpr(KEYS_PER_WARP)
HD = gl.constexpr(COLS)


@gluon.jit
def vt_operand(v):
    """V [warps, keys, 128 bytes] as loaded (V_LOAD) -> the A operand V^T [warps, 128, keys], row
    m = 16i + 8h + g holding column 16g + 2i + h (register moves only)."""
    v = gl.reshape(v.to(gl.float16), [NW, KW, 8, 8, 2])
    v = gl.permute(v, (0, 3, 4, 2, 1))
    return gl.convert_layout(gl.reshape(v, [NW, HD, KW]), A_V)


@gluon.jit
def row_col(m):
    """The column of row m of V^T (the permutation of vt_operand)."""
    return (m % 8) * 16 + (m // 16) * 2 + (m // 8) % 2
