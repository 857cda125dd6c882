#pragma once
//! \file
//! The device model on W tensor-parallel ranks (issue 7): one model::device_model per rank, each
//! built from its own checkpoint shard (parallel::rank_model) on its own device, and a thread per
//! rank for every call, as model.py runs one process per GPU. The ranks' collectives are either
//! - NCCL, one GPU per rank (`make_nccl_tp_device_model`, parallel/tp_device_model_nccl.cuh), or
//! - staged through the host (`tp_device_model::staged`): any number of ranks on one GPU, sums in
//!   the host simulation's rank order. A test and debugging tool: every collective waits for the
//!   device.
//! A call returns the full logits, which every rank holds after the head's all-gather (checked: a
//! rank holding other bits would mean the replicated state diverged).
//!
//! Failures. Token ids are checked once, before any rank starts. Every rank then begins the call
//! (device_model::begin_*: its checks, no collective); a call that every rank refuses alike (a
//! busy slot, a full page pool) is refused and the model stays usable; one that only some ranks
//! refuse is cancelled on the others. A rank that fails while running a call abandons the
//! collectives, so the others fail too instead of waiting. After either, the model is unusable
//! (`broken()`, each call says so) and must be rebuilt, as after a failed NCCL communicator.

#include <cuda_runtime.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/model/device_model.cuh"
#include "dsv4/parallel/device_collectives.cuh"
#include "dsv4/parallel/host_communicator.hpp"
#include "dsv4/parallel/tensor_parallel_reference.hpp"
#include "dsv4/runtime/cuda_check.cuh"

namespace dsv4::parallel {

template <class Model>
class tp_device_model {
 public:
  using rank_model_t = model::device_model<Model>;
  using limits = typename rank_model_t::limits;

  //! W = m.world() ranks, all on `device`, collectives staged through the host.
  static tp_device_model staged(const tp_model<Model>& m, const limits& lim, int device = 0) {
    const int W = m.world();
    if (W < 1) throw error("tp_device_model: no ranks");
    auto comm = std::make_shared<host_communicator>(W);
    std::vector<std::unique_ptr<device_collectives>> cs;
    for (int r = 0; r < W; ++r) cs.push_back(std::make_unique<staged_collectives>(*comm, r));
    return tp_device_model(m, lim, std::move(cs), std::vector<int>(std::size_t(W), device), comm);
  }

  //! Rank r on devices[r] with collectives comms[r] (comms[r]->rank() == r); `keep` holds what the
  //! collectives need alive (an NCCL world), released after the models.
  tp_device_model(const tp_model<Model>& m, const limits& lim,
                  std::vector<std::unique_ptr<device_collectives>> comms, std::vector<int> devices,
                  std::shared_ptr<const void> keep)
      : keep_(std::move(keep)), comms_(std::move(comms)), devices_(std::move(devices)) {
    const int W = m.world();
    if (W < 1 || comms_.size() != std::size_t(W) || devices_.size() != std::size_t(W))
      throw error("tp_device_model: " + std::to_string(W) +
                  " ranks need as many collectives and devices (got " + std::to_string(comms_.size()) +
                  " and " + std::to_string(devices_.size()) + ")");
    for (int r = 0; r < W; ++r)
      if (!comms_[std::size_t(r)] || comms_[std::size_t(r)]->rank() != r ||
          comms_[std::size_t(r)]->size() != W)
        throw error("tp_device_model: the collectives of rank " + std::to_string(r) + " are not rank " +
                    std::to_string(r) + " of " + std::to_string(W));
    int previous = 0;
    DSV4_CUDA_CHECK(cudaGetDevice(&previous));
    try {
      for (int r = 0; r < W; ++r) {
        DSV4_CUDA_CHECK(cudaSetDevice(devices_[std::size_t(r)]));
        ranks_.push_back(
            std::make_unique<rank_model_t>(m.ranks[std::size_t(r)], lim, *comms_[std::size_t(r)]));
      }
    } catch (...) {
      (void)cudaSetDevice(previous);
      throw;
    }
    DSV4_CUDA_CHECK(cudaSetDevice(previous));
  }
  tp_device_model(tp_device_model&&) noexcept = default;
  ~tp_device_model() {
    // The rank models before the collectives and what they need, each with its device current
    // (its streams, cuBLAS handles and buffers belong to that device).
    int previous = 0;
    const bool known = cudaGetDevice(&previous) == cudaSuccess;
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      (void)cudaSetDevice(devices_[r]);
      ranks_[r].reset();
    }
    if (known) (void)cudaSetDevice(previous);
    ranks_.clear();
    comms_.clear();
  }

  int world() const { return int(ranks_.size()); }
  bool broken() const { return broken_; }
  //! Rank r's model (its stream, its attention stack: for inspection and benchmarks).
  rank_model_t& rank(int r) { return *ranks_.at(std::size_t(r)); }

  //! A new sequence on every rank; returns its slot (the same on every rank).
  int add_sequence() {
    check_usable();
    const int slot = on_device(0, [&] { return ranks_[0]->add_sequence(); });
    for (int r = 1; r < world(); ++r) {
      int s = -1;
      try {
        s = on_device(r, [&] { return ranks_[std::size_t(r)]->add_sequence(); });
      } catch (...) {
        broken_ = true;  // ranks 0 .. r - 1 hold a sequence that this one does not
        throw;
      }
      if (s != slot) {
        broken_ = true;
        throw error("tp_device_model: rank " + std::to_string(r) + " gave slot " + std::to_string(s) +
                    ", rank 0 slot " + std::to_string(slot) + " (the ranks' sequences diverged)");
      }
    }
    return slot;
  }
  void release_sequence(int slot) {
    check_usable();
    for (int r = 0; r < world(); ++r) on_device(r, [&] { ranks_[std::size_t(r)]->release_sequence(slot); });
  }
  long long length(int slot) const { return ranks_.at(0)->length(slot); }

  //! Prefill of a new sequence: fp32 logits [vocab] of its last position.
  std::vector<float> prefill(int slot, std::span<const std::int32_t> ids) {
    check_call(ids);
    return on_ranks([&](rank_model_t& m) { m.begin_prefill(slot, ids); });
  }
  //! A chunk appended after the prefill (exact mode): logits [vocab] of its last position.
  std::vector<float> append(int slot, std::span<const std::int32_t> ids) {
    check_call(ids);
    return on_ranks([&](rank_model_t& m) { m.begin_append(slot, ids); });
  }
  //! One token for each of `slots`: logits [slots.size(), vocab].
  std::vector<float> decode(const std::vector<int>& slots, std::span<const std::int32_t> ids) {
    if (ids.size() != slots.size()) throw error("tp_device_model::decode: one token id per sequence");
    check_call(ids);
    return on_ranks([&](rank_model_t& m) { m.begin_decode(slots, ids); });
  }
  //! The CED prefill (device_model::prefill_ced) on every rank.
  std::vector<float> prefill_ced(int slot, std::span<const std::int32_t> ids) {
    check_call(ids);
    return on_ranks([&](rank_model_t& m) { m.begin_prefill_ced(slot, ids); });
  }
  //! A CED append (device_model::append_ced; limits::ced_appends) on every rank.
  std::vector<float> append_ced(int slot, std::span<const std::int32_t> ids) {
    check_call(ids);
    return on_ranks([&](rank_model_t& m) { m.begin_append_ced(slot, ids); });
  }

 private:
  std::shared_ptr<const void> keep_;
  std::vector<std::unique_ptr<device_collectives>> comms_;
  std::vector<int> devices_;
  std::vector<std::unique_ptr<rank_model_t>> ranks_;
  bool broken_ = false;

  void check_usable() const {
    if (ranks_.empty()) throw error("tp_device_model: this model was moved from");
    if (broken_)
      throw error(
          "tp_device_model: a rank failed inside an earlier call and the collectives were abandoned; "
          "build the model again");
  }
  void check_call(std::span<const std::int32_t> ids) const {
    check_usable();
    if (ids.empty()) throw error("tp_device_model: no tokens");
    for (std::int32_t id : ids)
      if (id < 0 || id >= Model::dims.vocab_size)
        throw error("tp_device_model: token id " + std::to_string(id) + " outside the vocabulary of " +
                    std::to_string(Model::dims.vocab_size));
  }
  template <class F>
  auto on_device(int r, F&& f) {
    int previous = 0;
    DSV4_CUDA_CHECK(cudaGetDevice(&previous));
    DSV4_CUDA_CHECK(cudaSetDevice(devices_[std::size_t(r)]));
    struct restore {
      int d;
      ~restore() { (void)cudaSetDevice(d); }
    } back{previous};
    return f();
  }

  //! Waits until all `n` threads have arrived, or the wait is cancelled (then false).
  class rendezvous {
   public:
    explicit rendezvous(int n) : left_(n) {}
    bool arrive_and_wait() {
      std::unique_lock lock(m_);
      if (--left_ == 0) cv_.notify_all();
      cv_.wait(lock, [&] { return left_ <= 0 || cancelled_; });
      return left_ <= 0;
    }
    void cancel() {
      const std::lock_guard lock(m_);
      cancelled_ = true;
      cv_.notify_all();
    }

   private:
    std::mutex m_;
    std::condition_variable cv_;
    int left_;
    bool cancelled_ = false;
  };

  //! One call on every rank, rank r on a thread of its own with devices[r] current (rank 0 on the
  //! caller's): each rank begins it (`begin(rank model)`: device_model::begin_*, every check, no
  //! collective); only if every rank began does any finish it (device_model::finish_call), so a
  //! call that one rank refuses never leaves another waiting in a collective. Returns rank 0's
  //! logits after checking every rank holds the same bits.
  //! Failures: refused by every rank with the same message -> rethrown, the model stays usable
  //! (the ranks' replicated state refuses alike: a busy slot, a full page pool). Refused by some
  //! ranks only -> the others cancel their begun call, the model is broken. A rank failing while
  //! it runs the call abandons the collectives (device_model does; here too, for anything else),
  //! so the others fail instead of waiting; the model is broken; the first error that is a rank's
  //! own (not "another rank failed") is rethrown once every rank has returned.
  template <class Begin>
  std::vector<float> on_ranks(Begin&& begin) {
    const int W = world();
    const std::size_t n = static_cast<std::size_t>(W);
    std::vector<std::vector<float>> out(n);
    std::vector<std::exception_ptr> refused(n), failure(n);
    rendezvous begun(W);
    auto run = [&](int r) {
      const std::size_t i = std::size_t(r);
      rank_model_t& m = *ranks_[i];
      try {
        DSV4_CUDA_CHECK(cudaSetDevice(devices_[i]));
        begin(m);
      } catch (...) {
        refused[i] = std::current_exception();
      }
      if (!begun.arrive_and_wait()) {  // cancelled: not every rank was started
        if (!refused[i]) m.cancel_call();
        return;
      }
      // Every rank's `refused` is written and visible from here.
      if (std::any_of(refused.begin(), refused.end(), [](const auto& e) { return bool(e); })) {
        if (!refused[i]) m.cancel_call();
        return;
      }
      try {
        out[i] = m.finish_call();
      } catch (...) {
        failure[i] = std::current_exception();
        try {
          if (!comms_[i]->abandoned()) comms_[i]->abandon();
        } catch (...) {  // nothing more to do: the rank's own error is reported
        }
      }
    };
    {
      std::vector<std::jthread> threads;
      try {
        for (int r = 1; r < W; ++r) threads.emplace_back(run, r);
      } catch (...) {
        begun.cancel();  // the started ranks cancel their begun call and return
        broken_ = true;
        throw;
      }
      // Rank 0 on this thread: run() sets its device and never throws, so it always reaches the
      // rendezvous the other ranks wait in; the caller's device is restored after.
      int previous = 0;
      const bool known = cudaGetDevice(&previous) == cudaSuccess;
      run(0);
      if (known) (void)cudaSetDevice(previous);
    }
    if (std::any_of(refused.begin(), refused.end(), [](const auto& e) { return bool(e); })) {
      const std::string first = message(*std::find_if(refused.begin(), refused.end(), [](const auto& e) { return bool(e); }));
      for (const auto& e : refused)
        if (!e || message(e) != first) broken_ = true;  // a rank began (and cancelled) or refused otherwise
      std::rethrow_exception(*std::find_if(refused.begin(), refused.end(), [](const auto& e) { return bool(e); }));
    }
    if (std::any_of(failure.begin(), failure.end(), [](const auto& e) { return bool(e); })) {
      broken_ = true;
      for (const auto& e : failure)
        if (e && message(e).find("another rank failed") == std::string::npos) std::rethrow_exception(e);
      std::rethrow_exception(*std::find_if(failure.begin(), failure.end(), [](const auto& e) { return bool(e); }));
    }
    for (int r = 1; r < W; ++r)
      if (out[std::size_t(r)].size() != out[0].size() ||
          std::memcmp(out[std::size_t(r)].data(), out[0].data(), out[0].size() * sizeof(float)) != 0) {
        broken_ = true;
        throw error("tp_device_model: rank " + std::to_string(r) +
                    " holds other logits than rank 0 (the ranks' replicated state diverged)");
      }
    return std::move(out[0]);
  }
  static std::string message(const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      return x.what();
    } catch (...) {
      return "unknown exception";
    }
  }
};

}  // namespace dsv4::parallel
