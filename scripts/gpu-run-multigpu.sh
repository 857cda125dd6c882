#!/usr/bin/env bash
# Runs the multi-GPU cases of binaries packed by scripts/gpu-pack.sh on a machine with 2+ GPUs
# (the device tool's nvidia-h200-x2): the tensor-parallel model over NCCL against staged ranks,
# the NCCL collectives, and the benchmarks bench_nccl / bench_tp when packed
# (BENCHES="bench_nccl bench_tp" scripts/gpu-pack.sh). Results in $OUT (default build/gpu-run):
# summary.txt and logs.tar.gz. Exit status 0 only if everything run passed.
#
#   bash scripts/gpu-run-multigpu.sh [PACKDIR]     # default devbin/pack
#   V41=1 ...                                      # also bench_tp --v41-width (~5 minutes)
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
pack=$(cd "${1:-$repo/devbin/pack}" && pwd)
out=${OUT:-$repo/build/gpu-run}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0  # see parallel/nccl.cuh: NVLink multicast stays off on shared hosts
# shellcheck source=scripts/gpu-pack-env.sh
source "$repo/scripts/gpu-pack-env.sh"
log "gpus: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | tr '\n' ' ')"
fail=0
for t in test_tp_device_cuda test_nccl_cuda; do
  [ -x "tests/$t" ] || { log "$t: not packed"; fail=1; continue; }
  if timeout 300 "tests/$t" --run_test=@multigpu --log_level=message > "$out/$t.multigpu.log" 2>&1; then r=passed; else r=FAILED; fail=1; fi
  # (--run_test=@multigpu reports the other cases as skipped; a skipped *_multigpu case means
  # fewer than two GPUs were visible.)
  grep "was skipped" "$out/$t.multigpu.log" | grep -q '_multigpu"' && { r="FAILED (skipped: fewer than 2 GPUs?)"; fail=1; }
  log "$t @multigpu: $r"
done
grep -a "over NCCL" "$out/test_tp_device_cuda.multigpu.log" 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' | tee -a "$out/summary.txt"
for b in bench_nccl bench_tp; do
  [ -x "bench/$b" ] || continue
  if timeout 300 "bench/$b" > "$out/$b.txt" 2>&1; then log "$b: done"; else log "$b: FAILED"; fail=1; fi
done
if [ -n "${V41:-}" ] && [ -x bench/bench_tp ]; then
  if timeout 480 bench/bench_tp --v41-width --json "$out/bench_tp_v41.json" > "$out/bench_tp_v41.txt" 2>&1; then
    grep -E "^(prefill|decode)" "$out/bench_tp_v41.txt" | tee -a "$out/summary.txt"
  else
    log "bench_tp --v41-width: FAILED"; fail=1
  fi
fi
log "$([ "$fail" = 0 ] && echo 'ALL PASSED' || echo 'SOMETHING FAILED')"
tar -czf "$out/logs.tar.gz" -C "$out" --exclude summary.txt --exclude logs.tar.gz --exclude '*.json' . 2>/dev/null
find "$out" -maxdepth 1 -type f -name '*.log' -delete
exit "$fail"
