#pragma once
//! \file
//! The DSpark drafter on the host (spec §14: DSparkAttention, DSparkBlock, forward_spec), beside
//! the host model of model_reference.hpp, whose embedding and head it shares (tied, as in the
//! reference).
//!
//! Stages `mtp.0 .. mtp.{S-1}` are full blocks (single-pass mHC, attention, MoE with the DSpark
//! expert counts, routing with `bias` only: drafts are text) whose attention is SWA only: RoPE
//! theta = rope_theta with no YaRN (ratio 0), no compressor, indexer or Engram, and a ring of
//! `window` slots per stage. Per backbone call at positions p .. p+s-1, with main_hidden the
//! residual entering the target layers (forward's `main_hidden`):
//!   main_x  = main_norm(main_proj(main_hidden))            (stage 0's weights; every stage reads it)
//!   main_kv = FP8QDQ(RoPE_p(kv_norm(wkv(main_x))))         (each stage's own wkv, kv_norm)
//!   prefill (the reference's start_pos == 0 call): main_kv seeds each stage's ring (slot =
//!     position mod window, last min(s, window) positions); nothing else runs, no drafts.
//!   decode (one row at p; `input_id` = t_{p+1}, the token just sampled for p+1):
//!     rows [t_{p+1}, noise x (block - 1)] at positions p+1 .. p+block, embedded into 4 streams,
//!     one-hot pre-mix; each stage: Block.forward whose attention writes main_kv(p) into slot
//!     p mod window, then attends from every row to ring slots 0 .. min(window, p+1) - 1 in
//!     ascending slot order and then to all `block` draft KV rows (no causal mask), with the sink,
//!     inverse RoPE at the row's position, wo_a, wo_b;
//!     head: x = hc_pre(h, pre_mix) (last stage's pre-mix); logits = head(norm(x)) (fp32, every
//!     row; `norm` is the last stage's); for i = 0 .. block-1: logits[i] += markov_head(out[i])
//!     (e_i = embed_m[out[i]] bf16, bias = fp32(e_i) . W_m^T fp32), out[i+1] = sample(logits[i]);
//!     confidence[i] = proj(fp32([x_i || e_i])), a raw fp32 scalar (no sigmoid).
//! The ring is written only here (never by the backbone forward), and only with the backbone's
//! main_kv at accepted positions: rejected drafts leave no state. An engine runs the DSpark
//! prefill / decode step at every backbone call to keep the rings in step with the backbone.
//!
//! Parity: the official forward_spec has not been run against this file yet (it needs PyTorch:
//! tools/parity/reference_dspark.py and dsv4_dspark_parity are written for that run). What the
//! tests check is the composition above, the rings and the properties the spec states.
//!
//! Sampling: the reference draws each draft with torch's generator (Gumbel-max at `temperature`);
//! here the draft for row i, i.e. the token at position p+2+i, is drawn by sample_reference with
//! the caller's parameters at step p+2+i, the counter the backbone's sampler would use for that
//! position (dsv4 run draws position q's token at step q). Temperature 0 is the argmax.
//!
//! Beyond the reference: a chunk of several rows after the prefill (an appended turn) writes each
//! row's main_kv into its slot and drafts from the last row: exactly what row-by-row decode steps
//! leave in the rings, since a decode step's only state is that slot.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/checkpoint.hpp"
#include "dsv4/kernels/attention/layer_reference.hpp"
#include "dsv4/kernels/linear/reference.hpp"
#include "dsv4/kernels/mhc/reference.hpp"
#include "dsv4/kernels/norm/reference.hpp"
#include "dsv4/kernels/output/reference.hpp"
#include "dsv4/kernels/rope/rope.hpp"
#include "dsv4/kernels/sampling/reference.hpp"
#include "dsv4/model/block_reference.hpp"
#include "dsv4/model/model_reference.hpp"
#include "dsv4/numerics/quantize.hpp"

namespace dsv4::model {

//! The DSpark stages' tensors (spec §16 `mtp.N.*`); embed and head are the backbone's.
struct dspark_weights {
  std::vector<block_weights> stages;          //!< mtp.0 .. mtp.{S-1}: attention (local), norms, mixes, MoE
  kernels::attention::fp8_linear main_proj;   //!< mtp.0: [dim, targets * dim], FP8
  std::vector<float> main_norm;               //!< mtp.0: [dim]
  std::vector<float> norm;                    //!< last stage: [dim]
  std::vector<float> markov_embed;            //!< last stage: [vocab, rank], bf16 values
  std::vector<float> markov_head;             //!< last stage: [vocab, rank], fp32 in the module
  std::vector<float> confidence;              //!< last stage: [dim + rank], fp32 in the module
  std::vector<float> freqs;                   //!< RoPE of a ratio-0 layer: rope_theta, no YaRN
  int block = 0, noise_token = 0, rank = 0, targets = 0;
};

//! Every DSpark tensor of `Model`, read from `ck` (errors name the tensor and file). A variant with
//! no drafter (dspark<0, at<>>) has no stages: loading is then an error.
template <class Model>
dspark_weights dspark_weights_of(io::checkpoint& ck) {
  using sched = typename models::model_traits<Model>::schedule;
  constexpr models::model_config c = Model::dims;
  constexpr int stages = sched::drafter::stages, targets = sched::drafter::targets::size;
  if constexpr (stages == 0) {
    throw error(std::string("dspark_weights_of: ") + Model::name + " has no DSpark stages");
  } else {
    static_assert(targets > 0, "dspark_weights_of: DSpark stages need target layers");
    dspark_weights w;
    for (int s = 0; s < stages; ++s) {
      const std::string p = "mtp." + std::to_string(s) + ".";
      w.stages.push_back(block_weights_at<Model>(ck, p, local_attention_weights<Model>(ck, p + "attn."),
                                                 c.dspark.dspark_n_routed_experts, c.dspark.dspark_n_activated_experts));
    }
    const std::string first = "mtp.0.", last = "mtp." + std::to_string(stages - 1) + ".";
    w.main_proj = detail::fp8(ck, first + "main_proj", c.dim, targets * c.dim);
    w.main_norm = detail::floats(ck, first + "main_norm.weight", {c.dim});
    w.norm = detail::floats(ck, last + "norm.weight", {c.dim});
    const int rank = c.dspark.dspark_markov_rank;
    const io::tensor_view e = detail::need(ck, last + "markov_head.embed.weight", {c.vocab_size, rank});
    if (e.dtype != io::st_dtype::BF16)  // a bf16 module parameter (spec §14)
      throw error("checkpoint: tensor '" + last + "markov_head.embed.weight' in " + ck.file_of(last + "markov_head.embed.weight") +
                  " is " + io::dtype_name(e.dtype) + ", expected BF16");
    w.markov_embed = detail::floats(ck, last + "markov_head.embed.weight", {c.vocab_size, rank});
    w.markov_head = detail::floats(ck, last + "markov_head.head.weight", {c.vocab_size, rank});
    w.confidence = detail::floats(ck, last + "confidence_head.proj.weight", {1, c.dim + rank});
    w.freqs = kernels::rope::frequencies({c.attn.rope_head_dim, c.rope.rope_theta});
    w.block = c.dspark.dspark_block_size;
    w.noise_token = c.dspark.dspark_noise_token_id;
    w.rank = rank;
    w.targets = targets;
    return w;
  }
}

//! What the drafter keeps per sequence: one ring of `window` main_kv rows per stage, and the
//! number of positions it has seen (the backbone's length when both are in step).
struct dspark_state {
  std::vector<std::vector<bf16>> rings;  //!< per stage [window, head_dim], zero-initialised
  long long length = 0;
};

//! One draft block (spec §14 forward_head): ids [block + 1] = [t_{p+1}, d_1 .. d_block], the fp32
//! logits [block, vocab] with the Markov bias added, the raw confidence [block].
struct dspark_draft {
  std::vector<std::int32_t> ids;
  std::vector<float> logits;
  std::vector<float> confidence;
};

namespace detail {
//! main_x for each row of main_hidden [rows, targets * dim]: main_norm(main_proj(row)) (FP8 GEMM
//! with act_quant, bf16 out; then RMSNorm).
template <class Model>
std::vector<bf16> dspark_main_x(const dspark_weights& w, std::span<const bf16> main_hidden) {
  constexpr models::model_config c = Model::dims;
  const std::size_t in = std::size_t(w.targets) * std::size_t(c.dim);
  if (main_hidden.empty() || main_hidden.size() % in)
    throw error("dspark: main_hidden must be [rows, " + std::to_string(in) + "] (the residuals entering the " +
                std::to_string(w.targets) + " target layers), got " + std::to_string(main_hidden.size()) + " values");
  std::vector<bf16> out;
  for (std::size_t r = 0; r < main_hidden.size() / in; ++r) {
    const auto y = kernels::norm::rmsnorm_bf16_reference(w.main_proj(main_hidden.subspan(r * in, in)), w.main_norm, c.norm_eps);
    out.insert(out.end(), y.begin(), y.end());
  }
  return out;
}

//! A stage's window KV for rows x [rows, dim] at positions first, first+1, ...:
//! FP8QDQ(RoPE(kv_norm(wkv(x)))), RoPE first (spec §14).
inline std::vector<bf16> dspark_kv(const kernels::attention::layer_weights& a, const kernels::attention::layer_shape& sh,
                                   std::span<const float> freqs, std::span<const bf16> x, long long first) {
  std::vector<bf16> kv;
  for (std::size_t i = 0; i < x.size() / std::size_t(sh.dim); ++i) {
    const std::int64_t pos[1] = {first + (long long)i};
    auto k = kernels::norm::rmsnorm_bf16_reference(a.wkv(x.subspan(i * std::size_t(sh.dim), std::size_t(sh.dim))), a.kv_norm,
                                                   sh.norm_eps);
    kernels::rope::apply_rope_reference(k, sh.head_dim, 1, pos, freqs, false);
    numerics::qdq_vector<numerics::fp8_act_format>(k);
    kv.insert(kv.end(), k.begin(), k.end());
  }
  return kv;
}

//! Writes kv rows [rows, head_dim] at positions first, first+1, ... into the ring's slots
//! (position mod window); only the last `window` rows can survive, so only they are written.
inline void seed_ring(std::vector<bf16>& ring, std::span<const bf16> kv, int head_dim, int window, long long first) {
  const long long rows = (long long)(kv.size() / std::size_t(head_dim));
  for (long long r = std::max(0LL, rows - window); r < rows; ++r)
    std::copy(kv.begin() + std::ptrdiff_t(r * head_dim), kv.begin() + std::ptrdiff_t((r + 1) * head_dim),
              ring.begin() + std::ptrdiff_t(((first + r) % window) * head_dim));
}

//! DSparkAttention at a decode step of position p: main_kv(p) into the ring, then the draft rows
//! x [block, dim] (attn_norm outputs) at positions p+1 .. p+block against ring ++ draft KV.
inline std::vector<bf16> dspark_attention(const kernels::attention::layer_weights& a, const kernels::attention::layer_shape& sh,
                                          std::span<const float> freqs, std::span<const bf16> x,
                                          std::span<const bf16> main_kv, std::vector<bf16>& ring, long long p) {
  const int hd = sh.head_dim, block = int(x.size() / std::size_t(sh.dim));
  std::vector<bf16> q;
  for (int i = 0; i < block; ++i) {
    const std::int64_t pos[1] = {p + 1 + i};
    auto qi = a.wq_b(kernels::norm::rmsnorm_bf16_reference(a.wq_a(x.subspan(std::size_t(i) * sh.dim, std::size_t(sh.dim))),
                                                            a.q_norm, sh.norm_eps));
    kernels::rope::apply_rope_reference(qi, hd, sh.heads, pos, freqs, false);
    q.insert(q.end(), qi.begin(), qi.end());
  }
  const auto kv = dspark_kv(a, sh, freqs, x, p + 1);
  seed_ring(ring, main_kv, hd, sh.window, p);
  std::vector<bf16> operand(ring);
  operand.insert(operand.end(), kv.begin(), kv.end());
  // Every row: ring slots 0 .. min(window, p + 1) - 1 (ascending slot order, not oldest first),
  // then the block's own rows; no -1, no causal mask (spec §14, get_dspark_topk_idxs).
  std::vector<std::int32_t> list;
  for (int j = 0; j < int(std::min<long long>(sh.window, p + 1)); ++j) list.push_back(j);
  for (int j = 0; j < block; ++j) list.push_back(sh.window + j);
  std::vector<std::int32_t> idx;
  for (int i = 0; i < block; ++i) idx.insert(idx.end(), list.begin(), list.end());
  std::vector<bf16> o(q.size());
  kernels::attention::sparse_attention_reference(
      {block, sh.heads, hd, int(operand.size() / std::size_t(hd)), int(list.size()), float(std::pow(double(hd), -0.5))}, q,
      operand, a.attn_sink, idx, o);
  const kernels::output::output_shape os{sh.heads, hd, sh.groups, sh.o_lora, sh.dim};
  std::vector<bf16> out;
  for (int i = 0; i < block; ++i) {
    const auto oi = kernels::output::attention_output_reference(
        os, std::span<const bf16>(o).subspan(std::size_t(i) * sh.heads * hd, std::size_t(sh.heads) * hd), p + 1 + i, freqs, a.wo_a,
        a.wo_b.codes, a.wo_b.scales);
    out.insert(out.end(), oi.begin(), oi.end());
  }
  return out;
}

template <class Model>
void check_dspark(const dspark_weights& w, dspark_state& st) {
  constexpr auto sh = attention_shape<Model>();
  if (w.stages.empty()) throw error("dspark: no stages loaded");
  st.rings.resize(w.stages.size());
  for (auto& r : st.rings)
    if (r.empty()) r.assign(std::size_t(sh.window) * std::size_t(sh.head_dim), bf16::from_float(0.0f));
}
}  // namespace detail

//! The DSpark prefill (the reference's forward_spec at start_pos == 0): main_hidden [rows, targets
//! * dim] at positions first_position .. first_position + rows - 1 seeds every stage's ring;
//! nothing else runs. `first_position` is 0 after an exact prefill (forward), s - rows after a
//! CED prefill (forward_ced captures the replayed rows only). Resets the rings of `st`.
template <class Model>
void dspark_prefill(const dspark_weights& w, dspark_state& st, std::span<const bf16> main_hidden, long long first_position = 0) {
  constexpr auto sh = attention_shape<Model>();
  if (first_position < 0) throw error("dspark_prefill: negative first position");
  st = dspark_state{};
  detail::check_dspark<Model>(w, st);
  const auto main_x = detail::dspark_main_x<Model>(w, main_hidden);
  for (std::size_t s = 0; s < w.stages.size(); ++s)
    detail::seed_ring(st.rings[s], detail::dspark_kv(w.stages[s].attn, sh, w.freqs, main_x, first_position), sh.head_dim, sh.window,
                      first_position);
  st.length = first_position + (long long)(main_hidden.size() / (std::size_t(w.targets) * std::size_t(Model::dims.dim)));
}

//! A DSpark decode step after the backbone's call at positions st.length .. st.length + rows - 1
//! (one row for a decode step; several for an appended chunk): main_hidden [rows, targets * dim]
//! from that call, `input_id` the token sampled for the position after it. Writes every row's
//! main_kv into the rings and returns the draft block of the last position. `sampling` defaults to
//! greedy (temperature 0); the reference's default is temperature 1 (its ModelArgs.temperature).
//! `forced` (block + 1 ids, for parity runs) replaces the drawn drafts d_1 .. d_block by the given
//! ones, so that each row's Markov bias is that of the other side's draft (teacher forcing).
template <class Model>
dspark_draft dspark_decode(const host_model<Model>& m, const dspark_weights& w, dspark_state& st, std::int32_t input_id,
                           std::span<const bf16> main_hidden, const kernels::sampling::sampling_params& sampling = {0.0f},
                           std::uint64_t sequence = 0, std::span<const std::int32_t> forced = {}) {
  constexpr models::model_config c = Model::dims;
  constexpr auto sh = attention_shape<Model>();
  constexpr int hc = kernels::mhc::hc;
  const std::size_t dim = std::size_t(c.dim), width = hc * dim, V = std::size_t(c.vocab_size);
  if (st.length <= 0) throw error("dspark_decode: no DSpark prefill yet (run dspark_prefill after the backbone's prefill)");
  if (input_id < 0 || input_id >= c.vocab_size)
    throw error("dspark_decode: token id " + std::to_string(input_id) + " outside the vocabulary of " + std::to_string(c.vocab_size));
  if (!forced.empty() && forced.size() != std::size_t(w.block) + 1)
    throw error("dspark_decode: forced ids must be block + 1 = " + std::to_string(w.block + 1) + " ids");
  if (!forced.empty() && forced[0] != input_id) throw error("dspark_decode: forced ids must start with the input id");
  for (std::int32_t id : forced)
    if (id < 0 || id >= c.vocab_size) throw error("dspark_decode: forced id " + std::to_string(id) + " outside the vocabulary");
  detail::check_dspark<Model>(w, st);
  const auto main_x = detail::dspark_main_x<Model>(w, main_hidden);
  const long long rows = (long long)(main_x.size() / dim), p = st.length + rows - 1;  // the last row's position
  const std::size_t block = std::size_t(w.block);

  // Draft rows [t_{p+1}, noise ...] in 4 streams, one-hot pre-mix.
  std::vector<bf16> h(block * width);
  for (std::size_t i = 0; i < block; ++i) {
    const std::size_t id = std::size_t(i == 0 ? input_id : w.noise_token);
    for (int r = 0; r < hc; ++r)
      for (std::size_t d = 0; d < dim; ++d) h[i * width + std::size_t(r) * dim + d] = bf16::from_float(m.embed[id * dim + d]);
  }
  std::vector<float> pre(block * hc, 0.0f);
  for (std::size_t i = 0; i < block; ++i) pre[i * hc] = 1.0f;

  using sched = typename models::model_traits<Model>::schedule;
  for (std::size_t s = 0; s < w.stages.size(); ++s) {
    const auto& a = w.stages[s].attn;
    const auto kv = detail::dspark_kv(a, sh, w.freqs, main_x, st.length);
    // Rows before the last: their slots only (what their own decode steps would have written).
    detail::seed_ring(st.rings[s], std::span<const bf16>(kv).first(std::size_t(rows - 1) * std::size_t(sh.head_dim)), sh.head_dim,
                      sh.window, st.length);
    const auto last_kv = std::span<const bf16>(kv).last(std::size_t(sh.head_dim));
    h = block_forward_with(sched::num_layers + int(s), w.stages[s], sh.dim, sh.norm_eps, h, pre,
                           [&](std::span<const bf16> attn_in) {
                             return detail::dspark_attention(a, sh, w.freqs, attn_in, last_kv, st.rings[s], p);
                           });
  }
  st.length += rows;

  // forward_head.
  dspark_draft out;
  std::vector<bf16> x;  // hc_pre output, [block, dim] (pre-norm: the confidence reads it)
  for (std::size_t i = 0; i < block; ++i) {
    float pm[hc];
    for (int r = 0; r < hc; ++r) pm[r] = pre[i * hc + std::size_t(r)];
    const auto xi = kernels::mhc::hc_pre(std::span<const bf16>(h).subspan(i * width, width), int(dim), pm);
    x.insert(x.end(), xi.begin(), xi.end());
    const auto li = kernels::linear::linear_fp32_reference(
        kernels::linear::widen(kernels::norm::rmsnorm_bf16_reference(xi, w.norm, c.norm_eps)), m.head, c.vocab_size);
    out.logits.insert(out.logits.end(), li.begin(), li.end());
  }
  out.ids.assign(block + 1, 0);
  out.ids[0] = input_id;
  const std::size_t rank = std::size_t(w.rank);
  for (std::size_t i = 0; i < block; ++i) {
    const std::size_t tok = std::size_t(out.ids[i]);
    // e_i is the bf16 embedding row; its fp32 widening feeds the fp32 head (exact).
    const std::span<const float> e(w.markov_embed.data() + tok * rank, rank);
    const auto bias = kernels::linear::linear_fp32_reference(e, w.markov_head, c.vocab_size);
    const std::span<float> li(out.logits.data() + i * V, V);
    for (std::size_t v = 0; v < V; ++v) li[v] += bias[v];
    out.ids[i + 1] = forced.empty() ? kernels::sampling::sample_reference(li, sampling, sequence, std::uint64_t(p + 2 + (long long)i))
                                    : forced[i + 1];
    std::vector<float> cat(dim + rank);
    for (std::size_t d = 0; d < dim; ++d) cat[d] = x[i * dim + d].to_float();
    std::copy(e.begin(), e.end(), cat.begin() + std::ptrdiff_t(dim));
    out.confidence.push_back(kernels::linear::linear_fp32_reference(cat, w.confidence, 1)[0]);
  }
  return out;
}

//! The reference's forward_spec: a prefill (start_pos == 0) seeds the rings and returns nothing;
//! otherwise a decode step (start_pos must be the drafter's length) returns the draft block.
template <class Model>
std::optional<dspark_draft> forward_spec(const host_model<Model>& m, const dspark_weights& w, dspark_state& st,
                                         std::int32_t input_id, std::span<const bf16> main_hidden, long long start_pos,
                                         const kernels::sampling::sampling_params& sampling = {0.0f}, std::uint64_t sequence = 0) {
  if (start_pos == 0) {
    dspark_prefill<Model>(w, st, main_hidden, 0);
    return std::nullopt;
  }
  if (start_pos != st.length)
    throw error("forward_spec: start position " + std::to_string(start_pos) + " but the drafter has seen " +
                std::to_string(st.length) + " positions (run a DSpark step after every backbone call)");
  return dspark_decode<Model>(m, w, st, input_id, main_hidden, sampling, sequence);
}

}  // namespace dsv4::model
