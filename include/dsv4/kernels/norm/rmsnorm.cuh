#pragma once
//! \file
//! CUDA RMSNorm (spec §4), rows of bf16 in, bf16 out, weight bf16 (backbone) or fp32 (vision).
//! One CTA per row. The sum of squares is accumulated in double, like the host reference
//! (reference.hpp), so that the fp32 mean, and with it every output, is the host's bit for bit
//! except when a different double summation order lands on the other side of an fp32 rounding
//! boundary (a 2^-29 relative event); the reciprocal square root is a correctly rounded sqrt
//! followed by a correctly rounded division, as on the host.

#include <cuda_runtime.h>  // provides cudaStream_t, uint4

#include <string>
#include <type_traits>

#include "dsv4/core/error.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::norm {

template <class Weight>
struct rmsnorm_args {
  const numerics::bf16* x = nullptr;  //!< [rows, dim], row stride x_stride elements
  long long x_stride = 0;
  const Weight* w = nullptr;          //!< [dim]
  numerics::bf16* y = nullptr;        //!< [rows, dim], row stride y_stride elements (may equal x)
  long long y_stride = 0;
  long long rows = 0;
  int dim = 0;
  float eps = 1e-20f;
};

namespace detail {
inline constexpr int rmsnorm_threads = 256;

template <class Weight>
DSV4_DEVICE float weight_value(const Weight* w, int i) {
  if constexpr (std::is_same_v<Weight, float>)
    return w[i];
  else
    return w[i].to_float();
}

template <class Weight>
DSV4_KERNEL void __launch_bounds__(rmsnorm_threads) rmsnorm_kernel(rmsnorm_args<Weight> a) {
  runtime::start_after_previous_grid();
  __shared__ double partial[rmsnorm_threads / 32];
  __shared__ float inv_rms;
  const numerics::bf16* x = a.x + blockIdx.x * a.x_stride;
  double ss = 0;
  for (int i = threadIdx.x * 8; i < a.dim; i += rmsnorm_threads * 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(x + i);
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
    for (int j = 0; j < 8; ++j) {
      const double v = __uint_as_float((words[j / 2] >> (16 * (j % 2))) << 16);
      ss += v * v;
    }
  }
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < rmsnorm_threads / 32; ++w) total += partial[w];
    const float mean = float(total / double(a.dim));
    inv_rms = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, a.eps)));
  }
  __syncthreads();
  const float r = inv_rms;
  numerics::bf16* y = a.y + blockIdx.x * a.y_stride;
  for (int i = threadIdx.x; i < a.dim; i += rmsnorm_threads)
    y[i] = numerics::bf16::from_float(__fmul_rn(weight_value(a.w, i), __fmul_rn(x[i].to_float(), r)));
}
}  // namespace detail

//! y = RMSNorm(x) * w per row. Rows must be 16-byte aligned with dim a multiple of 8.
template <class Weight>
void rmsnorm(const rmsnorm_args<Weight>& a, cudaStream_t stream = nullptr) {
  static_assert(std::is_same_v<Weight, float> || std::is_same_v<Weight, numerics::bf16>,
                "rmsnorm: the weight is bf16 (backbone) or float (vision)");
  const std::string where = "rmsnorm (rows " + std::to_string(a.rows) + ", dim " + std::to_string(a.dim) + "): ";
  if (a.rows < 0 || a.dim <= 0 || a.dim % 8 != 0) throw error(where + "need rows >= 0 and dim a positive multiple of 8");
  if (a.rows > 2147483647LL) throw error(where + "too many rows for one launch");
  if (a.rows == 0) return;
  if (!a.x || !a.w || !a.y) throw error(where + "null pointer argument");
  if (reinterpret_cast<std::uintptr_t>(a.x) % 16 || a.x_stride % 8)
    throw error(where + "x must be 16-byte aligned with a row stride that is a multiple of 8 elements");
  if (a.x_stride < a.dim || a.y_stride < a.dim) throw error(where + "row strides must be at least dim");
  runtime::launch_programmatic(detail::rmsnorm_kernel<Weight>, dim3(unsigned(a.rows)), dim3(detail::rmsnorm_threads), 0, stream,
                               a);
  DSV4_CUDA_CHECK_LAUNCH();
}

}  // namespace dsv4::kernels::norm
