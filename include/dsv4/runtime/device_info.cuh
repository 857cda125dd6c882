#pragma once
//! \file
//! Facts about the current CUDA device that launchers size their grids by, asked once per device
//! (launchers run per layer, and cudaDeviceGetAttribute is not free).

#include <cuda_runtime.h>

#include <atomic>

#include "dsv4/runtime/cuda_check.cuh"

namespace dsv4::runtime {

namespace detail {
//! An integer attribute of the current device, cached per device and attribute slot.
template <cudaDeviceAttr Attr>
int cached_device_attribute() {
  static std::atomic<int> cached[64] = {};
  int dev = 0, value = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 0 && dev < 64 && (value = cached[dev].load(std::memory_order_relaxed)) > 0) return value;
  DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&value, Attr, dev));
  if (dev >= 0 && dev < 64) cached[dev].store(value, std::memory_order_relaxed);
  return value;
}
}  // namespace detail

//! Streaming multiprocessors of the current device.
inline int sm_count() { return detail::cached_device_attribute<cudaDevAttrMultiProcessorCount>(); }

//! The most dynamic shared memory one block may opt in to on the current device (bytes).
inline int max_shared_per_block_optin() { return detail::cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(); }

//! The compute capability's major number of the current device (9: Hopper, sm_90).
inline int compute_capability_major() { return detail::cached_device_attribute<cudaDevAttrComputeCapabilityMajor>(); }

}  // namespace dsv4::runtime
