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
//!
//! Same bits on host and device, by construction (the CUDA sampler, sampling.cuh, calls these very
//! functions): the exponential and the logarithm are our own (range reduction and a polynomial in
//! single-rounding fp64 operations, numerics/bits.hpp), not libm's or CUDA's, which differ in the
//! last bits; the softmax denominator and the top-p masses are sums of fixed-point integers
//! (multiples of 2^-62), which no summation order can change. A probability is
//! float(e_i * (1 / S)): e_i = exp(x_i / T - max) rounded to float, S = the fixed-point sum of
//! the e_i. What this costs against a plain fp32 softmax: nothing a float can show (the fixed-point
//! sum truncates each term by < 2^-62; e_i is within an ulp of the correctly rounded value).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "dsv4/config.hpp"
#include "dsv4/core/error.hpp"
#include "dsv4/numerics/bits.hpp"
#include "dsv4/numerics/fp64.hpp"

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

//! exp(x) for x <= 0 as a float, identical on host and device: x = k ln2 + r (|r| <= ln2 / 2), a
//! degree-12 Taylor polynomial of exp(r) in fp64 (truncation < 2e-16), the power of two from bits,
//! one rounding to float. Results below FLT_MIN are 0 (no subnormals: none reach a draw).
DSV4_HOST_DEVICE float sampler_exp(float x) {
  if (!(x > -87.5f)) return 0.0f;  // e^-87.5 < FLT_MIN; also -inf (and NaN, which callers exclude)
  const double xd = x;
  const double k = numerics::round_half_even(numerics::mul_rn(xd, 1.4426950408889634));  // x / ln2
  double r = numerics::fma_rn(-k, 6.93147180369123816490e-01, xd);  // ln2's high part (exact product)
  r = numerics::fma_rn(-k, 1.90821492927058770002e-10, r);          // and its low part
  using numerics::fma_rn;                                           // Horner's rule, one rounding a step
  double q = fma_rn(1.0 / 479001600, r, 1.0 / 39916800);
  q = fma_rn(q, r, 1.0 / 3628800);
  q = fma_rn(q, r, 1.0 / 362880);
  q = fma_rn(q, r, 1.0 / 40320);
  q = fma_rn(q, r, 1.0 / 5040);
  q = fma_rn(q, r, 1.0 / 720);
  q = fma_rn(q, r, 1.0 / 120);
  q = fma_rn(q, r, 1.0 / 24);
  q = fma_rn(q, r, 1.0 / 6);
  q = fma_rn(q, r, 0.5);
  q = fma_rn(q, r, 1.0);
  q = fma_rn(q, r, 1.0);
  const double two_k = numerics::bits_to_double(std::uint64_t(1023 + int(k)) << 52);  // k in [-127, 0]
  const float e = numerics::to_float_rn(numerics::mul_rn(q, two_k));
  return e >= 1.17549435e-38f ? e : 0.0f;
}

//! log(u) for u in (0, 1] in fp64, identical on host and device: u = 2^k m with m in
//! [sqrt(1/2), sqrt(2)), log m = 2 atanh((m - 1) / (m + 1)) by its series to s^23 (|s| < 0.172:
//! truncation < 1e-18), plus k ln2.
DSV4_HOST_DEVICE double sampler_log(double u) {
  const std::uint64_t b = numerics::double_to_bits(u);
  int k = int((b >> 52) & 0x7ff) - 1023;  // u is a normal double: u >= 2^-53
  double m = numerics::bits_to_double((b & 0x000fffffffffffffull) | 0x3ff0000000000000ull);  // [1, 2)
  if (m > 1.4142135623730951) m = numerics::mul_rn(m, 0.5), ++k;
  const double s = numerics::div_rn(numerics::add_rn(m, -1.0), numerics::add_rn(m, 1.0));
  const double z = numerics::mul_rn(s, s);
  using numerics::fma_rn;
  double q = fma_rn(2.0 / 23, z, 2.0 / 21);
  q = fma_rn(q, z, 2.0 / 19);
  q = fma_rn(q, z, 2.0 / 17);
  q = fma_rn(q, z, 2.0 / 15);
  q = fma_rn(q, z, 2.0 / 13);
  q = fma_rn(q, z, 2.0 / 11);
  q = fma_rn(q, z, 2.0 / 9);
  q = fma_rn(q, z, 2.0 / 7);
  q = fma_rn(q, z, 2.0 / 5);
  q = fma_rn(q, z, 2.0 / 3);
  // log m = 2s + s z q; then + k ln2 (high and low parts)
  const double log_m = fma_rn(numerics::mul_rn(s, z), q, numerics::mul_rn(2.0, s));
  const double kd = double(k);
  return fma_rn(kd, 6.93147180369123816490e-01, fma_rn(kd, 1.90821492927058770002e-10, log_m));
}

//! Exp(1) noise of one (seed, sequence, step, token): -log(u), u = (k + 1) / 2^53 in (0, 1].
DSV4_HOST_DEVICE double exponential_noise(std::uint64_t seed, std::uint64_t sequence, std::uint64_t step,
                                          std::uint64_t token) {
  const std::uint64_t h = splitmix64(splitmix64(splitmix64(splitmix64(seed) ^ sequence) ^ step) ^ token);
  const double u = double((h >> 11) + 1) * 0x1p-53;  // exact: an integer below 2^54 times a power of 2
  return -sampler_log(u);
}

//! A value in [0, 2) as a fixed-point integer, a multiple of 2^-62, truncated: the sums of these
//! (the softmax denominator, the top-p masses) are exact and so independent of their order.
DSV4_HOST_DEVICE std::uint64_t to_fixed62(float v) {
  return numerics::double_to_u64_rz(numerics::mul_rn(double(v), 0x1p62));
}
inline constexpr double fixed62_unit = 0x1p-62;

//! An exact sum of up to 2^64 fixed-point terms (128 bits: each term < 2^63).
struct fixed_sum {
  std::uint64_t hi = 0, lo = 0;
  DSV4_HOST_DEVICE void add(std::uint64_t v) {
    lo += v;
    hi += lo < v;
  }
  DSV4_HOST_DEVICE void add(const fixed_sum& o) {
    add(o.lo);
    hi += o.hi;
  }
  //! The sum as a double: (hi 2^64 + lo) 2^-62, one rounding of lo and one of the fma.
  DSV4_HOST_DEVICE double value() const {
    return numerics::mul_rn(
        numerics::fma_rn(numerics::u64_to_double_rn(hi), 0x1p64, numerics::u64_to_double_rn(lo)),
        fixed62_unit);
  }
};

//! The probability of an exponential e given 1 / S: float(e / S) through the reciprocal, 0 below
//! FLT_MIN.
DSV4_HOST_DEVICE float probability(float e, double inv_sum) {
  const float p = numerics::to_float_rn(numerics::mul_rn(double(e), inv_sum));
  return p >= 1.17549435e-38f ? p : 0.0f;
}

//! top_p as a fixed-point mass threshold: the walk stops once the kept masses reach it.
DSV4_HOST_DEVICE std::uint64_t top_p_threshold(float top_p) {
  return to_fixed62(top_p);
}

//! Checks the parameters; throws dsv4::error naming the problem after `where` (the caller and row).
inline void check_sampling_params(const sampling_params& p, const std::string& where) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
    throw error(where + "temperature must be a finite value >= 0 (got " + std::to_string(p.temperature) +
                ")");
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

//! The fp32 probabilities softmax(logits / max(T, 1e-5)) as defined above: e_i = sampler_exp(x_i
//! / T - max), p_i = probability(e_i, 1 / S) with S the fixed-point sum of the e_i. Empty if every
//! logit is -inf (nothing to normalize: the caller takes the argmax).
inline std::vector<float> probabilities(std::span<const float> logits, float temperature) {
  const float t = std::max(temperature, 1e-5f);
  float mx = -INFINITY;
  for (const float x : logits) mx = std::max(mx, numerics::div_rn(x, t));
  if (mx == -INFINITY) return {};
  std::vector<float> p(logits.size());
  fixed_sum sum;
  for (std::size_t i = 0; i < p.size(); ++i) {
    p[i] = sampler_exp(numerics::sub_rn(numerics::div_rn(logits[i], t), mx));
    sum.add(to_fixed62(p[i]));
  }
  const double inv_sum = numerics::div_rn(1.0, sum.value());
  for (auto& v : p) v = probability(v, inv_sum);
  return p;
}

//! Zeroes every probability the top-k and top-p filters remove (ranking: p descending, then id).
inline void apply_filters(std::vector<float>& p, int top_k, float top_p) {
  if (top_k == 0 && top_p >= 1.0f) return;
  std::vector<std::size_t> order(p.size());
  std::iota(order.begin(), order.end(), std::size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return p[a] > p[b]; });
  std::size_t keep = top_k > 0 ? std::min<std::size_t>(std::size_t(top_k), p.size()) : p.size();
  if (top_p < 1.0f) {  // the masses in fixed point: exact, so a parallel prefix sum finds the same end
    const std::uint64_t threshold = top_p_threshold(top_p);
    std::uint64_t mass = 0;
    std::size_t n = 0;
    while (n < keep && mass < threshold) mass += to_fixed62(p[order[n++]]);
    keep = std::max<std::size_t>(n, 1);
  }
  for (std::size_t r = keep; r < order.size(); ++r) p[order[r]] = 0.0f;
}

//! One token id from `logits` (one row) at decode step `step` of sequence `sequence`.
inline int sample_reference(std::span<const float> logits, const sampling_params& params,
                            std::uint64_t sequence, std::uint64_t step) {
  check_sampling(logits, params);
  if (params.temperature == 0.0f)  // greedy; the filters cannot change the argmax
    return int(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<float> p = probabilities(logits, params.temperature);
  if (p.empty())  // every logit -inf: nothing is drawable, the argmax (the first token) as the device
    return int(std::max_element(logits.begin(), logits.end()) - logits.begin());
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
