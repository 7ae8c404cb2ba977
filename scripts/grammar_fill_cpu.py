"""Time XGrammar's bitmask fill per token on this machine's CPU (no GPU needed): the
``grammar_fill`` case of ``opmap bench`` (JSON Schema, GPT-2's real vocabulary, matchers advanced
through the case's prefixes), timed with perf_counter. Writes OUT/<date>-<host>-grammar-fill.json.

    PYTHONPATH=src python3 scripts/grammar_fill_cpu.py OUT
"""
import datetime
import json
import os
import statistics
import sys
import time

from opmap.bench.cases import grammar as G
from opmap.bench.report import environment


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "bench/results"
    inp = G._fill_setup("cpu")
    fn = G._fill(inp)
    fn()  # warm-up
    ts = []
    for _ in range(200):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    n = len(G.PREFIXES)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    from importlib.metadata import version

    doc = {"environment": environment(), "cpu": cpu, "cores": os.cpu_count(), "xgrammar": version("xgrammar"), "states": n,
           "fill_us_median": statistics.median(ts) / n * 1e6, "fill_us_p90": sorted(ts)[int(0.9 * len(ts))] / n * 1e6,
           "note": "per token of one request: one fill_next_token_bitmask per matcher state, vocab 50304 (GPT-2, padded)"}
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{datetime.date.today().isoformat()}-cpu-{os.cpu_count()}cores-grammar-fill.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
