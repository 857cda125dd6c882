#!/usr/bin/env bash
# Puts FlashMLA's sources and the CUTLASS tree it pins into OUTDIR (outside this repository), for
# bench_attention's side-by-side column (bench/CMakeLists.txt: DSV4_FLASHMLA_DIR, DSV4_CUTLASS_DIR).
# Needs git checkouts of deepseek-ai/FlashMLA and NVIDIA/cutlass (the tool library's `fetch`
# brings both under /work/.mirror); CUTLASS is taken at the commit FlashMLA's csrc/cutlass
# submodule names. Nothing of either enters dsv4's tree.
#
#   scripts/flashmla-sources.sh FLASHMLA_GIT CUTLASS_GIT OUTDIR
#   cmake --preset gpu -DDSV4_FLASHMLA_DIR=OUTDIR/flashmla -DDSV4_CUTLASS_DIR=OUTDIR/cutlass
set -euo pipefail
if [ $# -ne 3 ]; then
  echo "usage: $0 FLASHMLA_GIT CUTLASS_GIT OUTDIR" >&2
  exit 2
fi
flashmla=$1 cutlass=$2 out=$3
case "$(cd "$(dirname "$out")" 2>/dev/null && pwd)/" in
  "$(cd "$(dirname "$0")/.." && pwd)/"*) echo "flashmla-sources: OUTDIR must lie outside the dsv4 tree" >&2; exit 2 ;;
esac
pin=$(git -C "$flashmla" ls-tree HEAD csrc/cutlass | awk '$2 == "commit" {print $3}')
[ -n "$pin" ] || { echo "flashmla-sources: $flashmla has no csrc/cutlass submodule entry" >&2; exit 1; }
git -C "$cutlass" cat-file -e "$pin^{commit}" 2>/dev/null ||
  { echo "flashmla-sources: $cutlass lacks CUTLASS commit $pin (FlashMLA's pin)" >&2; exit 1; }
mkdir -p "$out/flashmla" "$out/cutlass"
git -C "$flashmla" archive HEAD csrc | tar -x -C "$out/flashmla"
# (git may name blobs outside include/ that a mirror lacks: harmless, only include/ is taken)
git -C "$cutlass" archive "$pin" include tools/util/include | tar -x -C "$out/cutlass"
echo "FlashMLA $(git -C "$flashmla" rev-parse --short HEAD) in $out/flashmla, CUTLASS ${pin:0:9} in $out/cutlass"
