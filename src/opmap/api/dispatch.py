"""How a public op call finds its kernel: the spec from the tensors, the selector's choice
(memoised by ``select``), the backend's entry; and the decode workspaces cached per device,
stream and shape, so that a call without a caller workspace runs the same launch as the engine's.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from opmap.core.registry import Backend, get as get_backend
from opmap.core.contract import InputError, dtype_name, expect
from opmap.core.select import BackendError, select


@functools.lru_cache(maxsize=64)
def _arch(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm{major}{minor}"
    return "cpu"


def arch_of(t: torch.Tensor) -> str:
    """The selector's arch for the device a tensor lives on ("cpu" or "smXY")."""
    return _arch(t.device)


def tensor(arg: str, t, ndim: Optional[int] = None) -> torch.Tensor:
    """``t`` is a tensor (of ``ndim`` dims): checked before its shape builds a spec."""
    expect(isinstance(t, torch.Tensor), arg, type(t).__name__, "a torch.Tensor")
    if ndim is not None:
        expect(t.dim() == ndim, arg, f"{t.dim()} dims {tuple(t.shape)}", f"{ndim} dims")
    return t


def dt(t: torch.Tensor) -> str:
    return dtype_name(t.dtype)


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def resolve(op: str, spec, entry: str, backend: Optional[str] = None):
    """(Backend, callable) of ``entry`` for ``spec``: the selector's choice, or the valid backend
    of highest priority after it that has the entry (an op's backends do not all serve every
    entry: the FlashInfer MLA backend has no sparse decode). ``backend`` forces one by name."""
    return entry_of(select(op, spec, backend=backend, runtime=True), entry)


def entry_of(choice, entry: str):
    """(Backend, callable) of ``entry`` for a selector's Choice (the engine resolves its choices
    through this too, so the engine and a user's call run the same callable)."""
    b = entry_backend(choice, entry)
    return b, b.fn(entry)


def entry_backend(choice, entry: str) -> Backend:
    """The backend whose ``entry`` runs for a selector's Choice, without loading it: the chosen
    one, or the valid backend of highest priority after it that has the entry."""
    op, spec = choice.op, choice.spec
    if entry in choice.backend.impl:
        return choice.backend
    if choice.forced_by:
        raise BackendError(f"{op}: backend {choice.name!r} ({choice.forced_by}) has no entry {entry!r}; "
                           f"it has {', '.join(sorted(choice.backend.impl))}")
    for cand in choice.trace[1:]:
        b = get_backend(op, cand.name)
        if cand.valid and entry in b.impl:
            return b
    raise BackendError(f"{op}: no valid backend for [{spec.describe()}] has the entry {entry!r}")


def call(op: str, spec, entry: str, backend: Optional[str], *args, **kw):
    return resolve(op, spec, entry, backend)[1](*args, **kw)


# (backend, device, stream, heads, width, batch bucket) -> workspace. A bucket is the batch rounded
# up to a power of two, as the engine's graph buckets: a workspace's split plan is made for its
# batch size (MLA's is fixed at creation). One per stream: two streams never share partials.
_WORKSPACES: dict = {}


def workspace(b: Backend, make_args: Callable[[int], tuple], batch: int, device: torch.device,
              heads: int, width: int):
    """The cached split-KV workspace of backend ``b`` for this device, stream and shape (None
    where ``b`` has none). Made during a CUDA-graph capture, it comes from the graph's pool and
    stays valid while cached; graphs captured on one stream share it, as the engine's graphs of one
    batch bucket share theirs. Why the call never goes without one: docs/attention.md, Decisions
    (the call without it launched another specialisation of the kernel, slower at B=64; the
    baseline's `opmap-decode-call` rows time the call with the cached workspace)."""
    if "make_workspace" not in b.impl:
        return None
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    rows = 1 << max(0, batch - 1).bit_length()
    key = (b.op, b.name, device, stream, heads, width, rows)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = b.fn("make_workspace")(*make_args(rows), device=device)
    return ws


def no_workspace_for(b: Backend, workspace) -> None:
    if workspace is not None and "make_workspace" not in b.impl:
        raise InputError("workspace", type(workspace).__name__,
                         f"None: backend {b.name!r} has no workspace (only backends with make_workspace)")
