"""The fuzz harness for public launchers (issue 8), and tests that it catches what it must.

A generated ``Case`` builds fresh inputs on each call (so the launcher and the reference get equal
values *and* equal strides, which ``clone()`` would not keep for a strided view) and says which
arguments it broke on purpose. ``check`` then demands one of:
- valid input: the launcher returns what the reference returns (``compare`` decides);
- broken input: ``InputError`` naming one of the broken arguments (``must_raise=False`` marks a
  break a launcher may also accept, e.g. a row-strided view; then its result must match);
- input outside what the backend declares it serves (``spec`` fails its ``validate``): an
  ``InputError`` naming any argument, or a result that matches.
Any other exception is a crash and fails the test; pytest-timeout catches a hang. Each launcher's
count of generated cases is reported as a ``FuzzReport`` warning (visible in the warnings summary
of the run, also under xdist).
"""
from __future__ import annotations

import collections
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opmap.core import registry
from opmap.core.contract import InputError
from opmap.core.specs import spec_for
from opmap.core.tolerance import compare as tol_compare


class FuzzReport(UserWarning):
    """The number of generated cases per launcher."""


@dataclass
class Case:
    build: Callable[[], tuple]  # () -> (args tuple, kwargs dict), fresh tensors each call
    broken: frozenset = frozenset()  # argument names broken on purpose
    must_raise: bool = True  # a broken case must raise (False: accepting it is fine if it matches)
    what: str = ""
    spec: Optional[dict] = None  # spec fields of this call, checked against the backend's declaration


def launchers(op: str, entry: str) -> list:
    """(backend name) of every backend of ``op`` with ``entry`` that can run in this process."""
    registry.load_all()
    out, seen = [], set()
    for b in registry.backends(op):
        if entry in b.impl and "cpu" in b.priority and not (b.available and b.available()):
            if b.impl[entry] in seen:  # several backends sharing one function: fuzz it once
                continue
            seen.add(b.impl[entry])
            out.append(b.name)
    return out


def check(op: str, backend: str, entry: str, case: Case, compare: Callable, ref: str = "reference") -> str:
    b = registry.get(op, backend)
    fn, ref = b.fn(entry), registry.get(op, ref).fn(entry)
    declared = True
    if case.spec is not None:
        declared = not b.validate(spec_for(op, arch="cpu", **case.spec))
    args, kw = case.build()
    try:
        out = fn(*args, **kw)
    except InputError as e:
        if case.broken and e.arg in case.broken:
            return "broken: rejected"
        if not declared:
            return "outside declaration: rejected"
        if not case.broken:
            raise AssertionError(f"{case.what}: valid input rejected by {backend}.{entry}: {e}") from e
        if e.arg not in case.broken:
            raise AssertionError(f"{case.what}: {backend}.{entry} raised InputError naming {e.arg!r} ({e}); "
                                 f"the broken argument(s): {sorted(case.broken)}") from e
        return "broken: rejected"
    if case.broken and case.must_raise and declared:
        raise AssertionError(f"{case.what}: {backend}.{entry} accepted broken {sorted(case.broken)} "
                             "without an InputError")
    rargs, rkw = case.build()
    expected = ref(*rargs, **rkw)
    compare(case, (out, args, kw), (expected, rargs, rkw))
    return "broken: accepted, matched" if case.broken else "valid: matched"


def fuzz(op: str, backend: str, entry: str, strategy, compare: Callable, max_examples: int,
         ref: str = "reference") -> dict:
    stats: collections.Counter = collections.Counter()

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case):
        stats[check(op, backend, entry, case, compare, ref)] += 1

    run()
    n = sum(stats.values())
    warnings.warn(FuzzReport(f"fuzz {op}.{entry} [{backend}]: {n} generated cases ("
                             + ", ".join(f"{k} {v}" for k, v in sorted(stats.items())) + ")"))
    # Both sides of the contract must have been exercised, or the fuzzing proved little.
    assert stats["valid: matched"] > 0, stats
    assert stats["broken: rejected"] > 0, stats
    return stats


# ---- helpers for building inputs ------------------------------------------------------------

def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, g, *, scale=1.0, row_stride_pad=0, last_dim_step=1):
    """Random values (never zeros) as a fresh tensor; ``row_stride_pad`` > 0 gives a view whose
    rows are strided (last dim contiguous, NaN between rows); ``last_dim_step`` > 1 a view strided
    in the last dim."""
    shape = tuple(shape)
    if not shape:
        return (torch.randn((), generator=g) * scale).to(dtype)
    full = list(shape)
    full[-1] = shape[-1] * last_dim_step + row_stride_pad
    base = (torch.randn(full, generator=g) * scale)
    if row_stride_pad:
        # The padding between rows holds NaN: a kernel that reads past the end of a row (an
        # out-of-bounds read in a real allocation) poisons its output and fails the comparison.
        base[..., shape[-1] * last_dim_step:] = float("nan")
    base = base.to(dtype) if dtype.is_floating_point else base.round().to(dtype)
    return base[..., : shape[-1] * last_dim_step: last_dim_step]


def close(a, b, dtype=None, scale=2.0, what="output"):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one side returned None"
        return
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, dtype, scale, f"{what}[{i}]")
        return
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    if not a.dtype.is_floating_point:
        assert torch.equal(a, b), f"{what}: integer outputs differ"
        return
    e = tol_compare(a.float(), b.float(), dtype or a.dtype, scale)
    assert e.ok, f"{what}: {e} (nonfinite={e.nonfinite})"


# ---- the harness catches what it must ---------------------------------------------------------

@pytest.fixture
def fake_op():
    """A fake 'activation' backend pair: reference doubles its input; 'bad' misbehaves on demand."""
    registry.load_all()
    saved = dict(registry._REGISTRY["activation"])
    registry._REGISTRY["activation"].clear()
    mode: dict[str, Any] = {"m": "ok"}

    def ref(x):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
            raise InputError("x", type(x).__name__, "an fp32 tensor")
        return x * 2

    def bad(x):
        m = mode["m"]
        if m == "crash":
            raise IndexError("index 9 is out of bounds")
        if m == "wrong-arg" and x.dtype != torch.float32:
            raise InputError("out", "?", "?")
        if m == "silent" and x.dtype != torch.float32:
            return x.float() * 2
        if m == "wrong-result":
            return x * 3
        return ref(x)

    mod = __import__(__name__)
    mod._fake_ref, mod._fake_bad = ref, bad
    for name, attr in (("reference", "_fake_ref"), ("bad", "_fake_bad")):
        registry.register(registry.Backend(op="activation", name=name, provider="fake", version="0",
                                           priority={"cpu": 1}, impl={"silu_mul": f"{__name__}:{attr}"}))
    yield mode
    registry._REGISTRY["activation"].clear()
    registry._REGISTRY["activation"].update(saved)


_CASES = st.sampled_from([
    Case(lambda: ((torch.arange(1.0, 5.0),), {}), what="valid"),
    Case(lambda: ((torch.arange(1, 5),), {}), frozenset({"x"}), what="int input"),
])


@pytest.mark.parametrize("mode,message", [
    ("crash", "IndexError"), ("wrong-arg", "naming 'out'"), ("silent", "accepted broken"),
    ("wrong-result", "worst/tol"),
])
def test_harness_catches(fake_op, mode, message):
    fake_op["m"] = mode
    with pytest.raises(BaseException) as e:
        fuzz("activation", "bad", "silu_mul", _CASES, lambda c, o, r: close(o[0], r[0]), 10)
    assert message in "".join(traceback.format_exception(e.value))


def test_harness_passes_a_good_launcher(fake_op):
    with pytest.warns(FuzzReport, match=r"fuzz activation.silu_mul \[bad\]: \d+ generated cases"):
        stats = fuzz("activation", "bad", "silu_mul", _CASES, lambda c, o, r: close(o[0], r[0]), 10)
    assert set(stats) == {"valid: matched", "broken: rejected"}
