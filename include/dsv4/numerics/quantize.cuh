#pragma once
//! \file
//! CUDA block quantizer and dequantizer for packed vectors. Same rules, same bytes as the host
//! reference in quantize.hpp (both call the codecs of block_format.hpp / minifloat.hpp).
//!
//! Work split: each thread owns 8 consecutive elements (one 16-byte load of bf16), so a format
//! block of N elements spans N/8 adjacent lanes, which agree on the block's amax through
//! xor-shuffles of the fp32 bit patterns (integer max: NaN ranks above +inf, so a NaN anywhere in
//! the block reaches every lane). Loads and stores are contiguous across the warp.

#include <cuda_runtime.h>  // provides cudaStream_t, uint2, uint4

#include <cstdint>
#include <string>
#include <type_traits>

#include "dsv4/core/error.hpp"
#include "dsv4/core/process_switch.hpp"
#include "dsv4/numerics/fast_codec.cuh"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::numerics {

//! A batch of `rows` vectors of `channels` values. Strides are in elements for `x` and in bytes
//! for `codes` and `scales`, so the outputs can be separate arrays or interleaved cache entries
//! (codes at entry offset 0, scales at packed_vector<...>::scale_offset).
struct quantize_args {
  const bf16* x = nullptr;
  long long rows = 0;
  int channels = 0;
  long long x_row_stride = 0;
  std::uint8_t* codes = nullptr;
  long long codes_row_stride = 0;
  std::uint8_t* scales = nullptr;
  long long scales_row_stride = 0;
  //! Optional, E4M3 codes only: [rows, channels] the value of each code as f16 bits (unscaled;
  //! exact: every E4M3 value is an f16 value), for GEMMs whose tensor-core operands are f16 (the
  //! MoE's streamed expert GEMMs read it instead of converting the codes in every warp).
  std::uint16_t* codes_f16 = nullptr;
  long long codes_f16_row_stride = 0;
};

//! Rows already quantized as activations (fp8_act_format: E4M3 codes [rows, width], UE8M0 scales
//! [rows, width / 32], contiguous rows), handed to a consumer that would otherwise quantize them
//! itself; codes_f16 (optional) their values as f16 bits (quantize_args::codes_f16). All null:
//! none given.
struct act_quant_view {
  const std::uint8_t* codes = nullptr;
  const std::uint8_t* scales = nullptr;
  const std::uint16_t* codes_f16 = nullptr;
};

//! Where a norm that feeds FP8 linears can write the act_quant of its output in its own launch:
//! the plain RMSNorms (q_norm: rmsnorm_args::codes through norm::rmsnorm_quantized) and the mHC
//! boundaries (mhc_step_args::h_codes through device_model's boundaries).
enum class act_quant_site { norms, boundaries };
namespace detail {
struct fused_act_quant_norms_tag;
struct fused_act_quant_boundaries_tag;
}  // namespace detail
//! Process-wide, per site: whether the norm writes the act_quant in the same launch or leaves it
//! to a quantize launch of its own. The bytes are the same either way. Measured per site on an
//! H100 at V4.1 width (bench_model --ab-act-quant, docs/perf.md, forty-second session): fused at
//! the plain norms a decode step is 0.7-0.9% faster at batch 1 and 0.3-0.8% at batch 8 (one
//! launch fewer a layer), within the noise at 64: on by default; fused at the mHC boundaries it
//! is 7-10% slower at every batch (the boundary's act_quant runs in its one last CTA, on the
//! step's critical chain): off by default. Read when a call is launched.
inline void set_fused_act_quant(act_quant_site site, bool on) {
  if (site == act_quant_site::norms)
    process_switch<detail::fused_act_quant_norms_tag, true>::set(on);
  else
    process_switch<detail::fused_act_quant_boundaries_tag, false>::set(on);
}
inline bool fused_act_quant(act_quant_site site) {
  return site == act_quant_site::norms ? process_switch<detail::fused_act_quant_norms_tag, true>::on()
                                       : process_switch<detail::fused_act_quant_boundaries_tag, false>::on();
}
//! Both sites at once (bench_model --fused-act-quant).
inline void set_fused_act_quant(bool on) {
  set_fused_act_quant(act_quant_site::norms, on);
  set_fused_act_quant(act_quant_site::boundaries, on);
}

struct dequantize_args {
  const std::uint8_t* codes = nullptr;
  long long codes_row_stride = 0;
  const std::uint8_t* scales = nullptr;
  long long scales_row_stride = 0;
  long long rows = 0;
  int channels = 0;
  bf16* out = nullptr;
  long long out_row_stride = 0;
};

namespace detail {
inline constexpr int quant_elems_per_thread = 8;
inline constexpr int quant_threads_per_cta = 256;

template <class F>
std::string format_name() {
  return std::string("block_scaled<") + minifloat_name<typename F::element> + ", " +
         minifloat_name<typename F::scale> + ", " + std::to_string(F::block_size) + ">";
}

inline bool aligned(const void* p, std::size_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

//! Empty if the launch can proceed, else the reason (checked on the host before any launch).
template <class F>
std::string check_shapes(long long rows, int channels, const void* values, long long values_stride_elems,
                         const void* codes, long long codes_stride, const void* scales) {
  constexpr int code_bytes_per_thread = quant_elems_per_thread * F::element::storage_bits / 8;
  if (rows < 0) return "rows must be >= 0";
  if (channels <= 0 || channels % F::block_size != 0)
    return "channels (" + std::to_string(channels) + ") must be a positive multiple of the block size " +
           std::to_string(F::block_size);
  if (rows == 0) return {};
  if (!values || !codes || !scales) return "null pointer argument";
  if (!aligned(values, 16) || values_stride_elems % quant_elems_per_thread != 0)
    return "the bf16 tensor must be 16-byte aligned with a row stride that is a multiple of 8 elements";
  if (!aligned(codes, code_bytes_per_thread) || codes_stride % code_bytes_per_thread != 0)
    return "codes must be " + std::to_string(code_bytes_per_thread) +
           "-byte aligned with a row stride that is a multiple of " + std::to_string(code_bytes_per_thread);
  return {};
}

//! Element encoder for one block, on the device. With a power-of-two (UE8M0) scale, x / s equals
//! x * (1 / s) exactly (1/s is exact, both round the same real value once), so the division of the
//! reference becomes a multiply; an E4M3 scale keeps the true division.
template <class F>
struct device_block_encoder {
  float factor;  // 1/s for UE8M0 scales, s for E4M3 scales
  DSV4_DEVICE explicit device_block_encoder(std::uint8_t scale_code) {
    if constexpr (std::is_same_v<typename F::scale, ue8m0>)
      factor = scale_code == 0xFF ? __uint_as_float(0x7fc00000u) : exp2_int(127 - int(scale_code));
    else
      factor = decode<typename F::scale>(scale_code);
  }
  DSV4_DEVICE std::uint8_t operator()(float x) const {
    if constexpr (std::is_same_v<typename F::scale, ue8m0>)
      return fast_encode<typename F::element>(__fmul_rn(x, factor));
    else
      return fast_encode<typename F::element>(__fdiv_rn(x, factor));
  }
};

//! One thread's share of a block quantization: its 8 consecutive values `v` of a row, `chunk`
//! (= element index / 8) in that row. Every lane of the warp must call it (the block's amax is
//! agreed by shuffles); an inactive lane passes zeros and writes nothing. Kernels that make the
//! values themselves (moe's fused SwiGLU) quantize them here without a round trip through memory.
//! `f16_row` (optional, E4M3 codes only): the codes' values as f16 bits, 8 per chunk (quantize_args).
template <class F>
DSV4_DEVICE void quantize_chunk8(const bf16 (&v)[quant_elems_per_thread], bool active, std::uint8_t* codes_row,
                                 std::uint8_t* scales_row, long long chunk, std::uint16_t* f16_row = nullptr) {
  constexpr int kElems = quant_elems_per_thread;
  constexpr int kLanes = F::block_size / kElems;
  using Elem = typename F::element;
  std::uint32_t amax = 0;
  for (int i = 0; i < kElems; ++i) amax = max(amax, abs_bits(v[i]));
  // Every lane of the warp takes part (inactive ones with amax 0), so the full mask is valid.
  for (int off = kLanes / 2; off > 0; off >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, off));

  const std::uint8_t sc = F::scale_code(bits_to_float(amax));
  const device_block_encoder<F> enc(sc);
  if (!active) return;
  if constexpr (Elem::storage_bits == 8) {
    std::uint32_t lo = 0, hi = 0;
    for (int i = 0; i < 4; ++i) lo |= std::uint32_t(enc(v[i].to_float())) << (8 * i);
    for (int i = 0; i < 4; ++i) hi |= std::uint32_t(enc(v[4 + i].to_float())) << (8 * i);
    *reinterpret_cast<uint2*>(codes_row + chunk * 8) = make_uint2(lo, hi);
    if (std::is_same_v<Elem, e4m3> && f16_row) {
      std::uint32_t h[4];
      for (int i = 0; i < 4; ++i) {
        const std::uint32_t word = i < 2 ? lo : hi, pair = word >> (16 * (i % 2));
        h[i] = std::uint32_t(e4m3_code_as_f16(std::uint8_t(pair))) |
               std::uint32_t(e4m3_code_as_f16(std::uint8_t(pair >> 8))) << 16;
      }
      *reinterpret_cast<uint4*>(f16_row + chunk * 8) = make_uint4(h[0], h[1], h[2], h[3]);
    }
  } else {
    std::uint32_t packed = 0;  // element 2k in the low nibble of byte k (little-endian word)
    for (int i = 0; i < kElems; ++i) packed |= std::uint32_t(enc(v[i].to_float())) << (4 * i);
    *reinterpret_cast<std::uint32_t*>(codes_row + chunk * 4) = packed;
  }
  if (chunk % kLanes == 0) scales_row[chunk / kLanes] = sc;
}

//! The eight bf16 values of a 16-byte load (element 2i in the low half of word i).
DSV4_DEVICE void bf16x8_of(const uint4& raw, bf16 (&v)[quant_elems_per_thread]) {
  static_assert(quant_elems_per_thread == 8, "bf16x8_of: eight values a thread");
  const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  for (int i = 0; i < 8; ++i) v[i] = bf16::from_bits(std::uint16_t(words[i / 2] >> (16 * (i % 2))));
}

template <class F>
DSV4_KERNEL void quantize_kernel(quantize_args a) {
  // Wait for the producer of x first, then let the GEMM that consumes the codes start streaming
  // its weights (runtime/pdl.cuh).
  runtime::start_after_previous_grid();
  constexpr int kElems = quant_elems_per_thread;
  const long long chunks_per_row = a.channels / kElems;
  const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = t < a.rows * chunks_per_row;
  const long long row = active ? t / chunks_per_row : 0;
  const long long chunk = active ? t % chunks_per_row : 0;

  uint4 raw = make_uint4(0, 0, 0, 0);
  if (active) raw = *reinterpret_cast<const uint4*>(a.x + row * a.x_row_stride + chunk * kElems);
  bf16 v[kElems];
  bf16x8_of(raw, v);
  quantize_chunk8<F>(v, active, a.codes + row * a.codes_row_stride, a.scales + row * a.scales_row_stride, chunk,
                     a.codes_f16 ? a.codes_f16 + row * a.codes_f16_row_stride : nullptr);
}

template <class F>
DSV4_KERNEL void dequantize_kernel(dequantize_args a) {
  runtime::start_after_previous_grid();
  constexpr int kElems = quant_elems_per_thread;
  constexpr int kLanes = F::block_size / kElems;
  using Elem = typename F::element;
  const long long chunks_per_row = a.channels / kElems;
  const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= a.rows * chunks_per_row) return;
  const long long row = t / chunks_per_row;
  const long long chunk = t % chunks_per_row;
  const std::uint8_t* codes = a.codes + row * a.codes_row_stride;
  const float s = decode<typename F::scale>(a.scales[row * a.scales_row_stride + chunk / kLanes]);
  std::uint8_t c[kElems];
  if constexpr (Elem::storage_bits == 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(codes + chunk * 8);
    for (int i = 0; i < 4; ++i) c[i] = std::uint8_t(w.x >> (8 * i));
    for (int i = 0; i < 4; ++i) c[4 + i] = std::uint8_t(w.y >> (8 * i));
  } else {
    const std::uint32_t w = *reinterpret_cast<const std::uint32_t*>(codes + chunk * 4);
    for (int i = 0; i < kElems; ++i) c[i] = std::uint8_t((w >> (4 * i)) & 0xf);
  }
  std::uint32_t words[4] = {0, 0, 0, 0};
  for (int i = 0; i < kElems; ++i) words[i / 2] |= std::uint32_t(fast_dequantize<F>(c[i], s).bits) << (16 * (i % 2));
  *reinterpret_cast<uint4*>(a.out + row * a.out_row_stride + chunk * kElems) =
      make_uint4(words[0], words[1], words[2], words[3]);
}
}  // namespace detail

//! Empty when `quantize<F>(a)` can run, else why not.
template <BlockFormat F>
std::string can_implement(const quantize_args& a) {
  if (a.codes_f16 && a.rows > 0) {
    if (!std::is_same_v<typename F::element, e4m3>) return "codes_f16 needs E4M3 element codes";
    if (!detail::aligned(a.codes_f16, 16) || a.codes_f16_row_stride % 8 != 0)
      return "codes_f16 must be 16-byte aligned with a row stride that is a multiple of 8 elements";
    // (A stride below the row width would have rows write over each other: silent garbage.)
    if (a.rows > 1 && a.codes_f16_row_stride < a.channels)
      return "codes_f16_row_stride (" + std::to_string(a.codes_f16_row_stride) + ") is below the row width " +
             std::to_string(a.channels);
  }
  return detail::check_shapes<F>(a.rows, a.channels, a.x, a.x_row_stride, a.codes, a.codes_row_stride, a.scales);
}
template <BlockFormat F>
std::string can_implement(const dequantize_args& a) {
  return detail::check_shapes<F>(a.rows, a.channels, a.out, a.out_row_stride, a.codes, a.codes_row_stride, a.scales);
}

namespace detail {
//! Check, then launch one thread per 8 elements of every row.
template <class F, class Args, class Kernel>
void launch_rows(const char* op, Kernel kernel, const Args& a, cudaStream_t stream) {
  if (const std::string why = can_implement<F>(a); !why.empty())
    throw error(std::string(op) + "<" + format_name<F>() + ">: " + why);
  const long long threads = a.rows * (a.channels / quant_elems_per_thread);
  if (threads == 0) return;
  const long long ctas = (threads + quant_threads_per_cta - 1) / quant_threads_per_cta;
  runtime::launch_programmatic(kernel, dim3(static_cast<unsigned>(ctas)), dim3(quant_threads_per_cta), 0, stream, a);
  DSV4_CUDA_CHECK_LAUNCH();
}
}  // namespace detail

//! Quantize rows of bf16 into codes and scales (act_quant / fp4_act_quant without write-back).
template <BlockFormat F>
void quantize(const quantize_args& a, cudaStream_t stream = nullptr) {
  detail::launch_rows<F>("quantize", detail::quantize_kernel<F>, a, stream);
}

//! Decode codes and scales back to bf16 (the in-place QDQ value of the reference).
template <BlockFormat F>
void dequantize(const dequantize_args& a, cudaStream_t stream = nullptr) {
  detail::launch_rows<F>("dequantize", detail::dequantize_kernel<F>, a, stream);
}

}  // namespace dsv4::numerics
