#!/usr/bin/env bash
# The GPU sessions' calls (docs/results-2026-11-30.md, "The next GPU session"), one per PART,
# each within one device call (< 600 s; start-up excluded). Works in /tmp and leaves
# OUTDIR/all.tgz (every log and result) and OUTDIR/summary.txt. Carry .whl in the device call.
#   scripts/gpu_session.sh final OUTDIR        # every preset's sanitizer section, resumed (qwen3, deepseek, llama3 reusing the runs before);
#                                              # FINAL_TESTS="a.py|b.py" runs GPU test lanes beside it;
#                                              # SAN_PARALLEL="1 5 3": the presets side by side with those --jobs
#   scripts/gpu_session.sh sampler OUTDIR      # sampler GPU tests, per-kernel profile, sampling bench (~4 min)
#   scripts/gpu_session.sh bench OUTDIR        # kernel benchmarks, each fused path against its switch
#   scripts/gpu_session.sh engine OUTDIR       # e2e B=1, Llama and Qwen3-MoE B=1 profiles (alone on the GPU)
#   scripts/gpu_session.sh profiles OUTDIR     # Llama B=32 profile; Qwen3 B=1 with and without the MoE kernels under PDL
#   scripts/gpu_session.sh flashinfer OUTDIR   # FlashInfer JIT builds for the bench shapes
#   scripts/gpu_session.sh fi-bench OUTDIR     # sampling, GQA decode and prefill quick grids with FlashInfer's
#                                              # rows from .whl/flashinfer-aot.tar.xz (scripts/build_flashinfer_aot.sh)
#   scripts/gpu_session.sh sampling-full OUTDIR # the full sampling grid with FlashInfer's rows (~5 min)
#   scripts/gpu_session.sh e2e10 OUTDIR        # B=32 e2e llama3 / qwen3, deepseek run, with the start-up fixes; llama3 pages 16 vs 64
#   scripts/gpu_session.sh mla11 OUTDIR        # engine GPU tests alone; MLA 16-head decomposition probe; the full MLA grid
#                                              # (default, FlashInfer and the torch peers only) (~8 min)
#   scripts/gpu_session.sh check12 OUTDIR      # after the eleventh session: GPU tests of every changed family (engine alone),
#                                              # a fresh-cache compile log of a B=32 run, the MLA quick grid with the fp8 TMA row (~9 min)
#   scripts/gpu_session.sh check13 OUTDIR      # after the twelfth session: attention and MLA GPU tests, the quick
#                                              # decode grids with the fp8 rows of the previous path, host-time probes (~8 min)
#   scripts/gpu_session.sh fix14 OUTDIR        # attention TMA and MLA GPU tests, MLA prefill configs (~3 min)
#   scripts/gpu_session.sh ncu14 OUTDIR        # ncu on the fp8 decodes beside bf16 / cast (~5 min)
#   scripts/gpu_session.sh grid14 OUTDIR       # fp8 GQA tile variants, 128-head fp8 MLA configs, 16-head fp8 MLA via TMA (~8 min)
#   scripts/gpu_session.sh mla15 OUTDIR        # the MLA prefill's placement-dependent time: rounds with per-kernel GPU times (~2 min)
#   scripts/gpu_session.sh host14 OUTDIR       # the B=1 prefill host-time probe with idle gaps and SM clocks (~2 min)
#   scripts/gpu_session.sh san13 OUTDIR        # the MLA and attention sanitizer cases stale at today's code, two presets at once
#   scripts/gpu_session.sh fp8-13 OUTDIR       # the fp8 halves of the MLA and GQA decode grids beside the previous path (~9 min)
#   scripts/gpu_session.sh verify OUTDIR       # attention, engine and MLA GPU tests beside the sanitizer's
#                                              # re-run of changed families (~7 min)
set -uo pipefail
part=${1:?usage: scripts/gpu_session.sh final|verify|mla15|fix14|ncu14|grid14|host14|san13|check13|fp8-13|check12|mla11|mem11|ab11|compiles11|e2e10|sampling-full|fi-bench|sampler|bench|engine|profiles|flashinfer OUTDIR}
out=${2:?usage: scripts/gpu_session.sh PART OUTDIR}
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
# FlashInfer only in its own parts (the others compare our kernels with their own switches).
case $part in flashinfer|fi-bench|sampling-full|mla11) ;; *) export NO_FLASHINFER=1 ;; esac
. scripts/gpu_env.sh
mkdir -p "$out"
res=$out
[ "$part" != flashinfer ] && out=/tmp/opmap-session-$part && rm -rf "$out" && mkdir -p "$out"
# Name the commit in the device call (OPMAP_COMMIT=$(git rev-parse --short HEAD) scripts/gpu_session.sh ...):
# the device's copy of .git has a stale HEAD, so the result files would name the wrong commit.
[ -z "${OPMAP_COMMIT:-}" ] && echo "warning: OPMAP_COMMIT is not set; result files name the device copy's stale HEAD" >&2
# compute-sanitizer children outlive an opmap check that `timeout` killed: on a machine kept warm
# they ran on into the next call (sixth session: its bench figures were 4x slow, a racecheck timed out).
pkill -f '[c]ompute-sanitizer' 2>/dev/null
# A call stopped at its time limit still returns what was done: the archive is made on TERM too.
[ "$part" != flashinfer ] && trap 'tar -C "$out" -czf "$res/all.tgz" . 2>/dev/null; exit 124' TERM
case $part in
  final)
    # Every preset's sanitizer section (the check's other sections run each time), resuming from
    # check/state/ and within ${SAN_TIMEOUT:-540} s in all: qwen3-30b-a3b first (the most cases),
    # then deepseek-v2-lite and llama3-8b, each reusing the verdicts of the same cases from the
    # runs before it (--reuse). Only verdicts whose family's source fingerprint is today's count
    # (check/fingerprint.py), so a kernel edited since its verdict runs again. --batch 1: each case
    # in its own child, so a verdict is saved as soon as it ends. Copy OUT/*/state.jsonl back into
    # check/state/ and call again until every preset reports all cases done.
    # --timeout 480: the MoE racecheck at qwen3 shapes took 359 s alone (sixth session); the
    # runs start longest first (racecheck, MoE first), so it starts at the top of a call.
    # FINAL_TESTS="a.py|b.py c.py": GPU test lanes beside the sanitizer (correctness only, so they
    # may share the GPU; timings never run here).
    tpid=
    if [ -n "${FINAL_TESTS:-}" ]; then
      (STEPS=tests TEST_TIMEOUT=300 TEST_LANES="$FINAL_TESTS" timeout 420 scripts/gpu.sh "$out/tests" \
        > "$out/tests-driver.log" 2>&1) &
      tpid=$!
    fi
    t0=$SECONDS; budget=${SAN_TIMEOUT:-540}; prev=()
    if [ -n "${SAN_PARALLEL:-}" ]; then
      # The three presets side by side, SAN_PARALLEL="jobs jobs jobs" each (one qwen3 case left
      # took the whole of a 300 s call alone, the GPU idle beside it); each reuses the verdicts
      # of the presets before it as they stood at the start.
      read -r -a js <<< "$SAN_PARALLEL"; i=0; pids=()
      for m in qwen3-30b-a3b deepseek-v2-lite llama3-8b; do
        mkdir -p "$out/$m"; [ -f "check/state/$m.jsonl" ] && cp "check/state/$m.jsonl" "$out/$m/state.jsonl"
        reuse=(); for p in "${prev[@]}"; do reuse+=(--reuse "$p"); done
        timeout $budget python3 -m opmap.cli check --model $m --sanitizer --resume "$out/$m/state.jsonl" "${reuse[@]}" \
          --out "$out/$m" --jobs ${js[$i]:-3} --batch 1 --timeout 480 > "$out/$m/check.log" 2>&1 &
        pids+=($!); prev+=("check/state/$m.jsonl"); i=$((i + 1))
      done
      wait "${pids[@]}"; pkill -f '[c]ompute-sanitizer' 2>/dev/null
    fi
    for m in qwen3-30b-a3b deepseek-v2-lite llama3-8b; do
      [ -n "${SAN_PARALLEL:-}" ] && break
      left=$(( budget - (SECONDS - t0) )); [ $left -lt 40 ] && break
      mkdir -p "$out/$m"; [ -f "check/state/$m.jsonl" ] && cp "check/state/$m.jsonl" "$out/$m/state.jsonl"
      reuse=(); for p in "${prev[@]}"; do reuse+=(--reuse "$p"); done
      timeout $left python3 -m opmap.cli check --model $m --sanitizer --resume "$out/$m/state.jsonl" "${reuse[@]}" \
        --out "$out/$m" --jobs ${SAN_JOBS:-9} --batch 1 --timeout 480 > "$out/$m/check.log" 2>&1
      prev+=("$out/$m/state.jsonl")
      pkill -f '[c]ompute-sanitizer' 2>/dev/null
    done
    [ -n "$tpid" ] && wait "$tpid" ;;
  sampler)
    # After a sampler change: its GPU tests, then (alone) each kernel's time and the bench.
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sampling_gpu.py \
      > "$out/tests-sampling.log" 2>&1
    timeout 90 python3 scripts/profile_sampler.py "$out/profile-sampler.json" > "$out/profile-sampler.log" 2>&1
    timeout 150 python3 -m opmap.cli bench --quick --op sampling --out "$out/bench" > "$out/bench.log" 2>&1 ;;
  bench)
    # Quick grids: sampling + kv_append (rope+append against two launches), decode, MLA.
    timeout 120 python3 -m opmap.cli bench --quick --op sampling --op kv_append --out "$out/bench" \
      > "$out/bench.log" 2>&1
    # attention.decode's quick grid has the split-length variants at B=1 / 32768.
    timeout 120 python3 -m opmap.cli bench --quick --op attention.decode --out "$out/decode" \
      > "$out/decode.log" 2>&1
    timeout 90 python3 -m opmap.cli bench --quick --op attention.mla_decode --op attention.mla_sparse_decode \
      --out "$out/mla" > "$out/mla.log" 2>&1 ;;
  engine)
    timeout 150 python3 -m opmap.bench.cases.e2e --model llama3-8b --case 1 --no-hf --out "$out/e2e" \
      > "$out/e2e.log" 2>&1
    # Where the B=1 step's 4.47 ms go now that the host no longer waits inside it (sixth session):
    # the per-kernel table against the 3.52 ms weight floor.
    timeout 120 python3 -m opmap.cli profile --model llama3-8b --max-num-seqs 1 --num-requests 2 \
      --input-len 1024 --output-len 128 --steps 60 --kernels 25 > "$out/profile-llama3-8b-b1.log" 2>&1
    timeout 120 python3 -m opmap.cli profile --model qwen3-30b-a3b --max-num-seqs 1 --num-requests 2 \
      --input-len 1024 --output-len 128 --steps 60 --kernels 25 > "$out/profile-qwen3-30b-a3b-b1.log" 2>&1 ;;
  profiles)
    # Where the B=32 decode step's 5.1 ms go (floor 3.47 ms), and which MoE kernel PDL slows
    # (Qwen3 B=1 TPOT 3.55 ms with the MoE kernels off PDL, 3.96 with them: seventh session).
    timeout 100 python3 -m opmap.cli profile --model llama3-8b --max-num-seqs 32 --num-requests 32 \
      --input-len 512 --output-len 128 --steps 60 --kernels 25 > "$out/profile-llama3-8b-b32.log" 2>&1
    timeout 90 python3 -m opmap.cli profile --model qwen3-30b-a3b --max-num-seqs 1 --num-requests 2 \
      --input-len 1024 --output-len 128 --steps 60 --kernels 25 > "$out/profile-qwen3-30b-a3b-b1.log" 2>&1
    OPMAP_PDL_MOE=1 timeout 90 python3 -m opmap.cli profile --model qwen3-30b-a3b --max-num-seqs 1 --num-requests 2 \
      --input-len 1024 --output-len 128 --steps 60 --kernels 25 > "$out/profile-qwen3-30b-a3b-b1-pdl-moe.log" 2>&1
    # the MoE kernels under PDL without the early release, against off and "1", one process each
    for v in 0 late 1; do
      OPMAP_PDL_MOE=$v timeout 60 python3 -m opmap.bench.cases.e2e --model qwen3-30b-a3b --case 1 --no-hf \
        --out "$out/e2e-qwen-pdl-moe-$v" > "$out/e2e-qwen-pdl-moe-$v.log" 2>&1
    done
    # B=32 with the 64-tile GEMMs (N = 4096) split along K, against the default, one process each
    for v in 4 1; do
      OPMAP_GEMM_SPLIT_BELOW=$v timeout 60 python3 -m opmap.bench.cases.e2e --model llama3-8b --case 32 --no-hf \
        --out "$out/e2e-b32-split-below-$v" > "$out/e2e-b32-split-below-$v.log" 2>&1
    done ;;
  verify9|verify)
    # After the ninth session (and as "verify" after any change to these families): the GPU tests of what changed on the CPU (the TMA decode and
    # prefill, in their own file and process; the prefill refactor; the sampler's chunk passes loading ahead; the engine's 64-token MLA pages;
    # the MLA 16-head TMA default), in two lanes beside the sanitizer re-run of the families whose
    # sources changed (attention, sampling and mla: qwen3's run
    # does its cases, llama3's reuses them; so no SAN_PARALLEL). Their timings
    # (the page-64 prefill rows, the MLA per_sm=3 row) are in fi-bench's quick grids.
    FINAL_TESTS=${FINAL_TESTS:-"tests/gpu/test_attention_gpu.py tests/gpu/test_sampling_gpu.py tests/gpu/test_attention_tma_gpu.py|tests/gpu/test_engine_gpu.py tests/gpu/test_mla_gpu.py"} \
      SAN_TIMEOUT=${SAN_TIMEOUT:-400} SAN_JOBS=${SAN_JOBS:-8} "$self" final "$out/final-part" \
      > "$out/final-part.log" 2>&1 ;;
  sampling-full)
    # The full sampling grid (B {1, 8, 64, 256} x vocab {32000, 128256, 151936}) at the current
    # sampler with FlashInfer's rows (modules built ahead; no JIT), the committed full grid being
    # from the first session. ~5 min.
    export FLASHINFER_DISABLE_JIT=1
    timeout 420 python3 -m opmap.cli bench --op sampling --out "$out/sampling" > "$out/sampling.log" 2>&1 ;;
  fi-bench)
    # FlashInfer beside our kernels in one run, from the modules built ahead of time on the CPU
    # machine (.whl/flashinfer-aot.tar.xz: sampling, the tensor-core decode, the FA3 prefill, the
    # MLA decode; all bf16). FLASHINFER_DISABLE_JIT=1: a module not built ahead (fp8 KV) fails at
    # once and its row says so, instead of an nvcc build eating the call.
    export FLASHINFER_DISABLE_JIT=1
    (ldd --version | head -1; python3 -c "import flashinfer.jit.env as e; print(e.get_aot_artifacts('sampling'))") \
      > "$out/fi-env.log" 2>&1  # the modules need glibc >= 2.34
    # FlashInfer's check cases first, against the references: a peer's time is quoted only if its
    # output is right (the cases that need modules not built ahead fail fast, naming the module)
    # The timeouts add up to 560 s: a device call ends at 600 s, and the archive below is made last.
    # FI_PARTS="prefill mla": only those grids (after a change to their defaults; ~4 min)
    parts=" ${FI_PARTS:-check sampling decode prefill mla} "
    [[ $parts == *" check "* ]] && timeout 90 python3 -m opmap.cli check --backend flashinfer mla-flashinfer \
      --json "$out/check-flashinfer.json" > "$out/check-flashinfer.log" 2>&1
    # (the prefill grid has four cases now, two of them compiling FlexAttention)
    [[ $parts == *" sampling "* ]] && timeout 100 python3 -m opmap.cli bench --quick --op sampling --out "$out/sampling" \
      > "$out/sampling.log" 2>&1
    [[ $parts == *" decode "* ]] && timeout 120 python3 -m opmap.cli bench --quick --op attention.decode \
      --out "$out/decode" > "$out/decode.log" 2>&1
    [[ $parts == *" prefill "* ]] && timeout 160 python3 -m opmap.cli bench --quick --op attention.prefill \
      --out "$out/prefill" > "$out/prefill.log" 2>&1
    [[ $parts == *" mla "* ]] && timeout 90 python3 -m opmap.cli bench --quick --op attention.mla_decode --out "$out/mla" \
      > "$out/mla.log" 2>&1 ;;
  e2e10)
    # After the tenth session (docs/results-2026-11-30.md, "The next GPU session"): the engine's
    # start-up warm-up, MoE tuning and host-sync-free MLA prefill, end to end at B=32 (one process
    # per run; no HF: its figures are in the seventh session's files). ~5 min.
    for m in llama3-8b qwen3-30b-a3b; do
      timeout 130 python3 -m opmap.bench.cases.e2e --model $m --case 32 --no-hf --out "$out/e2e-$m-b32" \
        > "$out/e2e-$m-b32.log" 2>&1
    done
    # DeepSeek-V2-Lite B=32 (against run-deepseek-b32-moe-warm-session10: TTFT p50 301 ms, mixed
    # steps 57 ms, with the MLA prefill reading its lengths from the device in every layer)
    timeout 100 python3 -m opmap.cli run --model deepseek-v2-lite --max-num-seqs 32 --num-requests 32 \
      --input-len 512 --output-len 128 --no-progress --json "$out/run-deepseek-b32.json" > "$out/run-deepseek-b32.log" 2>&1
    # 64-token pages for a GQA model: the TMA prefill (19-22% faster than the gather kernel at
    # S >= 4096) against 16-token pages, TTFT at B=1 / 1024 tokens
    for pg in 16 64; do
      timeout 80 python3 -m opmap.cli run --model llama3-8b --page-size $pg --max-num-seqs 1 --num-requests 4 \
        --input-len 1024 --output-len 64 --no-progress --json "$out/run-llama3-p$pg-b1.json" \
        > "$out/run-llama3-p$pg-b1.log" 2>&1
    done ;;
  check13)
    # After the twelfth session (docs/results-2026-11-30.md, "Twelfth GPU session"): fp8 KV caches
    # run fp16 dots on tiles converted once by PTX, in the GQA decode and the MLA decode
    # (ops/attention/fp8.py). Their GPU tests in two lanes; the quick grids of both decodes (fp8
    # rows beside the previous path: "[f16=0]" for GQA, "[...,cast]" for MLA). Then the prefill's
    # host time: Llama-3-8B B=1 after generates of 1 and of 128 tokens (the e2e bench's step had
    # 28.7 ms of host work in forward, the probe's 18.2-18.5 after 1-token ones; on the CPU with
    # tiny-llama3 the same order gave 3.6-4.1 against 4.4-5.6 ms), and DeepSeek-V2-Lite B=32 under
    # cProfile (its prefill/mixed steps: 78 ms of host work against 31 ms of GPU time).
    # The sanitizer's re-run of the two families is the next call: SAN_TIMEOUT=420 ... final OUT.
    STEPS=tests TEST_TIMEOUT=150 TEST_LANES="tests/gpu/test_attention_gpu.py|tests/gpu/test_mla_gpu.py" \
      timeout 160 scripts/gpu.sh "$out/tests" > "$out/tests-driver.log" 2>&1
    timeout 150 python3 -m opmap.cli bench --quick --op attention.decode --op attention.mla_decode --out "$out/decode" \
      > "$out/decode.log" 2>&1
    timeout 80 python3 scripts/probes/host_prefill.py --new 1 --new 128 > "$out/host-prefill-llama3-b1.log" 2>&1
    timeout 110 python3 scripts/probes/host_prefill.py --model deepseek-v2-lite --len 512 --batch 32 \
      > "$out/host-prefill-deepseek-b32.log" 2>&1 ;;
  ncu14)
    # After the thirteenth session: what bounds the fp8 decodes (GQA fp8 at bf16's time per token
    # for half the bytes; MLA fp8 at 0.27 of its read ceiling at 16 heads and 95 TFLOP/s at 128,
    # docs/attention.md, docs/mla.md). ncu's stall, occupancy and memory sections on one launch of
    # each build beside its bf16 or cast counterpart (scripts/probes/decode_once.py: warm-up outside
    # the profiled range). --clock-control none: the device notes say leave the clocks alone.
    # Each ncu run ~30-60 s (python start, compiles, the sections' replays).
    g="B=64,kv=4096,h=32/8,d=128,page=16,dtype"; m="B=64,kv=4096,h=16,R=512,Dr=64,page=64,kv_dtype"
    m128="B=64,kv=4096,h=128,R=512,Dr=64,page=64,kv_dtype"; i=0
    for spec in "attention.decode|$g=fp8|opmap-triton" "attention.decode|$g=fp8|opmap-triton[f16=0]" \
                "attention.decode|$g=bf16|opmap-triton" "attention.mla_decode|$m=fp8|opmap-triton" \
                "attention.mla_decode|$m=bf16|opmap-triton" "attention.mla_decode|$m128=fp8|opmap-triton" \
                "attention.mla_decode|$m128=fp8|opmap-triton[bh=64,bn=32,w=8,s=1]"; do
      IFS='|' read -r op cs pv <<< "$spec"; i=$((i + 1))
      echo "== $i $op $cs $pv" >> "$out/ncu-index.txt"
      timeout 120 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        --section SourceCounters --export "$out/ncu-$i" --force-overwrite \
        python3 scripts/probes/decode_once.py "$op" "$cs" "$pv" > "$out/ncu-$i.log" 2>&1
      ncu --import "$out/ncu-$i.ncu-rep" --page details > "$out/ncu-$i.txt" 2>&1
    done
    ;;
  grid14)
    # The tile variants on the fp8 GQA rows, the 128-head fp8 MLA configs by batch, and the 16-head
    # fp8 MLA through the TMA kernel with fp16 dots (the bench has them since the thirteenth
    # session): full grids, only those rows and our default.
    timeout 240 python3 -m opmap.cli bench --op attention.decode --provider opmap-triton --provider "opmap-triton[bn=32,s=4]" --provider "opmap-triton[bn=32,s=3]" --provider "opmap-triton[trans]" \
      --provider "opmap-triton[bn=128,s=2]" --provider "opmap-triton[w=8]" --provider "opmap-triton[pf=0]" \
      --out "$out/decode-variants" > "$out/decode-variants.log" 2>&1
    timeout 280 python3 -m opmap.cli bench --op attention.mla_decode --provider opmap-triton \
      --provider "opmap-triton[bh=64,bn=32,w=8,s=1]" --provider "opmap-triton[bh=64,bn=32,w=8,s=1,cast]" \
      --provider "opmap-triton[bh=32,bn=32,w=8,s=2]" --provider "opmap-triton[bh=16,bn=32,w=4,s=3,tma]" \
      --provider "opmap-triton[bh=16,bn=32,w=8,s=3,tma]" --out "$out/mla-128" > "$out/mla-128.log" 2>&1 ;;
  fix14)
    # After the warp-specialized builds were removed: the attention TMA and MLA GPU test files side
    # by side (correctness only), then alone on the GPU the MLA prefill's configs (quick grid: 16
    # heads / 4096 new tokens). As run in the fourteenth session's call 2, it also asked the quick
    # decode grids for variant rows only the full grids have (grid14 times those); the bench refused
    # them, and tests/test_gpu_scripts.py now checks each command's own grid.
    STEPS=tests TEST_TIMEOUT=200 TEST_LANES="tests/gpu/test_attention_tma_gpu.py|tests/gpu/test_mla_gpu.py" \
      timeout 210 scripts/gpu.sh "$out/tests" > "$out/tests-driver.log" 2>&1
    timeout 120 python3 -m opmap.cli bench --quick --op attention.mla_prefill --out "$out/mla-prefill" \
      > "$out/mla-prefill.log" 2>&1 ;;
  mla15)
    # The MLA prefill's 128-row default took 443-996 us for one case depending on where its inputs
    # landed (fourteenth session, calls 7-9; the old 64 x 64 default 770-939). Rounds with fresh
    # inputs, each followed by the same calls under torch.profiler: which kernel moves in a slow
    # round (the attention kernel, the expansion GEMM, the gather). Both configs, alternating (~2 min).
    c="new=4096,prefix=0,h=16,Dqk=192,Dv=128,page=64"
    for i in 1 2 3; do
      for cfg in 128,64,8,3 64,64,8,2; do
        echo "== process $i config $cfg" >> "$out/mla-prefill-rounds.txt"
        OPMAP_MLA_PREFILL_CONFIG=$cfg timeout 60 python3 scripts/probes/time_rounds.py attention.mla_prefill \
          "$c" opmap-triton --fresh --rounds 6 --kernels >> "$out/mla-prefill-rounds.txt" 2>&1
      done
    done ;;
  host14)
    # The B=1 prefill took 23 ms after 128-token generates and 30-44 ms after 1-token ones
    # (thirteenth session); with idle gaps and the SM clock read before each generate.
    timeout 150 python3 scripts/probes/host_prefill.py --new 1 --new 128 --idle 0 --idle 1 --profile-new 0 \
      > "$out/host-prefill-llama3-b1-idle.log" 2>&1 ;;
  san13)
    # Thirteenth session: the sanitizer's stale families only, two presets side by side (the
    # fingerprint is now the same on the CPU's Python 3.11 and the GPU's 3.12, so check/state/ was
    # re-keyed on the CPU for every family whose code is unchanged): MLA (deepseek-v2-lite, 18
    # cases) and the attention cases qwen3-30b-a3b has not re-run at today's code (llama3-8b reuses
    # them); SAN_OP=kv_append: the append cases of the same families. First the device's fingerprints, to compare with the CPU's (same code, same versions).
    python3 -c "from opmap.check.fingerprint import fingerprint as f
for x in ['activation','attention','gemm','grammar','mla','moe','norm','rope','sampling']: print(x, f(x))" \
      > "$out/fingerprints.txt" 2>&1
    # SAN_TESTS="a.py|b.py": GPU test lanes beside the sanitizer (correctness only)
    if [ -n "${SAN_TESTS:-}" ]; then
      (STEPS=tests TEST_TIMEOUT=300 TEST_LANES="$SAN_TESTS" timeout 320 scripts/gpu.sh "$out/tests" \
        > "$out/tests-driver.log" 2>&1) &
    fi
    for m in deepseek-v2-lite qwen3-30b-a3b; do
      mkdir -p "$out/$m"; cp "check/state/$m.jsonl" "$out/$m/state.jsonl"
      timeout ${SAN_TIMEOUT:-450} python3 -m opmap.cli check --model $m --op ${SAN_OP:-attention} --sanitizer \
        --resume "$out/$m/state.jsonl" --out "$out/$m" --jobs ${SAN_JOBS:-5} --batch 1 --timeout 420 \
        > "$out/$m/check.log" 2>&1 &
    done
    wait; pkill -f '[c]ompute-sanitizer' 2>/dev/null
    # llama3-8b: the same attention cases, reused from qwen3-30b-a3b's run (same keys)
    mkdir -p "$out/llama3-8b"; cp check/state/llama3-8b.jsonl "$out/llama3-8b/state.jsonl"
    timeout 120 python3 -m opmap.cli check --model llama3-8b --op ${SAN_OP:-attention} --sanitizer \
      --resume "$out/llama3-8b/state.jsonl" --reuse "$out/qwen3-30b-a3b/state.jsonl" --out "$out/llama3-8b" \
      --jobs ${SAN_JOBS:-5} --batch 1 --timeout 420 > "$out/llama3-8b/check.log" 2>&1
    pkill -f '[c]ompute-sanitizer' 2>/dev/null ;;
  fp8-13)
    # After check13: the fp8 halves of the issue grids at today's defaults, each row beside the
    # path before the twelfth session in the same run: the MLA decode (16 and 128 heads, B x
    # context, bf16 rows of our default as the same-run reference) and the GQA decode
    # (B {1..128} x kv {512..32k}).
    timeout 280 python3 -m opmap.cli bench --op attention.mla_decode --provider opmap-triton \
      --provider "opmap-triton[bh=16,bn=32,w=4,s=2,cast]" --provider "opmap-triton[bh=64,bn=32,w=8,s=1]" \
      --out "$out/mla-fp8" > "$out/mla-fp8.log" 2>&1
    timeout 280 python3 -m opmap.cli bench --op attention.decode --provider opmap-triton --provider "opmap-triton[f16=0]" \
      --out "$out/decode-fp8" > "$out/decode-fp8.log" 2>&1 ;;
  check12)
    # After the eleventh session (docs/results-2026-11-30.md, "The next GPU session"): kernels'
    # per-step integers no longer specialized, combine/partials/norm packing sized independent of the
    # batch, the fp8 MLA TMA path, 64-token pages on sm90 by default, the two-round warm-up.
    # Test lanes in parallel (correctness only); the engine file alone afterwards (its memory tests
    # size the cache from free memory).
    # (earlier durations: attention 107 + TMA 66 s, MLA 74, dense 67 + parity 119, engine 109-130)
    STEPS=tests TEST_TIMEOUT=240 TEST_LANES="tests/gpu/test_attention_gpu.py tests/gpu/test_attention_tma_gpu.py|tests/gpu/test_mla_gpu.py|tests/gpu/test_dense_gpu.py tests/gpu/test_parity_gpu.py" \
      timeout 250 scripts/gpu.sh "$out/tests" > "$out/tests-driver.log" 2>&1
    timeout 140 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_engine_gpu.py > "$out/tests-engine.log" 2>&1
    # First-use compiles on an empty Triton cache: none expected inside generate's steps now.
    TRITON_CACHE_DIR=/tmp/triton-fresh-$$ timeout 90 python3 scripts/probes/compile_log.py run --model llama3-8b \
      --max-num-seqs 32 --num-requests 32 --input-len 512 --output-len 128 --no-progress \
      --json "$out/run-llama3-b32-fresh-cache.json" > "$out/compiles-llama3-b32-fresh-cache.log" 2>&1
    timeout 60 python3 -m opmap.cli bench --quick --op attention.mla_decode --out "$out/mla" > "$out/mla.log" 2>&1 ;;
  mla11)
    # Eleventh session. The engine's GPU tests alone: in the verify call beside the sanitizer,
    # test_second_engine_sized_from_free_memory ran out of memory (the sanitizer's processes took
    # GPU memory after it sized its cache from what was free).
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_engine_gpu.py \
      > "$out/tests-engine.log" 2>&1
    # What bounds the 16-head MLA decode at 0.754 of the read ceiling: its tile step with parts left out.
    timeout 100 python3 scripts/probes/mla_decompose.py "$out/mla-decompose.json" > "$out/mla-decompose.log" 2>&1
    # The issue's full MLA grid at today's defaults (last run in the second session), with
    # FlashInfer's MLA beside it (modules built ahead; fp8 has none) and the torch peers; no config variants.
    export FLASHINFER_DISABLE_JIT=1
    timeout 250 python3 -m opmap.cli bench --op attention.mla --provider opmap-triton --provider flashinfer \
      --provider "torch-sdpa (contiguous latent)" --provider torch-gather+sdpa --provider torch-sdpa \
      --out "$out/mla-full" > "$out/mla-full.log" 2>&1 ;;
  mem11)
    # Where the engine's memory goes after the KV plan (the engine test's second engine ran out of
    # memory in its start-up warm-up), with FlashInfer off and on; then the B=32 profiles: Llama-3
    # (5.1 ms decode steps against the 3.48 ms weight floor) and DeepSeek-V2-Lite (mixed steps
    # of 52 ms whose host time is all forward: 51 ms, waiting 0.02).
    timeout 90 python3 scripts/probes/engine_memory.py > "$out/engine-memory.log" 2>&1
    (unset NO_FLASHINFER; . scripts/gpu_env.sh; FLASHINFER_DISABLE_JIT=1 timeout 90 python3 scripts/probes/engine_memory.py) \
      > "$out/engine-memory-fi.log" 2>&1
    timeout 100 python3 -m opmap.cli profile --model llama3-8b --max-num-seqs 32 --num-requests 32 \
      --input-len 512 --output-len 128 --steps 60 --kernels 25 > "$out/profile-llama3-8b-b32.log" 2>&1
    timeout 120 python3 -m opmap.cli profile --model deepseek-v2-lite --max-num-seqs 32 --num-requests 32 \
      --input-len 512 --output-len 128 --steps 60 --kernels 25 > "$out/profile-deepseek-v2-lite-b32.log" 2>&1 ;;
  ab11)
    # The 16-head MLA decode's split count at B=1 and 16; Llama-3-8B B=32 with the decode GEMMs
    # split along K from 64 tiles (N = 4096; 448-tile gate/up unchanged), and with cuBLAS for them.
    timeout 80 python3 scripts/probes/mla_splits.py > "$out/mla-splits.log" 2>&1
    for v in default split1 cublas; do
      extra=(); envs=()
      [ $v = split1 ] && envs=(OPMAP_GEMM_SPLIT_BELOW=1)
      [ $v = cublas ] && extra=(--backend gemm=cublas)
      env "${envs[@]}" timeout 100 python3 -m opmap.cli run --model llama3-8b --max-num-seqs 32 --num-requests 32 \
        --input-len 512 --output-len 128 --no-progress "${extra[@]}" --json "$out/run-llama3-b32-$v.json" \
        > "$out/run-llama3-b32-$v.log" 2>&1
    done ;;
  compiles11)
    # Which kernels compile where in a Llama-3-8B B=32 run, twice on one machine (fresh disk cache,
    # then warm): the default run spent 11.9 s in its warm-up and ~0.5 s per mixed step.
    for i in 1 2; do
      TRITON_PRINT_AUTOTUNING=1 timeout 100 python3 scripts/probes/compile_log.py run --model llama3-8b --max-num-seqs 32 \
        --num-requests 32 --input-len 512 --output-len 128 --no-progress --json "$out/run-llama3-b32-$i.json" \
        > "$out/compiles-llama3-b32-$i.log" 2>&1
    done ;;
  flashinfer)
    STEPS=flashinfer scripts/gpu.sh "$out" ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
# Everything in one archive (a call returns a limited number of files), the logs' tails beside it.
if [ "$part" != flashinfer ]; then
  tar -C "$out" -czf "$res/all.tgz" . && tail -n 30 "$out"/*.log "$out"/*/*.log > "$res/summary.txt" 2>/dev/null
fi
