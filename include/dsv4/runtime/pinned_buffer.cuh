#pragma once
//! \file
//! An owning, typed page-locked host allocation (cudaHostAlloc). Copies between it and the device
//! can be truly asynchronous (cudaMemcpyAsync from pageable memory is staged through a driver
//! buffer and synchronizes the host), so per-call uploads and the logits go through one of these.

#include <cuda_runtime.h>  // provides cudaHostAlloc, cudaFreeHost

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

#include "dsv4/runtime/cuda_check.cuh"

namespace dsv4::runtime {

template <class T>
class pinned_buffer {
  static_assert(std::is_trivially_copyable_v<T>, "pinned_buffer: elements are copied as bytes by the DMA engines");

 public:
  pinned_buffer() = default;
  explicit pinned_buffer(std::size_t n) : size_(n) {
    if (n) DSV4_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&ptr_), n * sizeof(T), cudaHostAllocDefault));
  }
  ~pinned_buffer() {
    if (ptr_) cudaFreeHost(ptr_);
  }
  pinned_buffer(pinned_buffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  pinned_buffer& operator=(pinned_buffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(size_, o.size_);
    return *this;
  }
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;

  T* data() { return ptr_; }
  const T* data() const { return ptr_; }
  std::size_t size() const { return size_; }
  std::size_t bytes() const { return size_ * sizeof(T); }

 private:
  T* ptr_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace dsv4::runtime
