"""Bad input, as a new user gives it, is an InputError naming the argument (public ops through
``opmap.*``) or that request's error (engine requests through ``LLM.generate``); the other
requests of a batch are not harmed."""
import math

import pytest
import torch

import opmap
from opmap.core.contract import InputError

# The Triton interpreter's own NumPy noise (-inf - -inf in masked lanes of the sampler).
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")]


def _named(arg, fn, *a, **kw):
    with pytest.raises(InputError) as e:
        fn(*a, **kw)
    assert e.value.arg == arg, f"{e.value} names {e.value.arg!r}, not {arg!r}"
    assert "\n" not in str(e.value)
    return str(e.value)


# ---- dense ops ----------------------------------------------------------------------------------

X, W = torch.randn(4, 8), torch.ones(8)


def test_rmsnorm_of_a_0d_tensor():
    _named("x", opmap.rmsnorm, torch.tensor(1.0), W)
    _named("x", opmap.add_rmsnorm, torch.tensor(1.0), torch.tensor(1.0), W)
    _named("weight", opmap.rmsnorm, X, torch.tensor(1.0))


def test_rmsnorm_of_float64_input_or_weight():
    assert "float64" in _named("x", opmap.rmsnorm, X.double(), W)
    assert "float64" in _named("x", opmap.add_rmsnorm, X.double(), X.double(), W)
    assert "float64" in _named("qk", opmap.qk_rmsnorm, torch.randn(2, 3, 8).double(), W, W, 1)
    msg = _named("weight", opmap.rmsnorm, X, W.double())
    assert msg.count("fp32") == 1, msg  # the allowed dtypes are named once each
    _named("x", opmap.rmsnorm, torch.randn(3, 0), torch.ones(0))  # an empty hidden dim
    assert torch.equal(opmap.rmsnorm(X[0], W), opmap.rmsnorm(X, W)[0])  # 1-d x is [H]: fine


def test_other_dense_ops_of_0d_or_float64_tensors():
    _named("x", opmap.silu_mul, torch.tensor(1.0))
    _named("x", opmap.gelu_tanh_mul, torch.randn(3, 8).double())
    _named("q", opmap.rope, torch.randn(3, 2, 8).double(), torch.randn(3, 2, 8), torch.arange(3), torch.randn(16, 8))
    _named("w", opmap.linear, torch.randn(3, 8), torch.randn(4, 8).double())  # was GemmSpec's ValueError
    _named("w", opmap.linear, torch.randn(3, 8), torch.ones(4, 8, dtype=torch.int32))
    _named("x", opmap.linear, torch.randn(3, 8).double(), torch.randn(4, 8).double())
    _named("k_cache", opmap.kv_append, torch.randn(3, 2, 16), torch.randn(3, 2, 16), torch.tensor(1.0),
           torch.randn(4, 16, 2, 16), torch.arange(3))


def test_attention_of_a_float64_query_or_cache():
    kc = torch.randn(4, 16, 2, 16)
    q = torch.randn(2, 4, 16)
    sl, bt = torch.tensor([5, 7], dtype=torch.int32), torch.tensor([[0], [1]], dtype=torch.int32)
    _named("q", opmap.attention_decode, q.double(), kc, kc, sl, bt, 0.25)  # was AttentionSpec's ValueError
    _named("k_cache", opmap.attention_decode, q, kc.double(), kc.double(), sl, bt, 0.25)
    _named("q_nope", opmap.mla_decode, torch.randn(2, 4, 16).double(), torch.randn(2, 4, 8).double(),
           torch.randn(4, 16, 24), sl, bt, 0.25)


@pytest.mark.parametrize("top_k", [0, -1, 9, True, 1.5])
def test_moe_top_k_outside_the_experts(top_k):
    rl = torch.randn(5, 8)
    _named("top_k", opmap.moe_route, rl, top_k)  # 0 was MoESpec's ValueError, 9 a selector error
    _named("top_k", opmap.moe, torch.randn(5, 8), rl, torch.randn(8, 8, 8), torch.randn(8, 8, 4), top_k)


def test_moe_of_float64_tensors():
    rl = torch.randn(5, 8)
    _named("router_logits", opmap.moe_route, rl.double(), 2)
    _named("w13", opmap.moe, torch.randn(5, 8), rl, torch.randn(8, 8, 8).double(), torch.randn(8, 8, 4).double(), 2)


# ---- sampling: every per-row parameter checked, for every backend -------------------------------

B, V = 3, 64


def _rows(**bad):
    """Valid per-row parameters with row 1 of the named ones replaced."""
    p = dict(temperature=torch.full((B,), 0.7), top_k=torch.full((B,), 5, dtype=torch.int32),
             top_p=torch.full((B,), 0.9), min_p=torch.full((B,), 0.05),
             seeds=torch.arange(B, dtype=torch.int64), positions=torch.arange(B, dtype=torch.int64))
    for name, v in bad.items():
        p[name][1] = v
    return p


BAD_ROWS = [("temperature", -1.0), ("temperature", math.nan), ("temperature", math.inf), ("top_k", -5),
            ("top_p", 5.0), ("top_p", math.nan), ("top_p", 0.0), ("top_p", -0.5), ("min_p", -2.0),
            ("min_p", 1.5), ("min_p", math.nan)]


def _sample_launchers():
    from test_fuzz_harness import launchers

    return launchers("sampling", "sample")


@pytest.mark.parametrize("name,value", BAD_ROWS)
def test_sample_refuses_a_bad_row_parameter(name, value):
    logits = torch.randn(B, V)
    p = _rows(**{name: value})
    args = (logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"], p["seeds"], p["positions"])
    msg = _named(name, opmap.sample, *args)
    assert f"{name}[1]=" in msg
    from opmap.core import registry

    for b in _sample_launchers():  # the shared check: every backend, peers included
        _named(name, registry.get("sampling", b).fn("sample"), *args)


def test_sample_launchers_are_the_ones_expected_on_this_machine():
    assert {"reference", "triton", "torch-sort", "torch-race"} <= set(_sample_launchers())


@pytest.mark.parametrize("name,value", [("repetition", 0.0), ("repetition", -1.0), ("repetition", math.nan),
                                        ("frequency", math.inf), ("presence", math.nan)])
def test_penalties_refuse_a_bad_row_parameter(name, value):
    rows = dict(repetition=torch.ones(B), frequency=torch.zeros(B), presence=torch.zeros(B))
    rows[name][1] = value
    for backend in ("reference", "triton"):
        _named(name, opmap.apply_penalties, torch.randn(B, V), torch.zeros(B, V, dtype=torch.bool),
               torch.zeros(B, V, dtype=torch.int32), rows["repetition"], rows["frequency"], rows["presence"],
               backend=backend)


def test_temperature_processor_refuses_a_negative_temperature():
    for backend in ("reference", "triton"):
        _named("temperature", opmap.apply_temperature, torch.randn(B, V), torch.tensor([1.0, -1.0, 0.0]),
               backend=backend)


def test_temperature_processor_leaves_greedy_rows_alone():
    """A temperature below the smallest normal fp32 (0 included) is greedy: its row is left as it is
    by both backends (the GPU flushes a subnormal one to 0)."""
    x = torch.randn(B, V)
    t = torch.tensor([0.0, 1e-40, 0.5])
    for backend in ("reference", "triton"):
        y = x.clone()
        opmap.apply_temperature(y, t, backend=backend)
        assert torch.equal(y[:2], x[:2]) and torch.allclose(y[2], x[2] / 0.5)


def test_value_checks_can_be_turned_off(monkeypatch):
    """OPMAP_CHECK_VALUES=0 skips the data-dependent checks (as for attention's metadata): a
    trusted caller's own tensors are not read back."""
    monkeypatch.setenv("OPMAP_CHECK_VALUES", "0")
    p = _rows(top_k=-5)
    opmap.sample(torch.randn(B, V), p["temperature"], p["top_k"], p["top_p"], p["min_p"], p["seeds"],
                 p["positions"], backend="reference")


# ---- engine requests: SamplingParams changed after construction ---------------------------------

MUTATIONS = [("top_p", math.nan), ("max_tokens", 0), ("max_tokens", -3), ("temperature", math.nan),
             ("temperature", -1.0), ("top_k", -7), ("seed", -5), ("stop", [""]), ("repetition_penalty", 0.0),
             ("logprobs", -1), ("stop", 5), ("stop_token_ids", [-1]),
             # valid as Python floats, not as the fp32 tensors the sampler reads
             ("temperature", 1e39), ("top_p", 1e-300), ("repetition_penalty", 1e-40), ("presence_penalty", -1e39)]


@pytest.fixture(scope="module")
def llm():
    from opmap.engine.llm import LLM

    return LLM("tiny-llama3", max_num_seqs=4)  # random weights, byte tokenizer


@pytest.mark.parametrize("field,value", MUTATIONS)
def test_a_field_changed_after_construction_fails_that_request_only(llm, field, value):
    from opmap.engine.params import SamplingParams

    good = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = llm.generate([[4, 5, 6]], good)[0].token_ids
    p = SamplingParams(max_tokens=6, temperature=0.8, seed=3)
    setattr(p, field, value)
    outs = llm.generate([[1, 2, 3], [4, 5, 6], "xyz"], [p, good, p])
    for o in (outs[0], outs[2]):
        assert o.finish_reason == "error" and o.token_ids == []
        assert o.error.startswith(f"{field}: got "), o.error
    assert outs[1].finish_reason == "length" and outs[1].error is None and outs[1].token_ids == want


def test_a_request_keeps_the_params_it_was_made_with(llm):
    """A request validates a copy when it is made: a later change of the caller's object reaches
    no queued request."""
    from opmap.engine.params import SamplingParams

    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    _, live = llm.add_requests([[1, 2, 3]], [p])
    p.max_tokens = 0
    p.temperature = math.nan
    assert live[0].params.max_tokens == 3 and live[0].params is not p
    done = []
    while llm.scheduler.has_unfinished():
        done += llm.step()
    done += llm.drain()
    assert [len(s.output_token_ids) for s in done] == [3]


def test_a_dict_of_params_is_checked_too(llm):
    outs = llm.generate([[1, 2, 3], [4, 5]], [{"max_tokens": 2, "top_k": -1}, {"max_tokens": 2}])
    assert outs[0].finish_reason == "error" and outs[0].error.startswith("top_k: got -1")
    assert outs[1].finish_reason == "length"


@pytest.mark.parametrize("field,value", [("stop", 5), ("stop", [""]), ("stop", ["a", 3]), ("stop_token_ids", 7),
                                         ("stop_token_ids", [1, -2])])
def test_stop_fields_of_the_wrong_kind_are_named_at_construction(field, value):
    from opmap.engine.params import SamplingParams

    _named(field, SamplingParams, **{field: value})  # was a TypeError from list() for a bare int
