"""Backend registrations of the ``logits`` (processors) and ``sampling`` ops.

Entry points and their contract: ``opmap.ops.sampling.reference`` (module docstring). User
parameters: ``opmap.ops.sampling.params.SamplingParams``; per-row tensors:
``opmap.ops.sampling.batch.SamplingTensors``; stop handling: ``opmap.ops.sampling.stop``.
Importing this module imports no kernel and no peer (impl strings are resolved on first use).
"""
from __future__ import annotations

from ... import registry
from ...registry import Backend, Check, Req

_REF = "opmap.ops.sampling.reference"

registry.register(Backend(
    op="logits", name="reference", provider="torch", version=registry.torch_version,
    priority=dict(registry.REFERENCE_PRIORITY),
    impl={"apply_penalties": f"{_REF}:apply_penalties", "apply_temperature": f"{_REF}:apply_temperature",
          "apply_filters": f"{_REF}:apply_filters", "logprobs": f"{_REF}:logprobs"},
    notes="plain PyTorch, fp32; apply_filters sorts the vocabulary (the oracle of the support)",
))

registry.register(Backend(
    op="sampling", name="reference", provider="torch", version=registry.torch_version,
    priority=dict(registry.REFERENCE_PRIORITY),
    impl={"sample": f"{_REF}:sample", "filtered_probs": f"{_REF}:filtered_probs"},
    reqs=(Req("cuda_graph", (False,), "eager only (a host loop with one generator per row)"),),
    notes="sort-based exact probabilities (fp64) + torch.multinomial with a generator per row "
          "seeded from (seed, position); slow, the oracle",
))

registry.register(Backend(
    op="sampling", name="triton", provider="opmap-triton", version=registry.triton_version,
    priority={"cpu": registry.TRITON_CPU_PRIORITY, "sm80": 50, "sm90": 50},
    impl={"sample": "opmap.ops.sampling.sampler:sample"},
    available=registry.triton_available,
    notes="one program per row: key bisection for the top-k / top-p boundary (exact ties), "
          "register compaction once <= 2048 candidates remain, Gumbel race with Philox keyed by "
          "(seed, position, token); no sort, no host sync, batch-invariant",
))
