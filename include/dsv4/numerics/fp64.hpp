#pragma once
//! \file
//! fp64 bit access and single-rounding fp64 arithmetic (with the fp32 subtraction and the
//! conversions such rules need), for rules that must give the same bits on the host and the device:
//! the sampler's exponential, logarithm and sums (kernels/sampling/reference.hpp). Each operation
//! is one IEEE rounding that neither compiler may contract or approximate; the fp32 helpers of the
//! same kind are in bits.hpp.

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

DSV4_HOST_DEVICE double mul_rn(double a, double b) {
#if DSV4_DEVICE_PASS
  return __dmul_rn(a, b);
#else
  volatile double p = a * b;  // volatile: forbid contraction into an FMA by the host compiler
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

//! a * b + c with one rounding (IEEE fused multiply-add on both sides).
DSV4_HOST_DEVICE double fma_rn(double a, double b, double c) {
#if DSV4_DEVICE_PASS
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
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
