"""opmap: the operator layer of LLM inference.

One function per operator of the map, each dispatching through the selector for its tensors'
device and shapes (``backend=`` forces one): ``opmap.rmsnorm``, ``opmap.attention_decode``,
``opmap.linear``, ``opmap.sample`` ... (the list: ``opmap.api.OPS``; contracts: docs/OPS_API.md).
``import opmap`` also registers them as ``torch.ops.opmap.*`` (torch.library custom ops with fake
implementations, so they run under ``torch.compile(fullgraph=True)`` and CUDA-graph capture).
The selector, the specs and the registry are ``opmap.core.select``, ``opmap.core.specs`` and
``opmap.core.registry``. Importing opmap imports no Triton kernel: each loads on its first call.
"""
__version__ = "0.1.0"

from opmap.api import *  # noqa: E402,F401,F403  (the public ops: opmap.api.__all__)
from opmap.api import __all__, custom_ops as _custom_ops  # noqa: E402,F401
