#!/usr/bin/env node
// Checks tests/data/engram/token_map_vectors.json (written by gen_token_map_vectors.py from Python's
// unicodedata) against the Hugging Face tokenizers library itself: the Rust code engram.py runs, here
// through its Node binding. Not part of the test suite (it needs the npm package):
//   npm install --prefix /tmp/hf tokenizers
//   NODE_PATH=/tmp/hf/node_modules node tests/engram/check_token_map_with_hf_tokenizers.js tests/data/engram
// It rebuilds the synthetic tokenizer's map with engram.py's loop (decode([id]) per id, the same
// normalizer chain, id_to_token for texts with U+FFFD), and recomputes every string and per-block
// hash with tokenizers' normalizers and ByteLevel decoder. Prints each difference; exit 1 if any.
'use strict';
const fs = require('fs');
const path = require('path');
const tk = require('tokenizers');

const dir = process.argv[2] || path.join(__dirname, '..', 'data', 'engram');
const vectors = JSON.parse(fs.readFileSync(path.join(dir, 'token_map_vectors.json'), 'utf8'));

// a tokenizer whose only job is to carry a normalizer (the Node binding has no Regex Replace)
function normalizerOf(normalizer) {
  const doc = {version: '1.0', truncation: null, padding: null, added_tokens: [], normalizer, pre_tokenizer: null,
               post_processor: null, decoder: {type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true},
               model: {type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
                       fuse_unk: false, byte_fallback: false, ignore_merges: false, vocab: {}, merges: []}};
  return tk.Tokenizer.fromString(JSON.stringify(doc));
}
const engram = normalizerOf({type: 'Sequence', normalizers: [
  {type: 'NFKC'}, {type: 'NFD'}, {type: 'StripAccents'}, {type: 'Lowercase'},
  {type: 'Replace', pattern: {Regex: '[ \\t\\r\\n]+'}, content: ' '},
  {type: 'Replace', pattern: {Regex: '^ $'}, content: '\ue000'},
  {type: 'Strip', strip_left: true, strip_right: true},
  {type: 'Replace', pattern: {String: '\ue000'}, content: ' '}]});
const forms = {
  nfd: normalizerOf({type: 'NFD'}).getNormalizer(), nfkd: normalizerOf({type: 'NFKD'}).getNormalizer(),
  nfc: normalizerOf({type: 'NFC'}).getNormalizer(), nfkc: normalizerOf({type: 'NFKC'}).getNormalizer(),
  strip_marks: normalizerOf({type: 'StripAccents'}).getNormalizer(),
  lowercase: normalizerOf({type: 'Lowercase'}).getNormalizer(), normalize_token_text: engram.getNormalizer(),
};
const decoder = engram.getDecoder();

let bad = 0;
const report = (what, got, want) => { ++bad; console.log(`${what}: tokenizers ${JSON.stringify(got)}, vectors ${JSON.stringify(want)}`); };
const cp = (s) => [...s].map((c) => 'U+' + c.codePointAt(0).toString(16).toUpperCase()).join(' ');

// GPT-2's byte alphabet, to feed raw bytes through the ByteLevel decoder (String::from_utf8_lossy)
const byteChar = [];
{
  let n = 0;
  for (let b = 0; b < 256; ++b) {
    const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae);
    byteChar[b] = String.fromCodePoint(printable ? b : 0x100 + n++);
  }
}
for (const u of vectors.utf8) {
  const bytes = Buffer.from(u.bytes, 'hex');
  const got = bytes.length ? decoder.decode([[...bytes].map((b) => byteChar[b]).join('')]) : '';
  if (got !== u.text) report(`utf8 ${u.bytes}`, cp(got), cp(u.text));
}
for (const s of vectors.strings)
  for (const f of Object.keys(forms)) {
    const got = forms[f].normalizeString(s.in);
    if (got !== s[f]) report(`${f}(${cp(s.in)})`, cp(got), cp(s[f]));
  }

// per-block hashes over every code point
function fnv(h, bytes) {
  for (const x of bytes) h = Math.imul(h ^ x, 0x01000193) >>> 0;
  return h;
}
const sep = Buffer.from([0xff]);
for (const f of Object.keys(forms)) {
  const n = forms[f];
  vectors.blocks[f].forEach((want, k) => {
    let h = 0x811c9dc5;
    const first = k * vectors.block_size;
    const diffs = [];
    for (let c = first; c < first + vectors.block_size; ++c) {
      if (c >= 0xd800 && c <= 0xdfff) continue;
      const out = n.normalizeString(String.fromCodePoint(c));
      h = fnv(fnv(h, Buffer.from(out, 'utf8')), sep);
    }
    if (String(h) !== want) report(`${f} block U+${first.toString(16).toUpperCase()}`, h, want);
  });
}

// the synthetic tokenizer's map, by engram.py's loop
(async () => {
  const tok = tk.Tokenizer.fromFile(path.join(dir, vectors.tokenizer.file));
  const norm = engram.getNormalizer();
  const n = tok.getVocabSize(true);
  if (n !== vectors.tokenizer.tokens) report('len(tokenizer)', n, vectors.tokenizer.tokens);
  const keys = new Map();
  const ids = [];
  for (let id = 0; id < n; ++id) {
    const text = await tok.decode([id], false);
    let key;
    if (text.includes('\ufffd')) key = tok.idToToken(id);
    else key = norm.normalizeString(text) || text;
    if (!keys.has(key)) keys.set(key, keys.size);
    ids.push(keys.get(key));
  }
  if (keys.size !== vectors.tokenizer.compressed_vocab_size) report('compressed size', keys.size, vectors.tokenizer.compressed_vocab_size);
  ids.forEach((v, i) => { if (v !== vectors.tokenizer.ids[i]) report(`map[${i}] (${JSON.stringify(tok.idToToken(i))})`, v, vectors.tokenizer.ids[i]); });
  console.log(bad ? `${bad} differences` : 'no differences: the vectors agree with tokenizers');
  process.exit(bad ? 1 : 0);
})();
