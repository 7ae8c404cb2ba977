"""Backend registrations of the attention family: ops "kv_append" (kind gqa), "attention"
(MHA/GQA/MQA; prefill / decode / mixed) and "attention_merge".

Declarations only: importing this module imports no kernel module and no peer package (the
``impl`` strings are resolved on first call). MLA lives in ``opmap.ops.mla``.
"""
from __future__ import annotations

import os
from typing import Optional

from opmap.core.registry import (REFERENCE_BASIS, REFERENCE_PRIORITY, TRITON_CPU_PRIORITY, Backend, Basis, Check,
                                 Evidence, Prefer, Req, needs_cuda, package_available, package_version, register,
                                 torch_version, triton_available, triton_version)

NOT_MLA = Req("kind", ("mha", "gqa", "mqa"), "kind in {mha, gqa, mqa} (MLA: opmap.ops.mla)")
TRITON_PRIORITY = {"cpu": TRITON_CPU_PRIORITY, "sm80": 50, "sm90": 50}
TRITON_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)
TMA_BLOCK_N = 64  # the TMA prefill's key tile on a GPU (kernels/attention/common._default_config)

# Baseline rows the priorities rest on (bench/baselines/h200/attention.md). That file predates the
# backend per kernel: its `opmap-triton` row is the kernel its case selected then, so each row that
# names no kernel by itself says which backend's kernel it measured.
H200 = "h200/attention"
PREFILL_MHA_64 = "B=1,S=8192,h=32/32,d=128,page=64,causal,dtype=bf16"
PREFILL_GQA_64 = "B=4,S=4096,h=32/8,d=128,page=64,causal,dtype=bf16"
PREFILL_MHA_16 = "B=1,S=8192,h=32/32,d=128,page=16,causal,dtype=bf16"
DECODE_64 = "B=64,kv=4096,h=32/8,d=128,page=16,dtype={}"
DECODE_128 = "B=128,kv=2048,h=32/8,d=128,page=16,dtype={}"
DECODE_1 = "B=1,kv=32768,h=32/8,d=128,page=16,dtype={}"


def _rows(case: str, *providers) -> tuple:
    """Rows of one case; a provider is a name, or (name, the backend whose kernel it measured)."""
    return tuple(Evidence(H200, case, *((p,) if isinstance(p, str) else p)) for p in providers)


TMA_VS_GATHER = (("opmap-triton", "triton-tma"), ("opmap-triton[tma=0]", "triton"))
GLUON_VS_TRITON = (("opmap-triton", "gluon-fp8"), ("opmap-triton[gl=0]", "triton"))


def _kv_same_or_fp8(spec):
    if spec.kv_dtype not in (spec.dtype, "fp8"):
        return f"kv_dtype={spec.kv_dtype} with dtype={spec.dtype} (needs kv_dtype == dtype or fp8)"
    return None


def _kv_same(spec):
    if spec.kv_dtype != spec.dtype:
        return f"kv_dtype={spec.kv_dtype} differs from dtype={spec.dtype} (needs the same dtype; no fp8 KV)"
    return None


def _dv_same(spec):
    if spec.head_dim_v != spec.head_dim:
        return f"head_dim_v={spec.head_dim_v} != head_dim={spec.head_dim}"
    return None


KV_CHECK = Check("kv_dtype == dtype or fp8 (e4m3, per-kv-head scales)", _kv_same_or_fp8, "kv_dtype")
KV_SAME = Check("kv_dtype == dtype (no fp8 KV)", _kv_same, "kv_dtype")
DV_SAME = Check("head_dim_v == head_dim", _dv_same, "head_dim_v")

# ---- kv_append ------------------------------------------------------------------------------

register(Backend(
    op="kv_append", name="reference", provider="torch", version=torch_version,
    priority=dict(REFERENCE_PRIORITY), basis=REFERENCE_BASIS,
    impl={"append": "opmap.ops.attention.reference:append", "rope_append": "opmap.ops.attention.reference:rope_append"},
    reqs=(Req("kind", ("gqa",), "kind gqa (K and V pages; MLA: opmap.ops.mla)"),
          Req("cuda_graph", (False,), "no CUDA-graph capture (index_put on a boolean selection syncs)")),
    notes="plain PyTorch index_put; fp8 saturates to +-448 and rounds to nearest",
))

register(Backend(
    op="kv_append", name="triton", provider="opmap-triton", version=triton_version,
    priority=dict(TRITON_PRIORITY), available=triton_available,
    # rope_append: RoPE on q, k and this append in one launch (the engine uses it when the rope
    # op chose this backend's name too, so the rope requirements were met by that selection).
    impl={"append": "opmap.kernels.attention.kv_append:append", "rope_append": "opmap.kernels.attention.rope_append:rope_append"},
    reqs=(Req("kind", ("gqa",), "kind gqa (K and V pages; MLA: opmap.ops.mla)"),
          Req("dtype", ("fp32", "fp16", "bf16")),
          Req("page_size", lambda p: 1 <= p <= 4096, "1 <= page_size <= 4096")),
    checks=(KV_CHECK,),
    notes="one program per token; slot -1 = skip, so padded CUDA-graph batches need no special case",
))

# ---- attention --------------------------------------------------------------------------------

register(Backend(
    op="attention", name="reference", provider="torch", version=torch_version,
    priority=dict(REFERENCE_PRIORITY), basis=REFERENCE_BASIS,
    impl={"prefill": "opmap.ops.attention.reference:prefill", "decode": "opmap.ops.attention.reference:decode",
          "mixed": "opmap.ops.attention.reference:mixed"},
    reqs=(NOT_MLA, Req("sparse", (False,), "dense attention only"),
          Req("cuda_graph", (False,), "no CUDA-graph capture (loops over sequences on the host)")),
    checks=(KV_CHECK,),
    notes="fp32 accumulation; a contiguous cache is a paged one with one page per sequence",
))

def _gluon_available() -> Optional[str]:
    """The Gluon kernels run compiled on a CUDA GPU, never in the Triton interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1: Gluon kernels do not run in the Triton interpreter"
    return needs_cuda()


def _group_at_most(n):
    def fn(spec):
        if spec.num_heads // spec.num_kv_heads > n:
            return (f"{spec.num_heads // spec.num_kv_heads} query heads per KV head (at most {n}: a KV head's "
                    "query heads share one tile of query rows)")
        return None

    return fn


def _kv_fp8(spec):
    if spec.kv_dtype != "fp8":
        return f"kv_dtype={spec.kv_dtype} (an fp8 cache only; 16-bit caches: triton)"
    return None


TRITON_COMMON = (NOT_MLA, Req("paged", (True,), "paged KV (contiguous KV: one page per sequence of a listed size)"),
                 Req("sparse", (False,), "dense attention only"))

register(Backend(
    op="attention", name="triton", provider="opmap-triton", version=triton_version,
    priority=dict(TRITON_PRIORITY), available=triton_available,
    impl={"prefill": "opmap.kernels.attention.prefill:prefill", "decode": "opmap.kernels.attention.decode:decode",
          "mixed": "opmap.kernels.attention.mixed:mixed",
          "make_workspace": "opmap.kernels.attention.splitkv:make_workspace"},
    reqs=(*TRITON_COMMON,
          Req("page_size", TRITON_PAGE_SIZES),
          Req("dtype", ("fp32", "fp16", "bf16")),
          Req("head_dim", TRITON_HEAD_DIMS),
          Req("cuda_graph", (False, True), "decode: workspace from make_workspace, allocated before capture"),
          Req("batch_invariant", (False, True),
              "decode: make_workspace(batch_invariant=True) (fixed split size); prefill always")),
    checks=(KV_CHECK, DV_SAME),
    notes=("prefill: FlashAttention-2 style varlen kernel gathering K/V rows through the block table, GQA "
           "heads packed per tile (fp8 caches: pages converted once to q's dtype when a call has many query "
           "rows a sequence, else converted in the kernel); decode: query heads of a KV head packed in one "
           "tile, split-KV planned on the device (static grid, persistent workspace), fp8 tiles converted in "
           "registers; batch_invariant uses a fixed split size in tokens; mixed: both kernels in one step"),
))

# triton-tma and gluon-fp8 rank above triton (50) where they serve, below FlashInfer's prefill (55):
# each is the faster kernel of its phase there (docs/attention.md, Decisions).
register(Backend(
    op="attention", name="triton-tma", provider="opmap-triton", version=triton_version,
    priority={"cpu": TRITON_CPU_PRIORITY - 1, "sm90": 52}, available=triton_available,
    basis={"sm90": Basis("the TMA prefill faster than the gather one on pages of whole 64-key tiles",
                         _rows(PREFILL_MHA_64, *TMA_VS_GATHER) + _rows(PREFILL_GQA_64, *TMA_VS_GATHER))},
    impl={"prefill": "opmap.kernels.attention.prefill_tma:prefill"},
    reqs=(*TRITON_COMMON,
          Req("phase", ("prefill",), "prefill (mixed steps: the gather kernel's, triton)"),
          Req("page_size", lambda p: p in TRITON_PAGE_SIZES and p % TMA_BLOCK_N == 0,
              f"pages holding whole {TMA_BLOCK_N}-key tiles (64, 128)"),
          Req("dtype", ("fp16", "bf16")),
          Req("head_dim", (64, 128), "head_dim 64 or 128 (the tiles its GPU tests cover)")),
    checks=(KV_SAME, DV_SAME),
    notes=("varlen prefill whose K/V tiles are one TMA box each (one page id a tile, no per-row addresses); "
           "the cache's rows 16-byte aligned (an InputError otherwise); the interpreter runs it with small "
           "tiles (cpu: for tests, below triton)"),
))

register(Backend(
    op="attention", name="gluon-ws", provider="opmap-triton", version=triton_version,
    priority={"sm90": 45}, available=_gluon_available,
    basis={"sm90": Basis("convention: below triton until its prefill rows are in the baseline")},
    impl={"prefill": "opmap.kernels.attention.prefill_ws:prefill", "mixed": "opmap.kernels.attention.mixed:mixed_ws",
          "make_workspace": "opmap.kernels.attention.splitkv:make_workspace"},
    reqs=(*TRITON_COMMON,
          Req("phase", ("prefill", "mixed"), "prefill, and mixed steps' chunks (their one-token rows: the Triton "
              "decode)"),
          Req("page_size", (16, 32, 64, 128), "pages of 16 to 128 keys (whole TMA boxes of one page)"),
          Req("dtype", ("fp16", "bf16")),
          Req("head_dim", (64, 128), "head_dim 64 or 128 (the tiles its GPU tests cover)")),
    checks=(KV_SAME, DV_SAME, Check("at most 128 query heads per KV head", _group_at_most(128), "num_heads")),
    notes=("varlen prefill in Gluon with FlashAttention-3's structure: a producer warp issues the K/V TMA boxes "
           "into a ring of stages behind mbarriers, two consumer warpgroups run warpgroup MMAs and overlap each "
           "tile's softmax with the previous tile's P @ V; mixed: the chunks on it, the one-token rows on the "
           "Triton decode (workspace from make_workspace, allocated before capture); sm90 only; the cache's rows "
           "16-byte aligned (an InputError otherwise)"),
))

register(Backend(
    op="attention", name="gluon-fp8", provider="opmap-triton", version=triton_version,
    priority={"sm90": 52}, available=_gluon_available,
    basis={"sm90": Basis("the Gluon decode faster than the Triton one on fp8 caches at head dim 128, at every batch",
                         _rows(DECODE_64.format("fp8"), *GLUON_VS_TRITON)
                         + _rows(DECODE_128.format("fp8"), *GLUON_VS_TRITON)
                         + _rows(DECODE_1.format("fp8"), *GLUON_VS_TRITON))},
    impl={"decode": "opmap.kernels.attention.decode_fp8:decode", "mixed": "opmap.kernels.attention.mixed:mixed_fp8",
          "make_workspace": "opmap.kernels.attention.splitkv:make_workspace"},
    reqs=(*TRITON_COMMON,
          Req("phase", ("decode", "mixed"), "decode, and mixed steps' decode tokens"),
          Req("page_size", TRITON_PAGE_SIZES),
          Req("dtype", ("fp16", "bf16"), "16-bit queries (fp16 dots)"),
          Req("head_dim", (128,), "head_dim 128 (the kernel's layouts)"),
          Req("cuda_graph", (False, True), "workspace from make_workspace, allocated before capture"),
          Req("batch_invariant", (False, True), "make_workspace(batch_invariant=True) (fixed split size)")),
    checks=(Check("an fp8 (e4m3) cache, per-kv-head scales", _kv_fp8, "kv_dtype"), DV_SAME,
            Check("at most 16 query heads per KV head", _group_at_most(16), "num_heads")),
    notes=("decode in Gluon: each 64-key fp8 tile crosses shared memory once, read in 16-byte pieces straight "
           "into the MMA fragments and converted in registers; the Triton decode's split plan, workspace and "
           "merge; mixed: the chunks on the gather prefill (in-kernel fp8 conversion), the one-token rows on "
           "this kernel; cache rows 16-byte aligned (an InputError otherwise)"),
))

_SDPA = (
    # name, provider, SDPBackend member, priority, basis, dtypes, head-dim condition. The SDPA kernels
    # serve contiguous KV only, so they never meet the paged Triton kernels; among themselves and Flex
    # the order is the one measured (docs/attention.md, Decisions).
    ("sdpa_cudnn", "cudnn-sdpa", "CUDNN_ATTENTION", {"sm90": 60},
     {"sm90": Basis("the fastest kernel on contiguous KV: ahead of FlashAttention-2, the memory-efficient "
                    "kernel and Flex in every row where they ran",
                    _rows(PREFILL_MHA_16, "cudnn-sdpa", "torch-sdpa-flash", "torch-sdpa-efficient", "torch-flex")
                    + _rows(DECODE_64.format("bf16"), "cudnn-sdpa", "torch-sdpa-flash"))},
     ("fp16", "bf16"), (lambda d: d % 8 == 0 and d <= 128, "head_dim <= 128, multiple of 8")),
    ("sdpa_flash", "torch-sdpa-flash", "FLASH_ATTENTION", {"sm80": 30, "sm90": 30},
     {"sm90": Basis("ahead of the memory-efficient kernel and Flex on contiguous KV in every row where they ran",
                    _rows(PREFILL_MHA_16, "torch-sdpa-flash", "torch-sdpa-efficient", "torch-flex"))},
     ("fp16", "bf16"), (lambda d: d % 8 == 0 and d <= 256, "head_dim <= 256, multiple of 8")),
    ("sdpa_efficient", "torch-sdpa-efficient", "EFFICIENT_ATTENTION", {"sm80": 20, "sm90": 20}, {},
     ("fp32", "fp16", "bf16"), (lambda d: d % 8 == 0 and d <= 256, "head_dim <= 256, multiple of 8")),
)
CUDNN_PHASES = Req("phase", ("prefill", "decode"),
                   "prefill of whole prompts or decode (no bottom-right causal mask: no chunk over a cached prefix)")
for name, provider, member, prio, basis, dts, (dfn, dtext) in _SDPA:
    register(Backend(
        op="attention", name=name, provider=provider, version=torch_version, priority=prio, basis=basis,
        available=needs_cuda,
        impl={e: f"opmap.peers.attention.sdpa:{name}_{e}" for e in ("prefill", "decode", "mixed")},
        reqs=(NOT_MLA, *((CUDNN_PHASES,) if name == "sdpa_cudnn" else ()),
              Req("paged", (False,), "contiguous KV only ([B, S, Hk, D], one page per sequence)"),
              Req("dtype", dts), Req("head_dim", dfn, dtext),
              Req("sliding_window", (False,), "no sliding window (no mask passed to this backend)"),
              Req("soft_cap", (False,), "no logit soft-cap"),
              Req("sparse", (False,)),
              Req("return_lse", (False,), "no LSE through the public SDPA API"),
              Req("cuda_graph", (False,), "no CUDA-graph capture (per-sequence host loop over lengths)"),
              Req("batch_invariant", (False,), "not batch invariant (kernel heuristics depend on the batch)")),
        checks=(KV_SAME, DV_SAME),
        notes=f"torch.nn.functional.scaled_dot_product_attention under sdpa_kernel({member}); "
              "bottom-right causal via torch.nn.attention.bias.causal_lower_right",
    ))

register(Backend(
    op="attention", name="flex", provider="torch-flex", version=torch_version,
    priority={"cpu": 5, "sm80": 15, "sm90": 15},
    basis={"sm90": Basis("below every other kernel it meets: the slowest in every row where it ran",
                         _rows(DECODE_1.format("bf16"), "torch-flex", ("opmap-triton", "triton"), "cudnn-sdpa",
                               "torch-sdpa-flash")
                         + _rows(PREFILL_MHA_16, "torch-flex", ("opmap-triton", "triton"), "torch-sdpa-efficient"))},
    available=package_available("torch.nn.attention.flex_attention"),
    impl={e: f"opmap.peers.attention.flex:{e}" for e in ("prefill", "decode", "mixed")},
    reqs=(NOT_MLA, Req("dtype", ("fp32", "fp16", "bf16")), Req("head_dim", (64, 128, 256)),
          Req("sparse", (False,)),
          Req("cuda_graph", (False,), "no CUDA-graph capture (block mask built from host lengths per call)"),
          Req("batch_invariant", (False,))),
    checks=(KV_SAME, DV_SAME),
    notes=("FlexAttention over the whole paged cache as one KV sequence, with a block mask mapping "
           "each query to the pages of its sequence; torch.compile on GPU, eager on CPU"),
))

register(Backend(
    op="attention", name="flashinfer", provider="flashinfer", version=package_version("flashinfer-python"),
    # Prefill first on sm90: its FA3-template kernel led ours (plan() and its host synchronisation
    # included), its decode did not, mixed batches were not timed (docs/attention.md, Decisions).
    priority={"sm80": 40, "sm90": Prefer(55, 40, lambda s: s.phase == "prefill", "phase = prefill", Basis(
        "not timed: FlashInfer was missing from the baseline run; in a run with it its prefill led the "
        "Triton kernels and its decode did not (docs/attention.md, Decisions)"))},
    available=package_available("flashinfer"),
    impl={"prefill": "opmap.peers.attention.flashinfer:prefill", "decode": "opmap.peers.attention.flashinfer:decode",
          "mixed": "opmap.peers.attention.flashinfer:prefill"},
    reqs=(NOT_MLA, Req("paged", (True,), "paged KV"), Req("dtype", ("fp16", "bf16")),
          Req("head_dim", (64, 128, 256)), Req("sparse", (False,)),
          Req("cuda_graph", (False,), "no CUDA-graph capture through this adapter (plan() per call)"),
          Req("batch_invariant", (False,))),
    checks=(KV_SAME, DV_SAME),
    notes=("FlashInfer BatchPrefill/BatchDecodeWithPagedKVCacheWrapper (modules built ahead: "
           "scripts/flashinfer/build_aot.sh); checked on the H200 against the references; plan() per call "
           "synchronises the host; fp8 KV not declared: FlashInfer takes one scalar scale per cache, "
           "opmap's fp8 KV has per-kv-head scales"),
))

# ---- attention_merge ---------------------------------------------------------------------------

register(Backend(
    op="attention_merge", name="reference", provider="torch", version=torch_version,
    priority=dict(REFERENCE_PRIORITY), basis=REFERENCE_BASIS, impl={"merge": "opmap.ops.attention.reference:merge"},
))

register(Backend(
    op="attention_merge", name="triton", provider="opmap-triton", version=triton_version,
    priority=dict(TRITON_PRIORITY), available=triton_available,
    impl={"merge": "opmap.kernels.attention.merge:merge"},
    reqs=(Req("dtype", ("fp32", "fp16", "bf16")), Req("head_dim", lambda d: 1 <= d <= 1024, "head_dim <= 1024")),
))
