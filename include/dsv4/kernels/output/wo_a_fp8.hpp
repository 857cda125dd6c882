#pragma once
//! \file
//! wo_a's FP8 form for the decode kernel (wo_a_fp8.cuh), recovered from its bf16 values on the
//! host. The checkpoint stores wo_a as E4M3 codes with UE8M0 tile scales and the reference holds
//! their bf16 products (attention_weights.hpp, as convert.py does); every such value is a code
//! times a power of two, so one UE8M0 scale per 32 x 32 tile with E4M3 codes represents the
//! tile exactly (the smallest scale that holds the tile's largest value: a larger checkpoint
//! scale only leaves the codes coarser). Where a value has no such form (a tile whose products
//! rounded in bf16, or weights that never were FP8), there is no FP8 form and the layer keeps
//! the bf16 path.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace dsv4::kernels::output {

//! E4M3 codes [rows, cols] row-major and UE8M0 scales [rows / 32, cols / 32].
struct fp8_tiles {
  std::vector<std::uint8_t> codes, scales;
};

namespace detail {
//! The E4M3 code whose value is exactly `x`, or -1 if there is none (bit arithmetic: a loaded
//! model's wo_a is 1.3 G values at V4.1 widths).
inline int exact_e4m3_code(float x) {
  const std::uint32_t b = std::bit_cast<std::uint32_t>(x), sign = (b >> 31) << 7, mag = b & 0x7FFFFFFFu;
  if (mag == 0) return int(sign);
  const int biased = int(mag >> 23), exp = biased - 127;
  const std::uint32_t man = mag & 0x7FFFFFu;
  if (biased == 0 || exp > 8 || exp < -9) return -1;  // fp32 subnormal, above 448, or below 2^-9
  if (exp >= -6) {                                    // an E4M3 normal: three mantissa bits
    if (man & 0xFFFFFu) return -1;
    const std::uint32_t code = sign | std::uint32_t(exp + 7) << 3 | man >> 20;
    return (code & 0x7Fu) == 0x7Fu ? -1 : int(code);  // 0x7F is NaN (480 would be)
  }
  const int shift = 23 - (exp + 9);  // an E4M3 subnormal: m * 2^-9, m < 8
  if (man & ((1u << shift) - 1)) return -1;
  return int(sign | ((0x800000u | man) >> shift));
}
}  // namespace detail

//! `values` [rows, cols] as E4M3 codes times one UE8M0 scale per 32 x 32 tile, each value
//! reproduced exactly (decode(code) * 2^(scale - 127) == value), or nullopt: rows or cols not a
//! multiple of 32, a non-finite value, or a tile with no exact form.
inline std::optional<fp8_tiles> exact_fp8_tiles(std::span<const float> values, int rows, int cols) {
  constexpr int T = 32;
  if (rows <= 0 || cols <= 0 || rows % T || cols % T || values.size() != std::size_t(rows) * std::size_t(cols))
    return std::nullopt;
  const int tiles_c = cols / T;
  fp8_tiles out;
  out.codes.resize(values.size());
  out.scales.resize(std::size_t(rows / T) * std::size_t(tiles_c));
  for (int tr = 0; tr < rows / T; ++tr)
    for (int tc = 0; tc < tiles_c; ++tc) {
      float amax = 0;
      for (int r = tr * T; r < tr * T + T; ++r)
        for (int c = tc * T; c < tc * T + T; ++c) {
          const float v = values[std::size_t(r) * std::size_t(cols) + std::size_t(c)];
          if (!std::isfinite(v)) return std::nullopt;
          amax = std::max(amax, std::fabs(v));
        }
      // The smallest exponent e with amax <= 448 * 2^e (448: E4M3's largest value).
      int e = 0;
      if (amax > 0) {
        e = std::ilogb(double(amax) / 448.0);
        while (double(amax) > std::ldexp(448.0, e)) ++e;
        while (double(amax) <= std::ldexp(448.0, e - 1)) --e;
      }
      if (e < -127 || e > 127) return std::nullopt;
      out.scales[std::size_t(tr) * std::size_t(tiles_c) + std::size_t(tc)] = std::uint8_t(e + 127);
      // 2^-e as a float (a subnormal for e = 127): v * 2^-e is IEEE's correctly rounded product,
      // the value std::ldexp(v, -e) returns, at a multiply a value instead of a library call.
      const float inv_scale = std::bit_cast<float>(e == 127 ? 0x00400000u : std::uint32_t(127 - e) << 23);
      for (int r = tr * T; r < tr * T + T; ++r)
        for (int c = tc * T; c < tc * T + T; ++c) {
          const std::size_t i = std::size_t(r) * std::size_t(cols) + std::size_t(c);
          const float v = values[i], x = v * inv_scale;  // exact unless it leaves fp32's normals
          const int code = detail::exact_e4m3_code(x);
          if (code < 0 || (x == 0.0f && v != 0.0f)) return std::nullopt;
          out.codes[i] = std::uint8_t(code);
        }
    }
  return out;
}

}  // namespace dsv4::kernels::output
