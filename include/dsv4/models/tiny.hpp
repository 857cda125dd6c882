#pragma once
//! \file
//! `tiny`: the V4.1 Flash layer structure (40 layers, the same roles, ratios, Engram and DSpark
//! positions) with small widths, and a small top-k and candidate pool so that sparse selection
//! and the pool both bind on inputs of a few hundred tokens. For tests, CI and machines without
//! a GPU. Scale-independent values (eps, RoPE/YaRN, mHC, routing) match V4.1 Flash.

#include <array>
#include <cstddef>

#include "dsv4/engram/numpy_rng.hpp"
#include "dsv4/engram/table_layout.hpp"
#include "dsv4/models/v41_flash.hpp"

namespace dsv4::models {

struct tiny {
  static constexpr const char* name = "tiny";
  static constexpr const char* title = "tiny (V4.1 Flash structure, small widths)";

  using schedule = v41_flash::schedule;
  using main_kv_format = numerics::main_kv_format;
  using index_key_format = numerics::index_key_format;
  using local_kv_format = numerics::fp8_act_format;

  static constexpr model_config dims = {
      .vocab_size = 1024,
      .dim = 256,
      .norm_eps = 1e-20f,
      .dtype = weight_dtype::fp8,
      .expert_dtype = weight_dtype::fp4,
      .attn = {.n_heads = 4, .head_dim = 128, .rope_head_dim = 32, .q_lora_rank = 64,
               .o_groups = 2, .o_lora_rank = 64, .window_size = 16},
      .rope = {.rope_theta = 10000.0f, .compress_rope_theta = 160000.0f, .original_seq_len = 65536,
               .rope_factor = 16.0f, .beta_fast = 32.0f, .beta_slow = 1.0f,
               .max_position_embeddings = 8192},
      .indexer = {.index_n_heads = 4, .index_head_dim = 64, .index_topk = 16,
                  .candidate_topk_blocks = 8, .candidate_block_size = 4},
      .moe = {.n_routed_experts = 8, .n_shared_experts = 1, .n_activated_experts = 2,
              .moe_inter_dim = 128, .score = score_func::sqrtsoftplus, .route_scale = 1.5f,
              .swiglu_limit = 10.0f, .gate_temp = 1.0f, .norm_topk_prob = true},
      .mhc = {.hc_mult = 4, .hc_sinkhorn_iters = 20, .hc_eps = 1e-6f},
      .engram = {.engram_vocab_size = 4000, .engram_max_ngram_size = 4, .engram_pad_id = 2,
                 .engram_compressed_vocab_size = 1024, .engram_n_heads = 4, .engram_head_dim = 32},
      .vision = {.vision_n_layers = 2, .vision_dim = 64, .vision_n_heads = 2, .vision_inter_dim = 128,
                 .vision_patch_size = 14, .vision_downsample_ratio = 3, .vision_max_n_token = 64,
                 .vision_min_pixels = 12544, .vision_rope_theta = 10000.0f, .image_token_id = 1000},
      .dspark = {.dspark_block_size = 5, .dspark_noise_token_id = 999, .dspark_markov_rank = 16,
                 .dspark_n_routed_experts = 4, .dspark_n_activated_experts = 2},
  };

  static constexpr std::array<long long, 2> engram_num_embeddings =
      engram::table_rows<2>(dims.engram.engram_vocab_size, dims.engram.engram_max_ngram_size,
                            dims.engram.engram_n_heads);

  //! Engram hash multipliers (index k = look-back shift), computed at compile time exactly as the
  //! reference's engram.py does for any config: default_rng(10007 x layer id).integers(0, bound,
  //! size=max_ngram) x 2 + 1, bound = (int64_max / compressed_vocab) / 2, with NumPy's stream
  //! (engram/numpy_rng.hpp): the reference's compute_hash_multipliers((1, 14), 4, 1024) returns these.
  static constexpr std::array<std::array<long long, 4>, 2> engram_multipliers = [] {
    std::array<std::array<long long, 4>, 2> m{};
    for (std::size_t l = 0; l < m.size(); ++l) {
      const auto v = engram::hash_multipliers<4>(schedule::engram::values[l], dims.engram.engram_compressed_vocab_size);
      for (std::size_t k = 0; k < v.size(); ++k) m[l][k] = v[k];
    }
    return m;
  }();
};

using tiny_traits = model_traits<tiny>;
static_assert(tiny_traits::global_kv_per_token.is_integer(),
              "tiny: global KV bytes per token should be a whole number");

}  // namespace dsv4::models
