#pragma once
//! \file
//! A barrier among the CTAs of one group inside a grid (for example the KV splits of one query
//! row): each CTA arrives once, then waits until all `members` have arrived. Used only by
//! kernels launched cooperatively (`launch_cooperative`), so every member is resident at once
//! and waiting cannot starve a member that has not started.
//!
//! The counters live in global memory, start at zero, and the group's last CTA to leave puts
//! them back to zero (`leave_group`), so the next launch on the stream finds them ready: a
//! launch must not begin before the previous one on the same counters has completed (stream
//! order, or `wait_for_previous_grid()` before the first arrival).

#include <cuda/atomic>
#include <cuda_runtime.h>

#include <utility>

#include "dsv4/config.hpp"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::runtime {

//! Nanoseconds of the GPU's global timer.
DSV4_DEVICE unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

//! Every thread of the CTA calls it. The CTA's writes before the call are visible to every member
//! after it (release by the arriving thread after a CTA barrier, acquire by the waiting one).
//! Readers of other CTAs' data after the barrier must bypass L1 (`__ldcg`): L1 is not coherent.
DSV4_DEVICE void group_arrive_and_wait(unsigned* counter, unsigned members) {
  __syncthreads();
  if (threadIdx.x == 0) {
    cuda::atomic_ref<unsigned, cuda::thread_scope_device> c(*counter);
    __threadfence();  // the CTA's writes, ordered before the arrival by the barrier above
    c.fetch_add(1u, cuda::memory_order_acq_rel);
    // A member that never arrives is a bug (or a launch that was not cooperative): stop with an
    // error after ten seconds instead of hanging the process.
    const unsigned long long start = global_timer_ns();
    while (c.load(cuda::memory_order_acquire) < members) {
      __nanosleep(20);
      if (global_timer_ns() - start > 10'000'000'000ull) __trap();
    }
  }
  __syncthreads();
}

//! Called once per CTA (any thread) after its last use of the counters: the last member to leave
//! zeroes `count` counters (the barriers' and this exit counter, which is counters[count - 1]).
DSV4_DEVICE void leave_group(unsigned* counters, int count, unsigned members) {
  cuda::atomic_ref<unsigned, cuda::thread_scope_device> exit(counters[count - 1]);
  if (exit.fetch_add(1u, cuda::memory_order_acq_rel) != members - 1) return;
  for (int i = 0; i < count; ++i) cuda::atomic_ref<unsigned, cuda::thread_scope_device>(counters[i]).store(0u, cuda::memory_order_relaxed);
}

//! Launches `kernel` cooperatively (all CTAs resident at once, or the launch fails instead of
//! hanging) and, where programmatic launches are enabled, so that it may overlap the tail of
//! the kernel before it. Returns the launch's error instead of throwing, so that a caller can
//! fall back to a launch that needs no co-residency.
template <class... Params, class... Args>
cudaError_t launch_cooperative(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem_bytes, cudaStream_t stream,
                               Args&&... args) {
  return launch_ex(true, kernel, grid, block, smem_bytes, stream, std::forward<Args>(args)...);
}

}  // namespace dsv4::runtime
