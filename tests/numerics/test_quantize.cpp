// Block quantizers (numerics/quantize.hpp): bit-exact against the reference vectors, then
// properties on random data, zeros, NaN/Inf, huge and tiny magnitudes, layout and errors.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "dsv4/io/safetensors.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.hpp"
#include "support/data.hpp"
#include "support/random.hpp"
#include "support/reference_codec.hpp"

using namespace dsv4;
using namespace dsv4::numerics;

namespace {

struct packed {
  std::vector<std::uint8_t> codes, scales;
};

template <class F>
packed quantize_rows(const std::vector<bf16>& x, int channels) {
  const std::size_t rows = x.size() / std::size_t(channels);
  packed p{std::vector<std::uint8_t>(x.size() * F::element::storage_bits / 8),
           std::vector<std::uint8_t>(x.size() / F::block_size)};
  const std::size_t cb = std::size_t(channels) * F::element::storage_bits / 8, sb = std::size_t(channels) / F::block_size;
  for (std::size_t r = 0; r < rows; ++r)
    quantize_vector<F>(std::span(x).subspan(r * channels, channels), std::span(p.codes).subspan(r * cb, cb),
                       std::span(p.scales).subspan(r * sb, sb));
  return p;
}

// One reference case of quant.safetensors: x -> (codes, scales, qdq), all bit-exact.
template <class F>
void check_reference(const std::string& prefix, const std::string& codes_name, const std::string& scales_name) {
  io::safetensors_file f(test::data_path("reference/quant.safetensors"));
  const auto& xt = f.tensor(prefix + ".x");
  const int channels = int(xt.shape[1]);
  const auto x = io::copy_as<bf16>(xt);
  const auto want_codes = io::copy_as<std::uint8_t>(f.tensor(prefix + "." + codes_name));
  const auto want_scales = io::copy_as<std::uint8_t>(f.tensor(prefix + "." + scales_name));
  const auto want_qdq = io::copy_as<bf16>(f.tensor(prefix + ".qdq"));
  const packed got = quantize_rows<F>(x, channels);
  BOOST_TEST(got.codes == want_codes, boost::test_tools::per_element());
  BOOST_TEST(got.scales == want_scales, boost::test_tools::per_element());
  std::vector<bf16> qdq = x;
  for (std::size_t r = 0; r < x.size() / std::size_t(channels); ++r)
    qdq_vector<F>(std::span(qdq).subspan(r * channels, channels));
  std::size_t bad = 0;
  for (std::size_t i = 0; i < qdq.size(); ++i) bad += qdq[i].bits != want_qdq[i].bits;
  BOOST_TEST(bad == 0u, prefix << ": " << bad << " qdq values differ from the reference bits");
}

template <class F>
const test::ref_encoding& ref_elem() {
  if constexpr (std::is_same_v<typename F::element, e2m1>) return test::ref_e2m1;
  else return test::ref_e4m3;
}

std::vector<bf16> random_bf16(std::mt19937_64& rng, std::size_t n, int min_exp, int max_exp) {
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> ex(min_exp, max_exp);
  std::vector<bf16> v(n);
  for (auto& x : v) x = bf16::from_float(std::ldexp(mant(rng), ex(rng)));
  return v;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(numerics)

BOOST_AUTO_TEST_CASE(act_quant_matches_reference_bits) {
  check_reference<fp8_act_format>("act_quant", "q_e4m3", "scale_ue8m0");
}
BOOST_AUTO_TEST_CASE(fp4_e4m3_main_kv_matches_reference_bits) {
  check_reference<main_kv_format>("fp4_e4m3", "q_packed", "scale_e4m3");
}
BOOST_AUTO_TEST_CASE(fp4_ue8m0_index_key_matches_reference_bits) {
  check_reference<index_key_format>("fp4_ue8m0", "q_packed", "scale_ue8m0");
}

using all_formats = std::tuple<main_kv_format, index_key_format, fp8_act_format>;

// Random data over a wide exponent range: the scale follows its rule exactly and every element is
// the nearest code of x / s (checked with the independent reference codec).
BOOST_AUTO_TEST_CASE_TEMPLATE(random_vectors_follow_the_rule, F, all_formats) {
  auto rng = test::make_rng(10 + F::block_size);
  for (int trial = 0; trial < 200; ++trial) {
    const int channels = 512;
    const int base = int(rng() % 200) - 120;  // per-vector magnitude, 2^-120 .. 2^80
    auto x = random_bf16(rng, channels, base - 6, base);
    const packed p = quantize_rows<F>(x, channels);
    for (int b = 0; b < channels / F::block_size; ++b) {
      float amax = 0;
      for (int j = 0; j < F::block_size; ++j) amax = std::fmax(amax, std::fabs(x[b * F::block_size + j].to_float()));
      amax = std::fmax(amax, F::amax_floor);
      const float s = decode<typename F::scale>(p.scales[b]);
      if constexpr (std::is_same_v<typename F::scale, ue8m0>) {
        // The smallest power of two with fp32(amax * inv_max) <= s.
        const float prod = float(double(amax) * double(F::rule::inv_max));
        BOOST_REQUIRE(prod <= s);
        BOOST_REQUIRE(prod > s / 2);
      } else {
        BOOST_REQUIRE(s == float(test::ref_e4m3.value(test::ref_e4m3.nearest(double(amax / 6.0f)))));
      }
      for (int j = 0; j < F::block_size; ++j) {
        const int i = b * F::block_size + j;
        const unsigned code = load_code<typename F::element>(p.codes.data(), i);
        const float q = x[i].to_float() / s;
        BOOST_REQUIRE_MESSAGE(code == ref_elem<F>().nearest(q), "element " << i << " x=" << x[i].to_float() << " s=" << s);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(zeros_take_the_floor_scale_and_keep_their_sign, F, all_formats) {
  std::vector<bf16> x(64, bf16::from_float(0.0f));
  for (int i = 1; i < 64; i += 2) x[i] = bf16::from_float(-0.0f);
  const packed p = quantize_rows<F>(x, 64);
  for (auto s : p.scales) BOOST_TEST(s == F::scale_code(F::amax_floor));
  for (int i = 0; i < 64; ++i) {
    const unsigned c = load_code<typename F::element>(p.codes.data(), i);
    BOOST_TEST(c == ((i % 2) ? unsigned(F::element::sign_bit) : 0u));
  }
  std::vector<bf16> y = x;
  qdq_vector<F>(y);
  for (int i = 0; i < 64; ++i) BOOST_TEST(y[i].bits == x[i].bits);
}

BOOST_AUTO_TEST_CASE_TEMPLATE(nan_poisons_only_its_block, F, all_formats) {
  auto rng = test::make_rng(20);
  auto x = random_bf16(rng, 64, -3, 3);
  x[5] = bf16::from_float(std::numeric_limits<float>::quiet_NaN());
  std::vector<bf16> y = x;
  qdq_vector<F>(y);
  for (int i = 0; i < 64; ++i) {
    const bool in_nan_block = i / F::block_size == 5 / F::block_size;
    BOOST_TEST(std::isnan(y[i].to_float()) == in_nan_block, "element " << i);
  }
}

BOOST_AUTO_TEST_CASE(infinities_and_extremes_saturate) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<bf16> x(32, bf16::from_float(1.0f));
  x[0] = bf16::from_float(inf);
  x[1] = bf16::from_float(-inf);
  // Local-KV / activation format: the scale clamps at 2^127, so inf stays inf after QDQ.
  std::vector<bf16> a = x;
  qdq_vector<fp8_act_format>(a);
  BOOST_TEST(std::isinf(a[0].to_float()));
  BOOST_TEST(a[1].to_float() == -inf);
  // Main-KV format: the E4M3 scale saturates at 448, so the largest value is 6 * 448 = 2688.
  std::vector<bf16> m(x.begin(), x.begin() + 16);
  qdq_vector<main_kv_format>(m);
  BOOST_TEST(m[0].to_float() == 2688.0f);
  BOOST_TEST(m[1].to_float() == -2688.0f);
  // bf16's largest and smallest magnitudes.
  std::vector<bf16> big(32, bf16::from_bits(0x7F7F));  // 3.39e38
  qdq_vector<fp8_act_format>(big);
  // 1.9921875 * 2^127 gets scale 2^120 and rounds to E4M3 256, so the fp32 product 2^128
  // overflows: the reference's QDQ turns bf16's largest value into inf, and so do we.
  BOOST_TEST(std::isinf(big[0].to_float()));
  std::vector<bf16> tiny(32, bf16::from_bits(0x0001));  // smallest bf16 subnormal
  qdq_vector<fp8_act_format>(tiny);
  for (auto t : tiny) BOOST_TEST(t.to_float() == 0.0f);  // below the 1e-4 amax floor's resolution
}

BOOST_AUTO_TEST_CASE(fp4_codes_pack_even_element_low) {
  std::vector<bf16> x(32, bf16::from_float(0.0f));
  x[0] = bf16::from_float(6.0f);   // with amax 6 the UE8M0 scale is 1: codes are the values
  x[1] = bf16::from_float(-1.0f);
  x[2] = bf16::from_float(0.5f);
  std::vector<std::uint8_t> codes(16), scales(1);
  quantize_vector<index_key_format>(x, codes, scales);
  BOOST_TEST(scales[0] == 127);
  BOOST_TEST(codes[0] == ((0xA << 4) | 0x7));  // element 0 (6.0 = code 7) low, element 1 (-1 = 0xA) high
  BOOST_TEST(codes[1] == 0x01);                // element 2 (0.5 = code 1) low
}

BOOST_AUTO_TEST_CASE(bad_shapes_are_errors_that_say_why) {
  std::vector<bf16> x(30);
  std::vector<std::uint8_t> codes(15), scales(1);
  BOOST_CHECK_EXCEPTION(quantize_vector<index_key_format>(x, codes, scales), dsv4::error,
                        [](const dsv4::error& e) { return std::string(e.what()).find("block size 32") != std::string::npos; });
  std::vector<bf16> y(32);
  BOOST_CHECK_EXCEPTION(quantize_vector<index_key_format>(y, codes, scales), dsv4::error,
                        [](const dsv4::error& e) { return std::string(e.what()).find("do not match") != std::string::npos; });
}

BOOST_AUTO_TEST_SUITE_END()
