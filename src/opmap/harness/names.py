"""Hints for a command-line name that matches nothing (a misspelt --op, --provider, --backend).

Its own module, not core/contract.py: every kernel family imports the input contract, so an edit there
makes every family's sanitizer verdicts stale (harness/check/fingerprint.py); the CLIs' hints are not code
any kernel runs."""
from __future__ import annotations

import difflib
from typing import Iterable


def closest(unknown: Iterable[str], known: Iterable[str], n: int = 3) -> str:
    """"'x': closest ['y', ...]" for each unknown name."""
    known = sorted(known)
    return "; ".join(f"{u!r}: closest {difflib.get_close_matches(u, known, n=n, cutoff=0.5) or 'none'}"
                     for u in unknown)
