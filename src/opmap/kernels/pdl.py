"""Programmatic dependent launch (PDL, sm90+) for the kernels of a decode step.

A decode step is a chain of ~10 small Triton kernels per layer; between two of them the GPU
drains the first grid, then launches and ramps up the second. With PDL a kernel launched with
``launch_pdl=True`` may be scheduled while its predecessor still runs: each kernel first waits for
its predecessor's grid to finish and its writes to be visible (``griddepcontrol.wait``), then lets
its own dependents launch (``griddepcontrol.launch_dependents``), so results are exactly those of
serial launches and at most one kernel waits ahead of the running one; what overlaps is launch
latency and ramp-up. A kernel before or after one that is not PDL-aware (cuBLAS, PyTorch copies)
is serialised as usual, and the wait is a no-op when PDL is off.

On by default on sm90+ (compiled kernels only; the interpreter never sees it); ``OPMAP_PDL=0`` in
the environment of the process turns it off (to compare, or to rule PDL out when debugging). The
MoE kernels (routing, align, grouped GEMM, combine) are not PDL-aware: under PDL the MoE decode
step measured slower (docs/moe.md, Decisions).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off (enabled() says so)
    gdc_launch_dependents = gdc_wait = None


# Read once: launchers ask per launch, and the MoE launch path is kept to a few us of host time
# (set OPMAP_PDL before the process starts).
_ASKED = (os.environ.get("OPMAP_PDL", "1") == "1" and os.environ.get("TRITON_INTERPRET") != "1"
          and gdc_wait is not None)


def enabled(device) -> bool:
    """PDL for launches on ``device``: asked for, a CUDA sm90+ device, not the interpreter."""
    return _ASKED and _sm90(device)


@functools.lru_cache(maxsize=None)
def _sm90(device) -> bool:
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (9, 0)


_ON = {"PDL": 1, "launch_pdl": True}
_OFF = {"PDL": False}


def launch(device) -> dict:
    """Keyword arguments for ``kernel[grid](...)``: the PDL constexpr and, when on, the launch
    attribute (``PDL`` must be a ``tl.constexpr`` parameter of the kernel). Do not mutate."""
    if not enabled(device):
        return _OFF
    return _ON


@triton.jit
def enter(PDL: tl.constexpr):
    """First statement of a PDL-aware kernel: wait for the predecessor, then release the dependents.

    In this order at most one kernel waits ahead of the running one. Released first (measured 7%
    slower at batch 1), each early kernel released the next at once, so the whole chain became
    resident and spun in ``griddepcontrol.wait`` on the SMs that the running kernel needed."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
