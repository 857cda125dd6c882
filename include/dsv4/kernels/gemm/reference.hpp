#pragma once
//! \file
//! Host references of the block-scaled GEMMs (spec §3 `fp8_gemm`, `fp4_gemm`): C = A W^T with
//! A in E4M3 with one UE8M0 scale per 32 activations (act_quant), and W either E4M3 with one
//! UE8M0 scale per 32 x 32 tile, or E2M1 (packed, even element low) with one UE8M0 scale per 32
//! along K. Per 32-wide K block: the block's dot product (exact in fp32 in practice; computed
//! here in double and rounded once), times both scales (exact), added to an fp32 accumulator in
//! increasing K order; the result is rounded once to bf16.

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/minifloat.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.hpp"

namespace dsv4::kernels::gemm {

using numerics::bf16;

struct gemm_shape {
  int m = 0, n = 0, k = 0;
};

namespace detail {
//! Every code's value of a format, decoded once (16 entries used for E2M1): the GEMMs read these
//! instead of decoding each element, which was most of the host tests' time.
template <class Elem, class T = float>
const std::array<T, 256>& decode_table() {
  static const std::array<T, 256> table = [] {
    std::array<T, 256> t{};
    for (int c = 0; c < (1 << Elem::storage_bits); ++c)
      t[std::size_t(c)] = T(numerics::decode<Elem>(std::uint8_t(c)));
    return t;
  }();
  return table;
}

//! C = A W^T by the spec's order (element values as doubles, which they are exactly): per 32-wide K block the
//! dot product in double (exact: E4M3 x E4M3 / E2M1 products and their sums fit in 53 bits, so its order does
//! not matter), rounded once to fp32, times the two scales, added in increasing K order. `decode_row(j,
//! values, scales)` writes weight row j's K values (double) and K / 32 block scales; the activations are
//! decoded once.
template <class DecodeRow>
std::vector<bf16> block_scaled_gemm(const gemm_shape& s, std::span<const std::uint8_t> a,
                                    std::span<const std::uint8_t> a_s, DecodeRow decode_row) {
  if (s.k % 32) throw error("block-scaled GEMM: K (" + std::to_string(s.k) + ") must be a multiple of 32");
  if (a.size() != std::size_t(s.m) * s.k || a_s.size() != std::size_t(s.m) * (s.k / 32))
    throw error("block-scaled GEMM: activations must be [M, K] E4M3 codes with [M, K/32] scales");
  const int blocks = s.k / 32;
  const auto& e4m3 = decode_table<numerics::e4m3, double>();
  const auto& ue8m0 = decode_table<numerics::ue8m0>();
  std::vector<double> av(a.size()), wv(static_cast<std::size_t>(s.k));
  std::vector<float> as(a_s.size()), ws(static_cast<std::size_t>(blocks));
  for (std::size_t i = 0; i < a.size(); ++i) av[i] = e4m3[a[i]];
  for (std::size_t i = 0; i < a_s.size(); ++i) as[i] = ue8m0[a_s[i]];
  std::vector<bf16> c(std::size_t(s.m) * s.n);
  for (int j = 0; j < s.n; ++j) {
    decode_row(j, wv.data(), ws.data());
    for (int i = 0; i < s.m; ++i) {
      const double* ar = av.data() + std::size_t(i) * s.k;
      const float* asr = as.data() + std::size_t(i) * blocks;
      float acc = 0.0f;
      for (int kb = 0; kb < blocks; ++kb) {
        // Four interleaved sums, met at the end: the same value as one sum in K order, because
        // every partial sum is exact (E4M3 values are multiples of 2^-9 up to 448, E2M1 ones of
        // 1/2 up to 6, so 32 products and all their sums are integers in units of 2^-18 below
        // 2^41, well inside double's 53 bits; a NaN code makes any order NaN; no inf exists).
        const double* x = ar + kb * 32;
        const double* y = wv.data() + std::size_t(kb) * 32;
        double p0 = 0, p1 = 0, p2 = 0, p3 = 0;
        for (int kk = 0; kk < 32; kk += 4) {
          p0 += x[kk] * y[kk];
          p1 += x[kk + 1] * y[kk + 1];
          p2 += x[kk + 2] * y[kk + 2];
          p3 += x[kk + 3] * y[kk + 3];
        }
        const double partial = (p0 + p1) + (p2 + p3);
        acc += numerics::mul_rn(numerics::mul_rn(float(partial), asr[kb]), ws[std::size_t(kb)]);
      }
      c[std::size_t(i) * s.n + j] = bf16::from_float(acc);
    }
  }
  return c;
}
}  // namespace detail

//! FP8 weights [N, K] with scales [ceil(N/32), K/32].
inline std::vector<bf16> fp8_gemm_reference(const gemm_shape& s, std::span<const std::uint8_t> a,
                                            std::span<const std::uint8_t> a_s, std::span<const std::uint8_t> w,
                                            std::span<const std::uint8_t> w_s) {
  const int nb = (s.n + 31) / 32, kb = s.k / 32;
  if (w.size() != std::size_t(s.n) * s.k || w_s.size() != std::size_t(nb) * kb)
    throw error("fp8_gemm_reference: weight must be [N, K] E4M3 with [ceil(N/32), K/32] scales");
  const auto& e4m3 = detail::decode_table<numerics::e4m3, double>();
  const auto& ue8m0 = detail::decode_table<numerics::ue8m0>();
  return detail::block_scaled_gemm(s, a, a_s, [&](int j, double* values, float* scales) {
    for (int k = 0; k < s.k; ++k) values[k] = e4m3[w[std::size_t(j) * s.k + k]];
    for (int b = 0; b < kb; ++b) scales[b] = ue8m0[w_s[std::size_t(j / 32) * kb + b]];
  });
}

//! FP4 weights [N, K/2] (two codes per byte) with scales [N, K/32].
inline std::vector<bf16> fp4_gemm_reference(const gemm_shape& s, std::span<const std::uint8_t> a,
                                            std::span<const std::uint8_t> a_s, std::span<const std::uint8_t> w,
                                            std::span<const std::uint8_t> w_s) {
  if (w.size() != std::size_t(s.n) * (s.k / 2) || w_s.size() != std::size_t(s.n) * (s.k / 32))
    throw error("fp4_gemm_reference: weight must be [N, K/2] packed E2M1 with [N, K/32] scales");
  const auto& e2m1 = detail::decode_table<numerics::e2m1, double>();
  const auto& ue8m0 = detail::decode_table<numerics::ue8m0>();
  return detail::block_scaled_gemm(s, a, a_s, [&](int j, double* values, float* scales) {
    const std::uint8_t* row = w.data() + std::size_t(j) * (s.k / 2);
    for (int k = 0; k < s.k; ++k) values[k] = e2m1[numerics::load_code<numerics::e2m1>(row, k)];
    for (int b = 0; b < s.k / 32; ++b) scales[b] = ue8m0[w_s[std::size_t(j) * (s.k / 32) + b]];
  });
}

//! act_quant (E4M3, one UE8M0 scale per 32) of one bf16 row: codes and scales (spec §3).
inline std::pair<std::vector<std::uint8_t>, std::vector<std::uint8_t>> act_quant_reference(std::span<const bf16> x) {
  std::vector<std::uint8_t> codes(x.size()), scales(x.size() / 32);
  numerics::quantize_vector<numerics::fp8_act_format>(x, codes, scales);
  return {std::move(codes), std::move(scales)};
}

//! The linear layer of an FP8 (fp4 = false) or FP4 (fp4 = true) weight [n, k] on one bf16 row
//! (spec §4): act_quant, then the block-scaled GEMM; bf16 out.
inline std::vector<bf16> block_scaled_linear_reference(std::span<const bf16> x, int n, std::span<const std::uint8_t> w,
                                                       std::span<const std::uint8_t> w_s, bool fp4) {
  const auto [a, a_s] = act_quant_reference(x);
  const gemm_shape s{1, n, int(x.size())};
  return fp4 ? fp4_gemm_reference(s, a, a_s, w, w_s) : fp8_gemm_reference(s, a, a_s, w, w_s);
}

}  // namespace dsv4::kernels::gemm
