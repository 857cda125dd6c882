// mHC split + Sinkhorn and the block-scaled GEMMs against the official vectors (issue 4 pieces).

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <vector>

#include "dsv4/io/safetensors.hpp"
#include "dsv4/kernels/gemm/reference.hpp"
#include "dsv4/kernels/gemm/weight_tiles.hpp"
#include "dsv4/kernels/mhc/sinkhorn.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.hpp"
#include "support/data.hpp"
#include "support/errors.hpp"
#include "support/random.hpp"

using namespace dsv4;
using numerics::bf16;

BOOST_AUTO_TEST_SUITE(mhc_gemm)

BOOST_AUTO_TEST_CASE(sinkhorn_matches_the_official_vectors) {
  io::safetensors_file f(test::data_path("reference/sinkhorn.safetensors"));
  const auto mixes = io::copy_as<float>(f.tensor("mixes", io::st_dtype::F32, {256, 24}));
  const auto scale = io::copy_as<float>(f.tensor("hc_scale", io::st_dtype::F32, {3}));
  const auto base = io::copy_as<float>(f.tensor("hc_base", io::st_dtype::F32, {24}));
  const auto pre = io::copy_as<float>(f.tensor("pre")), post = io::copy_as<float>(f.tensor("post"));
  const auto comb = io::copy_as<float>(f.tensor("comb", io::st_dtype::F32, {256, 4, 4}));
  double worst = 0;
  int exact = 0;
  for (int t = 0; t < 256; ++t) {
    float p[4], q[4], c[16];
    kernels::mhc::split_sinkhorn(&mixes[std::size_t(t) * 24], scale.data(), base.data(), 20, 1e-6f, p, q, c);
    for (int i = 0; i < 4; ++i) {
      worst = std::max(worst, std::fabs(double(p[i]) - pre[t * 4 + i]) / std::fabs(pre[t * 4 + i]));
      worst = std::max(worst, std::fabs(double(q[i]) - post[t * 4 + i]) / std::max(1e-30, double(std::fabs(post[t * 4 + i]))));
    }
    for (int i = 0; i < 16; ++i) {
      const double w = comb[std::size_t(t) * 16 + i];
      worst = std::max(worst, std::fabs(double(c[i]) - w) / std::fabs(w));
      exact += c[i] == float(w);
    }
  }
  BOOST_TEST_MESSAGE("sinkhorn vs reference: worst relative error " << worst << ", " << exact << " of 4096 comb values exact");
  BOOST_TEST(worst < 2e-6);  // last-ulp fp32 differences from exp, compounded over 20 iterations
  // The balanced matrix: columns sum to ~1 (the loop ends on a column normalization).
  float p[4], q[4], c[16];
  kernels::mhc::split_sinkhorn(mixes.data(), scale.data(), base.data(), 20, 1e-6f, p, q, c);
  for (int j = 0; j < 4; ++j) BOOST_TEST(std::fabs(c[j] + c[4 + j] + c[8 + j] + c[12 + j] - 1.0f) < 1e-5f);
}

BOOST_AUTO_TEST_CASE(sinkhorn_on_extreme_logits_has_no_nan) {
  // Mixes far outside any trained range (a runaway projection): every coefficient stays finite,
  // pre in (0, 1 + eps], post in [0, 2], and the columns of comb sum to 1 (the loop ends on them).
  const float scale[3] = {1.0f, 1.0f, 1.0f};
  float base[24] = {};
  for (const float big : {1e4f, 1e30f, 3e38f}) {
    for (int pattern = 0; pattern < 4; ++pattern) {
      float m[24], pre[4], post[4], comb[16];
      for (int i = 0; i < 24; ++i) {
        const float sign = pattern == 0 ? 1.0f : pattern == 1 ? -1.0f : (i % 2 ? 1.0f : -1.0f);
        m[i] = pattern == 3 && i % 3 ? 0.0f : sign * big;
      }
      kernels::mhc::split_sinkhorn(m, scale, base, 20, 1e-6f, pre, post, comb);
      for (int i = 0; i < 4; ++i) {
        BOOST_TEST(std::isfinite(pre[i]));
        BOOST_TEST((pre[i] > 0.0f && pre[i] <= 1.0f + 1e-6f));
        BOOST_TEST((std::isfinite(post[i]) && post[i] >= 0.0f && post[i] <= 2.0f));
      }
      for (int j = 0; j < 4; ++j) {
        double col = 0;
        for (int r = 0; r < 4; ++r) {
          BOOST_TEST(std::isfinite(comb[r * 4 + j]));
          col += comb[r * 4 + j];
        }
        BOOST_TEST(std::fabs(col - 1.0) < 1e-5, "column " << j << " sums to " << col << " (mixes " << big << ", pattern " << pattern << ")");
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(block_scaled_gemms_match_the_official_vectors) {
  io::safetensors_file f(test::data_path("reference/gemm.safetensors"));
  const auto a = io::copy_as<bf16>(f.tensor("a", io::st_dtype::BF16, {5, 256}));
  const auto a_q = io::copy_as<std::uint8_t>(f.tensor("a_q_e4m3", io::st_dtype::U8, {5, 256}));
  const auto a_s = io::copy_as<std::uint8_t>(f.tensor("a_scale_ue8m0", io::st_dtype::U8, {5, 8}));
  // The activations quantize to exactly the reference's codes and scales.
  std::vector<std::uint8_t> codes(256 * 5), scales(8 * 5);
  for (int r = 0; r < 5; ++r)
    numerics::quantize_vector<numerics::fp8_act_format>(std::span(a).subspan(r * 256, 256), std::span(codes).subspan(r * 256, 256),
                                                        std::span(scales).subspan(r * 8, 8));
  BOOST_TEST(codes == a_q, boost::test_tools::per_element());
  BOOST_TEST(scales == a_s, boost::test_tools::per_element());
  const kernels::gemm::gemm_shape s{5, 96, 256};
  auto check = [](const std::vector<bf16>& got, const std::vector<bf16>& want, const char* what) {
    int worst = 0, exact = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const int d = std::abs(int(got[i].bits & 0x7fff) - int(want[i].bits & 0x7fff)) +
                    (((got[i].bits ^ want[i].bits) & 0x8000) ? 1000 : 0);
      worst = std::max(worst, d);
      exact += d == 0;
    }
    BOOST_TEST_MESSAGE(what << ": " << exact << " of " << got.size() << " exact, worst " << worst << " bf16 ulp");
    BOOST_TEST(worst <= 1, what);  // MANIFEST: within ~1 bf16 ulp (tensor-core order inside a K block)
  };
  check(kernels::gemm::fp8_gemm_reference(s, a_q, a_s, io::copy_as<std::uint8_t>(f.tensor("w8_e4m3", io::st_dtype::U8, {96, 256})),
                                          io::copy_as<std::uint8_t>(f.tensor("w8_scale_ue8m0", io::st_dtype::U8, {3, 8}))),
        io::copy_as<bf16>(f.tensor("c_fp8", io::st_dtype::BF16, {5, 96})), "fp8_gemm");
  check(kernels::gemm::fp4_gemm_reference(s, a_q, a_s, io::copy_as<std::uint8_t>(f.tensor("w4_packed", io::st_dtype::U8, {96, 128})),
                                          io::copy_as<std::uint8_t>(f.tensor("w4_scale_ue8m0", io::st_dtype::U8, {96, 8}))),
        io::copy_as<bf16>(f.tensor("c_fp4", io::st_dtype::BF16, {5, 96})), "fp4_gemm");
  BOOST_CHECK_THROW(kernels::gemm::fp8_gemm_reference({5, 96, 250}, a_q, a_s, {}, {}), dsv4::error);
}

// An IEEE binary16 value from its bits, written out here (not the library's): the test of the
// GEMMs' FP4 -> f16 conversion must not share its arithmetic.
static double f16_value(std::uint32_t bits) {
  const int sign = bits >> 15 & 1, field = bits >> 10 & 31, man = bits & 1023;
  const double magnitude = field == 0 ? std::ldexp(man, -24) : std::ldexp(1024 + man, field - 25);
  return sign ? -magnitude : magnitude;
}

// The FP4 lane word: every code at every element round-trips, each code's bits sit at the
// positions weight_tiles.hpp names, and the kernels' conversion turns every code at every element
// into exactly its E2M1 value times 2^-14 in the f16x2 half the MMA pairs it with, whatever the
// neighbours hold.
BOOST_AUTO_TEST_CASE(fp4_lane_word_converts_to_exact_f16) {
  using namespace kernels::gemm;
  std::size_t wrong = 0, checked = 0;
  auto rng = test::make_rng(41);
  for (int e = 0; e < 8; ++e)
    for (int c = 0; c < 16; ++c)
      for (int trial = 0; trial < 64; ++trial) {
        std::uint8_t codes[8];
        for (auto& v : codes) v = std::uint8_t(rng() & 15u);  // neighbours that must not disturb element e
        codes[e] = std::uint8_t(c);
        const std::uint32_t w = fp4_lane_word(codes);
        for (int f = 0; f < 8; ++f) wrong += fp4_lane_code(w, f) != codes[f];
        wrong += (w >> fp4_magnitude_bit(e) & 7u) != std::uint32_t(c & 7) ||
                 (w >> fp4_sign_bit(e) & 1u) != std::uint32_t(c >> 3);
        std::uint32_t p[4];
        fp4_lane_word_to_f16x2(w, p);
        const std::uint32_t half = p[e / 2] >> (16 * (e % 2)) & 0xFFFFu;
        const double want =
            std::ldexp(double(numerics::decode<numerics::e2m1>(std::uint8_t(c))), fp4_f16_exponent_offset);
        wrong += f16_value(half) != want || (half >> 15) != std::uint32_t(c >> 3);  // -0 keeps its sign too
        ++checked;
      }
  BOOST_TEST(checked == 8u * 16u * 64u);
  BOOST_TEST(wrong == 0u);
  // The 32 bits are the 8 codes' 32 bits: -1.0 everywhere (magnitude 2, sign) sets one magnitude
  // bit and the sign of each element, 16 bits in all.
  const std::uint8_t negative_ones[8] = {0xA, 0xA, 0xA, 0xA, 0xA, 0xA, 0xA, 0xA};
  BOOST_TEST(fp4_lane_word(negative_ones) == 0xF492F492u);
  const std::uint8_t all_ones[8] = {0xF, 0xF, 0xF, 0xF, 0xF, 0xF, 0xF, 0xF};
  BOOST_TEST(fp4_lane_word(all_ones) == 0xFFFFFFFFu);
}

BOOST_AUTO_TEST_CASE(mma_tile_layout_holds_every_code_where_the_kernels_read_it) {
  using kernels::gemm::weight_format;
  auto rng = test::make_rng(40);
  for (const auto wf : {weight_format::fp8_tile32, weight_format::fp4_row32}) {
    const int n = 37, k = 96, kb_count = 3;  // a ragged last row tile
    const kernels::gemm::weight_tile_shape shape{n, k, wf};
    std::vector<std::uint8_t> codes(shape.checkpoint_code_bytes()), scales(shape.checkpoint_scale_bytes());
    for (auto& v : codes) v = std::uint8_t(rng());
    for (auto& v : scales) v = std::uint8_t(rng());
    const auto t = kernels::gemm::tile_weight(wf, n, k, codes, scales);
    BOOST_TEST(t.codes.size() == shape.code_bytes());
    BOOST_TEST(t.scales.size() == shape.scale_bytes());
    std::size_t wrong = 0;
    for (int row = 0; row < 48; ++row)
      for (int e = 0; e < k; ++e) {
        // Where the kernel finds element (row, e): tile (row/16, e/32), lane 4 (row%8) + (e%32)/8.
        const int rt = row / 16, kb = e / 32, lane = 4 * (row % 8) + (e % 32) / 8, half = (row % 16) / 8, i = e % 8;
        if (wf == weight_format::fp8_tile32) {
          const std::uint8_t got = t.codes[(std::size_t(rt) * kb_count + kb) * 512 + lane * 16 + half * 8 + i];
          wrong += got != (row < n ? codes[std::size_t(row) * k + e] : 0);
        } else {
          const std::uint8_t* word = t.codes.data() + (std::size_t(rt) * kb_count + kb) * 256 + lane * 8 + half * 4;
          const std::uint32_t w = std::uint32_t(word[0]) | std::uint32_t(word[1]) << 8 | std::uint32_t(word[2]) << 16 |
                                  std::uint32_t(word[3]) << 24;
          const int want = row < n ? numerics::load_code<numerics::e2m1>(codes.data() + std::size_t(row) * (k / 2), e) : 0;
          wrong += kernels::gemm::fp4_lane_code(w, i) != want;
          if (e % 32 == 0) {
            const int want_s = row < n ? scales[std::size_t(row) * kb_count + kb] : 127;
            wrong += t.scales[(std::size_t(rt) * kb_count + kb) * 16 + row % 16] != want_s;
          }
        }
      }
    BOOST_TEST(wrong == 0u);
  }
  std::vector<std::uint8_t> few(10);
  BOOST_TEST(test::throws_with([&] { kernels::gemm::tile_weight(weight_format::fp8_tile32, 4, 32, few, few); }, "codes have 10 bytes, expected 128"));
  BOOST_TEST(test::throws_with([&] { kernels::gemm::tile_weight(weight_format::fp4_row32, 4, 48, few, few); }, "multiple of 32"));
}

BOOST_AUTO_TEST_SUITE_END()
