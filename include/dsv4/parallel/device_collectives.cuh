#pragma once
//! \file
//! What a tensor-parallel rank of the device model (model/device_model.cuh) calls to join the
//! other ranks (issue 7), behind one interface with two implementations:
//! - `nccl_collectives` (parallel/nccl.cuh): NCCL over the GPUs of one host, one rank per GPU;
//! - `staged_collectives` (here): the rank's values copied to the host, summed there by a
//!   host_communicator in rank order, copied back. Slow (the stream is synchronized at every
//!   collective), but it needs no NCCL and lets W ranks share one GPU, so the per-rank device
//!   model is testable on a one-GPU machine, and its sums are the host simulation's bit for bit.
//! Every call is collective (all ranks, same order, same counts) and is issued on the rank's
//! stream; the caller's thread must have the rank's device current (device_model's are). All
//! ranks of a world use the same implementation (nccl_collectives picks a different but
//! bit-equal sum for the partials at two ranks, which every rank must pick alike).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>
#include <memory>
#include <span>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/convert.cuh"
#include "dsv4/parallel/host_communicator.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/pinned_buffer.cuh"

namespace dsv4::parallel {

//! One rank's collectives on the device (see the file comment).
class device_collectives {
 public:
  virtual ~device_collectives() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  //! v [n] <- the sum over ranks of v, fp32.
  virtual void all_reduce_sum(float* v, std::size_t n, cudaStream_t stream) = 0;
  //! v [n] <- the sum over ranks of v, bf16: each addition rounds to bf16.
  virtual void all_reduce_sum(numerics::bf16* v, std::size_t n, cudaStream_t stream) = 0;
  //! out [size() * n] <- the ranks' `part` [n] concatenated in rank order.
  virtual void all_gather(const float* part, std::size_t n, float* out, cudaStream_t stream) = 0;
  //! Called by a rank whose call failed, before it returns: the other ranks' collectives, now or
  //! next, fail instead of waiting for it. The collectives are unusable afterwards.
  void abandon() {
    if (abandoned_) return;  // once: a second barrier drop would release a rank twice
    abandoned_ = true;
    release_others();
  }
  //! abandon() was called on this rank's collectives.
  bool abandoned() const { return abandoned_; }

  //! model.py's sum after a row-parallel layer: out <- bf16(sum over ranks of fp32(partial)),
  //! through `scratch` [n] floats. `out` may be `partial`.
  virtual void all_reduce_partials(const numerics::bf16* partial, float* scratch, numerics::bf16* out,
                                   std::size_t n, cudaStream_t stream) {
    if (n == 0) return;
    if (!partial || !scratch || !out) throw error("device_collectives::all_reduce_partials: null buffer");
    numerics::widen_to_fp32(partial, scratch, static_cast<long long>(n), stream);
    all_reduce_sum(scratch, n, stream);
    numerics::narrow_to_bf16(scratch, out, static_cast<long long>(n), stream);
  }

 protected:
  //! abandon()'s effect on the other ranks.
  virtual void release_others() = 0;

 private:
  bool abandoned_ = false;
};

//! A rank's collectives through the host (see the file comment): its values go down to pinned
//! memory, `comm` sums them with the other ranks' in rank order (host_communicator), the result
//! goes back up. `comm` must outlive this object and is shared by the W ranks (each on its own
//! thread; the ranks may share a GPU).
class staged_collectives final : public device_collectives {
 public:
  staged_collectives(host_communicator& comm, int rank) : comm_(comm), rank_(rank) {
    if (rank < 0 || rank >= comm.world())
      throw error("staged_collectives: rank " + std::to_string(rank) + " of world size " +
                  std::to_string(comm.world()));
  }
  int rank() const override { return rank_; }
  int size() const override { return comm_.world(); }

  void all_reduce_sum(float* v, std::size_t n, cudaStream_t stream) override {
    auto host = down(v, n, stream, "all_reduce_sum (fp32)");
    comm_.all_reduce_fp32(rank_, host);
    up(v, host.data(), host.size(), stream);
  }
  void all_reduce_sum(numerics::bf16* v, std::size_t n, cudaStream_t stream) override {
    auto host = down(v, n, stream, "all_reduce_sum (bf16)");
    comm_.all_reduce_bf16(rank_, host);
    up(v, host.data(), host.size(), stream);
  }
  void all_gather(const float* part, std::size_t n, float* out, cudaStream_t stream) override {
    if (!out && n)
      throw error("staged_collectives::all_gather: null output on rank " + std::to_string(rank_));
    auto host = down(part, n, stream, "all_gather");
    const auto all = comm_.all_gather(rank_, host);
    up(out, all.data(), all.size(), stream);
  }

 private:
  void release_others() override { comm_.abandon(); }

  //! The device values [n], copied into the staging buffer once the stream has reached this point.
  template <class T>
  std::span<T> down(const T* v, std::size_t n, cudaStream_t stream, const char* what) {
    if (!v && n)
      throw error(std::string("staged_collectives::") + what + ": null buffer on rank " +
                  std::to_string(rank_));
    reserve(n * sizeof(T) * std::size_t(size()));
    T* h = reinterpret_cast<T*>(staging_.data());
    if (n) DSV4_CUDA_CHECK(cudaMemcpyAsync(h, v, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
    return {h, n};
  }
  //! Host values [n] back to the device; waits for the copy, as the staging buffer is reused next.
  template <class T>
  void up(T* v, const T* host, std::size_t n, cudaStream_t stream) {
    if (n == 0) return;
    reserve(n * sizeof(T));
    T* h = reinterpret_cast<T*>(staging_.data());
    if (host != h) std::memcpy(h, host, n * sizeof(T));
    DSV4_CUDA_CHECK(cudaMemcpyAsync(v, h, n * sizeof(T), cudaMemcpyHostToDevice, stream));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  //! Grows the staging buffer to `bytes` (never shrinks; contents are not kept).
  void reserve(std::size_t bytes) {
    if (staging_.size() < bytes) staging_ = runtime::pinned_buffer<std::byte>(bytes);
  }

  host_communicator& comm_;
  int rank_;
  runtime::pinned_buffer<std::byte> staging_;
};

}  // namespace dsv4::parallel
