"""Backend registrations of the MLA family (ops "attention" and "kv_append", kind="mla").

Every declaration here requires kind == "mla", so MLA backends never claim a GQA spec; the GQA
backends (ops/attention) must in turn reject kind == "mla". Names carry an ``mla-`` prefix
because they share the "attention" and "kv_append" ops with the GQA family.

Spec mapping: head_dim = R + Dr (576 = 512 + 64 for DeepSeek), head_dim_v = R (512),
num_kv_heads = 1 (one latent shared by every head). Phase "mixed" is served by ``mla_prefill``
(a decode token is a one-token prefill over its cached prefix).
"""
from __future__ import annotations

import os

from opmap.core import registry
from opmap.core.registry import Backend, Basis, Check, Evidence, Req

# Baseline rows the priorities rest on (bench/baselines/h200/mla.md). That file predates the backend
# per kernel: its `opmap-triton` rows are the kernels their cases selected then, so each row that names
# no kernel by itself says which backend's kernel it measured (on fp8, `[gl=0]` is the pointer kernel
# at 16 heads and the TMA kernel at 128).
H200 = "h200/mla"
DECODE = "B={b},kv={kv},h={h},R=512,Dr=64,page=64,kv_dtype={dt}"


def _rows(case: str, *providers) -> tuple:
    """Rows of one case; a provider is a name, or (name, the backend whose kernel it measured)."""
    return tuple(Evidence(H200, case, *((p,) if isinstance(p, str) else p)) for p in providers)


def _decode(b: int, h: int, dt: str, *providers: str) -> tuple:
    return _rows(DECODE.format(b=b, kv=4096 if b == 64 else 32768, h=h, dt=dt), *providers)


def _impl(mod: str, names) -> dict:
    """Entries of ``mod`` (a module under opmap, e.g. "kernels.mla.decode") by name."""
    return {n: f"opmap.{mod}:{n}" for n in names}


def _rope_part(spec):
    if spec.head_dim <= spec.head_dim_v:
        return (f"head_dim={spec.head_dim} must exceed head_dim_v={spec.head_dim_v} "
                "(head_dim = latent rank + RoPE dim)")
    return None


def _sparse_decode_only(spec):
    if spec.sparse and spec.phase != "decode":
        return f"sparse MLA is a decode kernel (phase={spec.phase})"
    return None


def _graph_decode_or_prefill(spec):
    # The prefill plans its chunks from max_q_len / max_seq_len: given them (the engine's padded
    # steps pass the token bucket) it reads nothing on the host; a mixed step's would.
    if spec.cuda_graph and spec.phase == "mixed":
        return "a mixed step plans its chunks on the host (reads lengths): not CUDA-graph capturable"
    return None


def _dims_at_most(rank: int, rope: int):
    def fn(spec):
        r, d = spec.head_dim_v, spec.head_dim - spec.head_dim_v
        if r > rank or d > rope:
            return f"latent rank {r} / rope dim {d} exceed the kernel tiles ({rank} / {rope})"
        return None

    return fn


MLA_KIND = Req("kind", ("mla",), "kind = mla")
ONE_KV = Req("num_kv_heads", (1,), "one latent KV head (num_kv_heads = 1)")
PAGED = Req("paged", (True,), "paged latent cache")
NO_WINDOW = Req("sliding_window", (False,), "no sliding window")
NO_CAP = Req("soft_cap", (False,), "no logit soft-cap")
ROPE = Check("head_dim = R + Dr > head_dim_v = R", _rope_part, "head_dim")
SPARSE = Check("sparse only in decode", _sparse_decode_only, "sparse")
GRAPH = Check("CUDA graph: decode, or prefill with its length hints", _graph_decode_or_prefill, "cuda_graph")
ENTRIES = ("mla_decode", "mla_prefill", "mla_sparse_decode")

registry.register(Backend(
    op="attention", name="mla-reference", provider="torch", version=registry.torch_version,
    priority=dict(registry.REFERENCE_PRIORITY), basis=registry.REFERENCE_BASIS,
    impl=_impl("ops.mla.reference", ENTRIES),
    reqs=(MLA_KIND, ONE_KV, PAGED, NO_WINDOW, NO_CAP,
          Req("cuda_graph", (False,), "eager only (host loop over sequences)")),
    checks=(ROPE, SPARSE),
    notes="plain PyTorch, fp32 accumulation, loop over sequences: the oracle",
))

registry.register(Backend(
    op="attention", name="mla-triton", provider="opmap-triton", version=registry.triton_version,
    priority={"cpu": registry.TRITON_CPU_PRIORITY, "sm80": 50, "sm90": 50},
    impl={**_impl("kernels.mla.decode", ("mla_decode", "mla_sparse_decode", "make_workspace")),
          **_impl("kernels.mla.prefill", ("mla_prefill",))},
    reqs=(MLA_KIND, ONE_KV, PAGED, NO_WINDOW, NO_CAP,
          Req("kv_dtype", ("fp32", "fp16", "bf16", "fp8"), "KV bf16 / fp16 / fp32 / fp8-e4m3 + scale"),
          Req("batch_invariant", (False,), "split-KV count depends on the batch size")),
    checks=(ROPE, SPARSE, GRAPH, Check("R <= 512, Dr <= 64", _dims_at_most(512, 64), "head_dim")),
    available=registry.triton_available,
    notes="absorbed split-KV decode on the pointer kernel (row addresses from the block table: any page "
          "size; device-side split plan, persistent workspace), sparse top-k decode, non-absorbed chunked "
          "prefill",
))


def _kv_same_or_fp8(spec):
    if spec.kv_dtype not in (spec.dtype, "fp8"):
        return f"kv_dtype={spec.kv_dtype} with dtype={spec.dtype} (needs kv_dtype == dtype or fp8)"
    return None


def _tma_rows(spec):
    elt = 1 if spec.kv_dtype == "fp8" else 2
    r, d = spec.head_dim_v, spec.head_dim - spec.head_dim_v
    if (r * elt) % 16 or (d * elt) % 16:
        return f"latent rank {r} / rope dim {d} at {elt} byte(s) an element: not 16-byte rows (TMA boxes)"
    return None


def _kv_fp8(spec):
    if spec.kv_dtype != "fp8":
        return f"kv_dtype={spec.kv_dtype} (an fp8 cache only; 16-bit caches: mla-tma, mla-triton)"
    return None


def _deepseek_dims(spec):
    if (spec.head_dim_v, spec.head_dim) != (512, 576):
        return f"R = {spec.head_dim_v}, Dr = {spec.head_dim - spec.head_dim_v} (the kernel's layouts: R=512, Dr=64)"
    return None


DECODE_ONLY = Req("phase", ("decode",), "decode (prefill and mixed steps: mla-triton's non-absorbed prefill)")
DENSE = Req("sparse", (False,), "dense decode (sparse top-k: mla-triton's pointer kernel)")
Q16 = Req("dtype", ("fp16", "bf16"), "q bf16 / fp16")
NOT_INVARIANT = Req("batch_invariant", (False,), "split-KV count depends on the batch size")

# mla-tma and mla-gluon-fp8 rank above mla-triton (50) where they serve, mla-tma below FlashInfer's
# decode from 64 heads (55): each is the faster kernel there (docs/mla.md, Decisions).
def _tma_first(basis: Basis) -> registry.Prefer:
    return registry.Prefer(52, 45, lambda s: s.kv_dtype != "fp8" or s.num_heads >= 64,
                           "a 16-bit cache, or an fp8 one from 64 heads", basis)


registry.register(Backend(
    op="attention", name="mla-tma", provider="opmap-triton", version=registry.triton_version,
    priority={"cpu": registry.TRITON_CPU_PRIORITY - 1,
              "sm80": _tma_first(Basis("convention: sm90's rule, not measured on sm80")),
              "sm90": _tma_first(Basis(
                  "the TMA kernel faster than the pointer kernel on 16-bit caches and on fp8 ones from 64 heads; "
                  "on fp8 at 16 heads the pointer kernel led",
                  _decode(64, 16, "bf16", ("opmap-triton", "mla-tma"), ("opmap-triton[tma=0,s=2]", "mla-triton"))
                  + _decode(64, 128, "bf16", ("opmap-triton", "mla-tma"), ("opmap-triton[tma=0,s=1]", "mla-triton"))
                  + _decode(64, 128, "fp8", ("opmap-triton[gl=0]", "mla-tma"),
                            ("opmap-triton[gl=0,bh=64,w=8,s=1,tma=0]", "mla-triton"))
                  + _decode(64, 16, "fp8", ("opmap-triton[gl=0,tma=1]", "mla-tma"),
                            ("opmap-triton[gl=0]", "mla-triton"))))},
    impl=_impl("kernels.mla.decode_tma", ("mla_decode", "make_workspace")),
    reqs=(MLA_KIND, ONE_KV, PAGED, NO_WINDOW, NO_CAP, DECODE_ONLY, DENSE, Q16,
          Req("page_size", lambda p: p % 64 == 0, "pages of 64 or more holding whole key tiles (multiples of 64)"),
          NOT_INVARIANT),
    checks=(ROPE, Check("kv_dtype == dtype or fp8", _kv_same_or_fp8, "kv_dtype"),
            Check("R <= 512, Dr <= 64", _dims_at_most(512, 64), "head_dim"),
            Check("16-byte latent and RoPE rows", _tma_rows, "head_dim")),
    available=registry.triton_available,
    notes="absorbed split-KV decode whose latent tiles are TMA boxes of one page (R = 512 as two 256-wide "
          "boxes), dots on wgmma from shared memory (keys as rows below 64-head blocks); fp8 tiles converted "
          "after the copy; a contiguous, 16-byte aligned cache (an InputError otherwise); the interpreter runs "
          "it (cpu: for tests, below mla-triton)",
))


def _gluon_available():
    """The Gluon kernels run compiled on a CUDA GPU, never in the Triton interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1: Gluon kernels do not run in the Triton interpreter"
    return registry.needs_cuda()


registry.register(Backend(
    op="attention", name="mla-gluon-fp8", provider="opmap-triton", version=registry.triton_version,
    priority={"sm90": 53},
    basis={"sm90": Basis(
        "the Gluon kernel faster than the Triton kernels on fp8 caches at R = 512 / Dr = 64, but for 16 heads "
        "at B=1 / 32k, where the pointer kernel led",
        _decode(64, 16, "fp8", ("opmap-triton", "mla-gluon-fp8"), ("opmap-triton[gl=0]", "mla-triton"))
        + _decode(64, 128, "fp8", ("opmap-triton", "mla-gluon-fp8"), ("opmap-triton[gl=0]", "mla-tma"))
        + _decode(1, 128, "fp8", ("opmap-triton", "mla-gluon-fp8"), ("opmap-triton[gl=0]", "mla-tma"))
        + _decode(1, 16, "fp8", ("opmap-triton", "mla-gluon-fp8"), ("opmap-triton[gl=0]", "mla-triton")))},
    impl=_impl("kernels.mla.decode_fp8", ("mla_decode", "make_workspace")),
    reqs=(MLA_KIND, ONE_KV, PAGED, NO_WINDOW, NO_CAP, DECODE_ONLY, DENSE, Q16, NOT_INVARIANT),
    checks=(Check("an fp8 (e4m3) cache + scale", _kv_fp8, "kv_dtype"),
            Check("R = 512, Dr = 64", _deepseek_dims, "head_dim")),
    available=_gluon_available,
    notes="absorbed split-KV decode in Gluon: each 64-key fp8 tile crosses shared memory once, read in "
          "16-byte pieces straight into the MMA fragments of both dots and converted in registers; warps "
          "split the latent; 16-byte aligned rows (an InputError otherwise)",
))

def _kv_16bit_as_q(spec):
    if spec.kv_dtype != spec.dtype:
        return f"kv_dtype={spec.kv_dtype} with dtype={spec.dtype} (a 16-bit cache of q's dtype; fp8: mla-gluon-fp8)"
    return None


def _heads_at_least(n):
    def fn(spec):
        if spec.num_heads < n:
            return f"{spec.num_heads} heads (at least {n}: one {n}-head block is the MMAs' rows; fewer: mla-tma)"
        return None

    return fn


registry.register(Backend(
    op="attention", name="mla-gluon-ws", provider="opmap-triton", version=registry.triton_version,
    priority={"sm90": 45},
    basis={"sm90": Basis("convention: below mla-triton until its decode rows are in the baseline")},
    impl=_impl("kernels.mla.decode_ws", ("mla_decode", "make_workspace")),
    reqs=(MLA_KIND, ONE_KV, PAGED, NO_WINDOW, NO_CAP, DECODE_ONLY, DENSE, Q16, NOT_INVARIANT,
          Req("page_size", lambda p: p % 64 == 0, "pages of 64 or more holding whole key tiles (multiples of 64)")),
    checks=(Check("a 16-bit cache of q's dtype", _kv_16bit_as_q, "kv_dtype"),
            Check("R = 512, Dr = 64", _deepseek_dims, "head_dim"),
            Check("64 heads or more", _heads_at_least(64), "num_heads")),
    available=_gluon_available,
    notes="absorbed split-KV decode in Gluon with FlashMLA's structure: a producer warp issues each 64-key "
          "tile's TMA boxes into a ring of stages behind mbarriers; two consumer warpgroups hold a 64-head "
          "block's scores (split by keys) and output (split by latent columns) and overlap each tile's softmax "
          "with the previous tile's value MMAs; sm90 only; a contiguous, 16-byte aligned cache (an InputError "
          "otherwise)",
))

registry.register(Backend(
    op="attention", name="mla-sdpa", provider="torch-sdpa", version=registry.torch_version,
    priority={"cpu": 5, "sm80": 20, "sm90": 20},
    basis={"sm90": Basis(
        "below the Triton kernels: slower in every row, though given the latent already contiguous",
        _decode(64, 16, "bf16", "torch-sdpa (contiguous latent)", ("opmap-triton", "mla-tma"))
        + _decode(64, 128, "bf16", "torch-sdpa (contiguous latent)", ("opmap-triton", "mla-tma"))
        + _rows("B=1,kv=32768,topk=2048,h=128,page=64,kv_dtype=bf16", "torch-gather+sdpa",
                ("opmap-triton", "mla-triton"))
        + _rows("new=4096,prefix=0,h=16,Dqk=192,Dv=128,page=64", "torch-sdpa", ("opmap-triton", "mla-triton")))},
    impl=_impl("peers.mla.sdpa", ENTRIES),
    reqs=(MLA_KIND, ONE_KV, PAGED, NO_WINDOW, NO_CAP,
          Req("cuda_graph", (False,), "eager only (gathers pages on the host side)"),
          Req("return_lse", (False,), "no LSE (SDPA does not return it)")),
    checks=(ROPE, SPARSE),
    notes="gathers the latent per sequence and calls F.scaled_dot_product_attention (decode: "
          "absorbed MQA, head dim R + Dr; prefill: K/V expanded per head by kv_b)",
))


def _flashinfer_dims(spec):
    if (spec.head_dim_v, spec.head_dim) != (512, 576):
        return f"FlashInfer MLA kernels are built for R=512, Dr=64 (got {spec.head_dim_v}/{spec.head_dim})"
    return None


registry.register(Backend(
    op="attention", name="mla-flashinfer", provider="flashinfer",
    version=registry.package_version("flashinfer-python"),
    # First from 64 heads on sm90, where the decode is compute-bound and its FlashMLA-style kernel
    # (two warpgroups ping-ponging softmax and value dots) leads; at 16 heads ours (docs/mla.md, Decisions).
    priority={"sm80": 40, "sm90": registry.Prefer(55, 40, lambda s: s.num_heads >= 64, "num_heads >= 64", Basis(
        "not timed: FlashInfer was missing from the baseline run; in a run with it its decode led ours from "
        "64 heads; at 16 it trailed at B=1 / 32k and was about level at B=64 (docs/mla.md, Decisions)"))},
    impl=_impl("peers.mla.flashinfer", ("mla_decode",)),
    reqs=(MLA_KIND, ONE_KV, PAGED, NO_WINDOW, NO_CAP,
          Req("phase", ("decode",), "decode only (our prefill entry is the non-absorbed form)"),
          Req("sparse", (False,), "dense only"),
          Req("dtype", ("fp16", "bf16"), "q bf16 / fp16"),
          Req("kv_dtype", ("fp16", "bf16"), "KV bf16 / fp16 (same as q)"),
          Req("cuda_graph", (False,), "adapter plans per call")),
    checks=(Check("R=512, Dr=64", _flashinfer_dims, "head_dim"),),
    available=registry.all_of(registry.needs_cuda, registry.package_available("flashinfer")),
    notes="BatchMLAPagedAttentionWrapper (plan + run) on ckv / kpe views of our cache; checked on the H200",
))

# ---- latent KV append --------------------------------------------------------------------------

_APPEND_KIND = Req("kind", ("mla",), "kind = mla")

registry.register(Backend(
    op="kv_append", name="mla-reference", provider="torch", version=registry.torch_version,
    priority=dict(registry.REFERENCE_PRIORITY), basis=registry.REFERENCE_BASIS,
    impl=_impl("ops.mla.reference", ("append_mla", "norm_rope_append_mla")),
    reqs=(_APPEND_KIND, ONE_KV, Req("cuda_graph", (False,), "eager only (boolean indexing)")),
    notes="index_put of [ckv, kpe] rows; fp8 stores value / scale clamped to +-448",
))

registry.register(Backend(
    op="kv_append", name="mla-triton", provider="opmap-triton", version=registry.triton_version,
    priority={"cpu": registry.TRITON_CPU_PRIORITY, "sm80": 50, "sm90": 50},
    impl=_impl("kernels.mla.append", ("append_mla", "norm_rope_append_mla")),
    reqs=(_APPEND_KIND, ONE_KV,
          Req("kv_dtype", ("fp32", "fp16", "bf16", "fp8"), "KV bf16 / fp16 / fp32 / fp8-e4m3 + scale")),
    available=registry.triton_available,
    notes="one program per token; slot -1 = skip (CUDA-graph padding); norm_rope_append_mla: the latent "
          "RMSNorm, the RoPE of q_pe and kpe and the append in one launch",
))
