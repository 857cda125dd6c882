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
//! `block_scaled_linear` picks the path: FP8 weights of the shapes and token counts folded_shape
//! takes on the folded wgmma kernel (folded_gemm.cuh) where the device runs it; otherwise the
//! dequantize + cuBLAS path for `dequant_min_tokens` tokens or more when a cuBLAS handle and a
//! large enough workspace are given, else the MMA kernel of block_scaled_gemm.cuh.

#include <cublas_v2.h>     // provides cublasGemmEx
#include <cuda_runtime.h>  // provides cudaStream_t, uint2, uint4

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/gemm/block_scaled_gemm.cuh"
#include "dsv4/kernels/gemm/dense.cuh"
#include "dsv4/kernels/gemm/folded_gemm.cuh"
#include "dsv4/kernels/gemm/wgmma_gemm.cuh"
#include "dsv4/numerics/fast_codec.cuh"
#include "dsv4/numerics/minifloat.hpp"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::gemm {

//! From this many tokens on, block_scaled_linear takes the dequantize + cuBLAS path (at 64 tokens
//! it is already 1.5-2x faster than the MMA kernel on every V4.1 shape; docs/perf.md).
inline constexpr int dequant_min_tokens = 64;
static_assert(wgmma_default_max_tokens == dequant_min_tokens - 1,
              "wgmma_gemm.cuh's default token limit must stay just below dequant_min_tokens");

//! bf16 elements the dequantize path needs in the workspace for one pass: both whole operands.
inline std::size_t dequant_elems(const gemm_shape& s) { return (std::size_t(s.m) + std::size_t(s.n)) * std::size_t(s.k); }

//! The least a pass of the dequantize path covers (activation rows, weight rows) unless the GEMM
//! itself is smaller: narrower passes would waste cuBLAS's large tiles.
inline constexpr int dequant_min_pass = 256;

//! How dequant_gemm cuts a GEMM whose bf16 operands do not fit the workspace at once: passes of
//! `rows` activation rows x `cols` weight rows (output columns). The whole weight is kept when it
//! fits beside a pass of rows (each weight is then dequantized once); otherwise the columns go in
//! passes too, `cols` a multiple of 32 (whole FP8 scale tiles). rows == 0: the workspace is too
//! small for passes of dequant_min_pass.
struct dequant_passes {
  long long rows = 0;
  int cols = 0;
};
inline dequant_passes plan_dequant_passes(const gemm_shape& s, std::size_t elems) {
  if (s.m <= 0 || s.n <= 0 || s.k <= 0) return {};
  const std::size_t k = std::size_t(s.k), whole_w = std::size_t(s.n) * k;
  const long long min_rows = std::min<long long>(s.m, dequant_min_pass);
  if (whole_w + std::size_t(min_rows) * k <= elems)
    return {std::min<long long>(s.m, (long long)((elems - whole_w) / k)), s.n};
  const long long rows = std::min<long long>(s.m, (long long)(elems / (2 * k)));
  if (rows < min_rows) return {};
  const long long cols = (long long)((elems - std::size_t(rows) * k) / k) / 32 * 32;
  if (cols < std::min(s.n, dequant_min_pass)) return {};
  return {rows, int(std::min<long long>(cols, s.n))};
}

//! Workspace elements for the dequantize path of GEMMs up to `max_m` rows of these weight shapes
//! ({n, k} pairs): one pass where that costs at most `cap` elements, else `cap` (passes).
inline std::size_t dequant_elems_for(long long max_m, std::initializer_list<std::pair<long long, long long>> weights,
                                     std::size_t cap = std::size_t(1) << 25) {
  if (max_m < dequant_min_tokens) return 0;
  std::size_t most = 0;
  for (const auto& [n, k] : weights) most = std::max(most, dequant_elems({int(max_m), int(n), int(k)}));
  return std::min(most, cap);
}

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
        v[i] = numerics::fast_decode<numerics::e2m1>(fp4_lane_code(words[h], i));
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
  runtime::launch_plain(dequantize_activations_kernel, dim3(unsigned((threads + 255) / 256)), dim3(256), 0,
                        stream, codes, scales, row_index, row0, rows, k, out);
}

//! A row-major bf16 [n, k] copy of an MMA-tile weight.
inline void dequantize_weight(weight_format wf, const std::uint8_t* codes, const std::uint8_t* scales, int n, int k,
                              numerics::bf16* out, cudaStream_t stream) {
  const long long threads = (long long)((n + 15) / 16) * (k / 32) * 32;
  if (threads == 0) return;
  const unsigned blocks = unsigned((threads + 255) / 256);
  runtime::launch_plain(wf == weight_format::fp8_tile32 ? dequantize_weight_kernel<weight_format::fp8_tile32>
                                                        : dequantize_weight_kernel<weight_format::fp4_row32>,
                        dim3(blocks), dim3(256), 0, stream, codes, scales, n, k, out);
}

//! Row-major C[m, n] = A[m, k] W[n, k]^T, bf16 in and out, fp32 accumulation (cuBLAS; the caller
//! holds a blas_call with bf16_math on the handle). C's rows are `ldc` elements apart (default n:
//! a block of columns of a wider C otherwise).
inline void bf16_gemm_nt(cublasHandle_t blas, const numerics::bf16* a, const numerics::bf16* w, numerics::bf16* c, int m,
                         int n, int k, const char* what, int ldc = 0) {
  // The handle's stream (set by the caller's blas_call) goes into the closure, which sets the
  // math mode itself: a launch log may issue it again outside the caller's scope.
  cudaStream_t stream = nullptr;
  blas_check(cublasGetStream(blas, &stream), "cublasGetStream");
  issue_blas(what, m, n, k, ldc, {a, w, c}, stream, [=](cudaStream_t s) {
    const blas_call call(blas, s, bf16_math);
    const float one = 1.0f, zero = 0.0f;
    // Row-major C[M, N] = A[M, K] W[N, K]^T is column-major C^T = W A^T.
    blas_check(
        cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, CUDA_R_16BF, k, a, CUDA_R_16BF, k,
                     &zero, c, CUDA_R_16BF, ldc > 0 ? ldc : n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        what);
  });
}

}  // namespace detail

//! C = A W^T through bf16 copies of the operands in `workspace` and cuBLAS GEMMs on `stream`:
//! one GEMM when both whole operands fit, else passes (plan_dequant_passes) over blocks of rows
//! and, if the weight does not fit whole, of columns; every output is one cuBLAS dot product of
//! the whole K either way. The handle's math mode is set to keep fp32 reductions for the call and
//! restored afterwards.
inline void dequant_gemm(const block_scaled_gemm_args& g, weight_format wf, gemm_workspace& workspace,
                         cublasHandle_t blas, cudaStream_t stream = nullptr) {
  if (auto why = detail::check_args(g, wf); !why.empty()) throw error("dequant_gemm: " + why);
  const auto& s = g.shape;
  if (s.m == 0 || s.n == 0) return;
  if (!blas) throw error("dequant_gemm: no cuBLAS handle");
  const auto pass = plan_dequant_passes(s, workspace.dequant_elems());
  if (pass.rows == 0)
    throw error("dequant_gemm: the workspace holds " + std::to_string(workspace.dequant_elems()) +
                " bf16 elements, too few for passes of " + std::to_string(std::min(s.m, dequant_min_pass)) + " rows x " +
                std::to_string(std::min(s.n, dequant_min_pass)) + " columns at K " + std::to_string(s.k) +
                " (one pass needs dequant_elems = " + std::to_string(dequant_elems(s)) + ")");
  const int kb = s.k / 32;
  numerics::bf16* w16 = workspace.dequant();
  numerics::bf16* a16 = w16 + std::size_t(pass.cols) * s.k;
  const detail::blas_call call(blas, stream, detail::bf16_math);
  for (int n0 = 0; n0 < s.n; n0 += pass.cols) {
    const int cols = std::min(pass.cols, s.n - n0);  // n0 is a multiple of 32 (whole scale tiles)
    const long long tile0 = n0 / 16;                   // the column block's first 16-row weight tile
    const std::uint8_t* codes = g.w + tile0 * kb * tile_code_bytes(wf);
    const std::uint8_t* scales = wf == weight_format::fp8_tile32 ? g.w_s + (long long)(n0 / 32) * kb : g.w_s + tile0 * kb * 16;
    detail::dequantize_weight(wf, codes, scales, cols, s.k, w16, stream);
    for (long long r0 = 0; r0 < s.m; r0 += pass.rows) {
      const long long rows = std::min<long long>(pass.rows, s.m - r0);
      detail::dequantize_activation_rows(g.a, g.a_s, nullptr, r0, rows, s.k, a16, stream);
      detail::bf16_gemm_nt(blas, a16, w16, g.c + r0 * s.n + n0, int(rows), cols, s.k, "dequant_gemm: cublasGemmEx", s.n);
    }
  }
}

//! Whether block_scaled_linear takes the dequantize + cuBLAS path for this shape: with a handle
//! and a workspace, above the few-token kernels' range (set_decode_gemm, wgmma_gemm.cuh: with
//! wgmma up to wgmma_max_tokens(), else below dequant_min_tokens), where the workspace's bf16
//! scratch holds at least one pass, and not where the folded kernel takes the GEMM
//! (`takes_folded`). The one place that decides it: the pair form and the MoE's shared expert
//! (which must not share that scratch from a second stream) ask it too.
inline bool takes_folded(const gemm_shape& s, weight_format wf, const gemm_workspace* workspace) {
  return current_decode_gemm() == decode_gemm::mma_sync && takes_folded_path(s, wf, workspace);
}
inline bool takes_dequant_path(const gemm_shape& s, const gemm_workspace* workspace, cublasHandle_t blas,
                               weight_format wf = weight_format::fp8_tile32) {
  if (!blas || !workspace || takes_folded(s, wf, workspace)) return false;
  const bool few = current_decode_gemm() == decode_gemm::wgmma ? s.m <= wgmma_max_tokens() : s.m < dequant_min_tokens;
  return !few && plan_dequant_passes(s, workspace->dequant_elems()).rows > 0;
}

//! The linear layer of an FP8 / FP4 weight (after act_quant): the folded kernel where
//! takes_folded says so (the wgmma opt-in of set_decode_gemm keeps its own routing), the
//! dequantize + cuBLAS path where takes_dequant_path does, else the few-token kernel
//! set_decode_gemm chose.
inline void block_scaled_linear(const block_scaled_gemm_args& g, weight_format wf, gemm_workspace* workspace,
                                cublasHandle_t blas, cudaStream_t stream = nullptr) {
  if (takes_folded(g.shape, wf, workspace)) return folded_gemm(g, *workspace, stream);
  if (takes_dequant_path(g.shape, workspace, blas, wf)) return dequant_gemm(g, wf, *workspace, blas, stream);
  decode_block_scaled_gemm(g, wf, workspace, stream);
}

//! block_scaled_linear of two weights on one input (the shared expert's w1 and w3): one launch of
//! block_scaled_gemm_pair where both would run on the few-token mma.sync kernel, else the two
//! calls (the folded kernel, the dequantize + cuBLAS path, or wgmma).
inline void block_scaled_linear_pair(const block_scaled_gemm_args& g1, const block_scaled_gemm_args& g2,
                                     weight_format wf, gemm_workspace* workspace, cublasHandle_t blas,
                                     cudaStream_t stream = nullptr) {
  if (current_decode_gemm() == decode_gemm::wgmma || takes_folded(g1.shape, wf, workspace) || takes_folded(g2.shape, wf, workspace) ||
      takes_dequant_path(g1.shape, workspace, blas, wf) || takes_dequant_path(g2.shape, workspace, blas, wf)) {
    block_scaled_linear(g1, wf, workspace, blas, stream);
    return block_scaled_linear(g2, wf, workspace, blas, stream);
  }
  block_scaled_gemm_pair(g1, g2, wf, workspace, stream);
}

}  // namespace dsv4::kernels::gemm
