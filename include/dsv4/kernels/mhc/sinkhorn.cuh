#pragma once
//! \file
//! CUDA mHC split + Sinkhorn: one thread per token, the same function as the host (sinkhorn.hpp).

#include <cuda_runtime.h>  // provides cudaStream_t

#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/mhc/sinkhorn.hpp"
#include "dsv4/runtime/cuda_check.cuh"

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

namespace detail {
DSV4_KERNEL void sinkhorn_kernel(sinkhorn_args a) {
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
  detail::sinkhorn_kernel<<<unsigned((a.tokens + 127) / 128), 128, 0, stream>>>(a);
  DSV4_CUDA_CHECK_LAUNCH();
}

}  // namespace dsv4::kernels::mhc
