"""The tile configuration schema the attention and MLA kernels share: a dict of launch
parameters (``BLOCK_M`` or ``BLOCK_H``, ``BLOCK_N``, ``num_warps``, ``num_stages`` and a kernel's
own pipeline switches such as ``PREFETCH``). Each launcher owns its defaults; a caller's ``config=``
replaces some of them, for tuning its own kernel (never choosing another: that is another backend),
and can only name keys the defaults have."""
from __future__ import annotations

from opmap.core.contract import expect


def tile_config(defaults: dict, override) -> dict:
    """``defaults`` with the keys of ``override`` replaced (a new dict); a key the defaults lack, a
    value that is not an int, or a block that is not a power of two is an InputError naming the
    config (each launcher adds the bounds of its own kernel)."""
    cfg = dict(defaults)
    if override is None:
        return cfg
    expect(isinstance(override, dict), "config", repr(override), f"a dict with keys among {sorted(defaults)}")
    bad = set(override) - set(defaults)
    expect(not bad, "config", sorted(bad), f"keys among {sorted(defaults)}")
    for k, v in override.items():
        expect(isinstance(v, int) and not isinstance(v, bool) and v >= 0, "config", f"{k}={v!r}",
               "a non-negative int")
        expect(not k.startswith("BLOCK_") or (v >= 1 and v & (v - 1) == 0), "config", f"{k}={v}", "a power of two")
        expect(k not in ("num_warps", "num_stages") or v >= 1, "config", f"{k}={v}", ">= 1")
    cfg.update(override)
    return cfg
