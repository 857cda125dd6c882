#pragma once
//! \file
//! Block-scaled formats as types (spec §3, §15).
//!
//! `block_scaled<Elem, Scale, N>`: N consecutive elements share one scale; a value is
//! decode<Elem>(code) * decode<Scale>(scale). `tile_scaled<Elem, Scale, R, C>`: one scale per R x C
//! tile of a weight matrix. The type fixes the encoding and the quantization rule; the channel
//! count and the memory layout come from `packed_vector<Format, Channels>` (layout.hpp).
//!
//! The quantization rule belongs to the (element, scale) pair, exactly as the official kernels
//! define it (kernel.py `act_quant` and `fp4_act_quant`):
//!
//! | element | scale | amax floor | scale                       | used for                         |
//! |---------|-------|------------|-----------------------------|----------------------------------|
//! | E4M3    | UE8M0 | 1e-4       | 2^ceil(log2(amax * 1/448))  | GEMM activations, local (SWA) KV |
//! | E2M1    | UE8M0 | 6 * 2^-126 | 2^ceil(log2(amax * 1/6))    | indexer keys and queries         |
//! | E2M1    | E4M3  | 6 * 2^-9   | e4m3_rne_sat(amax / 6)      | compressed main KV               |
//!
//! Elements: q = rne_sat(x / s) with a true fp32 division (exact for power-of-two scales).
//!
//! Non-finite input (a deliberate definition; the reference leaves it undefined): a block that
//! holds a NaN gets the scale's NaN code, so every element of it decodes to NaN. Infinities
//! saturate like any other out-of-range value.

#include <cstdint>

#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/minifloat.hpp"

namespace dsv4::numerics {

namespace detail {
template <class Elem, class Scale>
struct quant_rule;  // defined only for the pairs below
template <class Elem, class Scale>
inline constexpr bool has_quant_rule = false;
template <>
inline constexpr bool has_quant_rule<e4m3, ue8m0> = true;
template <>
inline constexpr bool has_quant_rule<e2m1, ue8m0> = true;
template <>
inline constexpr bool has_quant_rule<e2m1, e4m3> = true;

//! 2^ceil(log2(amax * inv_max)) from the fp32 bits of the product (kernel.py fast_round_scale),
//! returned as a UE8M0 code. The exponent is kept inside UE8M0's finite range.
DSV4_HOST_DEVICE std::uint8_t pow2_ceil_scale_code(float amax, float inv_max) {
  const std::uint32_t u = float_to_bits(mul_rn(amax, inv_max));
  if (is_nan_bits(u)) return 0xFF;
  int e = int((u >> 23) & 0xff) - 127 + ((u & 0x7fffffu) != 0 ? 1 : 0);
  if (e > 127) e = 127;
  if (e < -127) e = -127;
  return std::uint8_t(e + 127);
}

template <>
struct quant_rule<e4m3, ue8m0> {
  static constexpr float amax_floor = 1e-4f;
  static constexpr float inv_max = float(1.0 / 448.0);
  DSV4_HOST_DEVICE static std::uint8_t scale_code(float amax) {
    return pow2_ceil_scale_code(amax, inv_max);
  }
};

template <>
struct quant_rule<e2m1, ue8m0> {
  static constexpr float amax_floor = 6.0f / float(1ull << 63) / float(1ull << 63);  // 6 * 2^-126
  static constexpr float inv_max = float(1.0 / 6.0);
  DSV4_HOST_DEVICE static std::uint8_t scale_code(float amax) {
    return pow2_ceil_scale_code(amax, inv_max);
  }
};

template <>
struct quant_rule<e2m1, e4m3> {
  static constexpr float amax_floor = 6.0f / 512.0f;  // 6 * 2^-9: the scale is at least E4M3's min
  DSV4_HOST_DEVICE static std::uint8_t scale_code(float amax) {
    if (is_nan_bits(float_to_bits(amax))) return 0x7F;
    return encode<e4m3>(div_rn(amax, 6.0f));  // a true division, then RNE with saturation at 448
  }
};
}  // namespace detail

template <class Elem, class Scale, int Block>
struct block_scaled {
  static_assert(is_minifloat_v<Elem> && is_minifloat_v<Scale>,
                "block_scaled<Elem,Scale,N>: Elem and Scale must be numerics::minifloat encodings");
  static_assert(Block == 16 || Block == 32,
                "block_scaled<Elem,Scale,N>: N must be 16 (E4M3-scaled FP4) or 32 (MX formats)");
  static_assert(detail::has_quant_rule<Elem, Scale>,
                "block_scaled<Elem,Scale,N>: no quantization rule for this element/scale pair; the "
                "official kernels define (e4m3, ue8m0), (e2m1, ue8m0) and (e2m1, e4m3)");
  static_assert(Block * Elem::storage_bits % 8 == 0,
                "block_scaled<Elem,Scale,N>: a block of codes must fill whole bytes");

  using element = Elem;
  using scale = Scale;
  using rule = detail::quant_rule<Elem, Scale>;
  static constexpr int block_size = Block;
  static constexpr int code_bytes_per_block = Block * Elem::storage_bits / 8;
  static constexpr int scale_bytes_per_block = Scale::storage_bits / 8;
  static constexpr int bytes_per_block = code_bytes_per_block + scale_bytes_per_block;
  static constexpr float amax_floor = rule::amax_floor;

  //! The scale code for a block whose largest magnitude is `amax` (NaN if the block holds NaN).
  DSV4_HOST_DEVICE static std::uint8_t scale_code(float amax) {
    if (is_nan_bits(float_to_bits(amax))) return rule::scale_code(amax);
    return rule::scale_code(amax < amax_floor ? amax_floor : amax);
  }
  //! The element code of `x` under scale value `s` (rounded, saturated).
  DSV4_HOST_DEVICE static std::uint8_t element_code(float x, float s) {
    return encode<Elem>(div_rn(x, s));
  }
  //! The bf16 value written back by the reference's in-place quantize-dequantize.
  DSV4_HOST_DEVICE static bf16 dequantize(std::uint8_t code, float s) {
    return bf16::from_float(mul_rn(decode<Elem>(code), s));
  }
};

//! One scale per `TileRows x TileCols` tile of an [N, K] weight (FP8 weights: 32 x 32, UE8M0).
template <class Elem, class Scale, int TileRows, int TileCols>
struct tile_scaled {
  static_assert(is_minifloat_v<Elem> && is_minifloat_v<Scale>,
                "tile_scaled<Elem,Scale,R,C>: Elem and Scale must be numerics::minifloat encodings");
  static_assert(TileRows > 0 && TileCols > 0, "tile_scaled<Elem,Scale,R,C>: tiles must be non-empty");
  using element = Elem;
  using scale = Scale;
  static constexpr int tile_rows = TileRows;
  static constexpr int tile_cols = TileCols;

  //! Bytes of codes and of scales for an [n, k] matrix (scales [ceil(n/R), ceil(k/C)]).
  static constexpr long long code_bytes(long long n, long long k) {
    return n * k * Elem::storage_bits / 8;
  }
  static constexpr long long scale_bytes(long long n, long long k) {
    return ((n + TileRows - 1) / TileRows) * ((k + TileCols - 1) / TileCols) * (Scale::storage_bits / 8);
  }
};

template <class T>
inline constexpr bool is_block_scaled_v = false;
template <class E, class S, int N>
inline constexpr bool is_block_scaled_v<block_scaled<E, S, N>> = true;

//! A block format usable for packed vectors (caches, activations, expert weight rows).
template <class F>
concept BlockFormat = is_block_scaled_v<F>;

}  // namespace dsv4::numerics
