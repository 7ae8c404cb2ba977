"""The child side of ``check.workers``: rebuild the parent's selection, then run the case indices
read from stdin one at a time, answering each with one JSON line (``workpool.serve``)."""
from __future__ import annotations

import sys
from dataclasses import asdict

from opmap.harness.workpool import serve
from opmap.harness.check.runner import run_case, selection


def _run(item) -> dict:
    fam, c = item
    return {"title": c.title, "result": asdict(run_case(fam, c))}


def main(argv=None) -> int:
    return serve(argv, lambda a: selection(a["model"], a["backends"], a["ops"], a["sections"], a["quick"],
                                           a["device"])[0], _run, "selection")


if __name__ == "__main__":
    sys.exit(main())
