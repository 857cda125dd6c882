// Attention output path (spec §5): inverse RoPE, block-diagonal grouped wo_a, FP8 wo_b.

#include <boost/test/unit_test.hpp>

#include <limits>
#include <random>
#include <vector>

#include "dsv4/kernels/output/reference.hpp"
#include "dsv4/kernels/output/wo_a_fp8.hpp"
#include "dsv4/numerics/minifloat.hpp"
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

// wo_a's FP8 form (wo_a_fp8.hpp): the dequantized values of FP8 codes with 32 x 32 or 128 x 128
// UE8M0 tiles (as the checkpoint holds them and attention_weights.hpp rounds their products to
// bf16) come back exactly as codes times one scale per 32 x 32 tile, E4M3 subnormals and zeros
// included; values with no such form give none.
BOOST_AUTO_TEST_CASE(wo_a_fp8_form_is_exact_or_absent) {
  auto rng = test::make_rng(121);
  for (const int tile : {32, 128}) {
    const int rows = 256, cols = 384;
    std::vector<float> v(std::size_t(rows) * cols);
    std::vector<std::uint8_t> scales(std::size_t(rows / tile) * (cols / tile));
    for (auto& s : scales) s = std::uint8_t(100 + rng() % 40);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        std::uint8_t code = std::uint8_t(rng() % 0x7F) | std::uint8_t(rng() % 2 ? 0x80 : 0);  // never NaN
        if (rng() % 16 == 0) code &= 0x87;                                                     // a subnormal or zero
        const float scale = numerics::decode<numerics::ue8m0>(scales[std::size_t(r / tile) * (cols / tile) + c / tile]);
        v[std::size_t(r) * cols + c] = numerics::round_to_bf16(numerics::mul_rn(numerics::decode<numerics::e4m3>(code), scale));
      }
    const auto f8 = output::exact_fp8_tiles(v, rows, cols);
    BOOST_TEST_REQUIRE(f8.has_value());
    std::size_t differ = 0;
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        const std::size_t i = std::size_t(r) * cols + c;
        const float scale = numerics::decode<numerics::ue8m0>(f8->scales[std::size_t(r / 32) * (cols / 32) + c / 32]);
        differ += numerics::decode<numerics::e4m3>(f8->codes[i]) * scale != v[i];
      }
    BOOST_TEST(differ == 0u, differ << " values differ (tiles of " << tile << ")");
  }
  // An all-zero tile: scale 2^0, zero codes.
  std::vector<float> z(32 * 32, 0.0f);
  const auto fz = output::exact_fp8_tiles(z, 32, 32);
  BOOST_TEST_REQUIRE(fz.has_value());
  BOOST_TEST(fz->scales[0] == 127u);
  // 1 + 2^-7 needs seven mantissa bits: no E4M3 form beside 448 in its tile.
  std::vector<float> w(32 * 32, 1.0f);
  w[5] = 1.0f + 0x1p-7f;
  BOOST_TEST(!output::exact_fp8_tiles(w, 32, 32).has_value());
  // A tile spanning more than E4M3's range (448 and 2^-10 * 448 / 448 ... below its smallest step).
  w.assign(32 * 32, 448.0f);
  w[7] = 0x1p-10f;
  BOOST_TEST(!output::exact_fp8_tiles(w, 32, 32).has_value());
  w[7] = 0x1p-9f;  // the smallest E4M3 subnormal at scale 2^0
  BOOST_TEST(output::exact_fp8_tiles(w, 32, 32).has_value());
  // The bottom of the scale's range: every E4M3 value times 2^-127 (scale code 0), down to fp32
  // subnormals (2^-136), comes back exactly.
  std::vector<float> low(32 * 32);
  for (std::size_t i = 0; i < low.size(); ++i)
    low[i] =
        std::ldexp(numerics::decode<numerics::e4m3>(std::uint8_t(i % 0x7F)), -127) * (i % 2 ? -1.0f : 1.0f);
  const auto fl = output::exact_fp8_tiles(low, 32, 32);
  BOOST_TEST_REQUIRE(fl.has_value());
  BOOST_TEST(fl->scales[0] == 0u);
  std::size_t low_differ = 0;
  for (std::size_t i = 0; i < low.size(); ++i)
    low_differ += std::ldexp(numerics::decode<numerics::e4m3>(fl->codes[i]), -127) != low[i];
  BOOST_TEST(low_differ == 0u, low_differ << " values at scale 2^-127 differ");
  // Shapes that are not whole tiles, and non-finite values, have none.
  BOOST_TEST(!output::exact_fp8_tiles(std::vector<float>(48 * 32, 1.0f), 48, 32).has_value());
  w[9] = std::numeric_limits<float>::infinity();
  BOOST_TEST(!output::exact_fp8_tiles(w, 32, 32).has_value());
}

BOOST_AUTO_TEST_SUITE_END()
