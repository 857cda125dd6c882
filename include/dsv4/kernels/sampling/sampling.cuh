#pragma once
//! \file
//! Token sampling on the device: the draws of reference.hpp (`sample_reference`) from logits that
//! stay in device memory, one CTA per row, so a decode step returns token ids instead of
//! [rows, vocab] fp32 logits (33 MB a step at V4.1's vocabulary and 64 rows) and the host does not
//! sort a vocabulary per row for top-p.
//!
//! Per row: one pass finds NaN (an error naming the logit, as the host's check) and the argmax
//! (greedy: done); a second computes the exponentials (kept in a workspace, so the passes after it
//! read floats instead of recomputing them) and their fixed-point sum; then without filters one
//! pass draws argmax(p / E) with the shared counter-based noise. With top-k / top-p, the row's
//! probabilities go into 512 bins (sixteenths of an octave below the largest) with their counts and
//! fixed-point masses; the smallest bin prefix that holds the top-k tokens or reaches the top-p
//! mass is, by monotonicity, a prefix of the host's (p descending, id ascending) order that holds
//! the host's kept set, so sorting just those candidates in shared memory (at most
//! `max_candidates`) and walking them as the host does (a prefix sum of the same fixed-point
//! masses) keeps the same set. A row whose prefix holds more candidates (a flat distribution: high
//! temperature with top-p near 1) is drawn on the host from a copy of that row
//! (`device_sampler::fallback_rows` counts them).
//!
//! Same tokens as the host, bit for bit by construction: every number a draw depends on comes from
//! reference.hpp's functions (sampler_exp, to_fixed62, fixed_sum, probability, exponential_noise),
//! whose operations are single IEEE roundings on both sides, and the sums are of integers. The
//! bins' masses are native 64-bit integer atomics; the last bin (everything 32 octaves below the
//! largest, where most of a peaked row lands) is summed in registers, so no address is contended.

#include <cuda_runtime.h>

// Flush-to-zero arithmetic (which --use_fast_math turns on) changes comparisons, conversions and
// divisions of subnormal values on the device and not on the host: the draws would no longer be
// the host's. (-ftz=true alone defines no macro: it must be left off as well.)
#if defined(__USE_FAST_MATH__)
#error "sampling.cuh: compile without --use_fast_math (flush-to-zero breaks the exact draws)"
#endif

#include <climits>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/sampling/reference.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "dsv4/runtime/pdl.cuh"
#include "dsv4/runtime/pinned_buffer.cuh"

namespace dsv4::kernels::sampling {

//! One row's draw: the sampling parameters and the noise's coordinates (sample_reference's
//! `sequence` and `step`).
struct row_request {
  sampling_params params;
  std::uint64_t sequence = 0;
  std::uint64_t step = 0;
};

namespace detail {
inline constexpr int sampler_threads = 1024;
inline constexpr int max_candidates = 4096;  // 32 KB of (probability, id) keys in shared memory
inline constexpr int prob_bins =
    512;  // 16 a binary octave (a factor 1.044 apart), 32 octaves below the largest
inline constexpr int tail_bin = prob_bins - 1;
static_assert(sampler_threads == 1024,
              "the block reductions and the scan take one value per warp of 32 warps");
static_assert(max_candidates == 4 * sampler_threads, "the walk's prefix sum gives each thread 4 sorted keys");
static_assert(prob_bins == 16 * 32, "one warp chooses the bin prefix, 16 bins a lane");

enum row_status : int { drawn = 0, nan_logit = 1, too_flat = 2 };

struct row_result {
  std::int32_t token;
  int status;
  long long nan_index;
};

DSV4_DEVICE bool better(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}
DSV4_DEVICE bool better_score(double v, int i, double bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

//! Block-wide reductions through shared memory (sampler_threads threads, 32 warps); `shfl(v, o)`
//! exchanges a value between lanes o apart.
template <class T, class Op, class Shfl>
DSV4_DEVICE T block_reduce(T v, T* scratch, Op op, Shfl shfl) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = op(v, shfl(v, o));
  __syncthreads();  // scratch is free
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[lane];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = op(v, shfl(v, o));
  return v;
}
template <class T, class Op>
DSV4_DEVICE T block_reduce(T v, T* scratch, Op op) {
  return block_reduce(v, scratch, op, [](T x, int o) { return __shfl_xor_sync(0xffffffffu, x, o); });
}

//! The exclusive prefix sum of one value a thread over the block (sampler_threads threads).
DSV4_DEVICE unsigned long long block_exclusive_scan(unsigned long long v, unsigned long long* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  unsigned long long incl = v;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const unsigned long long u = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += u;
  }
  __syncthreads();  // scratch is free
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    unsigned long long w = scratch[lane];
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const unsigned long long u = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += u;
    }
    scratch[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  return (warp > 0 ? scratch[warp - 1] : 0ull) + incl - v;
}

//! A positive float's exponent and top four mantissa bits: monotone in the value.
DSV4_DEVICE int prob_key(float p) {
  return int(__float_as_uint(p) >> 19);
}
//! Bin of a positive probability: how many sixteenths of an octave it lies below the row's largest
//! (0 .. prob_bins - 1, the last holding everything further down). Monotone: p >= q gives
//! bin(p) <= bin(q), so every bin prefix is a prefix of the (p descending) order.
DSV4_DEVICE int prob_bin(float p, int max_key) {
  return min(tail_bin, max(0, max_key - prob_key(p)));
}

//! One row a CTA. `exps` is a [rows, vocab] workspace for the row's exponentials.
DSV4_KERNEL void __launch_bounds__(sampler_threads)
    sample_kernel(const float* logits, long long vocab, const row_request* requests, row_result* results,
                  float* exps) {
  __shared__ float f_scratch[32];
  __shared__ int i_scratch[32];
  __shared__ long long ll_scratch[32];
  __shared__ double d_scratch[32];
  __shared__ unsigned long long u_scratch[32];
  __shared__ fixed_sum s_scratch[32];
  __shared__ unsigned long long keys[max_candidates];
  __shared__ int bin_count[prob_bins];
  __shared__ unsigned long long bin_mass[prob_bins];
  __shared__ int chosen_bin, n_candidates, fill_count;

  const int row = blockIdx.x, tid = threadIdx.x;
  const float* x = logits + static_cast<long long>(row) * vocab;
  float* ex = exps + static_cast<long long>(row) * vocab;
  const row_request rq = requests[row];
  row_result* res = results + row;

  // Pass 1: the first NaN, the argmax (first occurrence).
  float best = -INFINITY;
  int best_i = INT_MAX;
  long long nan_i = LLONG_MAX;
  for (long long i = tid; i < vocab; i += sampler_threads) {
    const float v = x[i];
    if (v != v)
      nan_i = min(nan_i, i);
    else if (better(v, int(i), best, best_i))
      best = v, best_i = int(i);
  }
  nan_i = block_reduce(nan_i, ll_scratch, [](long long a, long long b) { return min(a, b); });
  if (nan_i != LLONG_MAX) {
    if (tid == 0) *res = {-1, nan_logit, nan_i};
    return;
  }
  {
    const float bv = block_reduce(best, f_scratch, [](float a, float b) { return fmaxf(a, b); });
    best_i = block_reduce(best == bv ? best_i : INT_MAX, i_scratch, [](int a, int b) { return min(a, b); });
    best = bv;
  }
  const sampling_params& sp = rq.params;
  if (sp.temperature == 0.0f ||
      best == -INFINITY) {  // greedy; or nothing drawable (the host takes the argmax too)
    if (tid == 0) *res = {best_i, drawn, 0};
    return;
  }
  // Pass 2: the exponentials and their exact sum, as probabilities() forms them.
  const float t = fmaxf(sp.temperature, 1e-5f);
  const float mx = numerics::div_rn(best, t);  // division by t > 0 is monotone: the largest scaled logit
  fixed_sum sum;
  for (long long i = tid; i < vocab; i += sampler_threads) {
    const float e = sampler_exp(numerics::sub_rn(numerics::div_rn(x[i], t), mx));
    ex[i] = e;
    sum.add(to_fixed62(e));
  }
  sum = block_reduce(
      sum, s_scratch, [](fixed_sum a, const fixed_sum& b) { return a.add(b), a; },
      [](const fixed_sum& v, int o) {
        fixed_sum w;
        w.hi = __shfl_xor_sync(0xffffffffu, v.hi, o);
        w.lo = __shfl_xor_sync(0xffffffffu, v.lo, o);
        return w;
      });
  const double inv_sum = numerics::div_rn(1.0, sum.value());
  // Each thread reads back the exponentials it wrote: no barrier needed before the passes below.

  const bool k_on = sp.top_k > 0 && sp.top_k < vocab;  // top_k >= vocab keeps every token: off
  const bool p_on = sp.top_p < 1.0f;
  const std::uint64_t threshold = top_p_threshold(sp.top_p);
  int keep = 0;
  if (k_on || p_on) {
    const int max_key = prob_key(probability(1.0f, inv_sum));  // the largest p: its exponential is 1
    for (int b = tid; b < prob_bins; b += sampler_threads) bin_count[b] = 0, bin_mass[b] = 0;
    if (tid == 0) fill_count = 0;
    __syncthreads();
    int tail_n = 0;
    unsigned long long tail_m = 0;
    for (long long i = tid; i < vocab; i += sampler_threads) {
      const float p = probability(ex[i], inv_sum);
      if (p <= 0.0f) continue;  // never drawn (host: filtered or underflowed)
      const int b = prob_bin(p, max_key);
      if (b == tail_bin) {
        ++tail_n, tail_m += to_fixed62(p);
      } else {
        atomicAdd(&bin_count[b], 1);
        atomicAdd(&bin_mass[b], static_cast<unsigned long long>(to_fixed62(p)));
      }
    }
    tail_n = block_reduce(tail_n, i_scratch, [](int a, int b) { return a + b; });
    tail_m =
        block_reduce(tail_m, u_scratch, [](unsigned long long a, unsigned long long b) { return a + b; });
    if (tid == 0) bin_count[tail_bin] += tail_n, bin_mass[tail_bin] += tail_m;
    __syncthreads();
    // The smallest bin prefix that holds top_k tokens or reaches the top-p mass (all bins if none):
    // one warp, 16 bins a lane, a scan over the lanes, then the first qualifying lane's own bins.
    if (tid < 32) {
      const int lane = tid;
      long long c = 0;
      unsigned long long m = 0;
      for (int j = 0; j < 16; ++j) c += bin_count[lane * 16 + j], m += bin_mass[lane * 16 + j];
      long long c_incl = c;
      unsigned long long m_incl = m;
      for (int o = 1; o < 32; o *= 2) {
        const long long cu = __shfl_up_sync(0xffffffffu, c_incl, o);
        const unsigned long long mu = __shfl_up_sync(0xffffffffu, m_incl, o);
        if (lane >= o) c_incl += cu, m_incl += mu;
      }
      auto enough = [&](long long cc, unsigned long long mm) {
        return (k_on && cc >= sp.top_k) || (p_on && mm >= threshold);
      };
      const unsigned ballot = __ballot_sync(0xffffffffu, enough(c_incl, m_incl));
      const int first = ballot ? __ffs(int(ballot)) - 1 : 31;
      if (lane == first) {
        long long cc = c_incl - c;
        unsigned long long mm = m_incl - m;
        int b = lane * 16;
        for (;; ++b) {
          cc += bin_count[b], mm += bin_mass[b];
          if (enough(cc, mm) || b == tail_bin) break;
        }
        chosen_bin = b;
        n_candidates = cc > max_candidates ? -1 : int(cc);
      }
    }
    __syncthreads();
    const int n = n_candidates, last = chosen_bin;
    if (n < 0) {
      if (tid == 0) *res = {-1, too_flat, 0};
      return;
    }
    // The candidates as keys that sort descending by (p, then lower id): p's bits are monotone for
    // p > 0; the id complemented.
    for (long long i = tid; i < vocab; i += sampler_threads) {
      const float p = probability(ex[i], inv_sum);
      if (p <= 0.0f || prob_bin(p, max_key) > last) continue;
      const int slot = atomicAdd(&fill_count, 1);
      if (slot < max_candidates)  // always (the same test counted them); the bound keeps it safe
        keys[slot] =
            (static_cast<unsigned long long>(__float_as_uint(p)) << 32) | (0xFFFFFFFFu - std::uint32_t(i));
    }
    int padded = 1;
    while (padded < n) padded *= 2;
    for (int i = n + tid; i < padded; i += sampler_threads) keys[i] = 0;  // below every candidate
    __syncthreads();
    for (int size = 2; size <= padded; size *= 2)  // bitonic sort, descending
      for (int stride = size / 2; stride > 0; stride /= 2) {
        for (int i = tid; i < padded; i += sampler_threads) {
          const int j = i ^ stride;
          if (j > i) {
            const bool descending = (i & size) == 0;
            const unsigned long long a = keys[i], b = keys[j];
            if (descending ? a < b : a > b) keys[i] = b, keys[j] = a;
          }
        }
        __syncthreads();
      }
    // apply_filters' walk over the sorted candidates: top_k first, then the shortest prefix whose
    // fixed-point mass reaches the threshold (a prefix sum, 4 keys a thread; the same integers as
    // the host's sequential walk, so the same end).
    keep = k_on ? min(sp.top_k, n) : n;
    if (p_on) {
      auto mass_of = [&](int c) -> unsigned long long {
        return c < n ? to_fixed62(__uint_as_float(std::uint32_t(keys[c] >> 32))) : 0ull;
      };
      const int c0 = 4 * tid;
      unsigned long long local = 0;
      for (int j = 0; j < 4; ++j) local += mass_of(c0 + j);
      unsigned long long prefix = block_exclusive_scan(local, u_scratch);
      int end = INT_MAX;  // the walk's length: the first c with mass(0 .. c) >= threshold, plus one
      for (int j = 0; j < 4 && c0 + j < n; ++j) {
        prefix += mass_of(c0 + j);
        if (prefix >= threshold) {
          end = c0 + j + 1;
          break;
        }
      }
      end = block_reduce(end, i_scratch, [](int a, int b) { return min(a, b); });
      keep = max(min(keep, end), 1);
    }
  }
  // The draw: argmax of p / E over the drawable tokens (the kept candidates, or every token).
  double score = -1.0;
  int score_i = INT_MAX;
  auto consider = [&](float p, int i) {
    if (p <= 0.0f) return;
    const double s =
        numerics::div_rn(double(p), exponential_noise(sp.seed, rq.sequence, rq.step, std::uint64_t(i)));
    if (better_score(s, i, score, score_i)) score = s, score_i = i;
  };
  if (k_on || p_on) {
    for (int c = tid; c < keep; c += sampler_threads) {
      const unsigned long long k = keys[c];
      consider(__uint_as_float(std::uint32_t(k >> 32)), int(0xFFFFFFFFu - std::uint32_t(k & 0xFFFFFFFFu)));
    }
  } else {
    for (long long i = tid; i < vocab; i += sampler_threads) consider(probability(ex[i], inv_sum), int(i));
  }
  const double bs = block_reduce(score, d_scratch, [](double a, double b) { return fmax(a, b); });
  score_i = block_reduce(score == bs ? score_i : INT_MAX, i_scratch, [](int a, int b) { return min(a, b); });
  if (tid == 0)  // none drawable: the host's fallback, the argmax
    *res = {score_i == INT_MAX ? best_i : score_i, drawn, 0};
}
}  // namespace detail

//! Draws tokens from device-resident logits; holds the launch's small buffers (one per engine: it
//! is not safe to call from two threads at once). Rows whose top-k / top-p prefix exceeds
//! detail::max_candidates (a flat row under top-p near 1, or any top_k above it) are drawn on the
//! host from a copy of the row.
class device_sampler {
 public:
  explicit device_sampler(int max_rows = 256)
      : max_rows_(max_rows > 0 ? max_rows : throw error("device_sampler: max_rows must be positive")),
        requests_(std::size_t(max_rows)),
        results_(std::size_t(max_rows)),
        results_host_(std::size_t(max_rows)),
        requests_host_(std::size_t(max_rows)) {}

  //! One token id per row of `logits` ([rows, vocab] fp32 in device memory, rows = requests.size()),
  //! drawn as sample_reference(row, requests[r].params, requests[r].sequence, requests[r].step)
  //! draws it. Blocks until the ids are back. Errors name the row and the problem.
  std::vector<std::int32_t> sample(const float* logits, long long vocab,
                                   std::span<const row_request> requests, cudaStream_t stream = nullptr) {
    const int rows = int(requests.size());
    if (rows == 0) return {};
    if (rows > max_rows_)
      throw error("device_sampler: " + std::to_string(rows) + " rows, at most " + std::to_string(max_rows_));
    if (!logits || vocab <= 0 || vocab > INT_MAX)
      throw error("device_sampler: null logits or a vocabulary outside [1, 2^31)");
    for (int r = 0; r < rows; ++r) {
      check_sampling_params(requests[std::size_t(r)].params,
                            "device_sampler: row " + std::to_string(r) + ": ");
      requests_host_.data()[r] = requests[std::size_t(r)];
    }
    bool any_drawn = false;  // greedy rows need no exponentials
    for (const row_request& rq : requests) any_drawn |= rq.params.temperature != 0.0f;
    const std::size_t workspace = any_drawn ? std::size_t(rows) * std::size_t(vocab) : 0;
    if (exps_.size() < workspace) {  // the exponentials' workspace, grown to the largest call
      DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));  // the old one may still be read
      exps_ = runtime::device_buffer<float>(workspace);
    }
    DSV4_CUDA_CHECK(cudaMemcpyAsync(requests_.data(), requests_host_.data(),
                                    std::size_t(rows) * sizeof(row_request), cudaMemcpyHostToDevice, stream));
    runtime::launch_plain(detail::sample_kernel, dim3(unsigned(rows)), dim3(detail::sampler_threads), 0,
                          stream, logits, vocab, requests_.data(), results_.data(), exps_.data());
    DSV4_CUDA_CHECK(cudaMemcpyAsync(results_host_.data(), results_.data(),
                                    std::size_t(rows) * sizeof(detail::row_result), cudaMemcpyDeviceToHost,
                                    stream));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<std::int32_t> ids(static_cast<std::size_t>(rows));
    for (int r = 0; r < rows; ++r) {
      const detail::row_result& res = results_host_.data()[r];
      if (res.status == detail::nan_logit)
        throw error("sample: row " + std::to_string(r) + ": logit " + std::to_string(res.nan_index) +
                    " is NaN (the model produced an invalid value)");
      if (res.status == detail::too_flat) {  // more candidates than shared memory holds: this row on the host
        std::vector<float> row(static_cast<std::size_t>(vocab));
        DSV4_CUDA_CHECK(cudaMemcpyAsync(row.data(), logits + static_cast<long long>(r) * vocab,
                                        row.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
        DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
        ids[std::size_t(r)] =
            sample_reference(row, requests[std::size_t(r)].params, requests[std::size_t(r)].sequence,
                             requests[std::size_t(r)].step);
        ++fallback_rows_;
        continue;
      }
      ids[std::size_t(r)] = res.token;
    }
    return ids;
  }
  //! Rows drawn on the host so far (their top-k / top-p prefix exceeded detail::max_candidates).
  long long fallback_rows() const { return fallback_rows_; }
  int max_rows() const { return max_rows_; }

 private:
  int max_rows_;
  runtime::device_buffer<row_request> requests_;
  runtime::device_buffer<detail::row_result> results_;
  runtime::pinned_buffer<detail::row_result> results_host_;
  runtime::pinned_buffer<row_request> requests_host_;
  runtime::device_buffer<float> exps_;  // [rows, vocab] exponentials of the last call
  long long fallback_rows_ = 0;
};

}  // namespace dsv4::kernels::sampling
