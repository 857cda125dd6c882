#pragma once
//! \file
//! bfloat16 as a plain 16-bit storage type with the conversions the reference relies on:
//! widening is exact, narrowing rounds to nearest even. Every NaN narrows to the one canonical
//! quiet NaN 0x7FC0, so host and device produce the same bits (their fp32 NaN payloads differ).

#include <cstdint>
#include <span>
#include <vector>

#include "dsv4/numerics/bits.hpp"

namespace dsv4::numerics {

//! Storage for one bf16 value. Layout-compatible with __nv_bfloat16 and torch.bfloat16.
struct bf16 {
  static constexpr std::uint16_t canonical_nan_bits = 0x7FC0;
  std::uint16_t bits = 0;

  DSV4_HOST_DEVICE static bf16 from_bits(std::uint16_t b) {
    bf16 v;
    v.bits = b;
    return v;
  }
  DSV4_HOST_DEVICE static bf16 from_float(float f) {
    const std::uint32_t u = float_to_bits(f);
    if (is_nan_bits(u)) return from_bits(canonical_nan_bits);
    const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return from_bits(std::uint16_t((u + rounding) >> 16));
  }
  DSV4_HOST_DEVICE float to_float() const { return bits_to_float(std::uint32_t(bits) << 16); }
};
static_assert(sizeof(bf16) == 2, "bf16: must be exactly two bytes to alias checkpoint data");

//! Round an fp32 value to bf16 precision and back (one rounding, as a `.to(bfloat16)` does).
DSV4_HOST_DEVICE float round_to_bf16(float f) { return bf16::from_float(f).to_float(); }

//! Host copies of fp32 values rounded to bf16 (the device models' bf16 weights).
inline std::vector<bf16> to_bf16(std::span<const float> v) {
  std::vector<bf16> b(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) b[i] = bf16::from_float(v[i]);
  return b;
}

}  // namespace dsv4::numerics
