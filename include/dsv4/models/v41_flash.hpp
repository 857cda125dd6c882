#pragma once
//! \file
//! DeepSeek V4.1 Flash, with every value of the official `inference/config.json` (spec §1.1)
//! and the HF config's max_position_embeddings (spec §1.2).

#include <array>

#include "dsv4/models/model_traits.hpp"

namespace dsv4::models {

struct v41_flash {
  static constexpr const char* name = "v41-flash";
  static constexpr const char* title = "DeepSeek V4.1 Flash";

  // Layers 0-1 local only; encoder 2-19: [Full, Reuse x5] x3 at ratio 2; decoder 20-39:
  // [Full, Reuse x3], [Reindex, Reuse x3] x4 at ratio 1 (spec §2). Engram before layers 1 and 14;
  // DSpark (3 stages) reads the residual entering layers 37, 38, 39.
  using layers = schedule::layer_list<
      schedule::run{2, schedule::swa},
      schedule::run{1, schedule::full<2>}, schedule::run{5, schedule::reuse<2>},
      schedule::run{1, schedule::full<2>}, schedule::run{5, schedule::reuse<2>},
      schedule::run{1, schedule::full<2>}, schedule::run{5, schedule::reuse<2>},
      schedule::run{1, schedule::full<1>}, schedule::run{3, schedule::reuse<1>},
      schedule::run{1, schedule::reindex<1>}, schedule::run{3, schedule::reuse<1>},
      schedule::run{1, schedule::reindex<1>}, schedule::run{3, schedule::reuse<1>},
      schedule::run{1, schedule::reindex<1>}, schedule::run{3, schedule::reuse<1>},
      schedule::run{1, schedule::reindex<1>}, schedule::run{3, schedule::reuse<1>}>;
  using schedule = schedule::model_schedule<layers, 20, schedule::at<1, 14>,
                                            schedule::dspark<3, schedule::at<37, 38, 39>>>;

  using main_kv_format = numerics::main_kv_format;
  using index_key_format = numerics::index_key_format;
  using local_kv_format = numerics::fp8_act_format;

  static constexpr model_config dims = {
      .vocab_size = 129280,
      .dim = 5120,
      .norm_eps = 1e-20f,
      .dtype = weight_dtype::fp8,
      .expert_dtype = weight_dtype::fp4,
      .attn = {.n_heads = 64, .head_dim = 512, .rope_head_dim = 64, .q_lora_rank = 1280,
               .o_groups = 8, .o_lora_rank = 1024, .window_size = 128},
      .rope = {.rope_theta = 10000.0f, .compress_rope_theta = 160000.0f, .original_seq_len = 65536,
               .rope_factor = 16.0f, .beta_fast = 32.0f, .beta_slow = 1.0f,
               .max_position_embeddings = 1048576},
      .indexer = {.index_n_heads = 32, .index_head_dim = 128, .index_topk = 512,
                  .candidate_topk_blocks = 2048, .candidate_block_size = 8},
      .moe = {.n_routed_experts = 384, .n_shared_experts = 1, .n_activated_experts = 6,
              .moe_inter_dim = 2304, .score = score_func::sqrtsoftplus, .route_scale = 1.5f,
              .swiglu_limit = 10.0f, .gate_temp = 1.0f, .norm_topk_prob = true},
      .mhc = {.hc_mult = 4, .hc_sinkhorn_iters = 20, .hc_eps = 1e-6f},
      .engram = {.engram_vocab_size = 16000000, .engram_max_ngram_size = 4, .engram_pad_id = 2,
                 .engram_compressed_vocab_size = 99092, .engram_n_heads = 8, .engram_head_dim = 256},
      .vision = {.vision_n_layers = 32, .vision_dim = 1024, .vision_n_heads = 16,
                 .vision_inter_dim = 2816, .vision_patch_size = 14, .vision_downsample_ratio = 3,
                 .vision_max_n_token = 1024, .vision_min_pixels = 295936,
                 .vision_rope_theta = 10000.0f, .image_token_id = 129264},
      .dspark = {.dspark_block_size = 5, .dspark_noise_token_id = 128799, .dspark_markov_rank = 256,
                 .dspark_n_routed_experts = 128, .dspark_n_activated_experts = 3},
  };

  //! Rows of the Engram tables of layers 1 and 14 (config `engram_num_embeddings`); the test
  //! suite re-derives them from the prime layout (engram/table_layout.hpp).
  static constexpr std::array<long long, 2> engram_num_embeddings = {384006168, 384016682};

  //! Engram hash multipliers of layers 1 and 14, index k = look-back shift (spec §10: engram.py's
  //! `compute_hash_multipliers((1, 14), 4, 99092)`, NumPy's default_rng; also in the reference
  //! MANIFEST, which the tests compare against).
  static constexpr std::array<std::array<long long, 4>, 2> engram_multipliers = {{
      {76632096046245, 4839876093313, 35959672319349, 73987337458391},
      {67716810739261, 51510806800915, 30921347202721, 82619226485591},
  }};
};

using v41_flash_traits = model_traits<v41_flash>;
static_assert(v41_flash_traits::main_entry_bytes == 288 && v41_flash_traits::index_entry_bytes == 68,
              "v41_flash: a global entry must be 288 + 68 bytes (spec §15)");
static_assert(v41_flash_traits::global_kv_per_token == bytes_per_token{890, 1},
              "v41_flash: global KV must be 890 bytes per token (spec §15)");
static_assert(v41_flash_traits::local_entry_bytes == 528,
              "v41_flash: a local window entry must be 528 bytes (spec §15)");

}  // namespace dsv4::models
