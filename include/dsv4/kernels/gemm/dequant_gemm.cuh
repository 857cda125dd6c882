#pragma once
//! \file
//! The prefill path of the block-scaled GEMMs: dequantize both operands to bf16, then one cuBLAS
//! bf16 GEMM with fp32 accumulation. Exact where it matters: an E4M3 or E2M1 value times a
//! power-of-two scale has at most 4 significant bits and, for scales between 2^-110 and 2^110
//! (act_quant's floor keeps activation scales above 2^-22; trained weight scales are near 2^-10),
//! lies in bf16's range, so every dequantized operand, and every product, is exact; the result differs from the reference only in
//! the order of the fp32 sum (the reference adds per-32 block sums; cuBLAS sums in its own order),
//! which is the same class of difference as split-K. Many tokens make the GEMM compute-bound, and
//! Hopper's bf16 tensor cores through cuBLAS beat a per-32-block FP8 MMA kernel there, whose
//! fp32 rescaling after every 32-wide block is as costly as the MMA itself (measured:
//! bench/bench_gemm.cu, docs/perf.md, docs/decisions.md).
//!
//! `block_scaled_linear` picks the path: the dequantize + cuBLAS path for `dequant_min_tokens`
//! tokens or more when a cuBLAS handle and a large enough workspace are given, else the MMA
//! kernel of block_scaled_gemm.cuh.

#include <cublas_v2.h>     // provides cublasGemmEx
#include <cuda_runtime.h>  // provides cudaStream_t, uint2, uint4

#include <cstdint>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/gemm/block_scaled_gemm.cuh"
#include "dsv4/kernels/gemm/dense.cuh"
#include "dsv4/numerics/fast_codec.cuh"
#include "dsv4/numerics/minifloat.hpp"

namespace dsv4::kernels::gemm {

//! From this many tokens on, block_scaled_linear takes the dequantize + cuBLAS path (at 64 tokens
//! it is already 1.5-2x faster than the MMA kernel on every V4.1 shape; docs/perf.md).
inline constexpr int dequant_min_tokens = 64;

//! bf16 elements the dequantize path needs in the workspace: both operands.
inline std::size_t dequant_elems(const gemm_shape& s) { return (std::size_t(s.m) + std::size_t(s.n)) * std::size_t(s.k); }

namespace detail {

//! Activations E4M3 with UE8M0 per 32 -> bf16 [rows, k]: one thread per 8 consecutive elements.
//! Output row i is input row `row_index[row0 + i]` (a gather, e.g. the MoE's sorted pairs), or
//! row0 + i without an index.
DSV4_KERNEL void __launch_bounds__(256)
    dequantize_activations_kernel(const std::uint8_t* codes, const std::uint8_t* scales, const int* row_index,
                                  long long row0, long long rows, int k, numerics::bf16* out) {
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long per_row = k / 8;
  if (t >= rows * per_row) return;
  const long long row = t / per_row;
  const long long src = row_index ? row_index[row0 + row] : row0 + row;
  const int col = int(t % per_row) * 8;
  const float s = ue8m0_value(scales[src * (k / 32) + col / 32]);
  const uint2 raw = *reinterpret_cast<const uint2*>(codes + src * k + col);
  unsigned packed[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const std::uint32_t word = i < 2 ? raw.x : raw.y;
    const float lo = numerics::fast_decode<numerics::e4m3>(std::uint8_t(word >> (16 * (i % 2))));
    const float hi = numerics::fast_decode<numerics::e4m3>(std::uint8_t(word >> (16 * (i % 2) + 8)));
    packed[i] = unsigned(numerics::bf16::from_float(__fmul_rn(lo, s)).bits) |
                (unsigned(numerics::bf16::from_float(__fmul_rn(hi, s)).bits) << 16);
  }
  *reinterpret_cast<uint4*>(out + row * k + col) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

//! MMA-tile weights -> row-major bf16 [n, k]: one thread per lane of each (row tile, K block),
//! i.e. 8 elements of row 16 rt + g and the same 8 of row 16 rt + g + 8.
template <weight_format WF>
DSV4_KERNEL void __launch_bounds__(256)
    dequantize_weight_kernel(const std::uint8_t* codes, const std::uint8_t* scales, int n, int k, numerics::bf16* out) {
  constexpr int kTileBytes = tile_code_bytes(WF);
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int kb_count = k / 32, row_tiles = (n + 15) / 16;
  if (t >= (long long)row_tiles * kb_count * 32) return;
  const int lane = int(t % 32), kb = int((t / 32) % kb_count), rt = int(t / 32 / kb_count);
  const std::uint8_t* src = codes + ((long long)rt * kb_count + kb) * kTileBytes + lane * (kTileBytes / 32);
  std::uint32_t words[4];
  if constexpr (WF == weight_format::fp8_tile32) {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    words[0] = v.x, words[1] = v.y, words[2] = v.z, words[3] = v.w;
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    words[0] = v.x, words[1] = v.y;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = rt * 16 + lane / 4 + 8 * h;
    if (row >= n) continue;
    const std::uint8_t scale_code = WF == weight_format::fp8_tile32 ? scales[(long long)(row / 32) * kb_count + kb]
                                                                    : scales[((long long)rt * kb_count + kb) * 16 + row % 16];
    const float s = ue8m0_value(scale_code);
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if constexpr (WF == weight_format::fp8_tile32)
        v[i] = numerics::fast_decode<numerics::e4m3>(std::uint8_t(words[2 * h + i / 4] >> (8 * (i % 4))));
      else
        v[i] = numerics::fast_decode<numerics::e2m1>(std::uint8_t((words[h] >> (4 * i)) & 0xFu));
    }
    unsigned packed[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      packed[i] = unsigned(numerics::bf16::from_float(__fmul_rn(v[2 * i], s)).bits) |
                  (unsigned(numerics::bf16::from_float(__fmul_rn(v[2 * i + 1], s)).bits) << 16);
    *reinterpret_cast<uint4*>(out + (long long)row * k + kb * 32 + (lane % 4) * 8) =
        make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

//! bf16 copies of `rows` activation rows (see the kernel for row_index / row0).
inline void dequantize_activation_rows(const std::uint8_t* codes, const std::uint8_t* scales, const int* row_index,
                                       long long row0, long long rows, int k, numerics::bf16* out, cudaStream_t stream) {
  const long long threads = rows * (k / 8);
  if (threads == 0) return;
  dequantize_activations_kernel<<<unsigned((threads + 255) / 256), 256, 0, stream>>>(codes, scales, row_index, row0, rows, k,
                                                                                     out);
  DSV4_CUDA_CHECK_LAUNCH();
}

//! A row-major bf16 [n, k] copy of an MMA-tile weight.
inline void dequantize_weight(weight_format wf, const std::uint8_t* codes, const std::uint8_t* scales, int n, int k,
                              numerics::bf16* out, cudaStream_t stream) {
  const long long threads = (long long)((n + 15) / 16) * (k / 32) * 32;
  if (threads == 0) return;
  const unsigned blocks = unsigned((threads + 255) / 256);
  if (wf == weight_format::fp8_tile32)
    dequantize_weight_kernel<weight_format::fp8_tile32><<<blocks, 256, 0, stream>>>(codes, scales, n, k, out);
  else
    dequantize_weight_kernel<weight_format::fp4_row32><<<blocks, 256, 0, stream>>>(codes, scales, n, k, out);
  DSV4_CUDA_CHECK_LAUNCH();
}

//! Row-major C[m, n] = A[m, k] W[n, k]^T, bf16 in and out, fp32 accumulation (cuBLAS; the caller
//! holds a blas_call with bf16_math on the handle).
inline void bf16_gemm_nt(cublasHandle_t blas, const numerics::bf16* a, const numerics::bf16* w, numerics::bf16* c, int m,
                         int n, int k, const char* what) {
  const float one = 1.0f, zero = 0.0f;
  // Row-major C[M, N] = A[M, K] W[N, K]^T is column-major C^T = W A^T.
  blas_check(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, CUDA_R_16BF, k, a, CUDA_R_16BF, k, &zero, c,
                          CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
             what);
}

}  // namespace detail

//! C = A W^T through bf16 copies of both operands in `workspace` and one cuBLAS GEMM on `stream`.
//! The handle's math mode is set to keep fp32 reductions for the call and restored afterwards.
inline void dequant_gemm(const block_scaled_gemm_args& g, weight_format wf, gemm_workspace& workspace,
                         cublasHandle_t blas, cudaStream_t stream = nullptr) {
  if (auto why = detail::check_args(g, wf); !why.empty()) throw error("dequant_gemm: " + why);
  const auto& s = g.shape;
  if (s.m == 0 || s.n == 0) return;
  if (!blas) throw error("dequant_gemm: no cuBLAS handle");
  if (workspace.dequant_elems() < dequant_elems(s))
    throw error("dequant_gemm: the workspace holds " + std::to_string(workspace.dequant_elems()) +
                " bf16 elements, this shape needs " + std::to_string(dequant_elems(s)) + " (dequant_elems)");
  numerics::bf16* a16 = workspace.dequant();
  numerics::bf16* w16 = a16 + std::size_t(s.m) * s.k;
  detail::dequantize_activation_rows(g.a, g.a_s, nullptr, 0, s.m, s.k, a16, stream);
  detail::dequantize_weight(wf, g.w, g.w_s, s.n, s.k, w16, stream);
  const detail::blas_call call(blas, stream, detail::bf16_math);
  detail::bf16_gemm_nt(blas, a16, w16, g.c, s.m, s.n, s.k, "dequant_gemm: cublasGemmEx");
}

//! The linear layer of an FP8 / FP4 weight (after act_quant): picks the path by token count.
inline void block_scaled_linear(const block_scaled_gemm_args& g, weight_format wf, gemm_workspace* workspace,
                                cublasHandle_t blas, cudaStream_t stream = nullptr) {
  if (blas && workspace && g.shape.m >= dequant_min_tokens &&
      workspace->dequant_elems() >= dequant_elems(g.shape))
    return dequant_gemm(g, wf, *workspace, blas, stream);
  block_scaled_gemm(g, wf, workspace, stream);
}

}  // namespace dsv4::kernels::gemm
