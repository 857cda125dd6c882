#pragma once
//! \file
//! Small floating-point encodings as types: E2M1 (FP4), E4M3 (fn: finite, max 448), UE8M0 (a
//! power-of-two scale). A type fixes the encoding; how many bits it occupies in memory is a
//! separate fact (`storage_bits`), because UE8M0 and E4M3 use all 8 bits but E2M1 shares a byte.
//!
//! The codecs here are the single definition of rounding used by the host reference, the CUDA
//! kernels and the tests (spec §3): round to nearest, ties to even code, saturating at the
//! largest finite value ("satfinite"), sign of zero kept.

#include <cstdint>

#include "dsv4/numerics/bits.hpp"

namespace dsv4::numerics {

//! How an encoding spends its top codes.
enum class special_codes {
  none,           //!< every code is a finite number (E2M1)
  nan_all_ones,   //!< finite-only "fn" style: only S.1111.111 is NaN, no infinities (E4M3fn)
  unsigned_pow2,  //!< unsigned exponent-only scale: 0xFF is NaN, the rest are 2^(code-127) (UE8M0)
};

namespace detail {
constexpr float pow2_constexpr(int e) {
  float v = 1.0f;
  for (; e > 0; --e) v *= 2.0f;
  for (; e < 0; ++e) v *= 0.5f;
  return v;
}
}  // namespace detail

template <int ExpBits, int ManBits, bool Signed, int StorageBits, special_codes Special>
struct minifloat {
  static_assert(ExpBits >= 1 && ManBits >= 0, "minifloat<E,M,...>: need at least one exponent bit");
  static_assert(int(Signed) + ExpBits + ManBits <= StorageBits,
                "minifloat<E,M,S,Bits>: the encoding is wider than its storage");
  static_assert(Special != special_codes::unsigned_pow2 || (!Signed && ManBits == 0),
                "minifloat: unsigned_pow2 encodings have no sign and no mantissa");

  static constexpr int exp_bits = ExpBits;
  static constexpr int man_bits = ManBits;
  static constexpr bool is_signed = Signed;
  static constexpr int storage_bits = StorageBits;
  static constexpr special_codes special = Special;
  static constexpr int bias = (1 << (ExpBits - 1)) - 1;
  static constexpr int code_count = 1 << (int(Signed) + ExpBits + ManBits);
  static constexpr int min_normal_exp = 1 - bias;
  //! Largest exponent of a finite value and the mantissa of the largest finite value.
  static constexpr int max_exp = Special == special_codes::unsigned_pow2
                                     ? (1 << ExpBits) - 2 - bias
                                     : (1 << ExpBits) - 1 - bias;
  static constexpr int max_mantissa = Special == special_codes::nan_all_ones ? (1 << ManBits) - 2
                                                                             : (1 << ManBits) - 1;
  static constexpr float max_finite =
      float((1 << ManBits) + max_mantissa) / float(1 << ManBits) * detail::pow2_constexpr(max_exp);
  static constexpr std::uint8_t max_code = std::uint8_t(
      Special == special_codes::unsigned_pow2 ? 0xFE : (((max_exp + bias) << ManBits) | max_mantissa));
  static constexpr std::uint8_t sign_bit = Signed ? std::uint8_t(1u << (ExpBits + ManBits)) : 0;
};

using e2m1 = minifloat<2, 1, true, 4, special_codes::none>;            //!< FP4: ±{0,.5,1,1.5,2,3,4,6}
using e4m3 = minifloat<4, 3, true, 8, special_codes::nan_all_ones>;    //!< FP8 E4M3fn: max 448
using ue8m0 = minifloat<8, 0, false, 8, special_codes::unsigned_pow2>;  //!< power-of-two scale

static_assert(e2m1::max_finite == 6.0f && e2m1::max_code == 0x7, "e2m1: max finite must be 6");
static_assert(e4m3::max_finite == 448.0f && e4m3::max_code == 0x7E, "e4m3: max finite must be 448");
static_assert(e4m3::bias == 7 && e2m1::bias == 1 && ue8m0::bias == 127, "minifloat: biases");

//! Printable name of an encoding (reports, error messages).
template <class T>
inline constexpr const char* minifloat_name = "minifloat";
template <>
inline constexpr const char* minifloat_name<e2m1> = "E2M1";
template <>
inline constexpr const char* minifloat_name<e4m3> = "E4M3";
template <>
inline constexpr const char* minifloat_name<ue8m0> = "UE8M0";

template <class T>
inline constexpr bool is_minifloat_v = false;
template <int E, int M, bool S, int B, special_codes Sp>
inline constexpr bool is_minifloat_v<minifloat<E, M, S, B, Sp>> = true;

//! The f16 bits of an E4M3 code's value (exact; NaN codes give an f16 NaN of the same sign).
DSV4_HOST_DEVICE constexpr std::uint16_t e4m3_code_as_f16(std::uint8_t code) {
  const std::uint16_t sign = std::uint16_t((code & 0x80u) << 8);
  const unsigned e = (code >> 3) & 0xFu, m = code & 7u;
  if (e == 15 && m == 7) return std::uint16_t(sign | 0x7E00u);
  if (e != 0) return std::uint16_t(sign | (e + 8) << 10 | m << 7);  // 2^(e-7) (1 + m/8)
  if (m == 0) return sign;
  const unsigned p = m >= 4 ? 2 : m >= 2 ? 1 : 0;  // m 2^-9 = 2^(p-9) (1 + (m - 2^p) / 2^p)
  return std::uint16_t(sign | (p + 6) << 10 | (m - (1u << p)) << (10 - p));
}

//! A UE8M0 code's value 2^(code - 127) straight from its bits: code 0 is the subnormal 2^-127,
//! 255 is NaN. Branch-free on the device; the one definition the kernels' scale decoding uses.
DSV4_HOST_DEVICE float ue8m0_value(std::uint32_t code) {
  return bits_to_float(code == 0 ? 0x00400000u : code == 0xFFu ? 0x7fc00000u : code << 23);
}

//! Decode one code to fp32 (exact: every value of these encodings is an fp32 value).
template <class T>
DSV4_HOST_DEVICE float decode(std::uint8_t code) {
  static_assert(is_minifloat_v<T>, "decode<T>: T must be a numerics::minifloat");
  if constexpr (T::special == special_codes::unsigned_pow2) {
    static_assert(T::bias == 127 && T::exp_bits == 8, "decode<T>: the unsigned power-of-two code is UE8M0");
    return ue8m0_value(code);
  } else {
    constexpr unsigned man_mask = (1u << T::man_bits) - 1;
    constexpr unsigned exp_mask = (1u << T::exp_bits) - 1;
    const bool negative = T::is_signed && (code & T::sign_bit);
    const unsigned field = (code >> T::man_bits) & exp_mask;
    const unsigned man = code & man_mask;
    float v;
    if (T::special == special_codes::nan_all_ones && field == exp_mask && man == man_mask) {
      v = bits_to_float(0x7fc00000u);
    } else if (field == 0) {
      v = float(man) * exp2_int(T::min_normal_exp - T::man_bits);
    } else {
      v = float((1u << T::man_bits) + man) * exp2_int(int(field) - T::bias - T::man_bits);
    }
    return negative ? -v : v;
  }
}

//! Encode an fp32 value: round to nearest, ties to even, saturate to ±max_finite (infinities
//! too). NaN gives the NaN code where the encoding has one, and +max for E2M1, which has none
//! (the block quantizers flag NaN blocks through their scale instead).
template <class T>
DSV4_HOST_DEVICE std::uint8_t encode(float x) {
  static_assert(is_minifloat_v<T> && T::special != special_codes::unsigned_pow2,
                "encode<T>: T must be a signed minifloat element type (E2M1, E4M3); "
                "UE8M0 scales come from encode_pow2_scale");
  const std::uint32_t u = float_to_bits(x);
  const std::uint8_t sign = (u >> 31) ? T::sign_bit : 0;
  if (is_nan_bits(u)) {
    if constexpr (T::special == special_codes::nan_all_ones) return std::uint8_t(0x7f);
    return T::max_code;
  }
  const float a = bits_to_float(u & 0x7fffffffu);
  if (!(a < T::max_finite)) return std::uint8_t(sign | T::max_code);
  // Quantum of the binade that holds `a` (subnormal quantum below the smallest normal).
  int e = int((u >> 23) & 0xff) - 127;
  if (e < T::min_normal_exp) e = T::min_normal_exp;
  const int quantum_exp = e - T::man_bits;
  const float m = round_half_even(a * exp2_int(-quantum_exp));  // exact scaling by 2^k
  if (m * exp2_int(quantum_exp) > T::max_finite) return std::uint8_t(sign | T::max_code);
  const int mi = int(m);
  // Within a normal binade the code is ((e+bias) << M) + (m - 2^M); m == 2^(M+1) carries into
  // the next binade correctly. Below it, m is the subnormal mantissa itself.
  const int magnitude = (a < exp2_int(T::min_normal_exp))
                            ? mi
                            : ((e + T::bias) << T::man_bits) + mi - (1 << T::man_bits);
  return std::uint8_t(sign | magnitude);
}

}  // namespace dsv4::numerics
