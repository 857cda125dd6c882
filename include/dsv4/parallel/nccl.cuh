#pragma once
//! \file
//! NCCL collectives for tensor parallelism on the GPUs of one host (issue 7): the device side of
//! the collectives that tensor_parallel_reference.hpp simulates, with the same per-rank calls
//! (all_reduce of fp32 and of bf16, all_gather in rank order) and the one composite model.py
//! uses after a row-parallel linear layer and the routed experts: the ranks' bf16 partials are
//! summed in fp32 and rounded to bf16 once (`all_reduce_partials`).
//!
//! One process drives every GPU: `nccl_world` creates one communicator per device
//! (ncclCommInitAll), and each rank's work runs on its own host thread with the device set, as the
//! host simulation runs its ranks. Calls from one thread to several ranks must be grouped
//! (`nccl_group`), or NCCL deadlocks waiting for the other ranks' halves.
//!
//! Rounding. NCCL sums in an order of its own choosing (ring or tree; it may differ between
//! elements and message sizes), so with more than two ranks the sums can differ from the host
//! simulation's rank order by fp32 rounding; with two ranks every sum is one addition and the
//! results equal the simulation bit for bit (tests/parallel/test_nccl_cuda.cu checks both).
//!
//! NVLink multicast (NVLS) stays off: on shared multi-GPU hosts a program that uses it can take the
//! host's GPUs out of service, and these collectives gain little from it at decode sizes. The
//! world sets NCCL_NVLS_ENABLE=0 unless the environment already says otherwise.
//!
//! Link with NCCL (CMake: dsv4::nccl, which finds libnccl beside the CUDA toolkit).

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/convert.cuh"
#include "dsv4/parallel/device_collectives.cuh"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::parallel {

//! Throws dsv4::error naming the call and NCCL's reason when `r` is not success.
inline void nccl_check(ncclResult_t r, const std::string& what) {
  if (r != ncclSuccess) throw error("NCCL " + what + " failed: " + ncclGetErrorString(r));
}

namespace nccl_detail {
//! Open nccl_group scopes on this thread: inside one, NCCL defers the collectives to the group's
//! end, so a call that launches its own kernels around a collective would run them too early.
inline int& group_depth() {
  thread_local int depth = 0;
  return depth;
}
//! Set by the world's abort (nccl_world::abort, from a failing rank's thread) before it aborts the
//! communicators: a rank's later calls throw instead of using an aborted communicator.
//! (A call already inside NCCL when another thread aborts its communicator is not excluded: a
//! lock held across the call would let abort() wait forever behind an enqueue that only the
//! abort can release, as NCCL's host-side waits for a full work queue are. Frameworks that
//! recover from a failed rank, e.g. a watchdog thread calling ncclCommAbort, accept the same.)
struct rank_guard {
  std::atomic<bool> aborted{false};
};
//! Makes `device` current for a scope (a thread may drive several ranks) and restores the
//! previous one.
class device_scope {
 public:
  explicit device_scope(int device) {
    DSV4_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) DSV4_CUDA_CHECK(cudaSetDevice(device));
  }
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;
  ~device_scope() { (void)cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};
}  // namespace nccl_detail

//! One rank's communicator: what a rank's thread calls. Every call is collective: all ranks make
//! the same calls in the same order with the same element counts, each on its own stream. The
//! calls are asynchronous on `stream` (NCCL's kernels and ours), like any kernel launch, and run
//! on the rank's device whatever device the calling thread has current. A view: the nccl_world
//! it came from must outlive it.
class nccl_rank {
 public:
  nccl_rank(ncclComm_t comm, int rank, int size, int device, nccl_detail::rank_guard* guard = nullptr)
      : comm_(comm), rank_(rank), size_(size), device_(device), guard_(guard) {}
  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  ncclComm_t comm() const { return comm_; }

  //! v <- the sum over ranks of v (in place), fp32.
  void all_reduce_sum(float* v, std::size_t n, cudaStream_t stream) const {
    check_pointer(v, n, "all_reduce_sum (fp32)");
    check_not_aborted("all_reduce_sum (fp32)");
    const nccl_detail::device_scope on(device_);
    nccl_check(ncclAllReduce(v, v, n, ncclFloat32, ncclSum, comm_, stream),
               where("all_reduce_sum (fp32)", n));
  }
  //! v <- the sum over ranks of v (in place), bf16: each addition rounds to bf16.
  void all_reduce_sum(numerics::bf16* v, std::size_t n, cudaStream_t stream) const {
    check_pointer(v, n, "all_reduce_sum (bf16)");
    check_not_aborted("all_reduce_sum (bf16)");
    const nccl_detail::device_scope on(device_);
    nccl_check(ncclAllReduce(v, v, n, ncclBfloat16, ncclSum, comm_, stream),
               where("all_reduce_sum (bf16)", n));
  }
  //! out [size() * n] <- the ranks' `part` [n] concatenated in rank order.
  void all_gather(const float* part, std::size_t n, float* out, cudaStream_t stream) const {
    check_pointer(part, n, "all_gather (part)");
    check_pointer(out, n, "all_gather (out)");
    check_not_aborted("all_gather");
    const nccl_detail::device_scope on(device_);
    nccl_check(ncclAllGather(part, out, n, ncclFloat32, comm_, stream), where("all_gather", n));
  }
  //! model.py's sum after a row-parallel layer: out <- bf16(sum over ranks of fp32(partial)),
  //! through `scratch` [n] floats on this rank's device. `out` may be `partial`. Not inside an
  //! nccl_group (it throws there): it launches kernels before and after its collective.
  void all_reduce_partials(const numerics::bf16* partial, float* scratch, numerics::bf16* out, std::size_t n,
                           cudaStream_t stream) const {
    check_pointer(partial, n, "all_reduce_partials (partial)");
    check_pointer(scratch, n, "all_reduce_partials (scratch)");
    check_pointer(out, n, "all_reduce_partials (out)");
    if (nccl_detail::group_depth() > 0)
      throw error("nccl_rank::all_reduce_partials on rank " + std::to_string(rank_) +
                  " inside an nccl_group: its kernels would run before the deferred all-reduce; call it "
                  "from the rank's own thread, outside the group");
    if (n == 0) return;
    const nccl_detail::device_scope on(device_);
    numerics::widen_to_fp32(partial, scratch, (long long)n, stream);
    all_reduce_sum(scratch, n, stream);
    numerics::narrow_to_bf16(scratch, out, (long long)n, stream);
  }

 private:
  std::string where(const char* call, std::size_t n) const {
    return std::string(call) + " of " + std::to_string(n) + " elements on rank " + std::to_string(rank_) +
           " of " + std::to_string(size_) + " (device " + std::to_string(device_) + ")";
  }
  //! Throws if the world was aborted (before the call touches the communicator).
  void check_not_aborted(const char* call) const {
    if (guard_ && guard_->aborted.load())
      throw error(std::string("NCCL ") + call + " on rank " + std::to_string(rank_) +
                  ": another rank failed and the world was aborted");
  }
  void check_pointer(const void* p, std::size_t n, const char* what) const {
    if (!p && n > 0)
      throw error(std::string("nccl_rank::") + what + ": null buffer on rank " + std::to_string(rank_));
  }

  ncclComm_t comm_;
  int rank_, size_, device_;
  nccl_detail::rank_guard* guard_;
};

//! The communicators of one process over a list of devices (rank i on devices[i]).
class nccl_world {
 public:
  explicit nccl_world(std::vector<int> devices) : devices_(std::move(devices)) {
    const int visible = runtime::cuda_device_count();
    if (devices_.empty()) throw error("nccl_world: no devices given");
    for (std::size_t i = 0; i < devices_.size(); ++i) {
      const int d = devices_[i];
      if (d < 0 || d >= visible)
        throw error("nccl_world: device " + std::to_string(d) + " (rank " + std::to_string(i) +
                    ") is not one of the " + std::to_string(visible) + " visible CUDA devices");
      if (std::count(devices_.begin(), devices_.end(), d) > 1)
        throw error("nccl_world: device " + std::to_string(d) + " is listed twice (one rank per device)");
    }
    // See the file comment. setenv changes the process's environment: create worlds before
    // starting threads that read it.
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
    comms_.resize(devices_.size());
    for (std::size_t i = 0; i < devices_.size(); ++i) guards_.push_back(std::make_unique<nccl_detail::rank_guard>());
    nccl_check(ncclCommInitAll(comms_.data(), int(devices_.size()), devices_.data()),
               "ncclCommInitAll over " + std::to_string(devices_.size()) + " devices");
  }
  //! Ranks 0 .. n-1 on devices 0 .. n-1.
  static nccl_world first(int n) {
    std::vector<int> d(std::size_t(std::max(n, 0)));
    for (int i = 0; i < n; ++i) d[std::size_t(i)] = i;
    return nccl_world(std::move(d));
  }
  nccl_world(nccl_world&& o) noexcept
      : devices_(std::move(o.devices_)), comms_(std::move(o.comms_)), guards_(std::move(o.guards_)), aborted_(o.aborted_) {
    o.comms_.clear();
  }
  nccl_world(const nccl_world&) = delete;
  nccl_world& operator=(const nccl_world&) = delete;
  nccl_world& operator=(nccl_world&&) = delete;
  ~nccl_world() {
    if (!aborted_)  // an aborted communicator is already freed
      for (auto c : comms_) ncclCommDestroy(c);
  }

  //! Aborts every communicator: the collectives other ranks' threads wait in return (with an
  //! error) instead of waiting forever for a rank that failed. The world is unusable afterwards.
  //! Safe to call from any thread, once or more.
  //! Every rank is marked aborted first (its later calls throw "another rank failed"), then
  //! every communicator is aborted, which also releases NCCL work and host waits in progress.
  void abort() const {
    std::call_once(abort_once_, [this] {
      aborted_ = true;
      for (const auto& g : guards_) g->aborted.store(true);
      for (auto c : comms_) (void)ncclCommAbort(c);
    });
  }

  int size() const { return int(devices_.size()); }
  int device(int rank) const {
    if (rank < 0 || rank >= size())
      throw error("nccl_world: rank " + std::to_string(rank) + " of " + std::to_string(size()));
    return devices_[std::size_t(rank)];
  }
  nccl_rank rank(int r) const {
    if (r < 0 || r >= size())
      throw error("nccl_world: rank " + std::to_string(r) + " of " + std::to_string(size()));
    return nccl_rank(comms_[std::size_t(r)], r, size(), devices_[std::size_t(r)], guards_[std::size_t(r)].get());
  }

 private:
  std::vector<int> devices_;
  std::vector<ncclComm_t> comms_;
  std::vector<std::unique_ptr<nccl_detail::rank_guard>> guards_;  //!< stable addresses: nccl_rank keeps one
  mutable std::once_flag abort_once_;
  mutable bool aborted_ = false;
};

//! ncclGroupStart / ncclGroupEnd around calls one thread makes for several ranks.
class nccl_group {
 public:
  nccl_group() {
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    ++nccl_detail::group_depth();
  }
  nccl_group(const nccl_group&) = delete;
  nccl_group& operator=(const nccl_group&) = delete;
  //! Ends the group; throws if NCCL reports an error (the destructor cannot).
  void end() {
    if (open_) {
      open_ = false;
      --nccl_detail::group_depth();
      nccl_check(ncclGroupEnd(), "ncclGroupEnd");
    }
  }
  ~nccl_group() {
    if (open_) {
      --nccl_detail::group_depth();
      (void)ncclGroupEnd();
    }
  }

 private:
  bool open_ = true;
};

//! A rank's collectives for the device model (device_collectives.cuh) over NCCL: the world's
//! rank `r`. abandon() aborts the whole world (every rank's communicator), which is what makes
//! the other ranks' pending collectives return; the world must outlive this object.
class nccl_collectives final : public device_collectives {
 public:
  nccl_collectives(const nccl_world& world, int r) : world_(world), rank_(world.rank(r)) {}
  int rank() const override { return rank_.rank(); }
  int size() const override { return rank_.size(); }
  void all_reduce_sum(float* v, std::size_t n, cudaStream_t stream) override { rank_.all_reduce_sum(v, n, stream); }
  void all_reduce_sum(numerics::bf16* v, std::size_t n, cudaStream_t stream) override {
    rank_.all_reduce_sum(v, n, stream);
  }
  void all_gather(const float* part, std::size_t n, float* out, cudaStream_t stream) override {
    rank_.all_gather(part, n, out, stream);
  }
  //! Two ranks: one bf16 all-reduce of the partials instead of widen, fp32 sum, round. The same
  //! bits: each output is one addition of two bf16 values, which is exact in fp32 unless their
  //! exponents are more than 16 apart, and then the smaller is below a quarter of the larger's
  //! bf16 ulp, so rounding the fp32 sum to bf16 and rounding the exact sum agree (no tie can
  //! arise); NCCL's bf16 sum rounds the exact (or fp32) sum once. Half the bytes, two launches
  //! fewer per call (test_tp_device_cuda: NCCL equals the staged fp32 path bit for bit).
  void all_reduce_partials(const numerics::bf16* partial, float* scratch, numerics::bf16* out, std::size_t n,
                           cudaStream_t stream) override {
    if (size() != 2) return device_collectives::all_reduce_partials(partial, scratch, out, n, stream);
    if (n == 0) return;
    if (!partial || !out) throw error("nccl_collectives::all_reduce_partials: null buffer");
    if (out != partial) {
      const nccl_detail::device_scope on(rank_.device());
      DSV4_CUDA_CHECK(cudaMemcpyAsync(out, partial, n * sizeof(numerics::bf16), cudaMemcpyDeviceToDevice, stream));
    }
    rank_.all_reduce_sum(out, n, stream);
  }

 private:
  void release_others() override { world_.abort(); }

  const nccl_world& world_;
  nccl_rank rank_;
};

}  // namespace dsv4::parallel
