// The host CSA2 attention sublayer (layer_reference.hpp) on a five-layer stack that has every
// role: a local layer, a ratio-2 owner + index source, a Reuse layer reading it, a ratio-1 owner
// that is the candidate source, and a Reindex layer. The decode path (window ring, compressor
// state, incremental caches, published top-k and pool) must reproduce the prefill: the output of
// a decode step at position p equals the last row of a fresh prefill of p + 1 tokens, bit for bit
// once the ring is full (the index lists are then identical), and within bf16 rounding before.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "dsv4/kernels/attention/layer_reference.hpp"
#include "dsv4/kernels/rope/rope.hpp"
#include "support/attention_stack.hpp"
#include "support/errors.hpp"
#include "support/random.hpp"

using namespace dsv4;
using namespace dsv4::kernels;
using attention::layer_shape;
using attention::layer_weights;
using attention::layer_wiring;
using numerics::bf16;
using schedule::attn_role;

namespace {

constexpr layer_shape shape = test::attention_stack_shape;
using stack = test::attention_stack_weights;
stack make_stack(std::mt19937_64& rng) { return test::make_attention_stack(rng); }

//! Every layer over rows [first, first + n) of x at start_pos = first; outputs per layer.
std::vector<std::vector<bf16>> run(const stack& st, const std::vector<bf16>& x, int first, int n,
                                   attention::sequence_state& state) {
  std::vector<std::vector<bf16>> outs;
  const auto rows = std::span<const bf16>(x).subspan(std::size_t(first) * shape.dim, std::size_t(n) * shape.dim);
  for (int l = 0; l < int(st.wiring.size()); ++l) {
    const auto& f = st.wiring[std::size_t(l)].ratio > 0 ? st.freqs_compressed : st.freqs_local;
    outs.push_back(attention::attention_layer_reference(l, st.wiring[std::size_t(l)], st.weights[std::size_t(l)], shape, f,
                                                        rows, first, state));
  }
  return outs;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(attention_layer)

BOOST_AUTO_TEST_CASE(decode_reproduces_prefill) {
  auto rng = test::make_rng(70);
  const stack st = make_stack(rng);
  constexpr int tokens = 28, first_decode = 3;
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<bf16> x(std::size_t(tokens) * shape.dim);
  for (auto& v : x) v = bf16::from_float(n(rng));

  attention::sequence_state incremental;
  run(st, x, 0, first_decode, incremental);
  for (int p = first_decode; p < tokens; ++p) {
    const auto step = run(st, x, p, 1, incremental);
    if (!(p <= 5 || p == 14 || p == 15 || p == 16 || p == 21 || p == tokens - 1)) continue;  // spot checks: prefills cost O(p)
    attention::sequence_state fresh;
    const auto full = run(st, x, 0, p + 1, fresh);
    for (std::size_t l = 0; l < step.size(); ++l) {
      double worst = 0, peak = 0;
      std::size_t differ = 0;
      for (int d = 0; d < shape.dim; ++d) {
        const double a = step[l][std::size_t(d)].to_float(), b = full[l][std::size_t(p) * shape.dim + d].to_float();
        BOOST_REQUIRE(std::isfinite(a));
        worst = std::max(worst, std::fabs(a - b));
        peak = std::max(peak, std::fabs(b));
        differ += step[l][std::size_t(d)].bits != full[l][std::size_t(p) * shape.dim + d].bits;
      }
      if (p >= shape.window - 1)
        BOOST_TEST(differ == 0u, "layer " << l << " position " << p << ": " << differ << " outputs differ from the prefill");
      else  // the ring's -1 slots sit first, the prefill's last: other 64-wide chunks, other bf16 roundings
        BOOST_TEST(worst <= peak * 0x1p-5, "layer " << l << " position " << p << ": worst " << worst << " of " << peak);
    }
  }
  // The selection binds at the end: more compressed entries than top-k, more blocks than the pool.
  BOOST_TEST(incremental.topk_width == shape.topk);
  BOOST_TEST(incremental.candidates_width == tokens);
  std::size_t kept = 0;
  for (auto c : incremental.candidates) kept += c;
  BOOST_TEST(kept == std::size_t(shape.pool_blocks * shape.pool_block));
}

BOOST_AUTO_TEST_CASE(misuse_is_an_error) {
  auto rng = test::make_rng(71);
  const stack st = make_stack(rng);
  std::vector<bf16> x(std::size_t(2) * shape.dim, bf16::from_float(0.5f));
  attention::sequence_state state;
  // A Reuse layer before its owner ran:
  BOOST_TEST(test::throws_with([&] {
    attention::attention_layer_reference(2, st.wiring[2], st.weights[2], shape, st.freqs_compressed, x, 0, state);
  }, "KV owner 1 has not run"));
}

// Exact mode: a chunk appended after the prefill gives, row for row, the bits that the decode
// steps of the same tokens give (chunks shorter and longer than the window, across ratio groups,
// with the top-k and the candidate pool binding).
BOOST_AUTO_TEST_CASE(appended_chunks_equal_token_by_token_decode) {
  auto rng = test::make_rng(72);
  const stack st = make_stack(rng);
  constexpr int tokens = 60;
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<bf16> x(std::size_t(tokens) * shape.dim);
  for (auto& v : x) v = bf16::from_float(n(rng));
  attention::sequence_state chunked, stepped;
  run(st, x, 0, 5, chunked);
  run(st, x, 0, 5, stepped);
  std::size_t compared = 0;
  for (const auto& [first, count] : std::vector<std::pair<int, int>>{{5, 3}, {8, 1}, {9, 20}, {29, 2}, {31, 29}}) {
    const auto chunk = run(st, x, first, count, chunked);
    for (int i = 0; i < count; ++i) {
      const auto step = run(st, x, first + i, 1, stepped);
      for (std::size_t l = 0; l < step.size(); ++l)
        for (int d = 0; d < shape.dim; ++d, ++compared)
          BOOST_REQUIRE_MESSAGE(chunk[l][std::size_t(i) * shape.dim + d].bits == step[l][std::size_t(d)].bits,
                                "layer " << l << " position " << first + i << " channel " << d);
    }
  }
  BOOST_TEST(compared == std::size_t(tokens - 5) * st.wiring.size() * shape.dim);
  BOOST_TEST(chunked.topk_width == shape.topk);
}

// CED at the layer level: the decoder's owner (layer 3 here, the ratio-1 candidate source) fills
// its cache over the whole prompt on its own, then layers 3.. replay the last rows. Replaying
// from position 0 is the plain prefill, bit for bit; replaying a suffix sees a window that starts
// at the replay start, and the decode steps after it run on the rings the replay left.
BOOST_AUTO_TEST_CASE(ced_owner_cache_and_replay) {
  auto rng = test::make_rng(73);
  const stack st = make_stack(rng);
  constexpr int tokens = 40, decoder = 3;
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<bf16> x(std::size_t(tokens + 2) * shape.dim);
  for (auto& v : x) v = bf16::from_float(n(rng));
  auto same_bits = [](const std::vector<bf16>& p, const std::vector<bf16>& q) {
    if (p.size() != q.size()) return false;
    for (std::size_t i = 0; i < p.size(); ++i)
      if (p[i].bits != q[i].bits) return false;
    return true;
  };
  auto rows = [&](int first, int count) {
    return std::span<const bf16>(x).subspan(std::size_t(first) * shape.dim, std::size_t(count) * shape.dim);
  };
  auto freqs = [&](int l) { return st.wiring[std::size_t(l)].ratio > 0 ? st.freqs_compressed : st.freqs_local; };
  auto ced = [&](attention::sequence_state& state, int prompt, int replay_from) {
    std::vector<std::vector<bf16>> outs;
    for (int l = 0; l < decoder; ++l)
      outs.push_back(attention::attention_layer_reference(l, st.wiring[std::size_t(l)], st.weights[std::size_t(l)], shape, freqs(l),
                                                          rows(0, prompt), 0, state));
    attention::attention_layer_reference(decoder, st.wiring[decoder], st.weights[decoder], shape, freqs(decoder), rows(0, prompt), 0,
                                         state, attention::layer_call::owner_cache_only);
    for (int l = decoder; l < int(st.wiring.size()); ++l)
      outs.push_back(attention::attention_layer_reference(l, st.wiring[std::size_t(l)], st.weights[std::size_t(l)], shape, freqs(l),
                                                          rows(replay_from, prompt - replay_from), replay_from, state,
                                                          attention::layer_call::replay));
    return outs;
  };
  // Replay from 0 = prefill.
  attention::sequence_state a, b;
  const auto full = run(st, x, 0, 30, a);
  const auto same = ced(b, 30, 0);
  for (std::size_t l = 0; l < full.size(); ++l) BOOST_TEST(same_bits(full[l], same[l]), "layer " << l);
  // Replay of the last `window` rows: the encoder half is the prefill's; the decoder rows see a
  // window truncated at the replay start, so they differ, except the first row, whose window is
  // itself in both.
  attention::sequence_state c, d;
  const int replay_from = tokens - shape.window;
  const auto exact = run(st, x, 0, tokens, c);
  const auto replay = ced(d, tokens, replay_from);
  for (int l = 0; l < decoder; ++l) BOOST_TEST(same_bits(exact[std::size_t(l)], replay[std::size_t(l)]), "encoder layer " << l);
  for (int l = decoder; l < int(st.wiring.size()); ++l) {
    BOOST_REQUIRE_EQUAL(replay[std::size_t(l)].size(), std::size_t(shape.window) * shape.dim);
    std::size_t differ = 0;
    for (std::size_t i = 0; i < replay[std::size_t(l)].size(); ++i)
      differ += replay[std::size_t(l)][i].bits != exact[std::size_t(l)][std::size_t(replay_from) * shape.dim + i].bits;
    BOOST_TEST(differ > 0u, "decoder layer " << l << " replays a truncated window");
  }
  BOOST_TEST(d.owners.at(decoder).main.size() == c.owners.at(decoder).main.size());  // the whole prompt's entries
  BOOST_TEST(same_bits(d.owners.at(decoder).main, c.owners.at(decoder).main));
  // Decode after the replay runs on the rings it left; the owner's cache keeps growing.
  for (int p = tokens; p < tokens + 2; ++p)
    for (const auto& o : run(st, x, p, 1, d))
      for (bf16 v : o) BOOST_REQUIRE(std::isfinite(v.to_float()));
  BOOST_TEST(d.owners.at(decoder).main.size() == std::size_t(tokens + 2) * shape.head_dim);
}

BOOST_AUTO_TEST_SUITE_END()
