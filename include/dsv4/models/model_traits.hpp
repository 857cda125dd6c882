#pragma once
//! \file
//! Compile-time validation of a model variant and the facts derived from it: cache formats and
//! bytes per token (spec §15). Every check says what is wrong and how to fix it.
//!
//! A model variant is a type with:
//! \code
//! struct my_model {
//!   static constexpr const char* name = "...";
//!   using schedule = schedule::model_schedule<...>;
//!   static constexpr models::model_config dims = {...};
//!   static constexpr std::array<long long, E> engram_num_embeddings = {...};  // E Engram layers
//!   using main_kv_format = numerics::main_kv_format;      // compressed global KV
//!   using index_key_format = numerics::index_key_format;  // indexer keys
//!   using local_kv_format = numerics::fp8_act_format;     // sliding-window KV
//! };
//! \endcode

#include <cstddef>
#include <numeric>

#include "dsv4/models/model_config.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/schedule/model_schedule.hpp"

namespace dsv4::models {

//! An exact number of bytes per token, num / den (ratio-2 owners store one entry per 2 tokens).
struct bytes_per_token {
  long long num = 0;
  long long den = 1;
  constexpr double value() const { return double(num) / double(den); }
  constexpr bool is_integer() const { return num % den == 0; }
  friend constexpr bool operator==(bytes_per_token a, bytes_per_token b) { return a.num * b.den == b.num * a.den; }
  constexpr bytes_per_token operator+(bytes_per_token o) const {
    const long long d = std::lcm(den, o.den);
    bytes_per_token r{num * (d / den) + o.num * (d / o.den), d};
    const long long g = std::gcd(r.num, r.den);
    return g > 1 ? bytes_per_token{r.num / g, r.den / g} : r;
  }
};

template <class Model>
struct model_traits {
  using schedule = typename Model::schedule;
  static constexpr model_config c = Model::dims;
  using main_kv_format = typename Model::main_kv_format;
  using index_key_format = typename Model::index_key_format;
  using local_kv_format = typename Model::local_kv_format;

  // --- formats -----------------------------------------------------------------------------
  static_assert(numerics::BlockFormat<main_kv_format> && numerics::BlockFormat<index_key_format> &&
                    numerics::BlockFormat<local_kv_format>,
                "model_traits<Model>: main_kv_format, index_key_format and local_kv_format must be "
                "numerics::block_scaled formats");

  // --- attention ---------------------------------------------------------------------------
  static_assert(c.dim > 0 && c.dim % 32 == 0,
                "model config: dim must be a positive multiple of 32 (FP8 activations carry one "
                "scale per 32 channels)");
  static_assert(c.attn.n_heads > 0 && c.attn.o_groups > 0 && c.attn.n_heads % c.attn.o_groups == 0,
                "model config: n_heads must be a positive multiple of o_groups (the grouped output "
                "projection takes n_heads / o_groups heads per group)");
  static_assert(c.attn.rope_head_dim > 0 && c.attn.rope_head_dim % 2 == 0 &&
                    c.attn.rope_head_dim < c.attn.head_dim,
                "model config: rope_head_dim must be even, positive and smaller than head_dim "
                "(RoPE rotates pairs in the last rope_head_dim channels)");
  static_assert(c.attn.head_dim % main_kv_format::block_size == 0 &&
                    c.attn.head_dim % local_kv_format::block_size == 0,
                "model config: head_dim must be a multiple of the main-KV and local-KV block sizes "
                "(16 and 32 for V4.1)");
  static_assert(c.attn.q_lora_rank > 0 && c.attn.q_lora_rank % 32 == 0 && c.attn.o_lora_rank > 0,
                "model config: q_lora_rank must be a positive multiple of 32 (it feeds FP8 GEMMs) and "
                "o_lora_rank positive");
  static_assert(c.attn.window_size > 0, "model config: window_size (local attention) must be positive");

  // --- indexer and candidate pool ---------------------------------------------------------
  static_assert(c.indexer.index_n_heads > 0 && c.indexer.index_head_dim % index_key_format::block_size == 0 &&
                    c.indexer.index_head_dim >= c.attn.rope_head_dim,
                "model config: index_head_dim must be a multiple of the index-key block (32) and at "
                "least rope_head_dim; index_n_heads must be positive");
  static_assert(c.indexer.index_topk > 0, "model config: index_topk must be positive");
  static_assert(schedule::candidate_source < 0 ||
                    (c.indexer.candidate_block_size > 0 &&
                     c.indexer.pool_capacity() >= c.indexer.index_topk),
                "model config: the candidate pool (candidate_topk_blocks x candidate_block_size) must "
                "hold at least index_topk entries, or Reindex layers cannot fill their top-k");

  // --- MoE ---------------------------------------------------------------------------------
  static_assert(c.moe.n_routed_experts > 0 && c.moe.n_activated_experts > 0 &&
                    c.moe.n_activated_experts <= c.moe.n_routed_experts,
                "model config: n_activated_experts must be in [1, n_routed_experts]");
  static_assert(c.moe.moe_inter_dim > 0 && c.moe.moe_inter_dim % 32 == 0,
                "model config: moe_inter_dim must be a positive multiple of 32 (FP4 expert weights "
                "carry one scale per 32 along K)");

  // --- mHC ---------------------------------------------------------------------------------
  static_assert(c.mhc.hc_mult >= 1 && c.mhc.hc_sinkhorn_iters >= 1,
                "model config: hc_mult and hc_sinkhorn_iters must be at least 1");

  // --- Engram, vision, DSpark ------------------------------------------------------------
  static_assert(Model::engram_num_embeddings.size() == std::size_t(schedule::engram::size),
                "model config: engram_num_embeddings needs one entry per Engram layer of the "
                "schedule");
  static_assert(schedule::engram::size == 0 ||
                    (c.engram.engram_max_ngram_size >= 2 && c.engram.engram_n_heads > 0 &&
                     c.engram.engram_head_dim > 0 && c.engram.engram_pad_id < c.vocab_size),
                "model config: Engram needs max_ngram_size >= 2, positive heads and head_dim, and a "
                "pad id inside the vocabulary");
  static_assert(c.vision.vision_n_heads > 0 && c.vision.vision_dim % c.vision.vision_n_heads == 0,
                "model config: vision_dim must be a multiple of vision_n_heads");
  static_assert(c.vision.image_token_id >= 0 && c.vision.image_token_id < c.vocab_size,
                "model config: image_token_id must be inside the vocabulary");
  static_assert(schedule::drafter::stages == 0 ||
                    (c.dspark.dspark_noise_token_id >= 0 && c.dspark.dspark_noise_token_id < c.vocab_size &&
                     c.dspark.dspark_n_activated_experts > 0 &&
                     c.dspark.dspark_n_activated_experts <= c.dspark.dspark_n_routed_experts),
                "model config: DSpark needs a noise token inside the vocabulary and "
                "dspark_n_activated_experts in [1, dspark_n_routed_experts]");

  // --- cache accounting (spec §15) ------------------------------------------------------
  static constexpr int main_entry_bytes =
      numerics::packed_vector<main_kv_format, c.attn.head_dim>::bytes;
  static constexpr int index_entry_bytes =
      numerics::packed_vector<index_key_format, c.indexer.index_head_dim>::bytes;
  static constexpr int local_entry_bytes =
      numerics::packed_vector<local_kv_format, c.attn.head_dim>::bytes;

  //! Global bytes per original token stored by owner layer `owner` (one entry per `ratio` tokens).
  static constexpr bytes_per_token owner_bytes_per_token(int owner, int entry_bytes) {
    return bytes_per_token{entry_bytes, schedule::ratio(owner)} + bytes_per_token{0, 1};
  }
  static constexpr bytes_per_token sum_over_owners(int entry_bytes) {
    bytes_per_token total{0, 1};
    for (int o : schedule::owners) total = total + owner_bytes_per_token(o, entry_bytes);
    return total;
  }
  static constexpr bytes_per_token global_main_per_token = sum_over_owners(main_entry_bytes);
  static constexpr bytes_per_token global_index_per_token = sum_over_owners(index_entry_bytes);
  static constexpr bytes_per_token global_kv_per_token = global_main_per_token + global_index_per_token;

  //! Local window bytes per sequence for one layer (a ring of window_size entries).
  static constexpr long long local_window_bytes_per_layer =
      static_cast<long long>(local_entry_bytes) * c.attn.window_size;
  //! Layers holding a window ring: every backbone layer plus every DSpark stage (spec §15).
  static constexpr int window_layers = schedule::num_layers + schedule::drafter::stages;
};

}  // namespace dsv4::models
