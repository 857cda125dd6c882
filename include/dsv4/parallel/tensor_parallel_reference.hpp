#pragma once
// clang-format off
//! \file
//! Tensor parallelism simulated on the host (issue 7): W ranks of the host reference model
//! (model/model_reference.hpp), each a thread holding only its own checkpoint shard
//! (parallel/shard_checkpoint.hpp) and computing what the official model.py computes on its rank
//! when world_size = W; the collectives model.py calls are simulated in memory.
//!
//! Per rank, as model.py (read, not copied) lays it out:
//!
//! | step | the rank computes | collective (dtype) |
//! |---|---|---|
//! | ParallelEmbedding | its vocab rows, zero rows for other ids | all_reduce (bf16) |
//! | ParallelEngramEmbedding | its table rows, dequantized to bf16, zero for other ids | all_reduce (bf16) |
//! | Engram wkv, gate, update | replicated | - |
//! | mHC, norms, wq_a, wkv, compressor, index keys | replicated (each rank its own caches) | - |
//! | wq_b, attn_sink (ColumnParallelLinear) | its n_heads / W heads: queries, sparse attention | - |
//! | indexer wq_b, weights_proj | its index_n_heads / W heads; bf16(sum over its heads) | all_reduce of index_score (bf16), then masks and top-k on every rank |
//! | wo_a (grouped, ColumnParallelLinear) | its o_groups / W groups | - |
//! | wo_b (RowParallelLinear) | its columns: a bf16 partial (the FP8 GEMM's output) | all_reduce (fp32 of the bf16 partials), then one rounding to bf16 |
//! | MoE | gate replicated; its experts [r n/W, (r+1) n/W) in ascending id into an fp32 buffer | all_reduce (fp32); then + shared expert (replicated), one rounding |
//! | ParallelHead | fp32 logits of its vocab rows | all_gather (concatenated in rank order) |
//!
//! Simulated collectives. A sum adds the ranks' values in rank order, 0, 1, ..., W - 1: fp32 sums
//! in fp32; bf16 sums round to bf16 after each addition (as a bf16 reduction does, one step per
//! added rank). NCCL's ring and tree algorithms add in another order in general (and it may differ
//! between elements, message sizes and runs), so a real W-GPU run matches this simulation bit for
//! bit only where the order cannot matter: the embeddings (one nonzero term), the head (a
//! gather), and any sum of two terms. At W = 1 every collective is the identity and the simulation
//! equals the one-process host model bit for bit (tested). At W > 1 the model changes its rounding
//! where model.py does (spec §4 "Tensor parallelism changes the rounding"): wo_b's bf16 partials,
//! the MoE's fp32 partials, the indexer's bf16 partial scores, so logits agree with W = 1 only to
//! a tolerance (measured in tests/parallel/test_tensor_parallel.cpp and docs/parallel.md).
//!
//! Scope: prefill from position 0, one-token decode steps (what model.py's Transformer.forward
//! runs) and chunks appended after them in exact mode (each row as its decode step would compute
//! it, as model::forward does), text tokens; the CED prefill, the DSpark drafter and the upstream
//! index-key quirk stay with the one-process host model. Every rank checks its own
//! inputs; a rank that fails makes the others fail at their next collective (no deadlock).
// clang-format on

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/checkpoint.hpp"
#include "dsv4/kernels/attention/layer_reference.hpp"
#include "dsv4/kernels/linear/reference.hpp"
#include "dsv4/kernels/mhc/reference.hpp"
#include "dsv4/kernels/moe/reference.hpp"
#include "dsv4/kernels/norm/reference.hpp"
#include "dsv4/model/model_reference.hpp"
#include "dsv4/models/checkpoint_schema.hpp"
#include "dsv4/parallel/host_communicator.hpp"
#include "dsv4/parallel/shard_checkpoint.hpp"
#include "dsv4/parallel/sharding.hpp"
#include "dsv4/runtime/prepare_ahead.hpp"

namespace dsv4::parallel {

using numerics::bf16;

// ------------------------------------------------------------------------------------------------
// A rank's model
// ------------------------------------------------------------------------------------------------

//! The widths a rank's attention computes with: n_heads / W heads, o_groups / W groups,
//! index_n_heads / W index heads; everything else as the model's.
template <class Model>
constexpr kernels::attention::layer_shape rank_attention_shape(int world) {
  kernels::attention::layer_shape s = model::attention_shape<Model>();
  s.heads /= world;
  s.groups /= world;
  s.index_heads /= world;
  return s;
}

//! Throws a dsv4::error naming every dimension that `world` does not divide (sharding.hpp's
//! divisibility checks).
template <class Model>
void check_world_size(int world) {
  if (world < 1)
    throw error(std::string("tensor parallel: world size ") + std::to_string(world) +
                " is not a positive number of ranks");
  const auto bad = world_size_violations<Model>(world);
  if (bad.empty()) return;
  std::string why;
  for (const auto& b : bad) why += (why.empty() ? "" : "; ") + b;
  throw error(std::string("tensor parallel: ") + Model::name + " does not split over world size " +
              std::to_string(world) + ": " + why);
}

//! Rank `rank` of `world`: the tensors of its checkpoint shard, in the host model's layout
//! (model::host_model), with the local widths.
template <class Model>
struct rank_model {
  using sched = typename models::model_traits<Model>::schedule;
  int world = 1, rank = 0;
  std::vector<float> embed, head, norm;  //!< [vocab / W, dim], [vocab / W, dim], [dim]
  std::vector<kernels::attention::layer_wiring> wiring;
  std::vector<model::block_weights> blocks;  //!< routed experts: the rank's n / W, from index 0
  std::vector<std::vector<float>> freqs;
  std::vector<engram::engram_weights> engrams;  //!< the rank's ceil(rows / W) table rows (padded)
  engram::hash_layout hashes;
  std::vector<std::int64_t> token_map;

  long long vocab_part() const { return Model::dims.vocab_size / world; }
  int experts_part() const { return Model::dims.moe.n_routed_experts / world; }

  //! Reads the rank's tensors from its shard `ck` (shard_checkpoint): every split tensor with its
  //! local shape, so a full tensor in the shard is an error naming it.
  static rank_model load(io::checkpoint& ck, std::vector<std::int64_t> token_map, int world, int rank) {
    constexpr models::model_config c = Model::dims;
    check_world_size<Model>(world);
    if (rank < 0 || rank >= world)
      throw error("tensor parallel: rank " + std::to_string(rank) + " is not in world size " +
                  std::to_string(world));
    if (token_map.size() != std::size_t(c.vocab_size))
      throw error("tensor parallel: the token map has " + std::to_string(token_map.size()) +
                  " entries, the vocabulary " + std::to_string(c.vocab_size));
    namespace d = model::detail;
    rank_model m;
    m.world = world, m.rank = rank;
    const long long vpart = c.vocab_size / world;
    m.embed = d::floats(ck, "embed.weight", {vpart, c.dim});
    m.head = d::floats(ck, "head.weight", {vpart, c.dim});
    m.norm = d::floats(ck, "norm.weight", {c.dim});
    const auto s = rank_attention_shape<Model>(world);
    // The layers read on worker threads (checkpoint::tensor is thread-safe), kept in order.
    runtime::prepare_ahead(
        sched::num_layers, runtime::prepare_threads(),
        [&](int l) {
          return model::block_weights_at<Model>(
              ck, "layers." + std::to_string(l) + ".", model::attention_weights<Model>(ck, l, s),
              c.moe.n_routed_experts, c.moe.n_activated_experts, rank * m.experts_part(), m.experts_part());
        },
        [&](int l, model::block_weights b) { model::detail::append_layer<Model>(m, l, std::move(b)); });
    for (int j = 0; j < int(sched::engram::values.size()); ++j)
      m.engrams.push_back(model::engram_weights_of<Model>(ck, j, world));
    m.hashes = model::engram_hash_layout<Model>();
    m.token_map = std::move(token_map);
    return m;
  }
};

//! W ranks' models, each loaded from its own shard of one full checkpoint.
template <class Model>
struct tp_model {
  std::vector<rank_model<Model>> ranks;
  int world() const { return int(ranks.size()); }

  //! Cuts `full` into W shards (shard_checkpoint) and loads each rank from its shard only.
  //! Throws a dsv4::error naming the dimension when `world` does not divide the model.
  static tp_model load(io::checkpoint& full, const std::vector<std::int64_t>& token_map, int world) {
    check_world_size<Model>(world);
    const auto schema = models::checkpoint_schema<Model>();
    tp_model m;
    for (int r = 0; r < world; ++r) {
      io::checkpoint shard = shard_checkpoint(full, schema, world, r, Model::dims);
      m.ranks.push_back(rank_model<Model>::load(shard, token_map, world, r));
    }
    return m;
  }
};

//! One sequence on W ranks: each rank's own caches and Engram history (replicated state, the
//! same bits on every rank) and the length.
struct tp_sequence {
  std::vector<model::host_sequence> ranks;
  long long length = 0;
};

// ------------------------------------------------------------------------------------------------
// A rank's forward
// ------------------------------------------------------------------------------------------------

namespace detail {

//! What a rank's forward needs besides its model and state.
struct rank_context {
  int world = 1, rank = 0;
  host_communicator* comm = nullptr;
};

//! bf16 partial sums of the ranks -> their fp32 sum rounded once to bf16 (RowParallelLinear:
//! y.float(), all_reduce, type_as(x)).
inline std::vector<bf16> row_parallel_sum(const rank_context& ctx, const std::vector<bf16>& partial) {
  std::vector<float> y = kernels::linear::widen(partial);
  ctx.comm->all_reduce_fp32(ctx.rank, y);
  std::vector<bf16> out(y.size());
  for (std::size_t i = 0; i < y.size(); ++i) out[i] = bf16::from_float(y[i]);
  return out;
}

//! A rank's attention sublayer over x [s, dim] (a prefill from 0 or one decode token): the
//! host reference's normal call (kernels/attention/layer_reference.hpp) with the rank's heads,
//! index heads and groups (`sh` from rank_attention_shape), its collectives where model.py places
//! them: the index scores all-reduced before the masks and the top-k, the output the all-reduced
//! wo_b partials.
inline std::vector<bf16> attention_rank(const rank_context& ctx, int layer,
                                        const kernels::attention::layer_wiring& wr,
                                        const kernels::attention::layer_weights& w,
                                        const kernels::attention::layer_shape& sh,
                                        std::span<const float> freqs, std::span<const bf16> x,
                                        long long start_pos, kernels::attention::sequence_state& st) {
  const std::string where = "tensor parallel attention (layer " + std::to_string(layer) + ", rank " +
                            std::to_string(ctx.rank) + "): ";
  if (x.size() % std::size_t(sh.dim) || x.empty()) throw error(where + "x must be [s, dim] with s >= 1");
  kernels::attention::layer_collectives coll;
  // Masked positions are -inf on every rank (model.py masks after the sum: the same).
  coll.sum_index_scores = [&](std::vector<float>& scores) { ctx.comm->all_reduce_bf16_values(ctx.rank, scores); };
  coll.sum_output = [&](const std::vector<bf16>& partial) { return row_parallel_sum(ctx, partial); };
  return kernels::attention::attention_layer_reference(layer, wr, w, sh, freqs, x, start_pos, st,
                                                       kernels::attention::layer_call::normal, &coll);
}

//! A rank's MoE over x [s, dim]: the replicated gate, the rank's experts in ascending id into an
//! fp32 buffer, the buffers all-reduced, then the replicated shared expert, one rounding
//! (moe_layer_reference's combination with the routed sum split over the ranks).
inline std::vector<bf16> moe_rank(const rank_context& ctx, const model::block_weights& w, int first_expert,
                                  std::span<const bf16> x) {
  namespace moe = kernels::moe;
  const std::size_t dim = std::size_t(w.gate.dim), tokens = x.size() / dim;
  const int held = int(w.experts.size());
  std::vector<float> routed(x.size(), 0.0f);
  std::vector<std::vector<bf16>> shared(tokens);
  for (std::size_t t = 0; t < tokens; ++t) {
    const auto xt = x.subspan(t * dim, dim);
    const moe::routing r = moe::route_reference(xt, w.gate);
    const auto [xq, xs] = moe::act_quant_reference(xt);
    std::vector<std::size_t> order(r.experts.size());
    for (std::size_t j = 0; j < order.size(); ++j) order[j] = j;
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return r.experts[a] < r.experts[b]; });
    for (std::size_t j : order) {
      const int e = r.experts[j] - first_expert;
      if (e < 0 || e >= held) continue;  // another rank's expert
      const auto y = moe::expert_reference(xq, xs, w.experts[std::size_t(e)], w.gate.dim, w.inter, true,
                                           r.weights[j], w.swiglu_limit);
      for (std::size_t d = 0; d < dim; ++d) routed[t * dim + d] += y[d].to_float();
    }
    shared[t] = moe::expert_reference(xq, xs, w.shared, w.gate.dim, w.inter, false, 1.0f, w.swiglu_limit);
  }
  ctx.comm->all_reduce_fp32(ctx.rank, routed);
  std::vector<bf16> out(x.size());
  for (std::size_t t = 0; t < tokens; ++t)
    for (std::size_t d = 0; d < dim; ++d)
      out[t * dim + d] = bf16::from_float(routed[t * dim + d] + shared[t][d].to_float());
  return out;
}

//! A rank's Engram module before its layer, on streams x [s, hc, dim] (engram_forward_reference
//! with the embedding split): the rank dequantizes the hash ids in its rows and zeros the rest,
//! the ranks' bf16 rows are all-reduced, then wkv, the gates and the update are replicated.
inline void engram_rank(const rank_context& ctx, const engram::engram_weights& w, std::span<bf16> x,
                        std::span<const std::int64_t> hashes, std::size_t rows) {
  const std::size_t width = std::size_t(w.hc) * std::size_t(w.dim);
  const int k = w.columns * w.head_dim;
  const long long first = ctx.rank * w.rows;  // w.rows: the rank's part, ceil(rows / W)
  std::vector<bf16> e(rows * std::size_t(k), bf16::from_float(0.0f));
  const auto codes = w.table_codes(), scales = w.table_scales();
  for (std::size_t t = 0; t < rows; ++t)
    for (int c = 0; c < w.columns; ++c) {
      const std::int64_t id = hashes[t * std::size_t(w.columns) + std::size_t(c)] - first;
      if (id < 0 || id >= w.rows) continue;  // another rank's row
      for (int d = 0; d < w.head_dim; ++d) {
        const float q = numerics::decode<numerics::e4m3>(codes[std::size_t(id) * w.head_dim + d]);
        const float sc = numerics::decode<numerics::ue8m0>(scales[std::size_t(id) * (w.head_dim / 32) + d / 32]);
        e[t * std::size_t(k) + std::size_t(c) * w.head_dim + d] = bf16::from_float(numerics::mul_rn(q, sc));
      }
    }
  ctx.comm->all_reduce_bf16(ctx.rank, e);
  for (std::size_t t = 0; t < rows; ++t) {  // steps 2-6 of engram/reference.hpp on the gathered rows
    const auto xt = x.subspan(t * width, width);
    const auto et = std::span<const bf16>(e).subspan(t * std::size_t(k), std::size_t(k));
    engram::apply_engram_mix(w, engram::engram_mix_reference(w, xt, et, false), xt);
  }
}

//! Rank `ctx.rank`'s Transformer.forward over `ids` (model::forward's steps with the rank's
//! shards and the collectives): the full fp32 logits of the last position, the same on every rank.
//! `observe` sees the blocks' stages as model::forward shows them (the values after the
//! collectives, the same on every rank).
template <class Model>
std::vector<float> forward_rank(const rank_context& ctx, const rank_model<Model>& m,
                                model::host_sequence& seq, std::span<const std::int32_t> ids,
                                const model::layer_observer* observe = nullptr) {
  using sched = typename models::model_traits<Model>::schedule;
  constexpr models::model_config c = Model::dims;
  constexpr int hc = kernels::mhc::hc;
  static_assert(c.mhc.hc_mult == hc, "tensor parallel forward: the mHC kernels are written for 4 streams");
  const std::size_t dim = std::size_t(c.dim), width = hc * dim, s = ids.size();
  const long long start = seq.length;
  if (s == 0) throw error("forward: no tokens");
  for (std::int32_t id : ids)
    if (id < 0 || id >= c.vocab_size)
      throw error("forward: token id " + std::to_string(id) + " outside the vocabulary of " +
                  std::to_string(c.vocab_size));
  if (seq.index_keys != schedule::index_key_policy::follow_ownership)
    throw error("tensor parallel forward: only the follow_ownership index-key policy is simulated");
  // Engram hash ids (replicated: every rank extends its own history).
  seq.engram_history.resize(m.engrams.size());
  std::vector<std::vector<std::int64_t>> hashes(m.engrams.size());
  for (std::size_t j = 0; j < m.engrams.size(); ++j) {
    const auto& mult = Model::engram_multipliers[j];
    const std::vector<std::int64_t> mv(mult.begin(), mult.end());
    hashes[j] = engram::hash_tokens(m.hashes, int(j), mv, ids, {}, m.token_map, c.engram.engram_pad_id,
                                    seq.engram_history[j], seq.length);
  }
  // ParallelEmbedding: the rank's rows, zeros for other ids, all-reduced.
  const long long vfirst = ctx.rank * m.vocab_part();
  std::vector<bf16> e(s * dim, bf16::from_float(0.0f));
  for (std::size_t t = 0; t < s; ++t) {
    const long long id = ids[t] - vfirst;
    if (id < 0 || id >= m.vocab_part()) continue;
    for (std::size_t d = 0; d < dim; ++d)
      e[t * dim + d] = bf16::from_float(m.embed[std::size_t(id) * dim + d]);
  }
  ctx.comm->all_reduce_bf16(ctx.rank, e);
  std::vector<bf16> x(s * width);
  for (std::size_t t = 0; t < s; ++t)
    for (int r = 0; r < hc; ++r)
      std::copy(e.begin() + std::ptrdiff_t(t * dim), e.begin() + std::ptrdiff_t((t + 1) * dim),
                x.begin() + std::ptrdiff_t(t * width + r * dim));
  std::vector<float> pre(s * hc, 0.0f);
  for (std::size_t t = 0; t < s; ++t) pre[t * hc] = 1.0f;

  const auto sh = rank_attention_shape<Model>(ctx.world);
  const int first_expert = ctx.rank * m.experts_part();
  for (int l = 0; l < sched::num_layers; ++l) {
    for (std::size_t j = 0; j < m.engrams.size(); ++j)
      if (sched::engram::values[j] == l) engram_rank(ctx, m.engrams[j], x, hashes[j], s);
    const auto& b = m.blocks[std::size_t(l)];
    x = model::block_forward_with_ffn(
        l, b, int(dim), c.norm_eps, x, pre,
        [&](std::span<const bf16> attn_in) {
          return attention_rank(ctx, l, m.wiring[std::size_t(l)], b.attn, sh, m.freqs[std::size_t(l)],
                                attn_in, start, seq.attention);
        },
        [&](std::span<const bf16> ffn_in) { return moe_rank(ctx, b, first_expert, ffn_in); }, observe);
  }
  seq.length += (long long)s;
  // Final collapse, norm (replicated), the rank's vocab rows of the head, all-gathered.
  float last_pre[hc];
  for (int r = 0; r < hc; ++r) last_pre[r] = pre[(s - 1) * hc + std::size_t(r)];
  const auto h =
      kernels::mhc::hc_pre(std::span<const bf16>(x).subspan((s - 1) * width, width), int(dim), last_pre);
  const auto hn = kernels::norm::rmsnorm_bf16_reference(h, m.norm, c.norm_eps);
  const auto part =
      kernels::linear::linear_fp32_reference(kernels::linear::widen(hn), m.head, int(m.vocab_part()));
  return ctx.comm->all_gather(ctx.rank, part);
}

}  // namespace detail

//! Runs `f(ctx)` as each of `world` ranks (rank 0 on the calling thread, the others on threads of
//! their own) with one host_communicator. A rank that throws releases the others (their next
//! collective throws); the first error that is a rank's own (not "another rank failed") is
//! rethrown once every rank has returned.
template <class F>
void run_ranks(int world, F&& f) {
  if (world < 1)
    throw error("tensor parallel: world size " + std::to_string(world) +
                " is not a positive number of ranks");
  host_communicator comm(world);
  std::vector<std::exception_ptr> failure(static_cast<std::size_t>(world));
  auto run = [&](int r) {
    try {
      f(detail::rank_context{world, r, &comm});
    } catch (...) {
      failure[std::size_t(r)] = std::current_exception();
      comm.abandon();
    }
  };
  {
    std::vector<std::jthread> threads;
    for (int r = 1; r < world; ++r) threads.emplace_back(run, r);
    run(0);
  }
  std::exception_ptr first;
  for (int r = 0; r < world; ++r) {
    if (!failure[std::size_t(r)]) continue;
    bool collective = false;
    try {
      std::rethrow_exception(failure[std::size_t(r)]);
    } catch (const std::exception& ex) {
      collective = std::string(ex.what()).find("another rank failed") != std::string::npos;
    } catch (...) {
    }
    if (!first || !collective) first = failure[std::size_t(r)];
    if (!collective) break;
  }
  if (first) std::rethrow_exception(first);
}

//! Feeds `ids` to the W ranks (one thread each; the prompt first, then one token per call) and
//! returns the last position's fp32 logits, which every rank holds after the head's all_gather
//! (checked: a rank holding other bits is an error, as it would mean the replicated state
//! diverged). `observe`, if given, sees rank 0's block stages (model::layer_observer).
template <class Model>
std::vector<float> forward(const tp_model<Model>& m, tp_sequence& seq, std::span<const std::int32_t> ids,
                           const model::layer_observer* observe = nullptr) {
  const int world = m.world();
  if (world < 1) throw error("tensor parallel forward: no ranks");
  seq.ranks.resize(std::size_t(world));
  std::vector<std::vector<float>> logits(static_cast<std::size_t>(world));
  run_ranks(world, [&](const detail::rank_context& ctx) {
    const std::size_t r = std::size_t(ctx.rank);
    logits[r] = detail::forward_rank(ctx, m.ranks[r], seq.ranks[r], ids, ctx.rank == 0 ? observe : nullptr);
  });
  for (int r = 1; r < world; ++r)
    if (std::memcmp(logits[std::size_t(r)].data(), logits[0].data(), logits[0].size() * sizeof(float)) != 0)
      throw error("tensor parallel forward: rank " + std::to_string(r) + " holds other logits than rank 0");
  seq.length = seq.ranks[0].length;
  return std::move(logits[0]);
}

}  // namespace dsv4::parallel
