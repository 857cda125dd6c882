#pragma once
//! \file
//! Host references of the plain (unquantized) linear layers (spec §4): y = x W^T with W [n, k].
//! bf16 layers accumulate in fp32 and round once to bf16; fp32 layers keep the fp32 result. The
//! reference accumulates in double and rounds once (a GEMM library's fp32 sum differs from it by
//! a few fp32 ulp at most). The block-scaled FP8 / FP4 GEMMs are issue 4's.

#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/numerics/bf16.hpp"

namespace dsv4::kernels::linear {

//! y[n] = sum_k x[k] * w[n * k_dim + k], as fp32.
inline std::vector<float> linear_fp32_reference(std::span<const float> x, std::span<const float> w, int n) {
  const std::size_t k = x.size();
  if (w.size() != k * std::size_t(n))
    throw error("linear_reference: weight has " + std::to_string(w.size()) + " values, expected " +
                std::to_string(n) + " x " + std::to_string(k));
  std::vector<float> y(static_cast<std::size_t>(n));
  for (int o = 0; o < n; ++o) {
    double acc = 0;
    const float* row = w.data() + std::size_t(o) * k;
    for (std::size_t i = 0; i < k; ++i) acc += double(x[i]) * double(row[i]);
    y[std::size_t(o)] = float(acc);
  }
  return y;
}

//! The same with the output rounded to bf16 (a plain bf16 GEMM with bf16 output).
inline std::vector<numerics::bf16> linear_bf16_reference(std::span<const float> x, std::span<const float> w, int n) {
  const auto y = linear_fp32_reference(x, w, n);
  std::vector<numerics::bf16> out(y.size());
  for (std::size_t i = 0; i < y.size(); ++i) out[i] = numerics::bf16::from_float(y[i]);
  return out;
}

inline std::vector<float> widen(std::span<const numerics::bf16> x) {
  std::vector<float> f(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) f[i] = x[i].to_float();
  return f;
}

}  // namespace dsv4::kernels::linear
