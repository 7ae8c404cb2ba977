#!/usr/bin/env bash
# Builds .whl/flashinfer.tar.xz (~15 MB): FlashInfer 0.7.2.post1 and apache-tvm-ffi for the GPU
# machine's Python 3.12, trimmed of the CUDA sources of kernel families opmap does not build
# (the large families: fused_moe, gdn, xqa, ...). scripts/gpu.sh unpacks it onto PYTHONPATH when it is there;
# carry .whl in the device call. FlashInfer then JIT-compiles its kernels on first use
# (seconds to minutes per configuration on 16 cores: FA3 prefill and sampling the longest).
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$tmp" flashinfer-python==0.7.2.post1
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$tmp" apache-tvm-ffi==0.1.15.post2
mkdir -p "$tmp/x" .whl
(cd "$tmp/x" && for w in ../*.whl; do unzip -q -o "$w"; done
 find . -name __pycache__ -type d -prune -exec rm -rf {} +
 cd flashinfer/data/csrc && rm -rf cake_dsv4 cake_sampling kda fused_moe gdn cake_fmha experimental \
   blackwell_* fmha_v2 xqa nv_internal *_sm100*)
tar -C "$tmp/x" -cJf .whl/flashinfer.tar.xz flashinfer tvm_ffi $(cd "$tmp/x" && ls -d apache_tvm_ffi-*.dist-info)
rm -rf "$tmp"
ls -la .whl/flashinfer.tar.xz
