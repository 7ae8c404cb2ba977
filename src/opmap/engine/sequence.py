"""Per-request state: tokens, how many of them have KV in the cache, pages, timings."""
from __future__ import annotations

import enum
import itertools
import time
from typing import Any, Optional

_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """``token_ids`` = prompt + generated tokens; the KV of ``token_ids[:num_computed]`` is in the
    cache. A step computes ``token_ids[num_computed:num_computed + n]``; when that reaches the end
    of ``token_ids`` the step's logits for the last token are sampled into a new token."""

    def __init__(self, prompt_token_ids: list, params: Any = None, prompt: Optional[str] = None,
                 index: int = 0, arrival: Optional[float] = None):
        self.seq_id = next(_ids)
        self.index = index  # position in the caller's list of prompts
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.status = SeqStatus.WAITING
        self.num_computed = 0
        self.block_table: list = []
        self.block_hashes: list = []
        self.num_cached_tokens = 0  # prefix-cache hit at first admission (statistics)
        self.num_preemptions = 0
        self.finish_reason: Optional[str] = None  # stop / length / error / abort
        self.stop_reason: Any = None  # the stop string or token that ended it
        self.error: Optional[str] = None
        self.text = ""
        self.logprobs: list = []
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.first_token_time: Optional[float] = None
        self.token_times: list = []  # perf_counter at each generated token
        self.state: dict = {}  # per-request sampler state (grammar matcher, detokenizer ...)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    @property
    def in_decode(self) -> bool:
        return self.num_computed == self.num_tokens - 1

    def append(self, token: int) -> None:
        now = time.perf_counter()
        self.token_ids.append(int(token))
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)

    def ttft(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed}, "
                f"blocks={len(self.block_table)}, {self.status.value})")
