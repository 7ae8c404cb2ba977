"""Backend registrations of the activation family (entries silu_mul / gelu_tanh_mul)."""
from opmap.core import registry
from opmap.core.registry import Backend, Basis, Evidence, Req

_FLOAT = ("fp32", "fp16", "bf16")
_ENTRIES = ("silu_mul", "gelu_tanh_mul")

registry.register(Backend(
    op="activation", name="reference", provider="torch", version=registry.torch_version,
    priority=dict(registry.REFERENCE_PRIORITY), basis=registry.REFERENCE_BASIS,
    impl={e: f"opmap.ops.activation.reference:{e}" for e in _ENTRIES},
    reqs=[Req("dtype", _FLOAT), Req("kind", _ENTRIES)],
    notes="plain PyTorch, fp32 math, one rounding",
))

registry.register(Backend(
    op="activation", name="triton", provider="opmap-triton", version=registry.triton_version,
    priority={"cpu": registry.TRITON_CPU_PRIORITY, "sm80": 50, "sm89": 50, "sm90": 50},
    basis={"sm90": Basis("one kernel against torch's two, faster in every row but the narrow MoE expert width "
                         "(R=4096, H=768), where torch was a little ahead",
                         tuple(Evidence("h200/activation", f"kind=silu_mul,R={r},H={h},dtype=bf16", p)
                               for r, h in ((64, 14336), (4096, 14336), (4096, 768))
                               for p in ("opmap-triton", "torch-eager")))},
    impl={e: f"opmap.kernels.activation.triton_act:{e}" for e in _ENTRIES},
    reqs=[Req("dtype", _FLOAT), Req("kind", _ENTRIES)],
    available=registry.triton_available,
    notes="elementwise, fp32 math, int64 row offsets",
))

registry.register(Backend(
    op="activation", name="torch-eager", provider="torch", version=registry.torch_version,
    priority={"cpu": 20, "sm80": 20, "sm89": 20, "sm90": 20, "sm100": 20},
    impl={e: f"opmap.peers.activation.torch_peer:{e}" for e in _ENTRIES},
    reqs=[Req("dtype", _FLOAT), Req("kind", _ENTRIES)],
    notes="peer: F.silu / F.gelu(tanh) then a multiply, in x.dtype (two kernels, HF-style rounding)",
))
