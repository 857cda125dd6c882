#!/usr/bin/env bash
# On the GPU machine: `dsv4 serve --backend cuda` (continuous batching, the model uploaded once)
# with four clients at once and one streamed request, each answer compared with `dsv4 run
# --backend cuda` for the same request. Batched decode is not batch-invariant, so a token may
# differ where two logits nearly tie: the script reports equal / differing answers, and fails only
# if the server fails (no answer, an error, a malformed stream). Flags after OUTDIR go to the
# server: with --speculative dspark every answer must also carry the drafts' counts.
#   scripts/gpu-serve-check.sh PATH/TO/dsv4 [OUTDIR [SERVE FLAGS...]]
set -uo pipefail
dsv4=$1
out=${2:-.}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"
port=$((18000 + RANDOM % 1000))
"$dsv4" serve --backend cuda --port "$port" --max-requests 6 --max-batch 4 "$@" > "$out/serve.log" 2>&1 &
server=$!
for _ in $(seq 120); do curl -sf "localhost:$port/health" > /dev/null 2>&1 && break; sleep 0.5; done
fail=0
clients=()
for i in 1 2 3 4; do
  curl -s "localhost:$port/v1/generate" -d "{\"prompt\": [1, 2, $i], \"max_tokens\": 8, \"seed\": $i, \"temperature\": 0.8}" \
    > "$out/client$i.json" &
  clients+=($!)
done
wait "${clients[@]}"
curl -sN "localhost:$port/v1/generate" -d '{"prompt": [1, 2, 9], "max_tokens": 5, "seed": 9, "stream": true}' > "$out/stream.txt"
wait "$server"
for i in 1 2 3 4; do
  got=$(sed -n 's/.*"tokens": \[\([0-9, ]*\)\].*/\1/p' "$out/client$i.json" | tr -d ',')
  want=$("$dsv4" run --backend cuda --prompt "1,2,$i" --tokens 8 --seed "$i" --temperature 0.8 | sed -n 's/^generated: //p')
  if [ -z "$got" ]; then
    fail=1; echo "client $i: FAILED: $(cat "$out/client$i.json")"
  elif [[ " $* " == *" dspark "* ]] && ! grep -q '"speculative": {"draft_block"' "$out/client$i.json"; then
    fail=1; echo "client $i: FAILED: no drafts' counts in $(cat "$out/client$i.json")"
  elif [ "$got" = "$want" ]; then
    echo "client $i: the answer equals dsv4 run's ($got)"
  else
    echo "client $i: differs from dsv4 run's (batched: $got; alone: $want)"
  fi
done
if grep -q '"done": true' "$out/stream.txt" && [ "$(grep -c '"token"' "$out/stream.txt")" = 5 ]; then
  echo "stream: 5 token events and the done event"
else
  fail=1; echo "stream: FAILED: $(head -c 600 "$out/stream.txt")"
fi
exit "$fail"
