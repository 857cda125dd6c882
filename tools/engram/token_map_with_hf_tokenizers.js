#!/usr/bin/env node
// Builds the Engram compressed token map of a tokenizer.json with the Hugging Face tokenizers
// library itself (the Rust code engram.py runs, through its Node binding), by engram.py's loop:
// decode([id]) per id without clean-up, the normalizer chain NFKC, NFD, StripAccents, Lowercase,
// whitespace runs to one space, the lone-space sentinel, Strip; texts holding U+FFFD keyed by the
// raw token string; new ids in first-seen order. Writes the map in dsv4's map-file format (one
// compressed id per line, engram/token_map.hpp), so `dsv4 token-map`'s map can be compared with it
// line by line (COMPARE=1 scripts/real-tokenizer.sh does so on DeepSeek V3's tokenizer).
//   npm install --prefix /tmp/hf tokenizers
//   NODE_PATH=/tmp/hf/node_modules node tools/engram/token_map_with_hf_tokenizers.js tokenizer.json map.txt
'use strict';
const fs = require('fs');
const tk = require('tokenizers');

const [input, output] = process.argv.slice(2);
if (!input || !output) {
  console.error('usage: token_map_with_hf_tokenizers.js TOKENIZER_JSON OUTPUT_MAP');
  process.exit(2);
}

// A tokenizer whose only job is to carry engram.py's normalizer chain.
const chain = tk.Tokenizer.fromString(JSON.stringify({
  version: '1.0', truncation: null, padding: null, added_tokens: [], pre_tokenizer: null, post_processor: null,
  decoder: null,
  normalizer: {type: 'Sequence', normalizers: [
    {type: 'NFKC'}, {type: 'NFD'}, {type: 'StripAccents'}, {type: 'Lowercase'},
    {type: 'Replace', pattern: {Regex: '[ \\t\\r\\n]+'}, content: ' '},
    {type: 'Replace', pattern: {Regex: '^ $'}, content: '\ue000'},
    {type: 'Strip', strip_left: true, strip_right: true},
    {type: 'Replace', pattern: {String: '\ue000'}, content: ' '}]},
  model: {type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
          fuse_unk: false, byte_fallback: false, ignore_merges: false, vocab: {}, merges: []}}));
const norm = chain.getNormalizer();

(async () => {
  const tok = tk.Tokenizer.fromFile(input);
  const n = tok.getVocabSize(true);  // len(tokenizer): model vocabulary and added tokens
  const keys = new Map();
  const ids = [];
  for (let id = 0; id < n; ++id) {
    const text = await tok.decode([id], false);
    // one dictionary for both kinds of key, as engram.py keeps it
    const key = text.includes('\ufffd') ? tok.idToToken(id) : norm.normalizeString(text) || text;
    if (!keys.has(key)) keys.set(key, keys.size);
    ids.push(keys.get(key));
  }
  const header = `# Engram compressed token map by HF tokenizers ${require('tokenizers/package.json').version}` +
                 ` from ${input}: ${n} tokens, ${keys.size} compressed ids\n`;
  fs.writeFileSync(output, header + ids.join('\n') + '\n');
  console.log(`${n} tokens, ${keys.size} compressed ids`);
})();
