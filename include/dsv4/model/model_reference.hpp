#pragma once
//! \file
//! The whole model on the host (spec §13 Transformer.forward, text tokens only), for variants
//! small enough to run this way (tiny): embedding, the four streams, Engram before its layers, the
//! blocks with single-pass mHC, the final collapse, norm and head (fp32 logits of the last
//! position). Prefill from position 0, then one-token decode steps, like the reference. On
//! request a forward also returns `main_hidden`, the residual entering each DSpark target layer
//! (spec §13), which the DSpark stages read (dspark_reference.hpp). Images and the CUDA backend
//! are not part of this file.

#include <cstdint>
#include <future>
#include <string>
#include <utility>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/checkpoint.hpp"
#include "dsv4/kernels/linear/reference.hpp"
#include "dsv4/kernels/mhc/reference.hpp"
#include "dsv4/kernels/norm/reference.hpp"
#include "dsv4/model/block_reference.hpp"
#include "dsv4/model/engram_weights.hpp"
#include "dsv4/runtime/prepare_ahead.hpp"
#include "dsv4/schedule/index_keys.hpp"

namespace dsv4::model {

namespace detail {
//! Appends layer l's weights, wiring and RoPE table to a model's per-layer lists (host_model's and
//! parallel::rank_model's loads, in layer order).
template <class Model, class Loaded>
void append_layer(Loaded& m, int l, block_weights b) {
  m.wiring.push_back(attention_wiring<Model>(l));
  m.blocks.push_back(std::move(b));
  m.freqs.push_back(attention_rope_frequencies<Model>(l));
}
}  // namespace detail

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
  //! `tables`: engram_tables::mapped reads the Engram tables in place (`ck` must then outlive
  //! the model).
  static host_model load(io::checkpoint& ck, std::vector<std::int64_t> token_map,
                         engram_tables tables = engram_tables::copied) {
    constexpr models::model_config c = Model::dims;
    if (token_map.size() != std::size_t(c.vocab_size))
      throw error("host_model: the token map has " + std::to_string(token_map.size()) + " entries, the vocabulary " +
                  std::to_string(c.vocab_size));
    host_model m;
    // The embedding and the head (the largest tensors) are read on threads of their own beside
    // the layers' workers (checkpoint::tensor is thread-safe).
    auto embed = std::async(std::launch::async, [&] {
      return detail::floats(ck, "embed.weight", {c.vocab_size, c.dim});
    });
    auto head = std::async(std::launch::async, [&] {
      return detail::floats(ck, "head.weight", {c.vocab_size, c.dim});
    });
    m.norm = detail::floats(ck, "norm.weight", {c.dim});
    // The layers read on worker threads (checkpoint::tensor is thread-safe), kept in order.
    runtime::prepare_ahead(
        sched::num_layers, runtime::prepare_threads(), [&](int l) { return block_weights_of<Model>(ck, l); },
        [&](int l, block_weights b) { detail::append_layer<Model>(m, l, std::move(b)); });
    m.embed = embed.get(), m.head = head.get();
    for (int j = 0; j < int(sched::engram::values.size()); ++j) m.engrams.push_back(engram_weights_of<Model>(ck, j, 1, tables));
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
  //! The last `window` positions' encoder output (the streams entering the first decoder layer,
  //! after any Engram there) and their pre-mix: what a CED append replays the decoder from. Every
  //! forward keeps it, [rows, hc * dim] and [rows, hc].
  std::vector<bf16> encoder_tail;
  std::vector<float> encoder_tail_pre;
};

//! Feeds `ids` (the prompt on the first call; later calls take one token or a chunk of several,
//! an appended turn, computed in exact mode: as if fed token by token) and returns the fp32 logits
//! of the last position.
namespace detail {
//! What every forward starts from: the ids checked, each Engram slot's hash ids (extending the
//! slot's history), the embedding repeated into the streams, and the first pre-mix (one-hot on
//! stream 0).
struct forward_start {
  std::vector<std::vector<std::int64_t>> hashes;  //!< per Engram slot, [s, columns]
  std::vector<bf16> x;                            //!< [s, hc, dim]
  std::vector<float> pre;                         //!< [s, hc]
};
template <class Model>
forward_start start_forward(const host_model<Model>& m, host_sequence& seq, std::span<const std::int32_t> ids) {
  constexpr models::model_config c = Model::dims;
  constexpr int hc = kernels::mhc::hc;
  static_assert(c.mhc.hc_mult == hc, "host forward: the mHC kernels are written for 4 streams");
  const std::size_t dim = std::size_t(c.dim), width = hc * dim, s = ids.size();
  if (s == 0) throw error("forward: no tokens");
  for (std::int32_t id : ids)
    if (id < 0 || id >= c.vocab_size)
      throw error("forward: token id " + std::to_string(id) + " outside the vocabulary of " + std::to_string(c.vocab_size));
  forward_start f;
  seq.engram_history.resize(m.engrams.size());
  f.hashes.resize(m.engrams.size());
  for (std::size_t j = 0; j < m.engrams.size(); ++j) {
    const auto& mult = Model::engram_multipliers[j];
    const std::vector<std::int64_t> mv(mult.begin(), mult.end());
    f.hashes[j] = engram::hash_tokens(m.hashes, int(j), mv, ids, {}, m.token_map, c.engram.engram_pad_id,
                                      seq.engram_history[j], seq.length);
  }
  f.x.resize(s * width);
  for (std::size_t t = 0; t < s; ++t)
    for (int r = 0; r < hc; ++r)
      for (std::size_t d = 0; d < dim; ++d)
        f.x[t * width + std::size_t(r) * dim + d] = bf16::from_float(m.embed[std::size_t(ids[t]) * dim + d]);
  f.pre.assign(s * hc, 0.0f);
  for (std::size_t t = 0; t < s; ++t) f.pre[t * hc] = 1.0f;
  return f;
}

//! The Engram modules placed before layer `layer`, on streams x [rows, hc, dim] whose first row is
//! row `first` of the call (its hash ids).
template <class Model>
void engram_before(const host_model<Model>& m, int layer, std::vector<bf16>& x, const forward_start& f, std::size_t first) {
  using sched = typename models::model_traits<Model>::schedule;
  const std::size_t width = std::size_t(kernels::mhc::hc) * std::size_t(Model::dims.dim), rows = x.size() / width;
  for (std::size_t j = 0; j < m.engrams.size(); ++j)
    if (sched::engram::values[j] == layer)
      for (std::size_t t = 0; t < rows; ++t)
        engram::engram_forward_reference(m.engrams[j], std::span<bf16>(x).subspan(t * width, width),
                                         std::span<const std::int64_t>(f.hashes[j]).subspan((first + t) * m.engrams[j].columns,
                                                                                          std::size_t(m.engrams[j].columns)),
                                         false);
}

//! Spec §13: the residual entering DSpark target layer `layer` (after any Engram before it), per
//! row: bf16(fp32 sum of the 4 streams x 0.25), written to that target's slot of `capture` [rows,
//! targets * dim]; rows of x from `first` on. The reference's torch.mean leaves the order of its
//! four fp32 additions to the framework (spec §18.10); this sums in stream order, which differs
//! from any other order only when a partial sum is inexact in fp32.
template <class Model>
void capture_main_hidden(int layer, std::span<const bf16> x, std::size_t first, std::vector<bf16>& capture) {
  using targets = typename models::model_traits<Model>::schedule::drafter::targets;
  constexpr int hc = kernels::mhc::hc;
  const std::size_t dim = std::size_t(Model::dims.dim), width = hc * dim, rows = x.size() / width - first;
  const std::size_t stride = std::size_t(targets::size) * dim;
  for (std::size_t j = 0; j < targets::values.size(); ++j) {
    if (targets::values[j] != layer) continue;
    capture.resize(rows * stride);
    for (std::size_t t = 0; t < rows; ++t)
      for (std::size_t d = 0; d < dim; ++d) {
        float sum = 0.0f;
        for (int r = 0; r < hc; ++r) sum += x[(first + t) * width + std::size_t(r) * dim + d].to_float();
        capture[t * stride + j * dim + d] = bf16::from_float(sum * 0.25f);
      }
  }
}

//! Appends a call's encoder output rows to the sequence's tail and keeps the last `window` rows.
template <class Model>
void push_encoder_tail(host_sequence& seq, const std::vector<bf16>& x, const std::vector<float>& pre) {
  constexpr int hc = kernels::mhc::hc;
  const std::size_t width = std::size_t(hc) * std::size_t(Model::dims.dim);
  const std::size_t keep = std::size_t(attention_shape<Model>().window);
  seq.encoder_tail.insert(seq.encoder_tail.end(), x.begin(), x.end());
  seq.encoder_tail_pre.insert(seq.encoder_tail_pre.end(), pre.begin(), pre.end());
  const std::size_t rows = seq.encoder_tail.size() / width;
  if (rows > keep) {
    seq.encoder_tail.erase(seq.encoder_tail.begin(), seq.encoder_tail.begin() + std::ptrdiff_t((rows - keep) * width));
    seq.encoder_tail_pre.erase(seq.encoder_tail_pre.begin(), seq.encoder_tail_pre.begin() + std::ptrdiff_t((rows - keep) * hc));
  }
}

//! Final collapse of the last row with its pre-mix, norm, fp32 head.
template <class Model>
std::vector<float> last_logits(const host_model<Model>& m, const std::vector<bf16>& x, const std::vector<float>& pre) {
  constexpr models::model_config c = Model::dims;
  constexpr int hc = kernels::mhc::hc;
  const std::size_t dim = std::size_t(c.dim), width = hc * dim, s = x.size() / width;
  float last_pre[hc];
  for (int r = 0; r < hc; ++r) last_pre[r] = pre[(s - 1) * hc + std::size_t(r)];
  const auto h = kernels::mhc::hc_pre(std::span<const bf16>(x).subspan((s - 1) * width, width), int(dim), last_pre);
  const auto hn = kernels::norm::rmsnorm_bf16_reference(h, m.norm, c.norm_eps);
  return kernels::linear::linear_fp32_reference(kernels::linear::widen(hn), m.head, c.vocab_size);
}
}  // namespace detail

//! `main_hidden`, if given, receives the DSpark stages' input over the call's rows, [s, targets *
//! dim] bf16: the residual entering each target layer (spec §13), in the schedule's target order.
template <class Model>
std::vector<float> forward(const host_model<Model>& m, host_sequence& seq, std::span<const std::int32_t> ids,
                           const layer_observer* observe = nullptr, std::vector<bf16>* main_hidden = nullptr) {
  using sched = typename models::model_traits<Model>::schedule;
  constexpr models::model_config c = Model::dims;
  const std::size_t s = ids.size();
  const long long start = seq.length;
  const bool quirk = seq.index_keys == schedule::index_key_policy::upstream_quirk && start > 0;
  if (quirk && s != 1) throw error("forward: the upstream index-key policy runs one token per decode call");
  detail::forward_start f = detail::start_forward(m, seq, ids);
  std::vector<bf16>& x = f.x;
  std::vector<float>& pre = f.pre;
  constexpr auto shape = attention_shape<Model>();
  if (main_hidden) main_hidden->clear();
  for (int l = 0; l < sched::num_layers; ++l) {
    detail::engram_before(m, l, x, f, 0);
    if (l == sched::encoder_layers) detail::push_encoder_tail<Model>(seq, x, pre);
    if (main_hidden) detail::capture_main_hidden<Model>(l, x, 0, *main_hidden);
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
  return detail::last_logits(m, x, pre);
}

//! True when a schedule allows the CED prefill: every decoder KV owner is the first decoder layer,
//! whose compressor reads the encoder output (so its cache can be built for the whole prompt
//! without running the decoder over it).
template <class Sched>
constexpr bool ced_prefill_possible() {
  for (int o : Sched::owners)
    if (o > Sched::encoder_layers) return false;
  return Sched::encoder_layers < Sched::num_layers;
}

//! The CED prefill (issue 6; the article's production path, spec §15): the encoder layers over
//! every prompt token; the decoder's KV owner (the first decoder layer) fills its global cache from
//! the encoder output over every token; the decoder layers over the last `window` tokens only, as
//! a replay whose local windows start at the replay start (a query at i sees
//! [max(s, i - window + 1), i]). On a sequence that already holds tokens, the call is a CED append
//! (a tool result, a new turn): the encoder runs over the chunk (exact mode, as forward appends),
//! the owner's cache grows by the chunk, and the decoder replays the last `window` positions of
//! the whole sequence from the encoder outputs every forward keeps (host_sequence::encoder_tail).
//! An approximation by design: while the sequence fits the window it equals the exact prefill bit
//! for bit; beyond it the decoder's local state differs. Decoding continues with `forward`.
//! Returns the last position's logits. `main_hidden`, if given, receives the DSpark input of the
//! replayed rows only (the last min(length, window) positions, [rows, targets * dim]): the DSpark
//! prefill needs no more, since its rings hold the last `window` positions.
template <class Model>
std::vector<float> forward_ced(const host_model<Model>& m, host_sequence& seq, std::span<const std::int32_t> ids,
                               const layer_observer* observe = nullptr, std::vector<bf16>* main_hidden = nullptr) {
  using sched = typename models::model_traits<Model>::schedule;
  static_assert(ced_prefill_possible<sched>(),
                "forward_ced: the CED prefill needs every decoder KV owner to be the first decoder layer (its "
                "compressor reads the encoder output) and at least one decoder layer");
  constexpr int E = sched::encoder_layers, hc = kernels::mhc::hc;
  constexpr models::model_config c = Model::dims;
  constexpr auto shape = attention_shape<Model>();
  const long long start = seq.length;
  const std::size_t dim = std::size_t(c.dim), width = hc * dim;
  if (start > 0 && seq.encoder_tail.size() / width != std::size_t(std::min<long long>(start, shape.window)))
    throw error("forward_ced: the sequence does not hold the encoder output of its last positions (it was not built by forward "
                "or forward_ced)");
  if (start > 0 && seq.index_keys == schedule::index_key_policy::upstream_quirk)
    throw error("forward_ced: the upstream index-key policy runs one token per decode call");
  if (main_hidden && start > 0)
    for (int t : sched::drafter::targets::values)
      if (t < E) throw error("forward_ced: a CED append cannot give the DSpark input of an encoder layer");
  detail::forward_start f = detail::start_forward(m, seq, ids);
  const std::size_t s = ids.size();
  const std::size_t first = s > std::size_t(shape.window) ? s - std::size_t(shape.window) : 0;  // (prefill: replayed rows of the call)
  if (main_hidden) main_hidden->clear();
  for (int l = 0; l < E; ++l) {
    detail::engram_before(m, l, f.x, f, 0);
    if (main_hidden) detail::capture_main_hidden<Model>(l, f.x, first, *main_hidden);
    f.x = block_forward_chunk(l, m.wiring[std::size_t(l)], m.blocks[std::size_t(l)], shape, m.freqs[std::size_t(l)], f.x, f.pre,
                              start, seq.attention, observe);
  }
  detail::engram_before(m, E, f.x, f, 0);  // (an Engram module before the first decoder layer sees every token)
  if (sched::role(E) == schedule::attn_role::full) {
    // The owner's input over the call's tokens: attn_norm(hc_pre(encoder output, pre-mix)).
    std::vector<bf16> h;
    for (std::size_t t = 0; t < s; ++t) {
      float pm[hc];
      for (int r = 0; r < hc; ++r) pm[r] = f.pre[t * hc + std::size_t(r)];
      const auto in = kernels::norm::rmsnorm_bf16_reference(
          kernels::mhc::hc_pre(std::span<const bf16>(f.x).subspan(t * width, width), int(dim), pm), m.blocks[std::size_t(E)].attn_norm,
          shape.norm_eps);
      h.insert(h.end(), in.begin(), in.end());
    }
    kernels::attention::attention_layer_reference(E, m.wiring[std::size_t(E)], m.blocks[std::size_t(E)].attn, shape,
                                                  m.freqs[std::size_t(E)], h, start, seq.attention,
                                                  kernels::attention::layer_call::owner_cache_only);
  }
  // Decoder replay over the sequence's last `window` positions, from their encoder outputs.
  detail::push_encoder_tail<Model>(seq, f.x, f.pre);
  std::vector<bf16> x = seq.encoder_tail;
  std::vector<float> pre = seq.encoder_tail_pre;
  const long long rows = (long long)(x.size() / width), replay_from = start + (long long)s - rows;
  for (int l = E; l < sched::num_layers; ++l) {
    if (l > E) {
      if (replay_from < start)
        for (int t : sched::engram::values)
          if (t == l) throw error("forward_ced: a CED append cannot replay an Engram module in the decoder over earlier tokens");
      detail::engram_before(m, l, x, f, std::size_t(replay_from - start));
    }
    if (main_hidden) detail::capture_main_hidden<Model>(l, x, 0, *main_hidden);
    x = block_forward_chunk(l, m.wiring[std::size_t(l)], m.blocks[std::size_t(l)], shape, m.freqs[std::size_t(l)], x, pre,
                            replay_from, seq.attention, observe, kernels::attention::layer_call::replay);
  }
  seq.length = start + (long long)s;
  return detail::last_logits(m, x, pre);
}

}  // namespace dsv4::model
