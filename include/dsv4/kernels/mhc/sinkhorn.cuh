#pragma once
//! \file
//! CUDA mHC split + Sinkhorn: one thread per token, the same function as the host (sinkhorn.hpp).

#include <cuda_runtime.h>  // provides cudaStream_t

#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/mhc/sinkhorn.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::mhc {

struct sinkhorn_args {
  const float* mixes = nullptr;  //!< [tokens, 24]
  const float* scale = nullptr;  //!< [3]
  const float* base = nullptr;   //!< [24]
  float* pre = nullptr;          //!< [tokens, 4]
  float* post = nullptr;         //!< [tokens, 4]
  float* comb = nullptr;         //!< [tokens, 4, 4]
  long long tokens = 0;
  int iters = 20;
  float eps = 1e-6f;
};

//! The same split, computed by half a warp for one token: lane 4 r + j of a half owns comb[r][j]
//! and the row and column sums are gathered by shuffles inside the half and added in the sequential
//! function's order, so the result is that of `split_sinkhorn` bit for bit, at 1/16 of its
//! single-thread latency (the 640 dependent divisions of 20 iterations dominate a decode step
//! otherwise). All 16 lanes of a half call it with the half's token (mixes, pre, post, comb): two
//! tokens a warp, or one where both halves pass the same and only lanes 0..15 say `writes`. The
//! halves shuffle only among their own lanes (a 16-lane mask), so they are independent: they may
//! run different `iters`, and one half may be absent. In a writing half, its lanes 0..15 write comb
//! and 0..3 pre and post.
DSV4_DEVICE void split_sinkhorn_warp(const float* mixes, const float* scale, const float* base, int iters,
                                     float eps, float* pre, float* post, float* comb, bool writes) {
  using numerics::mul_rn;
  const int lane = threadIdx.x % 32, hl = lane % 16, r = hl / hc, j = hl % hc;
  const unsigned half = 0xffffu << (lane & 16);  // the calling half's lanes
  if (writes && hl < hc) {
    pre[hl] = sigmoid_f32(mul_rn(mixes[hl], scale[0]) + base[hl]) + eps;
    post[hl] = 2.0f * sigmoid_f32(mul_rn(mixes[hc + hl], scale[1]) + base[hc + hl]);
  }
  const int e = 2 * hc + r * hc + j;
  float c = mul_rn(mixes[e], scale[2]) + base[e];
  auto row_lane = [&](int q) { return (lane & ~(hc - 1)) + q; };   // lane of (r, q)
  auto col_lane = [&](int q) { return (lane & 16) + q * hc + j; };  // lane of (q, j)
  float mx = -INFINITY;
  for (int q = 0; q < hc; ++q) {
    const float v = __shfl_sync(half, c, row_lane(q));
    mx = v > mx ? v : mx;
  }
  c = exp_f32(c - mx);
  float sum = 0.0f;
  for (int q = 0; q < hc; ++q) sum += __shfl_sync(half, c, row_lane(q));
  c = c / sum + eps;
  auto normalize = [&](bool rows) {
    float s = 0.0f;
    for (int q = 0; q < hc; ++q) s += __shfl_sync(half, c, rows ? row_lane(q) : col_lane(q));
    c = c / (s + eps);
  };
  normalize(false);
  for (int it = 0; it < iters - 1; ++it) {
    normalize(true);
    normalize(false);
  }
  if (writes) comb[hl] = c;
}

namespace detail {
DSV4_KERNEL void sinkhorn_kernel(sinkhorn_args a) {
  runtime::start_after_previous_grid();
  const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= a.tokens) return;
  float m[mix_count], pre[hc], post[hc], comb[hc * hc];
  for (int i = 0; i < mix_count; ++i) m[i] = a.mixes[t * mix_count + i];
  split_sinkhorn(m, a.scale, a.base, a.iters, a.eps, pre, post, comb);
  for (int i = 0; i < hc; ++i) {
    a.pre[t * hc + i] = pre[i];
    a.post[t * hc + i] = post[i];
  }
  for (int i = 0; i < hc * hc; ++i) a.comb[t * hc * hc + i] = comb[i];
}
}  // namespace detail

inline void split_sinkhorn(const sinkhorn_args& a, cudaStream_t stream = nullptr) {
  if (a.tokens < 0 || a.iters < 1) throw error("split_sinkhorn: need tokens >= 0 and iters >= 1");
  if (a.tokens == 0) return;
  if (!a.mixes || !a.scale || !a.base || !a.pre || !a.post || !a.comb) throw error("split_sinkhorn: null pointer argument");
  runtime::launch_programmatic(detail::sinkhorn_kernel, dim3(unsigned((a.tokens + 127) / 128)), dim3(128), 0, stream, a);
  DSV4_CUDA_CHECK_LAUNCH();
}

}  // namespace dsv4::kernels::mhc
