"""Backend registrations of the ``grammar_mask`` op (grammar bitmask apply).

Entry ``apply_bitmask(logits[B, V], bitmask[B, ceil(V/32)] int32, rows=None) -> None`` in place;
contract in ``opmap.ops.grammar.reference``. The XGrammar glue (compile, matchers, bitmask fill)
is ``opmap.ops.grammar.structured``. Importing this module imports no kernel and no peer.
"""
from __future__ import annotations

from ... import registry
from ...registry import Backend

registry.register(Backend(
    op="grammar_mask", name="reference", provider="torch", version=registry.torch_version,
    priority=dict(registry.REFERENCE_PRIORITY),
    impl={"apply_bitmask": "opmap.ops.grammar.reference:apply_bitmask"},
    notes="unpacks the bits to a bool mask, then masked_fill (-inf where the bit is clear)",
))
