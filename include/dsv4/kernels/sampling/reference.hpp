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
//! degree-12 Taylor polynomial of exp(r) by Horner's rule in fp64 (truncation < 2e-16; each step a
//! product and a sum, rounded apart), the power of two from bits, one rounding to float. Results
//! below FLT_MIN are 0 (no subnormals: none reach a draw).
DSV4_HOST_DEVICE float sampler_exp(float x) {
  using numerics::add_rn;
  using numerics::mul_rn;
  if (!(x > -87.5f)) return 0.0f;  // e^-87.5 < FLT_MIN; also -inf (and NaN, which callers exclude)
  const double xd = x;
  const double k = numerics::round_half_even(mul_rn(xd, 1.4426950408889634));  // x / ln2
  // ln2's high part has 21 trailing zero bits: k times it is exact for |k| <= 127.
  double r = add_rn(xd, mul_rn(-k, 6.93147180369123816490e-01));
  r = add_rn(r, mul_rn(-k, 1.90821492927058770002e-10));  // and its low part
  double q = add_rn(mul_rn(1.0 / 479001600, r), 1.0 / 39916800);
  q = add_rn(mul_rn(q, r), 1.0 / 3628800);
  q = add_rn(mul_rn(q, r), 1.0 / 362880);
  q = add_rn(mul_rn(q, r), 1.0 / 40320);
  q = add_rn(mul_rn(q, r), 1.0 / 5040);
  q = add_rn(mul_rn(q, r), 1.0 / 720);
  q = add_rn(mul_rn(q, r), 1.0 / 120);
  q = add_rn(mul_rn(q, r), 1.0 / 24);
  q = add_rn(mul_rn(q, r), 1.0 / 6);
  q = add_rn(mul_rn(q, r), 0.5);
  q = add_rn(mul_rn(q, r), 1.0);
  q = add_rn(mul_rn(q, r), 1.0);
  const double two_k = numerics::bits_to_double(std::uint64_t(1023 + int(k)) << 52);  // k in [-127, 0]
  const float e = numerics::to_float_rn(mul_rn(q, two_k));
  return e >= 1.17549435e-38f ? e : 0.0f;
}

//! log(u) for u in (0, 1] in fp64, identical on host and device: u = 2^k m with m in
//! [sqrt(1/2), sqrt(2)), log m = 2 atanh((m - 1) / (m + 1)) by its series to s^23 (|s| < 0.172:
//! truncation < 1e-18; Horner's rule, products and sums rounded apart), plus k ln2.
DSV4_HOST_DEVICE double sampler_log(double u) {
  using numerics::add_rn;
  using numerics::mul_rn;
  const std::uint64_t b = numerics::double_to_bits(u);
  int k = int((b >> 52) & 0x7ff) - 1023;  // u is a normal double: u >= 2^-53
  double m = numerics::bits_to_double((b & 0x000fffffffffffffull) | 0x3ff0000000000000ull);  // [1, 2)
  if (m > 1.4142135623730951) m = mul_rn(m, 0.5), ++k;
  const double s = numerics::div_rn(add_rn(m, -1.0), add_rn(m, 1.0));
  const double z = mul_rn(s, s);
  double q = add_rn(mul_rn(2.0 / 23, z), 2.0 / 21);
  q = add_rn(mul_rn(q, z), 2.0 / 19);
  q = add_rn(mul_rn(q, z), 2.0 / 17);
  q = add_rn(mul_rn(q, z), 2.0 / 15);
  q = add_rn(mul_rn(q, z), 2.0 / 13);
  q = add_rn(mul_rn(q, z), 2.0 / 11);
  q = add_rn(mul_rn(q, z), 2.0 / 9);
  q = add_rn(mul_rn(q, z), 2.0 / 7);
  q = add_rn(mul_rn(q, z), 2.0 / 5);
  q = add_rn(mul_rn(q, z), 2.0 / 3);
  // log m = 2s + s z q; then + k ln2 (high part exact in the product, low part)
  const double log_m = add_rn(mul_rn(mul_rn(s, z), q), mul_rn(2.0, s));
  const double kd = double(k);
  return add_rn(mul_rn(kd, 6.93147180369123816490e-01),
                add_rn(mul_rn(kd, 1.90821492927058770002e-10), log_m));
}

//! The uniform draw behind one (seed, sequence, step, token)'s noise: u = (k + 1) / 2^53 in (0, 1]
//! from a SplitMix64 hash.
DSV4_HOST_DEVICE double noise_uniform(std::uint64_t seed, std::uint64_t sequence, std::uint64_t step,
                                      std::uint64_t token) {
  const std::uint64_t h = splitmix64(splitmix64(splitmix64(splitmix64(seed) ^ sequence) ^ step) ^ token);
  return double((h >> 11) + 1) * 0x1p-53;  // exact: an integer below 2^54 times a power of 2
}

//! Exp(1) noise from its uniform draw: -log(u), +0 at u = 1 (not -0, whose p / E would be -inf).
DSV4_HOST_DEVICE double noise_of(double u) {
  const double l = sampler_log(u);
  return l == 0.0 ? 0.0 : -l;
}

//! Exp(1) noise of one (seed, sequence, step, token).
DSV4_HOST_DEVICE double exponential_noise(std::uint64_t seed, std::uint64_t sequence, std::uint64_t step,
                                          std::uint64_t token) {
  return noise_of(noise_uniform(seed, sequence, step, token));
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
  //! The sum as a double: (hi 2^64 + lo) 2^-62, one rounding of lo and one of the sum.
  DSV4_HOST_DEVICE double value() const {  // hi 2^64 is exact (hi < 2^53)
    return numerics::mul_rn(numerics::add_rn(numerics::mul_rn(numerics::u64_to_double_rn(hi), 0x1p64),
                                             numerics::u64_to_double_rn(lo)),
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
//! Only the ranking's head is sorted: its first n entries (nth_element, then a sort), n growing
//! fourfold until the walk ends inside them; the same kept set as sorting the whole row (a
//! vocabulary of 129,280 took 19 ms that way), in O(vocab + kept log kept).
inline void apply_filters(std::vector<float>& p, int top_k, float top_p) {
  if (top_k == 0 && top_p >= 1.0f) return;
  const std::size_t V = p.size();
  const std::size_t keep_k = top_k > 0 ? std::min<std::size_t>(std::size_t(top_k), V) : V;
  const auto before = [&](std::uint32_t a, std::uint32_t b) {
    return p[a] > p[b] || (p[a] == p[b] && a < b);
  };
  std::vector<std::uint32_t> order(V);
  std::iota(order.begin(), order.end(), std::uint32_t(0));
  std::size_t sorted = 0;  // order[0 .. sorted) is the ranking's head, in order
  auto sort_head = [&](std::size_t n) {
    n = std::min(n, V);
    if (n <= sorted) return;
    if (n < V)
      std::nth_element(order.begin() + std::ptrdiff_t(sorted), order.begin() + std::ptrdiff_t(n), order.end(),
                       before);
    std::sort(order.begin() + std::ptrdiff_t(sorted), order.begin() + std::ptrdiff_t(n), before);
    sorted = n;
  };
  std::size_t keep = keep_k;
  if (top_p < 1.0f) {  // the masses in fixed point: exact, so a parallel prefix sum finds the same end
    const std::uint64_t threshold = top_p_threshold(top_p);
    std::uint64_t mass = 0;
    std::size_t n = 0;
    for (std::size_t head = std::min<std::size_t>(keep_k, 256);; head *= 4) {
      sort_head(std::min(head, keep_k));
      while (n < std::min(sorted, keep_k) && mass < threshold) mass += to_fixed62(p[order[n++]]);
      if (mass >= threshold || n >= keep_k) break;
    }
    keep = std::max<std::size_t>(n, 1);
  } else if (keep_k < V) {  // top-k alone: the set is enough, not its order
    std::nth_element(order.begin(), order.begin() + std::ptrdiff_t(keep_k), order.end(), before);
  }
  std::vector<bool> kept(V, false);
  for (std::size_t r = 0; r < keep; ++r) kept[order[r]] = true;
  for (std::size_t i = 0; i < V; ++i)
    if (!kept[i]) p[i] = 0.0f;
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
  // argmax of p / E, ties to the lower id. Since E = -log(u) >= 1 - u, a token's score is at most
  // p / (1 - u) (widened by 2^-45 for the roundings), so the logarithm is taken only where that bound
  // can reach the best score so far, starting from the most probable token: the same argmax for a
  // fraction of the logarithms.
  int best = -1;
  double best_score = -1.0;
  auto consider = [&](std::size_t i) {
    if (p[i] <= 0.0f) return;  // filtered out, or underflowed: cannot be drawn
    const double u = noise_uniform(params.seed, sequence, step, i);
    if (best >= 0 && u < 1.0 && numerics::mul_rn(double(p[i]) / (1.0 - u), 1.0 + 0x1p-45) < best_score)
      return;
    const double score = numerics::div_rn(double(p[i]), noise_of(u));
    if (score > best_score || (score == best_score && int(i) < best)) best_score = score, best = int(i);
  };
  const std::size_t top = std::size_t(std::max_element(p.begin(), p.end()) - p.begin());
  consider(top);
  for (std::size_t i = 0; i < p.size(); ++i)
    if (i != top) consider(i);
  if (best < 0)  // every probability underflowed but the maximum's is 1: unreachable, kept defined
    best = int(std::max_element(logits.begin(), logits.end()) - logits.begin());
  return best;
}

}  // namespace dsv4::kernels::sampling
