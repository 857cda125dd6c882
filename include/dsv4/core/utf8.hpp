#pragma once
//! \file
//! UTF-8, decoded and encoded by the rules of Unicode §3.9 (the well-formed byte sequences of
//! table 3-7): shared by the JSON reader (which refuses ill-formed strings), the HTTP server's
//! error bodies (which replace ill-formed bytes they echo) and the Engram normalizer.

#include <cstddef>
#include <string>
#include <string_view>

namespace dsv4::text {

inline constexpr char32_t replacement_character = U'\uFFFD';

//! Decode UTF-8; each maximal subpart of an ill-formed sequence becomes one U+FFFD (Unicode
//! §3.9, "U+FFFD substitution of maximal subparts"): a lead byte followed by fewer continuation
//! bytes than it needs is one replacement; a byte that can start nothing is one replacement.
//! Overlong forms, surrogates (ED A0..BF) and code points above U+10FFFF are ill-formed at their
//! second byte, as the well-formed byte table (Unicode table 3-7) says.
inline std::u32string decode_utf8_lossy(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  std::size_t i = 0;
  while (i < s.size()) {
    const unsigned b0 = byte(i);
    if (b0 < 0x80) {
      out += char32_t(b0);
      ++i;
      continue;
    }
    int need = 0;                   // continuation bytes after b0
    unsigned lo = 0x80, hi = 0xBF;  // range of the second byte (table 3-7)
    char32_t cp = 0;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      need = 1;
      cp = b0 & 0x1F;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      need = 2;
      cp = b0 & 0x0F;
      if (b0 == 0xE0) lo = 0xA0;
      if (b0 == 0xED) hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      need = 3;
      cp = b0 & 0x07;
      if (b0 == 0xF0) lo = 0x90;
      if (b0 == 0xF4) hi = 0x8F;
    } else {  // 80..C1, F5..FF: never a lead byte
      out += replacement_character;
      ++i;
      continue;
    }
    std::size_t j = i + 1;
    bool ok = true;
    for (int k = 0; k < need; ++k, ++j) {
      const unsigned lo_k = k == 0 ? lo : 0x80u, hi_k = k == 0 ? hi : 0xBFu;
      if (j >= s.size() || byte(j) < lo_k || byte(j) > hi_k) {
        ok = false;
        break;
      }
      cp = (cp << 6) | (byte(j) & 0x3F);
    }
    out += ok ? cp : replacement_character;  // not ok: bytes i .. j-1 are the maximal subpart
    i = j;
  }
  return out;
}

//! Encode code points as UTF-8 (the input must hold Unicode scalar values).
inline std::string encode_utf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char32_t c : s) {
    if (c < 0x80) {
      out += char(c);
    } else if (c < 0x800) {
      out += char(0xC0 | (c >> 6));
      out += char(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      out += char(0xE0 | (c >> 12));
      out += char(0x80 | ((c >> 6) & 0x3F));
      out += char(0x80 | (c & 0x3F));
    } else {
      out += char(0xF0 | (c >> 18));
      out += char(0x80 | ((c >> 12) & 0x3F));
      out += char(0x80 | ((c >> 6) & 0x3F));
      out += char(0x80 | (c & 0x3F));
    }
  }
  return out;
}

//! Bytes of the well-formed sequence `s` starts with (1 to 4), or 0 if it starts with an
//! ill-formed one (or is empty).
inline std::size_t well_formed_length(std::string_view s) {
  if (s.empty()) return 0;
  const std::size_t end = s.size() < 4 ? s.size() : 4;
  const std::u32string first = decode_utf8_lossy(s.substr(0, end));
  if (first.empty()) return 0;
  if (first[0] == replacement_character && s.substr(0, 3) != "\xEF\xBF\xBD")
    return 0;  // ill-formed (not U+FFFD itself)
  const char32_t c = first[0];
  return c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4;
}

}  // namespace dsv4::text
