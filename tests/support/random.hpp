#pragma once
// Fresh random inputs each run, reproducible on demand: the seed comes from DSV4_TEST_SEED if set,
// else from std::random_device, and is printed so a failure can be replayed.

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>

namespace dsv4::test {

inline std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    if (const char* s = std::getenv("DSV4_TEST_SEED")) return std::uint64_t(std::strtoull(s, nullptr, 0));
    std::random_device rd;
    return (std::uint64_t(rd()) << 32) ^ rd();
  }();
  static bool printed = false;
  if (!printed) {
    std::cout << "dsv4 test seed: DSV4_TEST_SEED=" << seed << "\n";
    printed = true;
  }
  return seed;
}

inline std::mt19937_64 make_rng(std::uint64_t salt = 0) { return std::mt19937_64(test_seed() ^ (salt * 0x9E3779B97F4A7C15ull)); }

}  // namespace dsv4::test
