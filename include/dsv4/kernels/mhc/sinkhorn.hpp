#pragma once
//! \file
//! mHC coefficient split with Sinkhorn balancing (spec §3 `hc_split_sinkhorn`, §8), shared by the
//! host reference and the CUDA kernel (one token per call, all fp32).
//!
//! From the 24 mixes m of a token (hc_mult = 4):
//!   pre  = sigmoid(m[0:4] * scale0 + base[0:4]) + eps
//!   post = 2 * sigmoid(m[4:8] * scale1 + base[4:8])
//!   comb = m[8:24] * scale2 + base[8:24] as a 4 x 4 matrix (row-major), softmax over each row,
//!          + eps, divided by (column sums + eps); then iters - 1 times: rows / (row sums + eps),
//!          columns / (column sums + eps). The loop ends on a column normalization.
//! Each affine step is a rounded multiply followed by a rounded add (no fused multiply-add).

#include <cmath>

#include "dsv4/config.hpp"
#include "dsv4/numerics/bits.hpp"

namespace dsv4::kernels::mhc {

inline constexpr int hc = 4;
inline constexpr int mix_count = (2 + hc) * hc;  //!< 24

DSV4_HOST_DEVICE float exp_f32(float x) {
#if DSV4_DEVICE_PASS
  return expf(x);
#else
  return std::exp(x);
#endif
}

DSV4_HOST_DEVICE float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

//! One token: mixes[24], scale[3], base[24] -> pre[4], post[4], comb[16] (row-major).
DSV4_HOST_DEVICE void split_sinkhorn(const float* mixes, const float* scale, const float* base, int iters, float eps,
                                     float* pre, float* post, float* comb) {
  using numerics::mul_rn;
  for (int i = 0; i < hc; ++i) {
    pre[i] = sigmoid_f32(mul_rn(mixes[i], scale[0]) + base[i]) + eps;
    post[i] = 2.0f * sigmoid_f32(mul_rn(mixes[hc + i], scale[1]) + base[hc + i]);
  }
  float c[hc][hc];
  for (int r = 0; r < hc; ++r) {
    float mx = -INFINITY;
    for (int j = 0; j < hc; ++j) {
      c[r][j] = mul_rn(mixes[2 * hc + r * hc + j], scale[2]) + base[2 * hc + r * hc + j];
      mx = c[r][j] > mx ? c[r][j] : mx;
    }
    float sum = 0.0f;
    for (int j = 0; j < hc; ++j) sum += (c[r][j] = exp_f32(c[r][j] - mx));
    for (int j = 0; j < hc; ++j) c[r][j] = c[r][j] / sum + eps;
  }
  auto normalize_columns = [&] {
    for (int j = 0; j < hc; ++j) {
      float s = 0.0f;
      for (int r = 0; r < hc; ++r) s += c[r][j];
      for (int r = 0; r < hc; ++r) c[r][j] = c[r][j] / (s + eps);
    }
  };
  normalize_columns();
  for (int it = 0; it < iters - 1; ++it) {
    for (int r = 0; r < hc; ++r) {
      float s = 0.0f;
      for (int j = 0; j < hc; ++j) s += c[r][j];
      for (int j = 0; j < hc; ++j) c[r][j] = c[r][j] / (s + eps);
    }
    normalize_columns();
  }
  for (int r = 0; r < hc; ++r)
    for (int j = 0; j < hc; ++j) comb[r * hc + j] = c[r][j];
}

}  // namespace dsv4::kernels::mhc
