#pragma once
//! \file
//! Sizes of the Engram hash tables (spec §10), computable at compile time.
//!
//! Each Engram layer has one table per (n-gram order, head), of a prime number of rows. The
//! primes are handed out in increasing order, never reused, starting above `vocab_size - 1`:
//! layer 0 of the list gets the first (max_ngram - 1) * n_heads primes, the next layer the next
//! ones. A layer's `engram_num_embeddings` is the sum of its primes.

#include <array>
#include <cstddef>

namespace dsv4::engram {

constexpr bool is_prime(long long n) {
  if (n < 2) return false;
  if (n % 2 == 0) return n == 2;
  for (long long d = 3; d * d <= n; d += 2)
    if (n % d == 0) return false;
  return true;
}

constexpr long long next_prime_above(long long n) {
  long long p = n + 1;
  while (!is_prime(p)) ++p;
  return p;
}

//! Total rows of each Engram layer's tables, for `Layers` Engram layers.
template <std::size_t Layers>
constexpr std::array<long long, Layers> table_rows(long long vocab_size, int max_ngram, int n_heads) {
  std::array<long long, Layers> rows{};
  long long p = vocab_size - 1;
  const int tables_per_layer = (max_ngram - 1) * n_heads;
  for (std::size_t l = 0; l < Layers; ++l)
    for (int t = 0; t < tables_per_layer; ++t) {
      p = next_prime_above(p);
      rows[l] += p;
    }
  return rows;
}

}  // namespace dsv4::engram
