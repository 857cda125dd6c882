#pragma once
//! \file
//! Facts about the current CUDA device that launchers size their grids by, asked once per device
//! (launchers run per layer, and cudaDeviceGetAttribute is not free).

#include <cuda_runtime.h>

#include <atomic>

#include "dsv4/runtime/cuda_check.cuh"

namespace dsv4::runtime {

//! Streaming multiprocessors of the current device.
inline int sm_count() {
  static std::atomic<int> cached[64] = {};
  int dev = 0, sms = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 0 && dev < 64 && (sms = cached[dev].load(std::memory_order_relaxed)) > 0) return sms;
  DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (dev >= 0 && dev < 64) cached[dev].store(sms, std::memory_order_relaxed);
  return sms;
}

}  // namespace dsv4::runtime
