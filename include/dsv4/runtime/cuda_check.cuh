#pragma once
//! \file
//! CUDA error handling: every runtime call and launch is checked, and a failure becomes a
//! dsv4::error naming the call, the file and line, and CUDA's own message.

#include <cuda_runtime.h>  // provides cudaError_t, cudaGetErrorString

#include <string>

#include "dsv4/core/error.hpp"

namespace dsv4::runtime {

inline void cuda_check(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess)
    throw error(std::string(file) + ":" + std::to_string(line) + ": " + what + " failed: " +
                cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

//! Number of visible CUDA devices, 0 when there is no driver or no device (never throws).
inline int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

}  // namespace dsv4::runtime

#define DSV4_CUDA_CHECK(expr) ::dsv4::runtime::cuda_check((expr), #expr, __FILE__, __LINE__)
//! After a kernel launch: report launch-configuration errors at the launch site.
#define DSV4_CUDA_CHECK_LAUNCH() ::dsv4::runtime::cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
