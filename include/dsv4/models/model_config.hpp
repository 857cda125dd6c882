#pragma once
//! \file
//! The numeric configuration of a model (spec §1), grouped by the part of the model that reads
//! it. A model variant is a type with a `schedule` (schedule/model_schedule.hpp), a
//! `model_config dims` value, the cache formats, and its Engram table sizes; `model_traits`
//! checks the whole at compile time (model_traits.hpp).
//!
//! Field names follow the official `inference/config.json` keys, grouped; where the checkpoint's
//! HF config uses another name, the comment gives it.

#include <cstdint>

namespace dsv4::models {

enum class score_func : std::uint8_t { softmax, sigmoid, sqrtsoftplus };
enum class weight_dtype : std::uint8_t { bf16, fp8, fp4 };

struct attention_config {
  int n_heads = 0;           //!< query heads (one latent KV head, K = V)
  int head_dim = 0;          //!< per head, RoPE part included; also the latent KV width
  int rope_head_dim = 0;     //!< RoPE'd channels at the end of each head (qk_rope_head_dim)
  int q_lora_rank = 0;       //!< wq_a output width
  int o_groups = 0;          //!< grouped output projection: heads per group = n_heads / o_groups
  int o_lora_rank = 0;       //!< wo_a output width per group
  int window_size = 0;       //!< local sliding window (positions)
};

struct rope_config {
  float rope_theta = 0;            //!< base for ratio-0 layers (no YaRN)
  float compress_rope_theta = 0;   //!< base for compressed layers (with YaRN)
  int original_seq_len = 0;        //!< YaRN original length (0 disables YaRN)
  float rope_factor = 0;
  float beta_fast = 0;
  float beta_slow = 0;
  long long max_position_embeddings = 0;  //!< HF config; positions must stay below it
};

struct indexer_config {
  int index_n_heads = 0;
  int index_head_dim = 0;
  int index_topk = 0;
  int candidate_topk_blocks = 0;  //!< blocks kept in the candidate pool
  int candidate_block_size = 0;   //!< positions per block
  constexpr long long pool_capacity() const {
    return static_cast<long long>(candidate_topk_blocks) * candidate_block_size;
  }
};

struct moe_config {
  int n_routed_experts = 0;
  int n_shared_experts = 0;
  int n_activated_experts = 0;  //!< num_experts_per_tok
  int moe_inter_dim = 0;
  score_func score = score_func::sqrtsoftplus;
  float route_scale = 0;        //!< routed_scaling_factor
  float swiglu_limit = 0;
  float gate_temp = 1.0f;       //!< ModelArgs default, not in config.json
  bool norm_topk_prob = true;   //!< ModelArgs default, not in config.json
};

struct mhc_config {
  int hc_mult = 0;
  int hc_sinkhorn_iters = 0;
  float hc_eps = 0;
  constexpr int mix_hc() const { return (2 + hc_mult) * hc_mult; }
};

struct engram_config {
  long long engram_vocab_size = 0;
  int engram_max_ngram_size = 0;
  int engram_pad_id = 0;                    //!< HF: engram_pad_token_id
  int engram_compressed_vocab_size = 0;
  int engram_n_heads = 0;
  int engram_head_dim = 0;
};

struct vision_config {
  int vision_n_layers = 0;
  int vision_dim = 0;
  int vision_n_heads = 0;
  int vision_inter_dim = 0;
  int vision_patch_size = 0;
  int vision_downsample_ratio = 0;
  int vision_max_n_token = 0;
  long long vision_min_pixels = 0;
  float vision_rope_theta = 0;
  int image_token_id = 0;
};

struct dspark_config {
  int dspark_block_size = 0;
  int dspark_noise_token_id = 0;
  int dspark_markov_rank = 0;
  int dspark_n_routed_experts = 0;
  int dspark_n_activated_experts = 0;  //!< HF: dspark_num_experts_per_tok
};

struct model_config {
  int vocab_size = 0;
  int dim = 0;
  float norm_eps = 0;
  weight_dtype dtype = weight_dtype::fp8;
  weight_dtype expert_dtype = weight_dtype::fp4;
  attention_config attn{};
  rope_config rope{};
  indexer_config indexer{};
  moe_config moe{};
  mhc_config mhc{};
  engram_config engram{};
  vision_config vision{};
  dspark_config dspark{};
};

}  // namespace dsv4::models
