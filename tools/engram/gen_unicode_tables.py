#!/usr/bin/env python3
"""Writes include/dsv4/engram/unicode_data.hpp: the Unicode data the Engram token map needs.

    /usr/bin/python3 tools/engram/gen_unicode_tables.py > include/dsv4/engram/unicode_data.hpp

What the data must reproduce (spec section 10; engram.py's build_compressed_token_map): the
normalizer chain of Hugging Face `tokenizers` (Rust):
  - NFKC, NFD and StripAccents come from the crate unicode-normalization-alignments 0.1.12 (every
    tokenizers release depends on it), whose tables are Unicode 9.0.0. StripAccents removes
    General_Category = Mark (Mn, Mc, Me): that crate's `is_combining_mark`.
  - Lowercase is Rust's `char::to_lowercase`, one char at a time (no Final_Sigma context), and
    Strip trims `char::is_whitespace` (the White_Space property): the Unicode version of the Rust
    standard library that built the tokenizers binary.

Sources. Python's `unicodedata` (the Python running this script; Debian 12's 3.11 has Unicode
14.0.0) gives decompositions, combining classes, general categories and lower-case mappings. Perl's
Unicode::UCD (Debian 12's perl 5.36, also Unicode 14.0.0; the script checks the versions agree)
gives what unicodedata lacks: `Present_In=9.0` (the code points Unicode 9.0 had) and White_Space.

Normalization data is restricted to code points present in Unicode 9.0 (later ones have no
decomposition, combining class 0 and are not marks, as in the crate). Between 9.0 and 14.0 three
assigned code points changed General_Category to or from Mark; MARK_OVERRIDES restores their 9.0
value. Checked with --check-rust-tables against that crate's own tables (unicode-rs/
unicode-normalization at commit cc442c3, src/tables.rs, which unicode-normalization-alignments
0.1.12 forked: UNICODE_VERSION (9, 0, 0), the same hash salts): combining classes, canonical and
compatibility decompositions (fully expanded), the composition pairs and the mark set agree for
every code point.

Lower-case mappings and White_Space are not restricted: Python's (14.0.0 here), plus the lower-case
mappings Unicode 16.0 and 17.0 added (LOWER_ADDED), which recent Rust standard libraries have.
tests/engram/check_token_map_with_hf_tokenizers.js compares the result, code point by code point,
with tokenizers 0.23.2 itself.

The data is packed into sorted integer arrays (runs where consecutive code points share a rule),
so the header stays small and cheap to compile; include/dsv4/engram/unicode.hpp reads it.
"""

import argparse
import re
import subprocess
import sys
import unicodedata as ud

NORMALIZATION_UNICODE = "9.0"  # unicode-normalization-alignments 0.1.12's UNICODE_VERSION

# Code points present in 9.0 whose General_Category moved across the Mark boundary by 14.0.
# Values are "is a mark in Unicode 9.0".
MARK_OVERRIDES = {
    0x1CF2: True,    # VEDIC SIGN ARDHAVISARGA: Mc in 9.0, Lo since 10.0
    0x1CF3: True,    # VEDIC SIGN ROTATED ARDHAVISARGA: Mc in 9.0, Lo since 10.0
    0x111C9: False,  # SHARADA SANDHI MARK: Po in 9.0, Mn since 13.0
}

# Lower-case mappings that Unicode 16.0 and 17.0 added (UnicodeData.txt of those versions; 15.x added
# none). Rust's std has them (tokenizers 0.23.2's binary agrees on every code point once they are
# in), Python 3.11's unicodedata (14.0.0) does not. Used where the Python running this is older.
LOWER_ADDED = {
    "16.0.0": {0x1C89: 0x1C8A, 0xA7CB: 0x0264, 0xA7CC: 0xA7CD, 0xA7DA: 0xA7DB, 0xA7DC: 0x019B,
               **{c: c + 0x20 for c in range(0x10D50, 0x10D66)}},      # Cyrillic TJE, Latin, Garay
    "17.0.0": {0xA7CE: 0xA7CF, 0xA7D2: 0xA7D3, 0xA7D4: 0xA7D5,
               **{c: c + 0x1B for c in range(0x16EA0, 0x16EB9)}},      # Latin, Beria Erfe
}
LOWER_UNICODE = max(LOWER_ADDED)


def version_tuple(v):
    return tuple(int(x) for x in v.split("."))


def lower_char(c):
    """Rust's char::to_lowercase of one code point, as a string (Python's str.lower of the char
    alone, plus LOWER_ADDED where this Python's Unicode predates them)."""
    low = chr(c).lower()
    for version, table in LOWER_ADDED.items():
        if c in table:
            if version_tuple(ud.unidata_version) >= version_tuple(version):
                assert low == chr(table[c]), f"U+{c:04X}: Python lowers it to {low!r}"
            return chr(table[c])
    return low


def perl_invlist(prop):
    """Unicode::UCD::prop_invlist(prop) as a list of (first, last) ranges."""
    out = subprocess.run(
        ["perl", "-MUnicode::UCD=prop_invlist", "-e",
         'print join(" ", prop_invlist($ARGV[0])), "\\n"', prop],
        check=True, capture_output=True, text=True).stdout.split()
    inv = [int(x) for x in out]
    if len(inv) % 2:
        inv.append(0x110000)
    return [(inv[i], inv[i + 1] - 1) for i in range(0, len(inv), 2)]


def perl_unicode_version():
    return subprocess.run(["perl", "-MUnicode::UCD", "-e", "print Unicode::UCD::UnicodeVersion()"],
                          check=True, capture_output=True, text=True).stdout.strip()


def expand(ranges):
    s = set()
    for a, b in ranges:
        s.update(range(a, b + 1))
    return s


def is_hangul_syllable(c):
    return 0xAC00 <= c <= 0xD7A3


class Data:
    def __init__(self):
        if perl_unicode_version() != ud.unidata_version:
            sys.exit(f"perl's Unicode {perl_unicode_version()} != Python's {ud.unidata_version}")
        self.present = expand(perl_invlist(f"Present_In={NORMALIZATION_UNICODE}"))
        self.white_space = perl_invlist("White_Space")
        cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
        # single-level decompositions (UnicodeData field 5) of code points present in 9.0
        self.decomp = {}
        for c in cps:
            if c not in self.present:
                continue
            d = ud.decomposition(chr(c))
            if not d:
                continue
            parts = d.split()
            compat = parts[0].startswith("<")
            self.decomp[c] = (compat, [int(p, 16) for p in (parts[1:] if compat else parts)])
        self.ccc = {c: ud.combining(chr(c)) for c in cps if c in self.present and ud.combining(chr(c))}
        self.marks = {c for c in cps if c in self.present and ud.category(chr(c)) in ("Mn", "Mc", "Me")}
        for c, m in MARK_OVERRIDES.items():
            (self.marks.add if m else self.marks.discard)(c)
        # primary composites: canonical pairs that NFC recomposes (not composition-excluded)
        self.composite = {c for c, (compat, m) in self.decomp.items()
                          if not compat and len(m) == 2 and ud.normalize("NFC", chr(c)) == chr(c)}
        self.lower, self.lower_special = {}, {}
        for c in cps:
            low = lower_char(c)  # one char at a time: no Final_Sigma context, like char::to_lowercase
            if low == chr(c):
                continue
            if len(low) == 1:
                self.lower[c] = ord(low)
            else:
                self.lower_special[c] = [ord(x) for x in low]
        if list(self.lower_special) != [0x130]:
            sys.exit(f"expected one multi-char lower-case mapping (U+0130), got {self.lower_special}")


def runs_of(keys, same):
    """Group sorted keys into runs [first, count] where same(prev, cur) holds for neighbours."""
    out = []
    for c in sorted(keys):
        if out and out[-1][0] + out[-1][1] == c and same(out[-1][0] + out[-1][1] - 1, c):
            out[-1][1] += 1
        else:
            out.append([c, 1])
    return out


def emit_array(name, ctype, values, comment, per_line=8):
    lines = [f"// {comment}", f"inline constexpr {ctype} {name}[] = {{"]
    for i in range(0, len(values), per_line):
        lines.append("    " + ", ".join(values[i:i + per_line]) + ",")
    lines.append("};")
    return "\n".join(lines)


def generate(d):
    out = []
    # combining classes: (first | (count - 1) << 21 | ccc << 32)
    ccc_runs = runs_of(d.ccc, lambda a, b: d.ccc[a] == d.ccc[b])
    assert all(n <= 2048 for _, n in ccc_runs)
    out.append(emit_array(
        "ccc_runs", "std::uint64_t",
        [hex(f | (n - 1) << 21 | d.ccc[f] << 32) for f, n in ccc_runs],
        "canonical combining class != 0: first | (count - 1) << 21 | ccc << 32 (sorted by first)"))
    # marks: first | (count - 1) << 21
    mark_runs = runs_of(d.marks, lambda a, b: True)
    assert all(n <= 2048 for _, n in mark_runs)
    out.append(emit_array("mark_runs", "std::uint32_t", [hex(f | (n - 1) << 21) for f, n in mark_runs],
                          "General_Category = Mark: first | (count - 1) << 21"))
    # decompositions. A run: consecutive code points with one-code-point mappings to consecutive
    # targets and the same kind; the pool holds the first target. Others: count 1, the mapping.
    keys = sorted(d.decomp)
    runs = []
    for c in keys:
        compat, m = d.decomp[c]
        comp = c in d.composite
        if runs and len(m) == 1 and runs[-1]["len"] == 1 and runs[-1]["first"] + runs[-1]["count"] == c \
                and runs[-1]["compat"] == compat and not runs[-1]["composite"] and not comp \
                and runs[-1]["map"][0] + runs[-1]["count"] == m[0] and runs[-1]["count"] < 2048:
            runs[-1]["count"] += 1
            continue
        runs.append({"first": c, "count": 1, "compat": compat, "composite": comp, "len": len(m), "map": m})
    pool, index = [], []
    for r in runs:
        off = len(pool)
        pool.extend(r["map"])
        assert r["len"] < 32 and off < 1 << 14
        index.append(r["first"] | (r["count"] - 1) << 21 | int(r["compat"]) << 32 | int(r["composite"]) << 33
                     | r["len"] << 34 | off << 39)
    out.append(emit_array(
        "decomposition_runs", "std::uint64_t", [hex(v) for v in index],
        "one-level decompositions: first | (count - 1) << 21 | compatibility << 32 | primary composite << 33\n"
        "// | length << 34 | pool offset << 39 (a run of count > 1 maps first + i to pool[offset] + i)"))
    out.append(emit_array("decomposition_pool", "std::uint32_t", [hex(v) for v in pool],
                          "the mappings' code points", per_line=12))
    # lower case: runs with stride 1 or 2 and one delta: first | (count - 1) << 21 | (stride - 1) << 32
    # | (delta + 2^20) << 33
    items = sorted(d.lower.items())
    lruns = []
    for c, t in items:
        delta = t - c
        if lruns:
            r = lruns[-1]
            nxt = r["first"] + r["stride"] * r["count"]
            if r["count"] == 1 and r["delta"] == delta and c - r["first"] in (1, 2):
                r["stride"] = c - r["first"]
                r["count"] = 2
                continue
            if r["count"] > 1 and c == nxt and r["delta"] == delta and r["count"] < 2048:
                r["count"] += 1
                continue
        lruns.append({"first": c, "count": 1, "stride": 1, "delta": delta})
    assert all(abs(r["delta"]) < 1 << 20 for r in lruns)
    out.append(emit_array(
        "lower_runs", "std::uint64_t",
        [hex(r["first"] | (r["count"] - 1) << 21 | (r["stride"] - 1) << 32 | (r["delta"] + (1 << 20)) << 33)
         for r in lruns],
        "simple lower-case mappings: first | (count - 1) << 21 | (stride - 1) << 32 | (delta + 2^20) << 33;\n"
        "// code point first + stride * i maps to itself + delta (U+0130 is special-cased in unicode.hpp)"))
    out.append(emit_array("white_space_ranges", "std::uint32_t",
                          [hex(a | (b - a) << 21) for a, b in d.white_space], "White_Space: first | (count - 1) << 21"))
    return out, len(pool)


def check_rust_tables(d, path):
    """Compare with unicode-normalization's generated tables.rs (Unicode 9.0.0 version)."""
    src = open(path, encoding="utf-8").read()
    if "UNICODE_VERSION: (u64, u64, u64) = (9, 0, 0)" not in src:
        sys.exit(f"{path}: not the Unicode 9.0.0 tables")

    def section(name):
        i = src.index(name)
        return src[i:src.index("];", i)]

    def full(c, compat, table):
        if is_hangul_syllable(c) or c not in table or (table[c][0] and not compat):
            return [c]
        return [x for p in table[c][1] for x in full(p, compat, table)]

    ccc = {}
    for m in re.finditer(r"0x([0-9A-Fa-f]+),", section("CANONICAL_COMBINING_CLASS_KV")):
        v = int(m.group(1), 16)
        ccc[v >> 8] = v & 0xFF
    marks = {int(m.group(1), 16) for m in re.finditer(r"0x([0-9A-Fa-f]+),", section("COMBINING_MARK_KV"))}

    def decomp(name):
        t = {}
        for m in re.finditer(r"\(0x([0-9a-fA-F]+), &\[([^\]]*)\]\)", section(name)):
            t[int(m.group(1), 16)] = [int(x, 16) for x in re.findall(r"\\u\{([0-9A-Fa-f]+)\}", m.group(2))]
        return t

    canon, compat = decomp("CANONICAL_DECOMPOSED_KV"), decomp("COMPATIBILITY_DECOMPOSED_KV")
    comp = {}
    for m in re.finditer(r"\(0x([0-9A-Fa-f]+), '\\u\{([0-9A-Fa-f]+)\}'\)", section("COMPOSITION_TABLE_KV")):
        k = int(m.group(1), 16)
        comp[(k >> 16, k & 0xFFFF)] = int(m.group(2), 16)
    for m in re.finditer(r"\('\\u\{([0-9A-Fa-f]+)\}', '\\u\{([0-9A-Fa-f]+)\}'\) => Some\('\\u\{([0-9A-Fa-f]+)\}'\)", src):
        comp[(int(m.group(1), 16), int(m.group(2), 16))] = int(m.group(3), 16)
    bad = []
    if ccc != d.ccc:
        bad.append("combining classes")
    if marks != d.marks:
        bad.append(f"marks (only ours: {sorted(d.marks - marks)}, only theirs: {sorted(marks - d.marks)})")
    ours = {(m[0], m[1]): c for c, (_, m) in d.decomp.items() if c in d.composite}
    if ours != comp:
        bad.append("composition pairs")
    for c in range(0x110000):
        if 0xD800 <= c <= 0xDFFF or is_hangul_syllable(c):
            continue
        if full(c, False, d.decomp) != canon.get(c, [c]):
            bad.append(f"canonical decomposition of U+{c:04X}")
        if full(c, True, d.decomp) != (compat.get(c) or canon.get(c) or [c]):
            bad.append(f"compatibility decomposition of U+{c:04X}")
    if bad:
        sys.exit("differs from the Rust tables: " + "; ".join(bad[:20]))
    print(f"agrees with {path}: {len(ccc)} combining classes, {len(marks)} marks, {len(canon)} canonical and "
          f"{len(compat)} compatibility decompositions, {len(comp)} composition pairs", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check-rust-tables", metavar="TABLES_RS",
                    help="compare with unicode-normalization's src/tables.rs at its Unicode 9.0.0 version")
    args = ap.parse_args()
    d = Data()
    if args.check_rust_tables:
        check_rust_tables(d, args.check_rust_tables)
        return
    body, pool = generate(d)
    print(f"""#pragma once
//! \\file
//! GENERATED by tools/engram/gen_unicode_tables.py (do not edit): the Unicode data of the Engram
//! token map's normalizer (engram.py's tokenizers chain; see unicode.hpp for how it is read).
//! Normalization data (combining classes, decompositions, marks): Unicode {ud.unidata_version} data restricted
//! to the code points of Unicode {NORMALIZATION_UNICODE}.0, the version of the tables tokenizers uses
//! (unicode-normalization-alignments 0.1.12), with the {len(MARK_OVERRIDES)} Mark changes since then undone.
//! Lower case: Unicode {ud.unidata_version} plus the mappings added up to {LOWER_UNICODE}; White_Space: Unicode {ud.unidata_version}.
//! Only unicode.hpp includes this header.

#include <cstdint>

namespace dsv4::engram::unicode::data {{

inline constexpr const char* source_unicode_version = "{ud.unidata_version}";       // Python's unicodedata
inline constexpr const char* normalization_unicode_version = "{NORMALIZATION_UNICODE}.0";  // the tables restricted to it
inline constexpr const char* lowercase_unicode_version = "{LOWER_UNICODE}";     // lower-case mappings
inline constexpr int decomposition_pool_size = {pool};
""")
    print("\n\n".join(body))
    print("\n}  // namespace dsv4::engram::unicode::data")


if __name__ == "__main__":
    main()
