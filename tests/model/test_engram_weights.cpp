// tiny's two Engram modules bound from a random checkpoint and run on the host for a few tokens:
// hashes from tiny's multipliers (odd, below the reference's bound) and the identity token map
// (tiny's compressed vocabulary is its vocabulary), every row in range, outputs finite.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <filesystem>
#include <numeric>
#include <random>
#include <vector>

#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/model/engram_weights.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "support/errors.hpp"
#include "support/checkpoints.hpp"
#include "support/random.hpp"

using namespace dsv4;
using numerics::bf16;
using tiny = models::tiny;

BOOST_AUTO_TEST_SUITE(engram_weights)

BOOST_AUTO_TEST_CASE(tiny_multipliers_follow_the_recipe) {
  constexpr long long bound = (0x7fffffffffffffffLL / tiny::dims.engram.engram_compressed_vocab_size) / 2;
  for (const auto& layer : tiny::engram_multipliers)
    for (long long m : layer) {
      BOOST_TEST(m % 2 == 1);
      BOOST_TEST((m >= 1 && m < 2 * bound + 1));
    }
  BOOST_TEST(tiny::engram_multipliers[0][0] != tiny::engram_multipliers[1][0]);
}

BOOST_AUTO_TEST_CASE(tiny_engram_modules_run_from_a_checkpoint) {
  const test::temp_checkpoint tmp("engram", models::checkpoint_schema<tiny>(), 31);
  io::checkpoint ck(tmp.dir);
  const auto layout = model::engram_hash_layout<tiny>();
  constexpr auto c = tiny::dims;
  static_assert(c.engram.engram_compressed_vocab_size == c.vocab_size, "tiny's token map is the identity");
  std::vector<std::int64_t> token_map(std::size_t(c.vocab_size));
  std::iota(token_map.begin(), token_map.end(), 0);
  auto rng = test::make_rng(90);
  const int tokens = 9;
  std::vector<std::int32_t> ids(tokens);
  for (auto& id : ids) id = std::int32_t(rng() % std::uint64_t(c.vocab_size));
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int slot = 0; slot < 2; ++slot) {
    const auto w = model::engram_weights_of<tiny>(ck, slot);
    std::vector<std::int64_t> history;
    const auto& mult = tiny::engram_multipliers[std::size_t(slot)];
    const std::vector<std::int64_t> m(mult.begin(), mult.end());
    const auto hashes = engram::hash_tokens(layout, slot, m, ids, {}, token_map, c.engram.engram_pad_id, history, 0);
    BOOST_REQUIRE_EQUAL(hashes.size(), std::size_t(tokens) * w.columns);
    std::size_t changed = 0, nonfinite = 0;
    for (int t = 0; t < tokens; ++t) {
      std::vector<bf16> x(std::size_t(w.hc) * w.dim);
      for (auto& v : x) v = bf16::from_float(n(rng));
      const auto before = x;
      engram::engram_forward_reference(w, x, std::span<const std::int64_t>(hashes).subspan(std::size_t(t) * w.columns, w.columns), false);
      for (std::size_t i = 0; i < x.size(); ++i) {
        changed += x[i].bits != before[i].bits;
        nonfinite += !std::isfinite(x[i].to_float());
      }
    }
    BOOST_TEST(nonfinite == 0u);
    BOOST_TEST(changed > 0u);
  }
  BOOST_TEST(test::throws_with([&] { model::engram_weights_of<tiny>(ck, 2); }, "slot 2 outside [0, 2)"));
}

BOOST_AUTO_TEST_SUITE_END()
