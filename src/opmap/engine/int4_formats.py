"""The int4 weight-only checkpoint formats, each read into the one layout the kernels take
(``opmap.ops.gemm.quant``): uint8 codes [N, K], a scale per group [N, K / G], uint8 zero codes
[N, K / G] (None: symmetric, zero 8) and, for act-order checkpoints, each input channel's group.

- GPTQ (AutoGPTQ / GPTQModel, ``quant_method: gptq``): ``qweight`` int32 [K / 8, N], eight codes a
  word along K (nibble i = row 8j + i); ``qzeros`` int32 [K / G, N / 8], eight zero codes a word
  along N, stored minus one in the v1 ``checkpoint_format`` ("gptq"), as they are in "gptq_v2";
  ``scales`` [K / G, N]; ``g_idx`` [K] the group of each input channel (act order: not k // G).
- AWQ (AutoAWQ GEMM, ``quant_method: awq``, ``version: gemm``): ``qweight`` int32 [K, N / 8] and
  ``qzeros`` int32 [K / G, N / 8], eight codes a word along N in the order 0, 2, 4, 6, 1, 3, 5, 7
  (nibble i holds column 8j + AWQ_ORDER[i]); ``scales`` [K / G, N]; always with zero points.
- compressed-tensors ``pack-quantized`` (llm-compressor W4A16): ``weight_packed`` int32 [N, K / 8]
  (codes = signed value + 8, eight a word along K: our layout as stored), ``weight_scale``
  [N, K / G], ``weight_zero_point`` (asymmetric) int32 [N / 8, K / G] packed the same way along N,
  ``weight_g_idx`` [K] where the checkpoint kept its group act order.
"""
from __future__ import annotations

from typing import Optional

import torch

from opmap.core.contract import InputError
from opmap.ops.gemm.quant import unpack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class Int4Weight:
    """One Linear's int4 weight in the kernels' terms (see the module docstring)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
                 g_idx: Optional[torch.Tensor]):
        self.codes, self.scale, self.zero, self.g_idx = codes, scale, zero, g_idx

    def groups(self) -> torch.Tensor:
        """The group of each input channel [K]."""
        if self.g_idx is not None:
            return self.g_idx
        K = self.codes.shape[1]
        return torch.arange(K, device=self.codes.device) // (K // self.scale.shape[1])

    def dequantise(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in ``dtype``: (code - zero) * scale of each channel's group, rounded once."""
        g = self.groups()
        z = self.zero[:, g].float() if self.zero is not None else 8.0
        return ((self.codes.float() - z) * self.scale.float()[:, g]).to(dtype)


def read(get, prefix: str, k: int, q: dict) -> Int4Weight:
    """The int4 weight of Linear ``prefix`` (input size ``k``) in format ``q`` (model.hf's
    weight_quant: its layout, group size, zero points)."""
    group = q.get("group_size") or k
    if q["layout"] == "gptq":
        return gptq(get, prefix, k, group, q.get("gptq_v1", True))
    if q["layout"] == "awq":
        return awq(get, prefix, k, group)
    return compressed(get, prefix, k, group, not q.get("zero_point"))


def names(prefix: str, layout: str) -> tuple:
    """The checkpoint tensor that marks Linear ``prefix`` as int4 in ``layout``."""
    return f"{prefix}.weight_packed" if layout == "compressed" else f"{prefix}.qweight"


def _unpack_along_n(packed: torch.Tensor, order=None) -> torch.Tensor:
    """int32 [R, N / 8] with eight codes a word along N -> uint8 [R, N] (``order``: the column
    of each nibble within its word, AWQ's; none: nibble i is column 8j + i)."""
    u = unpack_int4(packed)  # nibble i of word j -> column 8j + i
    if order is None:
        return u
    R, N = u.shape
    inv = torch.empty(8, dtype=torch.long)
    inv[torch.tensor(order)] = torch.arange(8)  # column c of a word sits at nibble inv[c]
    return u.view(R, N // 8, 8)[:, :, inv.to(u.device)].reshape(R, N)


def _shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise InputError(f"checkpoint tensor {name}", f"shape {tuple(t.shape)}", f"shape {tuple(shape)}")


def _int32(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int32:
        raise InputError(f"checkpoint tensor {name}", f"dtype {t.dtype}", "int32 (eight packed 4-bit codes a word)")
    return t


def _groups(get, name: str, k: int, group: int) -> Optional[torch.Tensor]:
    """The act-order group index ``name`` [k] where the checkpoint has one and it is not k // group
    (None: the channels are in group order already); an index outside the groups is an InputError."""
    g_idx = get(name, optional=True)
    if g_idx is None:
        return None
    _shape(name, g_idx, (k,))
    g_idx = g_idx.to(torch.long)
    if bool((g_idx < 0).any()) or bool((g_idx >= k // group).any()):
        raise InputError(f"checkpoint tensor {name}", "a group index out of range", f"groups in [0, {k // group})")
    return None if torch.equal(g_idx, torch.arange(k, device=g_idx.device) // group) else g_idx


def _rows(get, name: str, dim: int) -> int:
    t = get(name)
    if t.dim() != 2:
        raise InputError(f"checkpoint tensor {name}", f"shape {tuple(t.shape)}", "2 dims")
    return t.shape[dim]


def gptq(get, prefix: str, k: int, group: int, v1: bool) -> Int4Weight:
    """``get(name[, optional=True])`` reads a checkpoint tensor; ``prefix`` the Linear's name; its
    input size ``k`` (the output size n from its scales)."""
    n = _rows(get, f"{prefix}.scales", 1)
    if k % 8 or n % 8 or k % group:
        raise InputError(f"checkpoint tensor {prefix}", f"{n} x {k} with group size {group}",
                         "both sizes multiples of 8 and the group dividing the input size")
    qw = _int32(f"{prefix}.qweight", get(f"{prefix}.qweight"))
    _shape(f"{prefix}.qweight", qw, (k // 8, n))
    qz = _int32(f"{prefix}.qzeros", get(f"{prefix}.qzeros"))
    _shape(f"{prefix}.qzeros", qz, (k // group, n // 8))
    s = get(f"{prefix}.scales")
    _shape(f"{prefix}.scales", s, (k // group, n))
    codes = unpack_int4(qw.t().contiguous())  # [n, k // 8] words along k -> [n, k]
    zero = _unpack_along_n(qz).t().contiguous()  # [n, k / g]
    if v1:  # stored as zero - 1 (8 as 7); a stored 15 reads 16, as AutoGPTQ's and exllama's kernels read it
        zero = zero + 1
    g_idx = _groups(get, f"{prefix}.g_idx", k, group)
    return Int4Weight(codes, s.t().contiguous(), zero, g_idx)


def awq(get, prefix: str, k: int, group: int) -> Int4Weight:
    n = _rows(get, f"{prefix}.scales", 1)
    if k % group or n % 8 or k % 8:
        raise InputError(f"checkpoint tensor {prefix}", f"{n} x {k} with group size {group}",
                         "the output size a multiple of 8 and the group dividing the input size")
    qw = _int32(f"{prefix}.qweight", get(f"{prefix}.qweight"))
    _shape(f"{prefix}.qweight", qw, (k, n // 8))
    qz = _int32(f"{prefix}.qzeros", get(f"{prefix}.qzeros"))
    _shape(f"{prefix}.qzeros", qz, (k // group, n // 8))
    s = get(f"{prefix}.scales")
    _shape(f"{prefix}.scales", s, (k // group, n))
    codes = _unpack_along_n(qw, AWQ_ORDER).t().contiguous()
    zero = _unpack_along_n(qz, AWQ_ORDER).t().contiguous()
    return Int4Weight(codes, s.t().contiguous(), zero, None)


def compressed(get, prefix: str, k: int, group: int, symmetric: bool) -> Int4Weight:
    n = _rows(get, f"{prefix}.weight_scale", 0)
    if k % 8 or k % group:
        raise InputError(f"checkpoint tensor {prefix}", f"{n} x {k} with group size {group}",
                         "the input size a multiple of 8 and the group dividing it")
    shape = get(f"{prefix}.weight_shape", optional=True)
    if shape is not None and [int(v) for v in shape.reshape(-1).tolist()] != [n, k]:
        raise InputError(f"checkpoint tensor {prefix}.weight_shape", str(shape.tolist()), f"[{n}, {k}]")
    wp = _int32(f"{prefix}.weight_packed", get(f"{prefix}.weight_packed"))
    _shape(f"{prefix}.weight_packed", wp, (n, k // 8))
    s = get(f"{prefix}.weight_scale")
    _shape(f"{prefix}.weight_scale", s, (n, k // group))
    zero = None
    if not symmetric:
        zp = _int32(f"{prefix}.weight_zero_point", get(f"{prefix}.weight_zero_point"))
        _shape(f"{prefix}.weight_zero_point", zp, (-(-n // 8), k // group))
        zero = _unpack_along_n(zp.t().contiguous())[:, :n].t().contiguous()
    g_idx = _groups(get, f"{prefix}.weight_g_idx", k, group)
    return Int4Weight(unpack_int4(wp), s.contiguous(), zero, g_idx)


def int8_channel(get, prefix: str) -> tuple:
    """compressed-tensors W8A16 (symmetric, a scale per output channel): ``weight_packed`` int32
    [N, K / 4], four codes a word along K (code = value + 128, byte i = column 4j + i) -> (int8
    [N, K], fp32 scale [N])."""
    wp = _int32(f"{prefix}.weight_packed", get(f"{prefix}.weight_packed"))
    s = get(f"{prefix}.weight_scale")
    n = wp.shape[0]
    if s.numel() != n:
        raise InputError(f"checkpoint tensor {prefix}.weight_scale", f"shape {tuple(s.shape)}", f"({n}, 1)")
    shape = get(f"{prefix}.weight_shape", optional=True)
    k = int(shape.reshape(-1)[1]) if shape is not None else wp.shape[1] * 4
    if k > wp.shape[1] * 4 or k <= (wp.shape[1] - 1) * 4:
        raise InputError(f"checkpoint tensor {prefix}.weight_packed", f"shape {tuple(wp.shape)}", f"({n}, {-(-k // 4)})")
    shifts = 8 * torch.arange(4, device=wp.device, dtype=torch.int32)
    codes = ((wp[..., None] >> shifts) & 0xFF).flatten(-2)[:, :k]
    return (codes - 128).to(torch.int8).contiguous(), s.float().reshape(n).contiguous()
