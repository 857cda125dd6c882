#pragma once
//! \file
//! The whole model on the host (spec §13 Transformer.forward, text tokens only), for variants
//! small enough to run this way (tiny): embedding, the four streams, Engram before its layers, the
//! blocks with single-pass mHC, the final collapse, norm and head (fp32 logits of the last
//! position). Prefill from position 0, then one-token decode steps, like the reference. The
//! DSpark stages, images and the CUDA backend are not part of this file.

#include <cstdint>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/checkpoint.hpp"
#include "dsv4/kernels/linear/reference.hpp"
#include "dsv4/kernels/mhc/reference.hpp"
#include "dsv4/kernels/norm/reference.hpp"
#include "dsv4/model/block_reference.hpp"
#include "dsv4/model/engram_weights.hpp"
#include "dsv4/schedule/index_keys.hpp"

namespace dsv4::model {

template <class Model>
struct host_model {
  using sched = typename models::model_traits<Model>::schedule;
  std::vector<float> embed, head, norm;  //!< [vocab, dim], [vocab, dim], [dim]
  std::vector<kernels::attention::layer_wiring> wiring;
  std::vector<block_weights> blocks;
  std::vector<std::vector<float>> freqs;
  std::vector<engram::engram_weights> engrams;  //!< one per Engram slot
  engram::hash_layout hashes;
  std::vector<std::int64_t> token_map;          //!< token id -> compressed id

  //! Reads every tensor the forward uses; `token_map` is the variant's compressed token map.
  static host_model load(io::checkpoint& ck, std::vector<std::int64_t> token_map) {
    constexpr models::model_config c = Model::dims;
    if (token_map.size() != std::size_t(c.vocab_size))
      throw error("host_model: the token map has " + std::to_string(token_map.size()) + " entries, the vocabulary " +
                  std::to_string(c.vocab_size));
    host_model m;
    m.embed = detail::floats(ck, "embed.weight", {c.vocab_size, c.dim});
    m.head = detail::floats(ck, "head.weight", {c.vocab_size, c.dim});
    m.norm = detail::floats(ck, "norm.weight", {c.dim});
    for (int l = 0; l < sched::num_layers; ++l) {
      m.wiring.push_back(attention_wiring<Model>(l));
      m.blocks.push_back(block_weights_of<Model>(ck, l));
      m.freqs.push_back(attention_rope_frequencies<Model>(l));
    }
    for (int j = 0; j < int(sched::engram::values.size()); ++j) m.engrams.push_back(engram_weights_of<Model>(ck, j));
    m.hashes = engram_hash_layout<Model>();
    m.token_map = std::move(token_map);
    return m;
  }
};

//! Everything one sequence keeps between calls.
struct host_sequence {
  kernels::attention::sequence_state attention;
  std::vector<std::vector<std::int64_t>> engram_history;  //!< per Engram slot
  long long length = 0;
  //! Whose index keys an index source scores against at a decode step (spec §7). dsv4 follows
  //! ownership; `upstream_quirk` reproduces the official reference's stale shared slot (at even
  //! decode positions the ratio-2 sources read the last refreshed source's keys, layer 20's for
  //! V4.1 and tiny), for parity runs against the reference only. It changes the selection once a
  //! ratio-2 source sees more groups than its top-k: positions above 1024 for V4.1, above 32 for
  //! tiny (top-k 16).
  schedule::index_key_policy index_keys = schedule::index_key_policy::follow_ownership;
};

//! Feeds `ids` (the prompt on the first call; later calls take one token or a chunk of several,
//! an appended turn, computed in exact mode: as if fed token by token) and returns the fp32 logits
//! of the last position.
template <class Model>
std::vector<float> forward(const host_model<Model>& m, host_sequence& seq, std::span<const std::int32_t> ids,
                           const layer_observer* observe = nullptr) {
  using sched = typename models::model_traits<Model>::schedule;
  constexpr models::model_config c = Model::dims;
  constexpr int hc = kernels::mhc::hc;
  static_assert(c.mhc.hc_mult == hc, "host forward: the mHC kernels are written for 4 streams");
  const std::size_t dim = std::size_t(c.dim), width = hc * dim, s = ids.size();
  if (s == 0) throw error("forward: no tokens");
  for (std::int32_t id : ids)
    if (id < 0 || id >= c.vocab_size)
      throw error("forward: token id " + std::to_string(id) + " outside the vocabulary of " + std::to_string(c.vocab_size));
  const long long start = seq.length;
  const bool quirk = seq.index_keys == schedule::index_key_policy::upstream_quirk && start > 0;
  if (quirk && s != 1) throw error("forward: the upstream index-key policy runs one token per decode call");

  // Engram hashes for every slot, once per forward (this also extends each slot's history).
  seq.engram_history.resize(m.engrams.size());
  std::vector<std::vector<std::int64_t>> hashes(m.engrams.size());
  for (std::size_t j = 0; j < m.engrams.size(); ++j) {
    const auto& mult = Model::engram_multipliers[j];
    const std::vector<std::int64_t> mv(mult.begin(), mult.end());
    hashes[j] = engram::hash_tokens(m.hashes, int(j), mv, ids, {}, m.token_map, c.engram.engram_pad_id,
                                    seq.engram_history[j], start);
  }
  // Embedding, repeated into the streams; the first pre-mix is one-hot on stream 0.
  std::vector<bf16> x(s * width);
  for (std::size_t t = 0; t < s; ++t)
    for (int r = 0; r < hc; ++r)
      for (std::size_t d = 0; d < dim; ++d)
        x[t * width + std::size_t(r) * dim + d] = bf16::from_float(m.embed[std::size_t(ids[t]) * dim + d]);
  std::vector<float> pre(s * hc, 0.0f);
  for (std::size_t t = 0; t < s; ++t) pre[t * hc] = 1.0f;
  constexpr auto shape = attention_shape<Model>();
  for (int l = 0; l < sched::num_layers; ++l) {
    for (std::size_t j = 0; j < m.engrams.size(); ++j)
      if (sched::engram::values[j] == l)
        for (std::size_t t = 0; t < s; ++t)
          engram::engram_forward_reference(m.engrams[j], std::span<bf16>(x).subspan(t * width, width),
                                           std::span<const std::int64_t>(hashes[j]).subspan(t * m.engrams[j].columns,
                                                                                            std::size_t(m.engrams[j].columns)),
                                           false);
    // upstream_quirk: for this call the source's own key cache holds the keys the reference's
    // shared slot holds (the first `rows` of the last refreshed source's), then its own again.
    struct restore_keys {
      std::vector<bf16>* keys = nullptr;
      std::vector<bf16> own;
      ~restore_keys() {
        if (keys) *keys = std::move(own);
      }
    } restore;
    if (quirk && (sched::role(l) == schedule::attn_role::full || sched::role(l) == schedule::attn_role::reindex)) {
      const int own = sched::kv_owner[std::size_t(l)];
      const auto src = schedule::decode_index_keys<sched>(l, start, seq.index_keys);
      if (src.owner != own) {
        const auto& from = seq.attention.owners.at(src.owner).keys;
        const std::size_t n = std::size_t(src.rows) * std::size_t(c.indexer.index_head_dim);
        if (from.size() < n)
          throw error("forward: layer " + std::to_string(src.owner) + " holds fewer index keys than layer " +
                      std::to_string(l) + " reads at position " + std::to_string(start));
        restore.keys = &seq.attention.owners.at(own).keys;
        restore.own = std::move(*restore.keys);
        restore.keys->assign(from.begin(), from.begin() + std::ptrdiff_t(n));
      }
    }
    x = block_forward_chunk(l, m.wiring[std::size_t(l)], m.blocks[std::size_t(l)], shape, m.freqs[std::size_t(l)], x, pre,
                            start, seq.attention, observe);
  }
  seq.length += (long long)s;
  // Final collapse of the last position, norm, fp32 head.
  float last_pre[hc];
  for (int r = 0; r < hc; ++r) last_pre[r] = pre[(s - 1) * hc + std::size_t(r)];
  const auto h = kernels::mhc::hc_pre(std::span<const bf16>(x).subspan((s - 1) * width, width), int(dim), last_pre);
  const auto hn = kernels::norm::rmsnorm_bf16_reference(h, m.norm, c.norm_eps);
  return kernels::linear::linear_fp32_reference(kernels::linear::widen(hn), m.head, c.vocab_size);
}

}  // namespace dsv4::model
