#pragma once
//! \file
//! Programmatic dependent launch (Hopper): a kernel launched with `launch_programmatic` may start
//! while the kernel before it on the stream is still running, do work that does not depend on
//! that kernel (a decode GEMM streams its weights), then call `wait_for_previous_grid()` before
//! it touches anything the previous kernel writes or reads. A kernel that wants its successor to
//! start early calls `allow_dependent_launch()`; without it the successor starts as the
//! kernel's last blocks exit, which still saves the launch latency.
//!
//! Rules that keep this correct (docs/decisions.md, "programmatic dependent launch"):
//! - Only kernels that call `wait_for_previous_grid()` in every thread, before their first read
//!   of a previous kernel's output and before their first write of any buffer, are launched
//!   with `launch_programmatic`. Then a kernel's completion implies its predecessor's, so
//!   ordinary stream order stays transitive for everything launched after it.
//! - On devices before sm_90, and for kernels launched the ordinary way, both calls are no-ops.
//! - Defining DSV4_NO_PDL makes every launch ordinary (to rule PDL in or out when hunting a race).
//!   Define it for the whole program (CMake: -DDSV4_NO_PDL=ON), not per translation unit: the
//!   launcher is one inline template, and mixed definitions would be an ODR violation.
//! - Where any target architecture of the build is below sm_90 (a kernel image that cannot wait),
//!   every launch is ordinary too (`pdl_enabled`).

#include <cuda_runtime.h>

#include <cxxabi.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "dsv4/config.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/launch_log.hpp"

namespace dsv4::runtime {

//! Blocks until the previous kernel on the stream has completed and its writes are visible.
DSV4_DEVICE void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

//! Lets the next kernel on the stream (if launched programmatically) be scheduled now.
DSV4_DEVICE void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

//! The prologue of every programmatically launched kernel (after any work that reads no earlier
//! kernel's data): wait for the kernel before, then let the next one be scheduled. Waiting
//! first keeps the chain of waiting kernels one deep.
DSV4_DEVICE void start_after_previous_grid() {
  wait_for_previous_grid();
  allow_dependent_launch();
}

//! Asks L2 for the 128-byte lines of [p, p + bytes), spread over the CTA's threads (a 1-D block),
//! without waiting for them. For a kernel's weights before wait_for_previous_grid(): between two
//! decode steps gigabytes of weights pass through L2, so a small weight (a norm's row, a rope table)
//! is a DRAM round trip again at every step; asked for while the kernel before still runs, its
//! loads after the wait find it in L2. Only for memory that no kernel writes during the step.
DSV4_DEVICE void prefetch_l2(const void* p, std::size_t bytes) {
#if defined(__CUDA_ARCH__)
  const std::uintptr_t begin = reinterpret_cast<std::uintptr_t>(p), end = begin + bytes;
  for (std::uintptr_t line = (begin & ~std::uintptr_t(127)) + 128 * std::uintptr_t(threadIdx.x); line < end;
       line += 128 * std::uintptr_t(blockDim.x))
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(line));
#else
  (void)p, (void)bytes;
#endif
}

//! Whether launches may be programmatic: every architecture this translation unit is compiled
//! for is sm_90 or newer (nvcc lists them in __CUDA_ARCH_LIST__), and DSV4_NO_PDL is not set.
inline constexpr bool pdl_enabled = [] {
#if defined(DSV4_NO_PDL)
  return false;
#elif defined(__CUDA_ARCH_LIST__)
  constexpr int archs[] = {__CUDA_ARCH_LIST__};
  for (int a : archs)
    if (a < 900) return false;
  return true;
#else
  return true;
#endif
}();

namespace detail {
//! Counts the launch and, where a launch_log is installed on this thread, records or checks it.
//! Returns true when the launch must be skipped (a checking log matched it: a graph issues it).
template <class... Params, class... Args>
bool note_launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem_bytes,
                 cudaStream_t stream, std::uint8_t flags, const Args&... args) {
  ++thread_launch_counts().kernels;
  launch_log* log = launch_log::installed();
  return log &&
         log->kernel(reinterpret_cast<const void*>(kernel), grid.x, grid.y, grid.z, block.x, block.y, block.z,
                     smem_bytes, static_cast<const void*>(stream), flags, static_cast<Params>(args)...);
}
}  // namespace detail

//! Launches `kernel` with cudaLaunchKernelEx, programmatically where pdl_enabled, and with the
//! cooperative attribute when `cooperative` (runtime/grid_barrier.cuh). Returns the launch's
//! error, already cleared from the runtime's last-error state.
template <class... Params, class... Args>
cudaError_t launch_ex(bool cooperative, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem_bytes,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  unsigned count = 0;
  if (pdl_enabled) {
    attribute[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cooperative) {
    attribute[count].id = cudaLaunchAttributeCooperative;
    attribute[count++].val.cooperative = 1;
  }
  config.attrs = attribute;
  config.numAttrs = count;
  const std::uint8_t flags = std::uint8_t((pdl_enabled ? launch_record::programmatic : 0) |
                                          (cooperative ? launch_record::cooperative : 0));
  if (detail::note_launch(kernel, grid, block, smem_bytes, stream, flags, args...)) return cudaSuccess;
  const cudaError_t launched = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (launched != cudaSuccess) (void)cudaGetLastError();  // reported by the caller, not by the next launch's check
  return launched;
}

//! Launches `kernel` so that it may overlap the tail of the kernel before it on `stream`.
template <class... Params, class... Args>
void launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem_bytes,
                         cudaStream_t stream, Args&&... args) {
  DSV4_CUDA_CHECK(launch_ex(false, kernel, grid, block, smem_bytes, stream, std::forward<Args>(args)...));
}

//! Launches `kernel` the ordinary way (no programmatic overlap: for kernels that do not call
//! `wait_for_previous_grid()`), counted and recorded like every other launch.
template <class... Params, class... Args>
void launch_plain(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem_bytes,
                  cudaStream_t stream, Args&&... args) {
  if (detail::note_launch(kernel, grid, block, smem_bytes, stream, 0, args...)) return;
  kernel<<<grid, block, smem_bytes, stream>>>(std::forward<Args>(args)...);
  DSV4_CUDA_CHECK_LAUNCH();
}

//! A readable name for a recorded launch: the kernel's demangled symbol (up to `max_chars`), or
//! "cuBLAS " and the call site's label.
inline std::string launch_name(const launch_record& r, std::size_t max_chars = 120) {
  if (r.what == launch_record::kind::blas)
    return std::string("cuBLAS ") + static_cast<const char*>(r.function);
  const char* symbol = nullptr;
  if (cudaFuncGetName(&symbol, r.function) != cudaSuccess || !symbol) {
    (void)cudaGetLastError();
    return "kernel (no name)";
  }
  int status = 0;
  char* demangled = abi::__cxa_demangle(symbol, nullptr, nullptr, &status);
  std::string name = status == 0 && demangled ? demangled : symbol;
  std::free(demangled);
  if (name.size() > max_chars) name = name.substr(0, max_chars) + "...";
  return name;
}

}  // namespace dsv4::runtime
