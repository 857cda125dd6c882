#pragma once
//! \file
//! Benchmark plumbing: CUDA-event timing with warm-up and the median of repeated runs, and the
//! ceilings measured in the same process (device-to-device copy bandwidth).

#include <cublas_v2.h>      // provides cublasGemmEx (the bf16 GEMM ceiling)
#include <cuda_runtime.h>  // provides cudaEvent_t

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "dsv4/config.hpp"
#include "dsv4/core/error.hpp"
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

//! Per-call milliseconds of `calls` back-to-back calls of `fn(stream)` replayed as one CUDA graph
//! (median of `reps` replays, divided by `calls`). A model replays its decode step as a graph,
//! so launch latency and host overhead are hidden there; timing a single short kernel between
//! events would mostly time the launch.
inline double median_ms_per_call(const std::function<void(cudaStream_t)>& fn, int calls = 20, int warmup = 2,
                                 int reps = 10) {
  cudaStream_t s;
  DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  DSV4_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  try {
    for (int i = 0; i < calls; ++i) fn(s);
  } catch (...) {
    // End the capture (it would keep this thread from allocating) and free what it holds, so
    // that a caller who catches the error can go on.
    cudaGraph_t partial = nullptr;
    if (cudaStreamEndCapture(s, &partial) == cudaSuccess && partial) cudaGraphDestroy(partial);
    (void)cudaGetLastError();
    cudaStreamDestroy(s);
    throw;
  }
  DSV4_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  DSV4_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < warmup; ++i) DSV4_CUDA_CHECK(cudaGraphLaunch(exec, s));
  DSV4_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaEvent_t start, stop;
  DSV4_CUDA_CHECK(cudaEventCreate(&start));
  DSV4_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    DSV4_CUDA_CHECK(cudaEventRecord(start, s));
    DSV4_CUDA_CHECK(cudaGraphLaunch(exec, s));
    DSV4_CUDA_CHECK(cudaEventRecord(stop, s));
    DSV4_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    DSV4_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] / calls;
}

//! Device copy bandwidth in bytes/s (read + write counted), over `bytes` per direction.
inline double copy_bandwidth(std::size_t bytes) {
  runtime::device_buffer<unsigned char> a(bytes), b(bytes);
  a.fill_bytes(1);
  const double ms = median_ms([&] { DSV4_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice)); });
  return 2.0 * double(bytes) / (ms * 1e-3);
}

//! Dense bf16 GEMM rate in FLOP/s (cuBLAS, fp32 accumulation, n x n x n).
inline double bf16_gemm_rate(int n = 8192) {
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) throw error("cublasCreate failed");
  runtime::device_buffer<unsigned short> a(std::size_t(n) * n), b(std::size_t(n) * n), c(std::size_t(n) * n);
  a.fill_bytes(0x3c);  // 0x3c3c: a small normal bf16 value
  b.fill_bytes(0x3c);
  const float one = 1.0f, zero = 0.0f;
  const double ms = median_ms([&] {
    if (cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a.data(), CUDA_R_16BF, n, b.data(), CUDA_R_16BF, n,
                     &zero, c.data(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
      throw error("cublasGemmEx failed");
  }, 3, 10);
  cublasDestroy(h);
  return 2.0 * double(n) * n * n / (ms * 1e-3);
}

//! The benchmarks' one option: `--json FILE`. Returns false (after printing usage) on anything else.
inline bool parse_json_option(int argc, char** argv, const char* name, std::string& json) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--json" && i + 1 < argc) {
      json = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--json FILE]\n", name);
      return false;
    }
  }
  return true;
}

namespace detail {
DSV4_KERNEL void fill_codes_kernel(std::uint8_t* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    std::uint32_t h = std::uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = std::uint8_t(h & 0xF7u);
  }
}
DSV4_KERNEL void fill_bf16_kernel(unsigned short* p, std::size_t n, std::uint32_t seed, float scale) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    std::uint32_t h = std::uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    const float v = (float(h % 2001u) - 1000.0f) / 1000.0f * scale;
    p[i] = static_cast<unsigned short>(__float_as_uint(v) >> 16);
  }
}
}  // namespace detail

//! Pseudo-random bf16 values, uniform in [-scale, scale] (truncated to bf16).
inline void fill_bf16(void* p, std::size_t n, std::uint32_t seed, float scale) {
  detail::fill_bf16_kernel<<<1024, 256>>>(static_cast<unsigned short*>(p), n, seed, scale);
  DSV4_CUDA_CHECK_LAUNCH();
}

//! Pseudo-random code bytes without E4M3 NaN codes (bit 3 clear excludes 0x7F and 0xFF).
inline void fill_codes(std::uint8_t* p, std::size_t n, std::uint32_t seed) {
  detail::fill_codes_kernel<<<1024, 256>>>(p, n, seed);
  DSV4_CUDA_CHECK_LAUNCH();
}

//! Both ceilings of a compute + memory roofline, measured now and printed.
struct ceilings {
  double copy_bps = 0, gemm_fps = 0;
  static ceilings measure() {
    ceilings c{copy_bandwidth(std::size_t(1) << 30), bf16_gemm_rate()};
    std::printf("ceilings: copy %.0f GB/s (1 GiB D2D, read + write), cuBLAS bf16 GEMM %.0f TFLOP/s (8192^3)\n",
                c.copy_bps / 1e9, c.gemm_fps / 1e12);
    return c;
  }
  //! Seconds of the roofline floor for a kernel of `flops` and `bytes`.
  double floor_s(double flops, double bytes) const { return std::max(flops / gemm_fps, bytes / copy_bps); }
};

//! A command-line list of positive integers: "8192,65535" -> {8192, 65535}; anything else is a
//! dsv4::error naming the flag and the entry.
inline std::vector<int> int_list(const std::string& flag, const std::string& text) {
  std::vector<int> v;
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t end = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, end - at);
    std::size_t used = 0;
    int n = 0;
    try {
      n = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || n <= 0)
      throw error(flag + ": '" + item + "' is not a positive integer (expected a list like 8192,65535)");
    v.push_back(n);
    at = end + 1;
  }
  return v;
}

}  // namespace dsv4::bench
