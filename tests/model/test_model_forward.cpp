// The whole tiny model on the host from a random checkpoint: embedding, Engram, 40 blocks, head.
// The logits of a decode step equal those of a fresh prefill of the same tokens, bit for bit
// (the step's position is past the window), and bad token ids are errors.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <vector>

#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/model/model_reference.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "support/errors.hpp"
#include "support/checkpoints.hpp"
#include "support/random.hpp"

using namespace dsv4;
using tiny = models::tiny;

BOOST_AUTO_TEST_SUITE(model_forward)

BOOST_AUTO_TEST_CASE(decode_logits_equal_prefill_logits) {
  const test::temp_checkpoint tmp("model", models::checkpoint_schema<tiny>(), 41);
  io::checkpoint ck(tmp.dir);
  std::vector<std::int64_t> token_map(std::size_t(tiny::dims.vocab_size));
  std::iota(token_map.begin(), token_map.end(), 0);
  const auto m = model::host_model<tiny>::load(ck, token_map);

  auto rng = test::make_rng(95);
  const int tokens = tiny::dims.attn.window_size + 2;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(tokens));
  for (auto& id : ids) id = std::int32_t(rng() % std::uint64_t(tiny::dims.vocab_size));

  model::host_sequence incremental, fresh;
  model::forward(m, incremental, std::span<const std::int32_t>(ids).first(std::size_t(tokens - 2)));
  model::forward(m, incremental, std::span<const std::int32_t>(ids).subspan(std::size_t(tokens - 2), 1));
  const auto step = model::forward(m, incremental, std::span<const std::int32_t>(ids).subspan(std::size_t(tokens - 1), 1));
  const auto full = model::forward(m, fresh, ids);
  BOOST_REQUIRE_EQUAL(step.size(), std::size_t(tiny::dims.vocab_size));
  std::size_t differ = 0, nonfinite = 0;
  float lo = step[0], hi = step[0];
  for (std::size_t i = 0; i < step.size(); ++i) {
    differ += std::memcmp(&step[i], &full[i], sizeof(float)) != 0;
    nonfinite += !std::isfinite(step[i]);
    lo = std::min(lo, step[i]), hi = std::max(hi, step[i]);
  }
  BOOST_TEST(differ == 0u);
  BOOST_TEST(nonfinite == 0u);
  BOOST_TEST(hi > lo);  // the logits depend on the token
  BOOST_TEST(incremental.length == tokens);

  model::host_sequence other;
  const std::int32_t bad[1] = {tiny::dims.vocab_size};
  BOOST_TEST(test::throws_with([&] { model::forward(m, other, bad); }, "outside the vocabulary"));
  // An appended chunk (exact mode) gives the logits of the same tokens fed one by one.
  model::host_sequence chunked;
  model::forward(m, chunked, std::span<const std::int32_t>(ids).first(3));
  const auto chunk_logits = model::forward(m, chunked, std::span<const std::int32_t>(ids).subspan(3));
  std::size_t chunk_differ = 0;
  for (std::size_t i = 0; i < step.size(); ++i) chunk_differ += std::memcmp(&chunk_logits[i], &step[i], sizeof(float)) != 0;
  BOOST_TEST(chunk_differ == 0u);
  BOOST_TEST(chunked.length == tokens);
}

BOOST_AUTO_TEST_SUITE_END()
