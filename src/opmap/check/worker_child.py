"""The child side of ``check.workers``: rebuild the parent's selection, then run the case indices
read from stdin one at a time, answering each with one JSON line (``workers.MARK``) on stdout;
whatever a case prints goes to stderr."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

from .runner import run_case, selection
from .workers import MARK


def main(argv=None) -> int:
    a = json.loads((argv if argv is not None else sys.argv[1:])[0])
    # Answers go to the real stdout; anything a case prints (Python or C) goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        selected = selection(a["model"], a["backends"], a["ops"], a["sections"], a["quick"], a["device"])[0]
    except Exception as e:  # answer every request with the reason
        selected, fatal = None, f"the worker could not build the selection: {type(e).__name__}: {e}"
    else:
        fatal = None if len(selected) == a["total"] else (
            f"the worker's selection has {len(selected)} cases, the parent's {a['total']}")
    for line in sys.stdin:
        k = int(line)
        if fatal:
            out.write(MARK + json.dumps({"fatal": fatal}) + "\n")
            continue
        fam, c = selected[k]
        out.write(MARK + json.dumps({"title": c.title, "result": asdict(run_case(fam, c))}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
