#pragma once
//! \file
//! An owning, typed device allocation (cudaMalloc; never managed memory) with checked copies.

#include <cuda_runtime.h>  // provides cudaMalloc, cudaMemcpy

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "dsv4/runtime/cuda_check.cuh"

namespace dsv4::runtime {

template <class T>
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t n) : size_(n) {
    if (n) DSV4_CUDA_CHECK(cudaMalloc(&ptr_, n * sizeof(T)));
  }
  explicit device_buffer(std::span<const T> host) : device_buffer(host.size()) { upload(host); }
  ~device_buffer() {
    if (ptr_) cudaFree(ptr_);
  }
  device_buffer(device_buffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(size_, o.size_);
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  T* data() { return ptr_; }
  const T* data() const { return ptr_; }
  std::size_t size() const { return size_; }
  std::size_t bytes() const { return size_ * sizeof(T); }

  void upload(std::span<const T> host) {
    if (host.size() != size_) throw error("device_buffer::upload: host span has " + std::to_string(host.size()) +
                                          " elements, buffer has " + std::to_string(size_));
    if (size_) DSV4_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice));
  }
  //! Copies `host` into the first host.size() elements (a call's share of a buffer sized for the most).
  void upload_prefix(std::span<const T> host) {
    if (host.size() > size_) throw error("device_buffer::upload_prefix: host span has " + std::to_string(host.size()) +
                                         " elements, buffer has " + std::to_string(size_));
    if (!host.empty()) DSV4_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(size_);
    if (size_) DSV4_CUDA_CHECK(cudaMemcpy(h.data(), ptr_, bytes(), cudaMemcpyDeviceToHost));
    return h;
  }
  //! Fill every byte with `byte` (tests poison outputs so unwritten elements are caught).
  void fill_bytes(unsigned char byte) {
    if (size_) DSV4_CUDA_CHECK(cudaMemset(ptr_, byte, bytes()));
  }

 private:
  T* ptr_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace dsv4::runtime
