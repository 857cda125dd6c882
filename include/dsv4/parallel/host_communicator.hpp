#pragma once
//! \file
//! The collectives of W tensor-parallel ranks running as threads of one process, in memory
//! (issue 7): what the host simulation (tensor_parallel_reference.hpp) and the staged device
//! collectives (device_collectives.cuh) sum with. Sums add the ranks' values in rank order
//! 0, 1, ..., W - 1, so their bits are defined (NCCL's order is not; see nccl.cuh).

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/numerics/bf16.hpp"

namespace dsv4::parallel {

using numerics::bf16;

//! The collectives of W ranks running as threads of one process. Every call is collective: all
//! ranks make the same calls in the same order with buffers of the same size. Sums add in rank
//! order (see the file comment); every rank receives the same bits.
class host_communicator {
 public:
  explicit host_communicator(int world) : world_(world), slots_(std::size_t(world)), sync_(world) {}

  int world() const { return world_; }

  //! fp32 sum: v <- v_0 + v_1 + ... + v_{W-1}, left to right in fp32.
  void all_reduce_fp32(int rank, std::span<float> v) {
    sum_in_rank_order(rank, v, [](float acc, float x) { return acc + x; });
  }

  //! bf16 sum: v <- bf16(...bf16(v_0 + v_1) + ... + v_{W-1}), each addition in fp32 rounded to bf16.
  void all_reduce_bf16(int rank, std::span<bf16> v) {
    sum_in_rank_order(rank, v,
                      [](bf16 acc, bf16 x) { return bf16::from_float(acc.to_float() + x.to_float()); });
  }

  //! bf16 scores kept as floats (every value a bf16 value, -inf allowed): the bf16 sum above.
  void all_reduce_bf16_values(int rank, std::span<float> v) {
    sum_in_rank_order(rank, v, [](float acc, float x) { return numerics::round_to_bf16(acc + x); });
  }

  //! Concatenation in rank order: out = part_0 ++ part_1 ++ ... (every part the same length).
  std::vector<float> all_gather(int rank, std::span<const float> part) {
    post(rank, part.data(), part.size());
    std::vector<float> out;
    out.reserve(part.size() * std::size_t(world_));
    for (int r = 0; r < world_; ++r) {
      const auto* p = static_cast<const float*>(slots_[std::size_t(r)].data);
      out.insert(out.end(), p, p + part.size());
    }
    finish();
    return out;
  }

  //! Called by a rank that throws: the others' next (or current) collective throws instead of
  //! waiting for it.
  void abandon() {
    failed_.store(true);
    sync_.arrive_and_drop();
  }

 private:
  struct slot {
    const void* data = nullptr;
    std::size_t size = 0;
  };
  //! v <- add(...add(v_0, v_1)..., v_{W-1}) on every rank.
  template <class T, class Add>
  void sum_in_rank_order(int rank, std::span<T> v, Add add) {
    post(rank, v.data(), v.size());
    std::vector<T> sum(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      T acc = static_cast<const T*>(slots_[0].data)[i];
      for (int r = 1; r < world_; ++r) acc = add(acc, static_cast<const T*>(slots_[std::size_t(r)].data)[i]);
      sum[i] = acc;
    }
    finish();
    std::copy(sum.begin(), sum.end(), v.begin());
  }
  //! Publishes this rank's buffer and waits for every rank's.
  void post(int rank, const void* data, std::size_t size) {
    slots_[std::size_t(rank)] = {data, size};
    wait();
    for (int r = 0; r < world_; ++r)
      if (slots_[std::size_t(r)].size != size)
        throw error("host_communicator: rank " + std::to_string(r) + " passed " +
                    std::to_string(slots_[std::size_t(r)].size) + " values to a collective, rank " +
                    std::to_string(rank) + " " + std::to_string(size));
  }
  //! Waits until every rank has read every buffer (a buffer may change once its owner returns).
  void finish() { wait(); }
  void wait() {
    sync_.arrive_and_wait();
    if (failed_.load()) throw error("host_communicator: another rank failed");
  }

  int world_;
  std::vector<slot> slots_;
  std::barrier<> sync_;
  std::atomic<bool> failed_{false};
};

}  // namespace dsv4::parallel
