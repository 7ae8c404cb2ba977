"""Engine behaviour on the CPU (fp32 references): chunked prefill, prefix caching and preemption
give the same tokens; bad requests fail alone; seeded sampling is batch independent; stops."""
import math

import pytest
import torch

from opmap.model.hf import save_checkpoint
from opmap.engine.llm import LLM
from opmap.engine.weights import StateDictSource
from opmap.engine.params import SamplingParams
from opmap.model.presets import PRESETS

from test_engine_util import random_prompts, single_thread, word_tokenizer  # noqa: F401

CFG = PRESETS["tiny-llama3"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama3")
    save_checkpoint(CFG, str(d), seed=11, tokenizer=word_tokenizer(CFG.vocab))
    return str(d)


def tokens(outs):
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(CFG.vocab, (5, 40, 77, 16, 33), seed=1)


@pytest.fixture(scope="module")
def whole(ckpt, prompts):
    llm = LLM(ckpt, max_num_batched_tokens=512, max_num_seqs=8, prefix_caching=False)
    return tokens(llm.generate(prompts, GREEDY))


@pytest.mark.parametrize("budget", [8, 17, 64])
def test_chunked_prefill_equals_whole_prefill(ckpt, prompts, whole, budget, single_thread):
    llm = LLM(ckpt, max_num_batched_tokens=budget, max_num_seqs=8, prefix_caching=False)
    assert tokens(llm.generate(prompts, GREEDY)) == whole
    assert llm.stats.steps["prefill"] + llm.stats.steps["mixed"] > 1


def test_no_chunking_equals_whole(ckpt, prompts, whole, single_thread):
    llm = LLM(ckpt, max_num_batched_tokens=80, max_num_seqs=8, chunked_prefill=False, prefix_caching=False)
    assert tokens(llm.generate(prompts, GREEDY)) == whole


def test_prefix_cache_hits_equal_misses(ckpt, single_thread):
    shared = random_prompts(CFG.vocab, (48,), seed=5)[0]
    tails = random_prompts(CFG.vocab, (3, 9, 1), seed=6)
    ps = [shared + t for t in tails]
    off = LLM(ckpt, max_num_seqs=4, prefix_caching=False)
    ref = tokens(off.generate(ps, GREEDY))
    on = LLM(ckpt, max_num_seqs=4, prefix_caching=True)
    on.generate([shared + [7]], GREEDY)  # warms the cache with the shared prefix
    outs = on.generate(ps, GREEDY)
    assert tokens(outs) == ref
    assert all(o.num_cached_tokens == 48 for o in outs)  # 3 full pages of 16 reused, never recomputed
    again = on.generate(ps, GREEDY)  # a second pass hits its own pages (prompt + generated blocks)
    assert tokens(again) == ref and all(o.num_cached_tokens >= 48 for o in again)


def test_preemption_gives_same_tokens(ckpt, prompts, whole, single_thread):
    # 12 pages of 16 tokens cannot hold the five sequences at once (they need 17): some are
    # preempted (freed and recomputed) and every request still finishes with the same tokens.
    llm = LLM(ckpt, max_num_batched_tokens=64, max_num_seqs=8, num_pages=12, prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    assert tokens(outs) == whole
    assert llm.stats.preemptions > 0 and any(o.num_preemptions for o in outs)
    with_cache = LLM(ckpt, max_num_batched_tokens=64, max_num_seqs=8, num_pages=12, prefix_caching=True)
    assert tokens(with_cache.generate(prompts, GREEDY)) == whole


def test_a_max_model_len_the_kv_cache_cannot_hold_is_refused_at_load(ckpt, caplog):
    """4 pages of 16 tokens hold 64: an explicit max_model_len of 128 is refused naming both figures;
    left to the model's 2048 positions it shrinks to 64 with a warning, and a longer prompt fails alone."""
    from opmap.core.contract import InputError

    with pytest.raises(InputError, match=r"max_model_len: got 128, expected at most 64.*4 pages of 16"):
        LLM(ckpt, max_num_seqs=2, num_pages=4, page_size=16, max_model_len=128)
    with caplog.at_level("WARNING", logger="opmap.engine"):
        llm = LLM(ckpt, max_num_seqs=2, num_pages=4, page_size=16)
    assert llm.max_model_len == 64 and "max_model_len 64, below the model's" in caplog.text
    outs = llm.generate([list(range(1, 70)), [1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    assert "max_model_len=64" in outs[0].error and outs[1].error is None and len(outs[1].token_ids) == 4


def test_bad_requests_fail_alone(ckpt, prompts, whole, single_thread):
    llm = LLM(ckpt, max_num_seqs=8, max_model_len=100)
    batch = [prompts[0], [], list(range(1, 101)), prompts[1], [CFG.vocab + 3], "w1 w2 w3", 3.5]
    params = [GREEDY, GREEDY, GREEDY, {"temperature": -1.0}, GREEDY, GREEDY, GREEDY]
    outs = llm.generate(batch, params)
    assert outs[0].error is None and outs[0].token_ids == whole[0]
    assert "empty" in outs[1].error and outs[1].finish_reason == "error"
    assert "max_model_len=100" in outs[2].error
    assert outs[3].error.startswith("temperature")
    assert "outside" not in outs[4].error and f"[0, {CFG.vocab})" in outs[4].error
    assert outs[5].error is None and len(outs[5].token_ids) == 12  # a text prompt through tokenizer.json
    assert outs[6].error.startswith("prompt")


def test_too_many_logprobs_fail_alone(ckpt, prompts, whole, single_thread):
    """A request asking for more top-n log-probabilities than the vocabulary (or than
    MAX_LOGPROBS) ends alone with an error; the good requests beside it are unchanged."""
    from opmap.engine.params import MAX_LOGPROBS

    llm = LLM(ckpt, max_num_seqs=8)
    lp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=CFG.vocab + 1)
    outs = llm.generate([prompts[0], prompts[1], prompts[2]], [GREEDY, lp, GREEDY])
    assert outs[1].finish_reason == "error" and outs[1].error.startswith("logprobs")
    assert outs[0].token_ids == whole[0] and outs[2].token_ids == whole[2]
    outs = llm.generate([prompts[0], prompts[1]], [GREEDY, {"max_tokens": 4, "logprobs": MAX_LOGPROBS + 1}])
    assert outs[1].finish_reason == "error" and str(MAX_LOGPROBS) in outs[1].error
    assert outs[0].token_ids == whole[0]


def test_nan_logits_end_one_request(ckpt, prompts, whole, single_thread):
    llm = LLM(ckpt, max_num_seqs=8)
    poison = 499
    llm.runner.model.params["embed"][poison] = float("nan")
    outs = llm.generate([prompts[0], prompts[1][:-1] + [poison], prompts[2]], GREEDY)
    assert outs[1].finish_reason == "error" and "NaN" in outs[1].error
    assert outs[0].token_ids == whole[0] and outs[2].token_ids == whole[2]


def test_seeded_sampling_is_batch_independent(ckpt, prompts, single_thread):
    llm = LLM(ckpt, max_num_seqs=8)
    sp = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    alone = tokens(llm.generate([prompts[2]], sp))[0]
    others = [SamplingParams(max_tokens=8, temperature=1.0, seed=s) for s in (1, 2, 3, 4)]
    mixed = llm.generate([prompts[0], prompts[1], prompts[2], prompts[3], prompts[4]],
                         [others[0], others[1], sp, others[2], others[3]])
    assert tokens(mixed)[2] == alone
    unseeded = llm.generate([prompts[2]] * 2, SamplingParams(max_tokens=8, temperature=1.0))
    assert all(len(o.token_ids) == 8 for o in unseeded)


def test_stops_and_logprobs(ckpt, prompts, whole, single_thread):
    llm = LLM(ckpt, max_num_seqs=8, eos_ids=[whole[1][5]])
    ref = whole[0]
    o = llm.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[ref[3]],
                                                  logprobs=2))[0]
    k = ref.index(ref[3])
    assert o.token_ids == ref[:k + 1] and o.finish_reason == "stop" and o.stop_reason == ref[3]
    assert len(o.logprobs) == k + 1 and len(o.logprobs[0]["top"]) == 2
    assert o.logprobs[0]["top"][0][0] == ref[0] and math.isclose(o.logprobs[0]["token"], o.logprobs[0]["top"][0][1])
    e = llm.generate([prompts[1]], GREEDY)[0]  # EOS from eos_ids
    assert e.token_ids == whole[1][:whole[1].index(whole[1][5]) + 1] and e.finish_reason == "stop"
    word = f"w{ref[4]}"
    s = llm.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0.0, stop=[word]))[0]
    assert s.finish_reason == "stop" and s.stop_reason == word and word not in s.text
    assert s.text.rstrip() == " ".join(f"w{t}" for t in ref[:ref.index(ref[4])])  # cut before the stop
    n = llm.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert len(n.token_ids) == 12


def test_state_dict_source_and_random_preset(ckpt, single_thread):
    from opmap.model.hf import make_hf_model

    hf = make_hf_model(CFG, seed=11)
    a = LLM(CFG, source=StateDictSource(hf.state_dict()), tokenizer=word_tokenizer(CFG.vocab), max_num_seqs=2)
    b = LLM(ckpt, max_num_seqs=2)
    p = random_prompts(CFG.vocab, (9,), seed=2)
    assert tokens(a.generate(p, GREEDY)) == tokens(b.generate(p, GREEDY))
    text = " ".join(f"w{t}" for t in p[0])  # the same prompt as text, through a given tokenizers.Tokenizer
    assert a.generate(text, GREEDY)[0].token_ids == tokens(b.generate(p, GREEDY))[0]
    r = LLM("tiny-llama3", max_num_seqs=2)  # random weights, byte tokenizer
    o = r.generate("hello", SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert o.error is None and len(o.token_ids) == 4 and o.ttft is not None and o.tpot is not None
    assert r.last_summary["output_tokens"] == 4


def test_interrupt_frees_everything(ckpt, prompts, whole, single_thread, monkeypatch):
    llm = LLM(ckpt, max_num_seqs=8)
    calls = {"n": 0}
    real = llm.runner.run

    def flaky(batch, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(batch, **kw)

    monkeypatch.setattr(llm.runner, "run", flaky)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY)
    assert not llm.scheduler.has_unfinished() and llm.bm.num_free_blocks == llm.bm.num_blocks
    assert tokens(llm.generate(prompts, GREEDY)) == whole  # still usable, same tokens


def test_structured_output(single_thread):
    pytest.importorskip("xgrammar")
    import json

    llm = LLM("tiny-llama3", max_num_seqs=8)  # random weights, byte tokenizer
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    outs = llm.generate(["a", "b", "c", "d", "e"], [
        SamplingParams(max_tokens=40, temperature=0.0, json_schema=schema),
        SamplingParams(max_tokens=5, temperature=0.0),
        SamplingParams(max_tokens=10, temperature=0.9, seed=1, regex="(yes|no)!"),
        SamplingParams(max_tokens=5, json_schema="{not json"),
        SamplingParams(max_tokens=20, temperature=0.7, seed=3, grammar='root ::= "a" [0-9] [0-9] "z"')])
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == "grammar"
    assert isinstance(json.loads(outs[0].text)["ok"], bool)
    assert outs[1].error is None and len(outs[1].token_ids) == 5  # unconstrained neighbour unaffected
    assert outs[2].text in ("yes!", "no!")
    assert outs[3].finish_reason == "error" and outs[3].error.startswith("json_schema")
    assert len(outs[4].text) == 4 and outs[4].text[0] == "a" and outs[4].text[1:3].isdigit()


def test_structured_output_prepared_at_start_up(single_thread):
    """EngineConfig.structured_output builds the compiler and the bitmask buffer in the
    constructor (before the engine's objects are frozen), so a constrained request pays no set-up;
    the tokens are those of an engine that builds them on first use."""
    pytest.importorskip("xgrammar")
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
    sp = SamplingParams(max_tokens=24, temperature=0.0, json_schema=schema)
    lazy = LLM("tiny-llama3", max_num_seqs=4)
    assert lazy._structured is None and lazy._bitmask is None
    want = lazy.generate(["x", "y"], sp)
    ready = LLM("tiny-llama3", max_num_seqs=4, structured_output=True)
    made = ready._structured
    assert made is not None and ready._bitmask is not None
    got = ready.generate(["x", "y"], sp)
    assert ready._structured is made  # not made again
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    lazy.close()
    ready.close()


def test_penalty_counts_are_updated_on_the_device_between_decode_steps(single_thread, monkeypatch):
    """With penalties the sampler rebuilds the prompt mask and output counts from the host's token
    lists only when the batch changes; in steady decode it adds the previous step's sampled ids on
    the device. The tokens equal those of rebuilding at every step, in lockstep and one step ahead."""
    from opmap.engine import sampler as esampler

    params = [SamplingParams(max_tokens=n, temperature=t, repetition_penalty=1.5, frequency_penalty=0.8,
                             presence_penalty=0.3, seed=s, ignore_eos=True)
              for n, t, s in ((18, 0.0, 1), (11, 0.8, 2), (14, 1.0, 3))]
    prompts = [[5, 6, 7, 5], [9, 9, 9], [1, 2, 3, 4, 5, 6]]
    calls = []
    real = esampler.penalty_state
    monkeypatch.setattr(esampler, "penalty_state", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = {}
    for asyn in (False, True):
        for rebuild in (False, True):
            llm = LLM("tiny-llama3", max_num_seqs=4, async_decode=asyn)
            if rebuild:  # forget the last launch's state before every launch
                launch = llm.sampler.launch

                def fresh(*a, _launch=launch, _s=llm.sampler, **k):
                    _s._pen = None
                    return _launch(*a, **k)

                llm.sampler.launch = fresh
            calls.clear()
            got[asyn, rebuild] = [o.token_ids for o in llm.generate(prompts, params)]
            if not rebuild:
                assert len(calls) < 10  # one rebuild per change of the batch, not one per step
            llm.close()
    assert got[False, False] == got[False, True] == got[True, False] == got[True, True]


def test_warm_up_runs_prefill_mixed_and_decode_then_starts_clean(ckpt, prompts, whole, single_thread):
    """warmup=True (the default on a GPU): a prefill, a mixed step and decode steps before the
    first request; afterwards the counters and the prefix cache are empty and the tokens are
    those of an engine without it."""
    llm = LLM(ckpt, max_num_batched_tokens=32, max_num_seqs=8, warmup=True)
    assert llm.warmup_s > 0
    w = llm.warmup_steps
    assert w["prefill"] >= 1 and w["mixed"] >= 1 and w["decode"] >= 1, w
    assert llm.stats.steps == {"prefill": 0, "mixed": 0, "decode": 0} and llm.last_summary is None
    assert llm.bm.num_free_blocks == llm.runner.num_pages and not llm.bm.table
    assert tokens(llm.generate(prompts, GREEDY)) == whole
    assert LLM(ckpt, max_num_seqs=8).warmup_s == 0.0  # off by default on the CPU
    # A model length within the token budget (no prompt chunked at that budget) still warms a
    # mixed step up, and the budget is the configured one afterwards.
    short = LLM(ckpt, max_num_batched_tokens=2048, max_model_len=128, max_num_seqs=8, warmup=True)
    assert short.warmup_steps["mixed"] >= 1, short.warmup_steps
    assert short.scheduler.budget == 2048
    assert tokens(short.generate(prompts, GREEDY)) == whole
    # without chunked prefill a smaller budget would refuse the long prompt: the budget stays
    whole_only = LLM(ckpt, max_num_batched_tokens=2048, max_model_len=128, max_num_seqs=8, warmup=True,
                     chunked_prefill=False)
    assert whole_only.scheduler.budget == 2048 and whole_only.warmup_steps["prefill"] >= 1


def test_mla_prefill_gets_the_step_lengths_from_the_host(single_thread):
    """Prefill and mixed steps hand the MLA prefill its plan's lengths (the longest query chunk
    and sequence) from the scheduler, so it never reads them from the device (a host sync in
    every layer on a GPU); the values are the true ones."""
    llm = LLM("tiny-deepseek", max_num_batched_tokens=24, max_num_seqs=4)
    seen = []
    for phase in ("prefill", "mixed"):
        ops = llm.runner.ops[phase]
        real = ops.attention

        def spy(*a, _real=real, **kw):
            cu, lens = a[5].tolist(), a[6].tolist()
            seen.append((kw.get("max_q_len"), kw.get("max_seq_len"),
                         max(y - x for x, y in zip(cu, cu[1:])), max(lens)))
            return _real(*a, **kw)

        ops.attention = spy
    outs = llm.generate(random_prompts(PRESETS["tiny-deepseek"].vocab, (5, 40, 3), seed=2),
                        SamplingParams(max_tokens=4, temperature=0.0))
    assert all(o.error is None for o in outs)
    assert llm.stats.steps["mixed"] > 0 and seen
    assert all(q == tq and s == ts for q, s, tq, ts in seen), seen
