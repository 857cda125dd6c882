#pragma once
//! \file
//! Host reference of single-pass mHC (spec §8): the residual is `hc` streams of `dim` bf16
//! values. Per sublayer:
//!   hc_mixes(X): m = (flatten(X) . fn^T) * rsqrt(mean(flatten(X)^2) + eps)   (fp32; 24 mixes)
//!   split_sinkhorn(m) -> pre, post, comb                                      (sinkhorn.hpp)
//!   hc_pre(X, a)  = bf16(sum_c a_c X_c)
//!   hc_post(F, X) = bf16(post_j F + sum_i comb[i][j] X_i)   (the sum over i first)
//! and a block runs attention on hc_pre(X, pre of the previous sublayer) and the FFN on
//! hc_pre(X1, pre of this block's attention mixes): X_{l+1} = B_l X_l + C_l F_l(A_{l-1} X_l).

#include <cmath>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/mhc/sinkhorn.hpp"
#include "dsv4/kernels/norm/reference.hpp"
#include "dsv4/numerics/bf16.hpp"

namespace dsv4::kernels::mhc {

using numerics::bf16;

//! Parameters of one sublayer's mixes: fn [24, hc * dim], base [24], scale [3] (all fp32).
struct mix_params {
  std::vector<float> fn, base, scale;
  int iters = 20;
  float hc_eps = 1e-6f;
  float norm_eps = 1e-20f;
};

struct coefficients {
  float pre[hc], post[hc], comb[hc * hc];
};

//! hc_mixes + split_sinkhorn for one token; x is [hc, dim] (stream-major, as flattened).
inline coefficients hc_coefficients(std::span<const bf16> x, int dim, const mix_params& p) {
  const std::size_t n = std::size_t(hc) * dim;
  if (x.size() != n || p.fn.size() != std::size_t(mix_count) * n || p.base.size() != std::size_t(mix_count) ||
      p.scale.size() != 3)
    throw error("hc_coefficients: x must be [4, dim], fn [24, 4 * dim], base [24], scale [3]");
  double ss = 0;
  for (bf16 v : x) ss += double(v.to_float()) * v.to_float();
  const float r = 1.0f / std::sqrt(float(ss / double(n)) + p.norm_eps);
  float m[mix_count];
  for (int j = 0; j < mix_count; ++j) {
    double dot = 0;
    for (std::size_t i = 0; i < n; ++i) dot += double(x[i].to_float()) * double(p.fn[std::size_t(j) * n + i]);
    m[j] = numerics::mul_rn(float(dot), r);  // the fp32 projection first, then the per-token statistic
  }
  coefficients c;
  split_sinkhorn(m, p.scale.data(), p.base.data(), p.iters, p.hc_eps, c.pre, c.post, c.comb);
  return c;
}

//! bf16(sum_c a_c X_c), fp32 products and sum in stream order.
inline std::vector<bf16> hc_pre(std::span<const bf16> x, int dim, const float (&a)[hc]) {
  std::vector<bf16> y(static_cast<std::size_t>(dim));
  for (int d = 0; d < dim; ++d) {
    float s = 0.0f;
    for (int c = 0; c < hc; ++c) s += numerics::mul_rn(a[c], x[std::size_t(c) * dim + d].to_float());
    y[std::size_t(d)] = bf16::from_float(s);
  }
  return y;
}

//! Y_j = bf16(post_j F + sum_i comb[i][j] X_i).
inline std::vector<bf16> hc_post(std::span<const bf16> f, std::span<const bf16> x, int dim, const coefficients& c) {
  std::vector<bf16> y(std::size_t(hc) * dim);
  for (int j = 0; j < hc; ++j)
    for (int d = 0; d < dim; ++d) {
      float mix = 0.0f;
      for (int i = 0; i < hc; ++i) mix += numerics::mul_rn(c.comb[i * hc + j], x[std::size_t(i) * dim + d].to_float());
      y[std::size_t(j) * dim + d] = bf16::from_float(numerics::mul_rn(c.post[j], f[std::size_t(d)].to_float()) + mix);
    }
  return y;
}

//! The pre-mix of layer 0: one-hot on stream 0.
inline void identity_pre_mix(float (&a)[hc]) {
  for (int c = 0; c < hc; ++c) a[c] = c == 0 ? 1.0f : 0.0f;
}

using sublayer = std::function<std::vector<bf16>(std::span<const bf16>)>;

//! Block.forward of the reference for one token: returns the new streams and writes the pre-mix
//! the next block's attention consumes.
inline std::vector<bf16> block_forward(std::span<const bf16> x, int dim, float (&pre_mix)[hc], const mix_params& attn_mix,
                                       const mix_params& ffn_mix, const sublayer& attn, const sublayer& ffn) {
  const coefficients a = hc_coefficients(x, dim, attn_mix);
  const std::vector<bf16> x1 = hc_post(attn(hc_pre(x, dim, pre_mix)), x, dim, a);
  const coefficients f = hc_coefficients(x1, dim, ffn_mix);
  const std::vector<bf16> x2 = hc_post(ffn(hc_pre(x1, dim, a.pre)), x1, dim, f);
  for (int c = 0; c < hc; ++c) pre_mix[c] = f.pre[c];
  return x2;
}

//! What a sublayer boundary computes for one token (the CUDA `mhc_step` fuses all of it):
//!   Y    = hc_post(F, X, post, comb)          (the new streams; Y = X where there is no F)
//!   h    = rmsnorm(hc_pre(Y, pre), norm_w)    (the next sublayer's input)
//!   next = hc_coefficients(Y, next mix params) (skipped when `next` is null)
//! After the attention `pre` is the attention's own a_pre; after the FFN it is f_pre; at the
//! model's entry (no F) the one-hot pre-mix; at the exit (no next) the last f_pre.
struct step_result {
  std::vector<bf16> y, h;
  coefficients next{};
};

inline step_result boundary_step_reference(std::span<const bf16> x, std::span<const bf16> f, int dim,
                                           const coefficients& applied, const float (&pre)[hc],
                                           std::span<const float> norm_w, float norm_eps, const mix_params* next) {
  if (x.size() != std::size_t(hc) * dim || (!f.empty() && f.size() != std::size_t(dim)) || norm_w.size() != std::size_t(dim))
    throw error("boundary_step_reference: x must be [4, dim], f [dim] or empty, norm_w [dim]");
  step_result r;
  r.y = f.empty() ? std::vector<bf16>(x.begin(), x.end()) : hc_post(f, x, dim, applied);
  const auto mixed = hc_pre(r.y, dim, pre);
  std::vector<float> mf(mixed.size());
  for (std::size_t i = 0; i < mixed.size(); ++i) mf[i] = mixed[i].to_float();
  r.h.resize(std::size_t(dim));
  norm::rmsnorm_reference(mf, norm_w, norm_eps, r.h);
  if (next) r.next = hc_coefficients(r.y, dim, *next);
  return r;
}

}  // namespace dsv4::kernels::mhc
