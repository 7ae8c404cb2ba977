"""Decode one step ahead (EngineConfig.async_decode, LLM.step): the tokens, texts, finish reasons,
logprobs and errors are those of lockstep decoding, for every feature the sampler pipeline has
(greedy, seeded sampling, penalties, logprobs, stop tokens and strings, EOS, grammars), with
more requests than sequence slots, under preemption, and at max_model_len; and the run-ahead
path is the one that ran."""
import json

import pytest
import torch

from opmap.engine.llm import PLACEHOLDER, LLM
from opmap.engine.params import SamplingParams

from test_engine_util import random_prompts, single_thread  # noqa: F401


def _outs(llm, prompts, params):
    outs = llm.generate(prompts, params)
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.error,
             [(lp["token"], lp["top"]) for lp in o.logprobs]) for o in outs]


def _both(prompts, params, **kw):
    got = {}
    for on in (False, True):
        llm = LLM("tiny-llama3", async_decode=on, **kw)
        got[on] = (_outs(llm, prompts, params), llm)
    return got


def _mixed_params(n):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    kinds = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0.9, top_k=20, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4,
                       presence_penalty=0.2, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.0, seed=9),  # may stop at EOS any time
        SamplingParams(max_tokens=25, temperature=0.0, stop=["<|3"]),  # a stop string (ids >= 256 print as <|id|>)
        SamplingParams(max_tokens=40, temperature=0.0, json_schema=json.dumps(schema)),
        SamplingParams(max_tokens=12, temperature=1.0, seed=11, stop_token_ids=list(range(300, 420))),
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


def test_run_ahead_equals_lockstep_all_features(single_thread):
    prompts = random_prompts(256, (5, 40, 77, 16, 33, 8, 21, 50, 3, 64, 12), seed=2)
    params = _mixed_params(len(prompts))
    got = _both(prompts, params, max_num_seqs=4, max_num_batched_tokens=64)  # requests wait for slots
    assert got[True][0] == got[False][0]
    assert got[True][1].ahead_steps > 10 and got[False][1].ahead_steps == 0
    stops = {type(r[3]).__name__ for r in got[True][0] if r[2] == "stop"}
    assert stops == {"str", "int"}, stops  # stop strings / grammar, and stop token ids, all ended requests


def test_run_ahead_under_preemption_and_at_max_model_len(single_thread):
    prompts = random_prompts(256, (30, 31, 29, 60), seed=4)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)]  # ends at max_model_len
    got = _both(prompts, params, max_num_seqs=4, num_pages=12, page_size=16, max_model_len=96)
    assert got[True][0] == got[False][0]
    assert got[True][1].stats.preemptions > 0 and got[True][1].ahead_steps > 0
    assert got[True][0][3][2] == "length" and len(got[True][0][3][0]) == 96 - 60


def test_no_placeholder_escapes_and_engine_reusable(single_thread):
    llm = LLM("tiny-llama3", max_num_seqs=3)
    prompts = random_prompts(256, (4, 9, 13), seed=7)
    for _ in range(2):  # the second call starts from the state the first one left
        outs = llm.generate(prompts, SamplingParams(max_tokens=1 + 7, temperature=1.0, seed=1))
        assert all(PLACEHOLDER not in o.token_ids and len(o.token_ids) <= 8 for o in outs)
        assert llm._pending is None and not llm.scheduler.has_unfinished()
    llm.bm.check_invariants()
    assert llm.bm.num_free_blocks == llm.bm.num_blocks


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_shortest_outputs(max_tokens, single_thread):
    prompts = random_prompts(256, (6, 11), seed=8)
    got = _both(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), max_num_seqs=2)
    assert got[True][0] == got[False][0]
    assert all(len(r[0]) == max_tokens for r in got[True][0])


def _random_params(rng, i):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}}},
              "required": ["a"]}
    kw = dict(max_tokens=rng.randint(1, 30), seed=i, temperature=rng.choice([0.0, 0.7, 1.3]))
    if rng.random() < 0.5:
        kw["top_k"] = rng.choice([0, 1, 5, 50])
    if rng.random() < 0.5:
        kw["top_p"] = rng.choice([1.0, 0.9, 0.3])
    if rng.random() < 0.3:
        kw["min_p"] = rng.choice([0.0, 0.05, 0.5])
    if rng.random() < 0.3:
        kw.update(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1)
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 1, 5])
    if rng.random() < 0.3:
        kw["stop"] = ["<|3", "a"]
    if rng.random() < 0.3:
        kw["stop_token_ids"] = list(range(300, 330))
    kw["ignore_eos"] = rng.random() < 0.3
    r = rng.random()
    if r < 0.15:
        kw["json_schema"] = json.dumps(schema)
    elif r < 0.25:
        kw["regex"] = "[a-z]{3,8}"
    elif r < 0.3:
        kw["json_object"] = True
    return SamplingParams(**kw)


def test_random_feature_mixes_under_preemption(single_thread):
    """30 requests, each a random mix of every sampler feature (grammars, penalties, logprobs,
    filters, stops), 6 slots and 16 pages so that requests wait and get preempted: no request
    fails, run-ahead equals lockstep, and every page comes back. (Penalties and a grammar in one
    batch used to crash the sampler.)"""
    import random

    rng = random.Random(0)
    prompts = random_prompts(256, [rng.randint(1, 90) for _ in range(30)], seed=0)
    params = [_random_params(rng, i) for i in range(30)]
    got = _both(prompts, params, max_num_seqs=6, max_num_batched_tokens=48, num_pages=16, page_size=16,
                max_model_len=160)
    assert got[True][0] == got[False][0]
    assert all(r[4] is None for r in got[True][0])  # no error
    llm = got[True][1]
    assert llm.stats.preemptions > 0 and llm.ahead_steps > 0
    llm.bm.check_invariants()
    assert llm.bm.num_free_blocks == llm.bm.num_blocks


def test_host_time_by_part(single_thread):
    """Each step's host time is split into parts (metrics.HOST_PARTS): the parts timed inside a
    step cover its measured time, and the grammar part appears only with a grammar."""
    from opmap.engine.metrics import HOST_PARTS

    llm = LLM("tiny-llama3", max_num_seqs=4)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for params, has_grammar in ((SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), False),
                                (SamplingParams(max_tokens=12, temperature=0.0, json_schema=json.dumps(schema)), True)):
        llm.generate(random_prompts(llm.cfg.vocab, [30, 31, 17]), params)
        d = llm.last_summary
        host = d["host_ms_per_step"]["decode"]
        assert set(host) == set(HOST_PARTS) and all(v >= 0 for v in host.values())
        assert host["forward"] > 0 and host["sample"] > 0
        assert (host["grammar"] > 0) == has_grammar
        inside = sum(v for k, v in host.items() if k != "schedule")  # schedule() runs before the step's clock
        step = d["step_seconds"]["decode"] / d["steps"]["decode"] * 1e3
        assert 0.7 * step <= inside <= step * 1.05 + 0.05


def test_engine_freezes_the_heap_and_close_unfreezes(single_thread):
    """Objects alive at construction go to the collector's permanent generation (a full
    collection then does not walk them inside a step); close() unfreezes, so the engine's own
    objects are collected once it is dropped."""
    import gc
    import weakref

    gc.unfreeze()
    llm = LLM("tiny-llama3", max_num_seqs=2)
    frozen = gc.get_freeze_count()
    assert frozen > 1000
    gc.collect()
    assert len(gc.get_objects()) < frozen // 4  # what a full collection walks now
    runner = weakref.ref(llm.runner)
    llm.generate([[5] * 10], SamplingParams(max_tokens=3, temperature=0.0))
    llm.close()
    assert gc.get_freeze_count() == 0
    del llm
    gc.collect()
    assert runner() is None


def test_summary_counts_collections_and_longest_steps(single_thread):
    """The run summary carries the collector's work during generate() and the longest step per
    phase; the hook is removed on close."""
    import gc

    llm = LLM("tiny-llama3", max_num_seqs=2)
    assert llm._gc in gc.callbacks

    def churn(n):  # cyclic garbage, so that collections run inside this generate()
        for _ in range(n):
            a = []
            a.append(a)

    orig = llm.scheduler.schedule

    def schedule_with_garbage():
        churn(3000)
        return orig()

    llm.scheduler.schedule = schedule_with_garbage
    llm.generate([[5] * 10], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    d = llm.last_summary
    assert d["gc"]["collections"][0] >= 1 and sum(d["gc"]["ms"]) > 0
    assert set(d["step_ms_max"]) == {"prefill", "decode"}
    assert d["step_ms_max"]["decode"] >= d["step_seconds"]["decode"] / d["steps"]["decode"] * 1e3 - 1e-9
    llm.close()
    assert llm._gc not in gc.callbacks


@pytest.mark.parametrize("B,max_seqs", [(1, 32), (5, 8), (8, 8)])
def test_readback_destination_is_contiguous(B, max_seqs):
    """The tokens' device-to-host copy lands in a contiguous slice of the pinned buffer. A strided
    slice (``buf[:, :B]`` of a [2, max_num_seqs] buffer, as before) makes PyTorch stage the copy
    through pageable memory, and the host then waits for the whole forward pass (docs/engine.md)."""
    from opmap.engine.llm import _Pending

    class Event:
        recorded = 0

        def record(self):
            self.recorded += 1

        def synchronize(self):
            pass

    ids = torch.arange(B, dtype=torch.int64) * 3 + 1
    invalid = torch.zeros(B, dtype=torch.bool)
    invalid[B // 2] = True
    buf = torch.full((2 * max_seqs,), -7, dtype=torch.int64)
    ev = Event()
    p = _Pending([None] * B, [None] * B, ids, invalid, [None] * B, readback=(buf, ev))
    assert p.host.is_contiguous() and p.host.data_ptr() == buf.data_ptr() and ev.recorded == 1
    got_ids, bad = p.read()
    assert got_ids == ids.tolist() and bad == invalid.tolist()
