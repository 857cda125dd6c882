#pragma once
//! \file
//! Engram n-gram hashing (spec §10), host reference. Integer arithmetic only, so it is exact.
//!
//! Each Engram layer has (max_ngram - 1) x n_heads tables of prime sizes (table_layout.hpp). For a
//! token at position p, with compressed ids c (DEAD = -1 inside image spans):
//!   tok_k = c_{p-k} for k = 0..max_ngram-1, or the pad id once "blocked" (p < k, or c_{p-k} DEAD;
//!           blocked stays blocked for larger k, so a DEAD current token pads everything);
//!   P_k = tok_k * mult_k;  r = P_0;  for n = 2..max_ngram: r ^= P_{n-1},
//!   hash_{n,h} = r mod prime_{n,h} + offset_{n,h}   (offsets: exclusive prefix sums of the primes).
//! The history of compressed ids is written before any look-up, so decode steps see the prefill.

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/engram/table_layout.hpp"

namespace dsv4::engram {

inline constexpr std::int64_t dead = -1;

//! Primes and offsets of every Engram layer: layer l's tables in (order, head) order.
struct hash_layout {
  int layers = 0, max_ngram = 0, n_heads = 0;
  std::vector<std::int64_t> primes;   //!< [layers, (max_ngram - 1) * n_heads]
  std::vector<std::int64_t> offsets;  //!< same shape; exclusive prefix sums within a layer
  int columns() const { return (max_ngram - 1) * n_heads; }

  static hash_layout make(int layers, long long vocab_size, int max_ngram, int n_heads) {
    if (layers < 0 || max_ngram < 2 || n_heads < 1 || vocab_size < 2)
      throw error("engram hash_layout: need layers >= 0, max_ngram >= 2, n_heads >= 1, vocab_size >= 2");
    hash_layout h{layers, max_ngram, n_heads, {}, {}};
    long long p = vocab_size - 1;
    for (int l = 0; l < layers; ++l) {
      std::int64_t offset = 0;
      for (int t = 0; t < h.columns(); ++t) {
        p = next_prime_above(p);
        h.primes.push_back(p);
        h.offsets.push_back(offset);
        offset += p;
      }
    }
    return h;
  }
};

//! Hash ids of `ids` (positions start_pos ...), one row of columns() values per token, for
//! Engram layer `layer` with multipliers `mult` (max_ngram of them). `history` holds the
//! compressed ids of the sequence so far and is extended (before the look-ups) by this call.
inline std::vector<std::int64_t> hash_tokens(const hash_layout& h, int layer, std::span<const std::int64_t> mult,
                                             std::span<const std::int32_t> ids, std::span<const std::uint8_t> token_mask,
                                             std::span<const std::int64_t> token_map, std::int64_t pad_id,
                                             std::vector<std::int64_t>& history, long long start_pos) {
  if (layer < 0 || layer >= h.layers) throw error("hash_tokens: layer " + std::to_string(layer) + " out of range");
  if (mult.size() != std::size_t(h.max_ngram)) throw error("hash_tokens: need one multiplier per n-gram shift");
  if (!token_mask.empty() && token_mask.size() != ids.size()) throw error("hash_tokens: token_mask must match ids");
  if (start_pos != static_cast<long long>(history.size()))
    throw error("hash_tokens: start_pos " + std::to_string(start_pos) + " does not continue the history of " +
                std::to_string(history.size()) + " tokens");
  if (pad_id < 0 || pad_id >= static_cast<std::int64_t>(token_map.size())) throw error("hash_tokens: pad id outside the token map");
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const bool live = token_mask.empty() || token_mask[i];
    if (live && (ids[i] < 0 || std::size_t(ids[i]) >= token_map.size()))
      throw error("hash_tokens: token id " + std::to_string(ids[i]) + " outside the token map (" +
                  std::to_string(token_map.size()) + " entries)");
    history.push_back(live ? token_map[std::size_t(ids[i])] : dead);
  }
  const std::int64_t pad = token_map[std::size_t(pad_id)];
  const int cols = h.columns();
  std::vector<std::int64_t> out(ids.size() * std::size_t(cols));
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const long long p = start_pos + static_cast<long long>(i);
    std::vector<std::int64_t> prod(std::size_t(h.max_ngram));
    bool blocked = false;
    for (int k = 0; k < h.max_ngram; ++k) {
      if (p < k || history[std::size_t(p - k)] == dead) blocked = true;
      const std::int64_t tok = blocked ? pad : history[std::size_t(p - k)];
      prod[std::size_t(k)] = tok * mult[std::size_t(k)];
    }
    std::int64_t r = prod[0];
    for (int n = 2; n <= h.max_ngram; ++n) {
      r ^= prod[std::size_t(n - 1)];
      for (int hd = 0; hd < h.n_heads; ++hd) {
        const std::size_t col = std::size_t((n - 2) * h.n_heads + hd);
        const std::size_t at = std::size_t(layer) * std::size_t(cols) + col;
        out[i * std::size_t(cols) + col] = r % h.primes[at] + h.offsets[at];
      }
    }
  }
  return out;
}

}  // namespace dsv4::engram
