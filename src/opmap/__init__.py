"""opmap: the operator layer of LLM inference.

One function per operator of the map, each dispatching through the selector for its tensors'
device and shapes (``backend=`` forces one): ``opmap.rmsnorm``, ``opmap.attention_decode``,
``opmap.linear``, ``opmap.sample`` ... (the list: ``opmap.api.OPS``; contracts: docs/OPS_API.md).
``import opmap`` also registers them as ``torch.ops.opmap.*`` (torch.library custom ops with fake
implementations, so they run under ``torch.compile(fullgraph=True)`` and CUDA-graph capture).
The selector, the specs and the registry are ``opmap.select``, ``opmap.specs`` and
``opmap.registry``. Importing opmap imports no Triton kernel: each loads on its first call.
"""
__version__ = "0.1.0"

from .api import (add_rmsnorm, append_mla, apply_bitmask, apply_penalties, apply_temperature,  # noqa: E402,F401
                  attention_decode, attention_merge, attention_mixed, attention_prefill, gelu_tanh_mul,
                  kv_append, linear, make_decode_workspace, mla_decode, mla_prefill, mla_sparse_decode, moe,
                  moe_route, qk_rmsnorm, rmsnorm, rope, rope_append, sample, silu_mul)
from .api import OPS, custom_ops as _custom_ops  # noqa: E402,F401

__all__ = list(OPS) + ["make_decode_workspace"]
