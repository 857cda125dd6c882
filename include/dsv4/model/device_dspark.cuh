#pragma once
//! \file
//! The DSpark drafter on CUDA (spec §14; host reference: dspark_reference.hpp, whose file comment
//! has the math), beside a device_model whose embedding, head, stream and cuBLAS handle it shares.
//! The backbone gives the drafter its input in device memory (device_model::capture_main_hidden);
//! the drafter keeps one ring of `window` FP8 window entries per stage and sequence slot.
//!
//!   prefill(slot, main_hidden, rows, first_position): the rings of `slot` from zero, then seeded
//!     with main_kv of positions first_position .. first_position + rows - 1 (forward_spec at
//!     start_pos 0; a CED prefill captures only its replayed rows, hence first_position).
//!   decode(slot, input_id, main_hidden, rows, positions): after a backbone call that added
//!     `positions` positions (a decode step: 1; an appended chunk: its length), whose last `rows`
//!     rows main_hidden holds, writes their main_kv into the rings and returns the draft block of
//!     the last position: ids, fp32 logits with the Markov bias, raw confidences.
//!   decode(steps): the same for several sequences in one pass (their draft rows as one batch of
//!     rows through the stages and the head; the chain below one row of every sequence at a time).
//!
//! Each stage runs as the backbone's blocks do: the mHC boundary (mhc_step), the attention, the
//! boundary into the FFN, the MoE with the DSpark expert counts (moe_forward, kernel path). The
//! attention is the local layer's pieces with DSpark's operand: queries and KV of the draft rows at
//! p+1 .., the ring written with main_kv, every draft row attending to ring slots 0 .. min(window,
//! p+1) - 1 in slot order and then to all draft rows (sparse_attention over an appended_kv operand:
//! ring, then the draft rows' own window entries), inverse RoPE, wo_a, wo_b (attention_output).
//! The window entries are packed FP8 exactly as the backbone's ring: FP8QDQ(RoPE(kv_norm(wkv x))).
//! The head: the backbone's fp32 head GEMM on norm(hc_pre(streams, pre)); the Markov bias of row i
//! (e_i = markov_embed[id_i], an fp32 GEMM on the device over the sequences' gathered rows) is
//! added before row i is sampled, on the device (kernels/sampling: sample_reference's draw at step
//! p + 2 + i, bit for bit), which gives id_{i+1}: one wait per draft row of the batch; the rows'
//! logits come back once, after the chain (or not at all: decode(steps, false)). The confidence is an fp32 dot product on the device.
//!
//! Differences from the host drafter are summation orders only (cuBLAS's fp32 GEMV and head,
//! the MMA sums of the GEMMs and attention, the confidence's fp32 tree against the host's double
//! sum); test_dspark_cuda bounds them.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/attention/layer.cuh"
#include "dsv4/kernels/attention/sparse_attention.cuh"
#include "dsv4/kernels/compressor/compressor.cuh"
#include "dsv4/kernels/gemm/dense.cuh"
#include "dsv4/kernels/moe/moe.cuh"
#include "dsv4/kernels/norm/rmsnorm.cuh"
#include "dsv4/kernels/output/output.cuh"
#include "dsv4/kernels/rope/rope.cuh"
#include "dsv4/kernels/sampling/reference.hpp"
#include "dsv4/kernels/sampling/sampling.cuh"
#include "dsv4/model/device_block.cuh"
#include "dsv4/model/device_model.cuh"
#include "dsv4/model/dspark_reference.hpp"
#include "dsv4/numerics/quantize.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "dsv4/runtime/pdl.cuh"
#include "dsv4/runtime/pinned_buffer.cuh"
#include "dsv4/runtime/upload_arena.cuh"

namespace dsv4::model {

namespace device_detail {
//! x [rows, dim] = bf16(sum_r pre[t, r] y[t, r, :]) in stream order from 0 (mhc/reference.hpp
//! hc_pre, without the norm): the pre-norm input of DSpark's head, which the confidence reads.
DSV4_KERNEL void hc_pre_kernel(const bf16* y, const float* pre, long long rows, int dim, int streams,
                               bf16* x) {
  runtime::start_after_previous_grid();
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * dim) return;
  const long long t = i / dim;
  const int d = int(i % dim);
  float s = 0.0f;
  for (int r = 0; r < streams; ++r)
    s = __fadd_rn(s, __fmul_rn(pre[t * streams + r], y[(t * streams + r) * dim + d].to_float()));
  x[i] = bf16::from_float(s);
}
//! row[v] += bias[v] (fp32).
//! rows[r * stride + i] += bias[r * n + i] for r < count, i < n (a draft row of each sequence, its
//! own Markov bias).
DSV4_KERNEL void add_bias_kernel(float* rows, long long stride, const float* bias, long long n, long long count) {
  runtime::start_after_previous_grid();
  const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n * count) return;
  const long long r = t / n, i = t % n;
  rows[r * stride + i] = __fadd_rn(rows[r * stride + i], bias[t]);
}
//! out[r, :] = table[ids[r], :] ([rows, width] fp32).
DSV4_KERNEL void gather_rows_kernel(const float* table, const std::int32_t* ids, int width, int rows, float* out) {
  runtime::start_after_previous_grid();
  const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= static_cast<long long>(rows) * width) return;
  const long long r = t / width, i = t % width;
  out[t] = table[static_cast<long long>(ids[r]) * width + i];
}
//! conf[i] = [fp32(x_i) || e_i] . w for row i (one CTA per row): x [rows, dim] bf16, e_i the fp32
//! Markov embedding row of ids[i] ([vocab, rank]), w [dim + rank] fp32.
DSV4_KERNEL void __launch_bounds__(256)
    confidence_kernel(const bf16* x, const float* embed, const std::int32_t* ids, const float* w, int dim,
                      int rank, float* conf) {
  runtime::start_after_previous_grid();
  const int row = blockIdx.x;
  const float* e = embed + static_cast<long long>(ids[row]) * rank;
  float s = 0.0f;
  for (int k = threadIdx.x; k < dim + rank; k += blockDim.x)
    s = fmaf(k < dim ? x[static_cast<long long>(row) * dim + k].to_float() : e[k - dim], w[k], s);
  __shared__ float part[256];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int h = blockDim.x / 2; h > 0; h /= 2) {
    if (int(threadIdx.x) < h) part[threadIdx.x] += part[threadIdx.x + h];
    __syncthreads();
  }
  if (threadIdx.x == 0) conf[row] = part[0];
}
}  // namespace device_detail

template <class Model>
class device_dspark {
 public:
  using sched = typename models::model_traits<Model>::schedule;
  static constexpr models::model_config c = Model::dims;
  static constexpr auto sh = attention_shape<Model>();
  static constexpr int hc = kernels::mhc::hc, head_dim = c.attn.head_dim;
  static constexpr int stages = sched::drafter::stages, targets = sched::drafter::targets::size;
  static_assert(stages > 0,
                "device_dspark: this model variant has no DSpark stages (dspark<0, at<>> in its schedule)");
  using window_format = numerics::fp8_act_format;
  using window_layout = numerics::packed_vector<window_format, head_dim>;
  using operand_t = kernels::attention::appended_kv<window_format, numerics::main_kv_format, head_dim>;

  //! The drafter of `backbone` (which must outlive it), from the host drafter's weights, for
  //! sequence slots 0 .. max_seqs - 1 (the backbone's slots); one decode pass takes up to
  //! `max_batch` sequences (0: max_seqs; at most the backbone's max_rows / block, whose head
  //! scratch the draft rows use), a batch of more runs in groups of that many.
  device_dspark(device_model<Model>& backbone, const dspark_weights& w, int max_seqs, int max_batch = 0)
      : m_(backbone), max_seqs_(max_seqs), block_(w.block), noise_(w.noise_token), rank_(w.rank) {
    using namespace device_detail;
    using kernels::attention::device_detail::fp8_weight;
    if (max_seqs <= 0) throw error("device_dspark: max_seqs must be positive");
    if (int(w.stages.size()) != stages || w.targets != targets)
      throw error("device_dspark: the weights hold " + std::to_string(w.stages.size()) + " stages and " +
                  std::to_string(w.targets) + " targets, " + Model::name + " has " + std::to_string(stages) +
                  " and " + std::to_string(targets));
    // Everything a decode needs of the backbone, checked here: a decode that failed halfway would
    // leave the slot needing a prefill whose input the backbone no longer holds.
    if (backbone.world() != 1)
      throw error(
          "device_dspark: the drafter runs beside a whole model, not a tensor-parallel rank (its embedding "
          "and "
          "head are vocabulary slices there)");
    if (block_ > backbone.max_rows())
      throw error("device_dspark: draft block " + std::to_string(block_) +
                  " exceeds the backbone's limits::max_rows (" + std::to_string(backbone.max_rows()) +
                  "), which its head's scratch holds");
    if (noise_ < 0 || noise_ >= c.vocab_size)
      throw error("device_dspark: the noise token " + std::to_string(noise_) +
                  " is outside the vocabulary of " + std::to_string(c.vocab_size));
    for (std::size_t s = 0; s < w.stages.size(); ++s)  // (as device_model refuses for the backbone's gates)
      require_bf16(w.stages[s].gate.weight, "device_dspark", "mtp." + std::to_string(s) + ".ffn.gate.weight");
    if (block_ <= 0 || block_ > sh.window)
      throw error("device_dspark: draft block " + std::to_string(block_) + " outside 1 .. window (" +
                  std::to_string(sh.window) + ")");
    if (max_batch < 0) throw error("device_dspark: negative max_batch");
    max_batch_ = std::max(1, std::min({max_batch > 0 ? max_batch : max_seqs, max_seqs, backbone.max_rows() / block_}));
    const int W = sh.window, B = block_ * max_batch_;  // B: the draft rows of a pass
    for (const auto& st : w.stages) {
      stage d;
      d.wq_a = fp8_weight::upload(st.attn.wq_a), d.wq_b = fp8_weight::upload(st.attn.wq_b);
      d.wkv = fp8_weight::upload(st.attn.wkv), d.wo_b = fp8_weight::upload(st.attn.wo_b);
      d.q_norm = upload_bf16(st.attn.q_norm), d.kv_norm = upload_bf16(st.attn.kv_norm),
      d.wo_a = upload_bf16(st.attn.wo_a);
      d.wo_a_fp8 = kernels::attention::device_detail::wo_a_fp8_buffers::upload(st.attn.wo_a, st.attn.wo_b.k);
      d.sink = upload(st.attn.attn_sink);
      d.block = device_block::upload_from(st, c.dim);
      d.ring = runtime::device_buffer<std::uint8_t>(std::size_t(max_seqs) * W * window_layout::bytes);
      d.ring.fill_bytes(0);
      stages_.push_back(std::move(d));
    }
    const auto& g = w.stages[0];
    moe_shape_ = {g.gate.experts,     g.gate.k,         c.dim,          g.inter,
                  g.gate.route_scale, g.gate.gate_temp, g.swiglu_limit, g.gate.norm_topk_prob};
    main_proj_ = fp8_weight::upload(w.main_proj);
    main_norm_ = upload_bf16(w.main_norm), norm_ = upload_bf16(w.norm);
    markov_embed_ = upload(w.markov_embed), markov_head_ = upload(w.markov_head),
    confidence_ = upload(w.confidence);
    freqs_ = upload(w.freqs);
    const int K = targets * c.dim, R = std::max(W, B), heads_hd = sh.heads * head_dim;
    mh_codes_ = device_buffer<std::uint8_t>(std::size_t(W) * K),
    mh_scales_ = device_buffer<std::uint8_t>(std::size_t(W) * K / 32);
    x_codes_ = device_buffer<std::uint8_t>(std::size_t(R) * c.dim),
    x_scales_ = device_buffer<std::uint8_t>(std::size_t(R) * c.dim / 32);
    main_x_ = device_buffer<bf16>(std::size_t(W) * c.dim),
    kv_ = device_buffer<bf16>(std::size_t(R) * head_dim);
    qr_ = device_buffer<bf16>(std::size_t(B) * sh.q_lora),
    qr_codes_ = device_buffer<std::uint8_t>(std::size_t(B) * sh.q_lora);
    qr_scales_ = device_buffer<std::uint8_t>(std::size_t(B) * sh.q_lora / 32);
    q_ = device_buffer<bf16>(std::size_t(B) * heads_hd), o_ = device_buffer<bf16>(std::size_t(B) * heads_hd);
    chunk_kv_ = device_buffer<std::uint8_t>(std::size_t(B) * window_layout::bytes);
    x_ = device_buffer<bf16>(std::size_t(B) * hc * c.dim),
    y_ = device_buffer<bf16>(std::size_t(B) * hc * c.dim);
    h_ = device_buffer<bf16>(std::size_t(B) * c.dim), sub_ = device_buffer<bf16>(std::size_t(B) * c.dim);
    xpre_ = device_buffer<bf16>(std::size_t(B) * c.dim);
    for (auto* b : {&a_pre_, &a_post_, &f_pre_, &f_post_}) *b = device_buffer<float>(std::size_t(B) * hc);
    a_comb_ = device_buffer<float>(std::size_t(B) * hc * hc),
    f_comb_ = device_buffer<float>(std::size_t(B) * hc * hc);
    std::vector<float> one_hot(std::size_t(B) * hc, 0.0f);
    for (int t = 0; t < B; ++t) one_hot[std::size_t(t) * hc] = 1.0f;
    one_hot_ = upload(one_hot);
    logits_ = device_buffer<float>(std::size_t(B) * c.vocab_size),
    bias_ = device_buffer<float>(std::size_t(max_batch_) * c.vocab_size);
    conf_ = device_buffer<float>(std::size_t(B));
    conf_host_ = runtime::pinned_buffer<float>(std::size_t(B));  // (logits_host_: on the first decode that copies logits)
    markov_rows_ = device_buffer<float>(std::size_t(max_batch_) * std::size_t(rank_));
    markov_ids_host_ = runtime::pinned_buffer<std::int32_t>(std::size_t(block_) * std::size_t(max_batch_));
    markov_ids_ = device_buffer<std::int32_t>(std::size_t(max_batch_));
    sampler_.emplace(max_batch_);
    // A decode pass's inputs (decode_group): per sequence its main rows' positions (a slot of
    // max(window, block) each, put_positions), the draft rows' positions, ids and index lists,
    // the ring slots and draft row starts; a prefill's positions fit the first slot.
    using A = runtime::upload_arena;
    const std::size_t P = std::size_t(std::max(W, block_)), NB = std::size_t(B);
    inputs_ = A(std::size_t(max_batch_) * A::space<std::int64_t>(P) + A::space<std::int64_t>(NB) +
                    A::space<std::int32_t>(NB) + A::space<std::int32_t>(NB * std::size_t(W + block_)) +
                    2 * A::space<std::int32_t>(std::size_t(max_batch_)),
                "device_dspark call inputs");
    gemm_ws_.emplace(std::size_t(1) << 22,
                     kernels::gemm::dequant_elems_for(
                         R, {{c.dim, K}, {head_dim, c.dim}, {sh.q_lora, c.dim}, {heads_hd, sh.q_lora}}),
                     kernels::gemm::folded_bytes_for(R, std::max<long long>({K, c.dim, sh.q_lora})));
    out_ws_.emplace(kernels::output::output_shape{sh.heads, head_dim, sh.groups, sh.o_lora, c.dim}, B);
    attn_ws_.emplace(kernels::attention::sparse_attention_workspace::for_device<head_dim>());
    mhc_ws_.emplace(B, c.dim);
    moe_ws_.emplace(moe_shape_, B);
    lengths_.assign(std::size_t(max_seqs), 0);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads ran on the legacy stream
  }
  device_dspark(const device_dspark&) = delete;
  device_dspark& operator=(const device_dspark&) = delete;
  ~device_dspark() { cudaStreamSynchronize(stream()); }

  //! Positions the drafter of `slot` has seen (the backbone's length when both are in step).
  long long length(int slot) const { return lengths_.at(check_slot(slot, "length")); }

  //! The ring of stage `stage` and `slot`, dequantised: [window, head_dim] values in slot order,
  //! as dspark_state::rings holds them on the host (for tests and debugging; waits for the stream).
  std::vector<bf16> ring_values(int stage, int slot) {
    check_slot(slot, "ring_values");
    if (stage < 0 || stage >= int(stages_.size()))
      throw error("device_dspark::ring_values: no stage " + std::to_string(stage) + " (the drafter has " +
                  std::to_string(stages_.size()) + ")");
    using layout = window_layout;
    std::vector<std::uint8_t> bytes(std::size_t(sh.window) * layout::bytes);
    DSV4_CUDA_CHECK(cudaMemcpyAsync(bytes.data(), ring_of(stages_[std::size_t(stage)], slot), bytes.size(),
                                    cudaMemcpyDeviceToHost, stream()));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream()));
    std::vector<bf16> out(std::size_t(sh.window) * head_dim);
    for (int r = 0; r < sh.window; ++r) {
      const auto entry =
          std::span<const std::uint8_t>(bytes).subspan(std::size_t(r) * layout::bytes, layout::bytes);
      numerics::dequantize_vector<window_format>(
          entry.first(layout::code_bytes), entry.subspan(layout::scale_offset, layout::scale_bytes),
          std::span<bf16>(out).subspan(std::size_t(r) * head_dim, head_dim));
    }
    return out;
  }

  //! The DSpark prefill of `slot` (see the file comment): main_hidden [rows, targets * dim] in
  //! device memory holds positions first_position .. first_position + rows - 1, rows <= window.
  void prefill(int slot, const bf16* main_hidden, long long rows, long long first_position = 0) {
    check_slot(slot, "prefill");
    check_rows(main_hidden, rows, "prefill");
    if (first_position < 0) throw error("device_dspark::prefill: negative first position");
    lengths_[std::size_t(slot)] = 0;  // (a failure below leaves the slot needing a new prefill)
    for (auto& st : stages_)
      DSV4_CUDA_CHECK(
          cudaMemsetAsync(ring_of(st, slot), 0, std::size_t(sh.window) * window_layout::bytes, stream()));
    inputs_.begin_pack();
    const std::int64_t* pos = put_positions(first_position, rows);
    inputs_.upload(stream());
    write_rings(slot, main_hidden, rows, pos);
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream()));
    lengths_[std::size_t(slot)] = first_position + rows;
  }

  //! One sequence's part of a batched decode step (see decode below).
  struct step {
    int slot = -1;
    std::int32_t input_id = 0;
    const bf16* main_hidden = nullptr;  //!< the backbone call's last `rows` rows of this sequence
    long long rows = 0;
    long long positions = -1;  //!< positions the backbone's call added (default: rows)
    kernels::sampling::sampling_params sampling{0.0f};
    std::uint64_t sequence = 0;
    std::span<const std::int32_t> forced = {};
  };

  //! A DSpark decode step of `slot` (see the file comment). `positions` (default: rows) is how
  //! many positions the backbone's call added; main_hidden holds its last `rows` (<= window).
  //! `sampling` defaults to greedy; `forced` (block + 1 ids starting with input_id) replaces the
  //! drawn drafts, as dspark_decode's teacher forcing does.
  dspark_draft decode(int slot, std::int32_t input_id, const bf16* main_hidden, long long rows,
                      long long positions = -1, const kernels::sampling::sampling_params& sampling = {0.0f},
                      std::uint64_t sequence = 0, std::span<const std::int32_t> forced = {}) {
    const step one{slot, input_id, main_hidden, rows, positions, sampling, sequence, forced};
    return std::move(decode(std::span<const step>(&one, 1))[0]);
  }

  //! Decode steps of several sequences (distinct slots) in one pass: their draft rows go through
  //! the stages, the head and the Markov chain together (the chain's row i of every sequence at
  //! once), so the weights are read once and the chain waits block times, not block times the
  //! sequences. Each sequence's block is what its own decode would give up to summation order
  //! (the attention's split over a longer index list, the Markov GEMM's rows). Batches larger
  //! than max_batch() run in groups. `copy_logits` false leaves dspark_draft::logits empty (a
  //! speculative loop needs only the ids: at V4.1's vocabulary a block's rows are 2.6 MB).
  std::vector<dspark_draft> decode(std::span<const step> steps, bool copy_logits = true) {
    std::vector<dspark_draft> out;
    out.reserve(steps.size());
    // Every step is checked before any group runs: a group that ran has advanced its slots.
    for (std::size_t i = 0; i < steps.size(); ++i) {
      check_step(steps[i]);
      for (std::size_t j = 0; j < i; ++j)
        if (steps[i].slot == steps[j].slot)
          throw error("device_dspark::decode: sequence slot " + std::to_string(steps[i].slot) + " appears twice in one batch");
    }
    for (std::size_t first = 0; first < steps.size(); first += std::size_t(max_batch_)) {
      auto part = decode_group(steps.subspan(first, std::min(steps.size() - first, std::size_t(max_batch_))), copy_logits);
      for (auto& d : part) out.push_back(std::move(d));
    }
    return out;
  }
  //! The most sequences one pass of decode() takes (the constructor's max_batch).
  int max_batch() const { return max_batch_; }
  //! Sequence slots 0 .. max_seqs() - 1.
  int max_seqs() const { return max_seqs_; }

 private:
  //! A decode step's errors (each names the problem); returns the positions it adds.
  long long check_step(const step& s) const {
    const int B = block_, W = sh.window;
    check_slot(s.slot, "decode");
    check_rows(s.main_hidden, s.rows, "decode");
    const long long positions = s.positions == -1 ? s.rows : s.positions;
    // Every position the rings keep must come in: the call's last min(positions, window) rows.
    if (positions < 1 || s.rows != std::min<long long>(positions, W))
      throw error("device_dspark::decode: " + std::to_string(s.rows) + " main_hidden rows of a call that added " +
                  std::to_string(positions) + " positions; expected its last min(positions, window) = " +
                  std::to_string(std::max<long long>(0, std::min<long long>(positions, W))) + " rows");
    if (lengths_[std::size_t(s.slot)] <= 0)
      throw error("device_dspark::decode: no DSpark prefill of slot " + std::to_string(s.slot) + " yet");
    if (s.input_id < 0 || s.input_id >= c.vocab_size)
      throw error("device_dspark::decode: token id " + std::to_string(s.input_id) + " outside the vocabulary of " +
                  std::to_string(c.vocab_size));
    if (!s.forced.empty() && (s.forced.size() != std::size_t(B) + 1 || s.forced[0] != s.input_id))
      throw error("device_dspark::decode: forced ids must be block + 1 = " + std::to_string(B + 1) +
                  " ids starting with the input id");
    for (std::int32_t id : s.forced)
      if (id < 0 || id >= c.vocab_size) throw error("device_dspark::decode: forced id " + std::to_string(id) + " outside the vocabulary");
    if (s.forced.empty()) kernels::sampling::check_sampling_params(s.sampling, "device_dspark::decode: ");  // (forced: not drawn)
    return positions;
  }

  std::vector<dspark_draft> decode_group(std::span<const step> steps, bool copy_logits) {
    using namespace device_detail;
    const int N = int(steps.size()), B = block_, W = sh.window, NB = N * B;
    std::vector<long long> p(steps.size()), advance(steps.size());
    int widest = 0;  // the most ring slots a sequence's draft rows see
    for (std::size_t n = 0; n < steps.size(); ++n) {  // (decode() checked every step)
      advance[n] = check_step(steps[n]);
      p[n] = lengths_[std::size_t(steps[n].slot)] + advance[n] - 1;  // the last row's position
      widest = std::max(widest, int(std::min<long long>(W, p[n] + 1)));
    }
    const int topk = widest + B;
    // Until the step has run: a failed step leaves the slots needing a prefill.
    std::vector<long long> lengths_before;
    for (const step& s : steps) lengths_before.push_back(lengths_[std::size_t(s.slot)]), lengths_[std::size_t(s.slot)] = 0;

    // Inputs: each sequence's main rows' positions, the draft rows' positions and ids, the index
    // lists (ring slots 0 .. min(window, p + 1) - 1, then the sequence's draft rows, then -1), the
    // rings' slots and where each sequence's draft rows start.
    inputs_.begin_pack();
    std::vector<const std::int64_t*> main_pos;
    for (std::size_t n = 0; n < steps.size(); ++n) main_pos.push_back(put_positions(p[n] - steps[n].rows + 1, steps[n].rows));
    std::vector<std::int64_t> dpos;
    std::vector<std::int32_t> ids, idx, ring_slots, chunk_first;
    idx.reserve(std::size_t(NB) * std::size_t(topk));
    for (std::size_t n = 0; n < steps.size(); ++n) {
      const int nwin = int(std::min<long long>(W, p[n] + 1));
      for (int i = 0; i < B; ++i) {
        dpos.push_back(p[n] + 1 + i);
        ids.push_back(i == 0 ? steps[n].input_id : noise_);
        for (int j = 0; j < nwin; ++j) idx.push_back(j);
        for (int j = 0; j < B; ++j) idx.push_back(W + j);
        for (int j = nwin; j < widest; ++j) idx.push_back(-1);
      }
      ring_slots.push_back(steps[n].slot), chunk_first.push_back(int(n) * B);
    }
    const std::size_t max_nb = std::size_t(max_batch_) * std::size_t(B);
    const std::int64_t* draft_pos = inputs_.put(std::span<const std::int64_t>(dpos), max_nb, "draft positions");
    const std::int32_t* draft_ids = inputs_.put(std::span<const std::int32_t>(ids), max_nb, "draft ids");
    const std::int32_t* draft_idx = inputs_.put(std::span<const std::int32_t>(idx), max_nb * std::size_t(W + B), "draft index lists");
    const std::int32_t* slots_d = inputs_.put(std::span<const std::int32_t>(ring_slots), std::size_t(max_batch_), "ring slots");
    const std::int32_t* first_d = inputs_.put(std::span<const std::int32_t>(chunk_first), std::size_t(max_batch_), "draft row starts");
    inputs_.upload(stream());

    for (std::size_t n = 0; n < steps.size(); ++n) write_rings(steps[n].slot, steps[n].main_hidden, steps[n].rows, main_pos[n]);
    runtime::launch_programmatic(embed_kernel, dim3(blocks_for(1LL * NB * hc * c.dim)), dim3(256), 0, stream(),
                                 m_.embedding(), 0LL, static_cast<long long>(c.vocab_size), draft_ids,
                                 static_cast<long long>(NB), c.dim, hc, x_.data());
    DSV4_CUDA_CHECK_LAUNCH();
    bf16 *X = x_.data(), *Y = y_.data();
    const mhc_constants k = mhc_constants_of<Model>();
    for (std::size_t s = 0; s < stages_.size(); ++s) {
      stage& st = stages_[s];
      const device_block& b = st.block;
      if (s == 0) {
        mhc_boundary(k, NB, X, nullptr, nullptr, nullptr, one_hot_.data(), b.attn_norm.data(), nullptr,
                     h_.data(), b.attn_fn.data(), b.attn_base.data(), b.attn_scale.data(), a_pre_.data(),
                     a_post_.data(), a_comb_.data(), *mhc_ws_, stream());
      } else {
        mhc_boundary(k, NB, X, sub_.data(), f_post_.data(), f_comb_.data(), f_pre_.data(), b.attn_norm.data(),
                     Y, h_.data(), b.attn_fn.data(), b.attn_base.data(), b.attn_scale.data(), a_pre_.data(),
                     a_post_.data(), a_comb_.data(), *mhc_ws_, stream());
        std::swap(X, Y);
      }
      attention(st, N, slots_d, first_d, draft_pos, draft_idx, topk);
      mhc_boundary(k, NB, X, sub_.data(), a_post_.data(), a_comb_.data(), a_pre_.data(), b.ffn_norm.data(), Y,
                   h_.data(), b.ffn_fn.data(), b.ffn_base.data(), b.ffn_scale.data(), f_pre_.data(),
                   f_post_.data(), f_comb_.data(), *mhc_ws_, stream());
      std::swap(X, Y);
      kernels::moe::moe_forward(h_.data(), NB, nullptr, b.moe(), sub_.data(), *moe_ws_, stream(), m_.blas(),
                                false);
    }
    // forward_head: Y = the streams after the last FFN, h = norm(hc_pre(Y, pre)), x = hc_pre(Y, pre).
    mhc_boundary(k, NB, X, sub_.data(), f_post_.data(), f_comb_.data(), f_pre_.data(), norm_.data(), Y,
                 h_.data(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, *mhc_ws_, stream());
    runtime::launch_programmatic(hc_pre_kernel, dim3(blocks_for(1LL * NB * c.dim)), dim3(256), 0, stream(),
                                 static_cast<const bf16*>(Y), static_cast<const float*>(f_pre_.data()),
                                 static_cast<long long>(NB), c.dim, hc, xpre_.data());
    DSV4_CUDA_CHECK_LAUNCH();
    m_.head_logits(h_.data(), NB, logits_.data());

    std::vector<dspark_draft> out(steps.size());
    for (std::size_t n = 0; n < steps.size(); ++n) {
      out[n].ids.assign(std::size_t(B) + 1, 0);
      out[n].ids[0] = steps[n].input_id;
    }
    const std::size_t V = std::size_t(c.vocab_size);
    std::vector<kernels::sampling::row_request> draws;
    for (int i = 0; i < B; ++i) {
      // Row i of every sequence (rows n * B + i) takes the Markov bias of the id drawn from its
      // row i - 1: the embedding rows gathered, one GEMM for all, added to the strided rows.
      // Each row's ids in their own part of the pinned buffer: the copy reads it when it runs,
      // and with every row forced no draw waits for it before the next row's ids are written.
      std::int32_t* row_ids_host = markov_ids_host_.data() + std::size_t(i) * std::size_t(max_batch_);
      for (int n = 0; n < N; ++n) row_ids_host[n] = out[std::size_t(n)].ids[std::size_t(i)];
      DSV4_CUDA_CHECK(cudaMemcpyAsync(markov_ids_.data(), row_ids_host, std::size_t(N) * sizeof(std::int32_t),
                                      cudaMemcpyHostToDevice, stream()));
      runtime::launch_programmatic(gather_rows_kernel, dim3(blocks_for(1LL * N * rank_)), dim3(256), 0, stream(),
                                   static_cast<const float*>(markov_embed_.data()),
                                   static_cast<const std::int32_t*>(markov_ids_.data()), rank_, N, markov_rows_.data());
      DSV4_CUDA_CHECK_LAUNCH();
      kernels::gemm::linear_fp32(m_.blas(), markov_rows_.data(), markov_head_.data(), bias_.data(), N, c.vocab_size, rank_,
                                 stream());
      float* rows = logits_.data() + std::size_t(i) * V;
      const long long row_stride = static_cast<long long>(B) * c.vocab_size;
      runtime::launch_programmatic(add_bias_kernel, dim3(blocks_for(1LL * N * c.vocab_size)), dim3(256), 0, stream(), rows,
                                   row_stride, static_cast<const float*>(bias_.data()), static_cast<long long>(c.vocab_size),
                                   static_cast<long long>(N));
      DSV4_CUDA_CHECK_LAUNCH();
      draws.clear();
      std::vector<int> drawn_at;  // the sequences whose row i is drawn, not forced
      for (int n = 0; n < N; ++n) {
        const step& s = steps[std::size_t(n)];
        if (s.forced.empty()) {
          draws.push_back({s.sampling, s.sequence, std::uint64_t(p[std::size_t(n)] + 2 + i)});
          drawn_at.push_back(n);
        } else {
          out[std::size_t(n)].ids[std::size_t(i) + 1] = s.forced[std::size_t(i) + 1];
        }
      }
      if (!draws.empty()) {  // drawn on the device (the host sampler's draw, bit for bit) from the rows gathered into bias_
        for (std::size_t d = 0; d < drawn_at.size(); ++d)
          DSV4_CUDA_CHECK(cudaMemcpyAsync(bias_.data() + d * V, rows + std::size_t(drawn_at[d]) * std::size_t(row_stride),
                                          V * sizeof(float), cudaMemcpyDeviceToDevice, stream()));
        const auto drawn = sampler_->sample(bias_.data(), c.vocab_size, draws, stream());
        for (std::size_t d = 0; d < drawn_at.size(); ++d) out[std::size_t(drawn_at[d])].ids[std::size_t(i) + 1] = drawn[d];
      }
    }
    if (copy_logits) {  // the draft rows' logits, for the caller (one copy after the chain)
      if (logits_host_.size() < std::size_t(NB) * V) logits_host_ = runtime::pinned_buffer<float>(std::size_t(NB) * V);
      DSV4_CUDA_CHECK(cudaMemcpyAsync(logits_host_.data(), logits_.data(), std::size_t(NB) * V * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream()));
      DSV4_CUDA_CHECK(cudaStreamSynchronize(stream()));
      for (int n = 0; n < N; ++n)
        out[std::size_t(n)].logits.assign(logits_host_.data() + std::size_t(n) * B * V,
                                          logits_host_.data() + std::size_t(n + 1) * B * V);
    }
    inputs_.begin_pack();
    std::vector<std::int32_t> row_ids;
    for (const auto& d : out) row_ids.insert(row_ids.end(), d.ids.begin(), d.ids.begin() + B);
    const std::int32_t* row_ids_d = inputs_.put(std::span<const std::int32_t>(row_ids), max_nb, "draft row ids");
    inputs_.upload(stream());
    runtime::launch_programmatic(confidence_kernel, dim3(unsigned(NB)), dim3(256), 0, stream(),
                                 static_cast<const bf16*>(xpre_.data()),
                                 static_cast<const float*>(markov_embed_.data()), row_ids_d,
                                 static_cast<const float*>(confidence_.data()), c.dim, rank_, conf_.data());
    DSV4_CUDA_CHECK_LAUNCH();
    DSV4_CUDA_CHECK(cudaMemcpyAsync(conf_host_.data(), conf_.data(), std::size_t(NB) * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream()));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream()));
    for (int n = 0; n < N; ++n) {
      out[std::size_t(n)].confidence.assign(conf_host_.data() + std::size_t(n) * B, conf_host_.data() + std::size_t(n + 1) * B);
      lengths_[std::size_t(steps[std::size_t(n)].slot)] = lengths_before[std::size_t(n)] + advance[std::size_t(n)];
    }
    return out;
  }


 private:
  struct stage {
    kernels::attention::device_detail::fp8_weight wq_a, wq_b, wkv, wo_b;
    runtime::device_buffer<bf16> q_norm, kv_norm, wo_a;
    kernels::attention::device_detail::wo_a_fp8_buffers wo_a_fp8;
    runtime::device_buffer<float> sink;
    device_detail::device_block block;
    runtime::device_buffer<std::uint8_t> ring;  //!< [max_seqs, window] FP8 window entries
  };

  device_model<Model>& m_;
  int max_seqs_ = 0, max_batch_ = 1, block_ = 0, noise_ = 0, rank_ = 0;
  std::vector<stage> stages_;
  kernels::moe::moe_shape moe_shape_;
  kernels::attention::device_detail::fp8_weight main_proj_;
  runtime::device_buffer<bf16> main_norm_, norm_;
  runtime::device_buffer<float> markov_embed_, markov_head_, confidence_, freqs_;
  runtime::device_buffer<std::uint8_t> mh_codes_, mh_scales_, x_codes_, x_scales_, qr_codes_, qr_scales_,
      chunk_kv_;
  runtime::device_buffer<bf16> main_x_, kv_, qr_, q_, o_, x_, y_, h_, sub_, xpre_;
  runtime::device_buffer<float> a_pre_, a_post_, a_comb_, f_pre_, f_post_, f_comb_, one_hot_, logits_, bias_,
      conf_, markov_rows_;
  runtime::pinned_buffer<float> logits_host_, conf_host_;
  //! The Markov chain's ids, [block, max_batch] (row i's part: one id per sequence), and the
  //! device copy of the current row's.
  runtime::pinned_buffer<std::int32_t> markov_ids_host_;
  runtime::device_buffer<std::int32_t> markov_ids_;
  //! One draft row of each sequence at a time (the Markov chain); sized in the constructor.
  std::optional<kernels::sampling::device_sampler> sampler_;
  runtime::upload_arena inputs_;
  std::optional<kernels::gemm::gemm_workspace> gemm_ws_;
  std::optional<kernels::output::output_workspace> out_ws_;
  std::optional<kernels::attention::sparse_attention_workspace> attn_ws_;
  std::optional<kernels::mhc::mhc_workspace> mhc_ws_;
  std::optional<kernels::moe::moe_workspace> moe_ws_;
  std::vector<long long> lengths_;

  cudaStream_t stream() const { return m_.stream(); }
  static unsigned blocks_for(long long n) { return unsigned((n + 255) / 256); }
  int check_slot(int slot, const char* what) const {
    if (slot < 0 || slot >= max_seqs_)
      throw error(std::string("device_dspark::") + what + ": no sequence slot " + std::to_string(slot) +
                  " (max_seqs " + std::to_string(max_seqs_) + ")");
    return slot;
  }
  void check_rows(const bf16* main_hidden, long long rows, const char* what) const {
    if (!main_hidden) throw error(std::string("device_dspark::") + what + ": null main_hidden");
    if (rows <= 0 || rows > sh.window)
      throw error(std::string("device_dspark::") + what + ": " + std::to_string(rows) +
                  " main_hidden rows, expected 1 .. window (" + std::to_string(sh.window) +
                  "): only the last window positions reach the rings");
  }
  std::uint8_t* ring_of(stage& st, int slot) {
    return st.ring.data() + std::size_t(slot) * sh.window * window_layout::bytes;
  }
  const std::int64_t* put_positions(long long first, long long n) {
    std::vector<std::int64_t> positions(static_cast<std::size_t>(n));
    std::iota(positions.begin(), positions.end(), static_cast<std::int64_t>(first));
    return inputs_.put(std::span<const std::int64_t>(positions),
                       static_cast<std::size_t>(std::max(sh.window, block_)), "positions");
  }
  void linear(const kernels::attention::device_detail::fp8_weight& w, long long rows, const std::uint8_t* a,
              const std::uint8_t* as, bf16* y) {
    kernels::gemm::block_scaled_linear({{int(rows), w.n, w.k}, a, as, w.codes.data(), w.scales.data(), y},
                                       kernels::gemm::weight_format::fp8_tile32, &*gemm_ws_, m_.blas(),
                                       stream());
  }
  //! x = rmsnorm(x) * w in place, rows of `dim`, and its act_quant (window_format) in one launch.
  void norm_quantize(bf16* x, const bf16* w, long long rows, int dim, std::uint8_t* codes,
                     std::uint8_t* scales) {
    static_assert(std::is_same_v<window_format, numerics::fp8_act_format>,
                  "device_dspark: the fused norm + act_quant writes fp8_act_format codes");
    kernels::norm::rmsnorm_args<bf16> a{x, dim, w, x, dim, rows, dim, c.norm_eps};
    a.codes = codes, a.codes_stride = dim, a.scales = scales, a.scales_stride = dim / 32;
    kernels::norm::rmsnorm_quantized(a, stream());
  }
  //! main_x = main_norm(main_proj(main_hidden)) of `rows` rows, then each stage's main_kv of them
  //! into its ring of `slot` at `pos` (rows <= window: no two rows share a slot).
  void write_rings(int slot, const bf16* main_hidden, long long rows, const std::int64_t* pos) {
    const int K = targets * c.dim;
    numerics::quantize<window_format>(
        {main_hidden, rows, K, K, mh_codes_.data(), K, mh_scales_.data(), K / 32}, stream());
    linear(main_proj_, rows, mh_codes_.data(), mh_scales_.data(), main_x_.data());
    norm_quantize(main_x_.data(), main_norm_.data(), rows, c.dim, x_codes_.data(), x_scales_.data());
    for (auto& st : stages_) {
      linear(st.wkv, rows, x_codes_.data(), x_scales_.data(), kv_.data());
      pack_window(st, rows, pos, ring_destination(st, slot));
    }
  }
  kernels::compressor::entry_destination ring_destination(stage& st, int slot) {
    kernels::compressor::entry_destination d;
    d.mode = kernels::compressor::entry_store::ring;
    d.base = ring_of(st, slot);
    d.entry_stride = window_layout::bytes;
    d.seq_stride = 0;
    d.ring_rows = sh.window;
    return d;
  }
  //! kv_ rows -> FP8 window entries: FP8QDQ(RoPE(kv_norm(kv))) at `pos`.
  void pack_window(stage& st, long long rows, const std::int64_t* pos,
                   const kernels::compressor::entry_destination& dst) {
    kernels::compressor::pack_entries<window_format, head_dim, bf16>(
        {kv_.data(), head_dim, rows, st.kv_norm.data(), c.norm_eps, pos, nullptr, freqs_.data(),
         sh.rope_dim / 2, dst},
        stream());
  }
  //! DSparkAttention of the draft rows (h_, `seqs` sequences of block rows) into sub_ (see the
  //! file comment): sequence n reads its ring `slots[n]`, then its own draft rows (from row first[n]).
  void attention(stage& st, int seqs, const std::int32_t* slots, const std::int32_t* first, const std::int64_t* draft_pos,
                 const std::int32_t* idx, int topk) {
    const int B = seqs * block_, pairs = sh.rope_dim / 2;
    numerics::quantize<window_format>(
        {h_.data(), B, c.dim, c.dim, x_codes_.data(), c.dim, x_scales_.data(), c.dim / 32}, stream());
    linear(st.wq_a, B, x_codes_.data(), x_scales_.data(), qr_.data());
    norm_quantize(qr_.data(), st.q_norm.data(), B, sh.q_lora, qr_codes_.data(), qr_scales_.data());
    linear(st.wq_b, B, qr_codes_.data(), qr_scales_.data(), q_.data());
    kernels::rope::apply_rope({q_.data(), draft_pos, freqs_.data(), B, sh.heads, head_dim, pairs, false},
                              stream());
    linear(st.wkv, B, x_codes_.data(), x_scales_.data(), kv_.data());
    kernels::compressor::entry_destination rows_dst;
    rows_dst.mode = kernels::compressor::entry_store::rows;
    rows_dst.base = chunk_kv_.data();
    rows_dst.entry_stride = window_layout::bytes;
    pack_window(st, B, draft_pos, rows_dst);
    operand_t kv;
    kv.window.base = st.ring.data();
    kv.window.rows = sh.window;
    kv.window.seq_stride = 1LL * sh.window * window_layout::bytes;
    kv.window.slots = slots;
    kv.chunk = chunk_kv_.data();
    kv.chunk_rows = block_;
    kv.chunk_first = first;
    kernels::attention::sparse_attention_args a;
    a.q = q_.data(), a.idx = idx, a.sink = st.sink.data(), a.out = o_.data();
    a.batch = seqs, a.rows = block_, a.heads = sh.heads, a.topk = topk;
    a.scale = float(std::pow(double(head_dim), -0.5));
    kernels::attention::sparse_attention<head_dim>(a, kv, stream(), &*attn_ws_);
    kernels::output::attention_output(o_.data(), draft_pos, B, freqs_.data(), sh.rope_dim, st.wo_a.data(),
                                      st.wo_b.codes.data(), st.wo_b.scales.data(), sub_.data(), *out_ws_,
                                      m_.blas(), stream(), st.wo_a_fp8.view());
  }
};

}  // namespace dsv4::model
