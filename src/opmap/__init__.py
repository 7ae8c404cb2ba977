"""opmap: the operator layer of LLM inference.

``import opmap`` registers the ops as ``torch.ops.opmap.*`` (torch.library custom ops with fake
implementations, so they run under ``torch.compile(fullgraph=True)`` and CUDA-graph capture):
norms, RoPE, activations, linear, MoE, KV append, attention prefill / decode / merge, MLA decode /
prefill / sparse decode / append, logits processors, sampling and the grammar bitmask. The
selector, the specs and the registry are ``opmap.select``, ``opmap.specs`` and ``opmap.registry``.
"""
__version__ = "0.1.0"

_FAMILIES = ("norm", "rope", "activation", "gemm", "moe", "attention", "mla", "sampling", "grammar")


def _register_custom_ops() -> None:
    import importlib

    for fam in _FAMILIES:
        importlib.import_module(f"opmap.ops.{fam}.custom_ops")


_register_custom_ops()
