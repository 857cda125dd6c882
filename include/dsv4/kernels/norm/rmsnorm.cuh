#pragma once
//! \file
//! CUDA RMSNorm (spec §4), rows of bf16 in, bf16 out, weight bf16 (backbone) or fp32 (vision).
//! One CTA per row. The sum of squares is accumulated in double, like the host reference
//! (reference.hpp), so that the fp32 mean, and with it every output, is the host's bit for bit
//! except when a different double summation order lands on the other side of an fp32 rounding
//! boundary (a 2^-29 relative event); the reciprocal square root is a correctly rounded sqrt
//! followed by a correctly rounded division, as on the host.
//!
//! Optionally the same launch also writes the output's act_quant (E4M3, UE8M0 per 32: what
//! numerics::quantize<fp8_act_format> makes of the stored y, byte for byte, through the
//! quantizer's own per-thread step), for a FP8 linear that reads the normalized rows next: one
//! launch and one round trip through memory less on the decode chain.

#include <cuda_runtime.h>  // provides cudaStream_t, uint4

#include <string>
#include <type_traits>

#include "dsv4/core/error.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/quantize.cuh"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::norm {

template <class Weight>
struct rmsnorm_args {
  const numerics::bf16* x = nullptr;  //!< [rows, dim], row stride x_stride elements
  long long x_stride = 0;
  const Weight* w = nullptr;          //!< [dim]
  numerics::bf16* y = nullptr;        //!< [rows, dim], row stride y_stride elements (may equal x)
  long long y_stride = 0;
  long long rows = 0;
  int dim = 0;
  float eps = 1e-20f;
  //! Optional, both or neither: y's act_quant (fp8_act_format) as numerics::quantize writes it,
  //! codes [rows, dim] and scales [rows, dim / 32] with these row strides in bytes. Needs dim a
  //! multiple of 32 and y 16-byte aligned with a row stride that is a multiple of 8 elements.
  std::uint8_t* codes = nullptr;
  long long codes_stride = 0;
  std::uint8_t* scales = nullptr;
  long long scales_stride = 0;
};

namespace detail {
inline constexpr int rmsnorm_threads = 256;

template <class Weight>
DSV4_DEVICE float weight_value(const Weight* w, int i) {
  if constexpr (std::is_same_v<Weight, float>)
    return w[i];
  else
    return w[i].to_float();
}

template <class Weight>
DSV4_KERNEL void __launch_bounds__(rmsnorm_threads) rmsnorm_kernel(rmsnorm_args<Weight> a) {
  runtime::prefetch_l2(a.w, sizeof(Weight) * std::size_t(a.dim));  // the weight row: no kernel writes it
  runtime::start_after_previous_grid();
  __shared__ double partial[rmsnorm_threads / 32];
  __shared__ float inv_rms;
  const numerics::bf16* x = a.x + blockIdx.x * a.x_stride;
  double ss = 0;
  for (int i = threadIdx.x * 8; i < a.dim; i += rmsnorm_threads * 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(x + i);
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
    for (int j = 0; j < 8; ++j) {
      const double v = __uint_as_float((words[j / 2] >> (16 * (j % 2))) << 16);
      ss += v * v;
    }
  }
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < rmsnorm_threads / 32; ++w) total += partial[w];
    const float mean = float(total / double(a.dim));
    inv_rms = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, a.eps)));
  }
  __syncthreads();
  const float r = inv_rms;
  numerics::bf16* y = a.y + blockIdx.x * a.y_stride;
  if (!a.codes) {
    for (int i = threadIdx.x; i < a.dim; i += rmsnorm_threads)
      y[i] = numerics::bf16::from_float(__fmul_rn(weight_value(a.w, i), __fmul_rn(x[i].to_float(), r)));
    return;
  }
  // With the act_quant: a thread takes 8 consecutive outputs (one chunk), so the quantizer's
  // block of 32 is four adjacent lanes. The loop's bound is tested per warp (every lane must
  // reach the quantizer's shuffles); lanes past the row pass zeros and write nothing.
  const int chunks = a.dim / 8, lane = int(threadIdx.x % 32);
  std::uint8_t* codes = a.codes + blockIdx.x * a.codes_stride;
  std::uint8_t* scales = a.scales + blockIdx.x * a.scales_stride;
  for (int c0 = int(threadIdx.x) - lane; c0 < chunks; c0 += rmsnorm_threads) {
    const int c = c0 + lane;
    const bool active = c < chunks;
    numerics::bf16 v[8];
    if (active) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + c * 8);
      const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
      unsigned out[4] = {0, 0, 0, 0};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float xv = __uint_as_float((words[j / 2] >> (16 * (j % 2))) << 16);
        v[j] = numerics::bf16::from_float(__fmul_rn(weight_value(a.w, c * 8 + j), __fmul_rn(xv, r)));
        out[j / 2] |= unsigned(v[j].bits) << (16 * (j % 2));
      }
      *reinterpret_cast<uint4*>(y + c * 8) = make_uint4(out[0], out[1], out[2], out[3]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = numerics::bf16::from_bits(0);
    }
    numerics::detail::quantize_chunk8<numerics::fp8_act_format>(v, active, codes, scales, c);
  }
}
}  // namespace detail

//! y = RMSNorm(x) * w per row. Rows must be 16-byte aligned with dim a multiple of 8.
template <class Weight>
void rmsnorm(const rmsnorm_args<Weight>& a, cudaStream_t stream = nullptr) {
  static_assert(std::is_same_v<Weight, float> || std::is_same_v<Weight, numerics::bf16>,
                "rmsnorm: the weight is bf16 (backbone) or float (vision)");
  const std::string where = "rmsnorm (rows " + std::to_string(a.rows) + ", dim " + std::to_string(a.dim) + "): ";
  if (a.rows < 0 || a.dim <= 0 || a.dim % 8 != 0) throw error(where + "need rows >= 0 and dim a positive multiple of 8");
  if (a.rows > 2147483647LL) throw error(where + "too many rows for one launch");
  if (a.rows == 0) return;
  if (!a.x || !a.w || !a.y) throw error(where + "null pointer argument");
  if (reinterpret_cast<std::uintptr_t>(a.x) % 16 || a.x_stride % 8)
    throw error(where + "x must be 16-byte aligned with a row stride that is a multiple of 8 elements");
  if (a.x_stride < a.dim || a.y_stride < a.dim) throw error(where + "row strides must be at least dim");
  if (bool(a.codes) != bool(a.scales))
    throw error(where + "the act_quant needs both codes and scales, or neither");
  if (a.codes) {
    if (a.dim % 32 != 0) throw error(where + "the act_quant needs dim a multiple of its block of 32");
    if (reinterpret_cast<std::uintptr_t>(a.y) % 16 || a.y_stride % 8)
      throw error(
          where +
          "with the act_quant, y must be 16-byte aligned with a row stride that is a multiple of 8 elements");
    if (reinterpret_cast<std::uintptr_t>(a.codes) % 8 || a.codes_stride % 8 || a.codes_stride < a.dim ||
        a.scales_stride < a.dim / 32)
      throw error(
          where +
          "act_quant codes must be 8-byte aligned with a row stride of at least dim (a multiple of 8), "
          "scales a row stride of at least dim / 32");
  }
  runtime::launch_programmatic(detail::rmsnorm_kernel<Weight>, dim3(unsigned(a.rows)), dim3(detail::rmsnorm_threads), 0, stream,
                               a);
  DSV4_CUDA_CHECK_LAUNCH();
}

//! rmsnorm with its act_quant (a.codes and a.scales required): one launch where
//! numerics::fused_act_quant(act_quant_site::norms) (the default), else the norm and then numerics::quantize.
//! The same bytes either way.
inline void rmsnorm_quantized(const rmsnorm_args<numerics::bf16>& a, cudaStream_t stream = nullptr) {
  if (!a.codes || !a.scales) throw error("rmsnorm_quantized: needs the act_quant's codes and scales");
  if (numerics::fused_act_quant(numerics::act_quant_site::norms)) return rmsnorm<numerics::bf16>(a, stream);
  rmsnorm_args<numerics::bf16> plain = a;
  plain.codes = plain.scales = nullptr, plain.codes_stride = plain.scales_stride = 0;
  rmsnorm<numerics::bf16>(plain, stream);
  numerics::quantize<numerics::fp8_act_format>(
      {a.y, a.rows, a.dim, a.y_stride, a.codes, a.codes_stride, a.scales, a.scales_stride}, stream);
}

}  // namespace dsv4::kernels::norm
