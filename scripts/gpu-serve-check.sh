#!/usr/bin/env bash
# On the GPU machine: `dsv4 serve --backend cuda` (continuous batching, the model uploaded once)
# with four clients at once and one streamed request, each answer compared with `dsv4 run
# --backend cuda` for the same request. Batched decode is not batch-invariant, so a token may
# differ where two logits nearly tie: the script reports equal / differing answers, and fails only
# if the server fails (no answer, an error, a malformed stream). Flags after OUTDIR go to the
# server: with --speculative dspark every answer must also carry the drafts' counts. A session's
# second turn (appended to the first's sequence) is compared with `dsv4 run` over the whole
# conversation, reported like the clients.
#   scripts/gpu-serve-check.sh PATH/TO/dsv4 [OUTDIR [SERVE FLAGS...]]
set -uo pipefail
dsv4=$1
out=${2:-.}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"
port=$((18000 + RANDOM % 1000))
drafts=0
[[ " $* " == *" dspark "* ]] && drafts=1
"$dsv4" serve --backend cuda --port "$port" --max-requests 8 --max-batch 4 "$@" > "$out/serve.log" 2>&1 &
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
curl -s "localhost:$port/v1/generate" -d '{"prompt": [4, 5, 6], "max_tokens": 4, "seed": 3, "session": "s"}' > "$out/turn1.json"
curl -s "localhost:$port/v1/generate" -d '{"prompt": [7, 8], "max_tokens": 4, "seed": 3, "session": "s", "continue": true}' \
  > "$out/turn2.json"
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
t1=$(sed -n 's/.*"tokens": \[\([0-9, ]*\)\].*/\1/p' "$out/turn1.json" | tr -d ' ')
t2=$(sed -n 's/.*"tokens": \[\([0-9, ]*\)\].*/\1/p' "$out/turn2.json" | tr -d ',')
if [ -z "$t1" ] || [ -z "$t2" ] || ! grep -q '"session": {"id": "s", "tokens": 13}' "$out/turn2.json"; then
  fail=1; echo "session: FAILED: $(cat "$out/turn1.json" "$out/turn2.json")"
elif [ "$drafts" = 1 ] && ! grep -q '"speculative": {"draft_block"' "$out/turn2.json"; then
  fail=1; echo "session: FAILED: no drafts' counts in turn 2: $(cat "$out/turn2.json")"
else
  want=$("$dsv4" run --backend cuda --prompt "4,5,6,$t1,7,8" --tokens 4 --seed 3 | sed -n 's/^generated: //p')
  if [ "$t2" = "$want" ]; then
    echo "session: turn 2 equals dsv4 run over the whole conversation ($t2)"
  else
    echo "session: turn 2 differs from dsv4 run over the whole conversation (appended: $t2; whole: $want)"
  fi
fi
if grep -q '"done": true' "$out/stream.txt" && [ "$(grep -c '"token"' "$out/stream.txt")" = 5 ]; then
  echo "stream: 5 token events and the done event"
else
  fail=1; echo "stream: FAILED: $(head -c 600 "$out/stream.txt")"
fi
exit "$fail"
