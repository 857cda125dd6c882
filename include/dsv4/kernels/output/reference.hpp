#pragma once
//! \file
//! Host reference of the attention output path (spec §5 "Output"):
//!   1. inverse RoPE on the last rope_dim channels of each head's output, at the query position;
//!   2. heads grouped o_groups ways (group g = heads g*hpg ... g*hpg + hpg - 1, concatenated), each
//!      group projected by its own block of wo_a [groups, o_lora, hpg * head_dim]: a plain bf16
//!      GEMM with bf16 output (the block-diagonal einsum "bsgd,grd->bsgr");
//!   3. the groups' outputs flattened (g * o_lora + r) and projected by wo_b, an FP8 linear layer
//!      (act_quant per 32, then the block-scaled GEMM), bf16 out.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/gemm/reference.hpp"
#include "dsv4/kernels/linear/reference.hpp"
#include "dsv4/kernels/rope/rope.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.hpp"

namespace dsv4::kernels::output {

using numerics::bf16;

struct output_shape {
  int heads = 0, head_dim = 0, groups = 0, o_lora = 0, dim = 0;
  int heads_per_group() const { return heads / groups; }
  int group_width() const { return heads_per_group() * head_dim; }
};

//! Step 2: o [heads * head_dim] (already un-rotated) -> [groups * o_lora] bf16.
inline std::vector<bf16> grouped_projection_reference(const output_shape& s, std::span<const bf16> o,
                                                      std::span<const float> wo_a) {
  if (s.groups <= 0 || s.heads % s.groups)
    throw error("grouped_projection_reference: heads must be a multiple of o_groups");
  if (o.size() != std::size_t(s.heads) * s.head_dim ||
      wo_a.size() != std::size_t(s.groups) * s.o_lora * s.group_width())
    throw error("grouped_projection_reference: o must be [heads * head_dim] and wo_a [groups, o_lora, group width]");
  std::vector<bf16> out;
  out.reserve(std::size_t(s.groups) * s.o_lora);
  const std::size_t gw = std::size_t(s.group_width());
  for (int g = 0; g < s.groups; ++g) {
    const auto xg = linear::widen(o.subspan(std::size_t(g) * gw, gw));
    const auto yg = linear::linear_bf16_reference(xg, wo_a.subspan(std::size_t(g) * s.o_lora * gw, std::size_t(s.o_lora) * gw),
                                                  s.o_lora);
    out.insert(out.end(), yg.begin(), yg.end());
  }
  return out;
}

//! Steps 1-3 for one token at `position`; wo_b is FP8 [dim, groups * o_lora] with 32 x 32 scales.
inline std::vector<bf16> attention_output_reference(const output_shape& s, std::span<const bf16> o, long long position,
                                                    std::span<const float> freqs, std::span<const float> wo_a,
                                                    std::span<const std::uint8_t> wo_b, std::span<const std::uint8_t> wo_b_scale) {
  std::vector<bf16> un(o.begin(), o.end());
  const std::int64_t pos[1] = {position};
  rope::apply_rope_reference(un, s.head_dim, s.heads, pos, freqs, true);
  const auto mid = grouped_projection_reference(s, un, wo_a);
  return gemm::block_scaled_linear_reference(mid, s.dim, wo_b, wo_b_scale, false);
}

}  // namespace dsv4::kernels::output
