// Single-pass mHC composition and MoE routing / combination host references (spec §8, §9).

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "dsv4/kernels/mhc/reference.hpp"
#include "dsv4/kernels/moe/reference.hpp"
#include "support/random.hpp"

using namespace dsv4;
using namespace dsv4::kernels;
using numerics::bf16;

namespace {
std::vector<bf16> random_bf16(std::mt19937_64& rng, std::size_t n, float sigma = 1.0f) {
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<bf16> v(n);
  for (auto& x : v) x = bf16::from_float(d(rng));
  return v;
}
mhc::mix_params random_mix(std::mt19937_64& rng, int dim) {
  std::normal_distribution<float> d(0.0f, 0.05f);
  mhc::mix_params p;
  p.fn.resize(std::size_t(24) * 4 * dim);
  for (auto& v : p.fn) v = d(rng);
  p.base.resize(24);
  for (auto& v : p.base) v = 10 * d(rng);
  p.scale = {1.0f, 0.5f, 2.0f};
  return p;
}
}  // namespace

BOOST_AUTO_TEST_SUITE(mhc_reference)

BOOST_AUTO_TEST_CASE(pre_and_post_edge_cases) {
  auto rng = test::make_rng(100);
  const int dim = 64;
  const auto x = random_bf16(rng, 4 * dim);
  float one_hot[4];
  mhc::identity_pre_mix(one_hot);
  const auto y = mhc::hc_pre(x, dim, one_hot);  // layer 0: stream 0 exactly
  for (int d = 0; d < dim; ++d) BOOST_TEST(y[d].bits == x[d].bits);
  mhc::coefficients c{};
  for (int i = 0; i < 4; ++i) c.comb[i * 4 + i] = 1.0f;  // identity mixing, no sublayer contribution
  const auto f = random_bf16(rng, dim);
  const auto z = mhc::hc_post(f, x, dim, c);
  for (std::size_t i = 0; i < x.size(); ++i) BOOST_TEST(z[i].bits == x[i].bits);
  c.post[2] = 2.0f;  // stream 2 also receives 2 F
  const auto w = mhc::hc_post(f, x, dim, c);
  for (int d = 0; d < dim; ++d)
    BOOST_TEST(w[2 * dim + d].bits == bf16::from_float(2.0f * f[d].to_float() + x[2 * dim + d].to_float()).bits);
}

// The mixes see the streams only through x / rms(x): doubling every stream changes nothing, bit for bit.
// (The order "project, then multiply by the token's rsqrt" is checked in mixes_follow_the_spec_order.)
BOOST_AUTO_TEST_CASE(mixes_are_scale_invariant) {
  auto rng = test::make_rng(101);
  const int dim = 32;
  const auto p = random_mix(rng, dim);
  auto x = random_bf16(rng, 4 * dim);
  const auto a = mhc::hc_coefficients(x, dim, p);
  for (auto& v : x) v = bf16::from_float(2.0f * v.to_float());
  const auto b = mhc::hc_coefficients(x, dim, p);
  for (int i = 0; i < 4; ++i) BOOST_TEST(a.pre[i] == b.pre[i]);
  for (int i = 0; i < 16; ++i) BOOST_TEST(a.comb[i] == b.comb[i]);
  for (int i = 0; i < 4; ++i) BOOST_TEST((a.pre[i] > 0.0f && a.pre[i] <= 1.0f + 1e-6f && a.post[i] >= 0.0f && a.post[i] <= 2.0f));
}

// Spec §8: m = fp32(x . fn^T) * rsqrt(mean(x^2) + eps); with a single nonzero fn row the pre
// coefficient of stream 0 is sigmoid(m0 * scale0 + base0) + eps, computable by hand.
BOOST_AUTO_TEST_CASE(mixes_follow_the_spec_order) {
  const int dim = 4;
  mhc::mix_params p;
  p.fn.assign(std::size_t(24) * 4 * dim, 0.0f);
  p.fn[0] = 0.5f;  // m0 = 0.5 * x[0] * rsqrt(mean x^2)
  p.base.assign(24, 0.0f);
  p.scale = {1.0f, 1.0f, 1.0f};
  std::vector<bf16> x(4 * dim, bf16::from_float(0.0f));
  x[0] = bf16::from_float(2.0f);
  x[5] = bf16::from_float(2.0f);  // mean of squares over 16 values = 8 / 16 = 0.5
  const auto c = mhc::hc_coefficients(x, dim, p);
  const float m0 = (0.5f * 2.0f) * (1.0f / std::sqrt(0.5f + 1e-20f));
  BOOST_TEST(c.pre[0] == 1.0f / (1.0f + std::exp(-m0)) + 1e-6f);
  BOOST_TEST(c.pre[1] == 0.5f + 1e-6f);  // m1 = 0: sigmoid(0) + eps
}

// Spec §8: attention reads hc_pre(X, previous pre), the FFN reads hc_pre(X1, this block's attention
// pre), and the block hands its FFN pre to the next block.
BOOST_AUTO_TEST_CASE(block_forward_consumes_the_previous_sublayers_pre) {
  auto rng = test::make_rng(102);
  const int dim = 32;
  const auto am = random_mix(rng, dim), fm = random_mix(rng, dim);
  const auto x = random_bf16(rng, 4 * dim);
  float pre[4];
  mhc::identity_pre_mix(pre);
  std::vector<bf16> attn_in, ffn_in;
  const mhc::sublayer attn = [&](std::span<const bf16> in) { attn_in.assign(in.begin(), in.end()); return std::vector<bf16>(in.begin(), in.end()); };
  const mhc::sublayer ffn = [&](std::span<const bf16> in) { ffn_in.assign(in.begin(), in.end()); return std::vector<bf16>(in.size(), bf16::from_float(0.25f)); };
  const auto out = mhc::block_forward(x, dim, pre, am, fm, attn, ffn);
  for (int d = 0; d < dim; ++d) BOOST_TEST(attn_in[d].bits == x[d].bits);  // one-hot pre at layer 0
  const auto a = mhc::hc_coefficients(x, dim, am);
  const auto x1 = mhc::hc_post(attn_in, x, dim, a);
  const auto want_ffn_in = mhc::hc_pre(x1, dim, a.pre);
  for (int d = 0; d < dim; ++d) BOOST_TEST(ffn_in[d].bits == want_ffn_in[d].bits);
  const auto f = mhc::hc_coefficients(x1, dim, fm);
  for (int c = 0; c < 4; ++c) BOOST_TEST(pre[c] == f.pre[c]);
  const auto want_out = mhc::hc_post(std::vector<bf16>(dim, bf16::from_float(0.25f)), x1, dim, f);
  BOOST_REQUIRE(out.size() == want_out.size());
  for (std::size_t i = 0; i < out.size(); ++i) BOOST_TEST(out[i].bits == want_out[i].bits);
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(moe_reference)

// The bias only picks the experts; the weights are the unbiased scores, normalized, times 1.5.
BOOST_AUTO_TEST_CASE(gate_bias_selects_unbiased_scores_weigh) {
  moe::gate_params g;
  g.experts = 4;
  g.k = 2;
  g.dim = 2;
  g.weight = {1, 0, 0, 1, 2, 0, 0, 0};  // expert logits = x0, x1, 2 x0, 0
  g.bias = {0.0f, 10.0f, 0.0f, 0.0f};   // expert 1 is forced in by its bias
  const std::vector<bf16> x = {bf16::from_float(1.0f), bf16::from_float(-3.0f)};
  const auto r = moe::route_reference(x, g);
  BOOST_TEST(r.experts == (std::vector<int>{1, 2}), boost::test_tools::per_element());
  const float s1 = std::sqrt(std::log1p(std::exp(-3.0f))), s2 = std::sqrt(std::log1p(std::exp(2.0f)));
  BOOST_TEST(std::fabs(r.weights[0] - 1.5f * s1 / (s1 + s2)) < 1e-6f);
  BOOST_TEST(std::fabs(r.weights[1] - 1.5f * s2 / (s1 + s2)) < 1e-6f);
  BOOST_TEST(moe::softplus_torch(25.0f) == 25.0f);  // PyTorch's threshold: linear above 20
  BOOST_TEST(moe::softplus_torch(20.0f) == std::log1p(std::exp(20.0f)));
  g.k = 5;
  BOOST_CHECK_THROW(moe::route_reference(x, g), dsv4::error);
}

// NaN biased scores rank as torch.topk ranks them (NaN above +inf, NaNs tie, -0 below +0), ties go
// to the lower expert id, and the CUDA route kernel uses the same key (numerics::topk_order_key).
BOOST_AUTO_TEST_CASE(gate_ranks_nan_first_like_torch_topk) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const auto key = dsv4::numerics::topk_order_key;
  BOOST_TEST(key(nan) == key(-nan));
  BOOST_TEST(key(nan) > key(inf));
  BOOST_TEST(key(inf) > key(1.0f));
  BOOST_TEST(key(1.0f) > key(0x1p-149f));
  BOOST_TEST(key(0x1p-149f) > key(0.0f));
  BOOST_TEST(key(0.0f) > key(-0.0f));  // as torch.topk on CUDA (biased scores are never -0)
  BOOST_TEST(key(-0.0f) > key(-0x1p-149f));
  BOOST_TEST(key(-0x1p-149f) > key(-1.0f));
  BOOST_TEST(key(-1.0f) > key(-inf));
  BOOST_TEST(key(-inf) > 0u);  // 0 is free: the CUDA kernel marks chosen experts with it

  moe::gate_params g;
  g.experts = 4;
  g.k = 2;
  g.dim = 2;
  g.weight = {1, 0, 0, 1, 2, 0, 0, 0};  // expert logits = x0, x1, 2 x0, 0
  g.bias = {0.0f, 0.0f, nan, 0.0f};     // a NaN bias picks its expert first; its weight stays finite
  const std::vector<bf16> x = {bf16::from_float(1.0f), bf16::from_float(-3.0f)};
  auto r = moe::route_reference(x, g);
  BOOST_TEST(r.experts == (std::vector<int>{2, 0}), boost::test_tools::per_element());
  const float s0 = std::sqrt(std::log1p(std::exp(1.0f))), s2 = std::sqrt(std::log1p(std::exp(2.0f)));
  BOOST_TEST(std::fabs(r.weights[0] - 1.5f * s2 / (s2 + s0)) < 1e-6f);
  BOOST_TEST(std::fabs(r.weights[1] - 1.5f * s0 / (s2 + s0)) < 1e-6f);
  g.bias = {0.0f, inf, nan, 0.0f};  // NaN above +inf
  r = moe::route_reference(x, g);
  BOOST_TEST(r.experts == (std::vector<int>{2, 1}), boost::test_tools::per_element());
  g.bias = {0.0f, nan, 0.0f, nan};  // NaNs tie: the lower id first, then the best number
  g.k = 3;
  r = moe::route_reference(x, g);
  BOOST_TEST(r.experts == (std::vector<int>{1, 3, 2}), boost::test_tools::per_element());
  // A NaN in x makes every logit NaN: a full tie, so experts 0, 1, 2, with NaN weights.
  g.bias = {0.0f, 0.0f, 0.0f, 0.0f};
  r = moe::route_reference(std::vector<bf16>{bf16::from_float(nan), bf16::from_float(1.0f)}, g);
  BOOST_TEST(r.experts == (std::vector<int>{0, 1, 2}), boost::test_tools::per_element());
  for (float w : r.weights) BOOST_TEST(std::isnan(w));
  // Equal numbers tie the same way: a zero gate gives every expert sqrt(log 2).
  g.weight.assign(8, 0.0f);
  r = moe::route_reference(x, g);
  BOOST_TEST(r.experts == (std::vector<int>{0, 1, 2}), boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(expert_activation_clamps) {
  const std::vector<bf16> g = {bf16::from_float(50.0f), bf16::from_float(-50.0f), bf16::from_float(1.0f)};
  const std::vector<bf16> u = {bf16::from_float(20.0f), bf16::from_float(1.0f), bf16::from_float(-30.0f)};
  const auto h = moe::expert_activation(g, u, 0.5f, 10.0f);
  BOOST_TEST(h[0].to_float() == bf16::from_float(0.5f * (10.0f / (1 + std::exp(-10.0f)) * 10.0f)).to_float());  // both clamped
  BOOST_TEST(std::fabs(h[1].to_float()) < 1e-15f);  // the gate has no lower clamp: silu(-50) ~ 0
  BOOST_TEST(h[2].to_float() == bf16::from_float(0.5f * (1.0f / (1 + std::exp(-1.0f)) * -10.0f)).to_float());
}

// Ascending expert id, then the shared expert, one rounding. The order shows in the fp32 sum:
// 2^24 (expert 1) + 1 (expert 5) + 1 (expert 9) is 2^24 when 2^24 comes first (each 1 is a tie that
// rounds to even) but 2^24 + 2 in top-k rank order (9, 5, 1).
BOOST_AUTO_TEST_CASE(combine_adds_in_ascending_expert_order) {
  const std::vector<int> experts = {9, 5, 1};  // top-k rank order
  const std::vector<std::vector<bf16>> outputs = {{bf16::from_float(1.0f)}, {bf16::from_float(1.0f)}, {bf16::from_float(16777216.0f)}};
  const std::vector<bf16> shared = {bf16::from_float(0.0f)};
  BOOST_TEST(moe::combine_fp32(experts, outputs, shared)[0] == 16777216.0f);
  const std::vector<bf16> one = {bf16::from_float(3.0f)};
  BOOST_TEST(moe::combine_reference({4}, {{bf16::from_float(2.0f)}}, one)[0].to_float() == 5.0f);
  BOOST_CHECK_THROW(moe::combine_reference({1, 2}, {{bf16::from_float(1.0f)}}, one), dsv4::error);
}

BOOST_AUTO_TEST_SUITE_END()
