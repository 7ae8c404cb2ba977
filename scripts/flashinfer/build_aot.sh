#!/usr/bin/env bash
# Builds FlashInfer's kernel modules for sm90a ahead of time on the CPU-only development machine
# (nvcc 13.0 is installed here; 2 cores, minutes per module) and packs them as
# .whl/flashinfer-aot.tar.xz. scripts/gpu_env.sh unpacks that archive into FlashInfer's own AOT
# directory (flashinfer/data/aot/<module>/<module>.so), which FlashInfer loads before it tries to
# JIT-build a module: the GPU calls then spend no device time on nvcc, where every earlier
# attempt ran out of time.
#   scripts/flashinfer/build_aot.sh [sampling] [fa2] [fa3] [mla] [fa2-feat] [fa3-feat]   # default: all
# sampling: flashinfer.sampling (top-k / top-p / min-p / joint); fa2: the tensor-core decode
# (BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True): the prefill kernels, FA2); fa3: the
# paged prefill on sm90 (FA3); mla: the MLA decode (FA3, FA2 fallback); *-feat: fa2 / fa3 with a
# sliding window and a soft-cap (opmap check's window+soft-cap cases). All bf16, head_dim 128, int32 indices, no RoPE / window / soft-cap:
# the shapes opmap's adapters ask for in the bench (scripts/flashinfer/warm.py).
# A module whose .so FlashInfer cannot load on the GPU (say, an older glibc there) is logged
# ("Failed to load AOT artifact") and JIT-built as before.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
mods=("$@"); [ ${#mods[@]} -eq 0 ] && mods=(sampling fa2 fa3 mla fa2-feat fa3-feat)
fi=/tmp/opmap-fi; deps=/tmp/opmap-fi-deps
# The same FlashInfer the GPU machine unpacks, plus the Python 3.11 build of tvm-ffi's core
# (the archive's is for the GPU machine's 3.12) and FlashInfer's import-time dependencies.
rm -rf "$fi" && mkdir -p "$fi" && tar -C "$fi" -xJf .whl/flashinfer.tar.xz
python3 -m pip install -q --no-deps --target "$deps/tvm" apache-tvm-ffi==0.1.15.post2
cp "$deps"/tvm/tvm_ffi/core.cpython-311-*.so "$fi/tvm_ffi/"
python3 -m pip install -q --target "$deps" nvidia-ml-py ninja einops
# What this machine's CUDA install lacks for these modules: cuRAND's headers (sampling), and for
# the link step (nvcc here is /usr/local/bin/nvcc, so FlashInfer takes /usr/local as CUDA home)
# libcudart and a libcuda stub (no symbol of it is used: the .so does not list it as needed).
inc=/usr/local/cuda/targets/x86_64-linux/include
if [ ! -f "$inc/curand.h" ]; then
  python3 -m pip download -q --no-deps -d /tmp/opmap-curand "nvidia-curand==10.4.5.25"
  (cd /tmp/opmap-curand && unzip -q -o nvidia_curand-*.whl && cp nvidia/cu13/include/curand*.h "$inc/")
fi
mkdir -p /usr/local/lib64/stubs
ln -sf /usr/local/cuda/lib64/libcudart.so /usr/local/lib64/libcudart.so
[ -f /usr/local/lib64/stubs/libcuda.so ] || { echo "" > /tmp/opmap-empty.c; gcc -shared -o /usr/local/lib64/stubs/libcuda.so -Wl,-soname,libcuda.so.1 /tmp/opmap-empty.c; }
PATH="$deps/bin:$PATH" FLASHINFER_CUDA_ARCH_LIST="9.0" FLASHINFER_WORKSPACE_BASE=/tmp/opmap-fi-cache \
  PYTHONPATH="$fi:$deps" MAX_JOBS=${MAX_JOBS:-2} python3 "$repo/scripts/flashinfer/aot.py" "${mods[@]}"
tar -C "$fi/flashinfer/data" -cJf .whl/flashinfer-aot.tar.xz aot
ls -la .whl/flashinfer-aot.tar.xz
