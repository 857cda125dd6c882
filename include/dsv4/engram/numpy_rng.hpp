#pragma once
//! \file
//! NumPy's `default_rng(seed).integers(...)` stream, bit for bit and at compile time, for the
//! Engram hash multipliers (spec §10): engram.py draws them with
//! `numpy.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram,), dtype=int64)`,
//! so the stream is part of the checkpoint contract.
//!
//! The pieces, as NumPy (1.17 and later) defines them:
//! - `seed_sequence`: SeedSequence with a pool of four 32-bit words. An integer seed becomes its
//!   32-bit words, least significant first; `mix_entropy` hashes them into the pool, and
//!   `generate_state` hashes the pool, cycled, into as many 32-bit words as asked (a uint64 word
//!   is two of them, the first one low).
//! - `pcg64`: PCG64 (128-bit LCG, XSL-RR output to 64 bits). Seeded from generate_state(4, uint64)
//!   = {s0, s1, i0, i1}: initstate = s0:s1 and initseq = i0:i1 (high:low), then pcg's setseq
//!   srandom (inc = 2 initseq + 1, state = 0, step, state += initstate, step). `next32` hands out
//!   the low then the high half of one 64-bit draw; the half kept back stays in the generator.
//! - `bounded_uint64_fill`: NumPy's bounded-integer fill for 64-bit outputs (Lemire's method
//!   without division in the common case). Ranges that fit in 32 bits draw 32-bit words; int64
//!   and uint64 arrays both go through it.
//!
//! Everything is constexpr and uses no 128-bit compiler extension (a small `u128` does the
//! multiplies), so any C++20 compiler, nvcc included, evaluates it at compile time; a handful of
//! draws costs nothing noticeable. Test vectors from NumPy itself: tests/data/numpy_rng.json,
//! written by tests/engram/gen_numpy_rng_vectors.py.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "dsv4/core/error.hpp"

namespace dsv4::engram {

//! Unsigned 128-bit integer arithmetic modulo 2^128: just what PCG64 and Lemire's method need.
struct u128 {
  std::uint64_t hi = 0, lo = 0;

  friend constexpr bool operator==(u128, u128) = default;

  //! The full 128-bit product of two 64-bit values, from 32-bit halves.
  static constexpr u128 mul_wide(std::uint64_t a, std::uint64_t b) {
    constexpr std::uint64_t m32 = 0xFFFFFFFFull;
    const std::uint64_t a0 = a & m32, a1 = a >> 32, b0 = b & m32, b1 = b >> 32;
    const std::uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
    const std::uint64_t mid = (p00 >> 32) + (p01 & m32) + (p10 & m32);  // < 3 * 2^32: no overflow
    return {p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32), (p00 & m32) | (mid << 32)};
  }
  friend constexpr u128 operator*(u128 a, u128 b) {
    u128 r = mul_wide(a.lo, b.lo);
    r.hi += a.hi * b.lo + a.lo * b.hi;  // the a.hi * b.hi term is a multiple of 2^128
    return r;
  }
  friend constexpr u128 operator+(u128 a, u128 b) {
    const std::uint64_t lo = a.lo + b.lo;
    return {a.hi + b.hi + (lo < a.lo ? 1u : 0u), lo};
  }
};

//! NumPy's SeedSequence for an integer seed (no spawn key), pool size 4.
struct seed_sequence {
  static constexpr int pool_size = 4;
  static constexpr std::uint32_t init_a = 0x43b0d7e5u, mult_a = 0x931e8875u;
  static constexpr std::uint32_t init_b = 0x8b51f9ddu, mult_b = 0x58f38dedu;
  static constexpr std::uint32_t mix_mult_l = 0xca01f9ddu, mix_mult_r = 0x4973f715u;
  static constexpr int xshift = 16;  // half the bits of a word

  std::array<std::uint32_t, pool_size> pool{};

  //! From entropy words, least significant first (what NumPy makes of a Python int). Words past
  //! the pool are mixed in afterwards, as NumPy does for integers wider than 128 bits.
  static constexpr seed_sequence from_entropy(std::span<const std::uint32_t> entropy) {
    seed_sequence s;
    std::uint32_t hash_const = init_a;
    auto hashmix = [&hash_const](std::uint32_t value) {
      value ^= hash_const;
      hash_const = std::uint32_t(hash_const * mult_a);
      value = std::uint32_t(value * hash_const);
      return std::uint32_t(value ^ (value >> xshift));
    };
    auto mix = [](std::uint32_t x, std::uint32_t y) {
      const std::uint32_t r = std::uint32_t(std::uint32_t(mix_mult_l * x) - std::uint32_t(mix_mult_r * y));
      return std::uint32_t(r ^ (r >> xshift));
    };
    for (std::size_t i = 0; i < pool_size; ++i) s.pool[i] = hashmix(i < entropy.size() ? entropy[i] : 0u);
    for (std::size_t src = 0; src < pool_size; ++src)
      for (std::size_t dst = 0; dst < pool_size; ++dst)
        if (src != dst) s.pool[dst] = mix(s.pool[dst], hashmix(s.pool[src]));
    for (std::size_t src = pool_size; src < entropy.size(); ++src)
      for (std::size_t dst = 0; dst < pool_size; ++dst) s.pool[dst] = mix(s.pool[dst], hashmix(entropy[src]));
    return s;
  }

  //! `SeedSequence(seed)`: the seed's 32-bit words (one word for seeds below 2^32, including 0).
  static constexpr seed_sequence from_seed(std::uint64_t seed) {
    const std::array<std::uint32_t, 2> words = {std::uint32_t(seed), std::uint32_t(seed >> 32)};
    return from_entropy(std::span<const std::uint32_t>(words.data(), (seed >> 32) != 0 ? 2 : 1));
  }

  //! `generate_state(out.size(), uint32)`.
  constexpr void generate_state(std::span<std::uint32_t> out) const {
    std::uint32_t hash_const = init_b;
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::uint32_t v = pool[i % pool_size] ^ hash_const;
      hash_const = std::uint32_t(hash_const * mult_b);
      v = std::uint32_t(v * hash_const);
      out[i] = std::uint32_t(v ^ (v >> xshift));
    }
  }

  //! `generate_state(out.size(), uint64)`: pairs of 32-bit words, the first one low.
  constexpr void generate_state(std::span<std::uint64_t> out) const {
    std::uint32_t hash_const = init_b;
    std::size_t src = 0;
    auto next = [&] {
      std::uint32_t v = pool[src++ % pool_size] ^ hash_const;
      hash_const = std::uint32_t(hash_const * mult_b);
      v = std::uint32_t(v * hash_const);
      return std::uint32_t(v ^ (v >> xshift));
    };
    for (auto& w : out) {
      const std::uint64_t lo = next();
      w = lo | (std::uint64_t(next()) << 32);
    }
  }
};

//! NumPy's PCG64 bit generator (XSL-RR 128/64), with its 32-bit buffer.
struct pcg64 {
  static constexpr u128 multiplier = {2549297995355413924ull, 4865540595714422341ull};

  u128 state{}, inc{};
  bool has_uint32 = false;     //!< a high half of the last 64-bit draw is waiting for next32
  std::uint32_t uinteger = 0;  //!< that half

  //! pcg_setseq_128_srandom_r(initstate, initseq).
  static constexpr pcg64 from_state(u128 initstate, u128 initseq) {
    pcg64 g;
    g.inc = {(initseq.hi << 1) | (initseq.lo >> 63), (initseq.lo << 1) | 1u};
    g.step();
    g.state = g.state + initstate;
    g.step();
    return g;
  }
  //! `PCG64(SeedSequence)`: state and stream from generate_state(4, uint64).
  static constexpr pcg64 from_seed_sequence(const seed_sequence& s) {
    std::array<std::uint64_t, 4> w{};
    s.generate_state(std::span<std::uint64_t>(w));
    return from_state({w[0], w[1]}, {w[2], w[3]});
  }

  constexpr void step() { state = state * multiplier + inc; }

  constexpr std::uint64_t next64() {
    step();
    const std::uint64_t x = state.hi ^ state.lo;
    const unsigned rot = unsigned(state.hi >> 58);
    return (x >> rot) | (x << ((64u - rot) & 63u));
  }
  constexpr std::uint32_t next32() {
    if (has_uint32) {
      has_uint32 = false;
      return uinteger;
    }
    const std::uint64_t x = next64();
    has_uint32 = true;
    uinteger = std::uint32_t(x >> 32);
    return std::uint32_t(x);
  }
};

//! `numpy.random.default_rng(seed)`'s bit generator.
constexpr pcg64 default_rng(std::uint64_t seed) { return pcg64::from_seed_sequence(seed_sequence::from_seed(seed)); }

//! NumPy's `random_bounded_uint64_fill` (not masked): out[i] = off + a value in [0, rng], rng
//! inclusive. rng < 2^32 takes the 32-bit path (next32: two values per 64-bit draw).
constexpr void bounded_uint64_fill(pcg64& g, std::uint64_t off, std::uint64_t rng, std::span<std::uint64_t> out) {
  if (rng == 0) {
    for (auto& v : out) v = off;
  } else if (rng <= 0xFFFFFFFFull) {
    const std::uint32_t r = std::uint32_t(rng);
    for (auto& v : out) {
      if (r == 0xFFFFFFFFu) {
        v = off + g.next32();
        continue;
      }
      const std::uint32_t excl = r + 1u;
      std::uint64_t m = std::uint64_t(g.next32()) * excl;
      if (std::uint32_t(m) < excl) {
        const std::uint32_t threshold = (0xFFFFFFFFu - r) % excl;  // 2^32 mod excl
        while (std::uint32_t(m) < threshold) m = std::uint64_t(g.next32()) * excl;
      }
      v = off + (m >> 32);
    }
  } else if (rng == 0xFFFFFFFFFFFFFFFFull) {
    for (auto& v : out) v = off + g.next64();
  } else {
    const std::uint64_t excl = rng + 1u;
    for (auto& v : out) {
      u128 m = u128::mul_wide(g.next64(), excl);
      if (m.lo < excl) {
        const std::uint64_t threshold = (0xFFFFFFFFFFFFFFFFull - rng) % excl;  // 2^64 mod excl
        while (m.lo < threshold) m = u128::mul_wide(g.next64(), excl);
      }
      v = off + m.hi;
    }
  }
}

//! `Generator.integers(low, high, size=out.size(), dtype=int64)`, half-open [low, high).
constexpr void integers(pcg64& g, std::int64_t low, std::int64_t high, std::span<std::int64_t> out) {
  if (high <= low) throw error("numpy integers: need low < high");
  const std::uint64_t off = std::uint64_t(low), rng = std::uint64_t(high) - std::uint64_t(low) - 1u;
  for (auto& v : out) {  // one at a time keeps the stream: the fill carries no state of its own
    std::uint64_t u = 0;
    bounded_uint64_fill(g, off, rng, std::span<std::uint64_t>(&u, 1));
    v = std::int64_t(u);
  }
}

//! engram.py's `multiplier_bound`: max(1, (int64_max // compressed_vocab) // 2).
constexpr std::int64_t hash_multiplier_bound(std::int64_t compressed_vocab) {
  if (compressed_vocab < 1) throw error("engram hash multipliers: the compressed vocabulary must be >= 1");
  const std::int64_t b = (INT64_MAX / compressed_vocab) / 2;
  return b < 1 ? 1 : b;
}

//! engram.py's `compute_hash_multipliers` for one Engram layer: out.size() = max_ngram odd
//! multipliers 2v + 1, v = default_rng(10007 * layer_id).integers(0, bound, size=max_ngram).
//! Index k is the look-back shift k.
constexpr void hash_multipliers(std::int64_t layer_id, std::int64_t compressed_vocab, std::span<std::int64_t> out) {
  if (layer_id < 0) throw error("engram hash multipliers: the layer id must be >= 0");
  pcg64 g = default_rng(10007u * std::uint64_t(layer_id));
  integers(g, 0, hash_multiplier_bound(compressed_vocab), out);
  for (auto& m : out) m = 2 * m + 1;
}

//! The same, with max_ngram a compile-time size (for model configurations).
template <std::size_t MaxNgram>
constexpr std::array<std::int64_t, MaxNgram> hash_multipliers(std::int64_t layer_id, std::int64_t compressed_vocab) {
  std::array<std::int64_t, MaxNgram> m{};
  hash_multipliers(layer_id, compressed_vocab, std::span<std::int64_t>(m));
  return m;
}

//! The same, with max_ngram known at run time.
inline std::vector<std::int64_t> hash_multipliers(std::int64_t layer_id, int max_ngram, std::int64_t compressed_vocab) {
  if (max_ngram < 1) throw error("engram hash multipliers: max_ngram must be >= 1");
  std::vector<std::int64_t> m(static_cast<std::size_t>(max_ngram));
  hash_multipliers(layer_id, compressed_vocab, std::span<std::int64_t>(m));
  return m;
}

}  // namespace dsv4::engram
