#pragma once
//! \file
//! Host reference of a whole CSA2 attention sublayer (spec §5, §6, §7) over one sequence, with
//! the state the reference keeps between calls: each layer's window ring, each KV owner's
//! compressed cache, index keys and compressor state, and the forward's shared slots (the last
//! index source's top-k lists and the candidate source's pool). Calls follow the reference: a
//! prefill from position 0, then one-token decode steps; layers are called in order. A chunk of
//! several tokens after the prefill (an appended turn) runs in exact mode: row by row, each row
//! as the decode step of its position would run it.
//!
//! Per call, with x the attention input (the attn_norm output) of the call's tokens:
//!   qr = q_norm(wq_a(x)); q = RoPE(wq_b(qr)); kv = QDQ_fp8(RoPE(kv_norm(wkv(x))))
//!   window operand: the chunk's kv (prefill) or the ring (decode), with the spec's index lists
//!   global branch (ratio > 0): a KV owner compresses x into index keys and main entries (RoPE
//!     at the group's first position, MXFP4 / FP4 QDQ); an index source scores its queries
//!     against its owner's index keys (the new keys included), the candidate source records its
//!     pool, a Reindex layer masks its scores with the pool, and the selection is published; a
//!     Reuse layer reads the published lists.
//! CED prefill (model_reference.hpp): the decoder's KV owner fills its cache from the encoder
//! output over the whole prompt (layer_call::owner_cache_only), then the decoder layers replay
//! only the last `window` prompt positions (layer_call::replay): their window starts at the replay
//! start, so a query at i sees local positions [max(s, i - window + 1), i] (spec §15).
//!   o = sparse_attn(q, window ++ compressed, sink, lists, head_dim^-0.5); out = output path.
//! The reference's stale-index-key quirk at even decode positions (spec §7) is not reproduced:
//! each index source reads its own owner's keys (dsv4's default policy).

#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/attention/reference.hpp"
#include "dsv4/kernels/compressor/reference.hpp"
#include "dsv4/kernels/gemm/reference.hpp"
#include "dsv4/kernels/indexer/reference.hpp"
#include "dsv4/kernels/linear/reference.hpp"
#include "dsv4/kernels/norm/reference.hpp"
#include "dsv4/kernels/output/reference.hpp"
#include "dsv4/kernels/rope/rope.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.hpp"
#include "dsv4/schedule/layer.hpp"

namespace dsv4::kernels::attention {

using numerics::bf16;

//! An FP8 linear layer in the checkpoint layout: weight [n, k] E4M3, scales [ceil(n/32), k/32].
struct fp8_linear {
  int n = 0, k = 0;
  std::vector<std::uint8_t> codes, scales;
  //! One row: act_quant (E4M3, UE8M0 per 32), then the block-scaled GEMM; bf16 out.
  std::vector<bf16> operator()(std::span<const bf16> x) const {
    if (x.size() != std::size_t(k)) throw error("fp8_linear: input has " + std::to_string(x.size()) + " values, expected " + std::to_string(k));
    return gemm::block_scaled_linear_reference(x, n, codes, scales, false);
  }
};

struct layer_shape {
  int dim = 0, heads = 0, head_dim = 0, rope_dim = 0, q_lora = 0, groups = 0, o_lora = 0, window = 0;
  int index_heads = 0, index_dim = 0, topk = 0, pool_blocks = 0, pool_block = 0;
  float norm_eps = 1e-20f;
};

//! The layer's place in the schedule (from model_schedule: role, ratio, kv_owner, topk_source).
struct layer_wiring {
  schedule::attn_role role = schedule::attn_role::local;
  int ratio = 0;
  int kv_owner = -1;
  bool candidate_source = false;
};

struct layer_weights {
  fp8_linear wq_a, wq_b, wkv, wo_b;
  std::vector<float> q_norm, kv_norm, wo_a, attn_sink;  //!< wo_a: [groups, o_lora, heads / groups * head_dim]
  compressor::compressor_weights compressor;            //!< KV owners (Full layers)
  compressor::index_key_weights index_key;              //!< KV owners
  fp8_linear idx_wq_b;                                  //!< index sources (Full, Reindex)
  std::vector<float> weights_proj;                      //!< [index_heads, dim], index sources
};

struct owner_cache {
  std::vector<bf16> main;  //!< [entries, head_dim]: RoPE'd, FP4 QDQ'd latents (the reference's bf16 cache)
  std::vector<bf16> keys;  //!< [entries, index_dim]: RoPE'd, MXFP4 QDQ'd index keys
  std::optional<compressor::compressor_state> state;
};

struct sequence_state {
  std::map<int, owner_cache> owners;
  std::map<int, std::vector<bf16>> rings;  //!< [window, head_dim] per layer, zero-initialised
  std::vector<std::int32_t> topk;          //!< published lists [rows, topk_width]
  int topk_width = 0;
  std::vector<std::uint8_t> candidates;    //!< the candidate source's pool [rows, candidates_width]
  int candidates_width = 0;
  //! A chunk after the prefill runs row by row (exact mode); the lists its sources publish are
  //! kept per row, since their widths grow with the position.
  struct row_lists {
    std::vector<std::int32_t> topk;
    int topk_width = 0;
    std::vector<std::uint8_t> candidates;
    int candidates_width = 0;
  };
  std::vector<row_lists> chunk_rows;
};

//! What a call computes.
enum class layer_call {
  normal,            //!< a prefill from 0, one decode token, or an appended chunk (exact mode)
  owner_cache_only,  //!< CED: a KV owner compresses x into its cache (main entries, index keys); no attention
  replay,            //!< CED: rows from start_pos as a prefill whose window starts there; owners do not compress
};

namespace detail {
//! A KV owner compresses the call's rows into its cache: latents, then the index key (from the
//! pre-RoPE latent) and the main entry of each, at its group's first position.
inline void compress_into(const layer_wiring& wr, const layer_weights& w, const layer_shape& sh, std::span<const float> freqs,
                          std::span<const bf16> x, long long start_pos, owner_cache& oc) {
  const int s = int(x.size() / std::size_t(sh.dim)), hd = sh.head_dim;
  if (!oc.state) oc.state.emplace(w.compressor);
  std::vector<std::vector<bf16>> latents;
  std::vector<long long> latent_pos;
  if (start_pos == 0) {
    const auto all = compressor::compress_prefill(w.compressor, x, s, *oc.state);
    for (int g = 0; g < s / wr.ratio; ++g) {
      latents.emplace_back(all.begin() + std::ptrdiff_t(g) * hd, all.begin() + std::ptrdiff_t(g + 1) * hd);
      latent_pos.push_back(1LL * g * wr.ratio);
    }
  } else {
    for (int i = 0; i < s; ++i)
      if (auto l = compressor::compress_decode(w.compressor, x.subspan(std::size_t(i) * sh.dim, std::size_t(sh.dim)),
                                               start_pos + i, *oc.state)) {
        latents.push_back(std::move(*l));
        latent_pos.push_back(start_pos + i + 1 - wr.ratio);
      }
  }
  for (std::size_t g = 0; g < latents.size(); ++g) {
    auto key = compressor::index_key_of(latents[g], w.index_key, freqs, latent_pos[g]);
    numerics::qdq_vector<numerics::index_key_format>(key);
    oc.keys.insert(oc.keys.end(), key.begin(), key.end());
    const std::int64_t pos[1] = {latent_pos[g]};
    auto m = latents[g];
    rope::apply_rope_reference(m, hd, 1, pos, freqs, false);
    numerics::qdq_vector<numerics::main_kv_format>(m);
    oc.main.insert(oc.main.end(), m.begin(), m.end());
  }
}
}  // namespace detail

//! Where a tensor-parallel rank (parallel/tensor_parallel_reference.hpp) joins the other ranks
//! inside the layer, as model.py places its collectives; empty members are one rank's identity.
struct layer_collectives {
  //! The index scores of all rows, [s, width] bf16 values held in fp32, of the rank's index heads,
  //! before any mask or selection reads them: made the sum over every rank's heads.
  std::function<void(std::vector<float>&)> sum_index_scores;
  //! The sublayer output [s, dim] from the rank's wo_b columns: made the sum over the ranks.
  std::function<std::vector<bf16>(const std::vector<bf16>&)> sum_output;
};

//! One call of layer `layer` over x [s, dim] at positions start_pos .. start_pos + s - 1: a
//! prefill (start_pos == 0), a decode step (s == 1) or an appended chunk; or, for the CED
//! prefill, an owner filling its cache or a replay (see layer_call). Returns the sublayer output
//! [s, dim] (nothing for owner_cache_only). `coll`: a tensor-parallel rank's collectives (null:
//! the whole model on one rank).
inline std::vector<bf16> attention_layer_reference(int layer, const layer_wiring& wr, const layer_weights& w,
                                                   const layer_shape& sh, std::span<const float> freqs,
                                                   std::span<const bf16> x, long long start_pos, sequence_state& st,
                                                   layer_call call = layer_call::normal,
                                                   const layer_collectives* coll = nullptr) {
  using schedule::attn_role;
  const std::string where = "attention_layer_reference (layer " + std::to_string(layer) + "): ";
  if (x.size() % std::size_t(sh.dim) || x.empty()) throw error(where + "x must be [s, dim] with s >= 1");
  if (start_pos < 0) throw error(where + "negative start position");
  const int s = int(x.size() / std::size_t(sh.dim));
  if (call == layer_call::owner_cache_only) {
    if (wr.role != attn_role::full) throw error(where + "only a KV owner (a Full layer) fills a cache on its own");
    if (start_pos == 0) st.owners[layer] = owner_cache{};
    auto found = st.owners.find(layer);
    if (found == st.owners.end()) throw error(where + "no cache to extend: the owner has not run from position 0");
    detail::compress_into(wr, w, sh, freqs, x, start_pos, found->second);
    return {};
  }
  // The window operand is the call's own rows for a prefill and a replay, the ring otherwise.
  const bool prefill = start_pos == 0 || call == layer_call::replay;
  if (!prefill && s > 1) {
    // Exact mode for a chunk appended after the prefill (a tool result, a new turn): every row as
    // the decode step of its position would compute it. Each row sees the lists that this
    // chunk's sources published for the same row.
    const bool source = wr.role == schedule::attn_role::full || wr.role == schedule::attn_role::reindex;
    if (source) st.chunk_rows.resize(std::size_t(s));
    if (st.chunk_rows.size() != std::size_t(s) && wr.ratio > 0)
      throw error(where + "the chunk's index source did not run over the same rows");
    std::vector<bf16> out;
    out.reserve(x.size());
    for (int i = 0; i < s; ++i) {
      sequence_state::row_lists* rl = wr.ratio > 0 ? &st.chunk_rows[std::size_t(i)] : nullptr;
      if (rl && wr.role != schedule::attn_role::full) {  // a consumer: this row's lists
        st.topk = rl->topk, st.topk_width = rl->topk_width;
        st.candidates = rl->candidates, st.candidates_width = rl->candidates_width;
      }
      const auto o = attention_layer_reference(layer, wr, w, sh, freqs, x.subspan(std::size_t(i) * sh.dim, std::size_t(sh.dim)),
                                               start_pos + i, st, layer_call::normal, coll);
      out.insert(out.end(), o.begin(), o.end());
      if (source) {
        rl->topk = st.topk, rl->topk_width = st.topk_width;
        if (wr.candidate_source) rl->candidates = st.candidates, rl->candidates_width = st.candidates_width;
      }
    }
    return out;
  }
  const int hd = sh.head_dim;
  auto row = [&](int i) { return x.subspan(std::size_t(i) * sh.dim, std::size_t(sh.dim)); };

  // Queries and the window KV, token by token.
  std::vector<std::vector<bf16>> qr(static_cast<std::size_t>(s));
  std::vector<bf16> q, kv;
  for (int i = 0; i < s; ++i) {
    const std::int64_t pos[1] = {start_pos + i};
    qr[std::size_t(i)] = norm::rmsnorm_bf16_reference(w.wq_a(row(i)), w.q_norm, sh.norm_eps);
    auto qi = w.wq_b(qr[std::size_t(i)]);
    rope::apply_rope_reference(qi, hd, sh.heads, pos, freqs, false);
    q.insert(q.end(), qi.begin(), qi.end());
    auto ki = norm::rmsnorm_bf16_reference(w.wkv(row(i)), w.kv_norm, sh.norm_eps);
    rope::apply_rope_reference(ki, hd, 1, pos, freqs, false);
    numerics::qdq_vector<numerics::fp8_act_format>(ki);  // RoPE first, then the FP8 QDQ
    kv.insert(kv.end(), ki.begin(), ki.end());
  }

  // Window operand and lists.
  auto& ring = st.rings[layer];
  if (ring.empty()) ring.assign(std::size_t(sh.window) * hd, bf16::from_float(0.0f));
  std::vector<bf16> operand;
  std::vector<std::vector<std::int32_t>> lists(static_cast<std::size_t>(s));
  if (prefill) {
    operand = kv;
    const int width = std::min(s, sh.window);
    for (int i = 0; i < s; ++i)
      for (int j = 0; j < width; ++j) {
        const int e = std::max(i - sh.window + 1, 0) + j;
        lists[std::size_t(i)].push_back(e > i ? -1 : e);
      }
    for (int p = std::max(0, s - sh.window); p < s; ++p)  // the last positions seed the ring
      std::copy(kv.begin() + std::ptrdiff_t(p) * hd, kv.begin() + std::ptrdiff_t(p + 1) * hd,
                ring.begin() + std::ptrdiff_t((start_pos + p) % sh.window) * hd);
  } else {
    const int slot = int(start_pos % sh.window);
    std::copy(kv.begin(), kv.end(), ring.begin() + std::ptrdiff_t(slot) * hd);
    operand = ring;
    for (int j = 1; j <= sh.window; ++j) {  // oldest first: slot + 1 .. window - 1, then 0 .. slot
      const int e = (slot + j) % sh.window;
      lists[0].push_back(e > start_pos ? -1 : e);
    }
  }
  const int offset = int(operand.size() / std::size_t(hd));

  // Global branch.
  if (wr.ratio > 0) {
    if (wr.kv_owner < 0) throw error(where + "a compressed layer needs a KV owner");
    const bool owner = wr.role == attn_role::full, source = owner || wr.role == attn_role::reindex;
    if (owner && start_pos == 0 && call == layer_call::normal) st.owners[layer] = owner_cache{};
    auto found = st.owners.find(wr.kv_owner);
    if (found == st.owners.end()) throw error(where + "its KV owner " + std::to_string(wr.kv_owner) + " has not run");
    owner_cache& oc = found->second;
    const long long compress_len = (start_pos + s) / wr.ratio;
    // A replay's owner filled its cache beforehand (owner_cache_only); the indexer reads only keys
    // and the attention only main entries, so writing both now changes nothing for either.
    if (owner && call == layer_call::normal) detail::compress_into(wr, w, sh, freqs, x, start_pos, oc);
    if (oc.main.size() < std::size_t(compress_len) * hd || oc.keys.size() < std::size_t(compress_len) * sh.index_dim)
      throw error(where + "its KV owner's cache holds fewer than the " + std::to_string(compress_len) + " entries this call needs");
    if (source) {
      const int width = int(compress_len);
      st.topk.clear();
      st.topk_width = std::min(sh.topk, width);
      if (wr.candidate_source) st.candidates.clear(), st.candidates_width = width;
      // Every row's scores first (a tensor-parallel rank sums them over the ranks' index heads
      // before anything reads them; model.py skips the indexer, and that sum, when width is 0).
      std::vector<float> all_scores;
      for (int i = 0; i < s && width > 0; ++i) {
        const long long visible = (start_pos + i + 1) / wr.ratio;
        const std::int64_t pos[1] = {start_pos + i};
        auto qi = w.idx_wq_b(qr[std::size_t(i)]);
        rope::apply_rope_reference(qi, sh.index_dim, sh.index_heads, pos, freqs, false);
        numerics::qdq_vector<numerics::index_key_format>(qi);
        const auto wp = linear::linear_bf16_reference(linear::widen(row(i)), w.weights_proj, sh.index_heads);
        std::vector<bf16> wscaled(wp.size());
        for (std::size_t h = 0; h < wp.size(); ++h) wscaled[h] = bf16::from_float(wp[h].to_float() * 0x1p-6f);
        const auto scores = indexer::index_scores_reference(
            qi, wscaled, std::span<const bf16>(oc.keys).subspan(0, std::size_t(width) * sh.index_dim), sh.index_heads,
            sh.index_dim, visible);
        all_scores.insert(all_scores.end(), scores.begin(), scores.end());
      }
      if (width > 0 && coll && coll->sum_index_scores) coll->sum_index_scores(all_scores);
      for (int i = 0; i < s && width > 0; ++i) {
        const long long visible = (start_pos + i + 1) / wr.ratio;
        const std::span<float> scores(all_scores.data() + std::size_t(i) * width, std::size_t(width));
        if (wr.candidate_source) {
          const auto mask = indexer::candidate_mask_reference(scores, visible, sh.pool_blocks, sh.pool_block);
          st.candidates.insert(st.candidates.end(), mask.begin(), mask.end());
        }
        if (wr.role == attn_role::reindex) {
          if (st.candidates_width != width || st.candidates.size() != std::size_t(s) * width)
            throw error(where + "the candidate pool does not match this layer's rows");
          indexer::apply_candidate_mask(scores, std::span<const std::uint8_t>(st.candidates).subspan(std::size_t(i) * width, width));
        }
        const auto sel = indexer::select_reference(scores, sh.topk, visible, offset);
        st.topk.insert(st.topk.end(), sel.begin(), sel.end());
      }
    }
    if (st.topk.size() != std::size_t(s) * st.topk_width) throw error(where + "no top-k lists for these rows");
    for (int i = 0; i < s; ++i)
      lists[std::size_t(i)].insert(lists[std::size_t(i)].end(), st.topk.begin() + std::ptrdiff_t(i) * st.topk_width,
                                   st.topk.begin() + std::ptrdiff_t(i + 1) * st.topk_width);
    operand.insert(operand.end(), oc.main.begin(), oc.main.begin() + std::ptrdiff_t(compress_len) * hd);
  }

  // One softmax over window + selected entries, with the sink; then the output path.
  const int list_width = int(lists[0].size());
  std::vector<std::int32_t> idx;
  for (const auto& l : lists) idx.insert(idx.end(), l.begin(), l.end());
  std::vector<bf16> o(q.size());
  sparse_attention_reference({s, sh.heads, hd, int(operand.size() / std::size_t(hd)), list_width, float(std::pow(double(hd), -0.5))},
                             q, operand, w.attn_sink, idx, o);
  const output::output_shape os{sh.heads, hd, sh.groups, sh.o_lora, sh.dim};
  std::vector<bf16> out;
  for (int i = 0; i < s; ++i) {
    const auto oi = output::attention_output_reference(os, std::span<const bf16>(o).subspan(std::size_t(i) * sh.heads * hd, std::size_t(sh.heads) * hd),
                                                       start_pos + i, freqs, w.wo_a, w.wo_b.codes, w.wo_b.scales);
    out.insert(out.end(), oi.begin(), oi.end());
  }
  if (coll && coll->sum_output) return coll->sum_output(out);
  return out;
}

}  // namespace dsv4::kernels::attention
