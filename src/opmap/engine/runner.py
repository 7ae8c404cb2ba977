"""ModelRunner: owns the model, the KV cache and the step metadata buffers; runs one step.

- Operators are resolved once here (one OpSet for prefill, one for mixed steps, one per decode
  batch bucket) and logged once per op and phase.
- Step metadata (input ids, positions, slot mapping, seq lens, cu_seqlens, block tables, logits
  rows) is built on the host once per step and copied into persistent device buffers; every layer
  reads views of them, so a captured decode graph replays with new values.
- KV cache: on a GPU, sized after a warm-up prefill of the full token budget by ``kv_plan``
  (``gpu_memory_fraction`` of the total less this engine's weights, the warm-up's own activation
  peak and memory outside PyTorch, and never more than is actually free); on the CPU a fixed
  number of pages (``num_pages``, default 256). ``close()`` frees the cache, graphs and weights.
- Decode steps are captured in CUDA graphs per batch bucket (padding rows: slot -1, length 0,
  which the kernels treat as "nothing to do") unless ``enforce_eager``; a bucket whose capture
  fails runs eagerly and the reason is logged (``opmap profile`` reports it).
- Prefill steps of at most ``prefill_graph_tokens`` are padded to a 128-token bucket (the padding
  rows: slot -1, a trailing sequence of their own, so the real rows' attention is unchanged) and
  replay that bucket's CUDA graph of the decoder layers; the final norm and the LM head run on
  the sampled rows after it. Eager runs pad the same way, so graphs change no result.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional

import torch

from opmap.core.contract import InputError, dtype_name, trusted_values
from opmap.core.hw import local_arch
from opmap.model.step import QUANTISED_MIXED_ROWS, many_tokens_of, mixed_rows_of
from opmap.ops.rope.reference import cos_sin_cache
from opmap.core.select import BackendError
from opmap.engine.capture import Capture
from opmap.engine.config import EngineConfig
from opmap.engine.kv_plan import MemFigures, plan_pages
from opmap.engine.model import Step
from opmap.engine.model_mla import build_model
from opmap.kernels.gemm import dequant_cublas
from opmap.ops.gemm.quant import INT4_GROUP
from opmap.engine.opset import OpSet, engine_dtype, engine_settings, log_choices, quantised_expert_format
from opmap.engine.scheduler import Batch

log = logging.getLogger("opmap.engine")
CPU_PAGES = 256
PREFILL_BUCKET = 128  # tokens: a padded prefill step does at most 127 rows of extra work


def token_buckets(limit: int) -> list:
    """The prefill token buckets: multiples of PREFILL_BUCKET below ``limit``, then ``limit``."""
    return list(range(PREFILL_BUCKET, limit, PREFILL_BUCKET)) + [limit] if limit > 0 else []


def buckets(max_seqs: int) -> list:
    out = [b for b in (1, 2, 4, 8) if b < max_seqs] + list(range(16, max_seqs, 16)) + [max_seqs]
    return sorted(set(out))


def device_arch(device: Optional[str]) -> tuple:
    """(torch.device, arch) of an engine's ``device`` setting (None: cuda if available)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return dev, (local_arch() if dev.type == "cuda" else "cpu")


class ModelRunner:
    def __init__(self, cfg, ecfg: EngineConfig, source=None):
        self.cfg, self.ecfg = cfg, ecfg
        self.device, self.arch = device_arch(ecfg.device)
        on_gpu = self.device.type == "cuda"
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[engine_dtype(ecfg, self.arch)]
        self.page = ecfg.page_size
        if on_gpu:
            torch.cuda.synchronize(self.device)
        # What the process held before this engine: the KV sizing counts only this engine's own.
        self._alloc0 = torch.cuda.memory_allocated(self.device) if on_gpu else 0
        t0 = time.perf_counter()
        self.model = build_model(cfg, self.device, self.dtype)
        if source is None:
            self.model.random_(seed=ecfg.seed)
            self.unused = []
        else:
            self.unused = self.model.load(source)
            mtp = int(cfg.extra.get("mtp_layers", 0))
            if mtp:  # DeepSeek-V3's multi-token-prediction layers follow the decoder's; nothing here runs them
                extra = {f"model.layers.{cfg.layers + j}." for j in range(mtp)}
                dropped = [n for n in self.unused if any(n.startswith(e) for e in extra)]
                if dropped:
                    log.info("ignoring the %d-layer MTP head (%d tensors): opmap decodes one token per step", mtp,
                             len(dropped))
                self.unused = sorted(set(self.unused) - set(dropped))
            if self.unused:  # a tensor nothing reads is a feature this model would silently drop
                more = f" and {len(self.unused) - 4} more" if len(self.unused) > 4 else ""
                raise InputError("checkpoint", f"tensors nothing reads: {', '.join(self.unused[:4])}{more}",
                                 "only tensors of the architecture (a config field that needs them is not supported)")
        self.model.set_kv_dtype(ecfg.kv_cache_dtype)
        stored = (cfg.extra.get("weight_quant") or {}).get("format")  # None for KV scales only
        if stored and ecfg.quantize:
            raise InputError("quantize", ecfg.quantize, f"None: the checkpoint's weights are {stored} already")
        # a quantised checkpoint's config.json alone (random weights): its format, as a load would give
        fmt = ecfg.quantize or (stored if source is None else None)
        # --quantize takes an LM head of its own too; a checkpoint's format is what it stores
        wq = cfg.extra.get("weight_quant") or {}
        group = wq.get("group_size") if stored in ("int4", "fp8-block") else INT4_GROUP
        self.quantised = self.model.quantize_(fmt, lm_head=bool(ecfg.quantize), group_size=group,
                                              zero_point=bool(stored == "int4" and wq.get("zero_point"))) if fmt else []
        experts = quantised_expert_format(cfg, ecfg) if fmt else None
        if experts and not self.model.expert_quant and (source is None or ecfg.quantize):
            # random weights of a quantised config (as a load gives them), or --quantize int4: the experts too
            self.model.quantize_experts_(*experts, zero_point=bool(stored == "int4" and wq.get("zero_point")))
        self.lm_head_quantised = "lm_head" in self.quantised
        if self.quantised:
            log.info("weight-only %s: %d projection weights quantised per %s%s (router, %sembedding keep %s)",
                     fmt, len(self.quantised),
                     {"int4": f"group of {group or 'K'} input channels", "fp8-block": f"{group} x {group} block"}.get(
                         fmt, "output channel"),
                     ", the LM head among them" if self.lm_head_quantised else "",
                     "" if self.model.expert_quant else "experts and " if cfg.is_moe else "", dtype_name(self.dtype))
        deq = self.model.dequantised
        if deq and wq.get("block") and stored != "fp8-block":
            log.warning("block-wise fp8 checkpoint: %d weights dequantised to %s at load (no kernel takes one scale "
                        "per block): %s's weight bytes and speed; --quantize fp8 re-quantises them per output channel",
                        len(deq), dtype_name(self.dtype), dtype_name(self.dtype))
        if stored:
            log.info("%s checkpoint: the attention and dense MLP projections stay %s (%s)%s", stored, stored,
                     {"int4": "packed, a scale per group", "fp8-block": f"a scale per {group} x {group} block"}.get(
                         stored, "a scale per output channel"),
                     f"; {len(deq)} other quantised tensors dequantised to {dtype_name(self.dtype)} at load "
                     f"(no {stored} kernel for them: {', '.join(deq[:3])}{' ...' if len(deq) > 3 else ''})" if deq else "")
        self.weight_format = ecfg.quantize or stored
        self.quantised_bytes = self.model.quantised_bytes_per_param() if self.weight_format else 1.0
        self.expert_bytes = self.model.expert_bytes_per_param() if self.model.expert_quant else None
        self.load_s = time.perf_counter() - t0
        self.max_seqs = ecfg.max_num_seqs
        self.buckets = buckets(self.max_seqs)
        self.max_tokens = max(ecfg.max_num_batched_tokens, self.buckets[-1])
        self.slot_cap = self.max_seqs + 1  # sequence slots: a padded prefill step adds one
        self.use_graphs = on_gpu and not ecfg.enforce_eager
        # Every op set is the model's step map (opmap.model.step) at these settings, resolved.
        settings = engine_settings(cfg, ecfg, self.arch, self.weight_format, self.lm_head_quantised,
                                   self.model.expert_quant)

        def opset(phase: str, graph: bool, m: Optional[int]) -> OpSet:
            return OpSet(cfg, phase, dataclasses.replace(settings, cuda_graph=graph, m=m),
                         ecfg.backends, ecfg.trace_ops, ecfg.fuse_rope_append,
                         ecfg.fuse_gated, ecfg.fuse_shared_add)

        self.ops = {p: opset(p, False, None) for p in ("prefill", "mixed")}
        # Quantised weights: eager mixed steps also take op sets planned at their row count
        # (model.step.mixed_rows_of); dense weights choose the same at any M: no further sets.
        self.mixed_rows = ({m: opset("mixed", False, m) for m in QUANTISED_MIXED_ROWS}
                           if self.weight_format else {})
        self.graphs_off_reason = None if self.use_graphs else ("enforce_eager" if on_gpu else "CPU")
        self.prefill_graphs_off = None if self.use_graphs else self.graphs_off_reason
        self.padded_ops = self.ops["prefill"]  # the op set of padded prefill steps (graph-capturable)
        if self.use_graphs:
            try:
                self.padded_ops = opset("prefill", True, None)
            except BackendError as e:
                self.prefill_graphs_off = str(e).splitlines()[0]
                log.warning("prefill CUDA graphs off: %s", self.prefill_graphs_off)
        # Quantised routed experts: steps of at least many_tokens rows run op sets planned at that
        # count, where the MoE selection can take its many-rows-an-expert route (ops/moe/backends.py);
        # {} when the experts are not quantised or no step can be that long.
        self.many_tokens = many_tokens_of(cfg) if self.model.expert_quant else None
        self.many_token_ops = {}
        if self.many_tokens is not None and self.many_tokens <= ecfg.max_num_batched_tokens:
            self.many_token_ops = {p: opset(p, False, self.many_tokens) for p in ("prefill", "mixed")}
            if self.padded_ops is not self.ops["prefill"]:
                self.many_token_ops["padded"] = opset("prefill", True, self.many_tokens)
        try:
            self.decode_ops = {b: opset("decode", self.use_graphs, b) for b in self.buckets}
        except BackendError as e:
            if not self.use_graphs:
                raise
            # No backend of some op can be captured for this model (e.g. a head_dim only the
            # reference serves): decode runs eagerly, and says why.
            self.use_graphs = False
            self.graphs_off_reason = str(e).splitlines()[0]
            log.warning("decode CUDA graphs off: %s", self.graphs_off_reason)
            self.decode_ops = {b: opset("decode", False, b) for b in self.buckets}
        self.choice_lines = log_choices([self.ops["prefill"], self.padded_ops, self.ops["mixed"],
                                         *self.mixed_rows.values(), *self.many_token_ops.values(),
                                         *self.decode_ops.values()])
        self._alloc_meta(cfg.max_position)
        # The decode workspaces before the KV plan, so that it counts them as this engine's own:
        # allocated after it, 1.08 GiB of them (20 batch buckets at 256 sequences) took more than
        # the plan's 1 GiB margin, and a second engine sized from free memory ran out of memory in
        # its start-up warm-up.
        self.workspace = {}
        for b, ops in self.decode_ops.items():
            if ops.make_workspace is not None:
                width = cfg.kv_lora_rank if cfg.is_mla else cfg.head_dim
                self.workspace[b] = ops.make_workspace(b, cfg.heads, width, device=self.device)
        self.num_pages, plan = self._size_kv()
        self.moe_warm_s = self._warm_moe()
        cap, want = self.num_pages * self.page, self._length_asked()
        if cap < want:
            # A length the cache cannot hold would end requests in errors at run time: an explicit
            # max_model_len is refused now, a default one (the model's positions) shrinks to the cache.
            if ecfg.max_model_len:
                raise InputError("max_model_len", ecfg.max_model_len,
                                 f"at most {cap}, the tokens the KV cache holds ({self.num_pages} pages of {self.page}; "
                                 f"{plan}); lower max_model_len, max_num_seqs or max_num_batched_tokens, or "
                                 f"raise gpu_memory_fraction")
            log.warning("max_model_len %d, below the model's %d positions: the KV cache holds %d pages of %d tokens (%s)",
                        cap, want, self.num_pages, self.page, plan)
        self.max_model_len = min(want, cap)
        self.max_pages_per_seq = -(-self.max_model_len // self.page)
        # Padded prefill steps up to the token limit, where a step can hold that many tokens (MLA's:
        # one sequence, see prefill_bucket).
        self.padded_seqs = 1 if cfg.is_mla else self.max_seqs  # real sequences a padded step holds
        limit = (min(ecfg.prefill_graph_tokens, self.max_tokens, self.padded_seqs * self.max_model_len)
                 if on_gpu else 0)
        self.prefill_buckets = token_buckets(limit)
        # The padding sequence (< PREFILL_BUCKET tokens) reads its pages from its own row too.
        width = max(self.max_pages_per_seq, -(-PREFILL_BUCKET // self.page))
        self.block_tables = torch.zeros(self.slot_cap, width, dtype=torch.int32, device=self.device)
        self.h_bt = torch.zeros(self.slot_cap * width, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.h_bt_np = self.h_bt.numpy()
        self.kv = self.model.make_kv(self.num_pages, self.page)
        self._rope_caches(self.max_model_len)
        self.graphs: dict = {}
        self.graph_errors: dict = {}
        self.prefill_graphs: dict = {}  # token bucket -> (graph, out rows, residual rows)
        self.prefill_graph_errors: dict = {}
        self.capture: Optional[Capture] = None  # the graphs' stream and pool (engine/capture.py)
        if self.use_graphs:
            self._capture()

    def _rope_caches(self, positions: int) -> None:
        """cos/sin of the model's RoPE, and of its local layers' where they have their own base (Gemma-3)."""
        c = self.cfg
        self.model.cos_sin = cos_sin_cache(self.model.rope_dim(), positions, c.rope_theta, c.rope_scaling,
                                           device=self.device)
        self.model.cos_sin_local = (cos_sin_cache(self.model.rope_dim(), positions, c.local_rope_theta, None,
                                                  device=self.device) if c.local_rope_theta else self.model.cos_sin)

    # ---- buffers ------------------------------------------------------------------------------

    def _alloc_meta(self, max_len: int) -> None:
        d, T, B = self.device, self.max_tokens, self.slot_cap
        i64 = dict(dtype=torch.int64, device=d)
        self.input_ids = torch.zeros(T, **i64)
        self.positions = torch.zeros(T, **i64)
        self.slots = torch.full((T,), -1, **i64)
        self.seq_lens = torch.zeros(B, dtype=torch.int32, device=d)
        self.cu = torch.zeros(B + 1, dtype=torch.int32, device=d)
        self.logits_idx = torch.zeros(B, **i64)
        pin = self.device.type == "cuda"
        self.h_i64 = torch.zeros(3, T, dtype=torch.int64, pin_memory=pin)  # ids, positions, slots
        self.h_i32 = torch.zeros(2 * B + 1, dtype=torch.int32, pin_memory=pin)  # seq_lens, cu
        self.h_idx = torch.zeros(B, dtype=torch.int64, pin_memory=pin)
        self.h_i64_np, self.h_i32_np, self.h_idx_np = self.h_i64.numpy(), self.h_i32.numpy(), self.h_idx.numpy()
        self._copied = None  # CUDA event after the last step's copies out of the pinned buffers

    def _fill(self, items, pad_to: int = 0, padded: Optional[tuple] = None):
        """Host metadata -> device buffers; returns (T, B, block-table width, rows that sample,
        (longest query chunk, longest sequence)). The pinned staging tensors are written through
        numpy views (no per-row tensors). ``pad_to``: a decode bucket (padding rows of length 0);
        ``padded``: (token bucket, sequence slots) of a padded prefill step (the padding tokens a
        trailing sequence of their own, the slots after it empty, logits rows padded with row 0)."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's host->device copies have read the pinned buffers
        page = self.page
        ids, pos, slots, lens, cu, rows = [], [], [], [], [0], []
        width = longest_q = 1
        for it in items:
            s, n, a = it.seq, it.num_tokens, it.start
            bt = s.block_table
            if n == 1:
                ids.append(max(s.token_ids[a], 0))  # a placeholder (-1) is overwritten on the device
                pos.append(a)
                slots.append(bt[a // page] * page + a % page)
            else:
                ids += s.token_ids[a:a + n]
                pos += range(a, a + n)
                slots += [bt[p // page] * page + p % page for p in range(a, a + n)]
            lens.append(a + n)
            cu.append(cu[-1] + n)
            width = max(width, len(bt))
            longest_q = max(longest_q, n)
            if it.samples:
                rows.append(cu[-1] - 1)
        T, B = len(ids), len(items)
        Tp, Bp = max(T, pad_to), max(B, pad_to)
        nrows = len(rows)
        if padded is not None:
            Tp, Bp = padded
            if Tp > T:  # the padding sequence: causal over its own tokens, writing no KV (slot -1)
                lens.append(Tp - T)
                cu.append(Tp)
            lens += [0] * (Bp - len(lens))
            cu += [Tp] * (Bp + 1 - len(cu))
            rows = rows + [0] * (Bp - nrows)
        h = self.h_i64_np
        h[0, :T], h[1, :T], h[2, :T] = ids, pos, slots
        h[0, T:Tp], h[1, T:Tp], h[2, T:Tp] = 0, 0, -1
        m = self.slot_cap
        n = len(lens)
        self.h_i32_np[:n], self.h_i32_np[n:Bp] = lens, 0
        self.h_i32_np[m:m + len(cu)] = cu
        bt_h = self.h_bt_np[:Bp * width].reshape(Bp, width)
        bt_h[B:] = 0
        for i, it in enumerate(items):
            t = it.seq.block_table
            bt_h[i, :len(t)] = t
            bt_h[i, len(t):] = 0
        nb = dict(non_blocking=True)
        self.input_ids[:Tp].copy_(self.h_i64[0, :Tp], **nb)
        self.positions[:Tp].copy_(self.h_i64[1, :Tp], **nb)
        self.slots[:Tp].copy_(self.h_i64[2, :Tp], **nb)
        self.seq_lens[:Bp].copy_(self.h_i32[:Bp], **nb)
        self.cu[:len(cu)].copy_(self.h_i32[m:m + len(cu)], **nb)
        self.block_tables[:Bp, :width].copy_(self.h_bt[:Bp * width].view(Bp, width), **nb)
        if rows:
            self.h_idx_np[:len(rows)] = rows
            self.logits_idx[:len(rows)].copy_(self.h_idx[:len(rows)], **nb)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return T, B, width, rows[:nrows], (longest_q, max(lens, default=1))

    def _step(self, T: int, B: int, width: Optional[int], decode: bool, nrows: Optional[int], bucket=None,
              longest=(None, None)) -> Step:
        """``longest``: (query chunk, sequence) lengths of a prefill or mixed step, host ints."""
        return Step(self.input_ids[:T], self.positions[:T], self.slots[:T], self.seq_lens[:B],
                    self.block_tables[:B] if width is None else self.block_tables[:B, :width],
                    None if decode else self.cu[:B + 1],
                    None if nrows is None else self.logits_idx[:nrows], decode,
                    self.workspace.get(bucket) if decode else None, *longest)

    # ---- one step -------------------------------------------------------------------------------
    def decode_weight_bytes(self, rows: float) -> float:
        """Weight bytes one decode step of ``rows`` sequences reads, as this engine stores them."""
        return self.cfg.decode_weight_bytes(rows, self.dtype.itemsize, quantised=bool(self.weight_format),
                                            lm_head=self.lm_head_quantised, bytes_per_quantised=self.quantised_bytes,
                                            bytes_per_expert=self.expert_bytes)

    def bucket_for(self, b: int) -> int:
        for x in self.buckets:
            if x >= b:
                return x
        raise ValueError(f"decode batch {b} > max_num_seqs {self.max_seqs}")

    @torch.inference_mode()
    def run(self, batch: Batch, dev_ids: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """fp32 logits of the items that sample, in batch order (None when none samples).
        ``dev_ids`` (decode only): the input token of every row, already on the device (the
        previous step's sampled ids, not yet read back by the host); it replaces the host's.
        The step metadata comes from the scheduler's host values, so the ops skip reading it back
        to check it (``trusted_values``: no host synchronisation inside a step)."""
        with trusted_values():
            return self._run(batch, dev_ids)

    def _run(self, batch: Batch, dev_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        items = batch.items
        if batch.is_decode:
            bs = self.bucket_for(len(items))
            T, B, _, rows, _ = self._fill(items, pad_to=bs)
            if dev_ids is not None:
                # Queued after _fill's host->device copy of the placeholder ids, so it wins.
                self.input_ids[:B].copy_(dev_ids[:B], non_blocking=True)
            if bs in self.graphs:
                graph, out = self.graphs[bs]
                graph.replay()
                logits = out
            else:
                logits = self.model.forward(self.decode_ops[bs], self._step(bs, bs, None, True, None, bs), self.kv)
            if not rows:
                return None
            # _fill already copied ``rows`` into logits_idx (queued, non-blocking): indexing with a
            # fresh torch.tensor(rows, device=...) would copy from pageable memory and synchronise.
            return logits[:B] if len(rows) == B else logits[self.logits_idx[:len(rows)]]
        tb = self.prefill_bucket(batch)
        if tb is not None:
            _, _, _, rows, _ = self._fill(items, padded=(tb, self.prefill_slots(tb)))
            if tb in self.prefill_graphs:
                graph, out, residual = self.prefill_graphs[tb]
                graph.replay()
            else:
                out, residual = self._padded_rows(tb)
            n = len(rows)
            return self.model.head(self.padded_ops_of(tb), out[:n], residual[:n]) if n else None
        T, B, width, rows, longest = self._fill(items)
        ops = self.eager_ops(batch.phase, T)
        st = self._step(T, B, width, False, len(rows), longest=longest)
        if not rows:  # a prefill chunk that samples nothing: the layers only
            self.model.layers(ops, st, self.kv)
            return None
        return self.model.forward(ops, st, self.kv)

    def eager_ops(self, phase: str, tokens: int) -> OpSet:
        """The op set of an eager (not replayed) step of ``tokens`` rows in ``phase``."""
        if self.many_token_ops and tokens >= self.many_tokens:
            return self.many_token_ops["prefill" if phase == "prefill" else "mixed"]
        if phase == "prefill":
            return self.ops["prefill"]
        m = mixed_rows_of(tokens) if self.mixed_rows else None
        return self.ops["mixed"] if m is None else self.mixed_rows[m]

    # ---- padded prefill steps ------------------------------------------------------------------
    def prefill_bucket(self, batch: Batch) -> Optional[int]:
        """The token bucket of a prefill step that is padded (and replayed from its graph), or None.
        MLA's prefill up-projects the latent cache of every sequence slot over the longest length
        (the bucket, its host-side chunk plan's hint), so empty slots would multiply its work: its
        padded steps are the single-sequence ones with no cached prefix (a prompt's first chunk,
        the time to first token of a lone request), in two slots."""
        if batch.phase != "prefill" or not self.prefill_buckets or batch.num_tokens > self.prefill_buckets[-1]:
            return None
        if len(batch.items) > self.padded_seqs or (self.cfg.is_mla and batch.items[0].start):
            return None
        return next(b for b in self.prefill_buckets if b >= batch.num_tokens)

    def prefill_slots(self, tb: int) -> int:
        """Sequence slots of a padded step: as many sequences as it can hold (one for MLA), and
        the padding one."""
        return min(self.padded_seqs, tb) + 1

    def _padded_rows(self, tb: int) -> tuple:
        """The layers of a padded prefill step (metadata already filled), then the rows of the
        logits slots: (out, residual), [slots, hidden] each. The longest query and sequence are
        the bucket (every length fits in it: MLA's chunk plan reads them)."""
        S = self.prefill_slots(tb)
        st = self._step(tb, S, None, False, S, longest=(tb, tb))
        out, residual = self.model.layers(self.padded_ops_of(tb), st, self.kv)
        return out[st.logits_idx], residual[st.logits_idx]

    def padded_ops_of(self, tb: int) -> OpSet:
        """The op set of a padded prefill step of bucket ``tb``: planned at many_tokens from there (the
        eager one where the graph set could not be planned)."""
        if self.many_token_ops and tb >= self.many_tokens:
            return self.many_token_ops.get("padded", self.many_token_ops["prefill"])
        return self.padded_ops

    # ---- KV sizing and CUDA graphs ------------------------------------------------------------
    def _length_asked(self) -> int:
        """The model length asked for (max_model_len, else the model's positions), within those positions."""
        return min(self.ecfg.max_model_len or self.cfg.max_position, self.cfg.max_position)

    def _size_kv(self) -> tuple:
        """(KV pages to allocate, where the figure comes from)."""
        if self.ecfg.num_pages:
            return int(self.ecfg.num_pages), "num_pages as given"
        if self.device.type != "cuda":
            return CPU_PAGES, "the CPU default"
        # Warm-up prefill of the whole token budget into a small scratch cache, to measure the
        # activation peak (and to compile the prefill kernels before any request arrives).
        T = self.ecfg.max_num_batched_tokens
        pages = -(-T // self.page) + 1
        kv = self.model.make_kv(pages, self.page)
        self._rope_caches(max(T, 1))
        self.block_tables = torch.arange(pages, dtype=torch.int32, device=self.device)[None, :].repeat(self.max_seqs, 1)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()  # weights, buffers, the scratch cache, other engines
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            self.input_ids[:T].random_(0, self.cfg.vocab)
            self.positions[:T].copy_(torch.arange(T, device=self.device))
            self.slots[:T].copy_(torch.arange(T, device=self.device))
            self.seq_lens[:1].fill_(T)
            self.cu[:2].copy_(torch.tensor([0, T], dtype=torch.int32))
            self.logits_idx[:1].fill_(T - 1)
            # the op set a prefill of T rows runs (its scratch, e.g. dequantised experts, counted)
            self.model.forward(self.eager_ops("prefill", T), self._step(T, 1, pages, False, 1, longest=(T, T)), kv)
        torch.cuda.synchronize()
        # what the warm-up left allocated (scratch its kernels keep, e.g. dequantised experts): in
        # ``own`` below, so not in the activation peak as well
        persist = max(torch.cuda.memory_allocated() - before, 0)
        act = torch.cuda.max_memory_allocated() - before - persist  # the warm-up's own activation peak
        del kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        alloc = torch.cuda.memory_allocated()
        # the graphs' pool: up to one more activation peak beside the eager steps' memory for prefill
        # graphs, and the kept scratch again for any graphs (their capture stream grows its own)
        pool = (act if self.use_graphs and self.ecfg.prefill_graph_tokens else 0) + (persist if self.use_graphs else 0)
        m = MemFigures(total=total, free=free, reserved=torch.cuda.memory_reserved(), allocated=alloc,
                       own=max(alloc - self._alloc0, 0), act_peak=act, graph_pool=pool)
        useful = self.max_seqs * -(-self._length_asked() // self.page)
        n, why = plan_pages(m, self.ecfg.gpu_memory_fraction, self.model.kv_bytes_per_page(self.page), useful)
        log.info("KV cache: %d pages of %d tokens (%.2f GiB); %s", n, self.page,
                 n * self.model.kv_bytes_per_page(self.page) / 2**30, why)
        return n, why

    def _warm_moe(self) -> float:
        """Tune the MoE GEMMs at start-up for every token count a prefill or mixed step can bring
        (the backend's ``warm_up``), not in the first steps that hit a new count, whose tuning
        otherwise lands inside the mixed steps (docs/engine.md, Decisions: the MoE GEMMs tuned at
        start-up). Seconds taken."""
        if self.device.type != "cuda" or not self.cfg.is_moe:
            return 0.0
        c, P = self.cfg, self.model.params
        layer = next(i for i in range(c.layers) if f"{i}.w13" in P)
        t0 = time.perf_counter()
        # the prefill and mixed op sets: one call per distinct backend entry
        for warm_up in {ops.moe_warm_up for ops in [*self.ops.values(), *self.many_token_ops.values()]} - {None}:
            with torch.inference_mode():
                n = warm_up(P[f"{layer}.w13"], P[f"{layer}.w2"], c.top_k, self.max_tokens, dtype=self.dtype,
                            router=c.router, renormalize=c.norm_topk_prob, n_group=c.n_group, topk_group=c.topk_group,
                            routed_scaling=c.routed_scaling, score_bias=P.get(f"{layer}.router_bias"),
                            **self.model.expert_scales(layer))
            torch.cuda.synchronize()
            log.info("MoE kernels tuned for %d token counts up to %d in %.1f s", n, self.max_tokens,
                     time.perf_counter() - t0)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Drop the KV cache, the decode graphs (and their memory pool), the weights and the step
        buffers; the caller (``LLM.close``) runs the garbage collector and empties the CUDA cache."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # the dequantisation scratch this engine's streams grew
            streams = [torch.cuda.current_stream(self.device).cuda_stream]
            streams += [self.capture.stream.cuda_stream] if self.capture is not None else []
            dequant_cublas.release(self.device, streams)
        if self.capture is not None:
            self.capture.close([g for g, *_ in [*self.graphs.values(), *self.prefill_graphs.values()]])
        self.graphs, self.prefill_graphs, self.capture = {}, {}, None
        self.kv = self.model = None
        self.workspace = {}
        self.ops, self.decode_ops, self.padded_ops, self.many_token_ops = {}, {}, None, {}
        for name in ("input_ids", "positions", "slots", "seq_lens", "cu", "logits_idx", "block_tables",
                     "h_i64", "h_i32", "h_idx", "h_bt", "h_i64_np", "h_i32_np", "h_idx_np", "h_bt_np", "_copied"):
            setattr(self, name, None)
        self.closed = True

    def _capture(self) -> None:
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        self.input_ids.zero_()
        self.positions.zero_()
        self.capture = Capture(self.device)
        if self.prefill_graphs_off is None:
            self._capture_prefill()
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        for bs in reversed(self.buckets):
            ops = self.decode_ops[bs]
            st = self._step(bs, bs, None, True, None, bs)
            try:
                with torch.inference_mode():
                    self.model.forward(ops, st, self.kv)  # warm-up: compiles kernels outside the graph
                    torch.cuda.synchronize()
                    with self.capture.graph() as g:
                        out = self.model.forward(ops, st, self.kv)
                self.graphs[bs] = (g, out)
            except Exception as e:  # noqa: BLE001 - a backend that cannot be captured runs eagerly
                self.graph_errors[bs] = f"{type(e).__name__}: {e}"
                log.warning("decode bucket %d: CUDA graph capture failed, runs eagerly (%s)", bs,
                            self.graph_errors[bs].splitlines()[0])
        torch.cuda.synchronize()
        log.info("decode CUDA graphs captured for batch buckets %s", sorted(self.graphs))

    def _capture_prefill(self):
        """One graph per prefill token bucket, largest first (the later ones, and the decode graphs,
        reuse its memory). Each bucket runs once eagerly first,
        with its tokens in sequences that fit a block-table row and write no KV (slot -1): that
        compiles its kernels and tunes its GEMMs outside the capture."""
        row = self.block_tables.shape[1] * self.page
        for tb in reversed(self.prefill_buckets):
            S = self.prefill_slots(tb)
            lens = [min(row, tb - a) for a in range(0, tb, row)]
            cu = [0]
            for n in lens:
                cu.append(cu[-1] + n)
            self.seq_lens[:S].copy_(torch.tensor(lens + [0] * (S - len(lens)), dtype=torch.int32))
            self.cu[:S + 1].copy_(torch.tensor(cu + [tb] * (S + 1 - len(cu)), dtype=torch.int32))
            self.logits_idx[:S].zero_()
            try:
                with torch.inference_mode(), trusted_values():
                    self._padded_rows(tb)
                    torch.cuda.synchronize()
                    with self.capture.graph() as g:
                        out, residual = self._padded_rows(tb)
                self.prefill_graphs[tb] = (g, out, residual)
            except Exception as e:  # noqa: BLE001 - a backend that cannot be captured runs eagerly
                self.prefill_graph_errors[tb] = f"{type(e).__name__}: {e}"
                log.warning("prefill bucket %d: CUDA graph capture failed, runs eagerly (%s)", tb,
                            self.prefill_graph_errors[tb].splitlines()[0])
        torch.cuda.synchronize()
        if self.prefill_graphs:
            log.info("prefill CUDA graphs captured for token buckets %s", sorted(self.prefill_graphs))
