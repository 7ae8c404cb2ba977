#!/usr/bin/env bash
# Runs on the GPU machine, offline, from the checkout: the GPU tests, `opmap check` and
# `opmap bench`, writing logs and result files to OUTDIR.
#   scripts/gpu.sh OUTDIR            # everything
#   STEPS="tests bench" scripts/gpu.sh OUTDIR
#   BENCH_ARGS="--op attention" TEST_FILES="tests/gpu/test_attention_gpu.py" scripts/gpu.sh OUTDIR
#   STEPS=tests TEST_LANES="tests/gpu/test_engine_gpu.py tests/gpu/test_parity_gpu.py|tests/gpu/test_attention_gpu.py" ...
#   STEPS=flashinfer scripts/gpu.sh OUTDIR   # FlashInfer's JIT builds for the bench shapes (FI_CHECK=1: and its check cases); packs them
# Peers and packages the GPU machine lacks travel in .whl/ (git-ignored; name it in the device
# call's carry): scripts/pack_wheels.sh and scripts/pack_flashinfer.sh fill it.
# Each step's log is OUTDIR/<step>.log; results: junit-*.xml, check-*.json, bench JSON/MD/PNG.
set -uo pipefail
out=${1:?usage: scripts/gpu.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
STEPS=${STEPS:-"env tests check bench e2e"}
MODELS=${MODELS:-"llama3-8b"}
status=0
step() { echo "== $1 ($(date -u +%T))"; }
for s in $STEPS; do
  case $s in
    env)
      step env
      python3 -m opmap.cli env 2>&1 | tee "$out/env.log" || status=1 ;;
    tests)
      # One process per test file: each family starts with an empty GPU (memory, autotune caches).
      # TEST_LANES="a.py b.py|c.py" runs the lanes at once (files in a lane one after another):
      # correctness runs can share the GPU; keep the memory-heavy files (engine, parity) in one lane.
      : > "$out/tests.log"
      run_file() {
        local f=$1 n; n=$(basename "$f" .py)
        echo "== tests $f ($(date -u +%T))"
        timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --timeout 240 \
          --junitxml="$out/junit-$n.xml" "$f" ${TEST_ARGS:-} > "$out/tests-$n.log" 2>&1
        local rc=$?
        tail -3 "$out/tests-$n.log"
        return $rc
      }
      if [ -n "${TEST_LANES:-}" ]; then
        IFS='|' read -ra lanes <<< "$TEST_LANES"
        pids=()
        for lane in "${lanes[@]}"; do
          ( rc=0; for f in $lane; do run_file "$f" || rc=1; done; exit $rc ) >> "$out/tests.log" 2>&1 &
          pids+=($!)
        done
        for p in "${pids[@]}"; do wait "$p" || status=1; done
        cat "$out/tests.log"
      else
        for f in ${TEST_FILES:-tests/gpu/test_*.py}; do
          run_file "$f" 2>&1 | tee -a "$out/tests.log"
          [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
        done
      fi ;;
    check)
      for m in $MODELS; do
        step "check $m"
        timeout ${CHECK_TIMEOUT:-300} python3 -m opmap.cli check --model "$m" --json "$out/check-$m.json" \
          ${CHECK_ARGS:-} 2>&1 | tee "$out/check-$m.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      done ;;
    bench)
      step bench
      timeout ${BENCH_TIMEOUT:-420} python3 -m opmap.cli bench --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    e2e)
      step e2e
      timeout ${E2E_TIMEOUT:-420} python3 -m opmap.bench.cases.e2e ${E2E_ARGS:---quick} --out "$out" 2>&1 | tee "$out/e2e.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    flashinfer)
      # FlashInfer's JIT modules for the shapes the benchmarks time, one by one with their build
      # times (scripts/flashinfer_warm.py), then, with what time is left, its check cases (which
      # need more modules: windows, soft-caps), then the build tree packed for the next call.
      step flashinfer
      timeout ${FI_TIMEOUT:-540} python3 scripts/flashinfer_warm.py --budget ${FI_BUDGET:-420} 2>&1 | tee "$out/flashinfer.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      if [ -n "${FI_CHECK:-}" ]; then
        timeout ${FI_CHECK_TIMEOUT:-300} python3 -m opmap.cli check --backend flashinfer mla-flashinfer \
          --json "$out/check-flashinfer.json" 2>&1 | tee -a "$out/flashinfer.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      fi
      if [ -d /tmp/opmap-fi-cache/.cache ]; then
        # The whole build tree: ninja decides freshness from its log and the objects, so the .so
        # files alone would be rebuilt. Paths match on the next call (same unpack locations).
        tar -C /tmp/opmap-fi-cache -cJf "$out/flashinfer-cache.tar.xz" .cache
        ls -la "$out/flashinfer-cache.tar.xz"
      fi ;;
    *) echo "unknown step $s"; status=1 ;;
  esac
done
echo "== done, status $status"
exit $status
