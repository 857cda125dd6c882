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
//! Work split: a CTA takes a slice of 128 positions of d (all four streams) for a group of up to
//! 8 tokens. It computes Y and h there (Y kept in shared memory), then the slice's share of the
//! 24 projections: each weight row is read once per token group, coalesced, and used for all
//! the group's tokens. Partial sums (the squares of Y and of h in double, like the host reference,
//! so the RMS statistics match it bit for bit in practice; the 24 projections in fp32 over 16
//! products per lane, then double) go
//! to a workspace; the last CTA of a token group to arrive adds the slices in slice order, runs
//! the Sinkhorn split and normalizes h. Results do not depend on arrival order.

#include <cuda_runtime.h>  // provides cudaStream_t, uint4

#include <algorithm>
#include <cstdint>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/mhc/sinkhorn.cuh"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "dsv4/runtime/pdl.cuh"

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

//! Partial sums per (token, d slice) and one arrival counter per token group, for up to
//! `max_tokens` tokens of width up to `max_dim`. The constructor zeroes the counters; every step
//! leaves them at zero.
class mhc_workspace {
 public:
  static constexpr int partial_count = 2 + mix_count;  // squares of Y, squares of h, 24 projections
  static constexpr int slice = 128;                     // positions of d per CTA
  mhc_workspace(long long max_tokens, int max_dim)
      : max_tokens_(max_tokens), max_dim_(max_dim),
        partials_(std::size_t(std::max(1LL, max_tokens)) * std::size_t((max_dim + slice - 1) / slice) * partial_count),
        counters_(std::size_t(std::max(1LL, max_tokens))) {
    counters_.fill_bytes(0);
    // The memset runs on the legacy stream; a non-blocking stream is not ordered after it.
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  }
  long long max_tokens() const { return max_tokens_; }
  int max_dim() const { return max_dim_; }
  double* partials() { return partials_.data(); }
  unsigned* counters() { return counters_.data(); }

 private:
  long long max_tokens_;
  int max_dim_;
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

template <int TB>
DSV4_KERNEL void __launch_bounds__(mhc_threads) mhc_step_kernel(mhc_step_args a, double* partials, unsigned* counters) {
  runtime::start_after_previous_grid();
  constexpr int P = mhc_workspace::partial_count, S = mhc_workspace::slice, kChunks = S / 8;
  const int dim = a.dim, splits = (dim + S - 1) / S, split = blockIdx.x;
  const long long group = blockIdx.y, tok0 = group * TB;
  const int toks = a.tokens - tok0 < TB ? int(a.tokens - tok0) : TB;
  const int d_base = split * S;
  const bool has_f = a.f != nullptr, has_next = a.fn != nullptr;

  __shared__ float ys[TB][hc][S];
  __shared__ double item_ss[TB][kChunks][2];
  __shared__ double dots[TB][mix_count];

  // Phase 1: Y and (unnormalized) h for each (token, chunk of 8 positions) of the tile.
  for (int item = threadIdx.x; item < TB * kChunks; item += mhc_threads) {
    const int t = item / kChunks, c = item % kChunks, d0 = d_base + c * 8;
    double ss_y = 0, ss_h = 0;
    float y8[hc][8] = {};
    if (t < toks && d0 < dim) {
      const long long tok = tok0 + t;
      const numerics::bf16* x = a.x + tok * 4 * dim;
      float xs[hc][8];
#pragma unroll
      for (int i = 0; i < hc; ++i) unpack8(*reinterpret_cast<const uint4*>(x + (long long)i * dim + d0), xs[i]);
      if (has_f) {
        float post[hc], comb[hc * hc], fv[8];
#pragma unroll
        for (int i = 0; i < hc; ++i) post[i] = a.post[tok * hc + i];
#pragma unroll
        for (int i = 0; i < hc * hc; ++i) comb[i] = a.comb[tok * hc * hc + i];
        unpack8(*reinterpret_cast<const uint4*>(a.f + tok * dim + d0), fv);
#pragma unroll
        for (int j = 0; j < hc; ++j) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            float mix = 0.0f;  // sum over the input streams first, in stream order, then post * F
#pragma unroll
            for (int i = 0; i < hc; ++i) mix = __fadd_rn(mix, __fmul_rn(comb[i * hc + j], xs[i][e]));
            y8[j][e] = numerics::round_to_bf16(__fadd_rn(__fmul_rn(post[j], fv[e]), mix));
          }
          *reinterpret_cast<uint4*>(a.y + (tok * 4 + j) * dim + d0) = pack8(y8[j]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < hc; ++j)
#pragma unroll
          for (int e = 0; e < 8; ++e) y8[j][e] = xs[j][e];
      }
      float pre[hc], hv[8];
#pragma unroll
      for (int i = 0; i < hc; ++i) pre[i] = a.pre[tok * hc + i];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < hc; ++i) sum = __fadd_rn(sum, __fmul_rn(pre[i], y8[i][e]));
        hv[e] = numerics::round_to_bf16(sum);
        ss_h += double(hv[e]) * double(hv[e]);
      }
      *reinterpret_cast<uint4*>(a.h + tok * dim + d0) = pack8(hv);  // unnormalized for now
#pragma unroll
      for (int i = 0; i < hc; ++i)
#pragma unroll
        for (int e = 0; e < 8; ++e) ss_y += double(y8[i][e]) * double(y8[i][e]);
    }
#pragma unroll
    for (int i = 0; i < hc; ++i)
#pragma unroll
      for (int e = 0; e < 8; ++e) ys[t][i][c * 8 + e] = y8[i][e];
    item_ss[t][c][0] = ss_y;
    item_ss[t][c][1] = ss_h;
  }
  __syncthreads();

  // Phase 2: the slice's share of the 24 projections; warp w takes rows w, w + 4, ... . All of
  // a warp's weights (6 rows x 4 x 128, coalesced) are loaded before any math, so the slice costs
  // one memory round trip, and each row is used for every token of the group.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kWarps = mhc_threads / 32, kRows = mix_count / kWarps, kPerLane = hc * S / 32;
  static_assert(mix_count % kWarps == 0 && S % 32 == 0, "mhc_step: 24 rows over the warps, 32 lanes per slice row");
  if (has_next) {
    float wv[kRows][kPerLane];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int n = 0; n < kPerLane; ++n) {
        const int i = n / (S / 32), dd = lane + 32 * (n % (S / 32));
        wv[r][n] = d_base + dd < dim ? __ldg(a.fn + (long long)(warp + kWarps * r) * 4 * dim + (long long)i * dim + d_base + dd)
                                     : 0.0f;
      }
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int t = 0; t < TB; ++t) {
        // A lane's 16 products are summed in fp32 (as precise as the reference's own fp32 GEMM;
        // double here would cost a conversion per product, the kernel's bottleneck at prefill),
        // everything after that in double.
        float lane_sum = 0.0f;
#pragma unroll
        for (int n = 0; n < kPerLane; ++n)
          lane_sum = __fmaf_rn(wv[r][n], ys[t][n / (S / 32)][lane + 32 * (n % (S / 32))], lane_sum);
        double v = lane_sum;
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == 0) dots[t][warp + kWarps * r] = v;
      }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < toks * P; idx += mhc_threads) {
    const int t = idx / P, k = idx % P;
    double v = 0;
    if (k < 2)
      for (int c = 0; c < kChunks; ++c) v += item_ss[t][c][k];
    else
      v = has_next ? dots[t][k - 2] : 0.0;
    partials[((tok0 + t) * splits + split) * P + k] = v;
  }
  __threadfence();
  __syncthreads();
  __shared__ unsigned ticket;
  if (threadIdx.x == 0) ticket = atomicAdd(counters + group, 1u);
  __syncthreads();
  if (ticket != unsigned(splits - 1)) return;
  __threadfence();

  // The group's last CTA: totals in slice order, coefficients, then the normalization of h.
  __shared__ double total[TB][P];
  __shared__ float inv_rms_h[TB];
  for (int idx = threadIdx.x; idx < toks * P; idx += mhc_threads) {
    const int t = idx / P, k = idx % P;
    const double* src = partials + (tok0 + t) * splits * P + k;
    double v = 0;
    for (int sl0 = 0; sl0 < splits; sl0 += 16) {  // 16 loads in flight, then the adds in slice order
      double buf[16];
#pragma unroll
      for (int u = 0; u < 16; ++u) buf[u] = sl0 + u < splits ? __ldcg(src + (sl0 + u) * P) : 0.0;
#pragma unroll
      for (int u = 0; u < 16; ++u)
        if (sl0 + u < splits) v += buf[u];
    }
    total[t][k] = v;
  }
  __syncthreads();
  if (threadIdx.x < toks) {
    const int t = threadIdx.x;
    const float mean_h = float(total[t][1] / double(dim));
    inv_rms_h[t] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_h, a.norm_eps)));
  }
  __syncthreads();
  // One warp per token runs the Sinkhorn split (a long dependent chain); the warps left over
  // normalize h meanwhile. With as many tokens as warps, every warp splits first, then all
  // normalize. (Each value is computed as before; only which thread does what changes.)
  const int sinkhorn_warps = has_next ? min(toks, kWarps) : 0;
  const bool overlap = sinkhorn_warps < kWarps;
  if (warp < sinkhorn_warps)
    for (int t = warp; t < toks; t += sinkhorn_warps) {
      const long long tok = tok0 + t;
      const float mean_y = float(total[t][0] / double(4 * dim));
      const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_y, a.mix_norm_eps)));
      float m[mix_count];
#pragma unroll
      for (int j = 0; j < mix_count; ++j) m[j] = __fmul_rn(float(total[t][2 + j]), r);
      split_sinkhorn_warp(m, a.scale, a.base, a.iters, a.hc_eps, a.next_pre + tok * hc, a.next_post + tok * hc,
                          a.next_comb + tok * hc * hc);
    }
  if (threadIdx.x == 0) counters[group] = 0;  // ready for the next step
  if (!overlap) __syncthreads();
  const int first = overlap ? sinkhorn_warps * 32 : 0, workers = mhc_threads - first;
  if (int(threadIdx.x) < first) return;
  const int chunks = dim / 8;
  constexpr int kBatch = 8;  // chunks per thread whose loads are issued together
  for (int idx0 = int(threadIdx.x) - first; idx0 < toks * chunks; idx0 += kBatch * workers) {
    uint4 raw[kBatch], wraw[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = idx0 + u * workers;
      if (idx >= toks * chunks) break;
      const int t = idx / chunks, c = idx % chunks;
      const unsigned* src = reinterpret_cast<const unsigned*>(a.h + (tok0 + t) * dim + c * 8);
      raw[u].x = __ldcg(src), raw[u].y = __ldcg(src + 1), raw[u].z = __ldcg(src + 2), raw[u].w = __ldcg(src + 3);
      wraw[u] = *reinterpret_cast<const uint4*>(a.norm_w + c * 8);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = idx0 + u * workers;
      if (idx >= toks * chunks) break;
      const int t = idx / chunks, c = idx % chunks;
      float hv[8], wv[8];
      unpack8(raw[u], hv);
      unpack8(wraw[u], wv);
      const float r = inv_rms_h[t];
#pragma unroll
      for (int e = 0; e < 8; ++e) hv[e] = __fmul_rn(wv[e], __fmul_rn(hv[e], r));
      *reinterpret_cast<uint4*>(a.h + (tok0 + t) * dim + c * 8) = pack8(hv);
    }
  }
}
}  // namespace detail

inline void mhc_step(const mhc_step_args& a, mhc_workspace& ws, cudaStream_t stream = nullptr) {
  const std::string where = "mhc_step (tokens " + std::to_string(a.tokens) + ", dim " + std::to_string(a.dim) + "): ";
  if (a.tokens < 0 || a.dim <= 0 || a.dim % 8 != 0) throw error(where + "need tokens >= 0 and dim a positive multiple of 8");
  if (a.tokens > ws.max_tokens() || a.dim > ws.max_dim())
    throw error(where + "the workspace holds " + std::to_string(ws.max_tokens()) + " tokens of width " +
                std::to_string(ws.max_dim()));
  if (a.tokens == 0) return;
  if (!a.x || !a.pre || !a.norm_w || !a.h) throw error(where + "null x, pre, norm_w or h");
  if (a.f && (!a.post || !a.comb || !a.y)) throw error(where + "with F, post, comb and y are required");
  if (a.fn && (!a.base || !a.scale || !a.next_pre || !a.next_post || !a.next_comb || a.iters < 1))
    throw error(where + "with fn, base, scale, next_pre/post/comb and iters >= 1 are required");
  for (const void* p : {(const void*)a.x, (const void*)a.f, (const void*)a.y, (const void*)a.h, (const void*)a.norm_w,
                        (const void*)a.fn})
    if (reinterpret_cast<std::uintptr_t>(p) % 16) throw error(where + "tensors must be 16-byte aligned");
  const unsigned splits = unsigned((a.dim + mhc_workspace::slice - 1) / mhc_workspace::slice);
  // One token per CTA at decode (more CTAs), groups of 8 when there are many tokens (the weight
  // is then read once per 8 tokens).
  if (a.tokens <= 16) {
    if (a.tokens > 65535) throw error(where + "too many tokens for one launch");
    runtime::launch_programmatic(detail::mhc_step_kernel<1>, dim3(splits, unsigned(a.tokens)), dim3(detail::mhc_threads), 0,
                                 stream, a, ws.partials(), ws.counters());
  } else {
    const long long groups = (a.tokens + 7) / 8;
    if (groups > 65535) throw error(where + "too many tokens for one launch");
    runtime::launch_programmatic(detail::mhc_step_kernel<8>, dim3(splits, unsigned(groups)), dim3(detail::mhc_threads), 0,
                                 stream, a, ws.partials(), ws.counters());
  }
  DSV4_CUDA_CHECK_LAUNCH();
}

}  // namespace dsv4::kernels::mhc
