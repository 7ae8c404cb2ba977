"""Backend registrations of the norm family (op "rmsnorm": entries rmsnorm / add_rmsnorm /
qk_rmsnorm, the per-head q/k norm of Qwen3 in place).

Import is cheap: impl strings are resolved on first call, so neither Triton nor a peer is
imported here.
"""
from opmap.core import registry
from opmap.core.registry import Backend, Basis, Evidence, Req

_FLOAT = ("fp32", "fp16", "bf16")

registry.register(Backend(
    op="rmsnorm", name="reference", provider="torch", version=registry.torch_version,
    priority=dict(registry.REFERENCE_PRIORITY), basis=registry.REFERENCE_BASIS,
    impl={"rmsnorm": "opmap.ops.norm.reference:rmsnorm", "add_rmsnorm": "opmap.ops.norm.reference:add_rmsnorm",
          "qk_rmsnorm": "opmap.ops.norm.reference:qk_rmsnorm"},
    reqs=[Req("dtype", _FLOAT)],
    notes="plain PyTorch, fp32 math, HF LlamaRMSNorm numerics (cast to x.dtype before the weight multiply)",
))

registry.register(Backend(
    op="rmsnorm", name="triton", provider="opmap-triton", version=registry.triton_version,
    priority={"cpu": registry.TRITON_CPU_PRIORITY, "sm80": 50, "sm89": 50, "sm90": 50},
    basis={"sm90": Basis("HF's rounding (torch's rms_norm multiplies by the weight before the cast) and faster than "
                         "torch's rms_norm in every row",
                         tuple(Evidence("h200/norm", f"R={r},H={h},fused_add={a},dtype=bf16", p)
                               for r, h, a in ((8192, 8192, 0), (1, 4096, 1))
                               for p in ("opmap-triton", "torch-rms_norm")))},
    impl={"rmsnorm": "opmap.kernels.norm.triton_norm:rmsnorm", "add_rmsnorm": "opmap.kernels.norm.triton_norm:add_rmsnorm",
          "qk_rmsnorm": "opmap.kernels.norm.triton_norm:qk_rmsnorm"},
    reqs=[Req("dtype", _FLOAT)],
    available=registry.triton_available,
    notes="one program per row (rows <= 8192 held in registers; wider rows in two passes); "
          "fused add writes the residual in place; HF numerics; int64 row offsets",
))

registry.register(Backend(
    op="rmsnorm", name="torch-rms_norm", provider="torch", version=registry.torch_version,
    priority={"cpu": 20, "sm80": 20, "sm89": 20, "sm90": 20, "sm100": 20},
    impl={"rmsnorm": "opmap.peers.norm.torch_peer:rmsnorm", "add_rmsnorm": "opmap.peers.norm.torch_peer:add_rmsnorm",
          "qk_rmsnorm": "opmap.peers.norm.torch_peer:qk_rmsnorm"},
    reqs=[Req("dtype", _FLOAT)],
    notes="torch.nn.functional.rms_norm (peer); the weight multiply is done before the cast "
          "to x.dtype, so it can differ from HF by one rounding",
))
