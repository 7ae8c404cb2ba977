"""``torch.library`` registrations (namespace ``opmap``) so that the sampling stage composes
with torch.compile and CUDA graphs and another engine can call it:

- ``torch.ops.opmap.sample(logits, temperature, top_k, top_p, min_p, seeds, positions) -> (ids, invalid)``
- ``torch.ops.opmap.apply_penalties(logits, prompt_mask, output_counts, repetition, frequency, presence)``
  (mutates ``logits``)
- ``torch.ops.opmap.apply_temperature(logits, temperature)`` (mutates ``logits``)

They run our Triton kernels where Triton can run (a GPU, or the interpreter), else the
reference; both honour the same contract (``opmap.ops.sampling.reference``).
"""
from __future__ import annotations

import torch

from ... import registry

__all__ = ["sample", "apply_penalties", "apply_temperature"]


def _impl(triton_mod: str, name: str):
    import importlib

    mod = triton_mod if registry.triton_available() is None else "opmap.ops.sampling.reference"
    return getattr(importlib.import_module(mod), name)


@torch.library.custom_op("opmap::sample", mutates_args=())
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl("opmap.ops.sampling.sampler", "sample")(logits, temperature, top_k, top_p, min_p, seeds, positions)


@sample.register_fake
def _(logits, temperature, top_k, top_p, min_p, seeds, positions):
    B = logits.shape[0]
    return logits.new_empty((B,), dtype=torch.int64), logits.new_empty((B,), dtype=torch.bool)


@torch.library.custom_op("opmap::apply_penalties", mutates_args=("logits",))
def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> None:
    _impl("opmap.ops.sampling.processors", "apply_penalties")(logits, prompt_mask, output_counts, repetition,
                                                               frequency, presence)


@apply_penalties.register_fake
def _(logits, prompt_mask, output_counts, repetition, frequency, presence):
    return None


@torch.library.custom_op("opmap::apply_temperature", mutates_args=("logits",))
def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> None:
    _impl("opmap.ops.sampling.processors", "apply_temperature")(logits, temperature)


@apply_temperature.register_fake
def _(logits, temperature):
    return None
