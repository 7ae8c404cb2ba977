#!/usr/bin/env bash
# Engine speed on the GPU machine, same build, one after another (benchmarks run alone):
# one-step-ahead decode (default), lockstep, and PDL; then the decode-step profile.
#   scripts/engine_speed.sh OUTDIR [e2e args...]     (default: --model llama3-8b --case 1 --case 32 --no-hf)
set -uo pipefail
out=${1:?usage: scripts/engine_speed.sh OUTDIR [e2e args]}; shift
args=${*:-"--model llama3-8b --case 1 --case 32 --no-hf"}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
mkdir -p "$out/async" "$out/lockstep" "$out/pdl"
t=${RUN_TIMEOUT:-150}
echo "== async $(date -u +%T)"; timeout $t python3 -m opmap.bench.cases.e2e $args --out "$out/async" 2>&1 | tail -25
echo "== lockstep $(date -u +%T)"; timeout $t python3 -m opmap.bench.cases.e2e $args --lockstep --out "$out/lockstep" 2>&1 | tail -25
echo "== pdl $(date -u +%T)"; OPMAP_PDL=1 timeout $t python3 -m opmap.bench.cases.e2e $args --out "$out/pdl" 2>&1 | tail -25
if [ -n "${PROFILE:-}" ]; then
  echo "== profile $(date -u +%T)"
  timeout $t python3 -m opmap.cli profile --model llama3-8b --max-num-seqs 1 --num-requests 2 --input-len 1024 \
    --output-len 128 --steps 60 --kernels 25 2>&1 | tee "$out/profile-llama3-8b.log" | tail -60
fi
echo "== done $(date -u +%T)"
