#pragma once
//! \file
//! fp64 bit access and single-rounding fp64 arithmetic (with the fp32 subtraction and the
//! conversions such rules need), for rules that must give the same bits on the host and the device:
//! the sampler's exponential, logarithm and sums (kernels/sampling/reference.hpp). Each operation
//! is one IEEE rounding that neither compiler may contract or approximate; the fp32 helpers of the
//! same kind are in bits.hpp. No fused multiply-add: without -mfma a host std::fma is a libm call
//! (5 ns each), which made the sampler's exponential 65 ns.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dsv4/config.hpp"

namespace dsv4::numerics {

DSV4_HOST_DEVICE std::uint64_t double_to_bits(double d) {
#if DSV4_DEVICE_PASS
  return static_cast<std::uint64_t>(__double_as_longlong(d));
#else
  std::uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
#endif
}

DSV4_HOST_DEVICE double bits_to_double(std::uint64_t u) {
#if DSV4_DEVICE_PASS
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
#endif
}

//! a * b, rounded once and never fused with a neighbouring add: on the host the product passes
//! through an empty asm statement (GCC / Clang on x86-64 and AArch64), which makes it opaque to the
//! optimizer at no cost; elsewhere through a volatile.
DSV4_HOST_DEVICE double mul_rn(double a, double b) {
#if DSV4_DEVICE_PASS
  return __dmul_rn(a, b);
#elif defined(__GNUC__) && defined(__x86_64__)
  double p = a * b;
  __asm__("" : "+x"(p));
  return p;
#elif defined(__GNUC__) && defined(__aarch64__)
  double p = a * b;
  __asm__("" : "+w"(p));
  return p;
#else
  volatile double p = a * b;
  return p;
#endif
}

DSV4_HOST_DEVICE double add_rn(double a, double b) {
#if DSV4_DEVICE_PASS
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

DSV4_HOST_DEVICE double div_rn(double a, double b) {
#if DSV4_DEVICE_PASS
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

DSV4_HOST_DEVICE float sub_rn(float a, float b) {
#if DSV4_DEVICE_PASS
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

//! The nearest float (ties to even), as the conversion rounds on both sides.
DSV4_HOST_DEVICE float to_float_rn(double d) {
#if DSV4_DEVICE_PASS
  return __double2float_rn(d);
#else
  return static_cast<float>(d);
#endif
}

//! The nearest double to an unsigned 64-bit integer (ties to even).
DSV4_HOST_DEVICE double u64_to_double_rn(std::uint64_t v) {
#if DSV4_DEVICE_PASS
  return __ull2double_rn(static_cast<unsigned long long>(v));
#else
  return static_cast<double>(v);
#endif
}

//! A non-negative double below 2^64 truncated to an integer.
DSV4_HOST_DEVICE std::uint64_t double_to_u64_rz(double d) {
#if DSV4_DEVICE_PASS
  return static_cast<std::uint64_t>(__double2ull_rz(d));
#else
  return static_cast<std::uint64_t>(d);
#endif
}

//! The nearest integer to a double (ties to even), as a double.
DSV4_HOST_DEVICE double round_half_even(double x) {
#if DSV4_DEVICE_PASS
  return rint(x);
#else
  return std::nearbyint(x);
#endif
}

}  // namespace dsv4::numerics
