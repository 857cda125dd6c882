#!/usr/bin/env bash
# On the device machine, with a pack of scripts/gpu-pack.sh that has bench_moe
# (BENCHES="bench_moe" scripts/gpu-pack.sh): ncu of the MoE layer at TOKENS tokens.
#   bash scripts/ncu-moe.sh [PACKDIR] [TOKENS]     # default devbin/pack, 1 token
# Writes $OUT/bench_ncu_times.txt (every kernel's time and instruction count) and
# $OUT/bench_ncu_streamed.txt (the first streamed expert GEMM launch: stall reasons, the pipes'
# utilization, the source lines where warps stall). `--clock-control none`: the H200 is shared.
# Why: the twentieth session's ncu left open which pipe throttles the streamed kernel (math-pipe
# throttle was 0.88 of its 5.64 cycles per instruction) and whether its long-scoreboard stalls
# are the weight ring's barriers.
set -uo pipefail
pack=$(cd "${1:-devbin/pack}" && pwd)
tokens=${2:-1}
out=${OUT:-build/gpu-run}
mkdir -p "$out"
bin=$(mktemp -d)
tar -xJf "$pack/bins.tar.xz" -C "$bin" bench/bench_moe || exit 1
ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum,smsp__inst_executed.sum \
  "$bin/bench/bench_moe" --profile "$tokens" > "$out/bench_ncu_times.txt" 2>&1 || exit 1
ncu --profile-from-start off --clock-control none -k regex:streamed -c 1 --section WarpStateStats \
  --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters --print-details all \
  "$bin/bench/bench_moe" --profile "$tokens" > "$out/bench_ncu_streamed.txt" 2>&1 || exit 1
grep -E "gpu__time_duration|  void " "$out/bench_ncu_times.txt" | sed 's/(gemm::block_scaled_gemm_args.*//' | paste - - | head -40
