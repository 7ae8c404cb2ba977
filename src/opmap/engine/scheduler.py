"""Continuous batching with chunked prefill under a token budget, and preemption by
free-and-recompute when pages run out.

Each step: first the running sequences, oldest first (a decoding sequence asks for one token, a
partly prefilled one for the rest of its prompt, cut to the remaining budget); when a running
sequence cannot get its pages, the newest running sequence is preempted (its pages freed, its
tokens recomputed later, prefix cache permitting) until it can. Then, if nothing was preempted
in this step, waiting sequences are admitted in arrival order while the budget, the sequence
limit and the free pages allow (a prompt longer than the budget is cut into chunks when chunked
prefill is on). Without chunked prefill a prompt is admitted only whole.

``prefill_cap`` (EngineConfig.max_prefill_tokens_with_decodes): while some running sequence decodes,
the step's prompt tokens (chunks of partly prefilled sequences and new admissions together) stay
within it; the decoding sequences are scheduled whatever their place in the running list. A step
with no decoding sequence takes the whole budget.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from opmap.engine.block_manager import BlockManager
from opmap.engine.sequence import Sequence, SeqStatus


@dataclass
class Scheduled:
    seq: Sequence
    start: int  # num_computed when scheduled: first position computed this step
    num_tokens: int
    samples: bool = False  # the step reaches the end of the known tokens: its last logits are sampled

    def __post_init__(self):
        self.samples = self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class Batch:
    items: list
    preempted: list = field(default_factory=list)
    failed: list = field(default_factory=list)  # sequences that can never fit the cache

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token: the decode path (CUDA graphs) serves it."""
        return bool(self.items) and all(it.num_tokens == 1 for it in self.items)

    @property
    def phase(self) -> str:
        if self.is_decode:
            return "decode"
        return "mixed" if any(it.num_tokens == 1 and it.start > 0 for it in self.items) else "prefill"


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True, prefill_cap: Optional[int] = None):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.chunked = chunked_prefill
        self.prefill_cap = prefill_cap
        self.waiting: deque = deque()
        self.running: list = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> Batch:
        budget = self.budget
        batch = Batch([])
        decoding = self.prefill_cap is not None and any(s.num_tokens - s.num_computed == 1 and s.num_computed
                                                         for s in self.running)
        prompt_left = self.prefill_cap if decoding else budget  # prompt tokens this step may still take
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n > 1 or not seq.num_computed:  # a prompt chunk
                n = min(n, prompt_left)
                if n == 0:  # the cap is spent: this sequence waits a step; decodes after it still run
                    i += 1
                    continue
                prompt_left -= n
            while not self.bm.can_allocate(seq, n):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    # Alone and still too big: the cache can never hold it.
                    self.running.remove(seq)
                    self.bm.free(seq)
                    batch.failed.append(seq)
                    break
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SeqStatus.RUNNING or seq in batch.failed:
                break  # seq itself was preempted: everything after it already was
            self.bm.allocate(seq, n)
            batch.items.append(Scheduled(seq, seq.num_computed, n))
            budget -= n
            i += 1
        if batch.preempted:
            return batch
        budget = min(budget, prompt_left)  # what admissions may take
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                seq.num_computed = self.bm.match_prefix(seq)
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = seq.num_computed
            remaining = seq.num_tokens - seq.num_computed
            if not self.chunked and remaining > budget:
                if not batch.items and remaining > self.budget:
                    self._fail_waiting(seq, batch)  # would never fit one step
                    continue
                self._rollback(seq)
                break
            n = min(remaining, budget)
            if not self.bm.can_allocate(seq, n):
                if not self.running and self.bm.blocks_for(seq.num_tokens) > self.bm.num_blocks:
                    self._fail_waiting(seq, batch)
                    continue
                self._rollback(seq)
                break
            self.waiting.popleft()
            self.bm.allocate(seq, n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.items.append(Scheduled(seq, seq.num_computed, n))
            budget -= n
        return batch

    def _rollback(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.num_computed = 0

    def _fail_waiting(self, seq: Sequence, batch: Batch) -> None:
        self.waiting.popleft()
        self._rollback(seq)
        batch.failed.append(seq)

    def update(self, batch: Batch) -> None:
        """After the model step: the scheduled tokens now have KV in the cache."""
        for it in batch.items:
            it.seq.num_computed = it.start + it.num_tokens
            self.bm.commit(it.seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
