"""BlockManager: allocation, ref counts, prefix caching by chained hashes, LRU eviction."""
import random

import pytest

from opmap.engine.block_manager import BlockManager
from opmap.engine.sequence import Sequence


def admit(bm, seq):
    """What the scheduler does on first admission: match the prefix, then allocate the rest."""
    seq.num_computed = bm.match_prefix(seq)
    n = seq.num_tokens - seq.num_computed
    assert bm.can_allocate(seq, n)
    bm.allocate(seq, n)
    return seq.num_computed


def run_all(bm, seq):
    seq.num_computed = seq.num_tokens
    bm.commit(seq)


def test_allocate_free_counts():
    bm = BlockManager(10, 4)
    s = Sequence(list(range(9)))  # 9 tokens -> 3 blocks
    assert admit(bm, s) == 0
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    assert len(set(s.block_table)) == 3
    run_all(bm, s)
    s.append(100)  # 10 tokens: still 3 blocks
    assert bm.can_allocate(s, 1)
    bm.allocate(s, 1)
    assert len(s.block_table) == 3
    s.num_computed = 10
    for t in range(3):  # up to 13 tokens -> 4 blocks
        s.append(101 + t)
        bm.allocate(s, 1)
        s.num_computed += 1
    assert len(s.block_table) == 4 and bm.num_free_blocks == 6
    bm.free(s)
    assert bm.num_free_blocks == 10 and s.block_table == []
    bm.check_invariants()


def test_cannot_allocate_beyond_capacity():
    bm = BlockManager(2, 4)
    s = Sequence(list(range(9)))
    assert not bm.can_allocate(s, 9)
    with pytest.raises(RuntimeError, match="needs 3 blocks"):
        bm.allocate(s, 9)


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(16, 4)
    a = Sequence(list(range(12)) + [50, 51])  # 3 full blocks + 2
    admit(bm, a)
    run_all(bm, a)
    b = Sequence(list(range(12)) + [60])  # same 3 full blocks
    assert admit(bm, b) == 12
    assert b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] != a.block_table[3]
    assert [bm.blocks[i].ref for i in a.block_table[:3]] == [2, 2, 2]
    bm.free(a)
    assert [bm.blocks[i].ref for i in b.block_table[:3]] == [1, 1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_last_token_never_matched():
    """A prompt of exactly whole blocks recomputes its last block (its last token needs logits)."""
    bm = BlockManager(8, 4)
    a = Sequence(list(range(8)))
    admit(bm, a)
    run_all(bm, a)
    b = Sequence(list(range(8)))
    assert admit(bm, b) == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_chained_hash_needs_same_prefix():
    bm = BlockManager(16, 4)
    a = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    run_all(bm, a)
    b = Sequence([0, 0, 0, 0, 5, 6, 7, 8, 9])  # second block equal, first differs
    assert admit(bm, b) == 0
    assert set(b.block_table).isdisjoint(a.block_table)


def test_only_computed_full_blocks_are_cached():
    bm = BlockManager(16, 4)
    a = Sequence(list(range(10)))
    admit(bm, a)
    a.num_computed = 5  # a chunk of 5: only block 0 is full and computed
    bm.commit(a)
    assert len(a.block_hashes) == 1
    b = Sequence(list(range(10)))
    assert admit(bm, b) == 4


def test_freed_blocks_stay_cached_until_reused_lru():
    bm = BlockManager(4, 2)
    a = Sequence([1, 2, 3, 4, 5])  # 3 blocks, 2 full and hashed
    admit(bm, a)
    run_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = Sequence([1, 2, 3, 4, 9])
    assert admit(bm, b) == 4  # revived from the free list
    bm.free(b)
    # Fill the cache with other content: the unhashed block goes first, then the oldest hashed.
    c = Sequence([7, 7, 8, 8, 9, 9, 6])
    admit(bm, c)
    assert len(c.block_table) == 4 and bm.num_free_blocks == 0
    d = Sequence([1, 2, 3, 4, 5])
    bm.free(c)
    assert admit(bm, d) == 0  # the old prefix was evicted
    bm.check_invariants()


def test_unhashed_blocks_are_reused_before_hashed():
    bm = BlockManager(4, 2)
    a = Sequence([1, 2, 3])  # block 0 full+hashed, block 1 partial (no hash)
    admit(bm, a)
    run_all(bm, a)
    hashed, partial = a.block_table
    bm.free(a)
    c = Sequence([9])
    admit(bm, c)
    assert c.block_table == [partial]
    assert bm.table[a.block_hashes[0] if a.block_hashes else bm.blocks[hashed].hash] == hashed


def test_twin_blocks_computed_concurrently():
    bm = BlockManager(8, 2)
    a, b = Sequence([1, 2, 3]), Sequence([1, 2, 3])
    admit(bm, a)
    admit(bm, b)  # nothing cached yet: both compute block 0
    run_all(bm, a)
    run_all(bm, b)
    h = bm.blocks[a.block_table[0]].hash
    assert h == bm.blocks[b.block_table[0]].hash and bm.table[h] == a.block_table[0]
    bm.free(a)
    bm.free(b)
    bm.check_invariants()
    c = Sequence([1, 2, 4])
    assert admit(bm, c) == 2


def test_hash_collision_is_not_a_hit(monkeypatch):
    bm = BlockManager(8, 2)
    monkeypatch.setattr(BlockManager, "chain", staticmethod(lambda prev, toks: 42))
    a = Sequence([1, 2, 3])
    admit(bm, a)
    run_all(bm, a)
    b = Sequence([5, 6, 7])  # same (forced) hash, other tokens
    assert admit(bm, b) == 0


def test_caching_off():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = Sequence([1, 2, 3])
    admit(bm, a)
    run_all(bm, a)
    b = Sequence([1, 2, 3])
    assert admit(bm, b) == 0 and not bm.table


def test_random_workload_invariants():
    rng = random.Random(0)
    bm = BlockManager(40, 4)
    live = []
    for step in range(400):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 6):
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        else:
            prefix = [rng.randrange(3)] * rng.choice([0, 4, 8])
            s = Sequence(prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 12))])
            s.num_computed = bm.match_prefix(s)
            n = s.num_tokens - s.num_computed
            if bm.can_allocate(s, n):
                bm.allocate(s, n)
                run_all(bm, s)
                live.append(s)
            else:
                bm.free(s)
        refs = {}
        for s in live:
            assert len(s.block_table) == bm.blocks_for(s.num_tokens)
            for b in s.block_table:
                refs[b] = refs.get(b, 0) + 1
        assert all(bm.blocks[b].ref == r for b, r in refs.items())
        assert bm.num_free_blocks == 40 - len(refs)
        bm.check_invariants()
    assert bm.hits > 0
