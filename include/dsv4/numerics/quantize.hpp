#pragma once
//! \file
//! Host reference of the block quantizers (spec §3 act_quant, fp4_act_quant) over packed vectors.
//! The CUDA kernels in quantize.cuh use the same per-element rules (block_format.hpp) and must
//! produce the same bytes.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/numerics/formats.hpp"

namespace dsv4::numerics {

//! Largest magnitude of a block, as fp32 bits so that NaN compares above +inf (integer order of
//! non-negative IEEE bit patterns is numeric order, and NaN patterns sit above infinity).
DSV4_HOST_DEVICE std::uint32_t abs_bits(bf16 x) { return (std::uint32_t(x.bits) << 16) & 0x7fffffffu; }

//! Store a code into a packed code array (two 4-bit codes per byte, even element low).
template <class Elem>
DSV4_HOST_DEVICE void store_code(std::uint8_t* codes, long long i, std::uint8_t code) {
  if constexpr (Elem::storage_bits == 8) {
    codes[i] = code;
  } else {
    static_assert(Elem::storage_bits == 4, "store_code: only 4- and 8-bit codes are packed");
    std::uint8_t& b = codes[i >> 1];
    b = (i & 1) ? std::uint8_t((b & 0x0f) | (code << 4)) : std::uint8_t((b & 0xf0) | (code & 0x0f));
  }
}

template <class Elem>
DSV4_HOST_DEVICE std::uint8_t load_code(const std::uint8_t* codes, long long i) {
  if constexpr (Elem::storage_bits == 8) {
    return codes[i];
  } else {
    return (i & 1) ? std::uint8_t(codes[i >> 1] >> 4) : std::uint8_t(codes[i >> 1] & 0x0f);
  }
}

//! Quantize `x` (one vector, channels a multiple of the block size) into `codes` (channels *
//! bits / 8 bytes) and `scales` (channels / N bytes).
template <BlockFormat F>
void quantize_vector(std::span<const bf16> x, std::span<std::uint8_t> codes,
                     std::span<std::uint8_t> scales) {
  const long long n = static_cast<long long>(x.size());
  if (n % F::block_size != 0)
    throw error("quantize_vector: " + std::to_string(n) + " channels is not a multiple of the block size " +
                std::to_string(F::block_size));
  if (static_cast<long long>(codes.size()) != n * F::element::storage_bits / 8 ||
      static_cast<long long>(scales.size()) != n / F::block_size)
    throw error("quantize_vector: output spans do not match " + std::to_string(n) + " channels");
  for (long long b = 0; b < n / F::block_size; ++b) {
    std::uint32_t amax = 0;
    for (int j = 0; j < F::block_size; ++j) {
      const std::uint32_t a = abs_bits(x[b * F::block_size + j]);
      amax = a > amax ? a : amax;
    }
    const std::uint8_t sc = F::scale_code(bits_to_float(amax));
    scales[b] = sc;
    const float s = decode<typename F::scale>(sc);
    for (int j = 0; j < F::block_size; ++j) {
      const long long i = b * F::block_size + j;
      store_code<typename F::element>(codes.data(), i, F::element_code(x[i].to_float(), s));
    }
  }
}

//! Decode a packed vector back to bf16 (exact: every representable product fits bf16).
template <BlockFormat F>
void dequantize_vector(std::span<const std::uint8_t> codes, std::span<const std::uint8_t> scales,
                       std::span<bf16> out) {
  const long long n = static_cast<long long>(out.size());
  if (n % F::block_size != 0 || static_cast<long long>(codes.size()) != n * F::element::storage_bits / 8 ||
      static_cast<long long>(scales.size()) != n / F::block_size)
    throw error("dequantize_vector: spans do not describe " + std::to_string(n) + " channels");
  for (long long i = 0; i < n; ++i) {
    const float s = decode<typename F::scale>(scales[i / F::block_size]);
    out[i] = F::dequantize(load_code<typename F::element>(codes.data(), i), s);
  }
}

//! The reference's in-place quantize-dequantize (QAT semantics): x <- bf16(q * s).
template <BlockFormat F>
void qdq_vector(std::span<bf16> x) {
  const std::size_t n = x.size();
  std::vector<std::uint8_t> codes(n * F::element::storage_bits / 8), scales(n / F::block_size);
  quantize_vector<F>(x, codes, scales);
  dequantize_vector<F>(codes, scales, x);
}

}  // namespace dsv4::numerics
