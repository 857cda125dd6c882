#pragma once
// Inputs for whole-model tests of the tiny variant: its token map (the identity: tiny's
// compressed vocabulary is its vocabulary) and fixed pseudo-random token ids (not
// DSV4_TEST_SEED's: end-to-end bounds on random weights are measured on fixed prompts).

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "dsv4/models/tiny.hpp"

namespace dsv4::test {

inline std::vector<std::int64_t> tiny_identity_map() {
  std::vector<std::int64_t> m(static_cast<std::size_t>(models::tiny::dims.vocab_size));
  std::iota(m.begin(), m.end(), 0);
  return m;
}

inline std::vector<std::int32_t> tiny_random_ids(std::uint64_t salt, int n) {
  std::mt19937_64 rng(salt);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (auto& id : ids) id = std::int32_t(rng() % std::uint64_t(models::tiny::dims.vocab_size));
  return ids;
}

}  // namespace dsv4::test
