#pragma once
// A five-layer CSA2 stack with every attention role, random weights in the checkpoint formats,
// and tiny widths with a small window, top-k and candidate pool (so that all of them bind on a few
// dozen tokens): a local layer, a ratio-2 owner + index source, a Reuse layer reading it, a
// ratio-1 owner that is the candidate source, and a Reindex layer. Shared by the host and the
// device tests of the attention sublayer.

#include <random>
#include <vector>

#include "dsv4/kernels/attention/layer_reference.hpp"
#include "dsv4/kernels/rope/rope.hpp"

namespace dsv4::test {

using kernels::attention::layer_shape;
using kernels::attention::layer_weights;
using kernels::attention::layer_wiring;
using numerics::bf16;
using schedule::attn_role;
namespace attention = kernels::attention;
namespace rope = kernels::rope;

inline constexpr layer_shape attention_stack_shape{.dim = 256, .heads = 4, .head_dim = 128, .rope_dim = 32, .q_lora = 64, .groups = 2,
                            .o_lora = 64, .window = 16, .index_heads = 4, .index_dim = 64, .topk = 8,
                            .pool_blocks = 3, .pool_block = 4};

struct attention_stack_weights {
  std::vector<layer_wiring> wiring;
  std::vector<layer_weights> weights;
  std::vector<float> freqs_local, freqs_compressed;
};

inline attention::fp8_linear random_fp8(int n, int k, std::mt19937_64& rng) {
  attention::fp8_linear l{n, k, std::vector<std::uint8_t>(std::size_t(n) * k),
                          std::vector<std::uint8_t>(std::size_t((n + 31) / 32) * (k / 32))};
  for (auto& c : l.codes) {
    c = std::uint8_t(rng());
    if ((c & 0x7F) == 0x7F) c = 0x38;
  }
  for (auto& c : l.scales) c = std::uint8_t(115 + rng() % 3);  // about 2^-11: outputs of order 1
  return l;
}

inline std::vector<float> random_values(std::size_t n, float scale, std::mt19937_64& rng, bool as_bf16 = true) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = as_bf16 ? bf16::from_float(d(rng)).to_float() : d(rng);
  return v;
}

//! RMSNorm weights near 1 (bf16 values), different per layer and per norm.
inline std::vector<float> random_norm(std::size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> d(0.75f, 1.25f);
  std::vector<float> v(n);
  for (auto& x : v) x = bf16::from_float(d(rng)).to_float();
  return v;
}

inline attention_stack_weights make_attention_stack(std::mt19937_64& rng) {
  attention_stack_weights st;
  st.wiring = {{attn_role::local, 0, -1, false},
               {attn_role::full, 2, 1, false},
               {attn_role::reuse, 2, 1, false},
               {attn_role::full, 1, 3, true},
               {attn_role::reindex, 1, 3, false}};
  const auto& s = attention_stack_shape;
  for (const auto& wr : st.wiring) {
    layer_weights w;
    w.wq_a = random_fp8(s.q_lora, s.dim, rng);
    w.wq_b = random_fp8(s.heads * s.head_dim, s.q_lora, rng);
    w.wkv = random_fp8(s.head_dim, s.dim, rng);
    w.wo_b = random_fp8(s.dim, s.groups * s.o_lora, rng);
    w.q_norm = random_norm(std::size_t(s.q_lora), rng);  // not all ones: a swapped or dropped weight must show
    w.kv_norm = random_norm(std::size_t(s.head_dim), rng);
    w.wo_a = random_values(std::size_t(s.groups) * s.o_lora * (s.heads / s.groups) * s.head_dim, 0.03f, rng);
    w.attn_sink = random_values(std::size_t(s.heads), 1.0f, rng, false);
    if (wr.role == attn_role::full) {
      w.compressor.dim = s.dim;
      w.compressor.head_dim = s.head_dim;
      w.compressor.ratio = wr.ratio;
      w.compressor.wkv = random_values(std::size_t(s.head_dim) * s.dim, 0.06f, rng, wr.ratio == 1);
      if (wr.ratio > 1) w.compressor.wgate = random_values(std::size_t(s.head_dim) * s.dim, 0.06f, rng, false);
      w.compressor.norm = random_norm(std::size_t(s.head_dim), rng);
      w.index_key.index_dim = s.index_dim;
      w.index_key.wk = random_values(std::size_t(s.index_dim) * s.head_dim, 0.09f, rng);
      w.index_key.norm = random_norm(std::size_t(s.index_dim), rng);
    }
    if (wr.role == attn_role::full || wr.role == attn_role::reindex) {
      w.idx_wq_b = random_fp8(s.index_heads * s.index_dim, s.q_lora, rng);
      w.weights_proj = random_values(std::size_t(s.index_heads) * s.dim, 0.06f, rng);
    }
    st.weights.push_back(std::move(w));
  }
  st.freqs_local = rope::frequencies({attention_stack_shape.rope_dim, 10000.0f});
  st.freqs_compressed = rope::frequencies({attention_stack_shape.rope_dim, 160000.0f, 65536, 16.0f, 32.0f, 1.0f});
  return st;
}

}  // namespace dsv4::test
