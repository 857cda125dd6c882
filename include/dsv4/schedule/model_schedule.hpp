#pragma once
//! \file
//! The layer schedule as a type (spec §2), and the facts every other part derives from it:
//! which layer owns each global cache, whose top-k each layer reads, the candidate source, the
//! index producers, the encoder/decoder split, Engram positions and DSpark stages.
//!
//! Wiring rule (as the reference's SharedAttentionRuntime does it, made explicit): a Reuse or
//! Reindex layer reads the cache of the most recent Full layer, and a Reuse layer reads the top-k
//! of the most recent index producer (Full or Reindex). The checks below make sure that rule
//! never pairs a layer with memory of another ratio or from the other half of the CED split,
//! which is the failure the article warns about ("plausible-looking output while attending to
//! the wrong history").
//!
//! Example (V4.1 Flash):
//! \code
//! using layers = layer_list<run{2, swa}, run{1, full<2>}, run{5, reuse<2>}, ...>;
//! using sched  = model_schedule<layers, 20, at<1, 14>, dspark<3, at<37, 38, 39>>>;
//! static_assert(sched::candidate_source == 20);
//! \endcode

#include <array>
#include <cstddef>

#include "dsv4/schedule/layer.hpp"

namespace dsv4::schedule {

//! A compile-time list of layer ids (Engram positions, DSpark capture layers).
template <int... Ids>
struct at {
  static constexpr int size = int(sizeof...(Ids));
  static constexpr std::array<int, sizeof...(Ids)> values{Ids...};
};

//! DSpark drafter: `Stages` extra local-attention blocks that read the residual entering each
//! layer of `Targets` (spec §13-14). dspark<0, at<>> means no drafter.
template <int Stages, class Targets>
struct dspark {
  static_assert(Stages >= 0, "dspark<Stages,Targets>: Stages must be >= 0");
  static constexpr int stages = Stages;
  using targets = Targets;
};
using no_dspark = dspark<0, at<>>;

//! The backbone's layers, run-length encoded: one `run{count, kind}` per stretch of equal layers.
template <run... Runs>
struct layer_list {
  static_assert(((Runs.count > 0) && ...), "layer_list<run...>: every run needs a positive count");
  static constexpr int size = (Runs.count + ... + 0);
  static_assert(size > 0, "layer_list<run...>: a model needs at least one layer");
  static constexpr std::array<layer, std::size_t(size)> expand() {
    std::array<layer, std::size_t(size)> out{};
    std::size_t i = 0;
    for (run r : {Runs...})
      for (int k = 0; k < r.count; ++k) out[i++] = r.kind;
    return out;
  }
  static constexpr std::array<layer, std::size_t(size)> layers = expand();
};

namespace detail {

template <std::size_t N>
using layer_array = std::array<layer, N>;

template <std::size_t N>
constexpr int first_role_ratio_mismatch(const layer_array<N>& l) {
  for (std::size_t i = 0; i < N; ++i) {
    const bool ok = l[i].role == attn_role::local ? l[i].ratio == 0 : is_supported_ratio(l[i].ratio);
    if (!ok) return int(i);
  }
  return -1;
}

//! Most recent Full layer at or before i, or -1.
template <std::size_t N>
constexpr int latest_owner(const layer_array<N>& l, int i) {
  for (int j = i; j >= 0; --j)
    if (l[std::size_t(j)].role == attn_role::full) return j;
  return -1;
}

//! Most recent index producer (Full or Reindex) at or before i, or -1.
template <std::size_t N>
constexpr int latest_index_producer(const layer_array<N>& l, int i) {
  for (int j = i; j >= 0; --j)
    if (l[std::size_t(j)].produces_topk()) return j;
  return -1;
}

constexpr bool same_half(int a, int b, int encoder_layers) {
  return (a < encoder_layers) == (b < encoder_layers);
}

enum class consumer_fault { none, no_owner, crosses_boundary, ratio_mismatch };

template <std::size_t N>
constexpr consumer_fault consumer_check(const layer_array<N>& l, int i, int encoder_layers) {
  const int o = latest_owner(l, i);
  if (o < 0) return consumer_fault::no_owner;
  if (!same_half(o, i, encoder_layers)) return consumer_fault::crosses_boundary;
  if (l[std::size_t(o)].ratio != l[std::size_t(i)].ratio) return consumer_fault::ratio_mismatch;
  return consumer_fault::none;
}

template <std::size_t N>
constexpr int first_consumer_fault(const layer_array<N>& l, int encoder_layers, attn_role role,
                                   consumer_fault fault) {
  for (std::size_t i = 0; i < N; ++i)
    if (l[i].role == role && consumer_check(l, int(i), encoder_layers) == fault) return int(i);
  return -1;
}

//! First Reindex layer whose owner differs from the first Reindex layer's owner, or -1.
template <std::size_t N>
constexpr int first_second_pool(const layer_array<N>& l) {
  int pool = -1;
  for (std::size_t i = 0; i < N; ++i) {
    if (l[i].role != attn_role::reindex) continue;
    const int o = latest_owner(l, int(i));
    if (pool < 0) pool = o;
    else if (o != pool) return int(i);
  }
  return -1;
}

template <std::size_t K>
constexpr bool ascending_ids_below(const std::array<int, K>& ids, int limit) {
  for (std::size_t i = 0; i < K; ++i) {
    if (ids[i] < 0 || ids[i] >= limit) return false;
    if (i > 0 && ids[i] <= ids[i - 1]) return false;
  }
  return true;
}

//! The ids of the layers for which `Pred` holds (a member predicate of `layer`).
template <class Layers, bool (layer::*Pred)() const>
constexpr auto select_layers() {
  constexpr auto& l = Layers::layers;
  constexpr int count = [] {
    int c = 0;
    for (const layer& x : Layers::layers) c += (x.*Pred)() ? 1 : 0;
    return c;
  }();
  std::array<int, std::size_t(count)> out{};
  std::size_t k = 0;
  for (std::size_t i = 0; i < l.size(); ++i)
    if ((l[i].*Pred)()) out[k++] = int(i);
  return out;
}

template <class Layers>
constexpr auto owner_table() {
  constexpr auto& l = Layers::layers;
  std::array<int, l.size()> out{};
  for (std::size_t i = 0; i < l.size(); ++i) out[i] = l[i].reads_global_kv() ? latest_owner(l, int(i)) : -1;
  return out;
}

template <class Layers>
constexpr auto topk_table() {
  constexpr auto& l = Layers::layers;
  std::array<int, l.size()> out{};
  for (std::size_t i = 0; i < l.size(); ++i)
    out[i] = l[i].reads_global_kv() ? latest_index_producer(l, int(i)) : -1;
  return out;
}

template <std::size_t N>
constexpr int candidate_source_of(const layer_array<N>& l) {
  for (std::size_t i = 0; i < N; ++i)
    if (l[i].role == attn_role::reindex) return latest_owner(l, int(i));
  return -1;
}

}  // namespace detail

//! Each template below fails with its message when the schedule breaks that rule; its argument is
//! the first offending layer (compilers print it in the instantiation note).
namespace diagnose {
template <int Layer>
struct layer_role_and_ratio {
  static_assert(Layer < 0,
                "model_schedule: a local (SWA) layer must have ratio 0, and a Full, Reuse or Reindex "
                "layer a supported compression ratio (1 or 2); see the instantiation note for the "
                "layer index");
};
template <int Layer>
struct reuse_needs_owner {
  static_assert(Layer < 0,
                "model_schedule: a Reuse layer needs an earlier Full layer that owns the global KV "
                "it reads; put a Full layer of the same ratio before it");
};
template <int Layer>
struct reindex_needs_candidate_source {
  static_assert(Layer < 0,
                "model_schedule: a Reindex layer needs a candidate source before it: an earlier "
                "Full layer of the same ratio whose candidate pool it selects in");
};
template <int Layer>
struct consumer_crosses_boundary {
  static_assert(Layer < 0,
                "model_schedule: a Reuse or Reindex layer would read a KV owner from the other "
                "half of the encoder/decoder split; the first compressed layer of each half must "
                "be Full");
};
template <int Layer>
struct consumer_ratio_mismatch {
  static_assert(Layer < 0,
                "model_schedule: a Reuse or Reindex layer must have the same compression ratio as "
                "the Full layer that owns the cache it reads; change its ratio or add a Full layer "
                "of its ratio before it");
};
template <int Layer>
struct one_candidate_pool {
  static_assert(Layer < 0,
                "model_schedule: all Reindex layers select inside one candidate pool, built by one "
                "Full layer; this Reindex layer follows a different Full layer");
};
template <bool Ok>
struct encoder_split {
  static_assert(Ok, "model_schedule<Layers,E,...>: the encoder size E must be in [0, number of layers]");
};
template <bool Ok>
struct engram_layers {
  static_assert(Ok, "model_schedule: Engram layer ids must be ascending, unique and below the number "
                    "of layers");
};
template <bool Ok>
struct dspark_targets {
  static_assert(Ok, "model_schedule: DSpark target layer ids must be ascending, unique and below the "
                    "number of layers, and a drafter with stages needs at least one target");
};
}  // namespace diagnose

template <class Layers, int EncoderLayers, class Engram = at<>, class DSpark = no_dspark>
struct model_schedule {
  static constexpr int num_layers = Layers::size;
  static constexpr auto layers = Layers::layers;
  static constexpr int encoder_layers = EncoderLayers;
  static constexpr int decoder_layers = num_layers - EncoderLayers;
  using engram = Engram;
  using drafter = DSpark;

 private:
  // Preconditions, in the order a reader would check them. Each names the first bad layer.
  static constexpr bool checked_ =
      sizeof(diagnose::encoder_split<(EncoderLayers >= 0 && EncoderLayers <= Layers::size)>) &&
      sizeof(diagnose::layer_role_and_ratio<detail::first_role_ratio_mismatch(layers)>) &&
      sizeof(diagnose::reuse_needs_owner<detail::first_consumer_fault(
          layers, EncoderLayers, attn_role::reuse, detail::consumer_fault::no_owner)>) &&
      sizeof(diagnose::reindex_needs_candidate_source<detail::first_consumer_fault(
          layers, EncoderLayers, attn_role::reindex, detail::consumer_fault::no_owner)>) &&
      sizeof(diagnose::consumer_crosses_boundary<detail::first_consumer_fault(
          layers, EncoderLayers, attn_role::reuse, detail::consumer_fault::crosses_boundary)>) &&
      sizeof(diagnose::consumer_crosses_boundary<detail::first_consumer_fault(
          layers, EncoderLayers, attn_role::reindex, detail::consumer_fault::crosses_boundary)>) &&
      sizeof(diagnose::consumer_ratio_mismatch<detail::first_consumer_fault(
          layers, EncoderLayers, attn_role::reuse, detail::consumer_fault::ratio_mismatch)>) &&
      sizeof(diagnose::consumer_ratio_mismatch<detail::first_consumer_fault(
          layers, EncoderLayers, attn_role::reindex, detail::consumer_fault::ratio_mismatch)>) &&
      sizeof(diagnose::one_candidate_pool<detail::first_second_pool(layers)>) &&
      sizeof(diagnose::engram_layers<detail::ascending_ids_below(Engram::values, Layers::size)>) &&
      sizeof(diagnose::dspark_targets<detail::ascending_ids_below(DSpark::targets::values,
                                                                  Layers::size) &&
                                      (DSpark::stages == 0 || DSpark::targets::size > 0)>);
  static_assert(checked_);

 public:
  //! Layer whose global cache layer i reads (itself for Full), or -1 for local layers.
  static constexpr std::array<int, std::size_t(num_layers)> kv_owner = detail::owner_table<Layers>();
  //! Layer whose top-k selection layer i attends with (itself for Full/Reindex), or -1.
  static constexpr std::array<int, std::size_t(num_layers)> topk_source = detail::topk_table<Layers>();
  //! The Full layers: each owns one compressed KV cache and one index-key cache.
  static constexpr auto owners = detail::select_layers<Layers, &layer::owns_global_kv>();
  //! The layers that run an indexer (Full and Reindex).
  static constexpr auto index_producers = detail::select_layers<Layers, &layer::produces_topk>();
  //! The Full layer that builds the candidate pool for the Reindex layers, or -1 if none.
  static constexpr int candidate_source = detail::candidate_source_of(layers);

  static constexpr bool in_encoder(int i) { return i < encoder_layers; }
  static constexpr int ratio(int i) { return layers[std::size_t(i)].ratio; }
  static constexpr attn_role role(int i) { return layers[std::size_t(i)].role; }
  static constexpr bool has_engram(int i) {
    for (int e : Engram::values)
      if (e == i) return true;
    return false;
  }
};

}  // namespace dsv4::schedule
