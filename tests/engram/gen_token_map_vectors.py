#!/usr/bin/env python3
"""Writes the Engram token-map test data (include/dsv4/engram/token_map.hpp, unicode.hpp):

    /usr/bin/python3 tests/engram/gen_token_map_vectors.py tests/data/engram

  tests/data/engram/token_map_vectors.json   UTF-8 decoding, normalization forms and the full
                                             normalizer on tricky strings; per-block hashes of
                                             every code point through each form; the expected map
                                             of the synthetic tokenizer below
  tests/data/engram/tokenizer.json           a small synthetic byte-level BPE tokenizer.json

The expectations come from Python's unicodedata / str / bytes (no dsv4 code), following the
reference's algorithm as spec section 10 states it (engram.py build_compressed_token_map, written
here from the spec, not copied). What stands in for the tokenizers library (Rust):
  - NFKC / NFD: unicodedata.normalize, for text whose code points all exist in Unicode 9.0 (the
    version of tokenizers' normalization tables; code points added later normalize to themselves
    there, and the per-code-point blocks use that rule);
  - StripAccents: General_Category in (Mn, Mc, Me) with Unicode 9.0's values for the three code
    points whose category changed since (tools/engram/gen_unicode_tables.py, MARK_OVERRIDES);
  - Lowercase: str.lower() on each character alone (Rust's char::to_lowercase has no Final_Sigma),
    plus the mappings Unicode 16.0 and 17.0 added (gen_unicode_tables.py, LOWER_ADDED);
  - Strip: the White_Space property (from perl's Unicode::UCD; str.strip() uses another set);
  - ByteLevel decoding: GPT-2's bytes_to_unicode, then bytes.decode("utf-8", "replace").
tests/engram/check_token_map_with_hf_tokenizers.js checks this file against the real tokenizers
library (npm package "tokenizers"), where one is installed. The tests need neither.
"""

import json
import os
import subprocess
import sys
import unicodedata as ud

sys.dont_write_bytecode = True  # no __pycache__ in tools/engram
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "engram"))
from gen_unicode_tables import LOWER_ADDED, MARK_OVERRIDES, NORMALIZATION_UNICODE, lower_char  # noqa: E402
BLOCK = 0x4000
FORMS = ["nfd", "nfkd", "nfc", "nfkc", "strip_marks", "lowercase", "normalize_token_text"]


def perl_set(prop):
    out = subprocess.run(["perl", "-MUnicode::UCD=prop_invlist", "-e", 'print join(" ", prop_invlist($ARGV[0]))', prop],
                         check=True, capture_output=True, text=True).stdout.split()
    inv = [int(x) for x in out] + ([0x110000] if len(out) % 2 else [])
    s = set()
    for i in range(0, len(inv), 2):
        s.update(range(inv[i], inv[i + 1]))
    return s


PRESENT = perl_set(f"Present_In={NORMALIZATION_UNICODE}")
WHITE_SPACE = perl_set("White_Space")


def in_9_0(s):
    return all(ord(c) in PRESENT for c in s)


def normalize(form, s):
    if in_9_0(s):
        return ud.normalize(form, s)
    if len(s) == 1:
        return s  # not in Unicode 9.0: no decomposition, ccc 0
    raise ValueError(f"test string {s!r} has code points Unicode 9.0 lacks")


def is_mark(c):
    o = ord(c)
    if o in MARK_OVERRIDES:
        return MARK_OVERRIDES[o]
    return o in PRESENT and ud.category(c) in ("Mn", "Mc", "Me")


def strip_marks(s):
    return "".join(c for c in s if not is_mark(c))


def lowercase(s):
    return "".join(lower_char(ord(c)) for c in s)


def normalize_token_text(text):
    """The reference's normalizer chain (spec section 10, step 2)."""
    s = lowercase(strip_marks(normalize("NFD", normalize("NFKC", text))))
    out, in_run = [], False
    for c in s:  # Replace([ \t\r\n]+ -> " ")
        ws = c in " \t\r\n"
        if not ws:
            out.append(c)
        elif not in_run:
            out.append(" ")
        in_run = ws
    s = "".join(out)
    if s == " ":  # Replace(^ $ -> U+E000)
        s = "\ue000"
    b, e = 0, len(s)  # Strip (White_Space)
    while b < e and ord(s[b]) in WHITE_SPACE:
        b += 1
    while e > b and ord(s[e - 1]) in WHITE_SPACE:
        e -= 1
    return s[b:e].replace("\ue000", " ")


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def byte_level(text_or_bytes):
    """The token string of some bytes in the byte alphabet."""
    b = text_or_bytes.encode() if isinstance(text_or_bytes, str) else text_or_bytes
    return "".join(BYTE_TO_CHAR[x] for x in b)


def byte_level_decode(token):
    if all(c in CHAR_TO_BYTE for c in token):
        raw = bytes(CHAR_TO_BYTE[c] for c in token)
    else:
        raw = token.encode()
    return raw.decode("utf-8", "replace")


def build_map(tokens):
    """engram.py's loop over ids, from the spec: key, first-seen ids."""
    seen, ids = {}, []
    for raw in tokens:
        text = byte_level_decode(raw)
        if "\ufffd" in text:
            key = raw
        else:
            n = normalize_token_text(text)
            key = n if n else text
        ids.append(seen.setdefault(key, len(seen)))
    return ids, len(seen)


def fnv1a(h, data):
    for x in data:
        h = ((h ^ x) * 0x01000193) & 0xFFFFFFFF
    return h


def block_hashes():
    funcs = {
        "nfd": lambda s: normalize("NFD", s), "nfkd": lambda s: normalize("NFKD", s),
        "nfc": lambda s: normalize("NFC", s), "nfkc": lambda s: normalize("NFKC", s),
        "strip_marks": strip_marks, "lowercase": lowercase, "normalize_token_text": normalize_token_text,
    }
    out = {f: [] for f in FORMS}
    for start in range(0, 0x110000, BLOCK):
        for f in FORMS:
            h = 0x811C9DC5
            for c in range(start, start + BLOCK):
                if 0xD800 <= c <= 0xDFFF:
                    continue
                h = fnv1a(h, funcs[f](chr(c)).encode() + b"\xff")
            out[f].append(h)
    return out


STRINGS = [
    # compatibility characters, ligatures, full-width and other width forms
    "\ufb01", "\ufb00\ufb03", "\u2460\u2474\u249c", "\u00b2\u2075\u2082", "\u2167\u217b", "\u337f\u3300",
    "\uff21\uff22\uff23\uff41\uff10\uff01", "\uff76\uff9e\uff8a\uff9f", "\u00bd\u2153", "\u2126\u212a\u212b",
    "\U0001d400\U0001d7d8", "\u00a0\u2002\u3000x", "\u2026\u2024",
    # Hangul: precomposed syllables, conjoining jamo, compatibility jamo, half-width
    "\ud55c\uad6d\uc5b4", "\u1112\u1161\u11ab", "\u1100\u1161", "\uac00\u11a8", "\u3131\u314f\uffa1",
    # combining sequences: reordering, composition, blocking
    "e\u0301", "a\u0323\u0302", "a\u0302\u0323", "\u1e69\u0323", "q\u0307\u0323", "\u0041\u030a\u0301",
    "\u00c5\u0327", "a\u0305\u0301", "a\u0315\u0301", "\u0301a", "\u05d0\u05b8\u05bc", "\u0915\u093c", "\u0b47\u0b3e", "\u1100\u0300\u1161",
    # accents, Vietnamese, Greek (final sigma stays sigma: no context), Turkish dotted / dotless i
    "Caf\u00e9 CAF\u00c9", "Ti\u1ebfng Vi\u1ec7t", "\u039f\u0394\u039f\u03a3 \u03bf\u03b4\u03bf\u03c2",
    "\u0391\u0301\u03b9\u0308\u0301", "\u0130stanbul", "I\u0131\u0130i", "\u1e9e\u00df", "\u01c5\u01c4",
    # whitespace: collapse, lone space, strip, other White_Space, sentinel collisions
    " ", "  ", "\t", "\r\n", " \t \n ", " a  b ", "\u000b", "\u000c x \u0085", "\u2028\u2029",
    "\u1680a\u180e", "\ue000", "a\ue000", " \ue000 ", "\u200b", "\ufeff",
    # marks only, spacing marks (Mc), enclosing marks (Me), marks whose category changed after 9.0
    "\u0301", "\u0903\u093e", "a\u20dd", "\u1cf2", "\U000111c9",
    # replacement character, private use, an emoji, CJK compatibility ideographs
    "\ufffd", "a\ufffdb", "\ue123", "\U0001f600", "\uf900\U0002f800", "\u2f00",
]

UTF8_BYTES = [
    b"", b"abc", b"\xc3\xa9", b"\xe2\x82\xac", b"\xf0\x9f\x98\x80", b"\x80", b"\xbf\x80", b"\xc3",
    b"\xe2\x82", b"\xe2\x82A", b"\xf0\x9f\x98", b"\xf0\x9f", b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\xaf",
    b"\xe0\x9f\xbf", b"\xed\xa0\x80", b"\xed\x9f\xbf", b"\xf4\x90\x80\x80", b"\xf4\x8f\xbf\xbf",
    b"\xf5\x80\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xfe\xff", b"a\xffb\xc3\xa9\xe2",
    b"\xf0\x80\x80\x80", b"\xe1\x80\xe2\xf0\x91\x92\xf1\xbfA",
]


def synthetic_tokenizer():
    """A DeepSeek-shaped byte-level BPE tokenizer.json: special tokens at ids 0-2 (also in the model
    vocabulary), the 256 byte tokens, words that normalize alike, partial UTF-8 tokens, then added
    tokens at the end."""
    special = ["<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
               "<\uff5c\u2581pad\u2581\uff5c>"]
    tokens = list(special)
    tokens += [BYTE_TO_CHAR[b] for b in range(256)]
    words = [
        "the", " the", " The", "THE", " THE", "The", "  ", "   ", "\n", "\n\n", "\t", " \t", "\r\n", " \n ",
        "caf\u00e9", "Caf\u00e9", "cafe", "CAF\u00c9", " caf\u00e9", "\ufb01", "fi", "FI", "\ufb01le", "file",
        "\uff21\uff22\uff23", "abc", "ABC", "\ud55c\uad6d\uc5b4", "\u1112\u1161\u11ab", "\ud55c",
        "\u039f\u0394\u039f\u03a3", "\u03bf\u03b4\u03bf\u03c3", "\u03bf\u03b4\u03bf\u03c2", "\u03c2", "\u03c3",
        "\u03a3", "\u0130", "i", "I", "\u0131", "i\u0307", "\u0130stanbul", "istanbul", "\u00b2", "2",
        "\u2167", "viii", "\u337f", "\u682a\u5f0f\u4f1a\u793e", "\u212a", "k", "\u212b", "\u00c5", "a",
        "\u3131", "\u1100", "\u00a0", "\u3000", "\u2003", "\u000b", "\u000c", "\u0085", "\u2028",
        "\u0301", "\u0300", "e\u0301", "\u00e9", "\ue000", " \ue000", "\ue000\ue000", "\ufffd", "\u00bd",
        "1\u20442", "\U0001f600", " \U0001f600", "\u200b", "\u1cf2", "\U000111c9",
        "\u0142", "\u0141", "Hello", " hello", "HELLO", "\u4e2d\u6587", " \u4e2d\u6587",
    ]
    tokens += [t for t in dict.fromkeys(byte_level(w) for w in words) if t not in tokens]  # no repeats
    partial = [b"\xe2\x80", b"\xf0\x9f\x98", b"\xf0\x9f", b"\xc3\xa9\xc3", b"\xe4\xb8", b" \xe4\xb8",
               b"\x80\x80", b"a\xff"]
    tokens += [byte_level(p) for p in partial]
    # added tokens after the model vocabulary (ASCII ones decode to themselves; the one with a
    # character outside the byte alphabet decodes to its own UTF-8; the one with a space too)
    added_tail = ["<think>", "</think>", "<\uff5cUser\uff5c>", "<|place holder|>", "\u0120x"]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens), "duplicate token in the synthetic vocabulary"
    n_model = len(tokens)
    added = [{"id": i, "content": t, "special": True} for i, t in enumerate(special)]
    added += [{"id": n_model + k, "content": t, "special": k < 4} for k, t in enumerate(added_tail)]
    all_tokens = tokens + added_tail
    doc = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": a["id"], "content": a["content"], "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": True, "special": a["special"]} for a in added],
        "normalizer": {"type": "Sequence", "normalizers": []},
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    return doc, all_tokens


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "data", "engram")
    os.makedirs(outdir, exist_ok=True)
    doc, tokens = synthetic_tokenizer()
    ids, size = build_map(tokens)
    strings = []
    for s in STRINGS:
        strings.append({"in": s, "nfd": normalize("NFD", s), "nfkd": normalize("NFKD", s), "nfc": normalize("NFC", s),
                        "nfkc": normalize("NFKC", s), "strip_marks": strip_marks(s), "lowercase": lowercase(s),
                        "normalize_token_text": normalize_token_text(s)})
    vectors = {
        "generator": "tests/engram/gen_token_map_vectors.py",
        "python_unicode_version": ud.unidata_version,
        "lowercase_unicode_version": max(LOWER_ADDED),
        "normalization_unicode_version": NORMALIZATION_UNICODE + ".0",
        "utf8": [{"bytes": b.hex(), "text": b.decode("utf-8", "replace")} for b in UTF8_BYTES],
        "strings": strings,
        "byte_level": [{"token": t, "text": byte_level_decode(t)} for t in tokens],
        "block_size": BLOCK,
        "block_hash": "FNV-1a 32 over each code point's output in UTF-8 followed by a 0xFF byte, "
                      "surrogates skipped",
        "blocks": {f: [str(h) for h in hs] for f, hs in block_hashes().items()},
        "tokenizer": {"file": "tokenizer.json", "tokens": len(tokens), "compressed_vocab_size": size, "ids": ids},
    }
    with open(os.path.join(outdir, "token_map_vectors.json"), "w", encoding="ascii") as f:
        json.dump(vectors, f, ensure_ascii=True, indent=0)
        f.write("\n")
    with open(os.path.join(outdir, "tokenizer.json"), "w", encoding="ascii") as f:
        json.dump(doc, f, ensure_ascii=True, indent=1)
        f.write("\n")
    print(f"{len(tokens)} tokens -> {size} compressed ids; {len(strings)} strings; "
          f"{len(UTF8_BYTES)} byte strings", file=sys.stderr)


if __name__ == "__main__":
    main()
