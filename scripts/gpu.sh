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
#   E2E_ARGS="--model llama3-8b --case 1" STEPS=e2e-start scripts/gpu.sh OUTDIR   # the e2e benchmark detached,
#   STEPS=e2e-wait scripts/gpu.sh OUTDIR                     # then (the next device call) wait for it, collect
# (the full e2e grid takes longer than one device call: its compiled HF peers compile for minutes)
# Steps: env, tests (pytest -m gpu, one process per file; TEST_LANES="a b|c" runs lanes at once),
# check (MODELS, default llama3-8b), bench (BENCH_ARGS, default --quick), e2e (E2E_ARGS, default
# --quick), e2e-start / e2e-wait (the e2e benchmark in the background of a kept-warm machine,
# E2E_WAIT seconds per wait, default 540), report (`opmap report` for each of MODELS into
# OUTDIR/report-M, timed), flashinfer.
# Packages the GPU machine lacks travel in .whl/ (scripts/pack_wheels.sh, scripts/flashinfer/pack.sh);
# scripts/gpu_env.sh installs them.
# PACK=1: OUTDIR ends as one archive, OUTDIR.tgz, in its place (a machine that hands back a few files
# a call, as the device tool does, returns all of it; the steps' many logs would not all come back).
set -uo pipefail
out=${1:?usage: scripts/gpu.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
STEPS=${STEPS:-"env tests check bench e2e"}
MODELS=${MODELS:-"llama3-8b"}
status=0
if [ "${PACK:-}" = 1 ]; then
  trap 'tar -czf "$out.tgz" -C "$out" . && rm -rf "$out"' EXIT
fi
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
      python3 -m opmap.cli.main env 2>&1 | tee "$out/env.log" || status=1 ;;
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
        timeout "${CHECK_TIMEOUT:-300}" python3 -m opmap.cli.main check --model "$m" --json "$out/check-$m.json" \
          ${CHECK_ARGS:-} 2>&1 | tee "$out/check-$m.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      done ;;
    bench)
      step bench
      timeout "${BENCH_TIMEOUT:-420}" python3 -m opmap.cli.main bench ${BENCH_ARGS:---quick} 2>&1 | tee "$out/bench.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      pack_baselines ;;
    e2e)
      step e2e
      timeout "${E2E_TIMEOUT:-560}" python3 -m opmap.harness.bench.cases.e2e ${E2E_ARGS:---quick} 2>&1 | tee "$out/e2e.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      pack_baselines ;;
    e2e-start)
      step e2e-start
      E2E_DIR=/tmp/opmap-e2e
      if [ -f $E2E_DIR/pid ] && kill -0 "$(cat $E2E_DIR/pid)" 2>/dev/null; then
        echo "an e2e run is already going (pid $(cat $E2E_DIR/pid))"
      else
        rm -rf $E2E_DIR && mkdir -p $E2E_DIR
        setsid nohup python3 -m opmap.harness.bench.cases.e2e ${E2E_ARGS:---quick} --out $E2E_DIR > $E2E_DIR/log 2>&1 &
        echo $! > $E2E_DIR/pid
        echo "e2e started (pid $!): ${E2E_ARGS:---quick}; collect it with STEPS=e2e-wait"
      fi ;;
    e2e-wait)
      step e2e-wait
      E2E_DIR=/tmp/opmap-e2e
      end=$(( $(date +%s) + ${E2E_WAIT:-540} ))
      while [ -f $E2E_DIR/pid ] && kill -0 "$(cat $E2E_DIR/pid)" 2>/dev/null && [ "$(date +%s)" -lt $end ]; do sleep 5; done
      grep "^\[e2e\]" $E2E_DIR/log | tail -3
      cp $E2E_DIR/log "$out/e2e.log" 2>/dev/null
      cp $E2E_DIR/e2e-partial.json "$out/" 2>/dev/null
      if kill -0 "$(cat $E2E_DIR/pid 2>/dev/null)" 2>/dev/null; then
        echo "e2e still running: run STEPS=e2e-wait again (what it finished is in $out/e2e-partial.json)"
      elif ls $E2E_DIR/*/e2e.json >/dev/null 2>&1; then
        for d in $E2E_DIR/*/; do mkdir -p "bench/baselines/$(basename $d)" && cp $d/e2e.* "bench/baselines/$(basename $d)/"; done
        tail -40 $E2E_DIR/log
        pack_baselines
      else
        echo "e2e ended without a result file"; tail -5 $E2E_DIR/log; status=1
      fi ;;
    report)
      for m in $MODELS; do
        step "report $m"
        t0=$(date +%s)
        timeout "${REPORT_TIMEOUT:-300}" python3 -m opmap.cli.main report --model "$m" --out "$out/report-$m" \
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
