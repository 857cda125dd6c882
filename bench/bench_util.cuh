#pragma once
//! \file
//! Benchmark plumbing: CUDA-event timing with warm-up and the median of repeated runs, and the
//! ceilings measured in the same process (device-to-device copy bandwidth).

#include <cuda_runtime.h>  // provides cudaEvent_t

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_buffer.cuh"

namespace dsv4::bench {

//! Median milliseconds of `reps` runs of `fn` after `warmup` runs, each run timed by events.
inline double median_ms(const std::function<void()>& fn, int warmup = 5, int reps = 30) {
  for (int i = 0; i < warmup; ++i) fn();
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  DSV4_CUDA_CHECK(cudaEventCreate(&start));
  DSV4_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    DSV4_CUDA_CHECK(cudaEventRecord(start));
    fn();
    DSV4_CUDA_CHECK(cudaEventRecord(stop));
    DSV4_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    DSV4_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  DSV4_CUDA_CHECK(cudaEventDestroy(start));
  DSV4_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

//! Device copy bandwidth in bytes/s (read + write counted), over `bytes` per direction.
inline double copy_bandwidth(std::size_t bytes) {
  runtime::device_buffer<unsigned char> a(bytes), b(bytes);
  a.fill_bytes(1);
  const double ms = median_ms([&] { DSV4_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice)); });
  return 2.0 * double(bytes) / (ms * 1e-3);
}

}  // namespace dsv4::bench
