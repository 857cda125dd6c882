#pragma once
//! \file
//! IEEE-754 fp32 bit access and correctly rounded arithmetic that behave the same on the host and
//! on the device. The quantizers of the reference are specified in terms of fp32 bits and of
//! single roundings; these helpers keep nvcc from contracting or approximating them.

#include <cstdint>
#include <cstring>
#include <cmath>

#include "dsv4/config.hpp"

namespace dsv4::numerics {

DSV4_HOST_DEVICE std::uint32_t float_to_bits(float f) {
#if DSV4_DEVICE_PASS
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

DSV4_HOST_DEVICE float bits_to_float(std::uint32_t u) {
#if DSV4_DEVICE_PASS
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

//! 2^e as fp32 for e in [-149, 127], built from bits (exact, no libm).
DSV4_HOST_DEVICE float exp2_int(int e) {
  if (e >= -126) return bits_to_float(std::uint32_t(e + 127) << 23);
  return bits_to_float(std::uint32_t(1) << (e + 149));  // subnormal
}

//! Correctly rounded fp32 product; never fused with a neighbouring add.
DSV4_HOST_DEVICE float mul_rn(float a, float b) {
#if DSV4_DEVICE_PASS
  return __fmul_rn(a, b);
#else
  volatile float p = a * b;  // volatile: forbid contraction into an FMA by the host compiler
  return p;
#endif
}

//! Correctly rounded fp32 quotient (IEEE division under nvcc's -prec-div=false too; -ftz=true, as
//! --use_fast_math sets, still flushes subnormal operands and results to zero).
DSV4_HOST_DEVICE float div_rn(float a, float b) {
#if DSV4_DEVICE_PASS
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

//! Round to the nearest integer, ties to even (the default IEEE rounding mode).
DSV4_HOST_DEVICE float round_half_even(float x) {
#if DSV4_DEVICE_PASS
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}

DSV4_HOST_DEVICE bool is_nan_bits(std::uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

}  // namespace dsv4::numerics
