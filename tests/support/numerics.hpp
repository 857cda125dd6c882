#pragma once
// Small numeric helpers the kernel tests share: the distance between bf16 values in ulps, and
// packing vectors into entries of a packed format (codes, then scales at the layout's offset) with
// the values the entries decode to, which the host references read.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.hpp"

namespace dsv4::test {

//! How many bf16 values lie between a and b (sign-magnitude bits put on one line: +0 and -0 are 0
//! apart, the smallest values of either sign 2 apart). For finite values.
inline int bf16_ulp_distance(numerics::bf16 a, numerics::bf16 b) {
  auto line = [](numerics::bf16 x) { return (x.bits & 0x8000) ? -int(x.bits & 0x7fff) : int(x.bits); };
  return std::abs(line(a) - line(b));
}

//! Quantizes x (Dim values) into one entry of packed_vector<F, Dim> at `entry`.
template <class F, int Dim>
void quantize_entry(std::span<const numerics::bf16> x, std::uint8_t* entry) {
  using layout = numerics::packed_vector<F, Dim>;
  numerics::quantize_vector<F>(x, {entry, std::size_t(layout::code_bytes)},
                               {entry + layout::scale_offset, std::size_t(layout::scale_bytes)});
}

//! Quantizes x into the entry at `entry` and writes the values it decodes to into qdq.
template <class F, int Dim>
void pack_entry(std::span<const numerics::bf16> x, std::uint8_t* entry, std::span<numerics::bf16> qdq) {
  using layout = numerics::packed_vector<F, Dim>;
  quantize_entry<F, Dim>(x, entry);
  numerics::dequantize_vector<F>({entry, std::size_t(layout::code_bytes)},
                                 {entry + layout::scale_offset, std::size_t(layout::scale_bytes)}, qdq);
}

//! MXFP4 index keys packed one after another (key t at t * stride) and their decoded values.
struct packed_keys {
  std::vector<std::uint8_t> cache;
  std::vector<numerics::bf16> qdq;
};

//! Packs keys [n, Dim] (row-major) as index keys (numerics::index_key_format), `stride` bytes
//! apart (at least the entry's bytes; the attention stack pads entries to a multiple of 4).
template <int Dim>
packed_keys pack_index_keys(std::span<const numerics::bf16> keys,
                            std::size_t stride = numerics::packed_vector<numerics::index_key_format, Dim>::bytes) {
  using F = numerics::index_key_format;
  const std::size_t n = keys.size() / Dim;
  packed_keys p{std::vector<std::uint8_t>(n * stride, 0xEE), std::vector<numerics::bf16>(keys.size())};
  for (std::size_t t = 0; t < n; ++t)
    pack_entry<F, Dim>(keys.subspan(t * Dim, Dim), p.cache.data() + t * stride,
                       std::span(p.qdq).subspan(t * Dim, Dim));
  return p;
}

}  // namespace dsv4::test
