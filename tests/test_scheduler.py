"""Scheduler: continuous batching, chunked prefill under a budget, preemption, failures."""
from opmap.engine.block_manager import BlockManager
from opmap.engine.scheduler import Scheduler
from opmap.engine.sequence import Sequence, SeqStatus


def step(sch, token=7):
    """One fake model step: tokens computed, a token appended where the step samples."""
    b = sch.schedule()
    sch.update(b)
    for it in b.items:
        if it.samples:
            it.seq.append(token)
    return b


def test_chunked_prefill_under_budget_then_decode():
    sch = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    a = Sequence(list(range(20)))
    sch.add(a)
    sizes = []
    for _ in range(3):
        b = step(sch)
        assert b.num_tokens <= 8
        sizes.append([(it.start, it.num_tokens, it.samples) for it in b.items])
    assert sizes == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    assert a.num_output_tokens == 1
    b = step(sch)
    assert b.is_decode and b.items[0].start == 20


def test_decodes_first_then_new_prefills_fill_budget():
    sch = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, c = Sequence([1, 2, 3]), Sequence(list(range(30)))
    sch.add(a)
    step(sch)
    sch.add(c)
    b = step(sch)
    assert [(it.seq is a, it.num_tokens) for it in b.items] == [(True, 1), (False, 9)]
    assert b.phase == "mixed"
    assert sch.schedule().num_tokens <= 10


def test_no_chunking_admits_whole_prompts_only():
    sch = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10, chunked_prefill=False)
    a, c = Sequence(list(range(6))), Sequence(list(range(10, 16)))
    sch.add(a)
    sch.add(c)
    b = step(sch)
    assert [it.seq for it in b.items] == [a] and b.phase == "prefill"
    b = step(sch)
    assert [(it.seq, it.num_tokens) for it in b.items] == [(a, 1), (c, 6)]
    big = Sequence(list(range(11)))
    sch.add(big)
    sch.running.clear()  # pretend others are done: a prompt over the budget can never run unchunked
    sch.bm = BlockManager(64, 4)
    b = sch.schedule()
    assert b.failed == [big]


def test_max_num_seqs():
    sch = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [Sequence([i, i + 1]) for i in range(3)]
    for s in seqs:
        sch.add(s)
    b = step(sch)
    assert len(b.items) == 2 and seqs[2].status == SeqStatus.WAITING
    sch.finish(seqs[0], "stop")
    b = step(sch)
    assert seqs[2] in [it.seq for it in b.items]


def test_preemption_frees_newest_and_recomputes():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, c = Sequence([1, 2, 3]), Sequence([4, 5, 6])  # 2 blocks each: cache full
    sch.add(a)
    sch.add(c)
    step(sch)
    assert bm.num_free_blocks == 0
    step(sch)  # 4 tokens each: still 2 blocks
    b = step(sch)  # a needs a 3rd block: c (newest) is preempted
    assert b.preempted == [c] and [it.seq for it in b.items] == [a]
    assert c.status == SeqStatus.WAITING and c.num_computed == 0 and c.block_table == []
    assert sch.waiting[0] is c and c.num_tokens == 5  # its generated tokens are kept
    sch.finish(a, "stop")
    b = step(sch)
    assert [(it.seq, it.start, it.num_tokens) for it in b.items] == [(c, 0, 5)]


def test_preempting_itself_when_newest():
    bm = BlockManager(3, 2, enable_prefix_caching=False)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, c = Sequence([1, 2]), Sequence([3, 4, 5])
    sch.add(a)
    sch.add(c)
    step(sch)  # a: 1 block, c: 2 blocks, cache full
    b = step(sch)  # a -> 3 tokens needs a 2nd block: c preempted; c is not scheduled
    assert b.preempted == [c] and [it.seq for it in b.items] == [a]


def test_sequence_larger_than_cache_fails_not_loops():
    bm = BlockManager(2, 2)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    s = Sequence([1, 2, 3, 4, 5])
    sch.add(s)
    b = sch.schedule()
    assert b.failed == [s] and not b.items and not sch.has_unfinished()
    t = Sequence([1, 2, 3])
    sch.add(t)
    step(sch)
    step(sch)  # 4 tokens: 2 blocks
    b = step(sch)  # 5th token needs a 3rd block that does not exist
    assert b.failed == [t]


def test_prefix_cache_hit_skips_computed_tokens():
    sch = Scheduler(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=64)
    a = Sequence(list(range(10)))
    sch.add(a)
    step(sch)
    c = Sequence(list(range(9)) + [99])
    sch.add(c)
    b = step(sch)
    it = [it for it in b.items if it.seq is c][0]
    assert (it.start, it.num_tokens) == (8, 2) and c.num_cached_tokens == 8


def test_finish_frees_blocks():
    bm = BlockManager(8, 4)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    s = Sequence([1, 2, 3, 4, 5])
    sch.add(s)
    step(sch)
    sch.finish(s, "length")
    assert bm.num_free_blocks == 8 and s.finish_reason == "length" and not sch.has_unfinished()


def test_prefill_cap_applies_only_while_sequences_decode():
    """max_prefill_tokens_with_decodes: a step with decoding sequences takes at most the cap in
    prompt tokens (a running chunk and new admissions together) and still runs every decode, also
    one placed after a capped prompt in the running list; a step without decodes takes the budget."""
    sch = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=16, prefill_cap=5)
    long_, short = Sequence(list(range(60))), Sequence([1, 2, 3])
    sch.add(long_)
    assert step(sch).num_tokens == 16  # nothing decodes: the whole budget
    sch2 = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=16, prefill_cap=5)
    sch2.add(short)
    step(sch2)  # short's prompt; it decodes from the next step
    sch2.add(long_ := Sequence(list(range(60))))
    for _ in range(4):
        b = step(sch2)
        assert [it.seq for it in b.items][0] is short and b.items[0].num_tokens == 1
        assert sum(it.num_tokens for it in b.items[1:]) == 5  # long's chunks, capped
    late = Sequence(list(range(30)))  # a prompt arriving while short decodes: admitted within the cap
    sch2.add(late)
    sch2.running.reverse()  # the capped prompt first in the running list: the decode still runs
    b = step(sch2)
    assert short in [it.seq for it in b.items]
    assert sum(it.num_tokens for it in b.items if it.seq is not short) <= 5


def test_prefill_cap_none_is_the_budget():
    sch = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10, prefill_cap=None)
    a, c = Sequence([1, 2, 3]), Sequence(list(range(30)))
    sch.add(a)
    step(sch)
    sch.add(c)
    assert [it.num_tokens for it in step(sch).items] == [1, 9]
