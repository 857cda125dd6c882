// tiny's 40 blocks (attention + MoE under single-pass mHC) bound from a random checkpoint and run
// as a chained stack on the host: the residual streams of a decode step equal those of a fresh
// prefill's last position, bit for bit, after all 40 blocks.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <filesystem>
#include <random>
#include <vector>

#include "dsv4/io/random_checkpoint.hpp"
#include "dsv4/model/block_reference.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/models/tiny.hpp"
#include "support/checkpoints.hpp"
#include "support/random.hpp"

using namespace dsv4;
using numerics::bf16;
using tiny = models::tiny;

namespace {

struct bound_blocks {
  std::vector<kernels::attention::layer_wiring> wiring;
  std::vector<model::block_weights> weights;
  std::vector<std::vector<float>> freqs;
};

//! Streams [n, 4, dim] of tokens first .. first + n - 1 through every block; pre-mixes start one-hot.
std::vector<bf16> run(const bound_blocks& b, std::vector<bf16> streams, int n, long long first,
                      kernels::attention::sequence_state& state) {
  constexpr auto shape = model::attention_shape<tiny>();
  std::vector<float> pre(std::size_t(n) * 4, 0.0f);
  for (int t = 0; t < n; ++t) pre[std::size_t(t) * 4] = 1.0f;
  for (int l = 0; l < int(b.wiring.size()); ++l)
    streams = model::block_forward_chunk(l, b.wiring[std::size_t(l)], b.weights[std::size_t(l)], shape,
                                         b.freqs[std::size_t(l)], streams, pre, first, state);
  return streams;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(block_stack)

BOOST_AUTO_TEST_CASE(decode_reproduces_prefill_through_every_block) {
  const test::temp_checkpoint tmp("blocks", models::checkpoint_schema<tiny>(), 21);
  io::checkpoint ck(tmp.dir);
  using sched = models::model_traits<tiny>::schedule;
  bound_blocks b;
  for (int l = 0; l < sched::num_layers; ++l) {
    b.wiring.push_back(model::attention_wiring<tiny>(l));
    b.weights.push_back(model::block_weights_of<tiny>(ck, l));
    b.freqs.push_back(model::attention_rope_frequencies<tiny>(l));
  }

  constexpr auto shape = model::attention_shape<tiny>();
  const int tokens = shape.window + 3;
  const std::size_t width = std::size_t(4) * shape.dim;
  auto rng = test::make_rng(81);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<bf16> x(std::size_t(tokens) * width);
  for (auto& v : x) v = bf16::from_float(n(rng));
  auto rows = [&](int first, int count) {
    return std::vector<bf16>(x.begin() + std::ptrdiff_t(first) * std::ptrdiff_t(width),
                             x.begin() + std::ptrdiff_t(first + count) * std::ptrdiff_t(width));
  };

  kernels::attention::sequence_state incremental, fresh;
  run(b, rows(0, tokens - 2), tokens - 2, 0, incremental);
  run(b, rows(tokens - 2, 1), 1, tokens - 2, incremental);
  const auto step = run(b, rows(tokens - 1, 1), 1, tokens - 1, incremental);
  const auto full = run(b, rows(0, tokens), tokens, 0, fresh);
  std::size_t differ = 0, nonfinite = 0, changed = 0;
  for (std::size_t i = 0; i < width; ++i) {
    const bf16 a = step[i], want = full[std::size_t(tokens - 1) * width + i];
    differ += a.bits != want.bits;
    nonfinite += !std::isfinite(a.to_float());
    changed += a.bits != x[std::size_t(tokens - 1) * width + i].bits;  // the blocks did transform the streams
  }
  BOOST_TEST(differ == 0u);
  BOOST_TEST(nonfinite == 0u);
  BOOST_TEST(changed > width / 2);
}

BOOST_AUTO_TEST_SUITE_END()
