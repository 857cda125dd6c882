#pragma once
//! \file
//! Facts about the current CUDA device that launchers size their grids by, asked once per device
//! (launchers run per layer, and cudaDeviceGetAttribute is not free).

#include <cuda_runtime.h>

#include <atomic>

#include "dsv4/runtime/cuda_check.cuh"

namespace dsv4::runtime {

//! Slots for one non-negative int per device (devices 0..63; 0 in a slot: not known yet).
using per_device_ints = std::atomic<int>[64];

//! `compute(device)` for the current device, computed once per device into `slots` (stored + 1,
//! so that 0 can be an answer). Devices past the slots are asked every time.
template <class Compute>
int cached_per_device(per_device_ints& slots, Compute compute) {
  int dev = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&dev));
  const bool slot = dev >= 0 && dev < 64;
  if (slot)
    if (const int k = slots[dev].load(std::memory_order_relaxed); k != 0) return k - 1;
  const int value = compute(dev);
  if (slot) slots[dev].store(value + 1, std::memory_order_relaxed);
  return value;
}

namespace detail {
//! An integer attribute of the current device, cached per device and attribute slot.
template <cudaDeviceAttr Attr>
int cached_device_attribute() {
  static per_device_ints cached = {};
  return cached_per_device(cached, [](int dev) {
    int value = 0;
    DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&value, Attr, dev));
    return value;
  });
}
}  // namespace detail

//! Streaming multiprocessors of the current device.
inline int sm_count() { return detail::cached_device_attribute<cudaDevAttrMultiProcessorCount>(); }

//! The most dynamic shared memory one block may opt in to on the current device (bytes).
inline int max_shared_per_block_optin() { return detail::cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(); }

//! The compute capability's major number of the current device (9: Hopper, sm_90).
inline int compute_capability_major() { return detail::cached_device_attribute<cudaDevAttrComputeCapabilityMajor>(); }

}  // namespace dsv4::runtime
