#pragma once
//! \file
//! Binds a checkpoint's Engram tensors (spec §10, §16) to the host Engram module of one Engram
//! slot of a variant (slot j = the j-th layer of the schedule's Engram list), with the hash
//! layout and multipliers the module needs. Errors name the tensor and the file.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsv4/engram/hash.hpp"
#include "dsv4/engram/reference.hpp"
#include "dsv4/model/attention_weights.hpp"

namespace dsv4::model {

//! How an Engram module's embedding table is held: `copied` into the weights' own vectors, or
//! `mapped`: read in place from the checkpoint (for a file, its memory mapping: V4.1's tables
//! are ~100 GB each; the rows a call needs are paged in on first use). With `mapped` the
//! checkpoint must outlive the weights (and any host or device model built from them).
enum class engram_tables { copied, mapped };

//! The Engram module of slot `slot`, read from `ck`. `world` > 1: a tensor-parallel rank's
//! shard, whose table holds ceil(rows / world) rows (ParallelEngramEmbedding's part).
template <class Model>
engram::engram_weights engram_weights_of(io::checkpoint& ck, int slot, int world = 1,
                                         engram_tables tables = engram_tables::copied) {
  using sched = typename models::model_traits<Model>::schedule;
  constexpr models::model_config c = Model::dims;
  if (slot < 0 || slot >= int(sched::engram::values.size()))
    throw error("engram_weights_of: slot " + std::to_string(slot) + " outside [0, " +
                std::to_string(sched::engram::values.size()) + ") of " + Model::name);
  const std::string p = "layers." + std::to_string(sched::engram::values[std::size_t(slot)]) + ".engram.";
  engram::engram_weights w;
  w.hc = c.mhc.hc_mult;
  w.dim = c.dim;
  w.head_dim = c.engram.engram_head_dim;
  w.columns = (c.engram.engram_max_ngram_size - 1) * c.engram.engram_n_heads;
  w.rows = (Model::engram_num_embeddings[std::size_t(slot)] + world - 1) / world;
  w.eps = c.norm_eps;
  if (tables == engram_tables::mapped) {
    w.mapped_embed = detail::bytes_view(ck, p + "embed.weight", {w.rows, w.head_dim}, io::st_dtype::F8_E4M3);
    w.mapped_embed_scale = detail::bytes_view(ck, p + "embed.scale", {w.rows, w.head_dim / 32}, io::st_dtype::F8_E8M0);
  } else {
    w.embed = detail::bytes(ck, p + "embed.weight", {w.rows, w.head_dim}, io::st_dtype::F8_E4M3);
    w.embed_scale = detail::bytes(ck, p + "embed.scale", {w.rows, w.head_dim / 32}, io::st_dtype::F8_E8M0);
  }
  auto wkv = detail::fp8(ck, p + "wkv", w.dim * (w.hc + 1), w.columns * w.head_dim);
  w.wkv = std::move(wkv.codes);
  w.wkv_scale = std::move(wkv.scales);
  w.q_weight = detail::floats(ck, p + "q_weight", {w.hc, w.dim});
  w.k_weight = detail::floats(ck, p + "k_weight", {w.hc, w.dim});
  w.check();
  return w;
}

//! The hash layout of every Engram slot of the variant (primes and offsets, spec §10).
template <class Model>
engram::hash_layout engram_hash_layout() {
  using sched = typename models::model_traits<Model>::schedule;
  constexpr models::model_config c = Model::dims;
  return engram::hash_layout::make(int(sched::engram::values.size()), c.engram.engram_vocab_size,
                                   c.engram.engram_max_ngram_size, c.engram.engram_n_heads);
}

}  // namespace dsv4::model
