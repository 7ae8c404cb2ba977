"""The Gluon warp-specialised prefill (kernels/attention/prefill_ws.py, the gluon-ws backend) on the
CPU: what its entry refuses before any launch (an InputError naming the argument), its tiles and
what the backend declares. Its numbers are the GPU tests' (tests/gpu/test_attention_tma_gpu.py):
Gluon kernels do not run in the interpreter."""
import pytest
import torch
import triton
import triton.language as tl

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.core.specs import AttentionSpec
from opmap.harness.fixtures.attention import make_paged, make_query
from opmap.kernels.attention import prefill_ws as W
from opmap.kernels.attention.tiles import box_positions, box_row
from opmap.kernels.attention.tma import SMEM_BUDGET

BF = torch.bfloat16


def _args(page=64, dtype=BF, d=128, fp8=False):
    pc = make_paged([130, 9], 2, d, page, dtype=dtype, fp8=fp8)
    q, cu = make_query([130, 9], 8, d, dtype=torch.float32 if dtype == torch.float32 else BF)
    return (q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables), pc


def test_tiles_come_from_config_and_must_fit():
    assert W.tile_config(None, 128) == W.DEFAULTS
    assert W.tile_config({"BLOCK_N": 64, "STAGES": 3}, 128) == {"BLOCK_N": 64, "STAGES": 3, "PINGPONG": 0}
    assert W.tile_config({"PINGPONG": 1}, 128)["PINGPONG"] == 1
    with pytest.raises(InputError, match="config.*PINGPONG=2"):
        W.tile_config({"PINGPONG": 2}, 128)
    # 128-key tiles at three stages: Q and 3 x (K + V) of 32 KB each, over the budget at d = 128
    assert W.smem_bytes({"BLOCK_N": 128, "STAGES": 3}, 128) > SMEM_BUDGET
    with pytest.raises(InputError, match="config.*shared memory"):
        W.tile_config({"STAGES": 3}, 128)
    assert W.tile_config({"STAGES": 3}, 64)["STAGES"] == 3
    with pytest.raises(InputError, match="config.*key 'BLOCK_M'"):
        W.tile_config({"BLOCK_M": 64}, 128)
    with pytest.raises(InputError, match="config.*BLOCK_N=32"):
        W.tile_config({"BLOCK_N": 32}, 128)


def test_entry_refuses_what_the_kernel_cannot_read():
    args, pc = _args()
    # valid inputs on the CPU: refused for the device, after every check of the tensors
    with pytest.raises(InputError, match="q.*device cpu.*sm90"):
        W.prefill(*args, scale=0.1)
    a8, _ = _args(page=8)
    with pytest.raises(InputError, match="k_cache.*page size 8"):
        W.prefill(*a8, scale=0.1)
    a32, _ = _args(d=32)
    with pytest.raises(InputError, match="q.*head_dim 32"):
        W.prefill(*a32, scale=0.1)
    f8, p8 = _args(fp8=True)
    with pytest.raises(InputError, match="k_cache.*bf16/fp16"):
        W.prefill(*f8, scale=0.1, **p8.kw)
    f32, _ = _args(dtype=torch.float32)
    with pytest.raises(InputError, match="k_cache.*bf16/fp16"):
        W.prefill(*f32, scale=0.1)
    q, kc, vc, cu, sl, bt = args
    shifted = torch.zeros(kc.numel() + 4, dtype=BF)[4:].view(kc.shape)  # contiguous, 8 bytes off 16
    with pytest.raises(InputError, match="k_cache.*16-byte aligned"):
        W.prefill(q, shifted, shifted, cu, sl, bt, scale=0.1)
    with pytest.raises(InputError, match="config"):
        W.prefill(*args, scale=0.1, config={"num_warps": 4})
    # the mixed step (chunks on this kernel, one-token rows on the Triton decode) checks the same
    from opmap.kernels.attention.mixed import mixed_ws
    with pytest.raises(InputError, match="q.*device cpu.*sm90"):
        mixed_ws(*args, scale=0.1)
    with pytest.raises(InputError, match="k_cache.*bf16/fp16"):
        mixed_ws(*f32, scale=0.1)


def test_backend_declares_prefill_and_mixed_on_sm90_only():
    b = registry.get("attention", "gluon-ws")
    assert set(b.impl) == {"prefill", "mixed", "make_workspace"}
    sm90 = AttentionSpec(arch="sm90", phase="prefill", num_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                         dtype="bf16", kv_dtype="bf16")
    assert not b.validate(sm90) and not b.validate(sm90.replace(phase="mixed", cuda_graph=True))
    for bad, field in [(dict(phase="decode"), "phase"), (dict(page_size=8), "page_size"),
                       (dict(kv_dtype="fp8"), "kv_dtype"), (dict(head_dim=256), "head_dim"),
                       (dict(dtype="fp32", kv_dtype="fp32"), "dtype"), (dict(arch="sm80"), "arch")]:
        assert b.validate(sm90.replace(**bad)), bad
    # runs nowhere in the interpreter (Gluon), and ranks below triton until its rows are measured
    assert b.available() is not None
    assert b.priority["sm90"] < registry.get("attention", "triton").priority["sm90"]


@triton.jit
def _box_layout_kernel(out_ptr, L, START, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BOX: tl.constexpr):
    """Per column of tile program_id(0) from START: its key position, whether the tile adds it, the
    page index and the page row its box reads it from (tiles.box_row / box_positions, as the
    warp-specialised kernels call them)."""
    t = tl.program_id(0)
    start = START + t * BLOCK_N
    cols = tl.arange(0, BLOCK_N)
    pos, new = box_positions(start, cols, L, BOX)
    j = start + cols - cols % BOX  # the column's box
    pidx = tl.minimum(j // PAGE, (L - 1) // PAGE)
    row = box_row(j, L, pidx, PAGE, BOX) + cols % BOX
    base = out_ptr + t * 4 * BLOCK_N + cols
    tl.store(base, pos)
    tl.store(base + BLOCK_N, new.to(tl.int32))
    tl.store(base + 2 * BLOCK_N, pidx)
    tl.store(base + 3 * BLOCK_N, row)


@pytest.mark.parametrize("page,block_n", [(16, 128), (32, 128), (64, 128), (128, 128), (16, 64), (64, 64),
                                          (128, 64)])
def test_boxes_never_read_past_the_length_and_add_each_key_once(page, block_n):
    """Where the warp-specialised kernels' TMA boxes read (gluon-ws: boxes of min(page, BLOCK_N)
    rows; mla-gluon-ws: one 64-key box a tile ending at a split's end), in the interpreter: over
    every tile of a key range [start, hi) with hi <= L, no box reads a row at or past L (rows
    outside the page read as zeros), each key below hi is added exactly once, and a column the
    tile adds holds the row of its own key."""
    box = min(page, block_n)
    lens = sorted({1, 2, box - 1, box, box + 1, page - 1, page, page + 1, 2 * page + 3, block_n - 1, block_n,
                   block_n + 1, 3 * block_n + box // 2, 300} - {0})
    for L in lens:
        for start in (0, block_n):
            for hi in {L, L - 5, L - box}:
                if hi <= start:
                    continue
                n = -(-(hi - start) // block_n)
                out = torch.zeros(n, 4, block_n, dtype=torch.int32)
                _box_layout_kernel[(n,)](out, L, start, PAGE=page, BLOCK_N=block_n, BOX=box)
                pos, new, pidx, row = (out[:, i].flatten() for i in range(4))
                inside = (row >= 0) & (row < page)
                read = pidx * page + row
                assert bool((read[inside] < L).all()), (L, start, hi)  # nothing past the length
                added = new.bool() & (pos < hi)
                assert sorted(pos[added].tolist()) == list(range(start, hi)), (L, start, hi)
                assert bool((inside[added]).all() and (read[added] == pos[added]).all()), (L, start, hi)
