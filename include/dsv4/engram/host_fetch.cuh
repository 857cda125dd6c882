#pragma once
//! \file
//! Moving a call's Engram rows from a host-memory table to the device (issue 5, item 5), ahead of
//! the consuming layer: `start` gathers the rows into pinned staging (host_table.hpp; on a worker
//! thread for prefill-sized packs, inline for a decode step's few rows) and issues the
//! cudaMemcpyAsyncs on the fetcher's own stream, then records an event; the forward goes on launching the layers before the Engram layer meanwhile. `wait`
//! (called when the Engram layer is launched) joins the worker and makes the model's stream wait
//! for the event, so the copy overlaps the earlier layers' GPU work and only the part that is not
//! done by then delays anything. `view` is the module's weights with the table replaced by the
//! pack, `ids` the pack indices to gather with (engram.cuh reads them like hash ids).

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <span>
#include <string>
#include <thread>

#include "dsv4/core/error.hpp"
#include "dsv4/engram/engram.cuh"
#include "dsv4/engram/host_table.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "dsv4/runtime/pinned_buffer.cuh"
#include "dsv4/runtime/stream.cuh"

namespace dsv4::engram {

//! What the fetches of one module cost (docs/perf.md reports them per token).
struct fetch_stats {
  long long calls = 0, rows = 0;
  double bytes = 0;         //!< sent to the device (codes, scales, pack indices)
  double gather_s = 0;      //!< host gather time (on the worker)
  double waited_s = 0;      //!< time the launching thread spent on fetches (waiting in `wait`, or an
                            //!< inline gather in `start`): the part not hidden
};

class host_table_fetch {
 public:
  //! `max_ids`: the most (token, column) pairs a call has (max rows x columns).
  host_table_fetch(const host_table& table, long long max_ids)
      : table_(table), max_ids_(max_ids), stream_(runtime::owned_stream::non_blocking()),
        staging_(bytes_for(table, max_ids)), device_(bytes_for(table, max_ids)) {
    if (max_ids <= 0) throw error("engram host table fetch: max_ids must be positive");
    DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
    DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&released_, cudaEventDisableTiming));
  }
  ~host_table_fetch() {
    if (pending_.valid()) pending_.wait();
    if (copied_) {
      cudaEventSynchronize(copied_);  // staging and device buffers are freed next
      cudaEventDestroy(copied_);
    }
    if (released_) cudaEventDestroy(released_);
  }
  host_table_fetch(const host_table_fetch&) = delete;
  host_table_fetch& operator=(const host_table_fetch&) = delete;

  //! Starts fetching the rows of `ids` ([tokens, columns] hash ids, copied: the caller's vector
  //! may go). `consumer`: the stream that reads the packs; the new pack overwrites the device
  //! buffer only after the work enqueued there so far (the previous pack's reader). A fetch still
  //! in flight is waited for first (the staging buffer is reused). Packs of up to
  //! `inline_max_ids` rows (a decode step's) are gathered and their copy issued right here: a
  //! few dozen rows take microseconds, less than handing them to a worker thread did (58 us per
  //! call measured, docs/perf.md); larger ones (a prefill's) go to a worker so that the layers
  //! before the Engram layer launch meanwhile.
  void start(std::span<const std::int64_t> ids, cudaStream_t consumer) {
    if (static_cast<long long>(ids.size()) > max_ids_)
      throw error("engram host table fetch: " + std::to_string(ids.size()) + " ids, the fetcher holds " +
                  std::to_string(max_ids_));
    // A fetch whose call failed before `wait` may still run: let it end (its error, if any, was
    // that call's, and is dropped with it).
    if (pending_.valid()) pending_.wait();
    DSV4_CUDA_CHECK(cudaEventSynchronize(copied_));  // the previous copy has left the staging buffer
    n_ = static_cast<long long>(ids.size());
    DSV4_CUDA_CHECK(cudaEventRecord(released_, consumer));
    if (static_cast<long long>(ids.size()) <= inline_max_ids) {
      const auto t0 = std::chrono::steady_clock::now();
      gather_and_copy(ids, 1);
      // The launching thread did the gather itself: none of it is hidden.
      stats_.waited_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      return;
    }
    pending_ = std::async(std::launch::async, [this, v = std::vector<std::int64_t>(ids.begin(), ids.end())] {
      gather_and_copy(v, std::max(1u, std::thread::hardware_concurrency() / 2));
    });
  }

  //! Packs of at most this many rows are gathered on the calling thread (see start).
  static constexpr long long inline_max_ids = 512;

  //! Makes `stream` wait for the started fetch (joining its worker first; a gather error is
  //! rethrown here).
  void wait(cudaStream_t stream) {
    const auto t0 = std::chrono::steady_clock::now();
    finish();
    stats_.waited_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    DSV4_CUDA_CHECK(cudaStreamWaitEvent(stream, copied_, 0));
  }

  //! `w` with the table replaced by the pack of the last fetch.
  engram_device_weights view(engram_device_weights w) const {
    w.embed = codes(const_cast<std::uint8_t*>(device_.data()));
    w.embed_scale = scales(const_cast<std::uint8_t*>(device_.data()));
    w.rows = std::max(n_, 1LL);
    return w;
  }
  //! The pack indices of the last fetch, [tokens, columns] like the hash ids they replace.
  const std::int64_t* ids() const { return packed(const_cast<std::uint8_t*>(device_.data())); }
  const fetch_stats& stats() const { return stats_; }

 private:
  host_table table_;
  long long max_ids_ = 0, n_ = 0;
  runtime::owned_stream stream_;
  runtime::pinned_buffer<std::uint8_t> staging_;  // codes, then scales, then pack indices, at full size
  runtime::device_buffer<std::uint8_t> device_;   // the same layout
  cudaEvent_t copied_ = nullptr;    // the last pack is on the device
  cudaEvent_t released_ = nullptr;  // the consumer has enqueued everything before this fetch
  std::future<void> pending_;
  fetch_stats stats_;

  static std::size_t bytes_for(const host_table& t, long long max_ids) {
    return std::size_t(std::max(max_ids, 1LL)) * (t.row_bytes() + sizeof(std::int64_t)) + 16;
  }
  // The three regions at full size; the index region is rounded up to 8-byte alignment.
  std::uint8_t* codes(std::uint8_t* base) const { return base; }
  std::uint8_t* scales(std::uint8_t* base) const { return base + std::size_t(max_ids_) * std::size_t(table_.head_dim); }
  std::int64_t* packed(std::uint8_t* base) const {
    const std::size_t at = std::size_t(max_ids_) * table_.row_bytes();
    return reinterpret_cast<std::int64_t*>(base + (at + 7) / 8 * 8);
  }
  // Gathers the rows of `ids` into the staging buffer (on `threads` threads), then copies the
  // three used prefixes on the fetcher's stream once the consumer has released the device buffer.
  void gather_and_copy(std::span<const std::int64_t> ids, unsigned threads) {
    const auto t0 = std::chrono::steady_clock::now();
    gather_rows(table_, ids, codes(staging_.data()), scales(staging_.data()), packed(staging_.data()), threads);
    stats_.gather_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // The pack is contiguous only at the full size, so copy the three used prefixes.
    DSV4_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), released_, 0));
    const long long n = static_cast<long long>(ids.size());
    copy(codes(device_.data()), codes(staging_.data()), std::size_t(n) * std::size_t(table_.head_dim));
    copy(scales(device_.data()), scales(staging_.data()), std::size_t(n) * std::size_t(table_.head_dim / 32));
    copy(reinterpret_cast<std::uint8_t*>(packed(device_.data())), reinterpret_cast<std::uint8_t*>(packed(staging_.data())),
         std::size_t(n) * sizeof(std::int64_t));
    DSV4_CUDA_CHECK(cudaEventRecord(copied_, stream_.get()));
    stats_.calls += 1, stats_.rows += n;
    stats_.bytes += double(n) * double(table_.row_bytes() + sizeof(std::int64_t));
  }
  void copy(std::uint8_t* dst, const std::uint8_t* src, std::size_t bytes) {
    if (bytes) DSV4_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_.get()));
  }
  void finish() {
    if (pending_.valid()) pending_.get();
  }
};

}  // namespace dsv4::engram
