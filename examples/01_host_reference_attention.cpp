//! \brief One decode step of CSA2 sparse attention on the host, from packed caches.
//! Usage: example_01_host_reference_attention
//!
//! Builds a window ring (FP8, 528-byte entries) and a few compressed global entries (FP4, 288
//! bytes) the way the caches store them, dequantizes them, and runs the reference sparse
//! attention with a sink for one query of 64 heads: the same semantics the CUDA kernels are
//! tested against (include/dsv4/kernels/attention/).

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "dsv4/kernels/attention/reference.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.hpp"

using namespace dsv4;
using numerics::bf16;

int main() {
  constexpr int dim = 512, heads = 64, window = 128, global = 300, selected = 64;
  using window_entry = numerics::packed_vector<numerics::fp8_act_format, dim>;   // 528 bytes
  using global_entry = numerics::packed_vector<numerics::main_kv_format, dim>;   // 288 bytes
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 1.0f);

  // The caches, as stored: packed entries.
  std::vector<std::uint8_t> ring(window * window_entry::bytes), cache(global * global_entry::bytes);
  std::vector<bf16> operand((window + global) * dim);  // what attention sees: the dequantized entries
  std::vector<bf16> row(dim);
  for (int e = 0; e < window + global; ++e) {
    for (auto& v : row) v = bf16::from_float(n(rng));
    std::span<bf16> out(operand.data() + e * dim, dim);
    if (e < window) {
      std::uint8_t* p = ring.data() + e * window_entry::bytes;
      numerics::quantize_vector<numerics::fp8_act_format>(row, {p, window_entry::code_bytes},
                                                          {p + window_entry::scale_offset, window_entry::scale_bytes});
      numerics::dequantize_vector<numerics::fp8_act_format>({p, window_entry::code_bytes},
                                                            {p + window_entry::scale_offset, window_entry::scale_bytes}, out);
    } else {
      std::uint8_t* p = cache.data() + (e - window) * global_entry::bytes;
      numerics::quantize_vector<numerics::main_kv_format>(row, {p, global_entry::code_bytes},
                                                          {p + global_entry::scale_offset, global_entry::scale_bytes});
      numerics::dequantize_vector<numerics::main_kv_format>({p, global_entry::code_bytes},
                                                            {p + global_entry::scale_offset, global_entry::scale_bytes}, out);
    }
  }
  // One query: 64 heads. The index list: the whole window (oldest first), then the indexer's
  // selection, ascending, offset by the window length; -1 marks empty slots.
  std::vector<bf16> q(heads * dim);
  for (auto& v : q) v = bf16::from_float(1.5f * n(rng));
  std::vector<std::int32_t> idx;
  for (int j = 0; j < window; ++j) idx.push_back(j);
  for (int j = 0; j < selected; ++j) idx.push_back(window + j * (global / selected));
  idx.push_back(-1);
  std::vector<float> sink(heads, 0.0f);
  std::vector<bf16> out(heads * dim);
  const kernels::attention::sparse_attention_problem p{1, heads, dim, window + global, int(idx.size()),
                                                       1.0f / std::sqrt(float(dim))};
  kernels::attention::sparse_attention_reference(p, q, operand, sink, idx, out);
  std::printf("window %d x %d B + %d x %d B global entries; head 0 output[0..3] = %.4f %.4f %.4f %.4f\n", window,
              window_entry::bytes, global, global_entry::bytes, out[0].to_float(), out[1].to_float(), out[2].to_float(),
              out[3].to_float());
}
