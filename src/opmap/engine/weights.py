"""Weights: from a local Hugging Face checkpoint directory (config.json, sharded *.safetensors with
their index, tokenizer.json) straight to the device, one tensor at a time (``safe_open`` maps the
file; no full CPU copy of the model is ever made), from an in-memory state dict (an HF model in
the same process, for parity tests), or drawn at random on the device for a preset.

The model allocates its own (fused) parameters on the device; a ``Loader`` fills them from HF
tensor names: plain copies, concatenations along dim 0 (QKV, gate+up) and stacked experts in
either the on-disk per-expert layout (``experts.{e}.w1`` / ``gate_proj``...) or the fused layout
of transformers 5.x (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``).
"""
from __future__ import annotations

import glob
import logging
import os
from typing import Iterable, Optional

import torch

from opmap.core.contract import InputError
from opmap.model.hf import inside, read_json_object
from opmap.engine import int4_formats
from opmap.ops.gemm.quant import pack_int4

log = logging.getLogger("opmap.engine")


class SafetensorsSource:
    """Tensors of a checkpoint directory by HF name, read one at a time."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            wm = read_json_object(index, "JSON with a weight_map").get("weight_map")
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise InputError(f"{index} weight_map", type(wm).__name__ if not isinstance(wm, dict) else
                                 "a file name that is not a string", "an object of tensor name -> file name")
            self.where = {}
            for k, v in wm.items():
                try:
                    self.where[k] = os.path.realpath(inside(path, v))
                except InputError as e:
                    raise InputError(index, f"{k} in {v!r} ({e.given})", "files inside the checkpoint directory") from None
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise InputError("model", repr(path), "a directory with *.safetensors files")
            self.where = {}
            for fn in files:
                fn = os.path.realpath(inside(path, os.path.basename(fn)))
                with _opened(fn) as f:
                    for k in f.keys():
                        self.where[k] = fn
        self._open: dict = {}

    def names(self) -> set:
        return set(self.where)

    def get(self, name: str, device, dtype) -> torch.Tensor:
        fn = self.where[name]
        f = self._open.get(fn)
        if f is None:
            # device= makes safetensors place each tensor on the device as it is read.
            d = torch.device(device)
            dev = f"cuda:{d.index if d.index is not None else torch.cuda.current_device()}" if d.type == "cuda" else "cpu"
            f = self._open[fn] = _opened(fn, dev)
        try:
            t = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise InputError(fn, f"tensor {name} unreadable", f"a complete safetensors file ({e})") from None
        return t.to(device=device, dtype=dtype)

    def close(self) -> None:
        self._open.clear()


class StateDictSource:
    """Tensors of a model already in memory (an HF model's state_dict)."""

    def __init__(self, state: dict):
        self.state = state

    def names(self) -> set:
        return set(self.state)

    def get(self, name: str, device, dtype) -> torch.Tensor:
        return self.state[name].detach().to(device=device, dtype=dtype)

    def close(self) -> None:
        pass


FP8 = torch.float8_e4m3fn


class Loader:
    """Fills the model's device tensors from a source; records which source names were used.

    fp8 checkpoints (compressed-tensors: ``<name>`` in e4m3 beside ``<name>_scale``, per tensor
    or per output channel): a parameter registered in ``scales`` (an fp8 weight and its fp32 scale
    per row) takes the fp8 bits as they are and the scale of each part expanded to its rows (exact);
    a quantised tensor read into a parameter of the model's dtype is dequantised (``dequantised``
    names them: the fallback the log reports). ``block`` (rows, columns): the checkpoint's weights
    have one scale per block of that size (block-wise fp8), dequantised at load.

    int4 checkpoints (``int4``: model.hf's weight_quant of a GPTQ / AWQ / compressed-tensors W4A16
    checkpoint): a parameter registered in ``int4_params`` (a placeholder of the dense shape,
    id -> (the model's params, its name)) is written as the kernels' packed layout (``<name>``
    int32, ``<name>.scale`` as stored, ``<name>.zero`` uint8, ``<name>.perm`` for act order), read by
    int4_formats without a dense copy; any other int4 tensor (experts, MLA's projections) is
    dequantised (``dequantised``)."""

    def __init__(self, source, device, dtype, scales: Optional[dict] = None, block: Optional[tuple] = None,
                 int4: Optional[dict] = None, int4_params: Optional[dict] = None):
        self.src, self.device, self.dtype = source, device, dtype
        self.names = source.names()
        self.used: set = set()
        self.scales = scales or {}  # id(fp8 parameter) -> its per-row fp32 scale parameter
        self.block = tuple(block) if block else None
        self.int4 = int4
        self.int4_params = int4_params or {}
        self.dequantised: list = []

    def has(self, name: str) -> bool:
        return name in self.names

    def _raw(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as stored: a floating-point dtype (an integer or bool tensor for a
        weight would be cast to numbers it never held), every value finite (a NaN or inf weight
        turns every logit NaN): an InputError naming the tensor otherwise."""
        if name not in self.names:
            raise InputError("checkpoint", f"no tensor {name!r}", "the tensors of this architecture")
        t = self.src.get(name, self.device, None)
        if not t.dtype.is_floating_point:
            raise InputError(f"checkpoint tensor {name}", f"dtype {t.dtype}", "a floating-point dtype")
        if t.dtype == FP8:  # e4m3fn has no inf; NaN is every exponent and mantissa bit set
            bad = bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
        else:
            bad = not bool(torch.isfinite(t).all())
        if bad:
            raise InputError(f"checkpoint tensor {name}", "NaN or inf values", "finite weights")
        self.used.add(name)
        return t

    def _packed(self, name: str, optional: bool = False) -> Optional[torch.Tensor]:
        """Tensor ``name`` as stored, of any dtype (packed codes, scales, group indices); a floating
        one (a scale) finite."""
        if name not in self.names:
            if optional:
                return None
            raise InputError("checkpoint", f"no tensor {name!r}", "the tensors of this quantised format")
        self.used.add(name)
        t = self.src.get(name, self.device, None)
        if t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
            raise InputError(f"checkpoint tensor {name}", "NaN or inf values", "finite scales")
        return t

    def is_int4(self, name: str) -> bool:
        """Weight ``name`` (``<linear>.weight``) is stored as int4 codes here."""
        return (self.int4 is not None and name.endswith(".weight")
                and int4_formats.names(name[:-len(".weight")], self.int4["layout"]) in self.names)

    def int4_weight(self, name: str, k: int):
        return int4_formats.read(self._packed, name[:-len(".weight")], k, self.int4)

    @torch.no_grad()
    def _int4_cat(self, dst: torch.Tensor, names: list) -> None:
        """The int4 parts ``names`` stacked along the output rows into ``dst``'s packed parameters.
        Act-order parts (GPTQ desc_act) must share one channel order (q, k and v read the same
        input): their channels are permuted into group order, and ``<name>.perm`` permutes the
        activations the same way at run time."""
        _, params, pname = self.int4_params.pop(id(dst))  # used once: a later tensor may take its id
        N, K = dst.shape
        parts = []
        for n in names:
            if not self.is_int4(n):  # the step map plans int4 kernels for every projection of quant_names
                raise InputError(f"checkpoint tensor {n}", "stored unquantised (the format's ignore list)" if n in
                                 self.names else "missing", f"int4 codes ({int4_formats.names(n[:-7], self.int4['layout'])}"
                                 "): the attention and dense MLP projections of an int4 checkpoint all in int4")
            parts.append(self.int4_weight(n, K))
        codes = torch.cat([p.codes for p in parts])
        if codes.shape != (N, K):
            raise InputError(f"checkpoint tensors {names[0]} ..", f"{codes.shape[0]} x {codes.shape[1]}",
                             f"{N} x {K} as config.json's sizes give")
        # the checkpoint's scale dtype (fp16 / bf16) where the parts agree: the kernels read it as stored
        sd = parts[0].scale.dtype if all(p.scale.dtype == parts[0].scale.dtype for p in parts) else torch.float32
        scale = torch.cat([p.scale.to(sd) for p in parts])
        zero = torch.cat([p.zero for p in parts]) if self.int4.get("zero_point") else None
        orders = [p.g_idx for p in parts]
        if any(o is not None for o in orders):
            if not all(o is not None and torch.equal(o, orders[0]) for o in orders):
                raise InputError(f"checkpoint tensors {', '.join(names)}", "different act-order group indices",
                                 "one g_idx for the parts of a fused projection (they read the same input)")
            G = K // scale.shape[1]
            perm = torch.argsort(orders[0], stable=True)
            if not torch.equal(orders[0][perm], torch.arange(K, device=perm.device) // G):
                raise InputError(f"checkpoint tensor {names[0][:-7]}.g_idx", "groups of unequal sizes",
                                 f"{G} input channels in each group")
            codes = codes[:, perm]
            params[f"{pname}.perm"] = perm.to(self.device)
        params[pname] = pack_int4(codes).to(self.device)
        params[f"{pname}.scale"] = scale.to(self.device)
        if zero is not None:
            params[f"{pname}.zero"] = zero.to(self.device)

    def _scale_name(self, name: str) -> Optional[str]:
        """The checkpoint's dequantising factor of weight ``name``: ``<name>_scale``, or
        ``<name>_scale_inv`` (transformers' FP8 layout: the same factor, named by its inverse)."""
        return next((n for n in (f"{name}_scale", f"{name}_scale_inv") if n in self.names), None)

    def _scale_of(self, key: str, t: torch.Tensor, s: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The scale tensor ``key`` of ``t`` (``s`` when already read) as one fp32 value per row of
        ``t`` (leading dims kept)."""
        s = (self._raw(key) if s is None else s).float()
        rows = t.shape[:-1]
        if s.numel() == 1:
            return s.reshape(()).expand(rows)
        if s.numel() != t[..., 0].numel():
            raise InputError(f"checkpoint tensor {key}", f"shape {tuple(s.shape)}",
                             f"one scale, or one per output channel ({tuple(rows)})")
        return s.reshape(rows)

    def _dequantise(self, name: str, key: str, t: torch.Tensor) -> torch.Tensor:
        """fp8 ``t`` times its scale ``key``: one per tensor or row, or one per block (``self.block``)."""
        s = self._raw(key).float()
        if not (self.block and s.dim() == t.dim() >= 2 and s.numel() > 1 and s.shape[:-2] == t.shape[:-2]):
            return (t.float() * self._scale_of(key, t, s)[..., None]).to(self.dtype)
        bn, bk = self.block
        rows, cols = t.shape[-2:]
        if tuple(s.shape[-2:]) != (-(-rows // bn), -(-cols // bk)):
            raise InputError(f"checkpoint tensor {key}", f"shape {tuple(s.shape)}",
                             f"one scale per {bn} x {bk} block of {name} {tuple(t.shape)}")
        w = t.float()
        s = s.repeat_interleave(bn, dim=-2)[..., :rows, :]  # rows expanded; columns by a view of w
        full, rem = divmod(cols, bk)
        w[..., :full * bk].unflatten(-1, (full, bk)).mul_(s[..., :full, None])
        if rem:
            w[..., full * bk:].mul_(s[..., full:])
        return w.to(self.dtype)

    def _get(self, name: str, shape=None, k: Optional[int] = None) -> torch.Tensor:
        """Tensor ``name`` in the model's dtype (``shape``: the one it must have; ``k``: the input
        size of a weight whose rows are checked by the caller)."""
        packed8 = f"{name[:-len('.weight')]}.weight_packed"
        if name not in self.names and self.is_int4(name):  # no kernel reads it packed here
            k = shape[-1] if shape is not None else k
            if k is None:
                raise InputError(f"checkpoint tensor {name}", "int4 codes", "a weight of a known input size")
            t = self.int4_weight(name, k).dequantise(self.dtype)
            self.dequantised.append(name)
        elif name not in self.names and name.endswith(".weight") and packed8 in self.names:  # W8A16, no kernel here
            q, s = int4_formats.int8_channel(self._packed, name[:-len(".weight")])
            t = (q.float() * s[:, None]).to(self.dtype)
            self.dequantised.append(name)
        else:
            t = self._raw(name)
        key = self._scale_name(name) if t.dtype == FP8 else None
        if key:
            t = self._dequantise(name, key, t)
            self.dequantised.append(name)
        elif t.dtype == FP8:  # its values mean nothing without the factor
            raise InputError(f"checkpoint tensor {name}", "fp8 without a scale", f"{name}_scale beside it")
        else:
            t = t.to(self.dtype)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise InputError(f"checkpoint tensor {name}", f"shape {tuple(t.shape)}", f"shape {tuple(shape)}")
        return t

    def _quantised(self, name: str, fmt: str = "fp8") -> tuple:
        """(fp8 bits, fp32 scale per row, or per block for ``fmt`` "fp8-block") of a weight for an
        fp8 parameter, (int8 values, scale per row) for an int8 one (compressed-tensors W8A16: four
        values + 128 a word along K). A projection the checkpoint stores unquantised (an ignore
        list) beside quantised ones is refused naming it: the step map plans quantised kernels for
        every projection, and re-quantising it here would not be HF's numbers."""
        base = name[:-len(".weight")] if name.endswith(".weight") else name
        if fmt == "int8" and name not in self.names and f"{base}.weight_packed" in self.names:
            return int4_formats.int8_channel(self._packed, base)
        t = self._raw(name)
        key = self._scale_name(name) if t.dtype == FP8 else None
        if fmt != "int8" and key is not None:
            return t, (self._raw(key).float() if fmt == "fp8-block" else self._scale_of(key, t))
        if t.dtype == FP8:
            raise InputError(f"checkpoint tensor {name}", "fp8 without a scale", f"{name}_scale beside it")
        raise InputError(f"checkpoint tensor {name}", f"stored unquantised ({t.dtype}) beside {fmt} projections",
                         f"every attention and dense MLP projection of a {fmt} checkpoint in {fmt}, with its scale")

    @torch.no_grad()
    def copy(self, dst: torch.Tensor, name: str) -> None:
        if id(dst) in self.scales or id(dst) in self.int4_params:
            return self.cat(dst, [name])
        dst.copy_(self._get(name, dst.shape))

    @torch.no_grad()
    def cat(self, dst: torch.Tensor, names: Iterable[str]) -> None:
        """dst = cat(names, dim 0), each part copied into its slice (no temporary of the whole)."""
        names = list(names)
        if id(dst) in self.int4_params:
            return self._int4_cat(dst, names)
        o = 0
        scale = self.scales.get(id(dst))
        for n in names:
            if scale is None:
                t = self._get(n, k=dst.shape[-1] if dst.dim() == 2 else None)
            else:
                fmt = "int8" if dst.dtype == torch.int8 else "fp8-block" if scale.dim() == 2 else "fp8"
                t, s = self._quantised(n, fmt)
            if tuple(t.shape[1:]) != tuple(dst.shape[1:]) or t.dim() != dst.dim():
                raise InputError(f"checkpoint tensor {n}", f"shape {tuple(t.shape)}",
                                 f"shape (rows, {', '.join(map(str, dst.shape[1:]))})" if dst.dim() > 1 else "1 dim")
            if o + t.shape[0] > dst.shape[0]:  # the row count check below names it
                o += t.shape[0]
                continue
            dst[o:o + t.shape[0]].copy_(t)
            if scale is not None and scale.dim() == 2:  # a scale per block: the part's rows of blocks
                b = self.block[0]
                if o % b or (s.dim() != 2 or tuple(s.shape) != (-(-t.shape[0] // b), scale.shape[1])):
                    raise InputError(f"checkpoint tensor {n}", f"{t.shape[0]} rows at row {o}, scales "
                                     f"{tuple(s.shape)}", f"whole {b}-row blocks before the last part, a scale per "
                                     f"{b} x {b} block")
                scale[o // b:o // b + s.shape[0]].copy_(s)
            elif scale is not None:
                scale[o:o + t.shape[0]].copy_(s)
            o += t.shape[0]
            del t
        if o != dst.shape[0]:
            what = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1].rsplit('.', 2)[-2]}"
            raise InputError(f"checkpoint tensor{'s' * (len(names) > 1)} {what}", f"{o} rows",
                             f"{dst.shape[0]} as config.json's sizes give (num_attention_heads, num_key_value_heads, "
                             "head_dim, intermediate_size)")

    @torch.no_grad()
    def experts(self, w13: torch.Tensor, w2: torch.Tensor, prefix: str, legacy: tuple) -> None:
        """w13[E, 2I, H] (gate; up) and w2[E, H, I] from ``prefix.experts.*``.
        ``legacy`` = names of (gate, up, down) in the per-expert layout, e.g. ("w1", "w3", "w2")."""
        if self.has(f"{prefix}.experts.gate_up_proj"):
            self.copy(w13, f"{prefix}.experts.gate_up_proj")
            self.copy(w2, f"{prefix}.experts.down_proj")
            return
        g, u, d = legacy
        for e in range(w13.shape[0]):
            self.cat(w13[e], [f"{prefix}.experts.{e}.{g}.weight", f"{prefix}.experts.{e}.{u}.weight"])
            self.copy(w2[e], f"{prefix}.experts.{e}.{d}.weight")

    @torch.no_grad()
    def quantised_experts(self, prefix: str, legacy: tuple, E: int, inter: int, hidden: int, fmt: str) -> dict:
        """The routed experts of ``prefix`` kept in the checkpoint's ``fmt`` (model.hf.quantised_experts
        says when), stacked as the MoE kernels read them: {"w13", "w2", "w13_scale", "w2_scale"} and,
        for int4 with zero points, "w13_zero" / "w2_zero". Per-expert tensors (``legacy`` names of
        gate, up, down); an expert stored otherwise is refused naming it."""
        g, u, d = legacy
        names = [[f"{prefix}.experts.{e}.{n}.weight" for n in (g, u, d)] for e in range(E)]
        if self.has(f"{prefix}.experts.gate_up_proj") or not (
                self.is_int4(names[0][0]) if fmt == "int4" else self.has(names[0][0]) and self._scale_name(names[0][0])):
            raise InputError(f"checkpoint tensor {names[0][0]}", "missing or not stored as the checkpoint's format says",
                             f"each routed expert's gate, up and down projections in {fmt}, one tensor each "
                             "(with their scales)")
        out: dict = {}
        per = 8 if fmt == "int4" else 1
        for key, parts in (("w13", [[n[0], n[1]] for n in names]), ("w2", [[n[2]] for n in names])):
            k = hidden if key == "w13" else inter
            want = (2 * inter, hidden // per) if key == "w13" else (hidden, inter // per)
            ws, ss, zs = [], [], []
            for n in parts:  # one expert: its parts read and stacked along the rows
                q = [self._expert_part(x, k, fmt) for x in n]
                ws.append(torch.cat([p[0] for p in q]))
                if tuple(ws[-1].shape) != want:
                    raise InputError(f"checkpoint tensor{'s' * (len(n) > 1)} {', '.join(n)}",
                                     f"{tuple(ws[-1].shape)} stacked",
                                     f"{want} as config.json's hidden_size and moe_intermediate_size give")
                ss.append(torch.cat([p[1].float() for p in q]))
                if q[0][2] is not None:
                    zs.append(torch.cat([p[2] for p in q]))
            out[key], out[f"{key}_scale"] = torch.stack(ws).to(self.device), torch.stack(ss).to(self.device)
            if zs:
                out[f"{key}_zero"] = torch.stack(zs).to(self.device)
        return out

    def _expert_part(self, name: str, k: int, fmt: str) -> tuple:
        """(weight as the kernels read it, scale, zero codes or None) of one expert projection."""
        if fmt == "int4":
            if not self.is_int4(name):
                raise InputError(f"checkpoint tensor {name}", "not int4", "int4 codes like the other experts")
            w = self.int4_weight(name, k)
            if w.g_idx is not None and not torch.equal(w.g_idx, torch.arange(k, device=w.g_idx.device)
                                                       // (k // w.scale.shape[1])):
                raise InputError(f"checkpoint tensor {name[:-7]}.g_idx", "act-order groups",
                                 "groups in channel order (the config says the checkpoint has no act order)")
            return pack_int4(w.codes), w.scale, w.zero if self.int4.get("zero_point") else None
        return (*self._quantised(name, "fp8-block"), None)

    def unused(self) -> list:
        # Allowed to stay unread: rotary caches (recomputed), lm_head.weight of a model with tied
        # embeddings (the embedding is the LM head; a checkpoint whose lm_head.weight differs from
        # it loads untied: model/hf.py, as transformers does), and the static activation scales of an fp8
        # checkpoint (``input_scale``, transformers' ``activation_scale``: activations stay in the
        # model's dtype, weight-only).
        return sorted(n for n in self.names - self.used if "rotary_emb" not in n and n != "lm_head.weight"
                      and not n.endswith((".input_scale", ".activation_scale")))


def open_source(path: str) -> SafetensorsSource:
    return SafetensorsSource(path)


@torch.no_grad()
def fill_random(params: dict, seed: int = 0, std: float = 0.02, index: Optional[dict] = None) -> None:
    """Random weights on the device, in place: norms around 1, everything else N(0, std). Each
    tensor draws from a generator seeded by its place in the sorted names (``index``: those places,
    for a part of a model's parameters drawn on its own)."""
    index = index or {n: i for i, n in enumerate(sorted(params))}
    for name, t in params.items():
        i = index[name]
        g = torch.Generator(device=t.device).manual_seed((seed * 100003 + i) % 2**64)  # a generator takes 64 bits
        if t.dtype.is_floating_point and t.element_size() >= 2:
            t.normal_(0.0, std, generator=g)
            if "norm" in name:
                t.mul_(5.0).add_(1.0)  # ~1 +- 0.1
        else:
            raise ValueError(f"cannot draw random values for {name} of dtype {t.dtype}")


def _opened(fn: str, device: str = "cpu"):
    """``safe_open`` of a checkpoint file; a missing, truncated or damaged file is an InputError."""
    # safetensors: for checkpoint files only (random weights need none)
    from safetensors import safe_open

    try:
        return safe_open(fn, framework="pt", device=device)
    except Exception as e:  # SafetensorError, OSError
        raise InputError(fn, "a file safetensors cannot read", f"a complete safetensors file ({e})") from None


def load_tokenizer(path: Optional[str]):
    """A ``tokenizers.Tokenizer`` from path/tokenizer.json, or None when there is none (a
    warning says so: text is then encoded by the built-in byte tokenizer, not the model's)."""
    if path is None:
        return None
    fn = inside(path, "tokenizer.json")
    if os.path.exists(fn) and not os.path.isfile(fn):
        raise InputError(fn, "not a file", "a tokenizer.json file (or none: the built-in byte tokenizer)")
    if not os.path.isfile(fn):
        log.warning("%s: no tokenizer.json: text prompts and outputs go through opmap's byte tokenizer (ids "
                    "0..255 are bytes), not this model's", path)
        return None
    # tokenizers: for a checkpoint's tokenizer.json only
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(fn)
    except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
        raise InputError(fn, "a file the tokenizers library cannot read", f"a tokenizer.json ({e})") from None


def eos_token_ids(path: Optional[str], vocab: Optional[int] = None) -> list:
    """EOS ids from generation_config.json / config.json of a checkpoint ([] when none); a file
    that is not a JSON object, or an eos_token_id that is not an id (or a list of ids) of the
    vocabulary, is an InputError naming the file and the field."""
    for fn in ("generation_config.json", "config.json"):
        p = inside(path, fn) if path else None
        if not (p and os.path.isfile(p)):
            continue
        d = read_json_object(p, "a JSON object")
        v = d.get("eos_token_id")
        if v is None:
            continue
        ids = v if isinstance(v, list) else [v]
        top = f"[0, {vocab})" if vocab else "[0, vocab)"
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0 or (vocab is not None and i >= vocab):
                raise InputError(f"{p} eos_token_id", repr(v), f"a token id in {top} or a list of them")
        return list(ids)
    return []


# A layer's KV cache scales in the checkpoint, by name: (k, v) under self_attn. The first is the
# compressed-tensors and vLLM name, then the older AutoFP8 ones (one kv_scale for both, and the
# k / v projections' output scales).
KV_SCALE_NAMES = (("k_scale", "v_scale"), ("kv_scale", "kv_scale"), ("k_proj.output_scale", "v_proj.output_scale"))


def kv_layer_scales(L: Loader, layers: int, mode) -> Optional[list]:
    """(k_scale, v_scale) of each layer from the checkpoint: required with a compressed-tensors
    ``kv_cache_scheme`` (``mode`` True), read where the checkpoint has them for formats that name
    no KV scheme (``"if-present"``); None otherwise or when there are none."""
    if not mode:
        return None
    attn = [f"model.layers.{i}.self_attn" for i in range(layers)]
    names = KV_SCALE_NAMES[0]
    if mode == "if-present":
        names = next((ns for ns in KV_SCALE_NAMES if L.has(f"{attn[0]}.{ns[0]}")), None)
        if names is None:
            return None
    return [tuple(float(L._raw(f"{a}.{n}").float().reshape(-1)[0]) for n in names) for a in attn]
