"""Build FlashInfer's JIT modules for exactly the shapes `opmap bench` times, one at a time,
through opmap's own adapters (so the module names match what the bench asks for), and report how
long each took. Run on the GPU machine before the benchmarks (scripts/gpu.sh, step
"flashinfer"); the build tree it fills is packed there for the next call.

  python3 scripts/flashinfer/warm.py [--budget SECONDS]

A build that fails is reported and the next one still runs; when the budget is spent the rest
are listed as not attempted. Exit status 0 if every attempted build succeeded.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch


def _gqa_inputs(B, L, hq, hk, d=128, page=16, dev="cuda"):
    pages = -(-L // page)
    kc = torch.randn(B * pages + 1, page, hk, d, dtype=torch.bfloat16, device=dev)
    vc = torch.randn_like(kc)
    bt = torch.arange(B * pages, dtype=torch.int32, device=dev).view(B, pages)
    return kc, vc, torch.full((B,), L, dtype=torch.int32, device=dev), bt


def decode_gqa():
    from opmap.core import registry

    kc, vc, sl, bt = _gqa_inputs(2, 300, 32, 8)
    q = torch.randn(2, 32, 128, dtype=torch.bfloat16, device="cuda")
    registry.get("attention", "flashinfer")("decode", q, kc, vc, sl, bt, scale=128 ** -0.5)


def prefill(hq, hk):
    def run():
        from opmap.core import registry

        kc, vc, sl, bt = _gqa_inputs(1, 300, hq, hk)
        q = torch.randn(300, hq, 128, dtype=torch.bfloat16, device="cuda")
        cu = torch.tensor([0, 300], dtype=torch.int32, device="cuda")
        registry.get("attention", "flashinfer")("prefill", q, kc, vc, cu, sl, bt, scale=128 ** -0.5)

    return run


def sampling(kind):
    def run():
        from opmap.peers.sampling import flashinfer_peer as fi

        B, V = 4, 32000
        x = torch.randn(B, V, device="cuda")
        full = lambda v, dt=torch.float32: torch.full((B,), v, dtype=dt, device="cuda")  # noqa: E731
        k, p, mp = {"top_k": (50, 1.0, 0.0), "top_p": (0, 0.9, 0.0), "min_p": (0, 1.0, 0.05),
                    "joint": (50, 0.9, 0.0), "none": (0, 1.0, 0.0)}[kind]
        fn = fi.sample_joint if kind == "joint" else fi.sample
        fn(x, full(0.8), full(k, torch.int32), full(p), full(mp), torch.arange(B, device="cuda"),
           torch.arange(B, device="cuda"))

    return run


def mla(heads):
    def run():
        from opmap.core import registry

        B, L, R, Dr, page = 2, 300, 512, 64, 64
        pages = -(-L // page)
        cache = torch.randn(B * pages + 1, page, R + Dr, dtype=torch.bfloat16, device="cuda")
        bt = torch.arange(B * pages, dtype=torch.int32, device="cuda").view(B, pages)
        sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
        qn = torch.randn(B, heads, R, dtype=torch.bfloat16, device="cuda")
        qp = torch.randn(B, heads, Dr, dtype=torch.bfloat16, device="cuda")
        registry.get("attention", "mla-flashinfer")("mla_decode", qn, qp, cache, sl, bt, scale=(128 + 64) ** -0.5)

    return run


BUILDS = [("attention decode, GQA 32/8, d128, page 16", decode_gqa),
          ("attention prefill, MHA 32/32, causal", prefill(32, 32)),
          ("attention prefill, GQA 32/8, causal", prefill(32, 8)),
          ("sampling top-k", sampling("top_k")), ("sampling top-p", sampling("top_p")),
          ("sampling min-p", sampling("min_p")), ("sampling top-k + top-p (joint)", sampling("joint")),
          ("sampling, no filter", sampling("none")),
          ("MLA decode, 16 heads", mla(16)), ("MLA decode, 128 heads", mla(128))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=480.0, help="seconds; builds not started by then are skipped")
    a = ap.parse_args(argv)
    t_start, failed = time.perf_counter(), 0
    for i, (name, fn) in enumerate(BUILDS):
        if time.perf_counter() - t_start > a.budget:
            for rest, _ in BUILDS[i:]:
                print(f"[flashinfer warm] not attempted (budget spent): {rest}", flush=True)
            break
        t = time.perf_counter()
        try:
            fn()
            torch.cuda.synchronize()
            print(f"[flashinfer warm] built and ran in {time.perf_counter() - t:6.1f} s: {name}", flush=True)
        except Exception as e:  # noqa: BLE001 - a failed build is a finding; the next one still runs
            failed += 1
            print(f"[flashinfer warm] FAILED after {time.perf_counter() - t:6.1f} s: {name}: "
                  f"{type(e).__name__}: {str(e)[:400]}", flush=True)
            traceback.print_exc(limit=3, file=sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
