"""Backend registrations of the gemm family (entry "linear"; weights bf16/fp16/fp32, weight-only
fp8-e4m3 / int8 with per-output-channel scales, or int4 with group scales). One kernel, one
backend: the weight-only kernels are triton-wo (Triton, any M), gluon-wo (Gluon mma.sync, M <= 32,
sm89+), gluon-wo-wgmma (Gluon warpgroup MMAs, 32 < M <= 64, sm90), triton-w4a16 (int4, any M), gluon-w4a16
(int4, Gluon mma.sync, M <= 16) and,
for many rows, dequant-cublas and scaled-mm; the selector picks among them by the spec's M (GemmSpec.m: the engine plans its decode
steps per batch bucket, so each bucket's M is known)."""
import os

from opmap.core import registry
from opmap.core.registry import Backend, Basis, Check, Evidence, Prefer, Req
from opmap.ops.gemm.quant import int4_group

_FLOAT = ("fp32", "fp16", "bf16")

# Baseline rows the priorities rest on (bench/baselines/h200/gemm.md). That file predates the backend
# per kernel: on quantised weights its `opmap-triton` row is the kernel the case's M selected then
# (gluon-wo at M <= 32, gluon-wo-wgmma at M = 64, triton-wo from M = 256) and `[gl=0]` is triton-wo,
# so each row that names no kernel by itself says which backend's kernel it measured.
H200 = "h200/gemm"
H100 = "h100-80gb-hbm3/gemm"
CASE = "M={m},N={n},K={k},w={w},dtype=bf16"
GATE_UP, QKV, O, DOWN = (28672, 4096), (6144, 4096), (4096, 4096), (4096, 14336)
WGMMA_VS_TRITON = (("opmap-triton", "gluon-wo-wgmma"), ("opmap-triton[gl=0]", "triton-wo"))


def _rows(m: int, shape: tuple, w: str, *providers, base: str = H200) -> tuple:
    """Rows of one case; a provider is a name, or (name, the backend whose kernel it measured)."""
    case = CASE.format(m=m, n=shape[0], k=shape[1], w=w)
    return tuple(Evidence(base, case, *((p,) if isinstance(p, str) else p)) for p in providers)
MANY_ROWS = 128  # rows from which one weight pass serves many rows (dequant-cublas, scaled-mm); engine/runner.py


def _dense(spec):
    if spec.weight_dtype != spec.dtype:
        return f"weight_dtype={spec.weight_dtype} differs from dtype={spec.dtype} (needs dense weights in the activation dtype)"
    return None


def _act_is_dtype(spec):
    if spec.act_dtype != spec.dtype:
        return f"act_dtype={spec.act_dtype} (needs activations in dtype={spec.dtype}, not quantised)"
    return None


def _mult16(spec):
    bad = [f"{d}={getattr(spec, d)}" for d in ("n", "k") if getattr(spec, d) % 16]
    return f"{', '.join(bad)} not a multiple of 16 (cuBLASLt fp8)" if bad else None


def _many_rows(spec):
    return (spec.m or 0) >= MANY_ROWS or (spec.m is None and spec.phase == "prefill")


_SAME_ACT = Check("act_dtype == dtype", _act_is_dtype, "act_dtype")


def fp8_cast_arch(spec):
    """fp8 weights (per channel or per block) refused on sm80, whose fp8 casts are not native: the
    dequantising routes' check, the MoE's too."""
    if spec.weight_dtype in ("fp8", "fp8-block") and spec.arch == "sm80":
        return "fp8 weights on sm80 (the dequantisation casts fp8 natively: sm89+)"
    return None

registry.register(Backend(
    op="gemm", name="reference", provider="torch", version=registry.torch_version,
    priority=dict(registry.REFERENCE_PRIORITY), basis=registry.REFERENCE_BASIS,
    impl={"linear": "opmap.ops.gemm.reference:linear", "linear_act": "opmap.ops.gemm.reference:linear_act",
          "linear_add": "opmap.ops.gemm.reference:linear_add"},
    reqs=[Req("dtype", _FLOAT), Req("weight_dtype", ("fp32", "fp16", "bf16", "fp8", "int8", "int4", "fp8-block"))],
    checks=[_SAME_ACT],
    notes="plain PyTorch fp32 matmul on the dequantised weight",
))

registry.register(Backend(
    op="gemm", name="cublas", provider="cublas", version=registry.torch_version,
    priority={"cpu": 20, "sm80": 40, "sm89": 40, "sm90": 40, "sm100": 40},
    impl={"linear": "opmap.peers.gemm.torch_peer:linear", "linear_add": "opmap.peers.gemm.torch_peer:linear_add"},
    reqs=[Req("dtype", _FLOAT)],
    checks=[Check("weight_dtype == dtype", _dense, "weight_dtype"), _SAME_ACT],
    notes="torch.nn.functional.linear (cuBLAS on a GPU, the CPU BLAS on a CPU); linear_add: addmm (beta 1)",
))

registry.register(Backend(
    op="gemm", name="triton-decode", provider="opmap-triton", version=registry.triton_version,
    # sm90, bf16: above cuBLAS where it is level or ahead (docs/dense.md, Decisions).
    priority={"cpu": registry.TRITON_CPU_PRIORITY, "sm80": 50, "sm89": 50,
              "sm90": Prefer(50, 30, lambda s: s.m is None or s.m <= 32 or s.n >= 16384, "M <= 32 or N >= 16384",
                             Basis("level with cuBLAS at M <= 32 and ahead on the wide N (gate/up, LM head) at "
                                   "M = 64; behind it at M = 64 on QKV, O and down",
                                   _rows(64, QKV, "bf16", ("opmap-triton", "triton-decode"), "cublas")
                                   + _rows(64, GATE_UP, "bf16", ("opmap-triton", "triton-decode"), "cublas")
                                   + _rows(32, QKV, "bf16", ("opmap-triton", "triton-decode"), "cublas")))},
    impl={"linear": "opmap.kernels.gemm.triton_gemm:linear", "linear_act": "opmap.kernels.gemm.triton_gemm:linear_act",
          "linear_add": "opmap.kernels.gemm.triton_gemm:linear_add"},
    reqs=[Req("dtype", _FLOAT),
          Req("m", lambda m: m is not None and m <= 64, "M <= 64 (decode; larger M goes to cuBLAS)")],
    checks=[Check("weight_dtype == dtype", _dense, "weight_dtype"), _SAME_ACT],
    available=registry.triton_available,
    notes="small-M GEMM: many narrow N tiles (split-K when N is small) so that every SM streams weight; "
          "linear_act: a gate/up GEMM with its gated activation in the epilogue (both halves' rows a program); "
          "linear_add: an addend summed into the fp32 result in the epilogue",
))

registry.register(Backend(
    op="gemm", name="triton-wo", provider="opmap-triton", version=registry.triton_version,
    priority={"cpu": registry.TRITON_CPU_PRIORITY, "sm80": 50, "sm89": 50, "sm90": 50},
    impl={"linear": "opmap.kernels.gemm.triton_gemm:linear", "linear_act": "opmap.kernels.gemm.triton_gemm:linear_act",
          "linear_add": "opmap.kernels.gemm.triton_gemm:linear_add"},
    reqs=[Req("dtype", _FLOAT), Req("weight_dtype", ("fp8", "int8"), "weight-only fp8-e4m3 / int8")],
    checks=[_SAME_ACT],
    available=registry.triton_available,
    notes="weight-only fp8/int8 in Triton (_gemm_kernel), any M: the weight tile is converted in registers, "
          "the per-channel scale applied in the epilogue; no dequantised copy. Below the Gluon kernels where "
          "they serve; the route of sm80, fp32 activations, K not a multiple of 16 and steps of unknown M",
))


def _group_multiple_of(tile: int, what: str):
    """The check that a layer's own int4 group (one a row where the format's does not divide k) is a
    multiple of ``tile``."""
    def check(spec):
        g = int4_group(spec.k, spec.group_size)
        return f"group size {g} (k={spec.k}) not a multiple of {tile} ({what})" if g % tile else None

    return check


_group16 = _group_multiple_of(16, "a K tile inside one group")


registry.register(Backend(
    op="gemm", name="triton-w4a16", provider="opmap-triton", version=registry.triton_version,
    priority={"cpu": registry.TRITON_CPU_PRIORITY, "sm80": 50, "sm89": 50, "sm90": 50, "sm100": 50},
    impl={"linear": "opmap.kernels.gemm.w4a16:linear"},
    reqs=[Req("dtype", _FLOAT),
          Req("weight_dtype", ("int4",), "int4 weight-only (W4A16: GPTQ, AWQ, compressed-tensors pack-quantized)")],
    checks=[_SAME_ACT, Check("group size a multiple of 16", _group16, "group_size")],
    available=registry.triton_available,
    notes="int4 weight-only in Triton (_w4a16_kernel), any M: the packed words of a tile read once and split "
          "into nibbles in registers, the MMA on (code - zero) in x's dtype, the group scale applied to each "
          "K tile's fp32 product; split K at decode M; no dequantised copy",
))


def _block_pow2(spec):
    b = spec.group_size or 0
    return None if b >= 16 and b & (b - 1) == 0 else f"block edge {b} (a power of two from 16: whole tiles in a block)"


registry.register(Backend(
    op="gemm", name="triton-fp8-block", provider="opmap-triton", version=registry.triton_version,
    priority={"cpu": registry.TRITON_CPU_PRIORITY, "sm89": 50, "sm90": 50, "sm100": 50},
    impl={"linear": "opmap.kernels.gemm.fp8_block:linear"},
    reqs=[Req("dtype", _FLOAT),
          Req("weight_dtype", ("fp8-block",), "block-wise fp8 weight-only (DeepSeek-V3, Qwen3-FP8: a scale per block)")],
    checks=[_SAME_ACT, Check("block edge a power of two >= 16", _block_pow2, "group_size")],
    available=registry.triton_available,
    notes="block-wise fp8 weight-only in Triton (_fp8_block_kernel), any M: a weight tile inside one block, "
          "converted exactly to x's dtype, the block's scale on the tile's fp32 product; split K at decode M",
))


def _gluon_available():
    """The Gluon kernels run compiled on a CUDA GPU, never in the Triton interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1: Gluon kernels do not run in the Triton interpreter"
    return registry.needs_cuda()


def _k16(spec):
    return f"k={spec.k} not a multiple of 16 (16-byte rows for the async copies)" if spec.k % 16 else None


_GLUON_REQS = [Req("dtype", ("bf16", "fp16"), "bf16 / fp16 activations"),
               Req("weight_dtype", ("fp8", "int8"), "weight-only fp8-e4m3 / int8")]
_GLUON_CHECKS = [_SAME_ACT, Check("K a multiple of 16", _k16, "k")]

registry.register(Backend(
    op="gemm", name="gluon-wo", provider="opmap-triton", version=registry.triton_version,
    # Above triton-wo (50) where it serves (docs/dense.md, Decisions).
    priority={"sm89": 52, "sm90": 52},
    basis={"sm90": Basis("faster than triton-wo on every shape at M <= 32, fp8 and int8",
                         _rows(1, GATE_UP, "fp8", ("opmap-triton", "gluon-wo"), ("opmap-triton[gl=0]", "triton-wo"))
                         + _rows(32, QKV, "fp8", ("opmap-triton", "gluon-wo"), ("opmap-triton[gl=0]", "triton-wo"))
                         + _rows(1, DOWN, "int8", ("opmap-triton", "gluon-wo"), ("opmap-triton[gl=0]", "triton-wo")))},
    impl={"linear": "opmap.kernels.gemm.wo_gluon:linear"},
    reqs=_GLUON_REQS + [Req("m", lambda m: m is not None and m <= 32,
                            "M known and <= 32 (mma.sync: above it each warp re-reads the whole x tile)")],
    checks=_GLUON_CHECKS,
    available=_gluon_available,
    notes="weight-only fp8/int8 in Gluon (_wo_kernel) on mma.sync, sm89+: 16-byte async copies of the weight "
          "tile, fragments converted exactly in registers; bf16 / fp16 activations, 16-byte aligned rows",
))

_group128 = _group_multiple_of(128, "a K tile of 128 inside one group")


registry.register(Backend(
    op="gemm", name="gluon-w4a16", provider="opmap-triton", version=registry.triton_version,
    # sm90: above triton-w4a16 (50) wherever it serves (docs/dense.md, Decisions); below it where
    # nothing was measured.
    priority={"sm80": 45, "sm89": 45, "sm90": 52, "sm100": 45},
    basis={"sm90": Basis("ahead of triton-w4a16 at M = 1 and 16 on gate/up and down",
                         _rows(1, GATE_UP, "int4-g128", "opmap-gluon-w4a16", "opmap-triton-w4a16", base=H100)
                         + _rows(1, DOWN, "int4-g128", "opmap-gluon-w4a16", "opmap-triton-w4a16", base=H100)
                         + _rows(16, GATE_UP, "int4-g128", "opmap-gluon-w4a16", "opmap-triton-w4a16", base=H100)
                         + _rows(16, DOWN, "int4-g128", "opmap-gluon-w4a16", "opmap-triton-w4a16", base=H100))},
    impl={"linear": "opmap.kernels.gemm.w4a16_gluon:linear"},
    reqs=[Req("dtype", ("bf16", "fp16"), "bf16 / fp16 activations"),
          Req("weight_dtype", ("int4",), "int4 weight-only (W4A16: GPTQ, AWQ, compressed-tensors pack-quantized)"),
          Req("m", lambda m: m is not None and m <= 16, "M known and <= 16 (decode; triton-w4a16 serves any M)")],
    checks=[_SAME_ACT, Check("group size a multiple of 128", _group128, "group_size")],
    available=_gluon_available,
    notes="int4 weight-only in Gluon (_w4a16_mma_kernel) on mma.sync: the packed words loaded straight into "
          "the A fragment's registers and split into codes in place (no shared memory), the group scale on "
          "each K tile's fp32 product; M <= 16, bf16 / fp16 activations",
))

registry.register(Backend(
    op="gemm", name="gluon-wo-wgmma", provider="opmap-triton", version=registry.triton_version,
    # Above triton-wo (50) at 32 < M <= 64 on sm90, where the mma.sync kernel lost to the Triton one
    # (docs/dense.md, Decisions).
    priority={"sm90": 52},
    basis={"sm90": Basis("faster than triton-wo at M = 64 in fp8 on every shape; in int8 ahead on QKV and the wide "
                         "N, behind on O and down",
                         _rows(64, GATE_UP, "fp8", *WGMMA_VS_TRITON) + _rows(64, O, "fp8", *WGMMA_VS_TRITON)
                         + _rows(64, GATE_UP, "int8", *WGMMA_VS_TRITON) + _rows(64, DOWN, "int8", *WGMMA_VS_TRITON))},
    impl={"linear": "opmap.kernels.gemm.wo_wgmma:linear"},
    reqs=_GLUON_REQS + [Req("m", lambda m: m is not None and 32 < m <= 64,
                            "M known, 32 < M <= 64 (one 64-token warpgroup MMA; gluon-wo below)")],
    checks=_GLUON_CHECKS,
    available=_gluon_available,
    notes="weight-only fp8/int8 in Gluon (_wo_wgmma_kernel) on Hopper warpgroup MMAs, the converted weight "
          "as the A operand from registers; bf16 / fp16 activations, 16-byte aligned rows",
))

registry.register(Backend(
    op="gemm", name="dequant-cublas", provider="opmap-triton", version=registry.triton_version,
    # Above the weight-only kernels where M >= 128 is known (a decode bucket) or the phase is prefill
    # (on a GPU an engine's prefill step has >= 128 rows: padded to a 128-token bucket, or above the
    # graphs' limit; not with prefill_graph_tokens=0, nor MLA's unpadded prefill): the faster kernel
    # there (docs/dense.md, Decisions). The engine plans its mixed steps of >= 128 rows at M = 128
    # (MANY_ROWS) and the others at M unknown, which only triton-wo serves among the weight-only kernels.
    priority={"cpu": registry.TRITON_CPU_PRIORITY - 1,
              **{a: Prefer(55, 45, _many_rows, "M >= 128, or a prefill step",
                           Basis(f"convention: sm90's rule, not measured on {a}")) for a in ("sm80", "sm89")},
              "sm90": Prefer(55, 45, _many_rows, "M >= 128, or a prefill step", Basis(
                  "faster than triton-wo at M = 256 and 1024 on every Llama-3-8B / Qwen3-8B shape, fp8 and int8",
                  _rows(256, GATE_UP, "fp8", "opmap-dequant-cublas", ("opmap-triton", "triton-wo"))
                  + _rows(1024, O, "fp8", "opmap-dequant-cublas", ("opmap-triton", "triton-wo"))
                  + _rows(256, DOWN, "int8", "opmap-dequant-cublas", ("opmap-triton", "triton-wo"))))},
    impl={"linear": "opmap.kernels.gemm.dequant_cublas:linear"},
    reqs=[Req("dtype", ("bf16", "fp16", "fp32")),
          Req("weight_dtype", ("fp8", "int8", "int4", "fp8-block"), "weight-only fp8-e4m3 / int8 / int4 / block fp8"),
          Req("m", lambda m: m is None or m >= MANY_ROWS, "M >= 128 (prefill: one dequantisation serves many rows)")],
    checks=[_SAME_ACT, Check("fp8 needs sm89+", fp8_cast_arch, "arch")],
    available=registry.triton_available,
    notes="weight-only fp8/int8/int4 for many rows: one Triton pass dequantises the weight into a reused "
          "bf16 scratch buffer, then cuBLAS",
))


def _act_fp8_or_many_rows(spec):
    if spec.act_dtype == "fp8" or (spec.act_dtype == spec.dtype and _many_rows(spec)):
        return None
    return (f"act_dtype={spec.act_dtype} at M={spec.m} ({spec.phase}): activations in {spec.dtype} are quantised "
            f"to fp8 here only from M >= {MANY_ROWS} or in a prefill step (else act_dtype='fp8')")


registry.register(Backend(
    op="gemm", name="scaled-mm", provider="cublaslt-fp8", version=registry.torch_version,
    # Above dequant-cublas (55) for fp8 weights where M >= 128 is known or the phase is prefill, on
    # sm90: the activations are quantised per token (W8A8 dynamic, how vLLM runs fp8 checkpoints)
    # and the GEMM runs on fp8 tensor cores (docs/dense.md, Decisions, the many-rows row);
    # activations given as fp8 (act_dtype="fp8") take it at any M.
    priority={"sm89": 45, "sm100": 45, "sm90": Prefer(60, 45, _many_rows, "M >= 128, or a prefill step", Basis(
        "fp8 weights on fp8 tensor cores, faster than dequant-cublas at M = 256 and 1024 on every Llama-3-8B shape",
        _rows(256, GATE_UP, "fp8", "scaled-mm-fp8-act", "opmap-dequant-cublas")
        + _rows(1024, GATE_UP, "fp8", "scaled-mm-fp8-act", "opmap-dequant-cublas")
        + _rows(256, O, "fp8", "scaled-mm-fp8-act", "opmap-dequant-cublas")))},
    impl={"linear": "opmap.kernels.gemm.scaled_mm:linear"},
    reqs=[Req("dtype", ("bf16", "fp16")), Req("weight_dtype", ("fp8",))],
    checks=[Check("act_dtype fp8, or M >= 128 / a prefill step", _act_fp8_or_many_rows, "act_dtype"),
            Check("N, K multiples of 16", _mult16, "k")],
    available=registry.needs_cuda,
    notes="torch._scaled_mm: x quantised per token to fp8 (one Triton launch), fp8 x fp8 on cuBLASLt "
          "(sm89+); for fp8 weights it serves steps of >= 128 rows (prefill) with bf16 activations too",
))


def _block128(spec):
    if spec.group_size != 128:
        return f"block edge {spec.group_size} (cuBLASLt block scaling takes 128 x 128 blocks only)"
    if spec.k % 512 or spec.n % 16:
        return f"k={spec.k}, n={spec.n} (needs K a multiple of 512: whole rows of four block scales; N of 16)"
    return None


def _many_rows_block(spec):
    if _many_rows(spec):
        return None
    return f"M={spec.m} ({spec.phase}): activations are quantised per token group here only from M >= {MANY_ROWS} or in a prefill step"


registry.register(Backend(
    op="gemm", name="scaled-mm-block", provider="cublaslt-fp8", version=registry.torch_version,
    # above dequant-cublas (55) where its checks hold (M >= 128 or a prefill step): measured faster
    priority={"sm90": 60},
    basis={"sm90": Basis(
        "block fp8 on fp8 tensor cores, faster than dequant-cublas and triton-fp8-block at M = 256 on Llama-3-8B's "
        "gate/up and down",
        _rows(256, GATE_UP, "fp8-block128", "opmap-scaled-mm-block", "opmap-dequant-cublas", "opmap-triton-fp8-block",
              base=H100)
        + _rows(256, DOWN, "fp8-block128", "opmap-scaled-mm-block", "opmap-dequant-cublas", "opmap-triton-fp8-block",
                base=H100))},
    impl={"linear": "opmap.kernels.gemm.scaled_mm:linear_block"},
    reqs=[Req("dtype", ("bf16",)), Req("weight_dtype", ("fp8-block",), "block-wise fp8 (128 x 128 blocks)")],
    checks=[Check("128 x 128 blocks, K a multiple of 512", _block128, "group_size"),
            Check("M >= 128 or a prefill step", _many_rows_block, "m"), _SAME_ACT],
    available=registry.needs_cuda,
    notes="block-wise fp8 on fp8 tensor cores: x quantised per token and 128-channel group (one Triton "
          "launch), torch._scaled_mm with 1 x 128 and 128 x 128 block scales (cuBLASLt, sm90, CUDA 12.9+)",
))
