#pragma once
//! \file
//! The attention output path on CUDA (spec §5 "Output"; host reference: reference.hpp):
//! inverse RoPE of the last rope_dim channels of every head (in place, at each token's position),
//! the block-diagonal bf16 projection by wo_a (o_groups groups of heads_per_group x head_dim ->
//! o_lora; at decode from its FP8 form where it has one: wo_a_fp8.cuh), act_quant, and the FP8
//! projection by wo_b (groups x o_lora -> dim), bf16 out.

#include <cublas_v2.h>     // provides cublasHandle_t
#include <cuda_runtime.h>  // provides cudaStream_t

#include <cstdint>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/gemm/dense.cuh"
#include "dsv4/kernels/gemm/dequant_gemm.cuh"
#include "dsv4/kernels/output/reference.hpp"
#include "dsv4/kernels/output/wo_a_fp8.cuh"
#include "dsv4/kernels/output/wo_a_fp8.hpp"
#include "dsv4/kernels/rope/rope.cuh"
#include "dsv4/numerics/quantize.cuh"
#include "dsv4/runtime/device_buffer.cuh"

namespace dsv4::kernels::output {

//! wo_a's FP8 form on the device (codes [groups * o_lora, group width], scales per 32 x 32 tile);
//! null: none (the bf16 path at every size).
struct wo_a_fp8_weight {
  const std::uint8_t* codes = nullptr;
  const std::uint8_t* scales = nullptr;
};

//! Intermediates for up to `max_tokens` tokens.
struct output_workspace {
  output_workspace(const output_shape& s, long long max_tokens)
      : shape(s), max_tokens(max_tokens), mid(std::size_t(max_tokens) * s.groups * s.o_lora),
        mid_codes(mid.size()), mid_scales(mid.size() / 32),
        gemm(std::size_t(1) << 22, std::size_t(max_tokens + s.dim) * s.groups * s.o_lora,
             gemm::folded_bytes_for(max_tokens, 1LL * s.groups * s.o_lora)) {}
  output_shape shape;
  long long max_tokens;
  runtime::device_buffer<numerics::bf16> mid;  //!< [T, groups * o_lora]
  runtime::device_buffer<std::uint8_t> mid_codes, mid_scales;
  gemm::gemm_workspace gemm;
};

//! out [T, dim] = wo_b(act_quant(wo_a(inverse_rope(o)))). `o` [T, heads * head_dim] is un-rotated
//! in place. wo_a: bf16 [groups, o_lora, heads_per_group * head_dim]; wo_b: FP8 MMA tiles of
//! [dim, groups * o_lora]. `wo_a_f8` (optional): wo_a's FP8 form (wo_a_fp8.hpp, exact_fp8_tiles),
//! which calls of up to wo_a_fp8_max_tokens tokens read instead of the bf16 weight (the same
//! products; wo_a_fp8.cuh).
inline void attention_output(numerics::bf16* o, const std::int64_t* positions, long long tokens, const float* freqs,
                             int rope_dim, const numerics::bf16* wo_a, const std::uint8_t* wo_b,
                             const std::uint8_t* wo_b_scale, numerics::bf16* out, output_workspace& ws,
                             cublasHandle_t blas, cudaStream_t stream = nullptr, const wo_a_fp8_weight& wo_a_f8 = {}) {
  const output_shape& s = ws.shape;
  if (tokens < 0 || tokens > ws.max_tokens)
    throw error("attention_output: " + std::to_string(tokens) + " tokens, the workspace holds " +
                std::to_string(ws.max_tokens));
  if (s.groups <= 0 || s.heads % s.groups || (s.groups * s.o_lora) % 32)
    throw error("attention_output: heads must be a multiple of o_groups, groups * o_lora of 32");
  if (s.o_lora <= 0 || s.dim <= 0 || s.head_dim <= 0 || rope_dim <= 0 || rope_dim % 2 || rope_dim > s.head_dim)
    throw error("attention_output: bad widths (o_lora, dim, head_dim, rope_dim)");
  if (tokens == 0) return;
  // Everything is checked before o is un-rotated in place, so a failed call leaves o as it was.
  if (!o || !positions || !freqs || !wo_a || !wo_b || !wo_b_scale || !out || !blas)
    throw error("attention_output: null pointer argument or cuBLAS handle");
  {
    const int k = s.groups * s.o_lora;
    if (auto why = gemm::detail::check_args({{int(tokens), s.dim, k}, ws.mid_codes.data(), ws.mid_scales.data(), wo_b,
                                             wo_b_scale, out},
                                            gemm::weight_format::fp8_tile32);
        !why.empty())
      throw error("attention_output: wo_b: " + why);
  }
  const wo_a_fp8_args fa{o, wo_a_f8.codes, wo_a_f8.scales, ws.mid.data(), int(tokens), s.groups, s.o_lora, s.group_width()};
  const bool fp8 = wo_a_f8.codes && wo_a_fp8_enabled() && wo_a_fp8_unsupported(fa).empty();
  rope::apply_rope({o, positions, freqs, tokens, s.heads, s.head_dim, rope_dim / 2, true}, stream);
  if (fp8)
    detail::launch_wo_a_fp8(fa, stream);  // fa checked above
  else
    gemm::grouped_linear_bf16(blas, o, wo_a, ws.mid.data(), int(tokens), s.groups, s.o_lora, s.group_width(), stream);
  const int k = s.groups * s.o_lora;
  numerics::quantize<numerics::fp8_act_format>({ws.mid.data(), tokens, k, k, ws.mid_codes.data(), k, ws.mid_scales.data(), k / 32},
                                               stream);
  gemm::block_scaled_linear({{int(tokens), s.dim, k}, ws.mid_codes.data(), ws.mid_scales.data(), wo_b, wo_b_scale, out},
                            gemm::weight_format::fp8_tile32, &ws.gemm, blas, stream);
}

}  // namespace dsv4::kernels::output
