"""ModelRunner.run on a decode step where not every row samples (a one-token prompt chunk that
does not reach the end of its prompt next to a decoding sequence): the returned logits are the
sampling rows' only, taken through the step's logits_idx buffer (no fresh index tensor); and a
prefill step padded to its token bucket gives the unpadded step's logits."""
import pytest
import torch

from opmap.engine.llm import LLM
from opmap.engine.runner import token_buckets
from opmap.engine.scheduler import Batch, Scheduled
from opmap.engine.sequence import Sequence

from test_engine_util import single_thread  # noqa: F401


def test_decode_step_with_a_row_that_does_not_sample(single_thread):
    llm = LLM("tiny-llama3", max_num_seqs=2, num_pages=16)
    run, bm = llm.runner, llm.bm
    a, b = Sequence([3, 1, 4, 1, 5]), Sequence([2, 7, 1, 8, 2, 8])
    for s in (a, b):  # prefill the first four tokens of each (neither step samples)
        bm.allocate(s, 4)
        assert run.run(Batch([Scheduled(s, 0, 4)])) is None
        s.num_computed = 4
    for s in (a, b):
        bm.allocate(s, 1)
    ia, ib = Scheduled(a, 4, 1), Scheduled(b, 4, 1)
    assert ia.samples and not ib.samples  # a reaches its last token, b does not
    batch = Batch([ia, ib])
    assert batch.is_decode
    got = run.run(batch).clone()
    ib.samples = True  # the same step again (same KV writes), now with every row sampled
    both = run.run(batch)
    assert got.shape == (1, both.shape[1])
    torch.testing.assert_close(got, both[:1], rtol=0, atol=0)
    llm.close()


def _prefill(run, bm, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [Sequence(torch.randint(0, 200, (n,), generator=g).tolist()) for n in lengths]
    for s in seqs:
        bm.allocate(s, s.num_tokens)
    return Batch([Scheduled(s, 0, s.num_tokens) for s in seqs])


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen3moe", "tiny-gemma2", "tiny-deepseek"])
def test_padded_prefill_step_gives_the_unpadded_logits(single_thread, name):
    """A prefill step padded to its token bucket, as on a GPU (the padding a trailing sequence of
    slot -1 rows, empty sequence slots after it): the sampled rows' logits are the unpadded
    step's, and a step that samples nothing still returns None."""
    llm = LLM(name, max_num_seqs=4, num_pages=64)
    run, bm = llm.runner, llm.bm
    assert run.prefill_buckets == []  # the CPU runs its prefill steps as they are
    mla = run.cfg.is_mla
    batch = _prefill(run, bm, (37,) if mla else (5, 37, 1))
    assert batch.phase == "prefill"
    ref = run.run(batch).clone()
    run.prefill_buckets = token_buckets(256)
    assert run.prefill_bucket(batch) == 128 and run.prefill_slots(128) == (2 if mla else 5)
    got = run.run(batch)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    s = Sequence(list(range(1, 30)))
    bm.allocate(s, 29)
    part = Batch([Scheduled(s, 0, 20)])  # a first chunk: samples nothing
    assert run.prefill_bucket(part) == 128 and run.run(part) is None
    # over a cached prefix, or several sequences: MLA's steps run unpadded
    assert run.prefill_bucket(Batch([Scheduled(s, 20, 9)])) == (None if mla else 128)
    assert run.prefill_bucket(_prefill(run, bm, (3, 4), seed=1)) == (None if mla else 128)
    llm.close()


def test_prefill_buckets():
    assert token_buckets(0) == []
    assert token_buckets(100) == [100]
    assert token_buckets(384) == [128, 256, 384]
    assert token_buckets(2048)[-2:] == [1920, 2048] and len(token_buckets(2048)) == 16
