#pragma once
//! \file
//! Host reference of sparse attention with a sink (spec §3 `sparse_attn`, §5 combine).
//!
//! One latent KV head (K = V, all channels), `heads` query heads. Each query row attends to the
//! entries its index list names (-1 = none), in the list's stored order, in chunks of 64 with an
//! online softmax whose probabilities are rounded to bf16 relative to the running maximum before
//! they weight the values: the reference's exact recurrence, so the list order and the chunk
//! boundaries matter at the bit level. The sink adds exp(sink_h - m) to the denominator only (it
//! is not multiplied by the softmax scale). A row with no valid index yields zeros.
//!
//! Written for clarity, not speed: dot products accumulate in double and are rounded once to
//! fp32 (the reference's fp32 tensor-core sum differs from it by a few fp32 ulp at most).

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/numerics/bf16.hpp"

namespace dsv4::kernels::attention {

inline constexpr int sparse_chunk = 64;  //!< kernel.py's block of indices per online-softmax step

struct sparse_attention_problem {
  int rows = 0;       //!< query rows (tokens) of one sequence
  int heads = 0;      //!< query heads
  int dim = 0;        //!< channels per head = latent KV width
  int entries = 0;    //!< rows of the kv operand
  int topk = 0;       //!< index-list length per row
  float scale = 0;    //!< softmax scale (head_dim^-0.5)
};

//! q [rows, heads, dim] bf16, kv [entries, dim] bf16, sink [heads] fp32, idx [rows, topk] int32
//! (-1 = none) -> out [rows, heads, dim] bf16.
inline void sparse_attention_reference(const sparse_attention_problem& p, std::span<const numerics::bf16> q,
                                       std::span<const numerics::bf16> kv, std::span<const float> sink,
                                       std::span<const std::int32_t> idx, std::span<numerics::bf16> out) {
  using numerics::bf16;
  const auto need = [](std::size_t got, long long want, const char* what) {
    if (static_cast<long long>(got) != want)
      throw error(std::string("sparse_attention_reference: ") + what + " has " + std::to_string(got) +
                  " elements, expected " + std::to_string(want));
  };
  need(q.size(), 1ll * p.rows * p.heads * p.dim, "q");
  need(kv.size(), 1ll * p.entries * p.dim, "kv");
  need(sink.size(), p.heads, "sink");
  need(idx.size(), 1ll * p.rows * p.topk, "idx");
  need(out.size(), 1ll * p.rows * p.heads * p.dim, "out");
  for (std::int32_t j : idx)
    if (j < -1 || j >= p.entries)
      throw error("sparse_attention_reference: index " + std::to_string(j) + " outside [-1, " +
                  std::to_string(p.entries) + ")");

  std::vector<float> acc(std::size_t(p.dim)), chunk(std::size_t(p.dim)), s(sparse_chunk), prob(sparse_chunk);
  for (int r = 0; r < p.rows; ++r) {
    const std::int32_t* row_idx = idx.data() + std::size_t(r) * p.topk;
    for (int h = 0; h < p.heads; ++h) {
      const bf16* qv = q.data() + (std::size_t(r) * p.heads + h) * p.dim;
      float m = -1e30f, l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int c0 = 0; c0 < p.topk; c0 += sparse_chunk) {
        const int n = std::min(sparse_chunk, p.topk - c0);
        float chunk_max = -INFINITY;
        for (int j = 0; j < n; ++j) {
          const std::int32_t e = row_idx[c0 + j];
          if (e < 0) {
            s[j] = -INFINITY;
            continue;
          }
          double dot = 0;
          const bf16* k = kv.data() + std::size_t(e) * p.dim;
          for (int d = 0; d < p.dim; ++d) dot += double(qv[d].to_float()) * double(k[d].to_float());
          s[j] = numerics::mul_rn(float(dot), p.scale);
          chunk_max = std::max(chunk_max, s[j]);
        }
        const float m_new = std::max(m, chunk_max);
        const float alpha = std::exp(m - m_new);
        float psum = 0;
        for (int j = 0; j < n; ++j) {
          prob[j] = std::exp(s[j] - m_new);  // exp(-inf) = 0 for empty slots
          psum += prob[j];
        }
        l = numerics::mul_rn(l, alpha) + psum;
        // acc <- acc * alpha + sum_j bf16(p_j) kv_j, the chunk's sum formed first (spec §3).
        std::fill(chunk.begin(), chunk.end(), 0.0f);
        for (int j = 0; j < n; ++j) {
          const std::int32_t e = row_idx[c0 + j];
          if (e < 0) continue;
          const float pb = numerics::round_to_bf16(prob[j]);  // bf16 probabilities weight the values
          const bf16* v = kv.data() + std::size_t(e) * p.dim;
          for (int d = 0; d < p.dim; ++d) chunk[std::size_t(d)] += numerics::mul_rn(pb, v[d].to_float());
        }
        for (int d = 0; d < p.dim; ++d) acc[std::size_t(d)] = numerics::mul_rn(acc[std::size_t(d)], alpha) + chunk[std::size_t(d)];
        m = m_new;
      }
      l += std::exp(sink[std::size_t(h)] - m);
      bf16* o = out.data() + (std::size_t(r) * p.heads + h) * p.dim;
      for (int d = 0; d < p.dim; ++d) o[d] = bf16::from_float(acc[std::size_t(d)] / l);
    }
  }
}

}  // namespace dsv4::kernels::attention
