"""The public op API: one function per operator of the map, each dispatching through the
selector for its tensors' device and shapes (``backend=`` forces one). ``opmap`` re-exports
them; ``opmap.api.custom_ops`` registers them as ``torch.ops.opmap.*``."""
from opmap.api.attention import (attention_decode, attention_merge, attention_mixed, attention_prefill,  # noqa: F401
                        make_decode_workspace, mla_decode, mla_prefill, mla_sparse_decode)
from opmap.api.dense import (add_rmsnorm, append_mla, gelu_tanh_mul, kv_append, linear, moe, moe_route,  # noqa: F401
                    qk_rmsnorm, rmsnorm, rope, rope_append, silu_mul)
from opmap.api.dispatch import resolve  # noqa: F401
from opmap.api.sampling import apply_bitmask, apply_penalties, apply_temperature, sample  # noqa: F401

OPS = ("rmsnorm", "add_rmsnorm", "qk_rmsnorm", "rope", "rope_append", "kv_append", "append_mla", "silu_mul",
       "gelu_tanh_mul", "linear", "moe", "moe_route", "attention_prefill", "attention_mixed", "attention_decode",
       "attention_merge", "mla_decode", "mla_prefill", "mla_sparse_decode", "apply_penalties", "apply_temperature",
       "sample", "apply_bitmask")
__all__ = [*OPS, "make_decode_workspace"]
