#!/bin/sh
# Measures the noise floor behind the parity tolerance (tools/parity/README.md, "Tolerance"): for
# each seed, a scaled random tiny checkpoint, the reference's logits on CUDA and on the CPU, and
# ours, for every case of tests/data/parity/cases.json. Needs PyTorch with CUDA and the reference
# folder; builds the dsv4 CLI itself (one g++ call). Results: OUTDIR/calibration.tar (the .npy
# files, named <seed>_<case>_{cuda,cpu,ours}.npy) and the comparisons on stdout.
#
# usage: tools/parity/calibrate.sh OUTDIR REFERENCE_DIR SEED...
set -eu
out=$1 ref=$2
shift 2
work=$(mktemp -d)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cases=$root/tests/data/parity/cases.json
g++ -O2 -std=c++20 -I"$root/include" "$root/apps/dsv4/main.cpp" -o "$work/dsv4"
"$work/dsv4" config-json --config tiny --out "$work/config.json" >/dev/null
ids() { python3 -c "import json,sys; c=[x for x in json.load(open('$cases'))['cases'] if x['name']=='$1'][0]; print(c['$2'])"; }
names=$(python3 -c "import json; print(' '.join(c['name'] for c in json.load(open('$cases'))['cases']))")
mkdir -p "$work/res"
for seed in "$@"; do  # everything in the background: ours on one core each, the reference on CUDA and CPU
  "$work/dsv4" random-checkpoint "$work/ck$seed" --config tiny --seed "$seed" --init scaled >/dev/null
  for n in $names; do
    "$work/dsv4" logits --checkpoint "$work/ck$seed" --prompt "$(ids "$n" prompt)" --decode "$(ids "$n" decode)" \
      --out "$work/res/${seed}_${n}_ours.npy" --index-keys upstream >/dev/null &
  done
  for dev in cuda cpu; do
    mkdir -p "$work/$seed-$dev"
    python3 "$here/reference_logits.py" --reference "$ref" --checkpoint "$work/ck$seed" --config "$work/config.json" \
      --cases "$cases" --out-dir "$work/$seed-$dev" --device "$dev" >"$work/$seed-$dev/log" 2>&1 &
  done
done
wait
for seed in "$@"; do
  for n in $names; do
    for dev in cuda cpu; do mv "$work/$seed-$dev/$n.npy" "$work/res/${seed}_${n}_$dev.npy" || cat "$work/$seed-$dev/log"; done
    for pair in cuda:ours cpu:ours cuda:cpu; do
      a=${pair%:*} b=${pair#*:}
      printf 'seed %s %-6s %-4s vs %-4s: ' "$seed" "$n" "$a" "$b"
      python3 "$here/compare.py" "$work/res/${seed}_${n}_$a.npy" "$work/res/${seed}_${n}_$b.npy" --tol 100 | grep '^overall' || true
    done
  done
done
tar -C "$work/res" -cf "$out/calibration.tar" .
rm -rf "$work"
