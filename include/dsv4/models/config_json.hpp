#pragma once
//! \file
//! A model variant's `inference/config.json` (spec §1.1), both ways:
//! - `compare_config_json` compares a checkpoint's file with the variant's types: every key the
//!   official file has, including the lists the schedule determines (kv_source_layers,
//!   index_source_layers, compress_ratios, engram_layer_ids, dspark_target_layer_ids). Returns one
//!   line per mismatch or missing key, naming the key and both values; empty when they agree.
//! - `config_json_text` writes the file for a variant: exactly the official file's keys, in its
//!   order, with the variant's values (what the official `ModelArgs(**json)` reads; tools/parity
//!   builds the reference model of tiny from it).

#include <charconv>
#include <cmath>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/json.hpp"
#include "dsv4/models/model_traits.hpp"

namespace dsv4::models {

template <class Model>
std::vector<std::string> compare_config_json(const io::json& j) {
  using sched = typename model_traits<Model>::schedule;
  constexpr model_config c = Model::dims;
  std::vector<std::string> problems;
  if (!j.is_object()) return {"config.json is not a JSON object"};
  const auto& o = j.object();
  auto get = [&](const char* key) -> const io::json* {
    auto it = o.find(key);
    if (it == o.end()) {
      problems.push_back(std::string("missing key '") + key + "'");
      return nullptr;
    }
    return &it->second;
  };
  auto num = [&](const char* key, double want) {
    const io::json* v = get(key);
    if (!v) return;
    if (!v->is_number()) {
      problems.push_back(std::string("key '") + key + "' is not a number");
      return;
    }
    const double got = v->number();
    if (std::fabs(got - want) > 1e-6 * std::fabs(want) + 1e-30)
      problems.push_back(std::string("key '") + key + "' is " + std::to_string(got) + ", the model has " + std::to_string(want));
  };
  auto str = [&](const char* key, const std::string& want) {
    const io::json* v = get(key);
    if (!v) return;
    if (!v->is_string() || v->string() != want)
      problems.push_back(std::string("key '") + key + "' is " + (v->is_string() ? "'" + v->string() + "'" : "not a string") +
                         ", the model has '" + want + "'");
  };
  auto list = [&](const char* key, const std::vector<long long>& want) {
    const io::json* v = get(key);
    if (!v) return;
    std::vector<long long> got;
    if (v->is_array())
      for (const auto& e : v->array()) got.push_back(e.is_number() && e.integral ? e.integer : -999999);
    if (got != want) {
      auto show = [](const std::vector<long long>& x) {
        std::string s = "[";
        for (std::size_t i = 0; i < x.size(); ++i) s += (i ? ", " : "") + std::to_string(x[i]);
        return s + "]";
      };
      problems.push_back(std::string("key '") + key + "' is " + (v->is_array() ? show(got) : "not a list") + ", the model has " + show(want));
    }
  };
  auto to_vec = [](const auto& a) { return std::vector<long long>(a.begin(), a.end()); };
  const char* dtypes[] = {"bf16", "fp8", "fp4"};

  num("vocab_size", c.vocab_size);
  num("dim", c.dim);
  num("moe_inter_dim", c.moe.moe_inter_dim);
  num("n_layers", sched::num_layers);
  num("n_mtp_layers", sched::drafter::stages);
  num("n_heads", c.attn.n_heads);
  num("n_routed_experts", c.moe.n_routed_experts);
  num("n_shared_experts", c.moe.n_shared_experts);
  num("n_activated_experts", c.moe.n_activated_experts);
  const char* score_names[] = {"softmax", "sigmoid", "sqrtsoftplus"};
  str("score_func", score_names[int(c.moe.score)]);
  num("route_scale", c.moe.route_scale);
  num("swiglu_limit", c.moe.swiglu_limit);
  num("q_lora_rank", c.attn.q_lora_rank);
  num("head_dim", c.attn.head_dim);
  num("rope_head_dim", c.attn.rope_head_dim);
  num("norm_eps", c.norm_eps);
  num("o_groups", c.attn.o_groups);
  num("o_lora_rank", c.attn.o_lora_rank);
  num("window_size", c.attn.window_size);
  list("kv_source_layers", to_vec(sched::owners));
  list("index_source_layers", to_vec(sched::index_producers));
  num("original_seq_len", c.rope.original_seq_len);
  num("rope_theta", c.rope.rope_theta);
  num("rope_factor", c.rope.rope_factor);
  num("beta_fast", c.rope.beta_fast);
  num("beta_slow", c.rope.beta_slow);
  num("compress_rope_theta", c.rope.compress_rope_theta);
  num("index_n_heads", c.indexer.index_n_heads);
  num("index_head_dim", c.indexer.index_head_dim);
  num("index_topk", c.indexer.index_topk);
  num("candidate_source_layer", sched::candidate_source);
  num("candidate_topk_blocks", c.indexer.candidate_topk_blocks);
  num("candidate_block_size", c.indexer.candidate_block_size);
  num("hc_mult", c.mhc.hc_mult);
  num("hc_sinkhorn_iters", c.mhc.hc_sinkhorn_iters);
  num("hc_eps", c.mhc.hc_eps);
  list("engram_layer_ids", to_vec(sched::engram::values));
  num("engram_vocab_size", double(c.engram.engram_vocab_size));
  list("engram_num_embeddings", to_vec(Model::engram_num_embeddings));
  num("engram_max_ngram_size", c.engram.engram_max_ngram_size);
  num("engram_pad_id", c.engram.engram_pad_id);
  num("engram_compressed_vocab_size", c.engram.engram_compressed_vocab_size);
  num("engram_n_heads", c.engram.engram_n_heads);
  num("engram_head_dim", c.engram.engram_head_dim);
  str("dtype", dtypes[int(c.dtype)]);
  str("expert_dtype", dtypes[int(c.expert_dtype)]);
  std::vector<long long> ratios;
  for (int i = 0; i < sched::num_layers; ++i) ratios.push_back(sched::ratio(i));
  for (int s = 0; s < sched::drafter::stages; ++s) ratios.push_back(0);
  list("compress_ratios", ratios);
  num("vision_n_layers", c.vision.vision_n_layers);
  num("vision_dim", c.vision.vision_dim);
  num("vision_n_heads", c.vision.vision_n_heads);
  num("vision_inter_dim", c.vision.vision_inter_dim);
  num("vision_patch_size", c.vision.vision_patch_size);
  num("vision_downsample_ratio", c.vision.vision_downsample_ratio);
  num("vision_max_n_token", c.vision.vision_max_n_token);
  num("vision_min_pixels", double(c.vision.vision_min_pixels));
  num("vision_rope_theta", c.vision.vision_rope_theta);
  num("image_token_id", c.vision.image_token_id);
  num("dspark_block_size", c.dspark.dspark_block_size);
  num("dspark_noise_token_id", c.dspark.dspark_noise_token_id);
  list("dspark_target_layer_ids", to_vec(sched::drafter::targets::values));
  num("dspark_markov_rank", c.dspark.dspark_markov_rank);
  num("dspark_n_routed_experts", c.dspark.dspark_n_routed_experts);
  num("dspark_n_activated_experts", c.dspark.dspark_n_activated_experts);
  return problems;
}

namespace detail {
//! The shortest decimal that reads back as the same float (std::to_chars), so 1e-20f is written
//! as 1e-20, as the official file has it.
inline std::string json_float(float v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  if (r.ec != std::errc{}) throw error("json_float: to_chars failed");
  return std::string(buf, r.ptr);
}
template <class Range>
std::string json_list(const Range& values) {
  std::string s = "[";
  bool first = true;
  for (const auto& v : values) {
    s += (first ? "" : ", ") + std::to_string(static_cast<long long>(v));
    first = false;
  }
  return s + "]";
}
}  // namespace detail

//! The variant's inference/config.json: the official file's keys in its order (spec §1.1), the
//! schedule's lists from the schedule type, the widths from `Model::dims`. `vision_max_wh_ratio`
//! is written as null (the official value; dsv4 has no such field). Floats are written in their
//! shortest round-trip form, integers as integers.
template <class Model>
std::string config_json_text() {
  using sched = typename model_traits<Model>::schedule;
  constexpr model_config c = Model::dims;
  const char* dtypes[] = {"bf16", "fp8", "fp4"};
  const char* score_names[] = {"softmax", "sigmoid", "sqrtsoftplus"};
  std::vector<long long> ratios;
  for (int i = 0; i < sched::num_layers; ++i) ratios.push_back(sched::ratio(i));
  for (int s = 0; s < sched::drafter::stages; ++s) ratios.push_back(0);
  std::vector<std::pair<std::string, std::string>> kv;
  auto i = [&](const char* key, long long v) { kv.emplace_back(key, std::to_string(v)); };
  auto f = [&](const char* key, float v) { kv.emplace_back(key, detail::json_float(v)); };
  auto s = [&](const char* key, const std::string& v) { kv.emplace_back(key, "\"" + v + "\""); };
  auto l = [&](const char* key, const auto& v) { kv.emplace_back(key, detail::json_list(v)); };
  i("vocab_size", c.vocab_size);
  i("dim", c.dim);
  i("moe_inter_dim", c.moe.moe_inter_dim);
  i("n_layers", sched::num_layers);
  i("n_mtp_layers", sched::drafter::stages);
  i("dspark_block_size", c.dspark.dspark_block_size);
  i("dspark_noise_token_id", c.dspark.dspark_noise_token_id);
  l("dspark_target_layer_ids", sched::drafter::targets::values);
  i("dspark_markov_rank", c.dspark.dspark_markov_rank);
  i("dspark_n_routed_experts", c.dspark.dspark_n_routed_experts);
  i("dspark_n_activated_experts", c.dspark.dspark_n_activated_experts);
  i("n_heads", c.attn.n_heads);
  i("n_routed_experts", c.moe.n_routed_experts);
  i("n_shared_experts", c.moe.n_shared_experts);
  i("n_activated_experts", c.moe.n_activated_experts);
  s("score_func", score_names[int(c.moe.score)]);
  f("route_scale", c.moe.route_scale);
  f("swiglu_limit", c.moe.swiglu_limit);
  i("q_lora_rank", c.attn.q_lora_rank);
  i("head_dim", c.attn.head_dim);
  i("rope_head_dim", c.attn.rope_head_dim);
  f("norm_eps", c.norm_eps);
  i("o_groups", c.attn.o_groups);
  i("o_lora_rank", c.attn.o_lora_rank);
  i("window_size", c.attn.window_size);
  l("kv_source_layers", sched::owners);
  l("index_source_layers", sched::index_producers);
  i("original_seq_len", c.rope.original_seq_len);
  f("rope_theta", c.rope.rope_theta);
  f("rope_factor", c.rope.rope_factor);
  f("beta_fast", c.rope.beta_fast);
  f("beta_slow", c.rope.beta_slow);
  i("index_n_heads", c.indexer.index_n_heads);
  i("index_head_dim", c.indexer.index_head_dim);
  i("index_topk", c.indexer.index_topk);
  i("candidate_source_layer", sched::candidate_source);
  i("candidate_topk_blocks", c.indexer.candidate_topk_blocks);
  i("candidate_block_size", c.indexer.candidate_block_size);
  i("hc_mult", c.mhc.hc_mult);
  i("hc_sinkhorn_iters", c.mhc.hc_sinkhorn_iters);
  f("hc_eps", c.mhc.hc_eps);
  l("engram_layer_ids", sched::engram::values);
  i("engram_vocab_size", c.engram.engram_vocab_size);
  l("engram_num_embeddings", Model::engram_num_embeddings);
  i("engram_max_ngram_size", c.engram.engram_max_ngram_size);
  i("engram_pad_id", c.engram.engram_pad_id);
  i("engram_compressed_vocab_size", c.engram.engram_compressed_vocab_size);
  s("dtype", dtypes[int(c.dtype)]);
  s("expert_dtype", dtypes[int(c.expert_dtype)]);
  f("compress_rope_theta", c.rope.compress_rope_theta);
  l("compress_ratios", ratios);
  i("vision_n_layers", c.vision.vision_n_layers);
  i("vision_dim", c.vision.vision_dim);
  i("vision_n_heads", c.vision.vision_n_heads);
  i("vision_inter_dim", c.vision.vision_inter_dim);
  i("vision_patch_size", c.vision.vision_patch_size);
  i("vision_downsample_ratio", c.vision.vision_downsample_ratio);
  i("vision_max_n_token", c.vision.vision_max_n_token);
  i("vision_min_pixels", c.vision.vision_min_pixels);
  kv.emplace_back("vision_max_wh_ratio", "null");
  i("image_token_id", c.vision.image_token_id);
  i("engram_n_heads", c.engram.engram_n_heads);
  i("engram_head_dim", c.engram.engram_head_dim);
  f("vision_rope_theta", c.vision.vision_rope_theta);
  std::string out = "{\n";
  for (std::size_t k = 0; k < kv.size(); ++k)
    out += "    \"" + kv[k].first + "\": " + kv[k].second + (k + 1 < kv.size() ? ",\n" : "\n");
  return out + "}\n";
}

}  // namespace dsv4::models
