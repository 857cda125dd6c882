#pragma once
//! \file
//! CUDA mHC sublayer boundary, fused (spec §8): one pass over the four streams computes
//!   Y = hc_post(F, X, post, comb), h = rmsnorm(hc_pre(Y, pre), w), next = hc_coefficients(Y)
//! for every token (host reference: reference.hpp `boundary_step_reference`). The streams are
//! read once and written once: X (4d) and F (d) in, Y (4d) and h (d) out, the article's (2n+2)d
//! (h is also written unnormalized once and read back, 2d more, because its RMS statistic is only
//! known after the pass). The 24 x 4d fp32 projection weight is read once per token slice
//! (from L2 after the first).
//!
//! Work split: a token's d range is cut into `splits` slices, one CTA each, so a decode step of
//! one token still spreads over several SMs; each slice writes its partial sums (the squares of
//! Y, the squares of h, the 24 projections; all in double, like the host reference, so the fp32
//! statistics match it bit for bit in practice) and the last CTA of the token to arrive adds them
//! in slice order, runs the Sinkhorn split, and normalizes h. Results do not depend on arrival
//! order.

#include <cuda_runtime.h>  // provides cudaStream_t, uint4

#include <algorithm>
#include <cstdint>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/mhc/sinkhorn.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_buffer.cuh"

namespace dsv4::kernels::mhc {

struct mhc_step_args {
  const numerics::bf16* x = nullptr;  //!< [tokens, 4, dim] streams the sublayer consumed
  const numerics::bf16* f = nullptr;  //!< [tokens, dim] sublayer output; null: Y = X (model entry)
  const float* post = nullptr;        //!< [tokens, 4] coefficients that apply F (unused without F)
  const float* comb = nullptr;        //!< [tokens, 4, 4]
  const float* pre = nullptr;         //!< [tokens, 4] pre-mix of the next sublayer's input
  const numerics::bf16* norm_w = nullptr;  //!< [dim] RMSNorm weight of the next sublayer
  float norm_eps = 1e-20f;
  numerics::bf16* y = nullptr;        //!< [tokens, 4, dim] new streams (unused without F)
  numerics::bf16* h = nullptr;        //!< [tokens, dim] normalized input of the next sublayer
  // Coefficients of the next sublayer, from Y; skipped when fn is null (the model's exit).
  const float* fn = nullptr;          //!< [24, 4 * dim]
  const float* base = nullptr;        //!< [24]
  const float* scale = nullptr;       //!< [3]
  int iters = 20;
  float hc_eps = 1e-6f;
  float mix_norm_eps = 1e-20f;
  float* next_pre = nullptr;          //!< [tokens, 4]
  float* next_post = nullptr;         //!< [tokens, 4]
  float* next_comb = nullptr;         //!< [tokens, 4, 4]
  long long tokens = 0;
  int dim = 0;
};

//! Partial sums per (token, slice) and one arrival counter per token. The constructor zeroes the
//! counters; every step leaves them at zero.
class mhc_workspace {
 public:
  static constexpr int partial_count = 2 + mix_count;  // squares of Y, squares of h, 24 projections
  explicit mhc_workspace(long long max_tokens, int max_splits = 16)
      : max_tokens_(max_tokens), max_splits_(max_splits),
        partials_(std::size_t(std::max(1LL, max_tokens)) * max_splits * partial_count),
        counters_(std::size_t(std::max(1LL, max_tokens))) {
    counters_.fill_bytes(0);
  }
  long long max_tokens() const { return max_tokens_; }
  int max_splits() const { return max_splits_; }
  double* partials() { return partials_.data(); }
  unsigned* counters() { return counters_.data(); }

 private:
  long long max_tokens_;
  int max_splits_;
  runtime::device_buffer<double> partials_;
  runtime::device_buffer<unsigned> counters_;
};

namespace detail {
inline constexpr int mhc_threads = 128;

DSV4_DEVICE void unpack8(const uint4& v, float (&out)[8]) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = __uint_as_float((w[i / 2] >> (16 * (i % 2))) << 16);
}

DSV4_DEVICE uint4 pack8(const float (&v)[8]) {
  unsigned w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = unsigned(numerics::bf16::from_float(v[2 * i]).bits) | (unsigned(numerics::bf16::from_float(v[2 * i + 1]).bits) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

DSV4_KERNEL void __launch_bounds__(mhc_threads) mhc_step_kernel(mhc_step_args a, int splits, double* partials,
                                                               unsigned* counters) {
  constexpr int P = mhc_workspace::partial_count;
  const long long tok = blockIdx.y;
  const int split = blockIdx.x, dim = a.dim, chunks = dim / 8;
  const int per_split = (chunks + splits - 1) / splits;
  const int c_begin = split * per_split, c_end = min(chunks, c_begin + per_split);
  const bool has_f = a.f != nullptr, has_next = a.fn != nullptr;
  const numerics::bf16* x = a.x + tok * 4 * dim;
  float pre[hc], post[hc], comb[hc * hc];
#pragma unroll
  for (int i = 0; i < hc; ++i) pre[i] = a.pre[tok * hc + i];
  if (has_f) {
#pragma unroll
    for (int i = 0; i < hc; ++i) post[i] = a.post[tok * hc + i];
#pragma unroll
    for (int i = 0; i < hc * hc; ++i) comb[i] = a.comb[tok * hc * hc + i];
  }

  double acc[P] = {};  // [0] sum Y^2, [1] sum h^2, [2 + j] projection j
  for (int c = c_begin + threadIdx.x; c < c_end; c += mhc_threads) {
    const int d0 = c * 8;
    float xs[hc][8], ys[hc][8];
#pragma unroll
    for (int i = 0; i < hc; ++i) unpack8(*reinterpret_cast<const uint4*>(x + (long long)i * dim + d0), xs[i]);
    if (has_f) {
      float fv[8];
      unpack8(*reinterpret_cast<const uint4*>(a.f + tok * dim + d0), fv);
#pragma unroll
      for (int j = 0; j < hc; ++j) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float mix = 0.0f;  // sum over the input streams first, in stream order, then post * F
#pragma unroll
          for (int i = 0; i < hc; ++i) mix = __fadd_rn(mix, __fmul_rn(comb[i * hc + j], xs[i][e]));
          ys[j][e] = numerics::round_to_bf16(__fadd_rn(__fmul_rn(post[j], fv[e]), mix));
        }
        *reinterpret_cast<uint4*>(a.y + (tok * 4 + j) * dim + d0) = pack8(ys[j]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < hc; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) ys[j][e] = xs[j][e];
    }
    float hv[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < hc; ++i) s = __fadd_rn(s, __fmul_rn(pre[i], ys[i][e]));
      hv[e] = numerics::round_to_bf16(s);
      acc[1] += double(hv[e]) * double(hv[e]);
    }
    *reinterpret_cast<uint4*>(a.h + tok * dim + d0) = pack8(hv);  // unnormalized for now
#pragma unroll
    for (int i = 0; i < hc; ++i)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[0] += double(ys[i][e]) * double(ys[i][e]);
    if (has_next) {
#pragma unroll
      for (int j = 0; j < mix_count; ++j) {
        double dot = 0;
#pragma unroll
        for (int i = 0; i < hc; ++i) {
          const float4* w = reinterpret_cast<const float4*>(a.fn + (long long)j * 4 * dim + (long long)i * dim + d0);
          const float4 w0 = __ldg(w), w1 = __ldg(w + 1);
          dot += double(w0.x) * ys[i][0] + double(w0.y) * ys[i][1] + double(w0.z) * ys[i][2] + double(w0.w) * ys[i][3] +
                 double(w1.x) * ys[i][4] + double(w1.y) * ys[i][5] + double(w1.z) * ys[i][6] + double(w1.w) * ys[i][7];
        }
        acc[2 + j] += dot;
      }
    }
  }

  // Block reduction of the P partial sums, then this slice's partial to the workspace.
  __shared__ double red[mhc_threads / 32][P];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    double v = acc[k];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32][k] = v;
  }
  __syncthreads();
  if (threadIdx.x < P) {
    double v = 0;
    for (int w = 0; w < mhc_threads / 32; ++w) v += red[w][threadIdx.x];
    partials[(tok * splits + split) * P + threadIdx.x] = v;
  }
  __threadfence();
  __syncthreads();
  __shared__ unsigned ticket;
  if (threadIdx.x == 0) ticket = atomicAdd(counters + tok, 1u);
  __syncthreads();
  if (ticket != unsigned(splits - 1)) return;
  __threadfence();

  // The token's last CTA: totals in slice order, coefficients, then the normalization of h.
  __shared__ double total[P];
  __shared__ float inv_rms_h;
  if (threadIdx.x < P) {
    double v = 0;
    for (int s = 0; s < splits; ++s) v += __ldcg(partials + (tok * splits + s) * P + threadIdx.x);
    total[threadIdx.x] = v;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const float mean_h = float(total[1] / double(dim));
    inv_rms_h = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_h, a.norm_eps)));
    if (has_next) {
      const float mean_y = float(total[0] / double(4 * dim));
      const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_y, a.mix_norm_eps)));
      float m[mix_count];
      for (int j = 0; j < mix_count; ++j) m[j] = __fmul_rn(float(total[2 + j]), r);
      split_sinkhorn(m, a.scale, a.base, a.iters, a.hc_eps, a.next_pre + tok * hc, a.next_post + tok * hc,
                     a.next_comb + tok * hc * hc);
    }
    counters[tok] = 0;  // ready for the next step
  }
  __syncthreads();
  const float r = inv_rms_h;
  for (int c = threadIdx.x; c < chunks; c += mhc_threads) {
    uint4 raw;
    const unsigned* src = reinterpret_cast<const unsigned*>(a.h + tok * dim + c * 8);
    raw.x = __ldcg(src), raw.y = __ldcg(src + 1), raw.z = __ldcg(src + 2), raw.w = __ldcg(src + 3);
    float hv[8], wv[8];
    unpack8(raw, hv);
    unpack8(*reinterpret_cast<const uint4*>(a.norm_w + c * 8), wv);
#pragma unroll
    for (int e = 0; e < 8; ++e) hv[e] = __fmul_rn(wv[e], __fmul_rn(hv[e], r));
    *reinterpret_cast<uint4*>(a.h + tok * dim + c * 8) = pack8(hv);
  }
}
}  // namespace detail

//! Slices per token: enough CTAs for about two per SM, at most one slice per 128 chunks of 8
//! (so every thread has work) and at most the workspace's limit.
inline int mhc_step_splits(long long tokens, int dim, int sms, int max_splits) {
  const long long want = (2LL * sms + tokens - 1) / std::max(1LL, tokens);
  const int by_dim = std::max(1, dim / 8 / detail::mhc_threads);
  return int(std::max<long long>(1, std::min<long long>({want, (long long)by_dim, (long long)max_splits})));
}

inline void mhc_step(const mhc_step_args& a, mhc_workspace& ws, cudaStream_t stream = nullptr) {
  const std::string where = "mhc_step (tokens " + std::to_string(a.tokens) + ", dim " + std::to_string(a.dim) + "): ";
  if (a.tokens < 0 || a.dim <= 0 || a.dim % 8 != 0) throw error(where + "need tokens >= 0 and dim a positive multiple of 8");
  if (a.tokens > ws.max_tokens()) throw error(where + "the workspace holds " + std::to_string(ws.max_tokens()) + " tokens");
  if (a.tokens > 65535) throw error(where + "at most 65535 tokens per launch");
  if (a.tokens == 0) return;
  if (!a.x || !a.pre || !a.norm_w || !a.h) throw error(where + "null x, pre, norm_w or h");
  if (a.f && (!a.post || !a.comb || !a.y)) throw error(where + "with F, post, comb and y are required");
  if (a.fn && (!a.base || !a.scale || !a.next_pre || !a.next_post || !a.next_comb || a.iters < 1))
    throw error(where + "with fn, base, scale, next_pre/post/comb and iters >= 1 are required");
  for (const void* p : {(const void*)a.x, (const void*)a.f, (const void*)a.y, (const void*)a.h, (const void*)a.norm_w,
                        (const void*)a.fn})
    if (reinterpret_cast<std::uintptr_t>(p) % 16) throw error(where + "tensors must be 16-byte aligned");
  int dev = 0, sms = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&dev));
  DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int splits = mhc_step_splits(a.tokens, a.dim, sms, ws.max_splits());
  detail::mhc_step_kernel<<<dim3(unsigned(splits), unsigned(a.tokens)), detail::mhc_threads, 0, stream>>>(
      a, splits, ws.partials(), ws.counters());
  DSV4_CUDA_CHECK_LAUNCH();
}

}  // namespace dsv4::kernels::mhc
