#!/usr/bin/env bash
# The GPU suite, in one command, on a machine with an NVIDIA GPU (the H200 here):
# build everything with CUDA for sm_90a, run the whole test suite (GPU cases included), the GPU
# cases again under compute-sanitizer (memcheck, initcheck), then the benchmarks.
# Logs and benchmark JSON go to $OUT (default build/gpu-suite). Exit status 0 only if all passed.
#
#   scripts/gpu-suite.sh            # everything
#   DSV4_SKIP_BENCH=1 scripts/gpu-suite.sh
#   DSV4_SANITIZERS=memcheck scripts/gpu-suite.sh   # a subset of the sanitizer tools (default: both)
#   DSV4_SANITIZERS=none scripts/gpu-suite.sh       # no sanitizer pass (a quick run)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/build/gpu-suite}
mkdir -p "$out"
fail=0
log() { echo "== $*" | tee -a "$out/summary.txt"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
{ git rev-parse --verify -q HEAD 2>/dev/null || echo "unknown (the device copy has no git history; record the commit you sent)"; } | tee "$out/commit.txt"

if ! cmake --preset gpu >"$out/configure.log" 2>&1; then tail -40 "$out/configure.log"; exit 1; fi
if ! cmake --build --preset gpu -j "$(nproc)" >"$out/build.log" 2>&1; then grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; fi
log "build ok"

ctest --test-dir build/gpu --output-on-failure -j 8 2>&1 | tee "$out/ctest.log"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then fail=1; log "ctest FAILED"; else log "ctest passed: $(grep -E 'tests passed' "$out/ctest.log")"; fi

# The device tests must not skip here: a skipped GPU case on the GPU machine is a failure.
for t in build/gpu/tests/test_*_cuda; do
  name=$(basename "$t")
  "$t" --run_test=@gpu --report_level=detailed >"$out/$name.log" 2>&1 || fail=1
  if grep -q "no CUDA device visible" "$out/$name.log"; then fail=1; log "$name: GPU cases were SKIPPED"; fi
  log "$name: $(grep -E 'Test module .* (passed|failed)' "$out/$name.log" | head -1)"
  for tool in ${DSV4_SANITIZERS:-memcheck initcheck}; do
    [ "$tool" = none ] && continue
    # initcheck does not see Hopper bulk (TMA) stores, so cuBLAS's split-K reduction appears to read
    # unwritten scratch that cuBLAS's own GEMM kernel wrote; that kernel is not ours to check.
    extra=()
    [ "$tool" = initcheck ] && extra=(--kernel-name-exclude kns=splitKreduce)
    if compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 86 "$t" --run_test=@gpu >"$out/$name.$tool.log" 2>&1; then
      log "$name under compute-sanitizer $tool: clean"
    else
      fail=1; log "$name under compute-sanitizer $tool: FAILED (see $name.$tool.log)"; tail -30 "$out/$name.$tool.log"
    fi
  done
done

if [ -z "${DSV4_SKIP_BENCH:-}" ]; then
  for b in build/gpu/bench/bench_*; do
    [ -x "$b" ] || continue
    name=$(basename "$b")
    if [ "$name" = bench_nccl ] && [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -lt 2 ]; then
      log "bench_nccl: not run (it needs 2 or more GPUs)"; continue
    fi
    "$b" --json "$out/$name.json" 2>&1 | tee "$out/$name.txt" || { fail=1; log "$name FAILED"; }
  done
fi

if [ "$fail" -eq 0 ]; then log "GPU SUITE PASSED"; else log "GPU SUITE FAILED"; fi
# The device tool returns at most 8 files: keep the summary and the benchmarks' text loose (six),
# pack the logs and the benchmarks' JSON.
tmp=$(mktemp -d)
tar -C "$out" -czf "$tmp/logs.tar.gz" --exclude 'bench_*.txt' --exclude summary.txt . &&
  find "$out" -maxdepth 1 -type f ! -name 'bench_*.txt' ! -name summary.txt -delete && mv "$tmp/logs.tar.gz" "$out/"
exit "$fail"
