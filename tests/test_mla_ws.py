"""The Gluon warp-specialised MLA decode (kernels/mla/decode_ws.py, the mla-gluon-ws backend) on the
CPU: what its entry refuses before any launch (an InputError naming the argument), its shared
memory and split plan, and what the backend declares. Its numbers are the GPU tests'
(tests/gpu/test_mla_gpu.py): Gluon kernels do not run in the interpreter."""
import pytest
import torch

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.core.specs import AttentionSpec
from opmap.harness.fixtures.mla import make_cache
from opmap.kernels.mla import decode_ws as W

BF = torch.bfloat16


def _inputs(R=512, Dr=64, page=64, dtype=BF, fp8=False, H=128):
    pc = make_cache([70, 3], R, Dr, page, dtype, fp8=fp8, gen=torch.Generator().manual_seed(0))
    qn = torch.randn(2, H, R).to(BF)
    qp = torch.randn(2, H, Dr).to(BF)
    return (qn, qp, pc.cache, pc.seq_lens, pc.block_tables), pc


def test_shared_memory_fits_one_program_an_sm():
    # q's latent part 64 KB, two stages of 72 KB, an 8 KB P buffer: under the sm90 block's 227 KB
    assert W.smem_bytes() == 2 * (64 * 512 + 2 * 64 * 576 + 64 * 64) <= 227 * 1024
    ws = W.make_workspace(4, 128, 512, "cpu")
    assert ws.num_splits >= 1 and ws.split_min == W.SPLIT_MIN
    with pytest.raises(InputError, match="config"):
        W.make_workspace(4, 128, 512, "cpu", config={"BLOCK_N": 32})


def test_entry_refuses_what_the_kernel_cannot_read():
    args, _ = _inputs()
    # valid inputs on the CPU: refused for the device, after every check of the tensors
    with pytest.raises(InputError, match="q_nope.*device cpu.*sm90"):
        W.mla_decode(*args, scale=0.1)
    small, _ = _inputs(R=256, Dr=32)
    with pytest.raises(InputError, match="q_nope.*latent rank 256, rope dim 32"):
        W.mla_decode(*small, scale=0.1)
    p16, _ = _inputs(page=16)
    with pytest.raises(InputError, match="cache.*page size 16"):
        W.mla_decode(*p16, scale=0.1)
    f8, pc8 = _inputs(fp8=True)
    with pytest.raises(InputError, match="cache.*mla-gluon-fp8"):
        W.mla_decode(*f8, scale=0.1, kv_scale=pc8.kv_scale)
    qn, qp, cache, sl, bt = args
    shifted = torch.zeros(cache.numel() + 4, dtype=BF)[4:].view(cache.shape)  # 8 bytes off 16
    with pytest.raises(InputError, match="cache.*16-byte aligned"):
        W.mla_decode(qn, qp, shifted, sl, bt, scale=0.1)
    with pytest.raises(InputError, match="config"):
        W.mla_decode(*args, scale=0.1, config={"num_stages": 3})


def test_backend_declares_decode_of_16_bit_caches_from_64_heads_on_sm90():
    b = registry.get("attention", "mla-gluon-ws")
    assert set(b.impl) == {"mla_decode", "make_workspace"}
    spec = AttentionSpec(arch="sm90", kind="mla", phase="decode", num_heads=128, num_kv_heads=1, head_dim=576,
                         head_dim_v=512, page_size=64, dtype="bf16", kv_dtype="bf16", cuda_graph=True)
    assert not b.validate(spec)
    for bad in (dict(num_heads=16), dict(kv_dtype="fp8"), dict(page_size=16), dict(phase="prefill"),
                dict(head_dim=320, head_dim_v=256), dict(sparse=True), dict(arch="sm80"), dict(batch_invariant=True)):
        assert b.validate(spec.replace(**bad)), bad
    assert b.available() is not None  # the interpreter: Gluon does not run there
    assert b.priority["sm90"] < registry.get("attention", "mla-triton").priority["sm90"]
