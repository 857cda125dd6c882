#pragma once
//! \file
//! Per-call metadata (positions, block tables, ...) uploaded with one asynchronous copy: a device
//! allocation and a pinned host staging buffer of the same size, made once for the caller's limits.
//!
//! Protocol, once per call: `begin_pack()` (waits until the previous call's copy has left the
//! staging buffer), `put()` each array (copied into staging; the device address of its slot is
//! returned at once), `upload(stream)` (one cudaMemcpyAsync of the packed prefix, then an event).
//! The device side is reused by the next call's copy, which is safe because that copy is issued on
//! the same stream as the kernels that read this call's metadata: keep every use on one stream.
//!
//! Each slot is `reserve` elements (the call's bound, not its count) rounded up to 256 bytes, so
//! the addresses depend only on the reserved sizes: calls of one shape (a decode batch size) see
//! the same pointers every time, which a captured CUDA graph needs.

#include <cuda_runtime.h>  // provides cudaMalloc, cudaMemcpyAsync, cudaEventRecord

#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "dsv4/core/error.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "dsv4/runtime/pinned_buffer.cuh"

namespace dsv4::runtime {

class upload_arena {
 public:
  static constexpr std::size_t alignment = 256;  // cudaMalloc's alignment: every slot starts as one would

  //! Bytes a slot of `n` elements of T takes (for sizing the arena from the limits).
  template <class T>
  static constexpr std::size_t space(std::size_t n) {
    return (n * sizeof(T) + alignment - 1) / alignment * alignment;
  }

  upload_arena() = default;
  //! `capacity`: the sum of space<T>(bound) over every array a call may put; `owner` names the
  //! arena in errors.
  upload_arena(std::size_t capacity, std::string owner)
      : owner_(std::move(owner)), device_(capacity), staging_(capacity) {
    if (capacity) std::memset(staging_.data(), 0, capacity);  // slot tails past a call's count are copied too
    DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming));
  }
  ~upload_arena() {
    if (uploaded_) {
      cudaEventSynchronize(uploaded_);  // the staging buffer is freed next: let the copy finish reading it
      cudaEventDestroy(uploaded_);
    }
  }
  upload_arena(upload_arena&& o) noexcept
      : owner_(std::move(o.owner_)), device_(std::move(o.device_)), staging_(std::move(o.staging_)),
        uploaded_(std::exchange(o.uploaded_, nullptr)), used_(o.used_), pending_(std::exchange(o.pending_, false)),
        packing_(std::exchange(o.packing_, false)) {}
  upload_arena& operator=(upload_arena&& o) noexcept {
    std::swap(owner_, o.owner_), std::swap(device_, o.device_), std::swap(staging_, o.staging_);
    std::swap(uploaded_, o.uploaded_), std::swap(used_, o.used_), std::swap(pending_, o.pending_);
    std::swap(packing_, o.packing_);
    return *this;
  }
  upload_arena(const upload_arena&) = delete;
  upload_arena& operator=(const upload_arena&) = delete;

  std::size_t capacity() const { return device_.size(); }
  //! Bytes packed since begin_pack (what upload copies).
  std::size_t used() const { return used_; }

  //! Starts a call's packing. Blocks until the previous upload has read the staging buffer (calls
  //! are sequential, and by then that copy has normally long finished).
  void begin_pack() {
    if (pending_) DSV4_CUDA_CHECK(cudaEventSynchronize(uploaded_));
    pending_ = false, packing_ = true, used_ = 0;
  }

  //! Copies `host` into the next slot of `reserve` elements (at least host.size()) and returns
  //! the slot's device address (null when reserve is 0). The device holds the values only once
  //! `upload` has run, in stream order.
  template <class T>
  T* put(std::span<const T> host, std::size_t reserve, const char* what) {
    static_assert(std::is_trivially_copyable_v<T>, "upload_arena::put: arrays are copied as bytes");
    static_assert(alignof(T) <= alignment, "upload_arena::put: slots are 256-byte aligned");
    if (!packing_) throw error(owner_ + ": put(" + what + ") outside begin_pack / upload");
    if (host.size() > reserve)
      throw error(owner_ + ": " + what + " has " + std::to_string(host.size()) + " elements, its slot holds " +
                  std::to_string(reserve));
    const std::size_t need = space<T>(reserve);
    if (need > capacity() - used_)
      throw error(owner_ + ": " + what + " (" + std::to_string(reserve) + " elements, " + std::to_string(need) +
                  " bytes) does not fit: " + std::to_string(used_) + " of " + std::to_string(capacity()) +
                  " bytes are packed already (the arena was sized for smaller limits)");
    if (reserve == 0) return nullptr;
    if (!host.empty()) std::memcpy(staging_.data() + used_, host.data(), host.size_bytes());
    T* slot = reinterpret_cast<T*>(device_.data() + used_);
    used_ += need;
    return slot;
  }

  //! One cudaMemcpyAsync of everything packed, on `stream`; the event marks when staging is free.
  void upload(cudaStream_t stream) {
    if (!packing_) throw error(owner_ + ": upload without begin_pack");
    packing_ = false;
    if (used_ == 0) return;
    DSV4_CUDA_CHECK(cudaMemcpyAsync(device_.data(), staging_.data(), used_, cudaMemcpyHostToDevice, stream));
    DSV4_CUDA_CHECK(cudaEventRecord(uploaded_, stream));
    pending_ = true;
  }

 private:
  std::string owner_;
  device_buffer<unsigned char> device_;
  pinned_buffer<unsigned char> staging_;
  cudaEvent_t uploaded_ = nullptr;
  std::size_t used_ = 0;
  bool pending_ = false;  //!< an upload may still be reading staging
  bool packing_ = false;
};

}  // namespace dsv4::runtime
