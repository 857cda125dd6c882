#pragma once
//! \file
//! The Unicode operations of the Engram token map's normalizer (spec §10), on code points
//! (`std::u32string`), host only:
//!   - UTF-8 decoding with U+FFFD for invalid input, one replacement per maximal invalid subpart
//!     (Rust's `String::from_utf8_lossy`, which tokenizers' ByteLevel decoder calls; Python's
//!     `bytes.decode("utf-8", "replace")` does the same);
//!   - NFD, NFKD, NFC, NFKC (UAX #15: full decomposition, canonical ordering, canonical
//!     composition; Hangul syllables by arithmetic);
//!   - General_Category = Mark (tokenizers' StripAccents removes these), one-char lower case
//!     (Rust's `char::to_lowercase`: full mappings, so U+0130 becomes "i" U+0307, and no
//!     Final_Sigma context: a word-final capital sigma becomes σ, not ς as Python's str.lower()
//!     gives), White_Space (Rust's `char::is_whitespace`, which tokenizers' Strip trims).
//! Which Unicode version each answers to is in unicode_data.hpp (generated; see
//! tools/engram/gen_unicode_tables.py): normalization and marks as Unicode 9.0.0, the version of the
//! tables inside tokenizers; lower case and White_Space as Unicode 14.0.0.
//!
//! Example: `encode_utf8(nfkc(decode_utf8_lossy("\xEF\xAC\x81")))` is "fi" (the ligature U+FB01).

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dsv4/core/utf8.hpp"
#include "dsv4/engram/unicode_data.hpp"

namespace dsv4::engram::unicode {

using text::replacement_character;
using text::decode_utf8_lossy;
using text::encode_utf8;

// ----------------------------------------------------------------------------------------------
// Character properties

namespace detail {
// Every table is sorted by its first code point (bits 0..20), with a run length - 1 in bits 21..31.
constexpr char32_t run_first(std::uint64_t v) { return char32_t(v & 0x1FFFFF); }
constexpr std::uint32_t run_count(std::uint64_t v) { return std::uint32_t((v >> 21) & 0x7FF) + 1; }

//! The run of `table` that holds `c`, or nullptr.
template <class T, std::size_t N>
const T* find_run(const T (&table)[N], char32_t c) {
  const T* it = std::upper_bound(std::begin(table), std::end(table), c,
                                 [](char32_t x, T v) { return x < run_first(v); });
  if (it == std::begin(table)) return nullptr;
  --it;
  return c - run_first(*it) < run_count(*it) ? it : nullptr;
}

// Hangul syllables (Unicode §3.12): S = SBase + (L * VCount + V) * TCount + T.
inline constexpr char32_t s_base = 0xAC00, l_base = 0x1100, v_base = 0x1161, t_base = 0x11A7;
inline constexpr char32_t l_count = 19, v_count = 21, t_count = 28, n_count = v_count * t_count,
                          s_count = l_count * n_count;
}  // namespace detail

//! Canonical combining class (0 for starters and for code points Unicode 9.0 did not have).
inline std::uint8_t combining_class(char32_t c) {
  const auto* r = detail::find_run(data::ccc_runs, c);
  return r ? std::uint8_t(*r >> 32) : 0;
}

//! General_Category = Mark (Mn, Mc, Me), as Unicode 9.0 assigned it: what tokenizers' StripAccents removes.
inline bool is_mark(char32_t c) { return detail::find_run(data::mark_runs, c) != nullptr; }

//! The White_Space property (Rust's char::is_whitespace; tokenizers' Strip trims these).
inline bool is_white_space(char32_t c) { return detail::find_run(data::white_space_ranges, c) != nullptr; }

//! Append the full lower-case mapping of `c` (one code point, or "i" U+0307 for U+0130), as
//! Rust's `char::to_lowercase`; no context (Final_Sigma) is applied.
inline void append_lowercase(char32_t c, std::u32string& out) {
  if (c == 0x130) {
    out += U'i';
    out += char32_t(0x307);
    return;
  }
  // the last run starting at or before c; a run of stride 2 spans first, first + 2, ...,
  // first + 2 (count - 1) (runs do not interleave: the generator closes one before the next)
  const auto* end = std::end(data::lower_runs);
  const auto* r = std::upper_bound(std::begin(data::lower_runs), end, c,
                                   [](char32_t x, std::uint64_t v) { return x < detail::run_first(v); });
  if (r != std::begin(data::lower_runs)) {
    const std::uint64_t v = *--r;
    const std::uint32_t stride = std::uint32_t((v >> 32) & 1) + 1, offset = std::uint32_t(c - detail::run_first(v));
    if (offset % stride == 0 && offset / stride < detail::run_count(v)) {
      out += char32_t(std::int64_t(c) + std::int64_t(v >> 33) - (std::int64_t(1) << 20));
      return;
    }
  }
  out += c;
}

//! Lower-case every code point of `s` on its own (tokenizers' Lowercase normalizer).
inline std::u32string lowercase(std::u32string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (const char32_t c : s) append_lowercase(c, out);
  return out;
}

// ----------------------------------------------------------------------------------------------
// Normalization forms

namespace detail {
struct decomposition {
  const std::uint32_t* pool = nullptr;  // the mapping (or, for a run, its first target)
  std::uint32_t length = 0, index = 0;  // index within a run: added to a one-code-point mapping
  bool compatibility = false, composite = false;
};

inline bool lookup_decomposition(char32_t c, decomposition& d) {
  const auto* r = find_run(data::decomposition_runs, c);
  if (!r) return false;
  const std::uint64_t v = *r;
  d.compatibility = (v >> 32) & 1;
  d.composite = (v >> 33) & 1;
  d.length = std::uint32_t((v >> 34) & 31);
  d.pool = data::decomposition_pool + (v >> 39);
  d.index = std::uint32_t(c - run_first(v));
  return true;
}

inline void decompose_into(char32_t c, bool compatibility, std::u32string& out) {
  if (c >= s_base && c < s_base + s_count) {
    const char32_t s = c - s_base;
    out += char32_t(l_base + s / n_count);
    out += char32_t(v_base + (s % n_count) / t_count);
    if (s % t_count) out += char32_t(t_base + s % t_count);
    return;
  }
  decomposition d;
  if (!lookup_decomposition(c, d) || (d.compatibility && !compatibility)) {
    out += c;
    return;
  }
  if (d.length == 1) {
    decompose_into(char32_t(d.pool[0] + d.index), compatibility, out);
    return;
  }
  for (std::uint32_t k = 0; k < d.length; ++k) decompose_into(char32_t(d.pool[k]), compatibility, out);
}

//! Canonical ordering: stable sort of every run of non-starters by combining class.
inline void canonical_order(std::u32string& s) {
  std::size_t i = 0;
  while (i < s.size()) {
    if (combining_class(s[i]) == 0) { ++i; continue; }
    std::size_t j = i;
    while (j < s.size() && combining_class(s[j]) != 0) ++j;
    std::stable_sort(s.begin() + std::ptrdiff_t(i), s.begin() + std::ptrdiff_t(j),
                     [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
}

//! Primary composites by their canonical pair (first << 21 | second), built once.
inline const std::vector<std::pair<std::uint64_t, char32_t>>& composition_pairs() {
  static const std::vector<std::pair<std::uint64_t, char32_t>> pairs = [] {
    std::vector<std::pair<std::uint64_t, char32_t>> p;
    for (const std::uint64_t v : data::decomposition_runs) {
      if (!((v >> 33) & 1)) continue;  // a primary composite is always a run of one, length 2
      const std::uint32_t* m = data::decomposition_pool + (v >> 39);
      p.emplace_back(std::uint64_t(m[0]) << 21 | m[1], run_first(v));
    }
    std::sort(p.begin(), p.end());
    return p;
  }();
  return pairs;
}

//! The primary composite of (a, b), or 0.
inline char32_t compose_pair(char32_t a, char32_t b) {
  if (a >= l_base && a < l_base + l_count && b >= v_base && b < v_base + v_count)
    return s_base + ((a - l_base) * v_count + (b - v_base)) * t_count;
  if (a >= s_base && a < s_base + s_count && (a - s_base) % t_count == 0 && b > t_base && b < t_base + t_count)
    return a + (b - t_base);
  const auto& p = composition_pairs();
  const std::uint64_t key = std::uint64_t(a) << 21 | b;
  const auto it = std::lower_bound(p.begin(), p.end(), key, [](const auto& e, std::uint64_t k) { return e.first < k; });
  return it != p.end() && it->first == key ? it->second : 0;
}

//! Canonical composition of a decomposed, canonically ordered string: a character combines with
//! the last starter unless something between them blocks it (a starter, or a character of the
//! same or higher combining class).
inline std::u32string compose(std::u32string_view s) {
  std::u32string out;
  out.reserve(s.size());
  std::size_t starter = std::u32string::npos;  // index in `out` of the last starter
  int last_ccc = -1;                           // ccc of the last character after it; -1: none
  for (const char32_t c : s) {
    const int ccc = combining_class(c);
    if (starter != std::u32string::npos && (last_ccc == -1 || last_ccc < ccc)) {
      if (const char32_t r = compose_pair(out[starter], c)) {
        out[starter] = r;
        continue;
      }
    }
    if (ccc == 0) {
      starter = out.size();
      last_ccc = -1;
    } else {
      last_ccc = ccc;
    }
    out += c;
  }
  return out;
}

inline std::u32string decompose(std::u32string_view s, bool compatibility) {
  std::u32string out;
  out.reserve(s.size());
  for (const char32_t c : s) decompose_into(c, compatibility, out);
  canonical_order(out);
  return out;
}
}  // namespace detail

inline std::u32string nfd(std::u32string_view s) { return detail::decompose(s, false); }
inline std::u32string nfkd(std::u32string_view s) { return detail::decompose(s, true); }
inline std::u32string nfc(std::u32string_view s) { return detail::compose(detail::decompose(s, false)); }
inline std::u32string nfkc(std::u32string_view s) { return detail::compose(detail::decompose(s, true)); }

//! Remove every General_Category = Mark code point (tokenizers' StripAccents; it does not
//! decompose first: run nfd or nfkd before it to strip accents from precomposed letters).
inline std::u32string strip_marks(std::u32string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (const char32_t c : s)
    if (!is_mark(c)) out += c;
  return out;
}

}  // namespace dsv4::engram::unicode
