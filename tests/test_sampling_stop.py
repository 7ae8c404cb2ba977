"""Stop handling: EOS, stop ids, stop strings (never half-emitted), max tokens, grammar
termination, errors; and SamplingParams / SamplingTensors validation (each error names the field)."""
import math

import pytest
import torch

from opmap.core.contract import InputError
from opmap.harness.fixtures.vocab import GPT2_EOS, gpt2_tokenizer_json, load_tokenizer
from opmap.engine.sampling_tensors import SamplingTensors
from opmap.engine.params import SamplingParams
from opmap.engine.stop import StopChecker


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(gpt2_tokenizer_json(tmp_path_factory.mktemp("gpt2")))


def run(tok, text, **kw):
    sc = StopChecker(SamplingParams(**kw), {GPT2_EOS}, tok.decode)
    pieces, out = [], None
    for t in tok.encode(text).ids + [GPT2_EOS]:
        out = sc.step(t)
        pieces.append(out.text)
        if out.finished:
            break
    return "".join(pieces), out, sc


def test_eos_and_max_tokens(tok):
    text, out, sc = run(tok, "Hello world, how are you?", max_tokens=100)
    assert out.reason == "eos" and text == "Hello world, how are you?" and sc.token_ids[-1] == GPT2_EOS
    text, out, _ = run(tok, "Hello world, how are you?", max_tokens=3)
    assert out.reason == "length" and text == tok.decode(tok.encode("Hello world, how are you?").ids[:3])
    sc = StopChecker(SamplingParams(max_tokens=5, ignore_eos=True), {GPT2_EOS}, tok.decode)
    outs = [sc.step(t) for t in tok.encode("Hi there").ids + [GPT2_EOS] * 3]
    assert [o.finished for o in outs] == [False] * 4 + [True] and outs[-1].reason == "length"


def test_stop_token_ids(tok):
    ids = tok.encode("one two three four").ids
    text, out, _ = run(tok, "one two three four", stop_token_ids=[ids[2]])
    assert out.reason == "stop_token" and out.stop == ids[2] and text == "one two"


@pytest.mark.parametrize("stop,want", [("three", "one two "), (" th", "one two"), ("ee fo", "one two thr"),
                                        ("our", "one two three f"), ("zzz", "one two three four")])
def test_stop_strings_are_never_half_emitted(tok, stop, want):
    sc = StopChecker(SamplingParams(stop=[stop, "never"]), {GPT2_EOS}, tok.decode)
    emitted = ""
    for t in tok.encode("one two three four").ids + [GPT2_EOS]:
        out = sc.step(t)
        emitted += out.text
        # no emitted text ever contains the stop string or ends inside it
        assert stop not in emitted
        if out.finished:
            break
    assert emitted == want
    assert out.reason == ("stop" if stop != "zzz" else "eos")


def test_multibyte_characters_come_out_whole(tok):
    text, out, _ = run(tok, "héllo wörld 你好", max_tokens=50)
    assert text == "héllo wörld 你好" and "\ufffd" not in text


def test_grammar_termination_and_error(tok):
    sc = StopChecker(SamplingParams(), {GPT2_EOS}, tok.decode)
    sc.step(tok.encode("{}").ids[0])
    out = sc.step(GPT2_EOS, grammar_terminated=True)
    assert out.reason == "eos"  # the stop token that terminates the grammar is the EOS
    sc = StopChecker(SamplingParams(ignore_eos=True), {GPT2_EOS}, tok.decode)
    out = sc.step(tok.encode("hello").ids[0], grammar_terminated=True)
    assert out.finished and out.reason == "grammar" and out.text == "hello"
    sc = StopChecker(SamplingParams(), {GPT2_EOS}, tok.decode)
    out = sc.fail("invalid logits (NaN)")
    assert out.reason == "error" and out.error == "invalid logits (NaN)"
    with pytest.raises(RuntimeError):
        sc.step(5)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("top_p", 0.0), ("top_p", 1.5),
    ("top_p", math.nan), ("top_k", -1), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.1), ("max_tokens", 0),
    ("repetition_penalty", 0.0), ("frequency_penalty", math.inf), ("presence_penalty", math.nan), ("seed", -1),
    ("stop", [""]), ("stop_token_ids", [-3]), ("logprobs", -1), ("json_schema", 5), ("grammar", ""),
])
def test_params_reject_out_of_range_naming_the_field(field, value):
    with pytest.raises(InputError, match=f"^{field}"):
        SamplingParams(**{field: value})


def test_params_one_constraint_and_tensors():
    with pytest.raises(InputError, match="regex"):
        SamplingParams(json_schema={"type": "object"}, regex="a+")
    ps = [SamplingParams(temperature=0.0), SamplingParams(top_k=500, top_p=0.9, seed=7, stop="x"),
          SamplingParams(frequency_penalty=0.5, json_object=True)]
    assert ps[1].stop == ["x"] and ps[2].structured == ("json", None) and ps[0].greedy
    st = SamplingTensors.build(ps, vocab=100)
    assert st.top_k.tolist() == [0, 0, 0]  # top_k >= vocab is off
    assert st.seeds[1] == 7 and st.any_penalties and not st.all_greedy and st.any_filters
    assert st.temperature.dtype == torch.float32 and st.seeds.dtype == torch.int64
    st2 = SamplingTensors.build([SamplingParams(seed=1)] * 3, vocab=100)
    st.copy_from(st2)
    assert st.seeds.tolist() == [1, 1, 1] and not st.any_penalties
    with pytest.raises(InputError, match="^params"):
        SamplingTensors.build([], vocab=10)
