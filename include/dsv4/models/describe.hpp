#pragma once
//! \file
//! A run-time description of a model variant, derived entirely from its types, and the
//! `dsv4 info` report printed from it. Nothing here is typed in by hand: change the schedule or
//! the formats and the report follows.

#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

#include "dsv4/cache/paged_cache.hpp"
#include "dsv4/schedule/prefill_work.hpp"
#include "dsv4/models/model_traits.hpp"

namespace dsv4::models {

struct layer_description {
  int index = 0;
  bool encoder = false;
  schedule::attn_role role = schedule::attn_role::local;
  int ratio = 0;
  int kv_owner = -1;
  int topk_source = -1;
  bool engram = false;           //!< an Engram module runs on the residual entering this layer
  bool dspark_capture = false;   //!< DSpark reads the residual entering this layer
  bool candidate_source = false;
};

struct model_description {
  std::string name, title;
  int num_layers = 0, encoder_layers = 0, dspark_stages = 0;
  std::vector<layer_description> layers;
  std::vector<int> owners, index_producers, engram_layers, dspark_targets;
  int candidate_source = -1;
  model_config dims{};
  int main_entry_bytes = 0, index_entry_bytes = 0, local_entry_bytes = 0;
  int main_block = 0, index_block = 0, local_block = 0;
  std::string main_elem, main_scale, index_elem, index_scale, local_elem, local_scale;
  bytes_per_token global_main{}, global_index{}, global_total{};
  long long local_window_bytes_per_layer = 0;
  int window_layers = 0;
  long long work_exact_1m = 0, work_ced_1m = 0;  //!< prefill layer-tokens for a 1M-token prompt
  int page_tokens = 0;       //!< tokens per page of the paged global cache
  long long page_bytes = 0;  //!< bytes per page (page_tokens x global bytes per token)
};

template <class Model>
model_description describe() {
  using traits = model_traits<Model>;
  using sched = typename traits::schedule;
  model_description d;
  d.name = Model::name;
  d.title = Model::title;
  d.num_layers = sched::num_layers;
  d.encoder_layers = sched::encoder_layers;
  d.dspark_stages = sched::drafter::stages;
  d.candidate_source = sched::candidate_source;
  d.owners.assign(sched::owners.begin(), sched::owners.end());
  d.index_producers.assign(sched::index_producers.begin(), sched::index_producers.end());
  d.engram_layers.assign(sched::engram::values.begin(), sched::engram::values.end());
  d.dspark_targets.assign(sched::drafter::targets::values.begin(), sched::drafter::targets::values.end());
  for (int i = 0; i < sched::num_layers; ++i) {
    layer_description l;
    l.index = i;
    l.encoder = sched::in_encoder(i);
    l.role = sched::role(i);
    l.ratio = sched::ratio(i);
    l.kv_owner = sched::kv_owner[std::size_t(i)];
    l.topk_source = sched::topk_source[std::size_t(i)];
    l.engram = sched::has_engram(i);
    for (int t : d.dspark_targets) l.dspark_capture |= (t == i);
    l.candidate_source = (i == sched::candidate_source);
    d.layers.push_back(l);
  }
  d.dims = Model::dims;
  d.main_entry_bytes = traits::main_entry_bytes;
  d.index_entry_bytes = traits::index_entry_bytes;
  d.local_entry_bytes = traits::local_entry_bytes;
  d.main_block = traits::main_kv_format::block_size;
  d.index_block = traits::index_key_format::block_size;
  d.local_block = traits::local_kv_format::block_size;
  using numerics::minifloat_name;
  d.main_elem = minifloat_name<typename traits::main_kv_format::element>;
  d.main_scale = minifloat_name<typename traits::main_kv_format::scale>;
  d.index_elem = minifloat_name<typename traits::index_key_format::element>;
  d.index_scale = minifloat_name<typename traits::index_key_format::scale>;
  d.local_elem = minifloat_name<typename traits::local_kv_format::element>;
  d.local_scale = minifloat_name<typename traits::local_kv_format::scale>;
  d.global_main = traits::global_main_per_token;
  d.global_index = traits::global_index_per_token;
  d.global_total = traits::global_kv_per_token;
  d.local_window_bytes_per_layer = traits::local_window_bytes_per_layer;
  d.window_layers = traits::window_layers;
  constexpr long long million = 1000000;
  d.work_exact_1m = schedule::prefill_layer_tokens<sched>(million, schedule::prefill_mode::exact, Model::dims.attn.window_size).total();
  d.work_ced_1m = schedule::prefill_layer_tokens<sched>(million, schedule::prefill_mode::ced, Model::dims.attn.window_size).total();
  using pages = cache::page_geometry<Model>;
  d.page_tokens = pages::page_tokens;
  d.page_bytes = pages::page_bytes;
  return d;
}

namespace detail {
inline std::string join(const std::vector<int>& v, const char* sep = ", ") {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
  return s.empty() ? "none" : s;
}
inline std::string show(bytes_per_token b) {
  if (b.is_integer()) return std::to_string(b.num / b.den);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f", b.value());
  return buf;
}
inline std::string idx(int i) { return i < 0 ? "-" : std::to_string(i); }
}  // namespace detail

//! The `dsv4 info` report: the layer table and the cache accounting per token.
inline void print_info(std::ostream& os, const model_description& d) {
  using detail::idx;
  const auto& a = d.dims.attn;
  os << d.title << " (--config " << d.name << ")\n"
     << "layers: " << d.num_layers << " (encoder 0-" << d.encoder_layers - 1 << ", decoder "
     << d.encoder_layers << "-" << d.num_layers - 1 << ")"
     << ", DSpark stages: " << d.dspark_stages << " reading layers " << detail::join(d.dspark_targets)
     << ", Engram before layers " << detail::join(d.engram_layers) << "\n"
     << "width " << d.dims.dim << ", " << a.n_heads << " heads x " << a.head_dim << " (RoPE "
     << a.rope_head_dim << "), window " << a.window_size << ", top-k " << d.dims.indexer.index_topk
     << ", experts " << d.dims.moe.n_routed_experts << " (top-" << d.dims.moe.n_activated_experts
     << ")\n\n";

  char line[160];
  std::snprintf(line, sizeof line, "%5s  %-7s  %-7s  %5s  %8s  %10s  %s\n", "layer", "half", "role",
                "ratio", "kv owner", "top-k from", "notes");
  os << line;
  for (const auto& l : d.layers) {
    std::string notes;
    if (l.engram) notes += "engram ";
    if (l.candidate_source) notes += "candidate-source ";
    if (l.role == schedule::attn_role::reindex) notes += "selects-in-pool-of-" + std::to_string(d.candidate_source) + " ";
    if (l.dspark_capture) notes += "dspark-capture ";
    std::snprintf(line, sizeof line, "%5d  %-7s  %-7s  %5d  %8s  %10s  %s\n", l.index,
                  l.encoder ? "encoder" : "decoder", schedule::role_name(l.role), l.ratio,
                  idx(l.kv_owner).c_str(), idx(l.topk_source).c_str(), notes.c_str());
    os << line;
  }
  const auto& ix = d.dims.indexer;
  os << "\nglobal KV owners: " << detail::join(d.owners) << "\n"
     << "index producers: " << detail::join(d.index_producers) << "\n"
     << "candidate source: " << idx(d.candidate_source);
  if (d.candidate_source >= 0)
    os << " (pool of " << ix.candidate_topk_blocks << " blocks x " << ix.candidate_block_size
       << " = " << ix.pool_capacity() << " candidates)";
  os << "\n\ncache bytes per token\n"
     << "  global entry: " << d.main_entry_bytes << " + " << d.index_entry_bytes << " = "
     << d.main_entry_bytes + d.index_entry_bytes << " bytes (main KV " << a.head_dim
     << " x " << d.main_elem << " + " << a.head_dim / d.main_block << " x " << d.main_scale
     << " scales; index key " << ix.index_head_dim << " x " << d.index_elem << " + "
     << ix.index_head_dim / d.index_block << " x " << d.index_scale << " scales)\n";
  for (int o : d.owners) {
    const int r = d.layers[std::size_t(o)].ratio;
    os << "  owner " << o << " (ratio " << r << "): " << d.main_entry_bytes + d.index_entry_bytes
       << " / " << r << " = "
       << detail::show(bytes_per_token{d.main_entry_bytes + d.index_entry_bytes, r} + bytes_per_token{0, 1})
       << " bytes per token\n";
  }
  os << "  global KV: " << detail::show(d.global_total) << " bytes per token (main "
     << detail::show(d.global_main) << " + index keys " << detail::show(d.global_index) << ")\n"
     << "  local window: " << d.local_entry_bytes << " bytes per position per layer (" << a.head_dim
     << " x " << d.local_elem << " + " << a.head_dim / d.local_block << " x " << d.local_scale
     << " scales), ring of " << a.window_size
     << " = " << d.local_window_bytes_per_layer << " bytes per layer per sequence, "
     << d.window_layers << " rings (" << d.num_layers << " layers + " << d.dspark_stages
     << " DSpark) = " << d.local_window_bytes_per_layer * d.window_layers << " bytes per sequence\n"
     << "  paged global cache: pages of " << d.page_tokens << " tokens = " << d.page_bytes
     << " bytes (all owners' entries, no padding)\n";
  char ratio[32];
  std::snprintf(ratio, sizeof ratio, "%.6f", double(d.work_ced_1m) / double(d.work_exact_1m));
  os << "prefill work for a 1,000,000-token prompt (layer-tokens): exact " << d.work_exact_1m << ", CED "
     << d.work_ced_1m << " (encoder over every token, decoder replay over the last " << d.dims.attn.window_size
     << "): " << ratio << " of exact\n";
}

}  // namespace dsv4::models
