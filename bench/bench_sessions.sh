#!/usr/bin/env bash
# `dsv4 serve` on an agent's conversation: TURNS turns, each NEW prompt tokens (a tool result, a
# user message) then GEN generated tokens, twice: as one session (each turn appends only its new
# tokens after the session's) and resent whole (each turn a new request for the conversation so
# far, as a server without sessions makes a client do). One client, so the figures are each
# turn's latency: wall time per turn (curl's time to the answer) and in all. The two runs draw
# the same tokens where the backend's append equals its prefill (the host: bit for bit).
#   bench/bench_sessions.sh PATH/TO/dsv4 [host|cuda] [TURNS] [NEW] [GEN] [SERVE FLAGS...]
# Defaults: cuda, 8 turns of 256 new and 32 generated tokens (a 2,304-token conversation).
set -uo pipefail
dsv4=$1
backend=${2:-cuda}
turns=${3:-8}
new=${4:-256}
gen=${5:-32}
shift $(( $# < 5 ? $# : 5 ))
extra=("$@")
total=$((turns * (new + gen)))
port=$((19500 + RANDOM % 400))
"$dsv4" serve --backend "$backend" --port "$port" --max-batch 2 --max-requests $((2 * turns + 1)) \
  --max-prompt-tokens "$total" --max-tokens "$gen" --max-session-tokens "$total" "${extra[@]}" > /dev/null 2>&1 &
server=$!
trap 'kill "$server" 2> /dev/null' EXIT
for _ in $(seq 240); do curl -sf "localhost:$port/health" > /dev/null 2>&1 && break; sleep 0.5; done
ids() {  # $1 = turn: NEW token ids, the same in both runs
  seq $(( $1 * new + 1 )) $(( ($1 + 1) * new )) | awk '{ printf "%s%d", (NR > 1 ? ", " : ""), ($1 * 37) % 1000 + 3 }'
}
tokens_of() { sed -n 's/.*"tokens": \[\([0-9, ]*\)\].*/\1/p'; }
echo "dsv4 serve, $backend backend${extra[*]:+ (${extra[*]})}: $turns turns of $new new and $gen generated tokens"
printf '%-6s %12s %12s\n' turn session resent
conversation=""
session_total=0
resent_total=0
session_answers=()
for t in $(seq 0 $((turns - 1))); do
  turn_ids=$(ids "$t")
  if [ "$t" = 0 ]; then
    body="{\"prompt\": [$turn_ids], \"max_tokens\": $gen, \"seed\": 1, \"session\": \"bench\"}"
  else
    body="{\"prompt\": [$turn_ids], \"max_tokens\": $gen, \"seed\": 1, \"session\": \"bench\", \"continue\": true}"
  fi
  out=$(curl -s -w '\n%{time_total}' "localhost:$port/v1/generate" -d "$body")
  s_time=$(tail -n 1 <<< "$out")
  s_tokens=$(head -n -1 <<< "$out" | tokens_of)
  [ -z "$s_tokens" ] && { echo "turn $t (session): FAILED: $(head -c 400 <<< "$out")"; exit 1; }
  conversation="${conversation:+$conversation, }$turn_ids"
  out=$(curl -s -w '\n%{time_total}' "localhost:$port/v1/generate" \
    -d "{\"prompt\": [$conversation], \"max_tokens\": $gen, \"seed\": 1}")
  r_time=$(tail -n 1 <<< "$out")
  r_tokens=$(head -n -1 <<< "$out" | tokens_of)
  [ -z "$r_tokens" ] && { echo "turn $t (resent): FAILED: $(head -c 400 <<< "$out")"; exit 1; }
  [ "$s_tokens" = "$r_tokens" ] || echo "turn $t: the session's tokens differ from the resent conversation's"
  conversation="$conversation, $s_tokens"  # (the session's answer is what the agent saw)
  printf '%-6s %10.3f s %10.3f s\n' "$t" "$s_time" "$r_time"
  session_total=$(awk -v a="$session_total" -v b="$s_time" 'BEGIN { print a + b }')
  resent_total=$(awk -v a="$resent_total" -v b="$r_time" 'BEGIN { print a + b }')
done
awk -v s="$session_total" -v r="$resent_total" 'BEGIN { printf "all turns: session %.3f s, resent %.3f s, ratio %.2fx\n", s, r, r / s }'
