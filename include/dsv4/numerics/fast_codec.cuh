#pragma once
//! \file
//! Device fast paths of the element codecs, for kernels that convert many values per byte moved
//! (quantizers, attention and GEMM prologues). Each one returns exactly what the generic codec of
//! minifloat.hpp returns, which the device tests check over every code and over every bf16 input:
//! - E4M3 encode: the hardware `cvt.rn.satfinite.e4m3x2.f32` (sm_89+), via cuda_fp8.h;
//! - E2M1 encode: seven threshold compares (RNE midpoints, ties to even; sm_90 has no FP4 cvt);
//! - E4M3 decode: the hardware `cvt.rn.f16x2.e4m3x2`, widened to fp32;
//! - E2M1 decode: fp32 bit patterns from a 128-bit constant table.

#include <cuda_fp8.h>  // provides __nv_cvt_float_to_fp8, __nv_cvt_fp8_to_halfraw

#include <cstdint>

#include "dsv4/numerics/block_format.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/minifloat.hpp"

namespace dsv4::numerics {

template <class T>
DSV4_DEVICE std::uint8_t fast_encode(float x) {
  if constexpr (std::is_same_v<T, e4m3>) {
    return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  } else {
    static_assert(std::is_same_v<T, e2m1>, "fast_encode<T>: T must be e2m1 or e4m3");
    const float m = fabsf(x);
    if (m != m) return e2m1::max_code;  // NaN, as encode<e2m1>
    // Midpoints between codes; ties go up only where the upper code is even (0.75, 1.75, 3.5).
    const unsigned c = unsigned(m > 0.25f) + unsigned(m >= 0.75f) + unsigned(m > 1.25f) + unsigned(m >= 1.75f) +
                       unsigned(m > 2.5f) + unsigned(m >= 3.5f) + unsigned(m > 5.0f);
    return std::uint8_t(c | ((__float_as_uint(x) >> 28) & 0x8u));
  }
}

template <class T>
DSV4_DEVICE float fast_decode(std::uint8_t code) {
  if constexpr (std::is_same_v<T, e4m3>) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(code, __NV_E4M3)));
  } else {
    static_assert(std::is_same_v<T, e2m1>, "fast_decode<T>: T must be e2m1 or e4m3");
    // Top 16 bits of the fp32 values 0, .5, 1, 1.5 | 2, 3, 4, 6 (their low 16 bits are zero).
    constexpr unsigned long long lo = 0x3FC03F803F000000ull, hi = 0x40C0408040404000ull;
    const unsigned m = code & 7u;
    const unsigned top = unsigned(((m < 4 ? lo : hi) >> (16 * (m & 3))) & 0xFFFFu);
    return __uint_as_float((top << 16) | (unsigned(code & 8u) << 28));
  }
}

//! bf16 value of element `code` under scale value `s`, as F::dequantize computes it.
template <class F>
DSV4_DEVICE bf16 fast_dequantize(std::uint8_t code, float s) {
  return bf16::from_float(__fmul_rn(fast_decode<typename F::element>(code), s));
}

//! Dequantize channels [c0, c0 + 8) of one packed vector (packed_vector<F, Channels> layout:
//! codes, then scales) into eight bf16 values. c0 must be a multiple of 8; the codes are read with
//! aligned 4-byte loads, so entries need only be 4-byte aligned (a 128-channel FP8 entry is 132 B).
template <class F, int Channels>
DSV4_DEVICE void dequantize8(const std::uint8_t* entry, int c0, bf16 (&out)[8]) {
  using layout = packed_vector<F, Channels>;
  // __ldg: read-only loads the compiler may issue early (no aliasing with the caller's stores).
  const float s = decode<typename F::scale>(__ldg(entry + layout::scale_offset + c0 / F::block_size));
  if constexpr (F::element::storage_bits == 8) {
    const std::uint32_t lo = __ldg(reinterpret_cast<const unsigned*>(entry + c0));
    const std::uint32_t hi = __ldg(reinterpret_cast<const unsigned*>(entry + c0 + 4));
    for (int i = 0; i < 4; ++i) out[i] = fast_dequantize<F>(std::uint8_t(lo >> (8 * i)), s);
    for (int i = 0; i < 4; ++i) out[4 + i] = fast_dequantize<F>(std::uint8_t(hi >> (8 * i)), s);
  } else {
    const std::uint32_t w = __ldg(reinterpret_cast<const unsigned*>(entry + c0 / 2));
    for (int i = 0; i < 8; ++i) out[i] = fast_dequantize<F>(std::uint8_t((w >> (4 * i)) & 0xf), s);
  }
}

}  // namespace dsv4::numerics
