"""The child side of ``check.workers``: rebuild the parent's selection, then run the case indices
read from stdin one at a time, answering each with one JSON line (``workpool``) on stdout;
whatever a case prints goes to stderr."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict

from ..workpool import answer_line, child_stdout
from .runner import run_case, selection


def main(argv=None) -> int:
    a = json.loads((argv if argv is not None else sys.argv[1:])[0])
    out = child_stdout()
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
            out.write(answer_line({"fatal": fatal}))
            continue
        fam, c = selected[k]
        out.write(answer_line({"title": c.title, "result": asdict(run_case(fam, c))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
