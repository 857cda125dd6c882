#pragma once
//! \file
//! Hopper's bulk copies (the one-dimensional form of the TMA, `cp.async.bulk`) from global into
//! shared memory, completed through a transaction barrier (`mbarrier` with expect_tx): one thread
//! asks for kilobytes with one instruction and the bytes land without occupying registers, so a
//! kernel can keep many of them in flight (the streamed GEMM, gemm/streamed_gemm.cuh).
//!
//! Protocol of one stage (a buffer and its barrier, initialised with an arrival count of 1):
//! 1. one thread calls `expect_bytes(bar, n)` (its arrival, carrying the byte count) and issues
//!    copies totalling n bytes onto `bar`;
//! 2. consumers call `wait(bar, parity)`: the barrier's phase completes when the arrival and all
//!    n bytes are in; parity is 0 for the stage's first use, 1 for its second, and so on;
//! 3. before the buffer is refilled, its readers are done (`__syncwarp` / `__syncthreads`) and the
//!    issuing thread calls `fence_before_refill` (the async proxy's writes must not pass the
//!    generic reads of the previous phase).
//! Addresses and sizes of a copy are multiples of 16 bytes (PTX ISA, cp.async.bulk).
//! sm_90 and newer only: on older architectures the functions trap (`unsupported_here`), and the
//! host side of each kernel refuses to launch there (gemm/streamed_gemm.cuh, streamed_ctas_per_sm).

#include <cstdint>

#include "dsv4/config.hpp"

namespace dsv4::kernels::bulk_copy {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DSV4_BULK_COPY_PASS 1
#else
#define DSV4_BULK_COPY_PASS 0
#endif

//! In device code for an architecture without bulk copies, every function here traps: a kernel
//! dispatched there by mistake fails loudly instead of computing on unwritten shared memory.
DSV4_DEVICE void unsupported_here() {
#if DSV4_DEVICE_PASS && !DSV4_BULK_COPY_PASS
  __trap();
#endif
}

//! The shared-memory address of a pointer into shared memory.
DSV4_DEVICE std::uint32_t shared_address(const void* p) {
#if DSV4_DEVICE_PASS
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
#else
  (void)p;
  return 0;
#endif
}

//! Initialises a barrier expecting `arrivals` arrivals per phase; then `init_fence` and a block
//! (or warp) synchronization before anyone uses it.
DSV4_DEVICE void init(std::uint64_t* bar, unsigned arrivals) {
#if DSV4_BULK_COPY_PASS
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(arrivals)
               : "memory");
#else
  (void)bar, (void)arrivals;
  unsupported_here();
#endif
}

//! Makes initialised barriers visible to the async proxy (the copies' completions).
DSV4_DEVICE void init_fence() {
#if DSV4_BULK_COPY_PASS
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

//! This thread's arrival on `bar`, announcing `bytes` bytes of copies for the current phase.
DSV4_DEVICE void expect_bytes(std::uint64_t* bar, unsigned bytes) {
#if DSV4_BULK_COPY_PASS
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
#else
  (void)bar, (void)bytes;
  unsupported_here();
#endif
}

//! L2 eviction priorities a copy can carry (createpolicy.fractional over all of its bytes).
enum class l2_eviction {
  first,   //!< data read exactly once (streamed weights): evicted first, so that the data other
           //!< kernels reuse (activations, caches) stays in L2
  normal,  //!< data several CTAs read (the mHC projection weight, once per token group)
};

//! The cache policy operand of `copy` for `e`.
DSV4_DEVICE std::uint64_t l2_policy(l2_eviction e) {
  std::uint64_t policy = 0;
#if DSV4_BULK_COPY_PASS
  if (e == l2_eviction::first)
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  else
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(policy));
#else
  (void)e;
#endif
  return policy;
}

//! Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `src` into shared
//! `dst`, completing on `bar`, with the L2 policy `policy`.
DSV4_DEVICE void copy(void* dst, const void* src, unsigned bytes, std::uint64_t* bar, std::uint64_t policy) {
#if DSV4_BULK_COPY_PASS
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, "
      "[%3], %4;\n" ::"r"(shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar)), "l"(policy)
      : "memory");
#else
  (void)dst, (void)src, (void)bytes, (void)bar, (void)policy;
  unsupported_here();
#endif
}

//! Whether the phase of parity `parity` of `bar` has completed (a bounded wait inside).
DSV4_DEVICE bool try_wait(std::uint64_t* bar, unsigned parity) {
#if DSV4_BULK_COPY_PASS
  std::uint32_t done = 0;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(shared_address(bar)), "r"(parity)
      : "memory");
  return done != 0;
#else
  (void)bar, (void)parity;
  unsupported_here();
  return true;
#endif
}

//! Waits until the phase of parity `parity` of `bar` has completed (its copies have landed).
DSV4_DEVICE void wait(std::uint64_t* bar, unsigned parity) {
  while (!try_wait(bar, parity)) {
  }
}

//! Orders this thread's (and, after a synchronization, its group's) earlier generic accesses of a
//! buffer before the async-proxy writes of copies issued after it.
DSV4_DEVICE void fence_before_refill() {
#if DSV4_BULK_COPY_PASS
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

}  // namespace dsv4::kernels::bulk_copy
