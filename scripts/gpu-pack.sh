#!/usr/bin/env bash
# Builds the GPU test binaries, the CLI and bench_model here (no GPU needed: nvcc targets sm_90a)
# and packs them for the device machine, where scripts/gpu-run-packed.sh runs them. The device
# then spends its minutes on tests, not on a build (~3 of a session's 30 minutes saved per run).
#
#   scripts/gpu-pack.sh [OUTDIR]     # default devbin/pack; carry OUTDIR to the device
#   BENCHES="bench_attention bench_gemm" scripts/gpu-pack.sh   # also pack these benchmarks
# On the device:  bash scripts/gpu-run-packed.sh OUTDIR   (options: see that script)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-devbin/pack}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the archive is written from inside build/gpu
cmake --preset gpu >/dev/null
targets=$(sed -n 's/^ *dsv4_add_test(\(test_[a-z_]*_cuda\) .*LABELS gpu.*/\1/p' tests/CMakeLists.txt | sort -u)
# shellcheck disable=SC2086
benches="bench_model ${BENCHES:-}"
# shellcheck disable=SC2086
cmake --build build/gpu -j "$(nproc)" --target $targets dsv4_cli $benches
# shellcheck disable=SC2046
(cd build/gpu && tar -cJf "$out/bins.tar.xz" tests/test_*_cuda apps/dsv4 $(printf 'bench/%s ' $benches))
echo "$PWD/tests/data" > "$out/data_path.txt"  # DSV4_TEST_DATA, compiled into the test binaries
git rev-parse --short HEAD > "$out/commit.txt"
git status --short --untracked-files=no | sed 's/^/changed: /' >> "$out/commit.txt"
echo "packed $(wc -w <<<"$targets") test binaries, the CLI and bench_model from $(head -1 "$out/commit.txt") into $out"
