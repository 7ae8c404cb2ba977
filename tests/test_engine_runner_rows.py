"""ModelRunner.run on a decode step where not every row samples (a one-token prompt chunk that
does not reach the end of its prompt next to a decoding sequence): the returned logits are the
sampling rows' only, taken through the step's logits_idx buffer (no fresh index tensor)."""
import torch

from opmap.engine.llm import LLM
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
