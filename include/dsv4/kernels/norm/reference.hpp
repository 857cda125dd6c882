#pragma once
//! \file
//! Host reference of RMSNorm (spec §4): y = round(w * (x * rsqrt(mean(x^2) + eps))), with x
//! widened to fp32, the mean of squares in fp32 (accumulated here in double, rounded once), the
//! normalized value multiplied by the fp32 weight and rounded once to bf16.

#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/numerics/bf16.hpp"

namespace dsv4::kernels::norm {

//! Normalizes one vector. `x` may be bf16 or fp32 values (as float); `w` the weight as float.
inline void rmsnorm_reference(std::span<const float> x, std::span<const float> w, float eps,
                              std::span<numerics::bf16> y) {
  if (x.size() != w.size() || y.size() != x.size())
    throw error("rmsnorm_reference: x, w and y must have the same length (" + std::to_string(x.size()) + ", " +
                std::to_string(w.size()) + ", " + std::to_string(y.size()) + ")");
  double ss = 0;
  for (float v : x) ss += double(v) * double(v);
  const float mean = float(ss / double(x.size()));
  const float r = 1.0f / std::sqrt(mean + eps);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const volatile float normed = x[i] * r;  // the product is rounded before the weight multiplies it
    y[i] = numerics::bf16::from_float(w[i] * normed);
  }
}

//! The same for a bf16 row: returns the normalized bf16 row.
inline std::vector<numerics::bf16> rmsnorm_bf16_reference(std::span<const numerics::bf16> x, std::span<const float> w,
                                                          float eps) {
  std::vector<float> xf(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) xf[i] = x[i].to_float();
  std::vector<numerics::bf16> y(x.size());
  rmsnorm_reference(xf, w, eps, y);
  return y;
}

}  // namespace dsv4::kernels::norm
