#pragma once
//! \file
//! Hopper warpgroup MMA (wgmma) building blocks: the shared-memory matrix descriptor, the fences
//! and groups of the asynchronous MMA, the m64nNk32 E4M3 x E4M3 -> fp32 product with A in
//! registers and B in shared memory (N = 8, 16, 32, 64), the m64nNk16 bf16 one (N = 16 .. 128; B
//! K-major, or N-major at N = 128), and m64n16k16 bf16 with both operands in shared memory.
//!
//! Why wgmma: sm_90 has no FP8 `mma.sync` (ptxas lowers it to conversions and two f16 MMAs,
//! docs/decisions.md 2026-12-01); its FP8 tensor cores are reached only through wgmma.
//!
//! Layouts (PTX ISA 8.x, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"). What the
//! hardware agrees with is checked by tests/kernels/test_wgmma_cuda.cu, which tries the
//! alternatives and names every one that matches; the constants here are the ones it asserts.
//! - A (64 x 32 E4M3, registers): warp w of the warpgroup holds rows 16 w .. 16 w + 15 as
//!   mma.m16n8k32 does: lane 4 g + q, register 0 = row g, columns 4 q .. 4 q + 3 (lowest byte
//!   first), 1 = row g + 8 the same columns, 2 = row g columns 16 + 4 q .., 3 = row g + 8 columns
//!   16 + 4 q ...
//! - B (N x 32 E4M3, shared memory, K-major, no swizzle): "core matrices" of 8 rows (tokens) x 16
//!   bytes (K), each 128 contiguous bytes, row after row. For one K block of 32 a token row spans
//!   two core matrices (K halves). `b_core_offset` places core matrix (token group, K half); the
//!   descriptor's leading byte offset is the distance between the two K halves of a token group,
//!   its stride byte offset the distance between token groups.
//! - D (64 x N fp32, registers): warp w rows 16 w ..; lane 4 g + q holds, for each 8-column
//!   group j, d[4 j + 0 / 1] = row g, columns 8 j + 2 q / + 1 and d[4 j + 2 / 3] = row g + 8.
//!
//! Every wgmma of a warpgroup is issued by all of its 128 threads (`.sync.aligned`).

#include <cuda_runtime.h>

#include <cstdint>

#include "dsv4/config.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_info.cuh"

// wgmma exists only on sm_90a (the architecture-specific features of compute capability 9.0).
// Compiled for another architecture, the functions below trap: wgmma_gemm refuses such a device
// before launching (gemm/wgmma_gemm.cuh).
#if DSV4_DEVICE_PASS && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DSV4_WGMMA_PASS 1
#else
#define DSV4_WGMMA_PASS 0
#endif

namespace dsv4::kernels::wgmma {

namespace detail {
//! Writes whether this translation unit's device code was compiled with wgmma (sm_90a).
DSV4_KERNEL void wgmma_compiled_kernel(int* out) {
  *out = DSV4_WGMMA_PASS;
}
}  // namespace detail

//! Whether the current device can run wgmma kernels: compute capability 9.x and device code
//! compiled for sm_90a (a build for plain sm_90 has no wgmma, and its kernels would trap). Asked
//! once per device with a one-thread kernel on a stream of its own (allowed while another stream
//! of this thread captures a graph).
inline bool supported() {
  static runtime::per_device_ints known = {};
  return runtime::cached_per_device(known, [](int) {
    if (runtime::compute_capability_major() != 9) return 0;
    // A probe launch: the kernel sets the flag only where its sm_90a code was compiled in.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    DSV4_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    int* flag = nullptr;
    int host = 0;
    cudaStream_t s = nullptr;
    DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    DSV4_CUDA_CHECK(cudaMallocAsync(&flag, sizeof(int), s));
    detail::wgmma_compiled_kernel<<<1, 1, 0, s>>>(flag);
    DSV4_CUDA_CHECK_LAUNCH();
    DSV4_CUDA_CHECK(cudaMemcpyAsync(&host, flag, sizeof(int), cudaMemcpyDeviceToHost, s));
    DSV4_CUDA_CHECK(cudaFreeAsync(flag, s));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(s));
    DSV4_CUDA_CHECK(cudaStreamDestroy(s));
    DSV4_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    return host == 1 ? 1 : 0;
  }) == 1;
}

//! Bytes of one core matrix: 8 rows of 16 bytes.
inline constexpr int core_matrix_bytes = 128;

//! Byte offset of core matrix (token group `ng`, K half `kh`) inside one K block's B tile:
//! the two K halves of a token group side by side, token groups one after the other.
DSV4_HOST_DEVICE constexpr int b_core_offset(int ng, int kh) {
  return (2 * ng + kh) * core_matrix_bytes;
}
//! The descriptor's offsets for that placement.
inline constexpr int b_leading_byte_offset = core_matrix_bytes;     // K half 0 -> K half 1
inline constexpr int b_stride_byte_offset = 2 * core_matrix_bytes;  // token group -> the next

//! Shared-memory matrix descriptor without swizzling: start address, leading and stride byte
//! offsets, each in units of 16 bytes (bits 0-13, 16-29, 32-45); base offset 0, swizzle mode 0.
DSV4_DEVICE std::uint64_t smem_descriptor(const void* smem, std::uint32_t leading_bytes,
                                          std::uint32_t stride_bytes) {
  std::uint64_t desc = 0;
#if DSV4_DEVICE_PASS
  const auto addr = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  desc = std::uint64_t((addr & 0x3FFFFu) >> 4) | std::uint64_t((leading_bytes >> 4) & 0x3FFFu) << 16 |
         std::uint64_t((stride_bytes >> 4) & 0x3FFFu) << 32;
#endif
  return desc;
}

//! Orders this thread's earlier register writes (A fragments, accumulators) before the wgmma
//! that follows; required before the first wgmma of a batch.
DSV4_DEVICE void fence() {
#if DSV4_WGMMA_PASS
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
//! Makes this thread's generic-proxy writes to shared memory visible to wgmma (the async proxy).
DSV4_DEVICE void fence_shared_for_async() {
#if DSV4_WGMMA_PASS
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
DSV4_DEVICE void commit_group() {
#if DSV4_WGMMA_PASS
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
//! Waits until at most `Pending` committed groups are still running.
template <int Pending>
DSV4_DEVICE void wait_group() {
#if DSV4_WGMMA_PASS
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
#endif
}
//! Pins a register operand of wgmma in program order: before fence(), so that its last write is
//! not moved past the fence (ptxas would then insert another one: "warpgroup.arrive is
//! injected"); after wait_group, so that no read of an accumulator moves before the wait (the
//! asm that wrote it returned before the hardware did).
DSV4_DEVICE void fence_operand(float& r) {
#if DSV4_DEVICE_PASS
  asm volatile("" : "+f"(r)::"memory");
#endif
}
DSV4_DEVICE void fence_operand(std::uint32_t& r) {
#if DSV4_DEVICE_PASS
  asm volatile("" : "+r"(r)::"memory");
#endif
}

//! d = A B (accumulate false) or d = A B + d: one m64nNk32 E4M3 product, fp32 out, A from
//! registers (the layout above), B through `b_desc`. Asynchronous: the result is in `d` after
//! commit_group and wait_group.
template <int N>
DSV4_DEVICE void mma_e4m3(float (&d)[N / 2], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                          bool accumulate);

// One specialization per N: inline asm needs the accumulator registers listed one by one.

template <>
DSV4_DEVICE void mma_e4m3<8>(float (&d)[4], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                             bool accumulate) {
#if DSV4_WGMMA_PASS
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(int(accumulate)));
#elif DSV4_DEVICE_PASS
  __trap();
#endif
}

template <>
DSV4_DEVICE void mma_e4m3<16>(float (&d)[8], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                              bool accumulate) {
#if DSV4_WGMMA_PASS
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, "
      "p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(int(accumulate)));
#elif DSV4_DEVICE_PASS
  __trap();
#endif
}

template <>
DSV4_DEVICE void mma_e4m3<32>(float (&d)[16], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                              bool accumulate) {
#if DSV4_WGMMA_PASS
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(int(accumulate)));
#elif DSV4_DEVICE_PASS
  __trap();
#endif
}

template <>
DSV4_DEVICE void mma_e4m3<64>(float (&d)[32], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                              bool accumulate) {
#if DSV4_WGMMA_PASS
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
      "{%32,%33,%34,%35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(int(accumulate)));
#elif DSV4_DEVICE_PASS
  __trap();
#endif
}

//! d = A B (accumulate false) or d = A B + d: one m64nNk16 bf16 product, fp32 out, A from registers
//! (per warp the mma.m16n8k16 A fragment: lane 4 g + q, register 0 = row g, columns 2 q, 2 q + 1
//! (the lower in the low half), 1 = row g + 8 the same columns, 2 = row g columns 8 + 2 q, + 1,
//! 3 = row g + 8 those), B through `b_desc` K-major (a token row's 16 bf16 span two core matrices
//! of 8, as the 32 E4M3 bytes of mma_e4m3's block do, so the same placement and offsets serve),
//! D as mma_e4m3's. N = 16, 32, 64, 128.
template <int N>
DSV4_DEVICE void mma_bf16(float (&d)[N / 2], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                          bool accumulate);

template <>
DSV4_DEVICE void mma_bf16<16>(float (&d)[8], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                              bool accumulate) {
#if DSV4_WGMMA_PASS
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, "
      "{%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(int(accumulate)));
#elif DSV4_DEVICE_PASS
  __trap();
#endif
}

template <>
DSV4_DEVICE void mma_bf16<32>(float (&d)[16], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                              bool accumulate) {
#if DSV4_WGMMA_PASS
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
      "{%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(int(accumulate)));
#elif DSV4_DEVICE_PASS
  __trap();
#endif
}

template <>
DSV4_DEVICE void mma_bf16<64>(float (&d)[32], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                              bool accumulate) {
#if DSV4_WGMMA_PASS
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
      "{%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(int(accumulate)));
#elif DSV4_DEVICE_PASS
  __trap();
#endif
}

//! m64n128k16 bf16 with B K-major (TransB 0) or N-major (1, see mma_bf16_nmajor128).
template <int TransB>
DSV4_DEVICE void mma_bf16_128(float (&d)[64], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                              bool accumulate) {
#if DSV4_WGMMA_PASS
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
      "{%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
        "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),
        "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(int(accumulate)), "n"(TransB));
#elif DSV4_DEVICE_PASS
  __trap();
#endif
}

template <>
DSV4_DEVICE void mma_bf16<128>(float (&d)[64], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                               bool accumulate) {
  mma_bf16_128<0>(d, a, b_desc, accumulate);
}

//! d = A B or A B + d, m64n16k16 bf16, both operands in shared memory, K-major (A: 64 rows of 16
//! bf16 as two core matrices of 8 rows each, placed as B's: `a_desc` with the same kind of
//! leading (K half) and stride (row group) offsets). For products whose A is too large for the
//! registers of every warpgroup that reads it (sparse attention's 64 query heads x 512 channels).
DSV4_DEVICE void mma_bf16_ss16(float (&d)[8], std::uint64_t a_desc, std::uint64_t b_desc, bool accumulate) {
#if DSV4_WGMMA_PASS
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(a_desc), "l"(b_desc), "r"(int(accumulate)));
#elif DSV4_DEVICE_PASS
  __trap();
#endif
}

//! d = A B or A B + d, m64n128k16 bf16, A from registers (as mma_bf16), B in shared memory
//! N-major (imm-trans-b = 1): core matrices of 8 K rows x 8 contiguous N elements (16 bytes a
//! row, 128 bytes each); `b_desc`'s leading byte offset is the distance between core matrices
//! along K, its stride byte offset the distance along N (PTX ISA, "Strides": the same meaning as
//! for K-major operands). Sparse attention's value product reads its dequantized entries
//! ([entry][channel], channels contiguous) this way, the very tile its score product reads
//! K-major.
DSV4_DEVICE void mma_bf16_nmajor128(float (&d)[64], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                                    bool accumulate) {
  mma_bf16_128<1>(d, a, b_desc, accumulate);
}

}  // namespace dsv4::kernels::wgmma
