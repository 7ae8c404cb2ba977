"""Build FlashInfer modules for sm90a without a GPU and copy each .so into FlashInfer's AOT
directory (flashinfer/data/aot/<name>/<name>.so), where FlashInfer loads it before any JIT build.
Run through scripts/flashinfer/build_aot.sh (which sets the paths and the target architecture).

  python3 scripts/flashinfer/aot.py sampling fa2 fa3 mla fa2-feat fa3-feat

The module arguments are the ones FlashInfer 0.7.2.post1's wrappers derive for opmap's adapters
at the bench shapes: bf16 q / kv / out, int32 indices, head_dim 128, no RoPE (posenc 0), no
sliding window, no soft-cap, no fp16 QK reduction. ``fa2``: the tensor-core decode
(``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`` plans the FA2 prefill kernels);
``fa3``: the paged prefill, which picks FA3 on sm90 for these types.
"""
from __future__ import annotations

import shutil
import sys
import time
import traceback

import torch
import flashinfer.jit.env as env
from flashinfer.jit import sampling
from flashinfer.jit.attention import modules as M

BF = torch.bfloat16
ARGS = (BF, BF, BF, torch.int32, 128, 128, 0, False, False, False)
# with a sliding window and a soft-cap: opmap check's "window+soft-cap" cases
FEAT = (BF, BF, BF, torch.int32, 128, 128, 0, True, True, False)
SPECS = {
    "sampling": lambda: [sampling.gen_sampling_module()],
    "fa2": lambda: [M._gen_batch_prefill_primary_module("fa2", *ARGS),
                    M._gen_batch_prefill_independent_paged_module("fa2", *ARGS)],
    "fa3": lambda: [M.gen_batch_prefill_module("fa3", *ARGS)],
    "fa2-feat": lambda: [M._gen_batch_prefill_primary_module("fa2", *FEAT),
                         M._gen_batch_prefill_independent_paged_module("fa2", *FEAT)],
    "fa3-feat": lambda: [M.gen_batch_prefill_module("fa3", *FEAT)],
    # MLA decode (BatchMLAPagedAttentionWrapper(backend="auto"): FA3 first on sm90, FA2 its
    # fallback), latent 512 + RoPE 64, int32 query offsets, no profiler
    "mla": lambda: [M.gen_batch_mla_module(b, BF, BF, BF, torch.int32, 512, 64, False) for b in ("fa3", "fa2")],
}


def main(names) -> int:
    failed = 0
    for key in names:
        for spec in SPECS[key]():
            t = time.time()
            try:
                spec.build(verbose=False)
                so = spec.get_library_path()
                dst = env.FLASHINFER_AOT_DIR / spec.name / f"{spec.name}.so"
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(so, dst)
                print(f"{key}: {spec.name} built in {time.time() - t:.0f} s ({so.stat().st_size / 1e6:.1f} MB)",
                      flush=True)
            except Exception:  # noqa: BLE001 - report and build the next one
                failed += 1
                traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(SPECS)))
