"""KV page allocator with reference counts and prefix caching by chained block hashes.

Pure Python (no torch): a page ("block") holds ``block_size`` consecutive tokens of one sequence.
A block that is full and whose KV has been computed gets the hash ``h_i = hash((h_{i-1},
tokens_i))``, chained so that equal token blocks under different prefixes never match. A later
sequence whose prompt starts with the same blocks reuses them (ref count + 1) instead of
recomputing them.

Freed blocks keep their hash and stay matchable until they are reused: the free list is an LRU
(an OrderedDict) from which new allocations take the oldest entry; blocks without a hash go to
its front (reused first), hashed ones to its back, and a sequence's blocks are released last
block first so that shared prefixes are the last to be evicted.

Only full blocks strictly before a prompt's last token are matched: the last token is always
computed, because its logits are needed, and it must not be written into a shared page.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional


class Block:
    __slots__ = ("id", "ref", "hash", "tokens")

    def __init__(self, bid: int):
        self.id = bid
        self.ref = 0
        self.hash: Optional[int] = None
        self.tokens: Optional[tuple] = None  # content behind the hash, to rule out hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}: both must be > 0")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_q: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.table: dict[int, int] = {}  # hash -> block id
        self.hits = 0  # blocks served from the prefix cache (statistics)
        self.queries = 0  # full prompt blocks looked up

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_q)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq, num_new_tokens: int) -> bool:
        need = self.blocks_for(seq.num_computed + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free_blocks

    @staticmethod
    def chain(prev: Optional[int], tokens: tuple) -> int:
        return hash((prev, tokens))

    # ---- allocation -------------------------------------------------------------------------
    def _take_free(self) -> Block:
        bid, _ = self.free_q.popitem(last=False)
        b = self.blocks[bid]
        if b.hash is not None and self.table.get(b.hash) == bid:
            del self.table[b.hash]  # evicted from the prefix cache
        b.hash, b.tokens, b.ref = None, None, 1
        return b

    def match_prefix(self, seq) -> int:
        """Attach the cached blocks of ``seq``'s leading tokens; returns the number of tokens
        they cover (0 without caching). Only for a sequence holding no blocks."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        seq.block_hashes = []
        if not self.caching:
            return 0
        bs, toks = self.block_size, seq.token_ids
        prev = None
        for i in range((len(toks) - 1) // bs):
            self.queries += 1
            blk = tuple(toks[i * bs:(i + 1) * bs])
            h = self.chain(prev, blk)
            bid = self.table.get(h)
            if bid is None or self.blocks[bid].tokens != blk:
                break
            b = self.blocks[bid]
            if b.ref == 0:
                del self.free_q[bid]
            b.ref += 1
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
            prev = h
            self.hits += 1
        return len(seq.block_table) * bs

    def allocate(self, seq, num_new_tokens: int) -> None:
        """Extend ``seq``'s block table to cover ``num_computed + num_new_tokens`` tokens."""
        need = self.blocks_for(seq.num_computed + num_new_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"sequence {seq.seq_id}: needs {need} blocks, {self.num_free_blocks} free "
                               "(the scheduler checks can_allocate first)")
        for _ in range(max(need, 0)):
            seq.block_table.append(self._take_free().id)

    def commit(self, seq) -> None:
        """Register the hashes of blocks that became full and computed (after a model step)."""
        if not self.caching:
            return
        bs = self.block_size
        full = min(seq.num_computed // bs, len(seq.block_table))
        for i in range(len(seq.block_hashes), full):
            blk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = self.chain(seq.block_hashes[-1] if seq.block_hashes else None, blk)
            seq.block_hashes.append(h)
            b = self.blocks[seq.block_table[i]]
            if b.hash is None:
                b.hash, b.tokens = h, blk
                # A twin computed concurrently by another sequence keeps the table entry.
                self.table.setdefault(h, b.id)

    def free(self, seq) -> None:
        """Release ``seq``'s blocks (last block first) and reset its cache state."""
        for bid in reversed(seq.block_table):
            b = self.blocks[bid]
            b.ref -= 1
            if b.ref < 0:
                raise RuntimeError(f"block {bid} freed more often than allocated")
            if b.ref == 0:
                self.free_q[bid] = None
                if b.hash is None:
                    self.free_q.move_to_end(bid, last=False)
        seq.block_table = []
        seq.block_hashes = []

    def check_invariants(self) -> None:
        """For tests: free list == blocks of ref 0; table entries point at blocks with that hash."""
        zero = {b.id for b in self.blocks if b.ref == 0}
        if zero != set(self.free_q):
            raise AssertionError(f"free list {sorted(self.free_q)} != ref-0 blocks {sorted(zero)}")
        for h, bid in self.table.items():
            if self.blocks[bid].hash != h:
                raise AssertionError(f"table hash {h} -> block {bid} with hash {self.blocks[bid].hash}")
