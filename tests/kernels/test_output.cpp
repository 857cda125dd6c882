// Attention output path (spec §5): inverse RoPE, block-diagonal grouped wo_a, FP8 wo_b.

#include <boost/test/unit_test.hpp>

#include <random>
#include <vector>

#include "dsv4/kernels/output/reference.hpp"
#include "support/random.hpp"

using namespace dsv4;
using namespace dsv4::kernels;
using numerics::bf16;

namespace {
const output::output_shape shape{8, 64, 2, 32, 64};  // 8 heads of 64 in 2 groups, o_lora 32, dim 64

std::vector<float> random_bf16_values(std::mt19937_64& rng, std::size_t n, float sigma) {
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = numerics::round_to_bf16(d(rng));
  return v;
}
}  // namespace

BOOST_AUTO_TEST_SUITE(output_path)

// Group g's outputs depend only on heads g*4 .. g*4+3, and wo_a's block g maps to columns g*32 + r.
BOOST_AUTO_TEST_CASE(grouped_projection_is_block_diagonal) {
  auto rng = test::make_rng(120);
  const auto wo_a = random_bf16_values(rng, std::size_t(2) * 32 * 256, 0.06f);
  std::vector<bf16> o(8 * 64);
  for (auto& v : o) v = bf16::from_float(std::normal_distribution<float>(0, 1)(rng));
  const auto y = output::grouped_projection_reference(shape, o, wo_a);
  BOOST_REQUIRE(y.size() == 64u);
  std::vector<bf16> o2 = o;
  for (int i = 256; i < 512; ++i) o2[std::size_t(i)] = bf16::from_float(0.0f);  // silence group 1's heads
  const auto y2 = output::grouped_projection_reference(shape, o2, wo_a);
  for (int r = 0; r < 32; ++r) BOOST_TEST(y2[std::size_t(r)].bits == y[std::size_t(r)].bits);  // group 0 untouched
  for (int r = 32; r < 64; ++r) BOOST_TEST(y2[std::size_t(r)].to_float() == 0.0f);              // group 1 silent
  // Column g * 32 + r is row r of block g.
  double dot = 0;
  for (int i = 0; i < 256; ++i) dot += double(o[256 + std::size_t(i)].to_float()) * wo_a[std::size_t(1) * 32 * 256 + 5 * 256 + std::size_t(i)];
  BOOST_TEST(y[37].bits == bf16::from_float(float(dot)).bits);
  BOOST_CHECK_THROW(output::grouped_projection_reference({6, 64, 4, 32, 64}, o, wo_a), dsv4::error);
}

// The inverse RoPE undoes the forward rotation of the heads' last channels before the projection.
BOOST_AUTO_TEST_CASE(output_unrotates_at_the_query_position) {
  auto rng = test::make_rng(121);
  const auto freqs = rope::frequencies({32, 160000.0f, 65536, 16.0f, 32.0f, 1.0f});
  const auto wo_a = random_bf16_values(rng, std::size_t(2) * 32 * 256, 0.06f);
  std::vector<std::uint8_t> wo_b(std::size_t(64) * 64), wo_b_scale(2 * 2, 127 - 4);
  for (auto& c : wo_b) c = std::uint8_t(rng() % 0x7E) | std::uint8_t(rng() % 2 ? 0x80 : 0);
  std::vector<bf16> o(8 * 64);
  for (auto& v : o) v = bf16::from_float(std::normal_distribution<float>(0, 1)(rng));
  const auto at0 = output::attention_output_reference(shape, o, 0, freqs, wo_a, wo_b, wo_b_scale);
  // Position 0 does not rotate: the result is the plain projection of o.
  const auto mid = output::grouped_projection_reference(shape, o, wo_a);
  std::vector<std::uint8_t> codes(64), scales(2);
  numerics::quantize_vector<numerics::fp8_act_format>(mid, codes, scales);
  const auto want = gemm::fp8_gemm_reference({1, 64, 64}, codes, scales, wo_b, wo_b_scale);
  for (int i = 0; i < 64; ++i) BOOST_TEST(at0[std::size_t(i)].bits == want[std::size_t(i)].bits);
  // At position 77 the output of o rotated forward by 77 is close to the output of o at position 0.
  std::vector<bf16> rotated = o;
  const std::int64_t pos[1] = {77};
  rope::apply_rope_reference(rotated, 64, 8, pos, freqs, false);
  const auto at77 = output::attention_output_reference(shape, rotated, 77, freqs, wo_a, wo_b, wo_b_scale);
  double num = 0, den = 0;
  for (int i = 0; i < 64; ++i) {
    num += std::pow(double(at77[std::size_t(i)].to_float()) - at0[std::size_t(i)].to_float(), 2);
    den += std::pow(double(at0[std::size_t(i)].to_float()), 2);
  }
  BOOST_TEST(std::sqrt(num / den) < 0.05);  // two bf16 roundings of the rotated channels and FP8 re-quantization
}

BOOST_AUTO_TEST_SUITE_END()
