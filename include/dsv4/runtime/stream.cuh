#pragma once
//! \file
//! An owned CUDA stream created non-blocking: it does not synchronize with the legacy default
//! stream, so work on it can be captured as a CUDA graph and is not serialized behind unrelated
//! legacy-stream work. The price: nothing issued on the legacy stream (synchronous cudaMemcpy,
//! cudaMemset, device_buffer uploads) is ordered before work on this stream; order it by hand
//! (cudaDeviceSynchronize once after setup, or issue the copy on this stream).
//! Also an owned event (no timing) for ordering work across streams: fork and join.

#include <cuda_runtime.h>  // provides cudaStreamCreateWithFlags, cudaEventCreateWithFlags

#include <utility>

#include "dsv4/runtime/cuda_check.cuh"

namespace dsv4::runtime {

class owned_stream {
 public:
  //! Creates a stream with cudaStreamNonBlocking.
  static owned_stream non_blocking() {
    owned_stream s;
    DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream_, cudaStreamNonBlocking));
    return s;
  }
  owned_stream() = default;
  //! Waits for the stream's work before destroying it (buffers freed after it may still be read).
  ~owned_stream() {
    if (stream_) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }
  owned_stream(owned_stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)) {}
  owned_stream& operator=(owned_stream&& o) noexcept {
    std::swap(stream_, o.stream_);
    return *this;
  }
  owned_stream(const owned_stream&) = delete;
  owned_stream& operator=(const owned_stream&) = delete;

  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

//! An owned cudaEvent_t created with cudaEventDisableTiming (for cross-stream order, also
//! inside a graph capture: a record and a wait become an edge of the graph).
class owned_event {
 public:
  static owned_event ordering() {
    owned_event e;
    DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&e.event_, cudaEventDisableTiming));
    return e;
  }
  owned_event() = default;
  ~owned_event() {
    if (event_) cudaEventDestroy(event_);
  }
  owned_event(owned_event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  owned_event& operator=(owned_event&& o) noexcept {
    std::swap(event_, o.event_);
    return *this;
  }
  owned_event(const owned_event&) = delete;
  owned_event& operator=(const owned_event&) = delete;

  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

//! `after` waits for the work issued on `before` so far.
inline void order_after(cudaStream_t after, cudaStream_t before, const owned_event& e) {
  DSV4_CUDA_CHECK(cudaEventRecord(e.get(), before));
  DSV4_CUDA_CHECK(cudaStreamWaitEvent(after, e.get(), 0));
}

}  // namespace dsv4::runtime
