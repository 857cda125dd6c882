#pragma once
// A cuBLAS handle for device tests, with a zero-filled workspace of our own (so that no test
// depends on what a previous user left in cuBLAS's default workspace).

#include <cublas_v2.h>  // provides cublasCreate, cublasSetWorkspace

#include "dsv4/core/error.hpp"
#include "dsv4/runtime/device_buffer.cuh"

namespace dsv4::test {

struct blas_handle {
  cublasHandle_t h = nullptr;
  runtime::device_buffer<unsigned char> workspace{std::size_t(64) << 20};
  blas_handle() {
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) throw error("cublasCreate failed");
    workspace.fill_bytes(0);
    if (cublasSetWorkspace(h, workspace.data(), workspace.size()) != CUBLAS_STATUS_SUCCESS)
      throw error("cublasSetWorkspace failed");
  }
  ~blas_handle() { cublasDestroy(h); }
  blas_handle(const blas_handle&) = delete;
  blas_handle& operator=(const blas_handle&) = delete;
};

}  // namespace dsv4::test
