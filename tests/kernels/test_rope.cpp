// RoPE (kernels/rope/rope.hpp): the YaRN table of the spec, the pair convention, inversion.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "dsv4/kernels/rope/rope.hpp"
#include "dsv4/models/v41_flash.hpp"
#include "support/random.hpp"

using namespace dsv4;
using namespace dsv4::kernels::rope;
using numerics::bf16;

namespace {
rope_params compressed_v41() {
  const auto& r = models::v41_flash::dims.rope;
  return {models::v41_flash::dims.attn.rope_head_dim, r.compress_rope_theta, r.original_seq_len, r.rope_factor,
          r.beta_fast, r.beta_slow};
}
}  // namespace

BOOST_AUTO_TEST_SUITE(rope)

BOOST_AUTO_TEST_CASE(yarn_range_and_frequencies_follow_the_spec) {
  const rope_params p = compressed_v41();
  const yarn_range r = yarn_correction_range(p);
  BOOST_TEST(r.low == 15);  // spec §1.3: cd(32) = 15.45 -> 15, cd(1) = 24.71 -> 25
  BOOST_TEST(r.high == 25);
  const auto f = frequencies(p);
  BOOST_REQUIRE(f.size() == 32u);
  for (int k = 0; k < 32; ++k) {
    const double plain = std::pow(160000.0, -2.0 * k / 64.0);
    const double ramp = std::clamp((k - 15) / 10.0, 0.0, 1.0);
    const double want = plain / 16 * ramp + plain * (1 - ramp);
    BOOST_TEST(std::fabs(f[k] - want) <= 4e-7 * want, "pair " << k << ": " << f[k] << " vs " << want);
  }
  // Ratio-0 layers: base 10000, no YaRN.
  const auto g = frequencies({64, 10000.0f, 0, 1, 32, 1});
  BOOST_TEST(g[0] == 1.0f);
  for (int k = 1; k < 32; ++k) BOOST_TEST(std::fabs(g[k] - std::pow(10000.0, -2.0 * k / 64.0)) <= 4e-7 * g[k]);
}

BOOST_AUTO_TEST_CASE(pairs_are_interleaved_in_the_last_channels) {
  const std::vector<float> f = {0.5f, 0.25f};
  std::vector<bf16> x(6, bf16::from_float(0.0f));
  x[0] = bf16::from_float(3.0f);  // outside the RoPE channels: untouched
  x[2] = bf16::from_float(1.0f);  // pair 0 = (x[2], x[3]) = (1, 0)
  x[4] = bf16::from_float(0.0f);  // pair 1 = (x[4], x[5]) = (0, 1)
  x[5] = bf16::from_float(1.0f);
  const std::vector<std::int64_t> pos = {2};
  apply_rope_reference(x, 6, 1, pos, f, false);
  BOOST_TEST(x[0].to_float() == 3.0f);
  BOOST_TEST(x[2].to_float() == bf16::from_float(std::cos(1.0f)).to_float());   // angle 2 * 0.5
  BOOST_TEST(x[3].to_float() == bf16::from_float(std::sin(1.0f)).to_float());
  BOOST_TEST(x[4].to_float() == bf16::from_float(-std::sin(0.5f)).to_float());  // (0 + i) * e^{0.5 i}
  BOOST_TEST(x[5].to_float() == bf16::from_float(std::cos(0.5f)).to_float());
}

BOOST_AUTO_TEST_CASE(position_zero_is_identity_and_inverse_undoes) {
  auto rng = test::make_rng(40);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const auto f = frequencies(compressed_v41());
  std::vector<bf16> x(3 * 4 * 512);
  for (auto& v : x) v = bf16::from_float(n(rng));
  const std::vector<std::int64_t> pos = {0, 1000, 1048575};
  std::vector<bf16> y = x;
  apply_rope_reference(y, 512, 4, pos, f, false);
  for (int i = 0; i < 4 * 512; ++i) BOOST_TEST(y[i].bits == x[i].bits);  // position 0
  for (int v = 0; v < 12; ++v)
    for (int c = 0; c < 448; ++c) BOOST_TEST(y[v * 512 + c].bits == x[v * 512 + c].bits);  // no-RoPE channels
  apply_rope_reference(y, 512, 4, pos, f, true);
  // Rotation errors scale with the pair's norm: two bf16 roundings of each coordinate.
  for (std::size_t i = 0; i < x.size(); i += 2) {
    const float norm = std::hypot(x[i].to_float(), x[i + 1].to_float());
    for (std::size_t j : {i, i + 1})
      BOOST_TEST(std::fabs(x[j].to_float() - y[j].to_float()) <= norm / 64 + 1e-6f, "value " << j);
  }
}

BOOST_AUTO_TEST_CASE(bad_shapes_are_errors) {
  const std::vector<float> f(32, 1.0f);
  const std::vector<std::int64_t> pos = {0};
  std::vector<bf16> x(100);
  BOOST_CHECK_THROW(apply_rope_reference(x, 64, 1, pos, f, false), dsv4::error);  // 100 values != 1 x 1 x 64
  std::vector<bf16> y(32);
  BOOST_CHECK_THROW(apply_rope_reference(y, 32, 1, pos, f, false), dsv4::error);   // dim < rope_dim
  BOOST_CHECK_THROW(frequencies({63, 10000.0f, 0, 1, 32, 1}), dsv4::error);
}

BOOST_AUTO_TEST_SUITE_END()
