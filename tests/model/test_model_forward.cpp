// The whole tiny model on the host from a random checkpoint: embedding, Engram, 40 blocks, head.
// The logits of a decode step equal those of a fresh prefill of the same tokens, bit for bit
// (the step's position is past the window), and bad token ids are errors.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <string_view>
#include <vector>

#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/model/model_reference.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "dsv4/schedule/prefill_work.hpp"
#include "support/errors.hpp"
#include "support/checkpoints.hpp"
#include "support/random.hpp"

using namespace dsv4;
using tiny = models::tiny;

BOOST_AUTO_TEST_SUITE(model_forward)

// Engram tables read in place from the checkpoint's memory mapping (engram_tables::mapped, for
// V4.1's ~100 GB tables) instead of copied: the same bytes, no copy, the same logits bit for bit.
BOOST_AUTO_TEST_CASE(mapped_engram_tables_give_the_copied_logits) {
  const test::temp_checkpoint tmp("mapped", models::checkpoint_schema<tiny>(), 43);
  io::checkpoint ck(tmp.dir);
  std::vector<std::int64_t> token_map(std::size_t(tiny::dims.vocab_size));
  std::iota(token_map.begin(), token_map.end(), 0);
  const auto copied = model::host_model<tiny>::load(ck, token_map);
  const auto mapped = model::host_model<tiny>::load(ck, token_map, model::engram_tables::mapped);
  BOOST_REQUIRE_EQUAL(mapped.engrams.size(), copied.engrams.size());
  BOOST_REQUIRE(!mapped.engrams.empty());
  for (std::size_t j = 0; j < mapped.engrams.size(); ++j) {
    const auto& a = copied.engrams[j];
    const auto& b = mapped.engrams[j];
    BOOST_TEST(b.embed.empty());  // nothing copied
    BOOST_TEST(b.embed_scale.empty());
    BOOST_TEST(a.mapped_embed.empty());
    BOOST_TEST(std::ranges::equal(a.table_codes(), b.table_codes()));
    BOOST_TEST(std::ranges::equal(a.table_scales(), b.table_scales()));
    BOOST_TEST(b.table_codes().size() == std::size_t(b.rows * b.head_dim));
  }
  auto rng = test::make_rng(96);
  std::vector<std::int32_t> ids(12);
  for (auto& id : ids) id = std::int32_t(rng() % std::uint64_t(tiny::dims.vocab_size));
  model::host_sequence sa, sb;
  const auto la = model::forward(copied, sa, ids), lb = model::forward(mapped, sb, ids);
  BOOST_REQUIRE_EQUAL(la.size(), lb.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < la.size(); ++i) differ += std::bit_cast<std::uint32_t>(float(la[i])) != std::bit_cast<std::uint32_t>(float(lb[i]));
  BOOST_TEST(differ == 0u, differ << " logits differ between mapped and copied Engram tables");
  // A table of the wrong dtype is refused by name, mapped or not.
  auto bad = io::checkpoint::in_memory();
  for (const auto& t : models::checkpoint_schema<tiny>()) {
    const std::string name = t.name;
    if (name.find(".engram.embed.weight") == std::string::npos) continue;
    long long n = 1;
    for (long long x : t.shape) n *= x;
    bad.add(name, io::st_dtype::U8, t.shape, std::vector<std::uint8_t>(std::size_t(n), 0));
  }
  BOOST_TEST(test::throws_with([&] { model::engram_weights_of<tiny>(bad, 0, 1, model::engram_tables::mapped); },
                               "engram.embed.weight"));
}

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

// The CED prefill: equal to the exact prefill while the prompt fits the replay window; beyond it,
// the decoder runs over the last `window` tokens only (the layer-token work of the article's
// model), the logits move (measured, not hidden), and decoding continues. Labelled long: the
// sanitizer build skips it (56 s there; test_ced_vs_exact runs the CED path under it).
BOOST_AUTO_TEST_CASE(ced_prefill, *boost::unit_test::label("long")) {
  using sched = models::model_traits<tiny>::schedule;
  const test::temp_checkpoint tmp("model_ced", models::checkpoint_schema<tiny>(), 42);
  io::checkpoint ck(tmp.dir);
  std::vector<std::int64_t> token_map(std::size_t(tiny::dims.vocab_size));
  std::iota(token_map.begin(), token_map.end(), 0);
  const auto m = model::host_model<tiny>::load(ck, token_map);
  auto rng = test::make_rng(98);
  constexpr int W = tiny::dims.attn.window_size;
  std::vector<std::int32_t> ids(47);
  for (auto& id : ids) id = std::int32_t(rng() % std::uint64_t(tiny::dims.vocab_size));
  auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };

  // A prompt that fits the window: bit for bit the exact prefill, and the decode step after it.
  {
    const auto prompt = std::span<const std::int32_t>(ids).first(W - 3);
    model::host_sequence exact, ced;
    BOOST_TEST(same_bits(model::forward(m, exact, prompt), model::forward_ced(m, ced, prompt)));
    const auto next = std::span<const std::int32_t>(ids).subspan(W - 3, 1);
    BOOST_TEST(same_bits(model::forward(m, exact, next), model::forward(m, ced, next)));
  }
  // A longer prompt: the work is the article's N E + W (L - E) layer-tokens.
  const auto prompt = std::span<const std::int32_t>(ids).first(45);
  long long rows = 0;
  const model::layer_observer count = [&](int, std::string_view stage, std::span<const numerics::bf16> v) {
    if (stage == "attn_in") rows += (long long)(v.size() / std::size_t(tiny::dims.dim));
  };
  model::host_sequence exact, ced;
  const auto want = model::forward(m, exact, prompt);
  const auto got = model::forward_ced(m, ced, prompt, &count);
  BOOST_TEST(rows == schedule::prefill_layer_tokens<sched>(45, schedule::prefill_mode::ced, W).total());
  BOOST_TEST(rows == 45LL * sched::encoder_layers + 1LL * W * (sched::num_layers - sched::encoder_layers));
  double worst = 0, peak = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    BOOST_REQUIRE(std::isfinite(got[i]));
    worst = std::max(worst, double(std::fabs(got[i] - want[i]))), peak = std::max(peak, double(std::fabs(want[i])));
  }
  BOOST_TEST_MESSAGE("CED vs exact prefill of 45 tokens (window " << W << "): worst logit difference " << worst / peak
                                                                  << " of the largest logit");
  BOOST_TEST(!same_bits(got, want));  // the replay truncated the decoder's windows
  BOOST_TEST(ced.length == 45);
  for (int p = 45; p < 47; ++p)
    for (float v : model::forward(m, ced, std::span<const std::int32_t>(ids).subspan(std::size_t(p), 1))) BOOST_REQUIRE(std::isfinite(v));
  // A CED append (a new turn): the encoder over the chunk, the decoder replaying the last window
  // positions of the whole sequence. The global caches are those of an exact append of the same
  // chunk (the encoder runs the chunk exactly, and the decoder's owner reads the encoder output).
  model::host_sequence appended = ced, exact_appended = ced;
  const auto chunk = std::span<const std::int32_t>(ids).subspan(40, 6);
  rows = 0;
  const auto got_append = model::forward_ced(m, appended, chunk, &count);
  model::forward(m, exact_appended, chunk);
  BOOST_TEST(rows == schedule::prefill_layer_tokens<sched>(6, schedule::prefill_mode::ced, W, 47).total());
  BOOST_TEST(appended.length == 53);
  for (const auto& [layer, cache] : appended.attention.owners) {
    const auto& other = exact_appended.attention.owners.at(layer);
    BOOST_TEST(cache.main.size() == other.main.size(), "owner " << layer);
    BOOST_TEST(std::memcmp(cache.main.data(), other.main.data(), cache.main.size() * sizeof(numerics::bf16)) == 0, "owner " << layer);
    BOOST_TEST(std::memcmp(cache.keys.data(), other.keys.data(), cache.keys.size() * sizeof(numerics::bf16)) == 0, "owner " << layer);
  }
  for (float v : got_append) BOOST_REQUIRE(std::isfinite(v));
  for (float v : model::forward(m, appended, std::span<const std::int32_t>(ids).subspan(46, 1))) BOOST_REQUIRE(std::isfinite(v));
  // A sequence without the encoder tail (state not built by forward) is refused.
  model::host_sequence broken = ced;
  broken.encoder_tail.clear();
  BOOST_TEST(test::throws_with([&] { model::forward_ced(m, broken, chunk); }, "does not hold the encoder output"));
}

BOOST_AUTO_TEST_SUITE_END()
