#pragma once
//! \file
//! bf16 <-> fp32 copies on the device, in one place for the model (the fp32 head's input), the
//! attention stack (the fp32 compressor projection) and the collectives (row-parallel partials):
//! widening is exact; narrowing rounds to nearest even, as numerics::bf16::from_float does.
//! One thread per element, launched programmatically (runtime/pdl.cuh).

#include <cuda_runtime.h>

#include "dsv4/numerics/bf16.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::numerics {

namespace convert_detail {
DSV4_KERNEL void widen_kernel(const bf16* x, float* y, long long n) {
  runtime::start_after_previous_grid();
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i].to_float();
}
DSV4_KERNEL void narrow_kernel(const float* x, bf16* y, long long n) {
  runtime::start_after_previous_grid();
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = bf16::from_float(x[i]);
}
inline dim3 grid_for(long long n) {
  return dim3(unsigned((n + 255) / 256));
}
}  // namespace convert_detail

//! y[i] = float(x[i]) for i < n, on `stream`.
inline void widen_to_fp32(const bf16* x, float* y, long long n, cudaStream_t stream) {
  if (n <= 0) return;
  runtime::launch_programmatic(convert_detail::widen_kernel, convert_detail::grid_for(n), dim3(256), 0,
                               stream, x, y, n);
  DSV4_CUDA_CHECK_LAUNCH();
}

//! y[i] = bf16(x[i]) (round to nearest even) for i < n, on `stream`.
inline void narrow_to_bf16(const float* x, bf16* y, long long n, cudaStream_t stream) {
  if (n <= 0) return;
  runtime::launch_programmatic(convert_detail::narrow_kernel, convert_detail::grid_for(n), dim3(256), 0,
                               stream, x, y, n);
  DSV4_CUDA_CHECK_LAUNCH();
}

}  // namespace dsv4::numerics
