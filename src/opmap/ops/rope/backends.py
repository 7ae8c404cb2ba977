"""Backend registrations of the rope family (entry "rope", in place on q and k).

HF transformers' apply_rotary_pos_emb is a benchmark peer (opmap.harness.bench.cases.rope), not a
backend: it is out of place and NeoX-only.
"""
from opmap.core import registry
from opmap.core.registry import Backend, Req

_FLOAT = ("fp32", "fp16", "bf16")

registry.register(Backend(
    op="rope", name="reference", provider="torch", version=registry.torch_version,
    priority=dict(registry.REFERENCE_PRIORITY), basis=registry.REFERENCE_BASIS,
    impl={"rope": "opmap.ops.rope.reference:rope"},
    reqs=[Req("dtype", _FLOAT), Req("style", ("neox", "gptj")), Req("scaling", ("none", "linear", "llama3", "yarn")),
          Req("rotary_dim", lambda r: r is not None and r > 0 and r % 2 == 0, "rotary_dim even")],
    notes="plain PyTorch, fp32 math; scaling is folded into the cos/sin cache (cos_sin_cache)",
))

registry.register(Backend(
    op="rope", name="triton", provider="opmap-triton", version=registry.triton_version,
    priority={"cpu": registry.TRITON_CPU_PRIORITY, "sm80": 50, "sm89": 50, "sm90": 50},
    impl={"rope": "opmap.kernels.rope.triton_rope:rope"},
    reqs=[Req("dtype", _FLOAT), Req("style", ("neox", "gptj")), Req("scaling", ("none", "linear", "llama3", "yarn")),
          Req("rotary_dim", lambda r: r is not None and r > 0 and r % 2 == 0, "rotary_dim even")],
    available=registry.triton_available,
    notes="q and k of one token in one program, in place; any position ids; partial rotary",
))
