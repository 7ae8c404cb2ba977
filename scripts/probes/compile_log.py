"""Which Triton kernels compile (or load from the disk cache) during an engine run, and in which
engine phase: a Triton compilation listener prints each one with the time since start, the
compile seconds, whether the disk cache served it, and the engine functions on the stack
(_size_kv, _capture, _warm_up, or a step of generate). Eleventh session: a Llama-3-8B B=32 run
spent 11.9 s in its start-up warm-up and still ~0.5 s per mixed step on a fresh machine.
Usage: python3 scripts/probes/compile_log.py run --model llama3-8b ... (any opmap command line)"""
import sys
import time
import traceback

from triton import knobs

T0 = time.perf_counter()
PHASES = ("_size_kv", "_capture", "_warm_moe", "_warm_up", "generate")


def listener(*, src, metadata, metadata_group, times, cache_hit):
    names = [f.name for f in traceback.extract_stack()]
    where = [p for p in PHASES if p in names]
    step = "step" in names
    total = times.total / 1e6  # microseconds
    print(f"[compile] t={time.perf_counter() - T0:7.2f}s {metadata.get('name', '?'):40s} "
          f"{'disk cache' if cache_hit else f'compiled in {total:.2f} s'} "
          f"in {'/'.join(where) or 'other'}{' (step)' if step else ''} "
          f"attrs={str(getattr(src, 'attrs', ''))[:160]}", file=sys.stderr, flush=True)


knobs.compilation.listener = listener
from opmap.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
