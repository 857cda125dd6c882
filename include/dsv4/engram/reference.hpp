#pragma once
//! \file
//! Host reference of the Engram module's forward pass for one token (spec §10, "Forward"):
//!   1. e = bf16(fp32(q) * fp32(scale)) for each looked-up FP8 row (one UE8M0 scale per 32 columns),
//!      the rows of all tables concatenated in column order;
//!   2. kv = wkv(e): FP8 GEMM (e re-quantized per 32 by act_quant), bf16 out;
//!   3. key = kv[: hc * dim] as [hc, dim], value = kv[hc * dim :];
//!   4. per stream c (fp32): rstd_c = rsqrt(mean h_c^2 + eps) rsqrt(mean key_c^2 + eps),
//!      dot_c = (sum_d h_{c,d} w_{c,d} key_{c,d}) rstd_c dim^-1/2 with w = q_weight * k_weight;
//!   5. gate_c = sigmoid(copysign(sqrt(max(|dot_c|, 1e-6)), dot_c)), 0 for image-span tokens;
//!   6. X_c <- bf16(h_c + gate_c value), the same value for every stream, one rounding.

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/gemm/reference.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/minifloat.hpp"
#include "dsv4/numerics/quantize.hpp"

namespace dsv4::engram {

using numerics::bf16;

struct engram_weights {
  int hc = 4, dim = 0, head_dim = 0, columns = 0;  //!< columns = (max_ngram - 1) * n_heads
  long long rows = 0;                              //!< embedding rows (sum of the tables' primes)
  std::vector<std::uint8_t> embed;                 //!< [rows, head_dim] E4M3 codes
  std::vector<std::uint8_t> embed_scale;           //!< [rows, head_dim / 32] UE8M0
  //! The table read in place instead (a memory-mapped checkpoint: V4.1's tables are ~100 GB
  //! each, not worth a copy); when set, `embed` / `embed_scale` stay empty. Whoever sets them
  //! keeps that memory alive while these weights are used (model::engram_tables::mapped: the
  //! checkpoint).
  std::span<const std::uint8_t> mapped_embed, mapped_embed_scale;
  std::vector<std::uint8_t> wkv, wkv_scale;        //!< FP8 [dim * (hc + 1), columns * head_dim], 32 x 32 scales
  std::vector<float> q_weight, k_weight;           //!< [hc, dim], bf16 values
  float eps = 1e-20f;

  //! The table's codes [rows, head_dim] and scales [rows, head_dim / 32], wherever they live.
  std::span<const std::uint8_t> table_codes() const { return mapped_embed.data() ? mapped_embed : std::span<const std::uint8_t>(embed); }
  std::span<const std::uint8_t> table_scales() const {
    return mapped_embed_scale.data() ? mapped_embed_scale : std::span<const std::uint8_t>(embed_scale);
  }

  void check() const {
    const long long k = 1ll * columns * head_dim, n = 1ll * dim * (hc + 1);
    if (head_dim % 32 || k % 32) throw error("engram: head_dim must be a multiple of 32");
    if (table_codes().size() != std::size_t(rows * head_dim) || table_scales().size() != std::size_t(rows * (head_dim / 32)))
      throw error("engram: embed must be [rows, head_dim] with [rows, head_dim / 32] scales");
    if (wkv.size() != std::size_t(n * k) || wkv_scale.size() != std::size_t(((n + 31) / 32) * (k / 32)))
      throw error("engram: wkv must be [dim * (hc + 1), columns * head_dim] FP8 with 32 x 32 scales");
    if (q_weight.size() != std::size_t(hc) * dim || k_weight.size() != q_weight.size())
      throw error("engram: q_weight and k_weight must be [hc, dim]");
  }
};

//! What the module adds for one token: value_{d} times gate_c on stream c.
struct engram_mix {
  std::vector<float> gates;  //!< [hc]
  std::vector<bf16> value;   //!< [dim]
};

//! Step 1 for one token: its `columns` embedding rows, dequantized to bf16 and concatenated
//! ([columns * head_dim]).
inline std::vector<bf16> engram_rows_reference(const engram_weights& w, std::span<const std::int64_t> hashes) {
  if (hashes.size() != std::size_t(w.columns)) throw error("engram: hashes must be [columns]");
  std::vector<bf16> e(std::size_t(w.columns) * std::size_t(w.head_dim));
  const auto codes = w.table_codes(), scales = w.table_scales();
  for (int c = 0; c < w.columns; ++c) {
    const std::int64_t row = hashes[std::size_t(c)];
    if (row < 0 || row >= w.rows) throw error("engram: hash row " + std::to_string(row) + " outside the table");
    for (int d = 0; d < w.head_dim; ++d) {
      const float q = numerics::decode<numerics::e4m3>(codes[std::size_t(row) * w.head_dim + d]);
      const float s = numerics::decode<numerics::ue8m0>(scales[std::size_t(row) * (w.head_dim / 32) + d / 32]);
      e[std::size_t(c) * w.head_dim + d] = bf16::from_float(numerics::mul_rn(q, s));
    }
  }
  return e;
}

//! Steps 2-5 for one token: x [hc, dim] (read only) and its gathered rows e [columns * head_dim]
//! (step 1; a tensor-parallel rank all-reduces them first) -> the gates and the value.
inline engram_mix engram_mix_reference(const engram_weights& w, std::span<const bf16> x, std::span<const bf16> e,
                                       bool image_token) {
  w.check();
  const int k = w.columns * w.head_dim;
  if (x.size() != std::size_t(w.hc) * w.dim || e.size() != std::size_t(k))
    throw error("engram: x must be [hc, dim] and the gathered rows [columns * head_dim]");
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(k)), scales(static_cast<std::size_t>(k / 32));
  numerics::quantize_vector<numerics::fp8_act_format>(e, codes, scales);
  const int n = w.dim * (w.hc + 1);
  const auto kv = kernels::gemm::fp8_gemm_reference({1, n, k}, codes, scales, w.wkv, w.wkv_scale);
  engram_mix mix;
  mix.value.assign(kv.begin() + std::ptrdiff_t(w.hc) * w.dim, kv.end());
  for (int c = 0; c < w.hc; ++c) {
    double hh = 0, kk = 0, dot = 0;
    for (int d = 0; d < w.dim; ++d) {
      const float h = x[std::size_t(c) * w.dim + d].to_float();
      const float key = kv[std::size_t(c) * w.dim + d].to_float();
      const float wd = numerics::mul_rn(w.q_weight[std::size_t(c) * w.dim + d], w.k_weight[std::size_t(c) * w.dim + d]);
      hh += double(h) * h;
      kk += double(key) * key;
      dot += double(numerics::mul_rn(numerics::mul_rn(h, wd), key));
    }
    const float rstd = (1.0f / std::sqrt(float(hh / w.dim) + w.eps)) * (1.0f / std::sqrt(float(kk / w.dim) + w.eps));
    const float dc = float(dot) * rstd * (1.0f / std::sqrt(float(w.dim)));
    const float signed_root = std::copysign(std::sqrt(std::max(std::fabs(dc), 1e-6f)), dc);
    mix.gates.push_back(image_token ? 0.0f : 1.0f / (1.0f + std::exp(-signed_root)));
  }
  return mix;
}

//! Steps 1-5 for one token: x [hc, dim] (read only), `hashes` its `columns` embedding row ids.
inline engram_mix engram_gates_reference(const engram_weights& w, std::span<const bf16> x,
                                         std::span<const std::int64_t> hashes, bool image_token) {
  w.check();
  if (x.size() != std::size_t(w.hc) * w.dim || hashes.size() != std::size_t(w.columns))
    throw error("engram: x must be [hc, dim] and hashes [columns]");
  return engram_mix_reference(w, x, engram_rows_reference(w, hashes), image_token);
}

//! Step 6 for one token: x [hc, dim] += gate_c value on each stream c.
inline void apply_engram_mix(const engram_weights& w, const engram_mix& mix, std::span<bf16> x) {
  for (int c = 0; c < w.hc; ++c)
    for (int d = 0; d < w.dim; ++d) {
      bf16& xv = x[std::size_t(c) * w.dim + d];
      xv = bf16::from_float(xv.to_float() + numerics::mul_rn(mix.gates[std::size_t(c)], mix.value[std::size_t(d)].to_float()));
    }
}

//! The whole step for one token: x [hc, dim] updated in place (step 6).
inline void engram_forward_reference(const engram_weights& w, std::span<bf16> x, std::span<const std::int64_t> hashes,
                                     bool image_token) {
  apply_engram_mix(w, engram_gates_reference(w, x, hashes, image_token), x);
}

}  // namespace dsv4::engram
