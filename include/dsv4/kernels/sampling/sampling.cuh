#pragma once
//! \file
//! Token sampling on the device: the draws of reference.hpp (`sample_reference`) from logits that
//! stay in device memory, one CTA per row, so a decode step returns token ids instead of
//! [rows, vocab] fp32 logits (33 MB a step at V4.1's vocabulary and 64 rows) and the host does not
//! sort a vocabulary per row for top-p.
//!
//! Per row: one pass finds NaN (an error naming the logit, as the host's check) and the argmax
//! (greedy: done); a second sums the exponentials (double, as the host); then without filters
//! one pass draws argmax(p / E) with the shared counter-based noise. With top-k / top-p, the rows'
//! probabilities go into 512 bins (sixteenths of an octave below the largest): the smallest bin prefix
//! that holds the top-k tokens or the top-p mass (with a margin) is, by monotonicity, a prefix of
//! the host's (p descending, id ascending) order, so sorting just those candidates in shared
//! memory (at most `max_candidates`) and walking them as the host does keeps the same set. A row
//! whose prefix holds more candidates (a flat distribution: high temperature with top-p near 1)
//! is drawn on the host from a copy of that row (`device_sampler::fallback_rows` counts them).
//!
//! Same tokens as the host, but not bit for bit by construction: the probabilities take the
//! host's float operations, except that the exponential is computed in double and rounded to float
//! (glibc's expf is not correctly rounded) and the double sums run in another order, so a
//! probability can sit one float ulp (~6e-8 relative) off the host's; a draw can then differ where
//! the two best scores agree to ~1e-7, and a top-k / top-p boundary can move between near-equal
//! probabilities. Measured: 1,080 of 1,080 draws equal (tests/kernels/test_sampling_cuda.cu). The
//! way to exactness: the host reference taking the same exponential and summation order.

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/sampling/reference.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_buffer.cuh"
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
inline constexpr double top_p_margin =
    1e-9;  // the candidates' mass must pass top_p by this (sum orders differ)

enum row_status : int { drawn = 0, nan_logit = 1, too_flat = 2 };

struct row_result {
  std::int32_t token;
  int status;
  long long nan_index;
};

struct argmax_pair {
  float v;
  int i;
};
DSV4_DEVICE bool better(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}
DSV4_DEVICE bool better_score(double v, int i, double bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

//! Block-wide reductions through shared memory (sampler_threads threads, 32 warps).
template <class T, class Op>
DSV4_DEVICE T block_reduce(T v, T* scratch, Op op) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // scratch is free
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[lane];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

//! exp as the host computes it in float (see the file comment).
DSV4_DEVICE float host_expf(float x) {
  return float(::exp(double(x)));
}

//! A positive float's exponent and top four mantissa bits: monotone in the value.
DSV4_DEVICE int prob_key(float p) {
  return int(__float_as_uint(p) >> 19);
}
//! Bin of a positive probability: how many sixteenths of an octave it lies below the row's largest
//! (0 .. prob_bins - 1, the last holding everything further down). Monotone: p >= q gives
//! bin(p) <= bin(q), so every bin prefix is a prefix of the (p descending) order.
DSV4_DEVICE int prob_bin(float p, int max_key) {
  return min(prob_bins - 1, max(0, max_key - prob_key(p)));
}

DSV4_KERNEL void __launch_bounds__(sampler_threads)
    sample_kernel(const float* logits, long long vocab, const row_request* requests, row_result* results) {
  __shared__ float f_scratch[32];
  __shared__ int i_scratch[32];
  __shared__ long long ll_scratch[32];
  __shared__ double d_scratch[32];
  __shared__ unsigned long long keys[max_candidates];
  __shared__ int bin_count[prob_bins];
  __shared__ double bin_mass[prob_bins];
  __shared__ int n_candidates, keep_count;

  const int row = blockIdx.x, tid = threadIdx.x;
  const float* x = logits + static_cast<long long>(row) * vocab;
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
      best == -INFINITY) {  // greedy; or nothing drawable (the host falls back to the argmax)
    if (tid == 0) *res = {best_i, drawn, 0};
    return;
  }
  // Pass 2: the denominator, as probabilities() forms it.
  const float t = fmaxf(sp.temperature, 1e-5f);
  const float mx = best / t;  // division by t > 0 is monotone: the largest scaled logit
  double sum = 0;
  for (long long i = tid; i < vocab; i += sampler_threads) sum += double(host_expf(x[i] / t - mx));
  sum = block_reduce(sum, d_scratch, [](double a, double b) { return a + b; });
  auto prob = [&](long long i) { return float(double(host_expf(x[i] / t - mx)) / sum); };

  long long last_bin = prob_bins;  // candidates: bins <= last_bin; prob_bins = every token
  const bool filtered = sp.top_k > 0 || sp.top_p < 1.0f;
  if (filtered) {
    const int max_key = prob_key(float(1.0 / sum));  // the largest p: its exponential is 1
    for (int b = tid; b < prob_bins; b += sampler_threads) bin_count[b] = 0, bin_mass[b] = 0.0;
    __syncthreads();
    for (long long i = tid; i < vocab; i += sampler_threads) {
      const float p = prob(i);
      if (p <= 0.0f) continue;  // never drawn (host: filtered or underflowed)
      const int b = prob_bin(p, max_key);
      atomicAdd(&bin_count[b], 1);
      atomicAdd(&bin_mass[b], double(p));
    }
    __syncthreads();
    if (tid == 0) {
      long long count = 0;
      double mass = 0;
      int chosen = prob_bins - 1;
      for (int b = 0; b < prob_bins; ++b) {
        count += bin_count[b], mass += bin_mass[b];
        const bool enough_k = sp.top_k > 0 && count >= sp.top_k;
        const bool enough_p = sp.top_p < 1.0f && mass >= double(sp.top_p) + top_p_margin;
        if (enough_k || enough_p) {
          chosen = b;
          break;
        }
      }
      long long n = 0;
      for (int b = 0; b <= chosen; ++b) n += bin_count[b];
      n_candidates = n > max_candidates ? -1 : int(n);
      last_bin = chosen;
      i_scratch[0] = chosen;
    }
    __syncthreads();
    if (n_candidates < 0) {
      if (tid == 0) *res = {-1, too_flat, 0};
      return;
    }
    last_bin = i_scratch[0];
    // The candidates as keys that sort descending by (p, then lower id): p's bits are monotone
    // for p > 0; the id complemented.
    __syncthreads();
    if (tid == 0) keep_count = 0;
    __syncthreads();
    for (long long i = tid; i < vocab; i += sampler_threads) {
      const float p = prob(i);
      if (p <= 0.0f || prob_bin(p, max_key) > last_bin) continue;
      const int slot = atomicAdd(&keep_count, 1);
      keys[slot] =
          (static_cast<unsigned long long>(__float_as_uint(p)) << 32) | (0xFFFFFFFFu - std::uint32_t(i));
    }
    __syncthreads();
    int n = 1;
    while (n < n_candidates) n *= 2;
    for (int i = n_candidates + tid; i < n; i += sampler_threads) keys[i] = 0;  // below every candidate
    __syncthreads();
    for (int size = 2; size <= n; size *= 2)  // bitonic sort, descending
      for (int stride = size / 2; stride > 0; stride /= 2) {
        for (int i = tid; i < n; i += sampler_threads) {
          const int j = i ^ stride;
          if (j > i) {
            const bool descending = (i & size) == 0;
            const unsigned long long a = keys[i], b = keys[j];
            if (descending ? a < b : a > b) keys[i] = b, keys[j] = a;
          }
        }
        __syncthreads();
      }
    if (tid == 0) {  // apply_filters' walk over the sorted prefix
      int keep = sp.top_k > 0 ? min(sp.top_k, n_candidates) : n_candidates;
      if (sp.top_p < 1.0f) {
        double mass = 0;
        int m = 0;
        while (m < keep && mass < double(sp.top_p))
          mass += double(__uint_as_float(std::uint32_t(keys[m++] >> 32)));
        keep = max(m, 1);
      }
      keep_count = keep;
    }
    __syncthreads();
  }
  // The draw: argmax of p / E over the drawable tokens (the kept candidates, or every token).
  double score = -1.0;
  int score_i = INT_MAX;
  auto consider = [&](float p, int i) {
    if (p <= 0.0f) return;
    const double s = double(p) / exponential_noise(sp.seed, rq.sequence, rq.step, std::uint64_t(i));
    if (better_score(s, i, score, score_i)) score = s, score_i = i;
  };
  if (filtered) {
    for (int c = tid; c < keep_count; c += sampler_threads) {
      const unsigned long long k = keys[c];
      consider(__uint_as_float(std::uint32_t(k >> 32)), int(0xFFFFFFFFu - std::uint32_t(k & 0xFFFFFFFFu)));
    }
  } else {
    for (long long i = tid; i < vocab; i += sampler_threads) consider(prob(i), int(i));
  }
  const double bs = block_reduce(score, d_scratch, [](double a, double b) { return fmax(a, b); });
  score_i = block_reduce(score == bs ? score_i : INT_MAX, i_scratch, [](int a, int b) { return min(a, b); });
  if (tid == 0)
    *res = {score_i == INT_MAX ? best_i : score_i, drawn,
            0};  // none drawable: the host's fallback, the argmax
}
}  // namespace detail

//! Draws tokens from device-resident logits; holds the launch's small buffers (one per engine).
class device_sampler {
 public:
  explicit device_sampler(int max_rows = 256)
      : max_rows_(max_rows),
        requests_(std::size_t(max_rows)),
        results_(std::size_t(max_rows)),
        results_host_(std::size_t(max_rows)),
        requests_host_(std::size_t(max_rows)) {
    if (max_rows <= 0) throw error("device_sampler: max_rows must be positive");
  }

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
    DSV4_CUDA_CHECK(cudaMemcpyAsync(requests_.data(), requests_host_.data(),
                                    std::size_t(rows) * sizeof(row_request), cudaMemcpyHostToDevice, stream));
    detail::sample_kernel<<<rows, detail::sampler_threads, 0, stream>>>(logits, vocab, requests_.data(),
                                                                        results_.data());
    DSV4_CUDA_CHECK_LAUNCH();
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
        DSV4_CUDA_CHECK(cudaMemcpy(row.data(), logits + static_cast<long long>(r) * vocab,
                                   row.size() * sizeof(float), cudaMemcpyDeviceToHost));
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
  long long fallback_rows_ = 0;
};

}  // namespace dsv4::kernels::sampling
