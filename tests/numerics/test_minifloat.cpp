// The element and scale codecs (numerics/minifloat.hpp, bf16.hpp, block_format.hpp): exhaustive
// over every code, the tie table, saturation, signed zero, NaN, against an independent model.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/block_format.hpp"
#include "dsv4/numerics/minifloat.hpp"
#include "support/random.hpp"
#include "support/reference_codec.hpp"

using namespace dsv4::numerics;
using dsv4::test::ref_e2m1;
using dsv4::test::ref_e4m3;
using dsv4::test::ref_ue8m0;

namespace {
bool same_value(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b && std::signbit(a) == std::signbit(b);
}
}  // namespace

BOOST_AUTO_TEST_SUITE(numerics)

BOOST_AUTO_TEST_CASE(e2m1_decodes_every_code) {
  const float table[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (unsigned c = 0; c < 16; ++c) {
    BOOST_TEST_CONTEXT("code " << c) {
      BOOST_TEST(same_value(decode<e2m1>(std::uint8_t(c)), table[c]));
      BOOST_TEST(same_value(decode<e2m1>(std::uint8_t(c)), ref_e2m1.value(c)));
    }
  }
}

BOOST_AUTO_TEST_CASE(e4m3_and_ue8m0_decode_every_code) {
  for (unsigned c = 0; c < 256; ++c) {
    BOOST_TEST_CONTEXT("code " << c) {
      BOOST_TEST(same_value(decode<e4m3>(std::uint8_t(c)), ref_e4m3.value(c)));
      BOOST_TEST(same_value(decode<ue8m0>(std::uint8_t(c)), ref_ue8m0.value(c)));
    }
  }
  BOOST_TEST(std::isnan(decode<e4m3>(0x7F)));
  BOOST_TEST(std::isnan(decode<e4m3>(0xFF)));
  BOOST_TEST(decode<e4m3>(0x7E) == 448.0f);
  BOOST_TEST(decode<e4m3>(0x01) == std::ldexp(1.0f, -9));
  BOOST_TEST(std::isnan(decode<ue8m0>(0xFF)));
  BOOST_TEST(decode<ue8m0>(0) == std::ldexp(1.0f, -127));
  BOOST_TEST(decode<ue8m0>(254) == std::ldexp(1.0f, 127));
}

// e4m3_code_as_f16 (the streamed expert GEMMs' f16 activations): every code's f16 is its value,
// decoded here from the f16 fields by hand; NaN codes give NaN.
BOOST_AUTO_TEST_CASE(e4m3_codes_as_f16_are_their_values) {
  auto f16_value = [](std::uint16_t h) {
    const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
    const double mag = e == 31 ? (m ? std::numeric_limits<double>::quiet_NaN() : INFINITY)
                       : e == 0 ? std::ldexp(double(m), -24)
                                : std::ldexp(1.0 + m / 1024.0, e - 15);
    return (h & 0x8000) ? -mag : mag;
  };
  int bad = 0;
  for (int c = 0; c < 256; ++c) {
    const double want = decode<e4m3>(std::uint8_t(c)), got = f16_value(e4m3_code_as_f16(std::uint8_t(c)));
    bad += std::isnan(want) ? !std::isnan(got) : !(got == want && std::signbit(got) == std::signbit(want));
  }
  BOOST_TEST(bad == 0, bad << " E4M3 codes whose f16 is not their value");
}

BOOST_AUTO_TEST_CASE(encode_round_trips_every_finite_code) {
  for (unsigned c = 0; c < 16; ++c) BOOST_TEST(encode<e2m1>(decode<e2m1>(std::uint8_t(c))) == c);
  for (unsigned c = 0; c < 256; ++c) {
    if (c == 0x7F || c == 0xFF) continue;
    BOOST_TEST_CONTEXT("code " << c) { BOOST_TEST(encode<e4m3>(decode<e4m3>(std::uint8_t(c))) == c); }
  }
}

// Spec §3: 0.75 -> 1, 1.75 -> 2, 3.5 -> 4 round up; 0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4 down.
BOOST_AUTO_TEST_CASE(e2m1_tie_table) {
  const float mids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const float want[7] = {0.0f, 1.0f, 1.0f, 2.0f, 2.0f, 4.0f, 4.0f};
  for (int i = 0; i < 7; ++i) {
    BOOST_TEST_CONTEXT("midpoint " << mids[i]) {
      BOOST_TEST(decode<e2m1>(encode<e2m1>(mids[i])) == want[i]);
      BOOST_TEST(same_value(decode<e2m1>(encode<e2m1>(-mids[i])), -double(want[i])));
      // Just off the midpoint the nearest value wins.
      const float up = std::nextafter(mids[i], 10.0f), down = std::nextafter(mids[i], 0.0f);
      BOOST_TEST(decode<e2m1>(encode<e2m1>(up)) == float(ref_e2m1.value(ref_e2m1.nearest(up))));
      BOOST_TEST(decode<e2m1>(encode<e2m1>(down)) == float(ref_e2m1.value(ref_e2m1.nearest(down))));
    }
  }
}

BOOST_AUTO_TEST_CASE(e4m3_every_midpoint_ties_to_even) {
  for (unsigned c = 0; c < 0x7E; ++c) {
    const double lo = ref_e4m3.value(c), hi = ref_e4m3.value(c + 1);
    const float mid = float((lo + hi) / 2);  // exact: one more bit than E4M3 has
    BOOST_REQUIRE(double(mid) == (lo + hi) / 2);
    BOOST_TEST_CONTEXT("between codes " << c << " and " << c + 1) {
      const unsigned even = (c % 2 == 0) ? c : c + 1;
      BOOST_TEST(encode<e4m3>(mid) == even);
      BOOST_TEST(encode<e4m3>(-mid) == (even | 0x80));
    }
  }
}

BOOST_AUTO_TEST_CASE(saturation_signed_zero_and_nan) {
  const float inf = std::numeric_limits<float>::infinity();
  BOOST_TEST(encode<e4m3>(449.0f) == 0x7E);
  BOOST_TEST(encode<e4m3>(464.0f) == 0x7E);
  BOOST_TEST(encode<e4m3>(465.0f) == 0x7E);
  BOOST_TEST(encode<e4m3>(1e30f) == 0x7E);
  BOOST_TEST(encode<e4m3>(inf) == 0x7E);
  BOOST_TEST(encode<e4m3>(-inf) == 0xFE);
  BOOST_TEST(encode<e2m1>(6.5f) == 0x7);
  BOOST_TEST(encode<e2m1>(-100.0f) == 0xF);
  BOOST_TEST(encode<e2m1>(inf) == 0x7);
  BOOST_TEST(encode<e2m1>(-0.0f) == 0x8);  // the sign of zero is kept (spec §3)
  BOOST_TEST(encode<e2m1>(0.0f) == 0x0);
  BOOST_TEST(encode<e2m1>(-0.1f) == 0x8);
  BOOST_TEST(encode<e4m3>(-0.0f) == 0x80);
  BOOST_TEST(encode<e4m3>(std::numeric_limits<float>::quiet_NaN()) == 0x7F);
  BOOST_TEST(encode<e4m3>(std::numeric_limits<float>::denorm_min()) == 0x00);
  BOOST_TEST(encode<e4m3>(std::ldexp(1.0f, -10)) == 0x00);                 // tie with 0: even
  BOOST_TEST(encode<e4m3>(std::nextafter(std::ldexp(1.0f, -10), 1.0f)) == 0x01);
}

// Every bf16 value (all 65536 bit patterns) and a million random fp32 values, scaled into and
// beyond each encoding's range, against the independent nearest-code search.
BOOST_AUTO_TEST_CASE(encode_matches_nearest_code_exhaustively) {
  int mismatches = 0;
  auto check = [&](float x) {
    if (std::isnan(x)) return;
    const unsigned r2 = ref_e2m1.nearest(x), r4 = ref_e4m3.nearest(x);
    const unsigned g2 = encode<e2m1>(x), g4 = encode<e4m3>(x);
    if (g2 != r2 || g4 != r4) {
      if (++mismatches <= 10)
        BOOST_ERROR("x=" << x << " (bits " << std::hex << float_to_bits(x) << std::dec << "): e2m1 " << g2
                         << " vs " << r2 << ", e4m3 " << g4 << " vs " << r4);
    }
  };
  for (unsigned b = 0; b < 65536; ++b) {
    const float x = bf16::from_bits(std::uint16_t(b)).to_float();
    check(x);
    check(x * 0.0625f);  // shifts bf16's 8-bit mantissa grid against E2M1's
  }
  auto rng = dsv4::test::make_rng(1);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-14, 10);
  for (int i = 0; i < 1000000; ++i) check(std::ldexp(mant(rng), ex(rng)));
  BOOST_TEST(mismatches == 0);
}

BOOST_AUTO_TEST_CASE(bf16_conversions) {
  for (unsigned b = 0; b < 65536; ++b) {
    const bf16 v = bf16::from_bits(std::uint16_t(b));
    const float f = v.to_float();
    if (std::isnan(f)) {
      BOOST_TEST(std::isnan(bf16::from_float(f).to_float()));
    } else if (bf16::from_float(f).bits != v.bits) {
      BOOST_ERROR("bf16 round trip broke for bits " << b);
    }
  }
  BOOST_TEST(bf16::from_float(1.0f + std::ldexp(1.0f, -8)).bits == bf16::from_float(1.0f).bits);  // tie: even
  BOOST_TEST(bf16::from_float(1.0f + 3 * std::ldexp(1.0f, -8)).to_float() == 1.0f + std::ldexp(1.0f, -6));
  BOOST_TEST(std::isinf(bf16::from_float(std::numeric_limits<float>::max()).to_float()));
  BOOST_TEST(std::signbit(bf16::from_float(-0.0f).to_float()));
}

// fast_round_scale (kernel.py): 2^ceil(log2(fp32(amax * inv))), from the bits.
BOOST_AUTO_TEST_CASE(pow2_scale_is_ceil_log2_of_the_fp32_product) {
  auto rng = dsv4::test::make_rng(2);
  std::uniform_real_distribution<float> mant(0.5f, 1.0f);
  std::uniform_int_distribution<int> ex(-120, 120);
  const float inv448 = float(1.0 / 448.0), inv6 = float(1.0 / 6.0);
  for (int i = 0; i < 200000; ++i) {
    const float a = std::ldexp(mant(rng), ex(rng));
    for (float inv : {inv448, inv6}) {
      const float p = float(double(a) * double(inv));  // the correctly rounded fp32 product
      int e;
      const double m = std::frexp(double(p), &e);      // p = m * 2^e, m in [0.5, 1)
      int want = (m == 0.5) ? e - 1 : e;                // ceil(log2 p)
      // The kernel reads the exponent field: a subnormal product (field 0) counts as 2^-126.
      if (p < std::ldexp(1.0f, -126)) want = -126;
      const int got = int(detail::pow2_ceil_scale_code(a, inv)) - 127;
      if (got != std::clamp(want, -127, 127)) BOOST_FAIL("amax " << a << ": scale exponent " << got << " != " << want);
    }
  }
  // An exact power of two needs no rounding up; anything above it goes to the next one.
  BOOST_TEST(int(detail::pow2_ceil_scale_code(16.0f, 0.25f)) - 127 == 2);
  BOOST_TEST(int(detail::pow2_ceil_scale_code(std::nextafter(16.0f, 17.0f), 0.25f)) - 127 == 3);
  BOOST_TEST(detail::pow2_ceil_scale_code(std::numeric_limits<float>::infinity(), inv448) == 254);
  BOOST_TEST(detail::pow2_ceil_scale_code(std::numeric_limits<float>::quiet_NaN(), inv448) == 255);
}

BOOST_AUTO_TEST_SUITE_END()
