"""Structured output end to end on the CPU: GPT-2's real byte-level BPE vocabulary, a random-weight
tiny model, a mixed batch (JSON Schemas, free JSON, EBNF, regex, unconstrained rows), the ops
pipeline (processors -> bitmask -> sample -> stop). Every constrained generation must parse and
validate (jsonschema); failures end one request with an error state while the batch goes on."""
import json
import re

import jsonschema
import pytest
import torch

xgrammar = pytest.importorskip("xgrammar")

from opmap.ops.grammar import reference as GR  # noqa: E402
from opmap.engine.structured import BitmaskBuffer, StructuredOutput, apply_bitmask  # noqa: E402
from opmap.harness.fixtures.vocab import GPT2_EOS, gpt2_tokenizer_json, load_tokenizer  # noqa: E402
from opmap.engine.sampling_tensors import SamplingTensors  # noqa: E402
from opmap.engine.params import SamplingParams  # noqa: E402
from opmap.engine.stop import StopChecker  # noqa: E402

VOCAB = 50304  # the model's padded vocabulary (GPT-2 has 50257 tokens): rows are wider than the tokenizer

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 1000, "maximum": 9999},
                                                     "city": {"enum": ["Paris", "Lyon", "Nice"]}},
                    "required": ["zip", "city"], "additionalProperties": False}},
     "required": ["name", "address"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 50}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3}},
     "required": ["kind", "ok", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 10},
                                      "level": {"enum": [1, 2, 3]}},
     "required": ["score", "level"], "additionalProperties": False},
]
EBNF = 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [a-z] | [0-9] [0-9]?\n'
EBNF_RE = re.compile(r"\((?:[a-z]|[0-9]{1,2})(?:,(?:[a-z]|[0-9]{1,2})){0,2}\)")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(gpt2_tokenizer_json(tmp_path_factory.mktemp("gpt2")))


@pytest.fixture(scope="module")
def so(tok):
    return StructuredOutput(tok, vocab_size=VOCAB, stop_token_ids=[GPT2_EOS])


class TinyModel:
    """Random weights: embedding [V, 16] -> tanh -> LM head [16, V]; logits of the last token."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(VOCAB, 16, generator=g)
        self.head = torch.randn(16, VOCAB, generator=g) * 0.5

    def __call__(self, last_ids):
        return torch.tanh(self.emb[last_ids]) @ self.head


def generate(tok, so, params, seed, max_steps=80):
    model = TinyModel(seed)
    states = [so.request(p) for p in params]
    for st in states:
        if st is not None:
            st.wait(60)
    stops = [StopChecker(p, {GPT2_EOS}, tok.decode) for p in params]
    st_t = SamplingTensors.build(params, vocab=VOCAB)
    buf = BitmaskBuffer(len(params), VOCAB)
    last = torch.full((len(params),), GPT2_EOS)
    texts = [""] * len(params)
    for step in range(max_steps):
        live = [i for i, s in enumerate(stops) if not s.finished]
        if not live:
            break
        logits = model(last)
        rows = buf.fill([st if not stops[i].finished else None for i, st in enumerate(states)])
        for i, st in enumerate(states):
            if st is not None and st.failed and not stops[i].finished:
                stops[i].fail(st.error)
        bm, r = buf.upload(len(params), rows)
        unmasked = logits.clone()
        apply_bitmask(logits, bm, r)
        free = [i for i in range(len(params)) if i not in rows]
        assert torch.equal(logits[free], unmasked[free])  # rows without a grammar are untouched
        # Exact draws by Gumbel-max with a fixed generator (the sampler's statistics are tested
        # elsewhere; its fp64 reference would dominate this test's time on a 2-core machine).
        g = torch.Generator().manual_seed(1000 * seed + step)
        noise = -torch.log(-torch.log(torch.rand(logits.shape, generator=g).clamp(1e-12, 1 - 1e-7)))
        ids = torch.argmax(logits / st_t.temperature[:, None] + noise, -1)
        for i in live:
            if stops[i].finished:
                continue
            t = int(ids[i])
            term = False
            if states[i] is not None:
                if not states[i].accept(t):
                    stops[i].fail(states[i].error)
                    continue
                term = states[i].terminated
            out = stops[i].step(t, grammar_terminated=term)
            texts[i] += out.text
        last = ids
    return texts, stops, states


def test_mixed_batch_all_generations_valid(tok, so):
    params = ([SamplingParams(json_schema=s, temperature=1.0, seed=10 + i, max_tokens=64) for i, s in enumerate(SCHEMAS)]
              + [SamplingParams(json_object=True, temperature=0.7, seed=3, max_tokens=40),
                 SamplingParams(grammar=EBNF, temperature=1.0, seed=4, max_tokens=40),
                 SamplingParams(regex=r"[A-Z][a-z]{2,5} [0-9]{2}", temperature=1.0, seed=5, max_tokens=40),
                 SamplingParams(temperature=1.0, seed=6, max_tokens=12)])
    for rep in range(3):
        texts, stops, _ = generate(tok, so, params, seed=rep, max_steps=64)
        for i, s in enumerate(SCHEMAS):
            assert stops[i].reason == "eos", (rep, i, stops[i].reason, texts[i])
            jsonschema.validate(json.loads(texts[i]), s)
        if stops[4].reason == "eos":  # free JSON has no length bound: a cut one cannot parse
            json.loads(texts[4])
        else:
            assert stops[4].reason == "length" and texts[4][:1] in "[{"
        assert EBNF_RE.fullmatch(texts[5]), texts[5]
        assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", texts[6]), texts[6]
        assert stops[7].reason in ("length", "eos")


def test_compile_cache_is_shared_and_keyed_by_grammar(so):
    a = so.compile_async("json_schema", SCHEMAS[0])
    b = so.compile_async("json_schema", json.dumps(SCHEMAS[0]))  # same schema, other spelling
    c = so.compile_async("json_schema", SCHEMAS[1])
    assert a is b and a is not c


def test_compile_failure_is_a_request_error_and_the_batch_goes_on(tok, so):
    params = [SamplingParams(regex="(unclosed", seed=1, max_tokens=10),
              SamplingParams(json_schema=SCHEMAS[3], seed=2, max_tokens=60)]
    texts, stops, states = generate(tok, so, params, seed=0)
    assert states[0].failed and "compile failed" in states[0].error
    assert stops[0].reason == "error"
    assert stops[1].reason == "eos"
    jsonschema.validate(json.loads(texts[1]), SCHEMAS[3])


def test_rejected_token_and_termination_are_handled(so):
    st = so.request(SamplingParams(regex="ab"))
    assert st.wait(60)
    bm = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    assert st.fill(bm, 0)
    allowed = GR.unpack_bitmask(bm, VOCAB)[0]
    bad = int((~allowed).nonzero()[0])
    assert not st.accept(bad) and st.failed and "rejected" in st.error
    st2 = so.request(SamplingParams(regex="a"))
    assert st2.wait(60) and st2.fill(bm, 0)
    assert st2.accept(int(GR.unpack_bitmask(bm, VOCAB)[0].nonzero()[0])) and not st2.terminated
    assert st2.fill(bm, 0) and GR.unpack_bitmask(bm, VOCAB)[0].nonzero().flatten().tolist() == [GPT2_EOS]
    assert st2.accept(GPT2_EOS) and st2.terminated
    assert not st2.fill(bm, 0) and "after the grammar terminated" in st2.error


def test_grammar_leaving_no_token_is_a_failure_state():
    """A vocabulary that cannot spell what the grammar needs: the mask is empty."""
    from tokenizers import Tokenizer, models

    tiny = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "</s>": 2}, merges=[]))
    st = StructuredOutput(tiny, vocab_size=3, stop_token_ids=[2]).request(SamplingParams(regex="c"))
    assert st.wait(60)
    bm = torch.zeros(1, 1, dtype=torch.int32)
    assert not st.fill(bm, 0) and st.failed and st.error == "grammar leaves no allowed token"
    buf = BitmaskBuffer(2, 3)
    assert buf.fill([st, None]) == []  # the failed row is not masked; its request ends with the error
