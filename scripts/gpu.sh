#!/usr/bin/env bash
# Runs on a GPU machine, offline, from the checkout: the GPU tests, `opmap check`, the benchmarks
# (which rewrite bench/baselines/<gpu>/<family>.{json,md,png}) and the end-to-end benchmark,
# writing logs to OUTDIR and a copy of the baselines to OUTDIR/baselines.tar.gz.
#   scripts/gpu.sh OUTDIR                                  # everything, in this order
#   STEPS="tests bench" scripts/gpu.sh OUTDIR              # some steps
#   TEST_LANES="tests/gpu/test_mla_gpu.py|tests/gpu/test_attention_gpu.py" STEPS=tests scripts/gpu.sh OUTDIR
#   BENCH_ARGS="--op attention --variants" STEPS=bench scripts/gpu.sh OUTDIR
#   CHECK_ARGS="--sanitizer --resume check/state/llama3-8b.jsonl" STEPS=check scripts/gpu.sh OUTDIR
#   STEPS=flashinfer scripts/gpu.sh OUTDIR                 # FlashInfer's JIT builds for the bench shapes
#   NO_FLASHINFER=1 STEPS=report scripts/gpu.sh OUTDIR      # `opmap report` per model, timed
# Steps: env, tests (pytest -m gpu, one process per file; TEST_LANES="a b|c" runs lanes at once),
# check (MODELS, default llama3-8b), bench (BENCH_ARGS, default --quick), e2e (E2E_ARGS, default
# --quick), report (`opmap report` for each of MODELS into OUTDIR/report-M, timed), flashinfer.
# Packages the GPU machine lacks travel in .whl/ (scripts/pack_wheels.sh, scripts/flashinfer/pack.sh);
# scripts/gpu_env.sh installs them.
set -uo pipefail
out=${1:?usage: scripts/gpu.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
STEPS=${STEPS:-"env tests check bench e2e"}
MODELS=${MODELS:-"llama3-8b"}
status=0
step() { echo "== $1 ($(date -u +%T))"; }
run_file() {
  local f=$1 n; n=$(basename "$f" .py)
  echo "== tests $f ($(date -u +%T))"
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --timeout 240 \
    --junitxml="$out/junit-$n.xml" "$f" ${TEST_ARGS:-} > "$out/tests-$n.log" 2>&1
  local rc=$?
  tail -3 "$out/tests-$n.log"
  return $rc
}
pack_baselines() { tar -czf "$out/baselines.tar.gz" bench/baselines 2>/dev/null; }
for s in $STEPS; do
  case $s in
    env)
      step env
      python3 -m opmap.cli env 2>&1 | tee "$out/env.log" || status=1 ;;
    tests)
      : > "$out/tests.log"
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
        timeout "${CHECK_TIMEOUT:-300}" python3 -m opmap.cli check --model "$m" --json "$out/check-$m.json" \
          ${CHECK_ARGS:-} 2>&1 | tee "$out/check-$m.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      done ;;
    bench)
      step bench
      timeout "${BENCH_TIMEOUT:-420}" python3 -m opmap.cli bench ${BENCH_ARGS:---quick} 2>&1 | tee "$out/bench.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      pack_baselines ;;
    e2e)
      step e2e
      timeout "${E2E_TIMEOUT:-560}" python3 -m opmap.bench.cases.e2e ${E2E_ARGS:---quick} 2>&1 | tee "$out/e2e.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      pack_baselines ;;
    report)
      for m in $MODELS; do
        step "report $m"
        t0=$(date +%s)
        timeout "${REPORT_TIMEOUT:-300}" python3 -m opmap.cli report --model "$m" --out "$out/report-$m" \
          2>&1 | tee "$out/report-$m.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
        echo "report $m: $(( $(date +%s) - t0 )) s wall" | tee -a "$out/report-$m.log"
      done ;;
    flashinfer)
      # FlashInfer's JIT modules for the shapes the benchmarks time, one by one with their build
      # times, then the build tree packed so that a later run on a fresh machine reuses it.
      step flashinfer
      timeout "${FI_TIMEOUT:-540}" python3 scripts/flashinfer/warm.py --budget "${FI_BUDGET:-420}" 2>&1 | tee "$out/flashinfer.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      if [ -d /tmp/opmap-fi-cache/.cache ]; then
        tar -C /tmp/opmap-fi-cache -cJf "$out/flashinfer-cache.tar.xz" .cache
      fi ;;
    *) echo "unknown step $s"; status=1 ;;
  esac
done
echo "== done, status $status"
exit $status
