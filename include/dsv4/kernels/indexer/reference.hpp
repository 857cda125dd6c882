#pragma once
//! \file
//! Host reference of the lightning indexer's scoring and selection, and of the hierarchical
//! candidate pool (spec §7).
//!
//! Score of one query row against key t (every step rounds to bf16, as the reference's bf16
//! tensor ops do):  d_h = bf16(q_h . k_t);  I_t = bf16( sum_h bf16(relu(d_h) * w_h) )  with the
//! 32-head sum in fp32. q_h . k_t is each 32-channel block's sum, the blocks added in double in
//! channel order, rounded once to fp32 then bf16: a block's MXFP4 products are small multiples of
//! its two scales' product, so its sum is exact; the blocks' sums are added exactly while they lie
//! within 2^53 of each other, and beyond that (block scales at the two ends of UE8M0's range) both
//! this reference and the CUDA scans (a tensor-core accumulator per block, the blocks added in
//! double in the same order) round the same additions. A plain channel-by-channel double sum
//! would lose a tiny block's sum against a large block's products that cancel exactly (seen: a
//! 2^-110 block beside a block summing to 0 gave 0). q_h and k_t are the MXFP4
//! quantize-dequantized vectors; w_h =
//! bf16(weights_proj(x))_h * 2^-6 (exact). Masked positions score -inf.
//!
//! Selection: the k = min(topk, end_pos / ratio) largest scores in torch.topk's order
//! (`numerics::topk_order_key`: -0 below +0, every NaN above +inf and all NaNs tied), ties broken
//! toward the lowest index (PyTorch CUDA's observed behaviour, spec §7 and §18), returned in
//! ascending order, with every index >= the row's visible count replaced by -1 (those sit at the
//! end) and the rest shifted by `offset` (the window operand length), ready for sparse attention.
//! Scores from the scan are never NaN or -0; the order matters for other inputs.
//!
//! Candidate pool (the candidate-source layer only): block maxima over blocks of `block`
//! positions (in the same order: a NaN is a block's maximum, as torch's max propagates it), the
//! block of the newest visible position forced in, the top `topk_blocks` blocks whose score is
//! not -inf, expanded back to positions.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/order_key.hpp"

namespace dsv4::kernels::indexer {

using numerics::bf16;

//! Channels per MXFP4 block of the index vectors: the unit of the dot product's exact partial sums.
inline constexpr int index_block = numerics::index_key_format::block_size;

//! Scores of one query row against keys [0, n): q [heads, dim], w [heads] (scaled), keys [n, dim].
//! Positions t >= visible score -inf.
inline std::vector<float> index_scores_reference(std::span<const bf16> q, std::span<const bf16> w,
                                                 std::span<const bf16> keys, int heads, int dim, long long visible) {
  if (q.size() != std::size_t(heads) * dim || w.size() != std::size_t(heads) || keys.size() % std::size_t(dim))
    throw error("index_scores_reference: q must be [heads, dim], w [heads], keys [n, dim]");
  const long long n = static_cast<long long>(keys.size() / std::size_t(dim));
  std::vector<float> out(static_cast<std::size_t>(n));
  for (long long t = 0; t < n; ++t) {
    if (t >= visible) {
      out[std::size_t(t)] = -INFINITY;
      continue;
    }
    float sum = 0;  // fp32, heads in order (the CUDA kernel sums in the same order)
    for (int h = 0; h < heads; ++h) {
      double dot = 0;
      for (int c0 = 0; c0 < dim; c0 += index_block) {
        double block = 0;  // exact: products of bf16 values, multiples of the block scales' product
        for (int c = c0; c < std::min(dim, c0 + index_block); ++c)
          block += double(q[std::size_t(h) * dim + c].to_float()) * double(keys[std::size_t(t) * dim + c].to_float());
        dot += block;
      }
      const float d = numerics::round_to_bf16(float(dot));
      sum += numerics::round_to_bf16(std::max(d, 0.0f) * w[std::size_t(h)].to_float());
    }
    out[std::size_t(t)] = numerics::round_to_bf16(sum);
  }
  return out;
}

//! Indices of the k largest scores in torch.topk's order (`numerics::topk_order_key`; equal keys:
//! lowest index first), in ascending index order.
inline std::vector<std::int32_t> topk_lowest_index_ties(std::span<const float> scores, int k) {
  const int n = int(scores.size());
  if (k < 0 || k > n) throw error("topk: k = " + std::to_string(k) + " outside [0, " + std::to_string(n) + "]");
  std::vector<std::uint32_t> key(scores.size());
  for (std::size_t i = 0; i < scores.size(); ++i) key[i] = numerics::topk_order_key(scores[i]);
  std::vector<std::int32_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  // Integer keys: a strict weak order whatever the scores hold (NaN included); stable: ties keep
  // index order.
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return key[std::size_t(a)] > key[std::size_t(b)]; });
  order.resize(static_cast<std::size_t>(k));
  std::sort(order.begin(), order.end());
  return order;
}

//! The indexer's selection for one row (spec §7 "Selection"): k = min(topk, columns), ascending,
//! -1 for indices >= visible, the rest + offset.
inline std::vector<std::int32_t> select_reference(std::span<const float> scores, int topk, long long visible,
                                                  int offset) {
  const int k = std::min<int>(topk, int(scores.size()));
  std::vector<std::int32_t> idx = topk_lowest_index_ties(scores, k);
  for (auto& i : idx) i = i < visible ? i + offset : -1;
  std::stable_partition(idx.begin(), idx.end(), [](std::int32_t i) { return i >= 0; });
  return idx;
}

//! Candidate mask (one flag per position of `scores`) built from the candidate source's masked
//! scores: keeps at most `topk_blocks` blocks of `block` positions.
inline std::vector<std::uint8_t> candidate_mask_reference(std::span<const float> scores, long long visible,
                                                          int topk_blocks, int block) {
  if (block <= 0 || topk_blocks <= 0) throw error("candidate pool: block and topk_blocks must be positive");
  const int n = int(scores.size());
  const int blocks = (n + block - 1) / block;
  std::vector<float> bmax(static_cast<std::size_t>(blocks), -INFINITY);
  for (int t = 0; t < n; ++t) {  // the maximum by key, as the CUDA block_max_kernel: NaN wins
    float& m = bmax[std::size_t(t / block)];
    if (numerics::topk_order_key(scores[std::size_t(t)]) > numerics::topk_order_key(m)) m = scores[std::size_t(t)];
  }
  if (visible > 0) bmax[std::size_t((visible - 1) / block)] = INFINITY;  // the newest visible block is always kept
  const auto top = topk_lowest_index_ties(bmax, std::min(topk_blocks, blocks));
  std::vector<std::uint8_t> mask(static_cast<std::size_t>(n), 0);
  for (std::int32_t b : top) {
    if (bmax[std::size_t(b)] == -INFINITY) continue;  // only blocks with a finite (or forced) score
    for (int t = b * block; t < std::min(n, (b + 1) * block); ++t) mask[std::size_t(t)] = 1;
  }
  return mask;
}

//! A Reindex layer's scores restricted to the pool: non-candidates become -inf.
inline void apply_candidate_mask(std::span<float> scores, std::span<const std::uint8_t> mask) {
  if (scores.size() != mask.size()) throw error("apply_candidate_mask: scores and mask differ in length");
  for (std::size_t t = 0; t < scores.size(); ++t)
    if (!mask[t]) scores[t] = -INFINITY;
}

}  // namespace dsv4::kernels::indexer
