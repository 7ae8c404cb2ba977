"""Bad input to the attention entries is a clear InputError naming the argument, raised before
any kernel launches; the registry declares the same limits so the selector rejects them first."""
import pytest
import torch

from opmap.core import registry

from opmap.core import specs
from opmap.core.contract import InputError
from opmap.kernels.attention import decode as D
from opmap.kernels.attention import prefill as P
from opmap.ops.attention import reference as R
from opmap.api.custom_ops import attention_decode, attention_prefill
from opmap.harness.fixtures.attention import make_paged, make_query


def _args(seq=(5, 20), ql=(5, 3), hq=8, hk=2, d=64, page=16, dtype=torch.float16, **kw):
    pc = make_paged(list(seq), hk, d, page, dtype=dtype, **kw)
    q, cu = make_query(list(ql), hq, d, dtype=dtype)
    return q, pc, cu


ENTRIES = ["triton-prefill", "triton-decode", "reference-prefill"]


def _call(entry, q, pc, cu, **over):
    a = dict(k_cache=pc.k_cache, v_cache=pc.v_cache, seq_lens=pc.seq_lens, block_tables=pc.block_tables,
             k_scale=pc.k_scale, v_scale=pc.v_scale)
    a.update(over)
    if entry.endswith("decode"):
        B = a["seq_lens"].shape[0]
        return D.decode(q[:B], a["k_cache"], a["v_cache"], a["seq_lens"], a["block_tables"], scale=0.1,
                        k_scale=a["k_scale"], v_scale=a["v_scale"])
    fn = P.prefill if entry.startswith("triton") else R.prefill
    return fn(q, a["k_cache"], a["v_cache"], over.get("cu", cu), a["seq_lens"], a["block_tables"], scale=0.1,
              k_scale=a["k_scale"], v_scale=a["v_scale"])


@pytest.mark.parametrize("entry", ENTRIES)
def test_metadata_errors(entry):
    q, pc, cu = _args()
    P_ = pc.k_cache.shape[0]
    bt = pc.block_tables.clone()
    bt[1, 0] = P_  # one past the last page
    with pytest.raises(InputError, match="block_tables"):
        _call(entry, q, pc, cu, block_tables=bt)
    cap = pc.block_tables.shape[1] * 16
    with pytest.raises(InputError, match="seq_lens"):
        _call(entry, q, pc, cu, seq_lens=torch.tensor([5, cap + 1], dtype=torch.int32))
    with pytest.raises(InputError, match="seq_lens"):
        _call(entry, q, pc, cu, seq_lens=pc.seq_lens.long())
    with pytest.raises(InputError, match="block_tables"):
        _call(entry, q, pc, cu, block_tables=pc.block_tables[:1])
    with pytest.raises(InputError, match="seq_lens"):
        _call(entry, q, pc, cu, seq_lens=pc.seq_lens.to("meta"))


@pytest.mark.parametrize("entry", ENTRIES)
def test_shape_and_dtype_errors(entry):
    q, pc, cu = _args()
    with pytest.raises(InputError, match="^q:.*multiple of num_kv_heads"):
        _call(entry, q[:, :7], pc, cu)
    with pytest.raises(InputError, match="k_cache.*dtype"):
        _call(entry, q.float(), pc, cu)
    with pytest.raises(InputError, match="v_cache"):
        _call(entry, q, pc, cu, v_cache=pc.v_cache.float())
    with pytest.raises(InputError, match="k_scale"):  # fp16 cache takes no scale
        _call(entry, q, pc, cu, k_scale=torch.ones(2), v_scale=torch.ones(2))
    f8 = _args(fp8=True)[1]
    with pytest.raises(InputError, match="k_scale"):
        _call(entry, q, f8, cu, k_scale=None)
    with pytest.raises(InputError, match="k_scale"):
        _call(entry, q, f8, cu, k_scale=torch.ones(3))


def test_prefill_query_errors():
    q, pc, cu = _args()
    for fn in (P.prefill, R.prefill):
        with pytest.raises(InputError, match="cu_seqlens_q"):
            fn(q, pc.k_cache, pc.v_cache, torch.tensor([0, 5, 9], dtype=torch.int32), pc.seq_lens, pc.block_tables,
               scale=0.1)
        with pytest.raises(InputError, match="seq_lens"):  # 6 new tokens but the sequence holds 5
            fn(torch.cat([q, q[:1]]), pc.k_cache, pc.v_cache, torch.tensor([0, 6, 9], dtype=torch.int32),
               pc.seq_lens, pc.block_tables, scale=0.1)
        with pytest.raises(InputError, match="scale"):
            fn(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, scale=-1.0)
        with pytest.raises(InputError, match="window"):
            fn(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, scale=0.1, window=0)


@pytest.mark.parametrize("d,page,match", [(80, 16, "head_dim 80"), (64, 3, "page_size 3"), (48, 16, "head_dim 48")])
def test_triton_limits_are_errors_and_declared(d, page, match):
    q, pc, cu = _args(seq=(5,), ql=(5,), d=d, page=page)
    with pytest.raises(InputError, match=match):
        P.prefill(q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, scale=0.1)
    with pytest.raises(InputError, match=match):
        D.decode(q[:1], pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.1)
    spec = specs.AttentionSpec(arch="sm90", head_dim=d, page_size=page)
    assert registry.get("attention", "triton").validate(spec)
    assert not registry.get("attention", "triton").validate(specs.AttentionSpec(arch="sm90"))


def test_decode_workspace_errors():
    q, pc, cu = _args(seq=(40, 300), ql=(1, 1))
    small = D.make_workspace(1, 8, 64, device="cpu")
    with pytest.raises(InputError, match="workspace"):
        D.decode(q[:2], pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.1, workspace=small)
    fixed = D.make_workspace(2, 8, 64, device="cpu", batch_invariant=True, split_tokens=64, max_seq_len=64)
    with pytest.raises(InputError, match="workspace"):
        D.decode(q[:2], pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.1, workspace=fixed)
    with pytest.raises(InputError, match="max_seq_len"):
        D.make_workspace(2, 8, 64, device="cpu", batch_invariant=True)


def test_custom_ops_opcheck():
    q, pc, cu = _args(seq=(3, 17), ql=(3, 1), hq=4, hk=2)
    torch.library.opcheck(attention_prefill, (q, pc.k_cache, pc.v_cache, cu, pc.seq_lens, pc.block_tables, 0.125),
                          dict(window=8, soft_cap=None))
    torch.library.opcheck(attention_decode, (q[:2], pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, 0.125))
    out, lse = attention_decode(q[:2], pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, 0.125)
    ref, rl = R.decode(q[:2], pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, scale=0.125, return_lse=True)
    assert torch.allclose(out.float(), ref.float(), atol=2e-3) and torch.allclose(lse, rl, atol=1e-4)
