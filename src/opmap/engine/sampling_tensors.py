"""Per-row tensors of a batch, built from a list of ``SamplingParams``: ``SamplingTensors``.

    st = SamplingTensors.build(params_list, vocab=V, device="cuda")
    ids, invalid = sample_fn(logits, st.temperature, st.top_k, st.top_p, st.min_p, st.seeds, positions)

``positions[B]`` int64 (the index in the sequence of the token being drawn) changes every step
and so is not part of this object; with ``seeds`` it keys the random stream, so a seeded row
draws the same tokens whatever else is in its batch. For CUDA graphs keep one instance per
graph bucket and ``copy_from`` a new batch into it (same tensors, new values).

Host-side flags (``any_penalties``, ``all_greedy``, ...) are computed from the Python values
while building, so that deciding which stages to run never reads a GPU tensor.

Penalty state: ``prompt_mask[B, V]`` bool (tokens of the prompt) and ``output_counts[B, V]``
int32 (occurrences in the output so far) come from ``penalty_state``; after each step the engine
calls ``update_output_counts`` (a scatter-add on the device, no host sync).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch

from opmap.core.contract import InputError
from opmap.engine.params import SamplingParams

__all__ = ["SamplingTensors", "penalty_state", "update_output_counts", "to_device"]


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A small host list as a device tensor without a host synchronisation.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory, after which PyTorch
    synchronises the stream: built right after the forward pass was launched, the host then waits
    for the whole forward before it can go on (a B=32 e2e run put most of each prefill step's host
    time in "sample", the wait of eight such copies in ``SamplingTensors.build``).
    From pinned memory with ``non_blocking`` the copy is queued behind the forward and the host
    goes on launching; the caching host allocator keeps the pinned block alive until the copy ran.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


# SamplingTensors' float fields and the SamplingParams fields they come from, in one order.
_F32_NAMES = ("temperature", "top_p", "min_p", "repetition", "frequency", "presence")
_F32_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # fp32 [B]; 0 = greedy
    top_k: torch.Tensor  # int32 [B]; 0 = off (also stored as 0 when >= vocab)
    top_p: torch.Tensor  # fp32 [B]; 1 = off
    min_p: torch.Tensor  # fp32 [B]; 0 = off
    repetition: torch.Tensor  # fp32 [B]
    frequency: torch.Tensor  # fp32 [B]
    presence: torch.Tensor  # fp32 [B]
    seeds: torch.Tensor  # int64 [B]
    any_penalties: bool = False
    all_greedy: bool = False
    any_filters: bool = False
    seeds_used: tuple = ()  # the Python seeds (drawn ones included), for logging / replay

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab: int, device="cpu") -> "SamplingTensors":
        if not params:
            raise InputError("params", "an empty list", "at least one SamplingParams")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise InputError(f"params[{i}]", type(p).__name__, "a SamplingParams")
        seeds = tuple(p.seed if p.seed is not None else _fresh_seed() for p in params)
        top_k = [0 if p.top_k >= vocab else p.top_k for p in params]

        # The six float fields in one copy: rows of a [6, n] tensor, n padded to 16 bytes so that
        # each row starts as aligned as a tensor of its own (Triton specialises on alignment).
        B, n = len(params), -(-len(params) // 4) * 4
        rows = [[float(getattr(p, f)) for p in params] + [0.0] * (n - B) for f in _F32_FIELDS]
        f32 = to_device(rows, torch.float32, device)[:, :B]
        st = cls(
            **dict(zip(_F32_NAMES, f32.unbind(0))),
            top_k=to_device(top_k, torch.int32, device),
            seeds=to_device(seeds, torch.int64, device),
            any_penalties=any(p.has_penalties for p in params),
            all_greedy=all(p.greedy for p in params),
            any_filters=any((0 < k) or p.top_p < 1 or p.min_p > 0 for p, k in zip(params, top_k)),
            seeds_used=seeds,
        )
        return st

    @property
    def batch(self) -> int:
        return self.temperature.shape[0]

    def copy_from(self, other: "SamplingTensors") -> None:
        """Copy ``other``'s values into these tensors (same batch size), for CUDA-graph buffers."""
        if other.batch != self.batch:
            raise InputError("other", f"batch {other.batch}", f"batch {self.batch}")
        for f in fields(self):
            v = getattr(other, f.name)
            if isinstance(v, torch.Tensor):
                getattr(self, f.name).copy_(v, non_blocking=True)
            else:
                setattr(self, f.name, v)


def penalty_state(prompts: Sequence[Sequence[int]], outputs: Optional[Sequence[Sequence[int]]],
                  vocab: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_mask[B, V] bool, output_counts[B, V] int32) from token-id lists."""
    B = len(prompts)
    outputs = outputs if outputs is not None else [[] for _ in range(B)]
    if len(outputs) != B:
        raise InputError("outputs", f"{len(outputs)} lists", f"{B} (one per prompt)")
    flat_p, flat_o = [], []  # row * vocab + id, for one scatter each (one copy, not one per row)
    for b, (p, o) in enumerate(zip(prompts, outputs)):
        for name, ids, flat in (("prompts", p, flat_p), ("outputs", o, flat_o)):
            if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
                raise InputError(f"{name}[{b}]", "a token id outside the vocabulary", f"ids in [0, {vocab})")
            flat.extend(b * vocab + t for t in ids)
    mask = torch.zeros((B, vocab), dtype=torch.bool, device=device)
    counts = torch.zeros((B, vocab), dtype=torch.int32, device=device)
    if flat_p:
        mask.view(-1)[to_device(flat_p, torch.int64, device)] = True
    if flat_o:
        idx = to_device(flat_o, torch.int64, device)
        counts.view(-1).scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
    return mask, counts


def update_output_counts(output_counts: torch.Tensor, new_ids: torch.Tensor,
                         valid: Optional[torch.Tensor] = None) -> None:
    """output_counts[b, new_ids[b]] += 1 for each row (where ``valid[b]``), on the device."""
    inc = torch.ones_like(new_ids, dtype=output_counts.dtype)
    if valid is not None:
        inc = inc * valid.to(inc.dtype)
    output_counts.scatter_add_(1, new_ids.to(torch.int64)[:, None], inc[:, None])
