#!/usr/bin/env bash
# Issue 6's speed comparison with the official reference on the same GPU and checkpoint: batch 1,
# a prefill of PROMPT tokens and decode steps after it, each side timed after a warm-up (ours:
# bench_model, medians; the reference: tools/parity/reference_logits.py --time, the official
# model.py with its torch kernel port, since tilelang is not on the GPU machine).
#
#   bash scripts/gpu-reference-speed.sh [PACKDIR]      # default devbin/pack (scripts/gpu-pack.sh)
#   PROMPT=512 STEPS=32 REPEATS=5 REF=.reference/deepseek_v41   # the defaults
#   VARIANT=v41-width    # bench_model's V4.1-width model (16 routed experts; a 25 GB checkpoint
#                        # written to CKDIR, default a temporary folder) instead of tiny
#   SKIP_OURS=1          # only write the checkpoint (bench_model --checkpoint-only) and time the
#                        # reference: ours timed in an earlier run (the weights come from a fixed seed)
# Needs PyTorch and the reference folder (tools/parity/README.md; git-ignored: carry it to the
# device). Results in $OUT (default build/gpu-run): summary.txt, ours.txt / ours.json,
# reference.txt / reference.json.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
pack=$(cd "${1:-$repo/devbin/pack}" && pwd)
out=${OUT:-$repo/build/gpu-run}
mkdir -p "$out"
prompt=${PROMPT:-512} steps=${STEPS:-32} repeats=${REPEATS:-5}
ref_dir="$repo/${REF:-.reference/deepseek_v41}"
[ -f "$ref_dir/model.py" ] || { echo "gpu-reference-speed: no reference at $ref_dir (tools/parity/README.md)" >&2; exit 2; }
ref_dir=$(cd "$ref_dir" && pwd)
# shellcheck source=scripts/gpu-pack-env.sh
source "$repo/scripts/gpu-pack-env.sh"  # enters the unpacked binaries' folder
variant=${VARIANT:-tiny}
case "$variant" in
  tiny) width=() ;;
  v41-width) width=(--v41-width) ;;
  *) echo "gpu-reference-speed: VARIANT must be tiny or v41-width, got '$variant'" >&2; exit 2 ;;
esac
ck=${CKDIR:-$(mktemp -d)/$variant}
# Ours first: bench_model writes its random checkpoint (scaled initialisation) to $ck and the
# variant's config.json, which the reference then loads, so that both sides run the same model.
if [ -n "${SKIP_OURS:-}" ]; then
  if bench/bench_model "${width[@]}" --checkpoint "$ck" --config-json "$out/${variant}_config.json" --checkpoint-only \
      > "$out/ours.txt" 2>&1; then
    log "ours: not timed (SKIP_OURS); $(cat "$out/ours.txt")"
  else
    log "bench_model --checkpoint-only FAILED (see ours.txt)"; exit 1
  fi
elif bench/bench_model "${width[@]}" --checkpoint "$ck" --config-json "$out/${variant}_config.json" \
    --prompts "$prompt" --batches 1 --decode-context "$prompt" --json "$out/ours.json" > "$out/ours.txt" 2>&1; then
  log "ours (bench_model, $variant, batch 1): $(grep -E '^(prefill|decode) ' "$out/ours.txt" | tr -s ' ' | tr '\n' ';')"
else
  log "bench_model FAILED (see ours.txt)"; exit 1
fi
if python3 -u "$repo/tools/parity/reference_logits.py" --reference "$ref_dir" --checkpoint "$ck" \
    --config "$out/${variant}_config.json" --time "$prompt,$steps" --time-repeats "$repeats" \
    --info "$out/reference.json" > "$out/reference.txt" 2>&1; then
  log "reference: $(grep 'timed on' "$out/reference.txt")"
else
  log "the reference FAILED (see reference.txt)"; exit 1
fi
