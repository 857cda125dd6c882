#pragma once
//! \file
//! Token sampling (spec §13 `sample`), host reference; the noise and the filters are
//! DSV4_HOST_DEVICE so a CUDA sampler draws the same tokens from the same logits.
//!
//! The reference: temperature 0 takes the argmax; otherwise p = softmax(logits / max(T, 1e-5)) in
//! fp32 and the token is argmax(p / E) with E ~ Exp(1) per vocabulary entry (the Gumbel-max trick:
//! a draw from p). Ours adds two optional filters before the noise, off by default: top-k keeps
//! the k most probable tokens, top-p the smallest most-probable prefix whose mass reaches p; the
//! others cannot be drawn. Ties rank the lower token id first (torch.argmax's first occurrence).
//!
//! Noise: the reference draws E from torch's generator, whose stream no engine reproduces. Ours is
//! counter-based: E = -log(u) with u in (0, 1] from a SplitMix64 hash of (seed, sequence, step,
//! token id), so a draw depends only on those four numbers: reproducible, batch-independent, and
//! the same on host and device.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "dsv4/config.hpp"
#include "dsv4/core/error.hpp"

namespace dsv4::kernels::sampling {

struct sampling_params {
  float temperature = 1.0f;  //!< 0: greedy (argmax)
  int top_k = 0;             //!< keep the k most probable tokens; 0: off
  float top_p = 1.0f;        //!< keep the smallest prefix of mass >= top_p; 1: off
  std::uint64_t seed = 0;
};

DSV4_HOST_DEVICE std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

//! Exp(1) noise of one (seed, sequence, step, token): -log(u), u = (k + 1) / 2^53 in (0, 1].
DSV4_HOST_DEVICE double exponential_noise(std::uint64_t seed, std::uint64_t sequence, std::uint64_t step,
                                          std::uint64_t token) {
  const std::uint64_t h = splitmix64(splitmix64(splitmix64(splitmix64(seed) ^ sequence) ^ step) ^ token);
  const double u = double((h >> 11) + 1) * 0x1p-53;
#if DSV4_DEVICE_PASS
  return -::log(u);
#else
  return -std::log(u);
#endif
}

//! Checks the parameters; throws dsv4::error naming the problem after `where` (the caller and row).
inline void check_sampling_params(const sampling_params& p, const std::string& where) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
    throw error(where + "temperature must be a finite value >= 0 (got " + std::to_string(p.temperature) + ")");
  if (p.top_k < 0) throw error(where + "top_k must be >= 0 (0 turns it off)");
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) throw error(where + "top_p must be in (0, 1] (1 turns it off)");
}

//! Checks the logits and the parameters; throws dsv4::error naming the problem.
inline void check_sampling(std::span<const float> logits, const sampling_params& p) {
  if (logits.empty()) throw error("sample: empty logits");
  check_sampling_params(p, "sample: ");
  for (std::size_t i = 0; i < logits.size(); ++i)
    if (std::isnan(logits[i]))
      throw error("sample: logit " + std::to_string(i) + " is NaN (the model produced an invalid value)");
}

//! The fp32 probabilities softmax(logits / max(T, 1e-5)) (sum in double, one division each).
inline std::vector<float> probabilities(std::span<const float> logits, float temperature) {
  const float t = std::max(temperature, 1e-5f);
  std::vector<float> scaled(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) scaled[i] = logits[i] / t;
  const float mx = *std::max_element(scaled.begin(), scaled.end());
  std::vector<float> p(scaled.size());
  double sum = 0;
  for (std::size_t i = 0; i < p.size(); ++i) sum += (p[i] = std::exp(scaled[i] - mx));
  for (auto& v : p) v = float(double(v) / sum);
  return p;
}

//! Zeroes every probability the top-k and top-p filters remove (ranking: p descending, then id).
inline void apply_filters(std::vector<float>& p, int top_k, float top_p) {
  if (top_k == 0 && top_p >= 1.0f) return;
  std::vector<std::size_t> order(p.size());
  std::iota(order.begin(), order.end(), std::size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return p[a] > p[b]; });
  std::size_t keep = top_k > 0 ? std::min<std::size_t>(std::size_t(top_k), p.size()) : p.size();
  if (top_p < 1.0f) {
    double mass = 0;
    std::size_t n = 0;
    while (n < keep && mass < double(top_p)) mass += p[order[n++]];
    keep = std::max<std::size_t>(n, 1);
  }
  for (std::size_t r = keep; r < order.size(); ++r) p[order[r]] = 0.0f;
}

//! One token id from `logits` (one row) at decode step `step` of sequence `sequence`.
inline int sample_reference(std::span<const float> logits, const sampling_params& params, std::uint64_t sequence,
                            std::uint64_t step) {
  check_sampling(logits, params);
  if (params.temperature == 0.0f)  // greedy; the filters cannot change the argmax
    return int(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<float> p = probabilities(logits, params.temperature);
  apply_filters(p, params.top_k, params.top_p);
  int best = -1;
  double best_score = -1.0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (p[i] <= 0.0f) continue;  // filtered out, or underflowed: cannot be drawn
    const double score = double(p[i]) / exponential_noise(params.seed, sequence, step, i);
    if (score > best_score) best_score = score, best = int(i);
  }
  if (best < 0)  // every probability underflowed but the maximum's is 1: unreachable, kept defined
    best = int(std::max_element(logits.begin(), logits.end()) - logits.begin());
  return best;
}

}  // namespace dsv4::kernels::sampling
