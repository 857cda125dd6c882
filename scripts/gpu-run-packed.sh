#!/usr/bin/env bash
# Runs binaries packed by scripts/gpu-pack.sh on the GPU machine: every GPU test binary's GPU
# cases (a skipped GPU case is a failure here), the CLI's CUDA backend, then optionally
# compute-sanitizer and bench_model (tiny, with the DSpark drafter). Results in $OUT (default build/gpu-run): summary.txt
# and one logs.tar.gz. Exit status 0 only if everything run passed.
#
#   bash scripts/gpu-run-packed.sh [PACKDIR]            # default devbin/pack
#   MEMCHECK="test_gemm_cuda test_moe_cuda" ...         # memcheck on these (all: MEMCHECK=all)
#   INITCHECK=...  BENCH=1  MC_LIMIT=seconds-per-binary (default 200)
#   RUN_BENCHES="bench_gemm bench_moe"  # also run these packed benchmarks (output kept loose: $OUT/bench_*.txt)
#   TESTS="test_device_model_cuda test_engram_cuda"  # only these test binaries (default: every one)
# The whole set takes longer than one 600 s device call (H200, nineteenth session: device_model
# over 150 s, engram over 60, gemm 68, tp_device 58, moe 42, dspark 40, the other ten under 5 s
# each): split it over two calls with TESTS, the two long ones in a call of their own.
# On a host with several GPUs, also: scripts/gpu-run-multigpu.sh (the multigpu cases, bench_tp).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
pack=$(cd "${1:-$repo/devbin/pack}" && pwd)
out=${OUT:-$repo/build/gpu-run}
mkdir -p "$out"
# shellcheck source=scripts/gpu-pack-env.sh
source "$repo/scripts/gpu-pack-env.sh"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 || true; } | sed 's/^/gpu: /' | tee -a "$out/summary.txt"
fail=0
if [ -n "${TESTS:-}" ]; then tests=$(printf 'tests/%s ' $TESTS); else tests=$(ls tests/test_*_cuda); fi
for t in $tests; do
  n=$(basename "$t")
  if ./"$t" --run_test=@gpu --report_level=detailed > "$out/$n.log" 2>&1; then r=passed; else r=FAILED; fail=1; fi
  # Cases named *_multigpu need several GPUs (label multigpu); --run_test=@gpu leaves them out,
  # which Boost's report also calls skipped. Any other skip is a failure here.
  grep "was skipped" "$out/$n.log" | grep -vq '_multigpu" was skipped' && { r="FAILED (GPU cases skipped)"; fail=1; }
  log "$n: $r $(grep -aE 'DSV4_TEST_SEED|error:' "$out/$n.log" | head -3 | tr '\n' ' ')"
done
for gemm in mma wgmma; do
  if apps/dsv4 run --backend cuda --gemm $gemm --tokens 3 --seed 7 > "$out/cli.$gemm.log" 2>&1 &&
      grep -q "generated:" "$out/cli.$gemm.log"; then
    log "dsv4 run --backend cuda --gemm $gemm: passed"
  else
    fail=1; log "dsv4 run --backend cuda --gemm $gemm: FAILED"
  fi
done
sanitize() {
  local tool=$1 list=$2 extra=()
  [ "$tool" = initcheck ] && extra=(--kernel-name-exclude kns=splitKreduce)  # see gpu-suite.sh
  [ "$list" = all ] && list=$(cd tests && ls test_*_cuda)
  for n in $list; do
    if timeout "${MC_LIMIT:-200}" compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 86 tests/"$n" --run_test=@gpu \
        > "$out/$n.$tool.log" 2>&1; then
      log "$n under $tool: clean"
    else
      fail=1; log "$n under $tool: FAILED or timed out"
    fi
  done
}
[ -n "${MEMCHECK:-}" ] && sanitize memcheck "$MEMCHECK"
[ -n "${INITCHECK:-}" ] && sanitize initcheck "$INITCHECK"
for b in ${RUN_BENCHES:-}; do
  if [ ! -x "bench/$b" ]; then log "$b: not packed"; fail=1; continue; fi
  if timeout "${BENCH_LIMIT:-240}" "bench/$b" > "$out/$b.txt" 2>&1; then log "$b: done"; else log "$b: FAILED"; fail=1; fi
done
if [ -n "${BENCH:-}" ]; then
  bench/bench_model --dspark > "$out/bench_model.txt" 2>&1 || fail=1
  grep -E "^(prefill|decode|dspark)" "$out/bench_model.txt" | tee -a "$out/summary.txt"
fi
log "$([ "$fail" = 0 ] && echo 'ALL PASSED' || echo 'SOMETHING FAILED')"
# The device tool returns a few files: keep summary.txt and the benchmarks loose, pack the rest.
tar -czf "$out/logs.tar.gz" -C "$out" --exclude summary.txt --exclude logs.tar.gz --exclude 'bench_*.txt' . 2>/dev/null
find "$out" -maxdepth 1 -type f ! -name summary.txt ! -name logs.tar.gz ! -name 'bench_*.txt' -delete
exit "$fail"
