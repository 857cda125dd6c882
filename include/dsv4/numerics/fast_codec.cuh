#pragma once
//! \file
//! Device fast paths of the element codecs, for kernels that convert many values per byte moved
//! (quantizers, attention and GEMM prologues). Each one returns exactly what the generic codec of
//! minifloat.hpp returns, which the device tests check over every code and over every bf16 input:
//! - E4M3 encode: the hardware `cvt.rn.satfinite.e4m3x2.f32` (sm_89+), via cuda_fp8.h;
//! - E2M1 encode: seven threshold compares (RNE midpoints, ties to even; sm_90 has no FP4 cvt);
//! - E4M3 decode: the hardware `cvt.rn.f16x2.e4m3x2`, widened to fp32;
//! - E2M1 decode: fp32 bit patterns from a 128-bit constant table.

#include <cuda_bf16.h>  // provides __floats2bfloat162_rn
#include <cuda_fp16.h>  // provides __half22float2
#include <cuda_fp8.h>  // provides __nv_cvt_float_to_fp8, __nv_cvt_fp8_to_halfraw

#include <cstdint>
#include <type_traits>

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

//! fp32 values rounded to bf16 precision and back, by the hardware conversion (`cvt.rn.bf16.f32`,
//! `cvt.rn.bf16x2.f32`: one instruction for one or two values, where bf16::from_float takes about
//! seven): the same value as round_to_bf16 for every input but NaN (round to nearest even,
//! subnormals kept, overflow to inf), and a NaN stays a NaN with the hardware's bits (0x7FFF), so
//! a result whose bits are stored goes through bf16::from_float (canonical NaN) once at the end.
DSV4_DEVICE float fast_round_to_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
DSV4_DEVICE float2 fast_round_to_bf16x2(float a, float b) { return __bfloat1622float2(__floats2bfloat162_rn(a, b)); }

//! Where a packed vector is read from: global memory through the read-only path (`__ldg`: loads
//! the compiler may issue early, no aliasing with the caller's stores; entries 4-byte aligned), or
//! any address space (a copy the caller staged in shared memory, 8-byte aligned).
enum class packed_source { global, any };

template <packed_source Src, class T>
DSV4_DEVICE T load_packed(const T* p) {
  if constexpr (Src == packed_source::global)
    return __ldg(p);
  else
    return *p;
}

//! Dequantize channels [c0, c0 + 8) of one packed vector (packed_vector<F, Channels> layout:
//! codes, then scales) into eight bf16 values. c0 must be a multiple of 8; the codes are read with
//! aligned 4-byte loads, so entries need only be 4-byte aligned (a 128-channel FP8 entry is 132 B).
template <class F, int Channels, packed_source Src = packed_source::global>
DSV4_DEVICE void dequantize8(const std::uint8_t* entry, int c0, bf16 (&out)[8]) {
  using layout = packed_vector<F, Channels>;
  const float s = decode<typename F::scale>(load_packed<Src>(entry + layout::scale_offset + c0 / F::block_size));
  if constexpr (F::element::storage_bits == 8) {
    const std::uint32_t lo = load_packed<Src>(reinterpret_cast<const unsigned*>(entry + c0));
    const std::uint32_t hi = load_packed<Src>(reinterpret_cast<const unsigned*>(entry + c0 + 4));
    for (int i = 0; i < 4; ++i) out[i] = fast_dequantize<F>(std::uint8_t(lo >> (8 * i)), s);
    for (int i = 0; i < 4; ++i) out[4 + i] = fast_dequantize<F>(std::uint8_t(hi >> (8 * i)), s);
  } else {
    const std::uint32_t w = load_packed<Src>(reinterpret_cast<const unsigned*>(entry + c0 / 2));
    for (int i = 0; i < 8; ++i) out[i] = fast_dequantize<F>(std::uint8_t((w >> (4 * i)) & 0xf), s);
  }
}

//! bf16x2 product, rounded to nearest even: sm_90's `mul.rn.bf16x2`; for older targets of a
//! mixed build, fp32 products rounded once (the same result: an fp32 product of two bf16 values
//! is exact).
DSV4_DEVICE std::uint32_t bf16x2_mul(std::uint32_t a, std::uint32_t b) {
  std::uint32_t d = 0;
#if DSV4_DEVICE_PASS && __CUDA_ARCH__ >= 900
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#elif DSV4_DEVICE_PASS
  const float lo = __fmul_rn(__uint_as_float(a << 16), __uint_as_float(b << 16));
  const float hi = __fmul_rn(__uint_as_float(a & 0xFFFF0000u), __uint_as_float(b & 0xFFFF0000u));
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
  d = std::uint32_t(__bfloat16_as_ushort(p.x)) | (std::uint32_t(__bfloat16_as_ushort(p.y)) << 16);
#endif
  return d;
}

//! Four E2M1 codes (16 bits, element i in bits 4i .. 4i + 3) -> their bf16 values as two bf16x2
//! words (elements 0, 1 in `w01`, 2, 3 in `w23`, the lower element in the low half). Byte
//! permutes look up the high and low bytes of the eight magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; the
//! sign bits are moved to bit 15 / 31. Every value is a normal bf16 (or zero): exact.
DSV4_DEVICE void e2m1x4_to_bf16x4(std::uint32_t v, std::uint32_t& w01, std::uint32_t& w23) {
  const std::uint32_t sel = v & 0x7777u;
  const std::uint32_t hi = __byte_perm(0x3F3F3F00u, 0x40404040u, sel);  // bf16 high bytes: 00 3F 3F 3F 40 40 40 40
  const std::uint32_t lo = __byte_perm(0xC0800000u, 0xC0804000u, sel);  // bf16 low bytes:  00 00 80 C0 00 40 80 C0
  w01 = __byte_perm(lo, hi, 0x5140u) | ((v << 12) & 0x8000u) | ((v << 24) & 0x80000000u);
  w23 = __byte_perm(lo, hi, 0x7362u) | ((v << 4) & 0x8000u) | ((v << 16) & 0x80000000u);
}

//! The packed bits of channels [c0, c0 + 8) of one vector: the element codes (E2M1: 32 bits in
//! `lo`; E4M3: 64 bits in lo, hi) and the block's scale code. Loading them (load_packed8) apart
//! from converting them (decode_packed8) lets a kernel issue the loads of several vectors before
//! it converts any: one memory round trip for all of them instead of one each.
struct packed8_bits {
  std::uint32_t lo = 0, hi = 0, scale = 0;
};

//! Whether F has a fast path below (else dequantize8_packed goes through dequantize8).
template <class F>
inline constexpr bool has_fast_packed8 =
    F::block_size % 8 == 0 &&
    ((std::is_same_v<typename F::element, e2m1> && std::is_same_v<typename F::scale, e4m3>) ||
     (std::is_same_v<typename F::element, e4m3> && std::is_same_v<typename F::scale, ue8m0>));

template <class F, int Channels, packed_source Src = packed_source::global>
DSV4_DEVICE packed8_bits load_packed8(const std::uint8_t* entry, int c0) {
  static_assert(has_fast_packed8<F>,
                "load_packed8: E2M1 / E4M3 elements with E4M3 / UE8M0 scales per 8k only");
  using layout = packed_vector<F, Channels>;
  // Unsigned offsets: divisions by powers of two are shifts. (Signed ones stayed divisions, and a
  // caller choosing between two formats' loads had them merged into one division by a selected
  // divisor: a call of the integer division routine per load.)
  const unsigned c = unsigned(c0);
  packed8_bits r;
  r.scale = load_packed<Src>(entry + layout::scale_offset + c / unsigned(F::block_size));
  if constexpr (std::is_same_v<typename F::element, e2m1>) {
    r.lo = load_packed<Src>(reinterpret_cast<const unsigned*>(entry + c / 2));
  } else if constexpr (Src == packed_source::any) {  // a staged copy, 8-byte aligned: one load (two would
                                                     // conflict in a bank)
    const uint2 v = *reinterpret_cast<const uint2*>(entry + c);
    r.lo = v.x, r.hi = v.y;
  } else {
    r.lo = load_packed<Src>(reinterpret_cast<const unsigned*>(entry + c));
    r.hi = load_packed<Src>(reinterpret_cast<const unsigned*>(entry + c + 4));
  }
  return r;
}

//! The eight bf16 values of load_packed8's bits as four bf16x2 words, without branches. The
//! main-KV format (E2M1 with an E4M3 scale per 16): table lookups for the elements and one bf16x2
//! multiply by the scale per pair, exact because an E2M1 value times an E4M3 value has at most 6
//! significant bits and stays in bf16's normal range; a NaN scale gives eight canonical NaNs, as
//! bf16::from_float does. The window / activation format (E4M3 with a UE8M0 scale per 32)
//! converts pairs in hardware: E4M3 -> f16 (exact), one fp32 multiply (the product dequantize8
//! forms, possibly an fp32 subnormal for tiny scales), one packed rounding to bf16 (round to
//! nearest even, as bf16::from_float); NaN results take the canonical bits as bf16::from_float does.
template <class F>
DSV4_DEVICE uint4 decode_packed8(const packed8_bits& r) {
  static_assert(has_fast_packed8<F>,
                "decode_packed8: E2M1 / E4M3 elements with E4M3 / UE8M0 scales per 8k only");
  if constexpr (std::is_same_v<typename F::element, e2m1>) {
    // The scale as bf16 in both halves (an E4M3 value is exact in bf16: its fp32 bits end in 16 zeros).
    const std::uint32_t s2 = (__float_as_uint(fast_decode<e4m3>(std::uint8_t(r.scale))) >> 16) * 0x10001u;
    std::uint32_t e[4];
    e2m1x4_to_bf16x4(r.lo & 0xFFFFu, e[0], e[1]);
    e2m1x4_to_bf16x4(r.lo >> 16, e[2], e[3]);
    const bool nan_scale = (r.scale & 0x7Fu) == 0x7Fu;
    const std::uint32_t nan2 = std::uint32_t(bf16::canonical_nan_bits) * 0x10001u;
    std::uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = nan_scale ? nan2 : bf16x2_mul(e[i], s2);
    return make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    const std::uint32_t sc = r.scale & 0xFFu;
    const float s = __uint_as_float(sc == 0 ? 0x00400000u : sc == 0xFFu ? 0x7fc00000u : sc << 23);
    std::uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const std::uint32_t codes = ((i < 2 ? r.lo : r.hi) >> (16 * (i % 2))) & 0xFFFFu;
      const __half2 h(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(codes), __NV_E4M3));
      const float2 f = __half22float2(h);
      const float a = __fmul_rn(f.x, s), b = __fmul_rn(f.y, s);
      const __nv_bfloat162 p = __floats2bfloat162_rn(a, b);
      std::uint32_t bits = std::uint32_t(__bfloat16_as_ushort(p.x)) | (std::uint32_t(__bfloat16_as_ushort(p.y)) << 16);
      if (a != a) bits = (bits & 0xFFFF0000u) | bf16::canonical_nan_bits;
      if (b != b) bits = (bits & 0x0000FFFFu) | (std::uint32_t(bf16::canonical_nan_bits) << 16);
      w[i] = bits;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

//! Channels [c0, c0 + 8) of one packed vector as four bf16x2 words (channel c0 + 2i in the low
//! half of word i): bit for bit the values of dequantize8 (the device test compares them over
//! every code and scale). Formats with a fast path (has_fast_packed8) go through load_packed8 and
//! decode_packed8, the others through dequantize8.
template <class F, int Channels, packed_source Src = packed_source::global>
DSV4_DEVICE uint4 dequantize8_packed(const std::uint8_t* entry, int c0) {
  if constexpr (has_fast_packed8<F>) {
    return decode_packed8<F>(load_packed8<F, Channels, Src>(entry, c0));
  } else {
    bf16 v[8];
    dequantize8<F, Channels, Src>(entry, c0, v);
    std::uint32_t w[4];
    for (int i = 0; i < 4; ++i) w[i] = std::uint32_t(v[2 * i].bits) | (std::uint32_t(v[2 * i + 1].bits) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace dsv4::numerics
