"""Every class of bad input gives an InputError that names the argument, what was given and what
was expected."""
import pytest
import torch

from opmap.core.contract import InputError, expect, expect_in, expect_same_device, expect_tensor


def _err(fn):
    with pytest.raises(InputError) as e:
        fn()
    return e.value


def test_expect_tensor_each_class():
    x = torch.randn(4, 6)
    e = _err(lambda: expect_tensor("x", [1, 2]))
    assert (e.arg, e.given, e.expected) == ("x", "list", "a torch.Tensor")
    e = _err(lambda: expect_tensor("x", x.half(), dtype=(torch.float32, torch.bfloat16)))
    assert str(e) == "x: got dtype fp16, expected dtype fp32 or bf16"
    e = _err(lambda: expect_tensor("w", x, ndim=3))
    assert str(e) == "w: got 2 dims (4, 6), expected 3 dims"
    e = _err(lambda: expect_tensor("w", x, shape=(4, 7)))
    assert str(e) == "w: got shape (4, 6), expected shape (4, 7)"
    e = _err(lambda: expect_tensor("w", x, shape=(None, 6, None)))
    assert e.expected == "shape (*, 6, *)"
    e = _err(lambda: expect_tensor("q", x, device="meta"))
    assert str(e) == "q: got device cpu, expected device meta"
    e = _err(lambda: expect_tensor("q", x.t(), contiguous=True))
    assert e.arg == "q" and "strides (1, 6)" in e.given
    e = _err(lambda: expect_tensor("q", x[:, ::2], last_dim_contiguous=True))
    assert e.expected == "stride 1 in the last dimension"
    assert expect_tensor("q", x, dtype=torch.float32, ndim=2, shape=(4, None), contiguous=True) is x
    # A last dimension of size 1 has no meaningful stride.
    expect_tensor("q", torch.randn(4, 6)[:, :1], last_dim_contiguous=True)


def test_expect_helpers():
    e = _err(lambda: expect(False, "page_size", 0, "a positive int"))
    assert str(e) == "page_size: got 0, expected a positive int"
    expect(True, "a", 1, "anything")
    e = _err(lambda: expect_in("style", "rot", ("neox", "gptj")))
    assert str(e) == "style: got 'rot', expected one of 'neox', 'gptj'"
    a = torch.zeros(2)
    e = _err(lambda: expect_same_device(a=a, b=None, c=torch.zeros(2, device="meta")))
    assert e.arg == "c" and "same as a" in e.expected
    assert expect_same_device(a=a, b=torch.zeros(3)) == a.device


def test_input_error_is_a_value_error():
    assert issubclass(InputError, ValueError)


def test_trusted_values_skip_only_device_value_checks():
    from opmap.core.contract import trusted_values, values_wanted

    t = torch.zeros(3, dtype=torch.int32)
    with trusted_values():
        assert values_wanted(t)  # CPU values cost no synchronisation: still checked
        with trusted_values():
            pass
        assert values_wanted(t)
    assert values_wanted(t)
    if torch.cuda.is_available():
        g = t.cuda()
        with trusted_values():
            assert not values_wanted(g)
        assert values_wanted(g)


def test_flashinfer_plans_once_per_metadata():
    # The adapter's plan memo (FlashInfer itself is not needed for it): the layers of one step
    # reuse a plan; an in-place rewrite of the metadata (the next step) plans again; each wrapper
    # kind keeps one live plan, since its workspace holds it.
    from opmap.peers.attention.flashinfer import _PLANS, _planned

    for memo in _PLANS.values():
        memo.clear()
    made = []

    def make():
        made.append(object())
        return made[-1]

    sl, bt = torch.tensor([5, 9]), torch.zeros(2, 4, dtype=torch.int32)
    a = _planned("decode", (sl, bt), (2, 32), make)
    assert _planned("decode", (sl, bt), (2, 32), make) is a and len(made) == 1
    assert _planned("decode", (sl, bt), (2, 64), make) is not a  # other arguments
    sl.add_(1)
    b = _planned("decode", (sl, bt), (2, 32), make)
    assert b is not a and len(made) == 3
    p = _planned("prefill", (sl, sl, bt), (2, 32), make)
    assert _planned("decode", (sl, bt), (2, 32), make) is b  # the prefill plan did not evict it
    assert _planned("prefill", (sl, sl, bt), (2, 32), make) is p
    assert len(_PLANS["decode"]) == 1
    for memo in _PLANS.values():
        memo.clear()


def test_inference_tensors_are_checked_every_time_not_remembered():
    """torch.inference_mode tensors keep no version counter: the memo remembers nothing about them
    (an in-place write would go unseen), and an op's value checks still run on them."""
    import opmap
    from opmap.core.contract import TensorMemo
    from opmap.harness.fixtures.attention import make_paged, make_query

    memo = TensorMemo(4)
    with torch.inference_mode():
        t = torch.zeros(3)
        memo.put(("tag", t), True)
        assert memo.get(("tag", t), False) is False and len(memo) == 0
        pc = make_paged([5, 9], 2, 16, 4, dtype=torch.float32)
        q, _ = make_query([1, 1], 4, 16, dtype=torch.float32)
        out = opmap.attention_decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, pc.block_tables, 0.25)
        assert torch.isfinite(out).all()
        bad = pc.block_tables.clone()
        bad[0, 0] = 10 ** 6
        with pytest.raises(InputError, match="block_tables"):
            opmap.attention_decode(q, pc.k_cache, pc.v_cache, pc.seq_lens, bad, 0.25)
