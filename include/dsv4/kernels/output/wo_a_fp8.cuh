#pragma once
//! \file
//! The block-diagonal wo_a projection at decode from wo_a's FP8 form (wo_a_fp8.hpp): half the
//! bytes of the bf16 weight the cuBLAS path reads (33.5 of 67 MB a layer at V4.1 widths), for
//! calls of up to wo_a_fp8_max_tokens tokens, where the projection is bound by its weight bytes.
//!
//! The arithmetic is the reference's (spec §5 "Output": wo_a held as bf16, a bf16 GEMM with fp32
//! accumulation): each weight is rebuilt as bf16(decode(code) * scale), the very value the
//! reference holds (attention_weights.hpp: its product is exact, so the rounding is too), and the
//! products with the bf16 activations are summed in fp32 on the tensor cores (mma.sync m16n8k16
//! bf16). Only the order of the fp32 sums differs from cuBLAS's, which the spec leaves to the
//! library (its item 10).
//!
//! Work split: a CTA takes 16 weight rows of one group (one m16 tile) and all of the group's K,
//! split over its warps (4 where K allows); the warps' fp32 tiles are added in warp order in shared
//! memory, so the result does not depend on timing. Within a warp, lane 4g + q reads 16 bytes of
//! weight rows g and g + 8 per 64-wide K step, and the matching 16 activations of token g: the
//! four m16n8k16 products of a step take the K positions in a permuted order, the same for both
//! operands, so the sum covers the same terms. The weights are read once, streamed past L1; the
//! first step's are requested before the programmatic wait (they are not produced by the kernel
//! before this one, pdl.cuh).

#include <cuda_runtime.h>  // provides cudaStream_t, uint4

#include <atomic>
#include <cstdint>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/core/process_switch.hpp"
#include "dsv4/kernels/tensor_core.cuh"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/minifloat.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::output {

//! Calls of up to this many tokens take the FP8 kernel (two n8 token tiles); larger ones the
//! cuBLAS bf16 path (output.cuh), where the weight's bytes are shared by enough tokens.
inline constexpr long long wo_a_fp8_max_tokens = 16;

namespace detail {
struct wo_a_fp8_tag;
}  // namespace detail
//! Process-wide: whether attention_output may read wo_a's FP8 form where it is given (the
//! default), or keeps the bf16 path at every size (for comparisons: bench_model --ab-decode).
//! Read when a call is launched.
inline void set_wo_a_fp8(bool on) {
  process_switch<detail::wo_a_fp8_tag>::set(on);
}
inline bool wo_a_fp8_enabled() {
  return process_switch<detail::wo_a_fp8_tag>::on();
}

struct wo_a_fp8_args {
  const numerics::bf16* x = nullptr;  //!< [tokens, groups * k]
  const std::uint8_t* codes = nullptr;   //!< [groups * n, k] E4M3, row-major
  const std::uint8_t* scales = nullptr;  //!< [groups * n / 32, k / 32] UE8M0
  numerics::bf16* y = nullptr;           //!< [tokens, groups * n]
  int tokens = 0, groups = 0, n = 0, k = 0;
};

namespace detail {
inline constexpr int wo_a_step = 64;  // K positions per warp step (16 per lane quad)
// K parts of a CTA: 4 warps of 128 threads, so that V4.1's 512 CTAs (8192 rows / 16) are all
// resident at once (75 registers: six CTAs an SM) instead of 1.3 waves of 256-thread CTAs.
inline constexpr int wo_a_max_warps = 4;

//! 16 bytes of weights past L1 (read once).
DSV4_DEVICE uint4 load_stream(const std::uint8_t* p) {
  uint4 v;
#if DSV4_DEVICE_PASS
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
#else
  v = *reinterpret_cast<const uint4*>(p);
#endif
  return v;
}

//! Two E4M3 codes (the low and high byte of `two`) times `scale`, as bf16x2 (low half first):
//! bf16(decode(code) * scale), each product computed in fp32 and rounded once, as the
//! reference's dequantization does.
DSV4_DEVICE std::uint32_t e4m3x2_scaled_bf16x2(std::uint32_t two, float scale) {
  std::uint32_t out = 0;
#if DSV4_DEVICE_PASS
  std::uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"(static_cast<unsigned short>(two & 0xFFFFu)));
  float lo, hi;
  asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
      : "=f"(lo), "=f"(hi)
      : "r"(h2));
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(out) : "f"(__fmul_rn(hi, scale)), "f"(__fmul_rn(lo, scale)));
#endif
  return out;
}

using numerics::ue8m0_value;

// NT: token tiles of 8, 1 (up to 8 tokens) or 2 (up to 16); kBatch: steps a batch. Four CTAs an SM
// (at most 128 registers) hold V4.1's 512 CTAs at once.
template <int NT, int kBatch>
DSV4_KERNEL void __launch_bounds__(32 * wo_a_max_warps, 4) wo_a_fp8_kernel(wo_a_fp8_args a, int parts) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, q = lane % 4;
  const int row0 = int(blockIdx.x) * 16, group = row0 / a.n;
  const int part = a.k / parts, k0 = warp * part, steps = part / wo_a_step;
  const long long k_total = 1LL * a.groups * a.k;
  const std::uint8_t* wa = a.codes + (long long)(row0 + g) * a.k + k0 + 16 * q;
  const std::uint8_t* wb = wa + 8LL * a.k;
  // Rows g and g + 8 share a 32-row scale tile (16-row tiles are aligned inside it).
  const std::uint8_t* srow = a.scales + (long long)(row0 / 32) * (a.k / 32);
  const numerics::bf16* xg = a.x + (long long)group * a.k + k0 + 16 * q;

  float acc[NT][4] = {};
  // A batch of steps: every load of it (weights, their scales, the activations) is issued before
  // its first product, so each warp waits on memory once a batch.
  for (int s0 = 0; s0 < steps; s0 += kBatch) {
    uint4 w[kBatch][2];
    std::uint32_t sc[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (s0 + u < steps) {
        const int s = s0 + u;
        w[u][0] = load_stream(wa + s * wo_a_step), w[u][1] = load_stream(wb + s * wo_a_step);
        sc[u] = srow[(k0 + s * wo_a_step + 16 * q) / 32];
      }
    if (s0 == 0) runtime::start_after_previous_grid();  // x comes from the kernel before (the inverse RoPE)
    uint4 xv[kBatch][NT][2];
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        xv[u][t][0] = xv[u][t][1] = make_uint4(0, 0, 0, 0);
        if (s0 + u < steps && t * 8 + g < a.tokens) {
          const uint4* xp = reinterpret_cast<const uint4*>(xg + (t * 8 + g) * k_total + (s0 + u) * wo_a_step);
          xv[u][t][0] = xp[0], xv[u][t][1] = xp[1];
        }
      }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (s0 + u >= steps) continue;
      const float scale = ue8m0_value(sc[u]);
      // This lane's 16 K positions of rows g and g + 8 as bf16 pairs: pair p = positions 2p, 2p + 1.
      std::uint32_t ra[8], rb[8];
      const std::uint32_t va[4] = {w[u][0].x, w[u][0].y, w[u][0].z, w[u][0].w};
      const std::uint32_t vb[4] = {w[u][1].x, w[u][1].y, w[u][1].z, w[u][1].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        ra[2 * i] = e4m3x2_scaled_bf16x2(va[i], scale), ra[2 * i + 1] = e4m3x2_scaled_bf16x2(va[i] >> 16, scale);
        rb[2 * i] = e4m3x2_scaled_bf16x2(vb[i], scale), rb[2 * i + 1] = e4m3x2_scaled_bf16x2(vb[i] >> 16, scale);
      }
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const std::uint32_t xb[8] = {xv[u][t][0].x, xv[u][t][0].y, xv[u][t][0].z, xv[u][t][0].w,
                                     xv[u][t][1].x, xv[u][t][1].y, xv[u][t][1].z, xv[u][t][1].w};
        // Product j takes positions 4j .. 4j + 3 of the lane's 16: logical columns 2q, 2q + 1 are
        // positions 4j, 4j + 1 (pair 2j), columns 2q + 8, 2q + 9 positions 4j + 2, 4j + 3 (pair 2j + 1),
        // for the weights (A) and the activations (B) alike.
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const std::uint32_t af[4] = {ra[2 * j], rb[2 * j], ra[2 * j + 1], rb[2 * j + 1]};
          tensor_core::mma_bf16(acc[t], af, xb[2 * j], xb[2 * j + 1]);
        }
      }
    }
  }
  // The warps' tiles, added in warp order: lane 4g + q holds rows g, g + 8 and tokens 2q, 2q + 1.
  __shared__ float part_sum[wo_a_max_warps][NT][4][32];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) part_sum[warp][t][i][lane] = acc[t][i];
  __syncthreads();
  for (int idx = int(threadIdx.x); idx < NT * 4 * 32; idx += int(blockDim.x)) {
    const int t = idx / 128, i = (idx / 32) % 4, l = idx % 32;
    float sum = part_sum[0][t][i][l];
    for (int p = 1; p < parts; ++p) sum = __fadd_rn(sum, part_sum[p][t][i][l]);
    const int row = row0 + l / 4 + (i >= 2 ? 8 : 0), token = t * 8 + 2 * (l % 4) + (i % 2);
    if (token < a.tokens) a.y[(long long)token * a.groups * a.n + row] = numerics::bf16::from_float(sum);
  }
}
//! Steps a batch at up to 8 tokens: 6 (the default: 127 registers, no spills), 4, or 8 (spills);
//! bench_gemm times each (set_wo_a_fp8_batch).
inline std::atomic<int>& wo_a_fp8_batch() {
  static std::atomic<int> steps{6};
  return steps;
}
}  // namespace detail

//! Process-wide, for benchmarks: the FP8 wo_a kernel's steps a batch at up to 8 tokens (4, 6 or
//! 8; see detail::wo_a_fp8_batch). Anything else is an error.
inline void set_wo_a_fp8_batch(int steps) {
  if (steps != 4 && steps != 6 && steps != 8)
    throw error("wo_a_fp8: a batch is 4, 6 or 8 steps, not " + std::to_string(steps));
  detail::wo_a_fp8_batch().store(steps);
}

//! Empty when wo_a_fp8(a) can run, else why not (shapes the kernel does not take: the caller
//! then keeps the bf16 path).
inline std::string wo_a_fp8_unsupported(const wo_a_fp8_args& a) {
  if (a.tokens < 0 || a.tokens > wo_a_fp8_max_tokens)
    return "tokens (" + std::to_string(a.tokens) + ") must lie in 0 .. " + std::to_string(wo_a_fp8_max_tokens);
  if (a.groups <= 0 || a.n <= 0 || a.n % 32 || a.k <= 0 || a.k % detail::wo_a_step)
    return "needs groups > 0, n a multiple of 32 and k of 64 (groups " + std::to_string(a.groups) + ", n " +
           std::to_string(a.n) + ", k " + std::to_string(a.k) + ")";
  if (!a.x || !a.codes || !a.scales || !a.y) return "null pointer argument";
  if (reinterpret_cast<std::uintptr_t>(a.x) % 16 || reinterpret_cast<std::uintptr_t>(a.codes) % 16)
    return "x and the codes must be 16-byte aligned";
  return {};
}

namespace detail {
//! wo_a_fp8 for arguments the caller has already checked with wo_a_fp8_unsupported.
inline void launch_wo_a_fp8(const wo_a_fp8_args& a, cudaStream_t stream) {
  if (a.tokens == 0) return;
  int parts = wo_a_max_warps;
  while (parts > 1 && (a.k / wo_a_step) % parts) parts /= 2;  // whole 64-wide steps a warp
  const dim3 grid(unsigned(1LL * a.groups * a.n / 16)), block(unsigned(32 * parts));
  const int batch = wo_a_fp8_batch().load();
  auto go = [&](auto kernel) { runtime::launch_programmatic(kernel, grid, block, 0, stream, a, parts); };
  if (a.tokens > 8)
    go(wo_a_fp8_kernel<2, 4>);
  else if (batch == 4)
    go(wo_a_fp8_kernel<1, 4>);
  else if (batch == 8)
    go(wo_a_fp8_kernel<1, 8>);
  else
    go(wo_a_fp8_kernel<1, 6>);
  DSV4_CUDA_CHECK_LAUNCH();
}
}  // namespace detail

//! y[t, g n + i] = bf16(sum_j x[t, g k + j] * W[g n + i, j]) for every group g, W the bf16 values
//! of `codes` times their tile's scale (see the file comment). Throws dsv4::error where
//! wo_a_fp8_unsupported says why.
inline void wo_a_fp8(const wo_a_fp8_args& a, cudaStream_t stream = nullptr) {
  if (const auto why = wo_a_fp8_unsupported(a); !why.empty()) throw error("wo_a_fp8: " + why);
  detail::launch_wo_a_fp8(a, stream);
}

}  // namespace dsv4::kernels::output
