"""Backend registrations of the ``logits`` (processors) and ``sampling`` ops.

Entry points and their contract: ``opmap.ops.sampling.reference`` (module docstring). User
parameters: ``opmap.engine.params.SamplingParams``; per-row tensors:
``opmap.engine.sampling_tensors.SamplingTensors``; stop handling: ``opmap.engine.stop``.
Importing this module imports no kernel and no peer (impl strings are resolved on first use).
"""
from __future__ import annotations

from opmap.core import registry
from opmap.core.registry import Backend, Basis, Check, Evidence, Prefer, Req

_REF = "opmap.ops.sampling.reference"
# Baseline cases the priorities rest on (bench/baselines/h200/sampling.md).
UNFILTERED = "B=64,vocab=128256,filter=none,dtype=fp32"
FILTERED = ("B=64,vocab=128256,filter=top_k+top_p,dtype=fp32", "B=1,vocab=128256,filter=top_k+top_p,dtype=fp32")


def _rows(cases, *providers) -> tuple:
    return tuple(Evidence("h200/sampling", c, p) for c in cases for p in providers)


def _unfiltered(spec) -> bool:
    return not (spec.top_k or spec.top_p or spec.min_p)

registry.register(Backend(
    op="logits", name="reference", provider="torch", version=registry.torch_version,
    priority=dict(registry.REFERENCE_PRIORITY), basis=registry.REFERENCE_BASIS,
    impl={"apply_penalties": f"{_REF}:apply_penalties", "apply_temperature": f"{_REF}:apply_temperature",
          "apply_filters": f"{_REF}:apply_filters", "logprobs": f"{_REF}:logprobs"},
    notes="plain PyTorch, fp32; apply_filters sorts the vocabulary (the oracle of the support)",
))

registry.register(Backend(
    op="sampling", name="reference", provider="torch", version=registry.torch_version,
    priority=dict(registry.REFERENCE_PRIORITY), basis=registry.REFERENCE_BASIS,
    impl={"sample": f"{_REF}:sample", "filtered_probs": f"{_REF}:filtered_probs"},
    notes="exact support by a stable sort (fp64), then the exponential race with the kernel's "
          "Philox stream written in PyTorch (philox.py): same tokens as the Triton sampler; slow",
))

registry.register(Backend(
    op="sampling", name="triton", provider="opmap-triton", version=registry.triton_version,
    priority={"cpu": registry.TRITON_CPU_PRIORITY, "sm80": 50, "sm90": 50},
    basis={"sm90": Basis("faster than the torch samplers in every row",
                         _rows((UNFILTERED, *FILTERED), "opmap-triton", "torch-sort", "torch-race"))},
    impl={"sample": "opmap.kernels.sampling.sampler:sample"},
    available=registry.triton_available,
    notes="one program per row: key bisection for the top-k / top-p boundary (exact ties), "
          "register compaction once <= 2048 candidates remain, Gumbel race with Philox keyed by "
          "(seed, position, token); no sort, no host sync, batch-invariant",
))

registry.register(Backend(
    op="logits", name="triton", provider="opmap-triton", version=registry.triton_version,
    priority={"cpu": registry.TRITON_CPU_PRIORITY, "sm80": 50, "sm90": 50},
    impl={"apply_penalties": "opmap.kernels.sampling.processors:apply_penalties",
          "apply_temperature": "opmap.kernels.sampling.processors:apply_temperature",
          "apply_filters": f"{_REF}:apply_filters", "logprobs": f"{_REF}:logprobs"},
    available=registry.triton_available,
    notes="Triton kernels for apply_penalties and apply_temperature (elementwise); apply_filters "
          "and logprobs are the shared PyTorch code (the sampler filters inside its own kernel)",
))

_UNSEEDED = (
    Req("seeded", (False,), "unseeded only (one generator for the whole batch)"),
    Req("batch_invariant", (False,), "a row's token depends on the batch (shared generator)"),
    Req("cuda_graph", (False,), "eager only (host-side checks of the batch's parameters)"),
)

registry.register(Backend(
    op="sampling", name="torch-sort", provider="torch-sort", version=registry.torch_version,
    priority={"cpu": 20, "sm80": 5, "sm89": 5, "sm90": 5, "sm100": 5},
    impl={"sample": "opmap.peers.sampling.torch_peers:sample_sort"},
    reqs=_UNSEEDED,
    notes="sort + cumsum + mask + torch.multinomial: the fallback engines use",
))

registry.register(Backend(
    op="sampling", name="torch-race", provider="torch-race", version=registry.torch_version,
    # Above torch-sort only where no filter applies: with a filter the race sorts the support as well.
    priority={"cpu": 30, "sm80": 10, "sm89": 10, "sm100": 10,
              "sm90": Prefer(10, 4, _unfiltered, "no top-k / top-p / min-p filter", Basis(
                  "faster than the sort with no filter, slower with one",
                  _rows((UNFILTERED, *FILTERED), "torch-race", "torch-sort")))},
    impl={"sample": "opmap.peers.sampling.torch_peers:sample_race"},
    reqs=_UNSEEDED,
    notes="argmax(p / Exp(1)) over the support; the support sorts only when a row has a filter",
))


def _one_filter_family(spec):
    if spec.min_p and (spec.top_k or spec.top_p):
        return "min_p together with top_k/top_p is not one FlashInfer kernel"
    if spec.top_k and spec.top_p:
        return ("top_k + top_p: FlashInfer's 'joint' order keeps another support than ours "
                "(top-p renormalised over top-k); its 'top_k_first' JIT build did not finish")
    return None


registry.register(Backend(
    op="sampling", name="flashinfer", provider="flashinfer", version=registry.package_version("flashinfer-python"),
    priority={"sm80": 40, "sm89": 40, "sm90": 40, "sm100": 40},
    basis={"sm90": Basis("not timed: FlashInfer was missing from the baseline run; below ours and above the torch "
                         "samplers, which sort or race over the whole vocabulary in several launches")},
    impl={"sample": "opmap.peers.sampling.flashinfer_peer:sample",
          "sample_joint": "opmap.peers.sampling.flashinfer_peer:sample_joint"},
    reqs=_UNSEEDED,
    checks=(Check("one filter kind per batch (top-k, top-p or min-p)", _one_filter_family, "top_k"),),
    available=registry.all_of(registry.needs_cuda, registry.package_available("flashinfer")),
    notes="FlashInfer rejection sampling from probabilities (softmax first, in PyTorch)",
))
