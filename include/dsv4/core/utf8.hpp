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

//! One sequence of `s` at byte `i`: returns how many bytes it takes and sets `cp` to its code
//! point, or to U+FFFD for an ill-formed one, whose length is then its maximal subpart (a lead
//! byte and the continuation bytes that fit it; 1 for a byte that can start nothing). Overlong
//! forms, surrogates (ED A0..BF) and code points above U+10FFFF are ill-formed at their second
//! byte, as the well-formed byte table (Unicode table 3-7) says. `well_formed` says which.
inline std::size_t decode_one(std::string_view s, std::size_t i, char32_t& cp, bool& well_formed) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned b0 = byte(i);
  well_formed = true;
  if (b0 < 0x80) {
    cp = char32_t(b0);
    return 1;
  }
  int need = 0;                   // continuation bytes after b0
  unsigned lo = 0x80, hi = 0xBF;  // range of the second byte (table 3-7)
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
    cp = replacement_character;
    well_formed = false;
    return 1;
  }
  std::size_t j = i + 1;
  for (int k = 0; k < need; ++k, ++j) {
    const unsigned lo_k = k == 0 ? lo : 0x80u, hi_k = k == 0 ? hi : 0xBFu;
    if (j >= s.size() || byte(j) < lo_k || byte(j) > hi_k) {
      cp = replacement_character;  // bytes i .. j-1 are the maximal subpart
      well_formed = false;
      break;
    }
    cp = (cp << 6) | (byte(j) & 0x3F);
  }
  return j - i;
}

//! Decode UTF-8; each maximal subpart of an ill-formed sequence becomes one U+FFFD (Unicode
//! §3.9, "U+FFFD substitution of maximal subparts").
inline std::u32string decode_utf8_lossy(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    char32_t cp;
    bool well_formed;
    i += decode_one(s, i, cp, well_formed);
    out += cp;
  }
  return out;
}

//! Bytes of the well-formed sequence `s` starts with (1 to 4), or 0 if it starts with an
//! ill-formed one (or is empty).
inline std::size_t well_formed_length(std::string_view s) {
  if (s.empty()) return 0;
  char32_t cp;
  bool well_formed;
  const std::size_t n = decode_one(s, 0, cp, well_formed);
  return well_formed ? n : 0;
}

//! Appends code point `c` (a Unicode scalar value) as UTF-8.
inline void append_utf8(std::string& out, char32_t c) {
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

//! Encode code points as UTF-8 (the input must hold Unicode scalar values).
inline std::string encode_utf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char32_t c : s) append_utf8(out, c);
  return out;
}

}  // namespace dsv4::text
