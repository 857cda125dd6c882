// NumPy's default_rng stream (engram/numpy_rng.hpp) against vectors from NumPy itself
// (tests/data/numpy_rng.json, written by tests/engram/gen_numpy_rng_vectors.py): SeedSequence
// pool and generate_state, PCG64 seeding and raw outputs, bounded integers on both the 32- and
// 64-bit paths, and the Engram hash multipliers of V4.1 and tiny.

#include <boost/test/unit_test.hpp>

#include <string>
#include <vector>

#include "dsv4/engram/numpy_rng.hpp"
#include "dsv4/io/json.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/models/v41_flash.hpp"
#include "support/data.hpp"

using namespace dsv4;
using engram::pcg64;
using engram::seed_sequence;

// The V4.1 multipliers hard-coded from the reference are the ones the recipe computes.
static_assert(engram::hash_multipliers<4>(1, 99092)[0] == 76632096046245);
static_assert(engram::hash_multipliers<4>(1, 99092) ==
              std::array<std::int64_t, 4>{models::v41_flash::engram_multipliers[0][0], models::v41_flash::engram_multipliers[0][1],
                                          models::v41_flash::engram_multipliers[0][2], models::v41_flash::engram_multipliers[0][3]});
static_assert(engram::hash_multipliers<4>(14, 99092) ==
              std::array<std::int64_t, 4>{models::v41_flash::engram_multipliers[1][0], models::v41_flash::engram_multipliers[1][1],
                                          models::v41_flash::engram_multipliers[1][2], models::v41_flash::engram_multipliers[1][3]});

// tiny's are the recipe's, evaluated when tiny.hpp is compiled (values from NumPy 1.24.2).
static_assert(models::tiny::engram_multipliers[0][0] == 7415652013100227 &&
              models::tiny::engram_multipliers[1][3] == 7995023819248391);

namespace {

const io::json& vectors() {
  static const io::json j = io::parse_json_file(test::data_path("numpy_rng.json"));
  return j;
}

std::uint64_t u64(const io::json& s) { return std::stoull(s.string()); }
std::int64_t i64(const io::json& s) { return std::stoll(s.string()); }

// A decimal string of up to 128 bits.
engram::u128 u128_of(const std::string& s) {
  engram::u128 v;
  for (char c : s) v = v * engram::u128{0, 10} + engram::u128{0, std::uint64_t(c - '0')};
  return v;
}

std::vector<std::uint64_t> u64s(const io::json& a) {
  std::vector<std::uint64_t> v;
  for (const auto& x : a.array()) v.push_back(u64(x));
  return v;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(engram_numpy_rng)

BOOST_AUTO_TEST_CASE(u128_multiply_by_hand) {
  using engram::u128;
  const u128 p = u128::mul_wide(0xFFFFFFFFFFFFFFFFull, 0xFFFFFFFFFFFFFFFFull);  // 2^128 - 2^65 + 1
  BOOST_TEST(p.hi == 0xFFFFFFFFFFFFFFFEull);
  BOOST_TEST(p.lo == 1u);
  const u128 q = u128{1, 0} * u128{1, 0};  // 2^128 wraps to 0
  BOOST_TEST((q == u128{0, 0}));
  const u128 s = u128{0, 0xFFFFFFFFFFFFFFFFull} + u128{0, 1};
  BOOST_TEST((s == u128{1, 0}));
  BOOST_TEST((u128_of("340282366920938463463374607431768211455") == u128{~0ull, ~0ull}));
}

BOOST_AUTO_TEST_CASE(seed_sequence_and_pcg64_match_numpy) {
  const auto& seeds = vectors().object().at("seeds").array();
  BOOST_REQUIRE(seeds.size() >= 5u);
  for (const auto& c : seeds) {
    const auto& o = c.object();
    const std::uint64_t seed = u64(o.at("seed"));
    BOOST_TEST_CONTEXT("seed " << seed) {
      const auto ss = seed_sequence::from_seed(seed);
      const auto pool = u64s(o.at("pool"));
      BOOST_TEST(std::vector<std::uint64_t>(ss.pool.begin(), ss.pool.end()) == pool, boost::test_tools::per_element());

      std::vector<std::uint32_t> w32(8);
      ss.generate_state(std::span<std::uint32_t>(w32));
      BOOST_TEST(std::vector<std::uint64_t>(w32.begin(), w32.end()) == u64s(o.at("state32")), boost::test_tools::per_element());
      std::vector<std::uint64_t> w64(4);
      ss.generate_state(std::span<std::uint64_t>(w64));
      BOOST_TEST(w64 == u64s(o.at("state64")), boost::test_tools::per_element());

      auto g = engram::default_rng(seed);
      BOOST_TEST((g.state == u128_of(o.at("pcg_state").string())));
      BOOST_TEST((g.inc == u128_of(o.at("pcg_inc").string())));
      std::vector<std::uint64_t> raw;
      for (std::size_t i = 0; i < o.at("next64").array().size(); ++i) raw.push_back(g.next64());
      BOOST_TEST(raw == u64s(o.at("next64")), boost::test_tools::per_element());
    }
  }
}

BOOST_AUTO_TEST_CASE(integers_match_numpy) {
  const auto& cases = vectors().object().at("integers").array();
  BOOST_REQUIRE(cases.size() >= 16u);
  for (const auto& c : cases) {
    const auto& o = c.object();
    const std::uint64_t seed = u64(o.at("seed"));
    const std::string low = o.at("low").string(), high = o.at("high").string(), dtype = o.at("dtype").string();
    BOOST_TEST_CONTEXT("seed " << seed << ", integers(" << low << ", " << high << ", " << dtype << ")") {
      const auto& expect = o.at("values").array();
      auto g = engram::default_rng(seed);
      if (dtype == "int64") {
        std::vector<std::int64_t> got(expect.size()), want;
        engram::integers(g, std::stoll(low), std::stoll(high), std::span<std::int64_t>(got));
        for (const auto& x : expect) want.push_back(i64(x));
        BOOST_TEST(got == want, boost::test_tools::per_element());
      } else {  // uint64, high up to 2^64: the fill with off = low, rng = high - low - 1
        const engram::u128 h = u128_of(high);
        const std::uint64_t off = std::stoull(low);
        const std::uint64_t rng = (h.hi != 0 ? 0ull : h.lo) - off - 1u;  // h = 2^64 wraps to 0
        std::vector<std::uint64_t> got(expect.size());
        engram::bounded_uint64_fill(g, off, rng, std::span<std::uint64_t>(got));
        BOOST_TEST(got == u64s(o.at("values")), boost::test_tools::per_element());
      }
    }
  }
}

// One generator across calls: the 32-bit half kept back by one call is the next 32-bit draw,
// even after 64-bit draws in between.
BOOST_AUTO_TEST_CASE(the_32_bit_buffer_lives_in_the_generator) {
  for (const auto& s : vectors().object().at("sequences").array()) {
    const std::uint64_t seed = u64(s.object().at("seed"));
    auto g = engram::default_rng(seed);
    for (const auto& step : s.object().at("steps").array()) {
      const auto& o = step.object();
      BOOST_TEST_CONTEXT("seed " << seed) {
        if (o.contains("next64")) {
          std::vector<std::uint64_t> raw;
          for (std::size_t i = 0; i < o.at("next64").array().size(); ++i) raw.push_back(g.next64());
          BOOST_TEST(raw == u64s(o.at("next64")), boost::test_tools::per_element());
          continue;
        }
        const auto& expect = o.at("values").array();
        std::vector<std::int64_t> got(expect.size()), want;
        engram::integers(g, i64(o.at("low")), i64(o.at("high")), std::span<std::int64_t>(got));
        for (const auto& x : expect) want.push_back(i64(x));
        BOOST_TEST(got == want, boost::test_tools::per_element());
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(hash_multipliers_match_numpy) {
  for (const auto& c : vectors().object().at("multipliers").array()) {
    const auto& o = c.object();
    const int max_ngram = int(o.at("max_ngram").integer);
    const std::int64_t vocab = o.at("compressed_vocab").integer;
    BOOST_TEST(engram::hash_multiplier_bound(vocab) == i64(o.at("bound")));
    for (const auto& [layer, values] : o.at("layers").object()) {
      BOOST_TEST_CONTEXT("compressed vocab " << vocab << ", layer " << layer) {
        std::vector<std::int64_t> want;
        for (const auto& x : values.array()) want.push_back(i64(x));
        BOOST_TEST(engram::hash_multipliers(std::stoll(layer), max_ngram, vocab) == want, boost::test_tools::per_element());
      }
    }
  }
}

// The model configurations hold what the recipe computes: V4.1's are hard-coded from the
// reference (spec §10), tiny's are computed at compile time by the recipe itself; both must
// equal NumPy's (the JSON vectors above check the recipe against NumPy).
BOOST_AUTO_TEST_CASE(model_multipliers_are_numpys) {
  const std::int64_t layers[2] = {1, 14};
  for (int l = 0; l < 2; ++l) {
    const auto v = engram::hash_multipliers(layers[l], 4, models::v41_flash::dims.engram.engram_compressed_vocab_size);
    const auto t = engram::hash_multipliers(layers[l], 4, models::tiny::dims.engram.engram_compressed_vocab_size);
    for (int k = 0; k < 4; ++k) {
      BOOST_TEST(models::v41_flash::engram_multipliers[std::size_t(l)][std::size_t(k)] == v[std::size_t(k)]);
      BOOST_TEST(models::tiny::engram_multipliers[std::size_t(l)][std::size_t(k)] == t[std::size_t(k)]);
    }
  }
  // tiny's, as NumPy 1.24.2 printed them (tests/data/numpy_rng.json).
  BOOST_TEST(models::tiny::engram_multipliers[0][0] == 7415652013100227);
  BOOST_TEST(models::tiny::engram_multipliers[1][3] == 7995023819248391);
}

BOOST_AUTO_TEST_CASE(rejects_an_empty_range) {
  auto g = engram::default_rng(0);
  std::int64_t v = 0;
  BOOST_CHECK_THROW(engram::integers(g, 5, 5, std::span<std::int64_t>(&v, 1)), dsv4::error);
  BOOST_CHECK_THROW(engram::hash_multipliers(1, 4, 0), dsv4::error);
}

BOOST_AUTO_TEST_SUITE_END()
