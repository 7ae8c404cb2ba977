"""Backend registrations of the ``grammar_mask`` op (grammar bitmask apply).

Entry ``apply_bitmask(logits[B, V], bitmask[B, ceil(V/32)] int32, rows=None) -> None`` in place;
contract in ``opmap.ops.grammar.reference``. The XGrammar glue (compile, matchers, bitmask fill)
is ``opmap.engine.structured``. Importing this module imports no kernel and no peer.
"""
from __future__ import annotations

from opmap.core import registry
from opmap.core.registry import Backend, Basis

registry.register(Backend(
    op="grammar_mask", name="reference", provider="torch", version=registry.torch_version,
    priority=dict(registry.REFERENCE_PRIORITY), basis=registry.REFERENCE_BASIS,
    impl={"apply_bitmask": "opmap.ops.grammar.reference:apply_bitmask"},
    notes="unpacks the bits to a bool mask, then masked_fill (-inf where the bit is clear)",
))

registry.register(Backend(
    op="grammar_mask", name="triton", provider="opmap-triton", version=registry.triton_version,
    priority={"cpu": registry.TRITON_CPU_PRIORITY, "sm80": 50, "sm90": 50},
    impl={"apply_bitmask": "opmap.kernels.grammar.bitmask:apply_bitmask"},
    available=registry.triton_available,
    notes="reads the packed words, writes -inf only where a bit is clear (never reads the logits)",
))

registry.register(Backend(
    op="grammar_mask", name="xgrammar", provider="xgrammar", version=registry.package_version("xgrammar"),
    priority={"cpu": 50, "sm80": 40, "sm89": 40, "sm90": 40, "sm100": 40},
    basis={"sm90": Basis("not timed: xgrammar was missing from the baseline run; below ours, which writes only the "
                         "masked entries and never reads the logits")},
    impl={"apply_bitmask": "opmap.peers.grammar.xgrammar_apply:apply_bitmask"},
    available=registry.package_available("xgrammar"),
    notes="xgrammar.apply_token_bitmask_inplace (its CUDA/Triton kernel on a GPU, its C++ on a CPU)",
))
