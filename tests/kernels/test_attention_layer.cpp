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

constexpr layer_shape shape{.dim = 256, .heads = 4, .head_dim = 128, .rope_dim = 32, .q_lora = 64, .groups = 2,
                            .o_lora = 64, .window = 16, .index_heads = 4, .index_dim = 64, .topk = 8,
                            .pool_blocks = 3, .pool_block = 4};

struct stack {
  std::vector<layer_wiring> wiring;
  std::vector<layer_weights> weights;
  std::vector<float> freqs_local, freqs_compressed;
};

attention::fp8_linear random_fp8(int n, int k, std::mt19937_64& rng) {
  attention::fp8_linear l{n, k, std::vector<std::uint8_t>(std::size_t(n) * k),
                          std::vector<std::uint8_t>(std::size_t((n + 31) / 32) * (k / 32))};
  for (auto& c : l.codes) {
    c = std::uint8_t(rng());
    if ((c & 0x7F) == 0x7F) c = 0x38;
  }
  for (auto& c : l.scales) c = std::uint8_t(115 + rng() % 3);  // about 2^-11: outputs of order 1
  return l;
}

std::vector<float> random_values(std::size_t n, float scale, std::mt19937_64& rng, bool as_bf16 = true) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = as_bf16 ? bf16::from_float(d(rng)).to_float() : d(rng);
  return v;
}

stack make_stack(std::mt19937_64& rng) {
  stack st;
  st.wiring = {{attn_role::local, 0, -1, false},
               {attn_role::full, 2, 1, false},
               {attn_role::reuse, 2, 1, false},
               {attn_role::full, 1, 3, true},
               {attn_role::reindex, 1, 3, false}};
  const auto& s = shape;
  for (const auto& wr : st.wiring) {
    layer_weights w;
    w.wq_a = random_fp8(s.q_lora, s.dim, rng);
    w.wq_b = random_fp8(s.heads * s.head_dim, s.q_lora, rng);
    w.wkv = random_fp8(s.head_dim, s.dim, rng);
    w.wo_b = random_fp8(s.dim, s.groups * s.o_lora, rng);
    w.q_norm.assign(std::size_t(s.q_lora), 1.0f);
    w.kv_norm.assign(std::size_t(s.head_dim), 1.0f);
    w.wo_a = random_values(std::size_t(s.groups) * s.o_lora * (s.heads / s.groups) * s.head_dim, 0.03f, rng);
    w.attn_sink = random_values(std::size_t(s.heads), 1.0f, rng, false);
    if (wr.role == attn_role::full) {
      w.compressor.dim = s.dim;
      w.compressor.head_dim = s.head_dim;
      w.compressor.ratio = wr.ratio;
      w.compressor.wkv = random_values(std::size_t(s.head_dim) * s.dim, 0.06f, rng, wr.ratio == 1);
      if (wr.ratio > 1) w.compressor.wgate = random_values(std::size_t(s.head_dim) * s.dim, 0.06f, rng, false);
      w.compressor.norm.assign(std::size_t(s.head_dim), 1.0f);
      w.index_key.index_dim = s.index_dim;
      w.index_key.wk = random_values(std::size_t(s.index_dim) * s.head_dim, 0.09f, rng);
      w.index_key.norm.assign(std::size_t(s.index_dim), 1.0f);
    }
    if (wr.role == attn_role::full || wr.role == attn_role::reindex) {
      w.idx_wq_b = random_fp8(s.index_heads * s.index_dim, s.q_lora, rng);
      w.weights_proj = random_values(std::size_t(s.index_heads) * s.dim, 0.06f, rng);
    }
    st.weights.push_back(std::move(w));
  }
  st.freqs_local = rope::frequencies({shape.rope_dim, 10000.0f});
  st.freqs_compressed = rope::frequencies({shape.rope_dim, 160000.0f, 65536, 16.0f, 32.0f, 1.0f});
  return st;
}

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
  // Two tokens after the prefill:
  BOOST_TEST(test::throws_with([&] {
    attention::attention_layer_reference(0, st.wiring[0], st.weights[0], shape, st.freqs_local, x, 5, state);
  }, "one token per call"));
}

BOOST_AUTO_TEST_SUITE_END()
