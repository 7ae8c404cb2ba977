"""Input validation shared by every launcher: each error names the argument, what was given
and what was expected, and is raised before anything launches."""
from __future__ import annotations

import os
import threading
import weakref
from contextlib import contextmanager
from collections import OrderedDict
from typing import Iterable, Optional, Sequence, Union

import torch


class InputError(ValueError):
    """Bad input to a public op. The message names the argument."""

    def __init__(self, arg: str, given, expected):
        self.arg, self.given, self.expected = arg, given, expected
        super().__init__(f"{arg}: got {given}, expected {expected}")


DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8",
    torch.int8: "int8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
}
TORCH_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_name(dt: torch.dtype) -> str:
    return DTYPE_NAMES.get(dt, str(dt).replace("torch.", ""))


def expect(cond: bool, arg: str, given, expected) -> None:
    if not cond:
        raise InputError(arg, given, expected)


def expect_tensor(
    arg: str,
    t,
    *,
    dtype: Union[None, torch.dtype, Sequence[torch.dtype]] = None,
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Check a tensor argument. ``shape`` entries of None match any size."""
    if not isinstance(t, torch.Tensor):
        raise InputError(arg, type(t).__name__, "a torch.Tensor")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            raise InputError(arg, f"dtype {dtype_name(t.dtype)}",
                             "dtype " + " or ".join(dtype_name(d) for d in allowed))
    if ndim is not None and t.dim() != ndim:
        raise InputError(arg, f"{t.dim()} dims {tuple(t.shape)}", f"{ndim} dims")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != g for s, g in zip(shape, t.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise InputError(arg, f"shape {tuple(t.shape)}", f"shape {want}")
    if device is not None and t.device != torch.device(device):
        raise InputError(arg, f"device {t.device}", f"device {device}")
    if contiguous and not t.is_contiguous():
        raise InputError(arg, f"strides {t.stride()}", "a contiguous tensor")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise InputError(arg, f"strides {t.stride()}", "stride 1 in the last dimension")
    return t


def expect_writable(arg: str, t: torch.Tensor) -> None:
    """A tensor an op writes in place: no element shared by two indices (an expanded view)."""
    if any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape)):
        raise InputError(arg, f"strides {t.stride()}",
                         "a tensor whose elements are distinct memory (it is written; an expanded view is not)")


def expect_same_device(**tensors: torch.Tensor) -> torch.device:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    dev = items[0][1].device
    for k, v in items[1:]:
        if v.device != dev:
            raise InputError(k, f"device {v.device}", f"device {dev} (same as {items[0][0]})")
    return dev


def expect_in(arg: str, value, allowed: Iterable) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise InputError(arg, repr(value), "one of " + ", ".join(repr(a) for a in allowed))


# ---- checks on the *values* of device metadata ------------------------------------------------
# Page ids, lengths, slots and offsets can only be checked on the host: on a CUDA device that is a
# synchronisation. So such checks are skipped while a CUDA graph is being captured (or when
# OPMAP_CHECK_VALUES=0) and memoised per (tensor, version), so that the layers of one step pay
# for them once (``_VALUE_MEMO`` below).
_TRUSTED = threading.local()


@contextmanager
def trusted_values():
    """Inside, the data-dependent checks of CUDA tensors are skipped: reading the values back is
    a host synchronisation. For a caller that builds those tensors itself from host values it
    already holds, such as the engine's runner (its steps then never wait for the GPU); checks on
    CPU tensors still run."""
    prev = getattr(_TRUSTED, "on", False)
    _TRUSTED.on = True
    try:
        yield
    finally:
        _TRUSTED.on = prev


def values_wanted(*tensors) -> bool:
    """Whether data-dependent checks on these tensors should run now."""
    on_gpu = any(t is not None and t.is_cuda for t in tensors)
    if on_gpu and (getattr(_TRUSTED, "on", False) or torch.cuda.is_current_stream_capturing()):
        return False  # no host synchronisation for a trusted caller or inside a captured graph
    # last: the engine's steps (trusted) skip the environment lookup on each of their ~300 calls
    return os.environ.get("OPMAP_CHECK_VALUES", "1") != "0"


class TensorMemo:
    """Values remembered for exactly these tensors and arguments: a key of id + version of each
    live tensor (an in-place write, or one through a view, bumps the version) and the other
    arguments; weak references kept beside it turn a reused id into a miss. The ``size`` most
    recent keys are kept."""

    def __init__(self, size: int):
        self.size = size
        self._held: "OrderedDict[tuple, tuple]" = OrderedDict()  # key -> (weak refs, value)

    @staticmethod
    def _key(items) -> Optional[tuple]:
        """None when an item is an inference tensor (``torch.inference_mode``): those keep no
        version counter, so an in-place write would go unseen and nothing about them is remembered."""
        if any(isinstance(t, torch.Tensor) and t.is_inference() for t in items):
            return None
        return tuple((id(t), t._version, tuple(t.shape)) if isinstance(t, torch.Tensor) else t for t in items)

    def get(self, items, default=None):
        key = self._key(items)
        held = None if key is None else self._held.get(key)
        if held is None or not all(r() is t for r, t in zip(held[0], [t for t in items if isinstance(t, torch.Tensor)])):
            return default
        self._held.move_to_end(key)
        return held[1]

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        self._held.clear()

    def put(self, items, value) -> None:
        key = self._key(items)
        if key is None:
            return
        self._held[key] = ([weakref.ref(t) for t in items if isinstance(t, torch.Tensor)], value)
        while len(self._held) > self.size:
            self._held.popitem(last=False)


_VALUE_MEMO = TensorMemo(64)


def value_check_seen(tag: str, *items) -> bool:
    """True when exactly these CUDA tensors (same objects, same versions) and arguments already
    passed the check named ``tag``. On the CPU the check is cheap and always runs."""
    if not any(isinstance(t, torch.Tensor) and t.is_cuda for t in items):
        return False
    return _VALUE_MEMO.get((tag, *items), False)


def value_check_passed(tag: str, *items) -> None:
    """Record that the check ``tag`` passed on these tensors (see ``value_check_seen``)."""
    _VALUE_MEMO.put((tag, *items), True)
