"""Backend registrations of the moe family.

Every backend serves the two entries of docs/OPS_API.md: ``moe`` (routed experts: route,
dispatch, gate/up GEMM, SiLU-and-mul, down GEMM, weighted combine) and ``route``. The torch
backends share one fp32 routing function (``routing.route``); ours fuses the same rules into one
Triton kernel (``route_triton.route``, tested to pick the same experts), and at decode sizes the
routing and the align by expert into one launch (``route_align.py``: kernels/moe/triton_moe.py).
Quantised experts (int4 with group scales, block fp8) are served by ``triton`` (the grouped GEMM
reads them as stored) and the reference; the torch peers take experts in x's dtype only.
Importing this module imports no kernel module and no peer.
"""
from __future__ import annotations

from typing import Optional

from opmap.core import registry
from opmap.core.registry import Backend, Basis, Check, Evidence, Prefer, Req
from opmap.ops.gemm.backends import fp8_cast_arch

_ROUTE = "opmap.ops.moe.routing:route"
_FLOAT = ("fp32", "fp16", "bf16")
_ROUTERS = ("softmax", "sigmoid", "sigmoid_grouped")

# Baseline cases the priorities rest on (bench/baselines/h200/moe.md): decode and prefill sizes of
# Mixtral-8x7B and Qwen3-30B-A3B.
MIXTRAL = "model=mixtral-8x7b,T={},E=8,k=2,H=4096,I=14336,hit={},dtype=bf16"
QWEN3 = "model=qwen3-30b-a3b,T={},E=128,k=8,H=2048,I=768,hit={},dtype=bf16"
CASES = {"mixtral T=1": MIXTRAL.format(1, 2), "mixtral T=4096": MIXTRAL.format(4096, 8),
         "qwen3 T=64": QWEN3.format(64, 126), "qwen3 T=4096": QWEN3.format(4096, 128)}


def _rows(cases, *providers) -> tuple:
    return tuple(Evidence("h200/moe", CASES[c], p) for c in cases for p in providers)


def _top_k_le_experts(spec):
    if not 1 <= spec.top_k <= spec.num_experts:
        return f"top_k={spec.top_k} outside 1..num_experts={spec.num_experts}"
    return None


_COMMON_CHECKS = (
    Check("1 <= top_k <= num_experts", _top_k_le_experts, "top_k"),
)
_COMMON_REQS = (
    Req("dtype", _FLOAT),
    Req("router", _ROUTERS),
    # fp8 / int8 expert weights are not served; the entry takes the weights in x.dtype
    # (MoESpec's weight_dtype defaults to bf16 whatever dtype says, so only its kind is checked).
    Req("weight_dtype", _FLOAT, "float expert weights in x.dtype (no int4 / block fp8)"),
)


def _span(spec):
    g = spec.group_size
    if spec.weight_dtype in QUANT_EXPERTS and (not g or g % 16 or (spec.weight_dtype == "fp8-block" and g & (g - 1))):
        return f"group_size={g} (a multiple of 16; for block fp8 a power of two: a K tile inside one span)"
    return None


QUANT_EXPERTS = ("int4", "fp8-block")  # the formats routed experts are served in as stored
_QUANT_REQS = tuple(r for r in _COMMON_REQS if r.field != "weight_dtype") + (
    Req("weight_dtype", _FLOAT + QUANT_EXPERTS, "experts in x.dtype, int4 (group scales) or block fp8"),)
_QUANT_CHECKS = _COMMON_CHECKS + (Check("group / block a multiple of 16", _span, "group_size"),)
_TRITON_QUANT_CHECKS = _QUANT_CHECKS + (Check("block fp8 needs sm89+", fp8_cast_arch, "arch"),)


def _grouped_mm_cuda_dtype(spec):
    # The CUTLASS grouped GEMM behind torch._grouped_mm takes bf16 only on CUDA; the CPU
    # build has a kernel for every float dtype.
    if spec.arch != "cpu" and spec.dtype != "bf16":
        return f"dtype={spec.dtype}: torch._grouped_mm on CUDA takes bf16 only"
    return None


def _rows_of_16_bytes(spec, who: str):
    """Why ``who`` cannot read the experts' rows (hidden and intermediate not in 16-byte rows), or None."""
    per16 = 4 if spec.dtype == "fp32" else 8
    if spec.hidden % per16 or spec.intermediate % per16:
        return (f"hidden={spec.hidden}, intermediate={spec.intermediate}: {who} needs both to be multiples "
                f"of {per16} for {spec.dtype} (16-byte rows)")
    return None


def _grouped_mm_alignment(spec):
    # Row strides of both operands must be multiples of 16 bytes (CPU and CUDA kernels alike).
    return _rows_of_16_bytes(spec, "torch._grouped_mm")


def _grouped_mm_available() -> Optional[str]:
    """Whether this process's torch has torch._grouped_mm for its GPU (any CPU build that has it)."""
    import torch  # heavy: importing the registry imports no framework

    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 0):
            return f"torch._grouped_mm needs sm80 or newer (this GPU is sm{major}{minor})"
        if major != 9 and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 9):
            return f"torch {torch.__version__}: torch._grouped_mm is sm90-only before torch 2.9"
    return None


registry.register(Backend(
    op="moe", name="reference", provider="torch", version=registry.torch_version,
    priority=dict(registry.REFERENCE_PRIORITY), basis=registry.REFERENCE_BASIS,
    impl={"moe": "opmap.ops.moe.reference:moe", "route": _ROUTE},
    reqs=_QUANT_REQS, checks=_QUANT_CHECKS,
    notes="fp32 per-expert loop (gather, gate/up, SiLU*up, down, weighted scatter-add); the oracle",
))

registry.register(Backend(
    op="moe", name="torch-loop", provider="torch", version=registry.torch_version,
    # The fallback engines use when no grouped kernel exists: on GPUs below our kernels.
    priority={"cpu": 50, "sm80": 20, "sm89": 20, "sm90": 20, "sm100": 20},
    impl={"moe": "opmap.peers.moe.torch_loop:moe", "route": _ROUTE},
    reqs=_COMMON_REQS, checks=_COMMON_CHECKS,
    notes="per-expert loop of cuBLAS GEMMs in the input dtype; one host sync for the expert counts",
))

registry.register(Backend(
    op="moe", name="torch-grouped-mm", provider="torch", version=registry.torch_version,
    priority={"cpu": 40, "sm80": 30, "sm90": 40, "sm100": 40},
    basis={"sm90": Basis("ahead of the per-expert loop in every row but Mixtral's 4096-token prefill",
                         _rows(("mixtral T=1", "qwen3 T=64", "mixtral T=4096"), "torch-grouped-mm", "torch-loop"))},
    impl={"moe": "opmap.peers.moe.torch_grouped:moe", "route": _ROUTE},
    reqs=_COMMON_REQS,
    checks=_COMMON_CHECKS + (
        Check("CUDA: bf16 only", _grouped_mm_cuda_dtype, "dtype"),
        Check("hidden, intermediate: 16-byte rows", _grouped_mm_alignment, "hidden"),
    ),
    available=_grouped_mm_available,
    notes="torch._grouped_mm (CUTLASS grouped GEMM); no host sync",
))

registry.register(Backend(
    op="moe", name="triton", provider="opmap-triton", version=registry.triton_version,
    priority={"cpu": registry.TRITON_CPU_PRIORITY, "sm80": 50, "sm90": 50},
    basis={"sm90": Basis("ahead of torch's grouped GEMM and expert loop at decode sizes of both models and at "
                         "Qwen3-30B-A3B's prefill; behind both at Mixtral's 4096-token prefill",
                         _rows(tuple(CASES), "opmap-triton", "torch-grouped-mm", "torch-loop"))},
    impl={"moe": "opmap.kernels.moe.triton_moe:moe", "route": "opmap.kernels.moe.route_triton:route",
          "warm_up": "opmap.kernels.moe.triton_moe:warm_up"},
    reqs=_QUANT_REQS, checks=_TRITON_QUANT_CHECKS,
    available=registry.triton_available,
    notes="routing and the device-side align by expert padded to the row tile (one launch at decode sizes: "
          "<= 64 tokens, no group-limited routing; two above), grouped GEMM gate/up with fused SiLU*mul, "
          "grouped GEMM down with the routing weight in its epilogue, fp32 combine; no host sync; int4 / block "
          "fp8 experts read as stored (codes converted exactly in registers, scales on each K tile's product)",
))

# Rows an expert meets (tokens x top_k / experts) from which the quantised experts are dequantised
# once per call (dequant-triton) rather than converted tile by tile in the grouped GEMM: the pass
# costs the same whatever the rows, the conversion repeats per row tile (docs/moe.md, Decisions: the
# many-token route). Counted in rows an expert, not tokens: the measured crossovers of Mixtral's 8
# experts and Qwen3-30B-A3B's 128 fall at about the same rows an expert (about 200), so the threshold
# is 1024 tokens for the one and 4096 for the other. Unknown token counts keep the stored-format kernel.
MANY_ROWS_AN_EXPERT = 256
H100_MOE = "h100-80gb-hbm3/moe"
QUANT_CASE = "model={},T={},E={},k={},H={},I={},hit={},w={},dtype=bf16"


def many_tokens(num_experts: int, top_k: int) -> int:
    """The fewest tokens a call needs for each expert to meet MANY_ROWS_AN_EXPERT rows on average."""
    return -(-MANY_ROWS_AN_EXPERT * num_experts // top_k)


def _many_rows_an_expert(spec):
    return spec.tokens is not None and spec.tokens >= many_tokens(spec.num_experts, spec.top_k)


def _quant_rows(*cases) -> tuple:
    return tuple(Evidence(H100_MOE, QUANT_CASE.format(*c), p) for c in cases
                 for p in ("opmap-dequant-triton+graph", "opmap-triton+graph"))


def _quantised(spec):
    if spec.weight_dtype not in QUANT_EXPERTS:
        return f"weight_dtype={spec.weight_dtype} (this route dequantises int4 / block-fp8 experts; " \
               "16-bit ones go to triton)"
    return None


registry.register(Backend(
    op="moe", name="dequant-triton", provider="opmap-triton", version=registry.triton_version,
    # Above triton where each expert meets many rows (a known token count), below it otherwise; the
    # reference keeps the CPU.
    priority={"cpu": registry.TRITON_CPU_PRIORITY - 1,
              "sm80": Prefer(55, 45, _many_rows_an_expert, f"tokens x top_k >= {MANY_ROWS_AN_EXPERT} x experts",
                             Basis("convention: sm90's rule, not measured on sm80")),
              "sm90": Prefer(55, 45, _many_rows_an_expert, f"tokens x top_k >= {MANY_ROWS_AN_EXPERT} x experts", Basis(
                  "ahead of the stored-format kernel at 4096 tokens (1024 rows an expert in Mixtral, 256 in "
                  "Qwen3-30B-A3B) in both formats, behind it at 512 tokens (128 and 32 rows an expert)",
                  _quant_rows(("mixtral-8x7b", 4096, 8, 2, 4096, 14336, 8, "int4-g128"),
                              ("mixtral-8x7b", 512, 8, 2, 4096, 14336, 8, "fp8-block128"),
                              ("qwen3-30b-a3b", 4096, 128, 8, 2048, 768, 128, "fp8-block128"),
                              ("qwen3-30b-a3b", 512, 128, 8, 2048, 768, 128, "int4-g128"))))},
    impl={"moe": "opmap.kernels.moe.dequant_moe:moe", "route": "opmap.kernels.moe.route_triton:route",
          "warm_up": "opmap.kernels.moe.dequant_moe:warm_up"},
    reqs=_QUANT_REQS, checks=_TRITON_QUANT_CHECKS + (Check("int4 or block-fp8 experts", _quantised, "weight_dtype"),),
    available=registry.triton_available,
    notes="int4 / block-fp8 experts dequantised by one Triton pass each into reused 16-bit scratch "
          "(gate/up and down), then the triton backend's routing and grouped GEMMs on them",
))


def _tma_rows(spec):
    return _rows_of_16_bytes(spec, "TMA")


registry.register(Backend(
    op="moe", name="triton-tma", provider="opmap-triton", version=registry.triton_version,
    # Below triton until a baseline row shows where it wins; the reference keeps the CPU.
    priority={"cpu": registry.TRITON_CPU_PRIORITY - 2, "sm90": 45},
    basis={"sm90": Basis("convention: below triton until its prefill rows are in the baseline")},
    impl={"moe": "opmap.kernels.moe.tma_moe:moe", "route": "opmap.kernels.moe.route_triton:route"},
    reqs=_COMMON_REQS, checks=_COMMON_CHECKS + (Check("hidden, intermediate: 16-byte TMA rows", _tma_rows, "hidden"),),
    available=registry.triton_available,
    notes="the many-token route: routing, the align by expert, the routed rows permuted once into contiguous "
          "expert blocks, persistent grouped GEMMs whose tiles are TMA loads (gate/up with fused SiLU*mul, "
          "stored by TMA in the same order; down with the routing weight, stored at each pair), fp32 combine; "
          "no host sync",
))
