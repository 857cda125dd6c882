#!/usr/bin/env bash
# `dsv4 serve` throughput: N clients at once, each asking for T tokens, against a server that
# decodes them together (--max-batch N) and one that answers one request at a time
# (--max-batch 1). Wall time from the first request to the last answer, tokens per second.
# Flags after T go to both servers (e.g. --speculative dspark: each step a round of drafts).
#   bench/bench_serve.sh PATH/TO/dsv4 [host|cuda] [N] [T] [SERVE FLAGS...]
set -uo pipefail
dsv4=$1
backend=${2:-cuda}
n=${3:-8}
tokens=${4:-32}
shift $(( $# < 4 ? $# : 4 ))
extra=("$@")
run() {  # $1 = --max-batch
  local port=$((19000 + RANDOM % 1000)) pids=()
  "$dsv4" serve --backend "$backend" --port "$port" --max-batch "$1" --max-requests $((n + 1)) "${extra[@]}" > /dev/null 2>&1 &
  local server=$!
  for _ in $(seq 240); do curl -sf "localhost:$port/health" > /dev/null 2>&1 && break; sleep 0.5; done
  local t0 t1
  t0=$(date +%s.%N)
  for i in $(seq "$n"); do
    curl -s "localhost:$port/v1/generate" -d "{\"prompt\": [1, 2, $i], \"max_tokens\": $tokens, \"seed\": $i}" > /dev/null &
    pids+=($!)
  done
  wait "${pids[@]}"
  t1=$(date +%s.%N)
  wait "$server"
  echo "$1 $(awk "BEGIN { print $t1 - $t0 }")"
}
echo "dsv4 serve, $backend backend${extra[*]:+ (${extra[*]})}: $n clients at once, $tokens tokens each"
read -r _ batched < <(run "$n")
read -r _ serial < <(run 1)
awk -v n="$n" -v t="$tokens" -v b="$batched" -v s="$serial" 'BEGIN {
  printf "decoded together (--max-batch %d): %.3f s, %.1f tokens/s\n", n, b, n * t / b
  printf "one at a time    (--max-batch 1): %.3f s, %.1f tokens/s\n", s, n * t / s
  printf "ratio: %.2fx\n", s / b }'
