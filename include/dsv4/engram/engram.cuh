#pragma once
//! \file
//! CUDA Engram forward (spec §10, host reference: reference.hpp), the table in device memory:
//!   1. gather the `columns` FP8 rows of each token's hash ids and dequantize them to bf16
//!      (q times its UE8M0 scale, exact), concatenated in column order;
//!   2. act_quant + the FP8 wkv GEMM (kernels/gemm) -> key [hc, dim] and value [dim];
//!   3. per stream c: the normalized dot product of the stream with the key (sums in double like
//!      the host), the signed-sqrt sigmoid gate (0 on image tokens), X_c <- bf16(X_c + gate_c value).
//! Hash ids come from the host (engram/hash.hpp: integer work on the token history); they are
//! checked on the device too, and an id outside the table yields NaN in the gathered row rather
//! than an out-of-bounds read. Tables too large for device memory (V4.1's ~100 GB) need the
//! host-memory path of issue 5, item 5, which is not built yet.

#include <cublas_v2.h>
#include <cuda_pipeline.h>  // __pipeline_memcpy_async (cp.async)
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/gemm/dequant_gemm.cuh"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/fast_codec.cuh"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/minifloat.hpp"
#include "dsv4/numerics/quantize.cuh"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::engram {

using numerics::bf16;

//! Device view of one Engram module's weights.
struct engram_device_weights {
  int hc = 4, dim = 0, head_dim = 0, columns = 0;
  long long rows = 0;                         //!< rows held here (a tensor-parallel rank: its part)
  //! A tensor-parallel rank holds table rows [first_row, first_row + rows) of `table_rows`
  //! (ParallelEngramEmbedding): ids of other ranks' rows gather zeros, to be summed over the
  //! ranks. table_rows 0: the whole table is here (first_row 0).
  long long first_row = 0, table_rows = 0;
  const std::uint8_t* embed = nullptr;        //!< [rows, head_dim] E4M3
  const std::uint8_t* embed_scale = nullptr;  //!< [rows, head_dim / 32] UE8M0
  const std::uint8_t* wkv = nullptr;          //!< FP8 [dim * (hc + 1), columns * head_dim], MMA tiles
  const std::uint8_t* wkv_scale = nullptr;
  const float* qk_weight = nullptr;           //!< [hc, dim]: q_weight * k_weight, rounded to fp32 once
  float eps = 1e-20f;
  DSV4_HOST_DEVICE int k() const { return columns * head_dim; }
  DSV4_HOST_DEVICE int n() const { return dim * (hc + 1); }
};

//! Intermediates for up to `max_tokens` tokens.
struct engram_workspace {
  engram_workspace(const engram_device_weights& w, long long max_tokens)
      : max_tokens(max_tokens), e(std::size_t(max_tokens) * w.k()), codes(e.size()), scales(e.size() / 32),
        kv(std::size_t(max_tokens) * w.n()),
        // The prefill path of the value projection (dequantize + cuBLAS; in passes above 64 MB).
        gemm(std::size_t(1) << 22, kernels::gemm::dequant_elems_for(max_tokens, {{w.n(), w.k()}}),
             kernels::gemm::folded_bytes_for(max_tokens, w.k())) {}
  long long max_tokens;
  runtime::device_buffer<bf16> e;
  runtime::device_buffer<std::uint8_t> codes, scales;
  runtime::device_buffer<bf16> kv;
  kernels::gemm::gemm_workspace gemm;
};

namespace detail {
DSV4_KERNEL void engram_gather_kernel(engram_device_weights w, const std::int64_t* hashes, long long tokens, bf16* e) {
  runtime::start_after_previous_grid();
  const long long per_token = 1LL * w.columns * w.head_dim;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * per_token) return;
  const long long t = i / per_token;
  const int c = int((i % per_token) / w.head_dim), d = int(i % w.head_dim);
  const std::int64_t id = hashes[t * w.columns + c];
  if (id < 0 || id >= (w.table_rows > 0 ? w.table_rows : w.rows)) {
    e[i] = bf16::from_bits(0x7fc0);
    return;
  }
  const std::int64_t row = id - w.first_row;
  if (row < 0 || row >= w.rows) {  // another rank's row
    e[i] = bf16::from_float(0.0f);
    return;
  }
  const float q = numerics::fast_decode<numerics::e4m3>(w.embed[row * w.head_dim + d]);
  const float s = numerics::decode<numerics::ue8m0>(w.embed_scale[row * (w.head_dim / 32) + d / 32]);
  e[i] = bf16::from_float(__fmul_rn(q, s));
}

inline constexpr int gate_threads = 256;
//! Shared memory a gate CTA may stage: 10 bytes per channel (qk weight, stream, key, value),
//! so channels up to 16384.
inline constexpr int gate_smem_budget = 160 * 1024;

//! One CTA per (token, stream): reduce, gate, update the stream.
//! The three sums keep the order of the kernel this one replaced (one CTA per token, one warp per
//! stream), so the bits are the same: lane l adds channels l, l + 32, ... in order into a
//! double, then the 32 lane sums meet in an xor butterfly. Each lane's sum is a dependent chain,
//! so a sum cannot use more than one warp without changing the bits; what made that kernel slow
//! (100 us at batch 1, dim 5120) was memory latency: each lane's 160 scalar loads per pass waited
//! one after another, on one CTA. Here the CTA's 256 threads first copy the stream's row, its
//! key, its qk weight and the value into shared memory with asynchronous copies, all in flight at
//! once; three warps run the three sums (h.h, key.key, the weighted dot) side by side, and the
//! value's copy overlaps them. Every thread then computes the same gate from the three sums.
DSV4_KERNEL void __launch_bounds__(gate_threads) engram_gate_kernel(engram_device_weights w, bf16* x, const bf16* kv,
                                                                    const std::uint8_t* is_image) {
  runtime::start_after_previous_grid();
  extern __shared__ uint4 staged[];  // qk weight [dim] fp32, then stream, key, value [dim] bf16 each
  __shared__ double sums[3];         // h.h, key.key, dot
  const long long t = blockIdx.x;
  const int c = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunks = w.dim / 8;  // 16-byte pieces of a bf16 row (dim % 8 == 0, checked by the launcher)
  bf16* xs = x + (t * w.hc + c) * w.dim;
  const bf16* key = kv + t * w.n() + static_cast<long long>(c) * w.dim;
  const bf16* value = kv + t * w.n() + static_cast<long long>(w.hc) * w.dim;
  const float* wd = w.qk_weight + static_cast<long long>(c) * w.dim;
  float* wd_s = reinterpret_cast<float*>(staged);
  bf16* h_s = reinterpret_cast<bf16*>(wd_s + w.dim);
  bf16* key_s = h_s + w.dim;
  bf16* value_s = key_s + w.dim;
  auto copy = [](void* to, const void* from, int pieces) {
    for (int i = threadIdx.x; i < pieces; i += gate_threads)
      __pipeline_memcpy_async(static_cast<uint4*>(to) + i, static_cast<const uint4*>(from) + i, sizeof(uint4));
  };
  copy(wd_s, wd, 2 * chunks);
  copy(h_s, xs, chunks);
  copy(key_s, key, chunks);
  __pipeline_commit();
  copy(value_s, value, chunks);
  __pipeline_commit();
  __pipeline_wait_prior(1);  // all but the value
  __syncthreads();
  if (warp < 3) {
    double sum = 0;
    if (warp == 0)
      for (int d = lane; d < w.dim; d += 32) {
        const float h = h_s[d].to_float();
        sum += double(h) * h;
      }
    else if (warp == 1)
      for (int d = lane; d < w.dim; d += 32) {
        const float k = key_s[d].to_float();
        sum += double(k) * k;
      }
    else
      for (int d = lane; d < w.dim; d += 32)
        sum += double(__fmul_rn(__fmul_rn(h_s[d].to_float(), wd_s[d]), key_s[d].to_float()));
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) sums[warp] = sum;
  }
  __pipeline_wait_prior(0);
  __syncthreads();  // the sums and the value are in shared memory
  const double hh = sums[0], kk = sums[1], dot = sums[2];
  const float rh = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(float(hh / w.dim), w.eps)));
  const float rk = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(float(kk / w.dim), w.eps)));
  const float rstd = __fmul_rn(rh, rk);
  const float dc = __fmul_rn(__fmul_rn(float(dot), rstd), __fdiv_rn(1.0f, __fsqrt_rn(float(w.dim))));
  const float root = copysignf(__fsqrt_rn(fmaxf(fabsf(dc), 1e-6f)), dc);
  const float gate = (is_image && is_image[t]) ? 0.0f : __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-root)));
  for (int d = threadIdx.x; d < w.dim; d += gate_threads)
    xs[d] = bf16::from_float(__fadd_rn(h_s[d].to_float(), __fmul_rn(gate, value_s[d].to_float())));
}
}  // namespace detail

//! A tensor-parallel rank's sum of the gathered rows over the ranks (model.py's all_reduce after
//! ParallelEngramEmbedding, bf16; each value has one nonzero term): called on the stream with
//! the bf16 rows [n] before anything reads them.
using gathered_row_sum = std::function<void(bf16* rows, std::size_t n, cudaStream_t stream)>;

//! x [tokens, hc, dim] (device, updated in place) += per-stream gate x value; `hashes` [tokens,
//! columns] (device); `is_image` optional, one byte per token. `sum_rows`: a tensor-parallel
//! rank's (w.first_row / table_rows name its part of the table); empty for the whole table.
inline void engram_forward(bf16* x, const std::int64_t* hashes, const std::uint8_t* is_image, long long tokens,
                           const engram_device_weights& w, engram_workspace& ws, cublasHandle_t blas,
                           cudaStream_t stream = nullptr, const gathered_row_sum& sum_rows = {}) {
  const std::string where = "engram_forward (tokens " + std::to_string(tokens) + "): ";
  if (tokens < 0 || tokens > ws.max_tokens) throw error(where + "the workspace holds " + std::to_string(ws.max_tokens) + " tokens");
  if (w.hc < 1 || w.hc > 65535 || w.dim <= 0 || w.dim % 8 || w.dim > detail::gate_smem_budget / 10 || w.head_dim <= 0 ||
      w.head_dim % 32 || w.columns <= 0 || w.rows <= 0)
    throw error(where + "need 1 <= hc <= 65535 (grid y), dim a positive multiple of 8 up to " +
                std::to_string(detail::gate_smem_budget / 10) +
                ", head_dim a positive multiple of 32, columns > 0, rows > 0");
  // (A high rank's part may start past the table's last row: ceil(rows / W) parts hold padding,
  // and such a rank gathers only zeros.)
  if (w.first_row < 0 || w.table_rows < 0 || (w.table_rows == 0 && w.first_row != 0))
    throw error(where + "the table part [" + std::to_string(w.first_row) + ", +" + std::to_string(w.rows) +
                ") is not a part of a table of " + std::to_string(w.table_rows) + " rows");
  if (ws.e.size() < std::size_t(tokens) * w.k() || ws.kv.size() < std::size_t(tokens) * w.n())
    throw error(where + "the workspace was made for other weights");
  if (tokens == 0) return;
  if (!x || !hashes || !w.embed || !w.embed_scale || !w.wkv || !w.wkv_scale || !w.qk_weight)
    throw error(where + "null pointer argument");
  auto misaligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 != 0; };
  if (misaligned(x) || misaligned(w.qk_weight)) throw error(where + "x and the qk weight must be 16-byte aligned");
  const long long gathered = tokens * w.k();
  runtime::launch_programmatic(detail::engram_gather_kernel, dim3(unsigned((gathered + 255) / 256)), dim3(256), 0, stream, w,
                               hashes, tokens, ws.e.data());
  DSV4_CUDA_CHECK_LAUNCH();
  if (sum_rows) sum_rows(ws.e.data(), std::size_t(gathered), stream);
  numerics::quantize<numerics::fp8_act_format>(
      {ws.e.data(), tokens, w.k(), w.k(), ws.codes.data(), w.k(), ws.scales.data(), w.k() / 32}, stream);
  kernels::gemm::block_scaled_linear({{int(tokens), w.n(), w.k()}, ws.codes.data(), ws.scales.data(), w.wkv, w.wkv_scale,
                                      ws.kv.data()},
                                     kernels::gemm::weight_format::fp8_tile32, &ws.gemm, blas, stream);
  const int smem = w.dim * 10;
  if (smem > 48 * 1024)  // above the default limit of dynamic shared memory: opt in
    DSV4_CUDA_CHECK(cudaFuncSetAttribute(detail::engram_gate_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  runtime::launch_programmatic(detail::engram_gate_kernel, dim3(unsigned(tokens), unsigned(w.hc)), dim3(detail::gate_threads),
                               std::size_t(smem), stream, w, x, ws.kv.data(), is_image);
  DSV4_CUDA_CHECK_LAUNCH();
}

}  // namespace dsv4::engram
