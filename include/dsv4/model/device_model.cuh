#pragma once
//! \file
//! The whole model on CUDA (spec §13 Transformer.forward, text tokens): the same computation as
//! model_reference.hpp, on the device kernels, for many sequences at once.
//!   embedding -> 4 streams; per layer: [Engram] -> boundary (mHC step: hc_post of the previous
//!   FFN, hc_pre, attn_norm, attention mixes) -> CSA2 attention (attention_stack) -> boundary
//!   (hc_post, hc_pre, ffn_norm, FFN mixes) -> MoE; final boundary (hc_post, collapse, norm);
//!   fp32 head.
//! Each mHC boundary is one fused launch (kernels/mhc/mhc_step.cuh). Before an Engram layer the
//! boundary is split in two (apply hc_post, run Engram on the new streams, then hc_pre and the
//! mixes), because Engram changes the streams the mixes read.
//!
//! Weights are taken from a loaded host_model (which has checked every tensor of the checkpoint)
//! and uploaded once: FP8 / FP4 weights in the GEMMs' MMA-tile layout, Engram tables in device
//! memory. A call is a prefill of one new sequence, one decode token for each of a batch of
//! sequences (different lengths allowed), or a chunk appended to one sequence (exact mode); it
//! returns fp32 logits, as the host model does.
//! `prefill_ced` is the CED prefill (encoder over the prompt, decoder replay of its last window);
//! `append_ced` the CED append (encoder over the chunk, decoder replay of the sequence's last
//! window from the per-sequence tail that limits::ced_appends keeps).
//!
//! Streams and synchronization: the model owns one non-blocking stream, and every launch, cuBLAS
//! call and copy of a call runs on it (the attention stack and both cuBLAS handles are bound to
//! it at construction). A call's token ids and Engram hashes go up in one cudaMemcpyAsync from
//! pinned staging (runtime/upload_arena.cuh), the attention stack's metadata in another; the one
//! point where the host waits for the device is the end of the call, when the logits come back
//! through a pinned buffer (cudaStreamSynchronize). The observer (parity work) also waits.
//! Engram tables can stay in host memory (limits::engram_host_tables; V4.1's are ~100 GB each).
//!
//! Tensor parallelism (issue 7): built from a parallel::rank_model (one rank's checkpoint shard)
//! and a parallel::device_collectives, the model is one rank of W and computes what model.py's
//! rank computes, with its collectives at the same points as the host simulation
//! (parallel/tensor_parallel_reference.hpp): the embedding's vocabulary slice (other ids give zero
//! rows) then a bf16 all-reduce; the Engram table's row slice then a bf16 all-reduce of the
//! gathered rows; the attention with the rank's heads, groups and index heads, the index scores
//! all-reduced (bf16) before the candidate pool and the top-k, wo_b's bf16 partial summed in fp32
//! and rounded once; the MoE's routed experts of the rank (an expert slice) summed in fp32 over
//! the ranks, then the replicated shared expert, one rounding; the head's vocabulary slice, then
//! an all-gather. Everything else is replicated: every rank computes it, with its own caches.
//! Each rank's calls run on a thread of their own (parallel/tp_device_model.cuh drives them).
//! Not here yet: DSpark stages, images.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/engram/engram.cuh"
#include "dsv4/engram/hash.hpp"
#include "dsv4/engram/host_fetch.cuh"
#include "dsv4/kernels/attention/layer.cuh"
#include "dsv4/kernels/gemm/dense.cuh"
#include "dsv4/kernels/gemm/weight_tiles.hpp"
#include "dsv4/kernels/mhc/mhc_step.cuh"
#include "dsv4/kernels/moe/moe.cuh"
#include "dsv4/kernels/sampling/sampling.cuh"
#include "dsv4/model/device_block.cuh"
#include "dsv4/model/model_reference.hpp"
#include "dsv4/numerics/convert.cuh"
#include "dsv4/parallel/device_collectives.cuh"
#include "dsv4/parallel/tensor_parallel_reference.hpp"
#include "dsv4/runtime/device_buffer.cuh"
#include "dsv4/runtime/pdl.cuh"
#include "dsv4/runtime/pinned_buffer.cuh"
#include "dsv4/runtime/prepare_ahead.hpp"
#include "dsv4/runtime/segment_graph.cuh"
#include "dsv4/runtime/stream.cuh"
#include "dsv4/runtime/upload_arena.cuh"

namespace dsv4::model {

namespace device_detail {
using runtime::device_buffer;

//! x [tokens, streams, dim] <- the table rows of the ids, each copied to every stream. The table
//! holds vocabulary rows [first, first + rows) (a tensor-parallel rank's slice): other ids give
//! zero rows.
DSV4_KERNEL void embed_kernel(const bf16* table, long long first, long long rows, const std::int32_t* ids, long long tokens,
                              int dim, int streams, bf16* x) {
  runtime::start_after_previous_grid();
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * streams * dim) return;
  const long long t = i / (1LL * streams * dim);
  const int d = int(i % dim);
  const long long row = ids[t] - first;
  x[i] = row >= 0 && row < rows ? table[row * dim + d] : bf16::from_float(0.0f);
}
//! x [tokens, streams, dim] <- e [tokens, dim] in every stream.
DSV4_KERNEL void spread_kernel(const bf16* e, long long tokens, int dim, int streams, bf16* x) {
  runtime::start_after_previous_grid();
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * streams * dim) return;
  x[i] = e[i / (1LL * streams * dim) * dim + i % dim];
}
//! Rows of a [*, width] array to rows of another: out[out_rows[r]] = in[in_rows[r]] for r < rows
//! (a null map is the identity; a row mapped to -1 is skipped). Keeps and reads back the encoder
//! tail of CED appends.
template <class T>
DSV4_KERNEL void copy_rows_kernel(const T* in, const std::int32_t* in_rows, T* out, const std::int32_t* out_rows, long long rows,
                                  long long width) {
  runtime::start_after_previous_grid();
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * width) return;
  const long long r = i / width, k = i % width;
  const long long src = in_rows ? in_rows[r] : r, dst = out_rows ? out_rows[r] : r;
  if (src < 0 || dst < 0) return;
  out[dst * width + k] = in[src * width + k];
}
//! DSpark's input (spec §13 main_hidden; 4 streams, asserted by device_model): out[t, d] =
//! bf16((((0 + x0) + x1) + x2) + x3) * 0.25), the
//! mean of the four streams of row first + t, summed in stream order as model_reference.hpp's
//! capture does; rows `out_stride` elements apart (one target layer's slot of [rows, targets * dim]).
DSV4_KERNEL void stream_mean_kernel(const bf16* x, long long first, long long rows, int dim, int streams, bf16* out,
                                    long long out_stride) {
  runtime::start_after_previous_grid();
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * dim) return;
  const long long t = i / dim;
  const int d = int(i % dim);
  float sum = 0.0f;
  for (int r = 0; r < streams; ++r) sum = __fadd_rn(sum, x[((first + t) * streams + r) * dim + d].to_float());
  out[t * out_stride + d] = bf16::from_float(__fmul_rn(sum, 0.25f));
}
}  // namespace device_detail

template <class Model>
class device_model {
 public:
  using sched = typename models::model_traits<Model>::schedule;
  static constexpr models::model_config c = Model::dims;
  static constexpr int hc = kernels::mhc::hc;
  static constexpr int head_dim = c.attn.head_dim;
  static constexpr int index_dim = c.indexer.index_head_dim;
  static_assert(c.mhc.hc_mult == hc, "device_model: the mHC kernels are written for 4 streams");
  using stack_t = kernels::attention::attention_stack<head_dim, index_dim>;

  struct limits {
    int max_seqs = 4;          //!< sequences alive at once
    int max_rows = 256;        //!< tokens of one call (prefill length, decode batch)
    long long max_tokens = 1024;  //!< tokens per sequence
    int page_tokens = 64;      //!< global-cache page size
    //! Engram tables stay in host memory (the host model's, which must then outlive this model):
    //! each call's rows are gathered on the host and copied ahead of the Engram layer on a side
    //! stream (engram/host_fetch.cuh); same results as tables in device memory, bit for bit.
    bool engram_host_tables = false;
    //! CED appends (append_ced): every call keeps, per sequence, the first decoder layer's input
    //! over its last `window` positions (the streams, the attention input and the mixes: window x
    //! (5 dim bf16 + 24 fp32) per sequence), from which a CED append replays the decoder.
    bool ced_appends = false;
    //! Rows of logits one call may return (append_all: a speculative round's verification); 0:
    //! min(max_rows, max_seqs), one per sequence of a decode batch.
    int logit_rows = 0;
    //! Host threads converting the weights while the model is built (runtime::prepare_threads;
    //! 0: the hardware's, at most 8). Each holds one layer's converted copy until it is uploaded.
    int load_threads = 0;
  };

  //! The whole model on the current device, from a loaded host model.
  device_model(const host_model<Model>& m, const limits& lim) : device_model(m, lim, nullptr) {}
  //! Rank comm.rank() of a tensor-parallel world of comm.size() ranks, on the current device, from
  //! the rank's shard (see the file comment). `comm` must outlive the model; the rank's calls
  //! must come from one thread at a time with this device current, and every rank must make the
  //! same calls in the same order.
  device_model(const parallel::rank_model<Model>& m, const limits& lim, parallel::device_collectives& comm)
      : device_model(m, lim, &comm) {}

 private:
  template <class Weights>
  device_model(const Weights& m, const limits& lim, parallel::device_collectives* comm)
      : lim_(lim), token_map_(m.token_map), hashes_(m.hashes), comm_(comm), stream_(runtime::owned_stream::non_blocking()) {
    using namespace device_detail;
    namespace gm = kernels::gemm;
    const int L = sched::num_layers;
    const int ranks = comm ? comm->size() : 1, rank_id = comm ? comm->rank() : 0;
    if constexpr (requires { m.world; }) {
      if (m.world != ranks || m.rank != rank_id)
        throw error("device_model: the shard is rank " + std::to_string(m.rank) + " of " + std::to_string(m.world) +
                    ", the collectives rank " + std::to_string(rank_id) + " of " + std::to_string(ranks));
    }
    if (ranks > 1 && lim.engram_host_tables && !m.engrams.empty())
      throw error("device_model: Engram tables in host memory are not supported on a tensor-parallel rank yet "
                  "(limits::engram_host_tables with " + std::to_string(ranks) + " ranks)");
    vocab_part_ = c.vocab_size / ranks, vocab_first_ = rank_id * vocab_part_;
    expert_count_ = c.moe.n_routed_experts / ranks, expert_first_ = rank_id * expert_count_;
    if (m.embed.size() != std::size_t(vocab_part_) * c.dim || m.head.size() != std::size_t(vocab_part_) * c.dim)
      throw error("device_model: embed / head hold " + std::to_string(m.embed.size() / c.dim) + " / " +
                  std::to_string(m.head.size() / c.dim) + " vocabulary rows, rank " + std::to_string(rank_id) + " of " +
                  std::to_string(ranks) + " needs " + std::to_string(vocab_part_));
    for (int l = 0; l < L; ++l)
      if (m.blocks[std::size_t(l)].experts.size() != std::size_t(expert_count_))
        throw error("device_model: layer " + std::to_string(l) + " holds " + std::to_string(m.blocks[std::size_t(l)].experts.size()) +
                    " routed experts, rank " + std::to_string(rank_id) + " of " + std::to_string(ranks) + " needs " +
                    std::to_string(expert_count_));
    for (int l = 0; l < L; ++l) {  // (device_detail::require_bf16: why)
      const block_weights& b = m.blocks[std::size_t(l)];
      const std::string p = "layers." + std::to_string(l) + ".";
      require_bf16(b.gate.weight, "device_model", p + "ffn.gate.weight");
      if (m.wiring[std::size_t(l)].role == schedule::attn_role::full && m.wiring[std::size_t(l)].ratio == 1)
        require_bf16(b.attn.compressor.wkv, "device_model", p + "attn.compressor.wkv.weight");
    }
    // The embedding's and the head's bf16 copies (1.3 GB each at V4.1 widths) are converted on
    // two threads of their own while the attention stack is built (runtime/prepare_ahead.hpp:
    // why); the copies to the device stay on this thread. The head's fp32 GEMM takes bf16
    // operands (linear_bf16_f32out: exact products, half the bytes of an fp32 copy) when the
    // checkpoint's head holds bf16 values, as the official one does; an F32 head with finer
    // values keeps the fp32 copy and cuBLAS's fp32 GEMM (no bf16 copy: nullopt).
    auto embed16 = std::async(std::launch::async, [&] { return numerics::to_bf16(m.embed); });
    auto head16 = std::async(std::launch::async, [&]() -> std::optional<std::vector<bf16>> {
      if (!holds_bf16_values(m.head)) return std::nullopt;
      return numerics::to_bf16(m.head);
    });
    std::vector<float> local, compressed;
    std::vector<kernels::attention::layer_weights> attn;
    for (int l = 0; l < L; ++l) {
      (m.wiring[std::size_t(l)].ratio > 0 ? compressed : local) = m.freqs[std::size_t(l)];
      attn.push_back(m.blocks[std::size_t(l)].attn);
    }
    typename stack_t::limits sl;
    sl.max_seqs = lim.max_seqs, sl.max_rows = lim.max_rows, sl.max_tokens = lim.max_tokens, sl.page_tokens = lim.page_tokens;
    sl.load_threads = lim.load_threads;
    stack_.emplace(parallel::rank_attention_shape<Model>(ranks), m.wiring, attn, local, compressed, sl, stream());
    attn.clear();
    if (comm_)  // model.py's all_reduce of the index scores, bf16
      stack_->set_index_score_sum([comm](bf16* v, std::size_t n, cudaStream_t st) { comm->all_reduce_sum(v, n, st); });

    embed_ = upload(embed16.get());
    if (const auto h = head16.get())
      head16_ = upload(*h);
    else
      head_ = upload(m.head);
    norm_ = upload_bf16(m.norm);
    runtime::prepare_ahead(  // each block converted on worker threads ahead of its copies
        L, runtime::prepare_threads(lim.load_threads),
        [&](int l) { return device_block::convert(m.blocks[std::size_t(l)], c.dim); },
        [&](int l, const device_block::host_form& h) {
          blocks_.push_back(device_block::to_device(h, m.blocks[std::size_t(l)]));
        });
    for (std::size_t j = 0; j < m.engrams.size(); ++j) {
      const auto& e = m.engrams[j];
      device_engram d;
      if (lim.engram_host_tables)
        d.fetch = std::make_unique<engram::host_table_fetch>(
            engram::host_table{e.table_codes().data(), e.table_scales().data(), e.rows, e.head_dim},
            static_cast<long long>(lim.max_rows) * e.columns);
      else
        d.embed = upload(e.table_codes()), d.embed_scale = upload(e.table_scales());
      const auto t = gm::tile_weight(gm::weight_format::fp8_tile32, e.dim * (e.hc + 1), e.columns * e.head_dim, e.wkv, e.wkv_scale);
      d.wkv = upload(t.codes), d.wkv_scale = upload(t.scales);
      std::vector<float> qk(e.q_weight.size());
      for (std::size_t i = 0; i < qk.size(); ++i) qk[i] = numerics::mul_rn(e.q_weight[i], e.k_weight[i]);
      d.qk = upload(qk);
      d.view.hc = e.hc, d.view.dim = e.dim, d.view.head_dim = e.head_dim, d.view.columns = e.columns, d.view.rows = e.rows;
      d.view.embed = d.embed.data(), d.view.embed_scale = d.embed_scale.data(), d.view.wkv = d.wkv.data();
      d.view.wkv_scale = d.wkv_scale.data(), d.view.qk_weight = d.qk.data(), d.view.eps = e.eps;
      if (comm_) d.view.first_row = rank_id * e.rows, d.view.table_rows = Model::engram_num_embeddings[j];
      d.ws.emplace(d.view, lim.max_rows);
      engrams_.push_back(std::move(d));
    }

    const std::size_t R = std::size_t(lim.max_rows), D = std::size_t(c.dim);
    x_ = device_buffer<bf16>(R * hc * D), y_ = device_buffer<bf16>(R * hc * D);
    h_ = device_buffer<bf16>(R * D), sub_ = device_buffer<bf16>(R * D);
    // Logits are computed for one row per sequence of a call (a prefill's last row, one per decode entry).
    hf_ = device_buffer<float>(R * D);
    if (lim.logit_rows < 0 || lim.logit_rows > lim.max_rows)
      throw error("device_model: limits::logit_rows must lie in 0 .. max_rows (" + std::to_string(lim.max_rows) + ")");
    logit_rows_ = std::max(std::min(lim.max_rows, lim.max_seqs), lim.logit_rows);
    logits_ = device_buffer<float>(std::size_t(logit_rows_) * std::size_t(c.vocab_size));
    if (comm_) logits_part_ = device_buffer<float>(std::size_t(logit_rows_) * std::size_t(vocab_part_));
    logits_host_ = runtime::pinned_buffer<float>(logits_.size());
    // A call's inputs: token ids [rows], then each Engram module's hashes [rows, columns].
    std::size_t input_bytes = runtime::upload_arena::space<std::int32_t>(R);
    if (lim.ced_appends) input_bytes += 2 * runtime::upload_arena::space<std::int32_t>(R);  // the tail's row maps
    for (const auto& e : engrams_) input_bytes += runtime::upload_arena::space<std::int64_t>(R * std::size_t(e.view.columns));
    inputs_ = runtime::upload_arena(input_bytes, "device_model call inputs");
    std::vector<float> one_hot(R * hc, 0.0f);
    for (std::size_t t = 0; t < R; ++t) one_hot[t * hc] = 1.0f;
    entry_pre_ = upload(one_hot);
    for (auto* b : {&a_pre_, &a_post_, &f_pre_, &f_post_}) *b = device_buffer<float>(R * hc);
    a_comb_ = device_buffer<float>(R * hc * hc), f_comb_ = device_buffer<float>(R * hc * hc);
    if (lim.ced_appends && !ced_prefill_possible<sched>())
      throw error("device_model: limits::ced_appends needs a schedule whose decoder KV owner is the first decoder layer "
                  "(CED prefill and appends are not possible with this one)");
    if (lim.ced_appends) {
      const std::size_t T = std::size_t(lim.max_seqs) * std::size_t(c.attn.window_size);
      tail_x_ = device_buffer<bf16>(T * hc * D), tail_h_ = device_buffer<bf16>(T * D);
      tail_pre_ = device_buffer<float>(T * hc), tail_post_ = device_buffer<float>(T * hc);
      tail_comb_ = device_buffer<float>(T * hc * hc);
    }
    mhc_ws_.emplace(lim.max_rows, c.dim);
    kernels::moe::moe_shape ms{c.moe.n_routed_experts, c.moe.n_activated_experts, c.dim, c.moe.moe_inter_dim,
                               c.moe.route_scale, c.moe.gate_temp, c.moe.swiglu_limit, c.moe.norm_topk_prob};
    moe_ws_.emplace(ms, lim.max_rows);
    // h's act_quant, written by the boundaries beside h (boundary, act_of); its f16 copy for the
    // MoE's call sizes that read one.
    h_codes_ = device_buffer<std::uint8_t>(R * D), h_scales_ = device_buffer<std::uint8_t>(R * D / 32);
    h_codes_f16_ = device_buffer<std::uint16_t>(std::size_t(moe_ws_->f16_tokens()) * D);
    kernels::gemm::detail::blas_check(cublasCreate(&blas_), "device_model: cublasCreate");
    // Once here: blas_call (dense.cuh) then never switches it (which would drop a set workspace).
    kernels::gemm::detail::blas_check(cublasSetStream(blas_, stream()), "device_model: cublasSetStream");
    blas_workspace_ = device_buffer<std::uint8_t>(kernels::gemm::detail::owned_workspace_bytes);
    kernels::gemm::detail::blas_check(cublasSetWorkspace(blas_, blas_workspace_.data(), blas_workspace_.size()),
                                      "device_model: cublasSetWorkspace");
    histories_.assign(std::size_t(lim.max_seqs), {});
    // The weights above went up by legacy-stream copies (device_buffer), which the non-blocking
    // stream is not ordered after.
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  }

 public:
  ~device_model() {
    cudaStreamSynchronize(stream());  // kernels of a failed call may still read the buffers freed next
    if (blas_) cublasDestroy(blas_);
  }
  device_model(const device_model&) = delete;
  device_model& operator=(const device_model&) = delete;

  int add_sequence() {
    const int s = stack_->add_sequence();
    histories_[std::size_t(s)].assign(engrams_.size(), {});
    return s;
  }
  void release_sequence(int slot) { stack_->release_sequence(slot); }
  //! A new sequence that continues from where sequence `from` stands (its caches, window rings,
  //! compressor states, Engram histories and CED tail copied on the model's stream); returns its
  //! slot. For several samples of one prompt or the branches of a conversation: one prefill, then
  //! copies. Between calls only. Not copied: a DSpark drafter's state for the sequence (the
  //! drafter keeps its own per slot; prefill it for the copy before drafting for it), and nothing
  //! random: draws for the copy with the original's row_request (params seed, `sequence`, `step`)
  //! repeat the original's tokens, so give each copy its own `sequence` number.
  int copy_sequence(int from) {
    check_idle();
    const int to = stack_->copy_sequence(from);
    try {
      histories_[std::size_t(to)] = histories_.at(std::size_t(from));
      if (lim_.ced_appends) tail_copy_between(from, to);
    } catch (...) {
      stack_->release_sequence(to);
      throw;
    }
    return to;
  }
  long long length(int slot) const { return stack_->length(slot); }
  stack_t& attention() { return *stack_; }
  //! Per Engram module, what its host-table fetches cost (empty without limits::engram_host_tables).
  std::vector<engram::fetch_stats> engram_fetch_stats() const {
    std::vector<engram::fetch_stats> v;
    for (const auto& e : engrams_)
      if (e.fetch) v.push_back(e.fetch->stats());
    return v;
  }
  //! The stream all of the model's work runs on.
  cudaStream_t stream() const { return stream_.get(); }
  //! Host seconds the last call took from its begin_* until every launch of its forward was
  //! issued (before its wait for the device). Against the call's wall time it says whether a
  //! step is bound by the host's launches (bench_model --issue-time).
  double last_issue_seconds() const { return last_issue_s_; }
  //! This model's rank and world size (0 and 1 without collectives).
  int rank() const { return comm_ ? comm_->rank() : 0; }
  int world() const { return comm_ ? comm_->size() : 1; }
  //! limits::max_rows: the most rows of one call (and of head_logits).
  int max_rows() const { return lim_.max_rows; }
  //! limits::max_seqs and max_tokens: sequence slots 0 .. max_seqs() - 1, tokens per sequence.
  int max_seqs() const { return lim_.max_seqs; }
  long long max_tokens() const { return lim_.max_tokens; }
  //! The most rows of logits one call returns (append_all; limits::logit_rows).
  int logit_rows() const { return logit_rows_; }
  //! Calls `observe` with each block's intermediates (block_reference.hpp's stages), copied to the
  //! host after a device synchronization: for parity work only, it serializes the forward.
  void set_observer(layer_observer observe) { observe_ = std::move(observe); }

  //! Decode steps through captured CUDA graphs (runtime/segment_graph.cuh): per batch size, after
  //! one plain step, the stretches of a step whose launches depend only on the batch size (all
  //! but each layer's global branch and attention core) are captured once and then replayed by
  //! one graph launch each, while the host checks that it would have issued exactly the captured
  //! launches (otherwise it issues them itself). Results are those of plain steps, bit for bit.
  //! Not on a tensor-parallel rank, not with an observer (both keep plain steps).
  void set_decode_graphs(bool on) {
    check_idle();
    if (on && !segments_) segments_.emplace(stream());
    if (!on) segments_.reset();
    stack_->set_segments(nullptr);
  }
  bool decode_graphs() const { return segments_.has_value(); }
  //! Segments replayed, captured, diverged and plain so far (set_decode_graphs).
  runtime::segment_graphs::counts decode_graph_counts() const {
    return segments_ ? segments_->stats() : runtime::segment_graphs::counts{};
  }

  //! From the next call on, keeps DSpark's input (spec §13 main_hidden: the mean of the four
  //! streams entering each target layer, [rows, targets * dim] bf16) in device memory: for a
  //! prefill, an append or a CED prefill the last min(tokens, window) rows of the call (all a
  //! drafter's rings keep); after a CED append the replayed rows, i.e. the sequence's last
  //! min(length, window) positions, of which the chunk's are the last min(chunk, window); for a
  //! decode batch one row per entry in the order given; for appends to several sequences every
  //! row of the call, in the call's order. Read with main_hidden() /
  //! main_hidden_rows() until the next call (0 rows after a failed one). Not on a
  //! tensor-parallel rank.
  void capture_main_hidden(bool on) {
    check_idle();
    if constexpr (sched::drafter::stages == 0) {
      if (on) throw error(std::string("device_model::capture_main_hidden: ") + Model::name + " has no DSpark stages");
    } else {
      if (on && comm_) throw error("device_model::capture_main_hidden: not supported on a tensor-parallel rank yet");
      if (on && !main_hidden_.size()) {
        // A prefill keeps its last window rows, a decode step one per sequence, appends to
        // several sequences all of their rows (at most logit_rows_, which covers a decode batch).
        const std::size_t rows = std::size_t(std::max(c.attn.window_size, logit_rows_));
        main_hidden_ = runtime::device_buffer<bf16>(rows * std::size_t(sched::drafter::targets::size) * std::size_t(c.dim));
      }
    }
    capture_ = on;
    main_hidden_rows_ = 0;
  }
  //! The last call's main_hidden rows (capture_main_hidden), row r at r * targets * dim.
  const bf16* main_hidden() const { return main_hidden_.data(); }
  long long main_hidden_rows() const { return main_hidden_rows_; }
  //! The token embedding [vocab, dim] bf16 (the whole vocabulary: not on a tensor-parallel rank).
  const bf16* embedding() const { return embed_.data(); }
  cublasHandle_t blas() const { return blas_; }
  //! fp32 logits [rows, vocab] of bf16 rows h [rows, dim] (already normalized) through the head,
  //! on the model's stream; rows <= limits::max_rows. (DSpark's head is the backbone's.)
  void head_logits(const bf16* h, long long rows, float* out) {
    if (comm_) throw error("device_model::head_logits: not on a tensor-parallel rank (the head is split by vocabulary)");
    if (rows < 0 || rows > lim_.max_rows)
      throw error("device_model::head_logits: " + std::to_string(rows) + " rows, at most max_rows = " + std::to_string(lim_.max_rows));
    head_gemm(h, rows, out, c.vocab_size);
  }

  //! Prefill of a new sequence: fp32 logits [vocab] of its last position.
  std::vector<float> prefill(int slot, std::span<const std::int32_t> ids) {
    begin_prefill(slot, ids);
    return finish_call();
  }
  //! A chunk appended to a sequence after its prefill (exact mode): logits [vocab] of its last position.
  std::vector<float> append(int slot, std::span<const std::int32_t> ids) {
    begin_append(slot, ids);
    return finish_call();
  }
  //! An appended chunk (exact mode) whose every row's logits come back, [ids.size(), vocab]: the
  //! verification of a speculative round (its input token and drafts), as decode steps of those
  //! positions would compute them. At most limits::logit_rows tokens.
  std::vector<float> append_all(int slot, std::span<const std::int32_t> ids) {
    if (static_cast<long long>(ids.size()) > logit_rows_)
      throw error("device_model::append_all: " + std::to_string(ids.size()) + " tokens, but limits::logit_rows holds " +
                  std::to_string(logit_rows_) + " rows of logits");
    begin_append(slot, ids);
    pending_->all_rows = true;
    return finish_call();
  }

  //! append_all without the way back: the rows' logits stay in device memory, for sample() (a
  //! speculative round's draws; at V4.1's vocabulary a round of 6 rows would copy 3 MB back).
  void append_all_on_device(int slot, std::span<const std::int32_t> ids) {
    if (comm_)
      throw error(
          "device_model::append_all_on_device: not on a tensor-parallel rank (use append_all: its logits are "
          "split by vocabulary)");
    if (static_cast<long long>(ids.size()) > logit_rows_)
      throw error("device_model::append_all_on_device: " + std::to_string(ids.size()) +
                  " tokens, but limits::logit_rows holds " + std::to_string(logit_rows_) + " rows of logits");
    begin_append(slot, ids);
    pending_->all_rows = true;
    finish_on_device();
  }
  //! Chunks appended to several sequences in one call (exact mode; `slots` distinct, chunks[b]
  //! for slots[b], each at most `window` tokens when there are several), every row's logits:
  //! [total tokens, vocab], the chunks' rows in the order given. A batch of speculative rounds'
  //! verifications; each chunk's rows as append_all of it alone would compute them (up to the
  //! GEMMs' row-count dependence, docs/decisions.md). At most limits::logit_rows tokens.
  std::vector<float> append_all(const std::vector<int>& slots, const std::vector<std::vector<std::int32_t>>& chunks) {
    begin_appends(slots, chunks, "append_all");
    pending_->all_rows = true;
    return finish_call();
  }
  //! append_all of several sequences without the way back (sample() draws from the rows).
  void append_all_on_device(const std::vector<int>& slots, const std::vector<std::vector<std::int32_t>>& chunks) {
    if (comm_) throw error("device_model::append_all_on_device: not on a tensor-parallel rank (use append_all)");
    begin_appends(slots, chunks, "append_all_on_device");
    pending_->all_rows = true;
    finish_on_device();
  }

  //! A sequence's state that later calls change and cannot recompute (the attention caches'
  //! length, window rings and compressor states, the Engram histories, the CED tail): with
  //! save_sequence before a speculative round and restore_sequence after, the rejected rows leave
  //! no trace, and appending the accepted tokens again gives the state plain decoding would have.
  struct sequence_snapshot {
    typename stack_t::sequence_snapshot attention;
    std::vector<std::size_t> history_sizes;  //!< per Engram module (the histories only grow)
    runtime::device_buffer<bf16> tail_x, tail_h;
    runtime::device_buffer<float> tail_pre, tail_post, tail_comb;
  };
  //! Saves sequence `slot` (between calls; device copies on the model's stream).
  void save_sequence(int slot, sequence_snapshot& into) {
    check_idle();
    stack_->save(slot, into.attention);
    into.history_sizes.clear();
    for (const auto& h : histories_.at(std::size_t(slot))) into.history_sizes.push_back(h.size());
    if (lim_.ced_appends) tail_copy(slot, &into, nullptr);
  }
  //! Returns sequence `slot` to the state save_sequence saved from it (its length may only have
  //! grown since).
  void restore_sequence(int slot, const sequence_snapshot& from) {
    check_idle();
    if (lim_.ced_appends && !from.tail_x.size()) throw error("device_model::restore_sequence: the snapshot has no CED tail");
    auto& histories = histories_.at(std::size_t(slot));
    if (from.history_sizes.size() != histories.size())
      throw error("device_model::restore_sequence: the snapshot is not from this model's sequence slot " + std::to_string(slot));
    for (std::size_t j = 0; j < histories.size(); ++j)
      if (from.history_sizes[j] > histories[j].size())
        throw error("device_model::restore_sequence: the snapshot is not from sequence slot " + std::to_string(slot) +
                    " before its later calls");
    stack_->restore(slot, from.attention);
    for (std::size_t j = 0; j < histories.size(); ++j) histories[j].resize(from.history_sizes[j]);
    if (lim_.ced_appends) tail_copy(slot, nullptr, &from);
  }

  //! One token for each of `slots`: logits [slots.size(), vocab], in the order given.
  std::vector<float> decode(const std::vector<int>& slots, std::span<const std::int32_t> ids) {
    begin_decode(slots, ids);
    return finish_call();
  }

  //! decode without the way back: the step's logits stay in device memory, for sample(). At V4.1's
  //! vocabulary a step of 64 rows would otherwise copy 33 MB of fp32 logits to the host.
  void decode_on_device(const std::vector<int>& slots, std::span<const std::int32_t> ids) {
    if (comm_) throw error("device_model::decode_on_device: not on a tensor-parallel rank (use decode: its logits are split by vocabulary)");
    begin_decode(slots, ids);
    finish_on_device();
  }
  //! One token per row of the last call's logits (its last row for a prefill or append, a row per
  //! sequence for a decode step; requests[r] for row r), drawn on the device as the host sampler
  //! draws them (kernels/sampling/sampling.cuh). Not on a tensor-parallel rank (its logits are
  //! gathered by vocabulary part).
  std::vector<std::int32_t> sample(std::span<const kernels::sampling::row_request> requests) {
    if (comm_) throw error("device_model::sample: not on a tensor-parallel rank (its logits are split by vocabulary)");
    if (logit_rows_ready_ == 0) throw error("device_model::sample: no logits yet (run a prefill, append or decode first)");
    if (static_cast<long long>(requests.size()) != logit_rows_ready_)
      throw error("device_model::sample: " + std::to_string(requests.size()) + " requests for " +
                  std::to_string(logit_rows_ready_) + " rows of logits");
    if (!sampler_) sampler_.emplace(std::max(logit_rows_, lim_.max_seqs));
    return sampler_->sample(logits_.data(), c.vocab_size, requests, stream());
  }
  //! Rows the device sampler handed to the host so far (too flat for its shared memory).
  long long sampler_fallback_rows() const { return sampler_ ? sampler_->fallback_rows() : 0; }

  //! A call in two steps, for tensor-parallel drivers (parallel/tp_device_model.cuh): begin_*
  //! makes every check of the call and sets up the attention stack's metadata, but joins no
  //! collective and launches no kernel of the forward; finish_call runs it. The driver lets
  //! every rank begin, and only if all did, lets them finish (otherwise cancel_call): a call that
  //! one rank refuses (a full page pool, a bad slot) then never leaves another rank waiting in
  //! a collective. prefill(slot, ids) == begin_prefill(slot, ids) + finish_call().
  // (Each begin_* copies the call first, so that once the stack has begun, nothing can throw.)
  void begin_prefill(int slot, std::span<const std::int32_t> ids) {
    begin_call();
    check_ids(ids);
    pending_call p{.what = pending_call::kind::normal, .slots = {slot}, .ids = {ids.begin(), ids.end()}, .tokens = {int(ids.size())}};
    stack_->begin_prefill(slot, int(ids.size()));
    pending_ = std::move(p);
  }
  void begin_append(int slot, std::span<const std::int32_t> ids) {
    begin_call();
    check_ids(ids);
    pending_call p{.what = pending_call::kind::normal, .slots = {slot}, .ids = {ids.begin(), ids.end()}, .tokens = {int(ids.size())}};
    stack_->begin_append(slot, int(ids.size()));
    pending_ = std::move(p);
  }
  //! Appends to several sequences (append_all's several-sequence form); `what` names the caller.
  void begin_appends(const std::vector<int>& slots, const std::vector<std::vector<std::int32_t>>& chunks,
                     const char* what = "begin_appends") {
    begin_call();
    const std::string where = std::string("device_model::") + what + ": ";
    if (slots.size() != chunks.size())
      throw error(where + std::to_string(slots.size()) + " sequences and " + std::to_string(chunks.size()) + " chunks");
    pending_call p{.what = pending_call::kind::normal, .slots = slots, .ids = {}, .tokens = {},
                   .one_sequence = slots.size() == 1};  // (one: a chunk of any length)
    for (const auto& ch : chunks) {
      check_ids(ch);
      p.ids.insert(p.ids.end(), ch.begin(), ch.end());
      p.tokens.push_back(int(ch.size()));
    }
    if (static_cast<long long>(p.ids.size()) > logit_rows_)
      throw error(where + std::to_string(p.ids.size()) + " tokens, but limits::logit_rows holds " + std::to_string(logit_rows_) +
                  " rows of logits");
    stack_->begin_appends(slots, p.tokens);
    pending_ = std::move(p);
  }
  void begin_decode(const std::vector<int>& slots, std::span<const std::int32_t> ids) {
    begin_call();
    if (ids.size() != slots.size()) throw error("device_model::decode: one token id per sequence");
    check_ids(ids);
    pending_call p{.what = pending_call::kind::normal, .slots = slots, .ids = {ids.begin(), ids.end()},
                   .tokens = std::vector<int>(slots.size(), 1), .one_sequence = false, .decode = true};
    stack_->begin_decode(slots);
    pending_ = std::move(p);
  }
  void begin_prefill_ced(int slot, std::span<const std::int32_t> ids) {
    static_assert(ced_prefill_possible<sched>(), "device_model::prefill_ced: every decoder KV owner must be the first decoder layer");
    begin_call();
    check_ids(ids);
    pending_call p{.what = pending_call::kind::ced, .slots = {slot}, .ids = {ids.begin(), ids.end()}, .tokens = {int(ids.size())}};
    stack_->begin_prefill(slot, int(ids.size()));
    pending_ = std::move(p);
  }
  void begin_append_ced(int slot, std::span<const std::int32_t> ids) {
    static_assert(ced_prefill_possible<sched>(), "device_model::append_ced: every decoder KV owner must be the first decoder layer");
    begin_call();
    check_ids(ids);
    if (!lim_.ced_appends)
      throw error("device_model::append_ced: the model was built without limits::ced_appends (it keeps no sequence's "
                  "first-decoder-layer input of its last window positions to replay)");
    if (slot < 0 || slot >= lim_.max_seqs) throw error("device_model::append_ced: no sequence slot " + std::to_string(slot));
    constexpr int E = sched::encoder_layers;
    bool decoder_engram = false;
    for (int t : sched::engram::values) decoder_engram |= t > E;
    const long long len = stack_->length(slot), s = static_cast<long long>(ids.size());
    // The replay's rows must fit one call; checked here, since the encoder's part commits the chunk.
    const long long replay_rows = std::min<long long>(len + s, c.attn.window_size);
    if (len > 0 && replay_rows > lim_.max_rows)
      throw error("device_model::append_ced: the decoder replays " + std::to_string(replay_rows) + " positions, beyond limits::max_rows (" +
                  std::to_string(lim_.max_rows) + "); build the model with max_rows >= the window (" +
                  std::to_string(c.attn.window_size) + ")");
    if (decoder_engram && len > 0 && s < c.attn.window_size)
      throw error("device_model::append_ced: a CED append of " + std::to_string(s) + " tokens would replay an Engram module "
                  "of the decoder over earlier tokens (as forward_ced refuses); append at least " +
                  std::to_string(c.attn.window_size) + " tokens or in exact mode");
    if (capture_ && len > 0)
      for (int t : sched::drafter::targets::values)
        if (t < E)
          throw error("device_model::append_ced: a CED append cannot give the DSpark input of encoder layer " + std::to_string(t) +
                      " (its rows are not the replayed positions; as forward_ced refuses)");
    pending_call p{.what = pending_call::kind::ced_append, .slots = {slot}, .ids = {ids.begin(), ids.end()}, .tokens = {int(ids.size())}};
    stack_->begin_append(slot, int(s));
    pending_ = std::move(p);
  }
  //! Runs the begun call: its logits, as prefill / append / decode / prefill_ced / append_ced return them.
  std::vector<float> finish_call() {
    if (!pending_) throw error("device_model::finish_call: no call was begun");
    pending_call p = std::move(*pending_);
    pending_.reset();
    if constexpr (ced_prefill_possible<sched>()) {  // (begin_*_ced refuse other schedules at compile time)
      if (p.what == pending_call::kind::ced) return run_ced(p.slots[0], p.ids);
      if (p.what == pending_call::kind::ced_append) return run_ced_append(p.slots[0], p.ids);
    }
    return run(p);
  }
  //! Drops a begun call (its sequences become unusable, as after a failed call: release them).
  void cancel_call() {
    logit_rows_ready_ = 0;
    if (!pending_) return;
    pending_.reset();
    stack_->abort_call();
  }

 private:
  using device_block = device_detail::device_block;
  //! finish_call for decode_on_device / append_all_on_device: exit_logits copies nothing back.
  void finish_on_device() {
    logits_stay_ = true;
    struct restore {
      bool& flag;
      ~restore() { flag = false; }
    } r{logits_stay_};
    finish_call();
  }

  struct device_engram {
    runtime::device_buffer<std::uint8_t> embed, embed_scale, wkv, wkv_scale;
    runtime::device_buffer<float> qk;
    const std::int64_t* hashes = nullptr;  //!< [rows, columns] of the call in progress (in inputs_)
    engram::engram_device_weights view;    //!< (with host tables: no table; the fetch's view adds the pack)
    std::optional<engram::engram_workspace> ws;
    std::unique_ptr<engram::host_table_fetch> fetch;  //!< limits::engram_host_tables (pinned: not movable)
  };

  limits lim_;
  std::vector<std::int64_t> token_map_;
  engram::hash_layout hashes_;
  parallel::device_collectives* comm_ = nullptr;  //!< a tensor-parallel rank's; null: the whole model
  long long vocab_first_ = 0, vocab_part_ = 0;    //!< the vocabulary rows of embed_ / head_
  int expert_first_ = 0, expert_count_ = 0;        //!< the routed experts held
  runtime::owned_stream stream_;  // before everything that uses it, so it is destroyed after them
  std::optional<stack_t> stack_;
  std::optional<runtime::segment_graphs> segments_;  //!< set_decode_graphs
  std::vector<device_block> blocks_;
  std::vector<device_engram> engrams_;
  runtime::device_buffer<bf16> embed_, norm_, x_, y_, h_, sub_;
  runtime::device_buffer<std::uint8_t> h_codes_, h_scales_;  //!< h's act_quant (boundary)
  runtime::device_buffer<std::uint16_t> h_codes_f16_;
  runtime::device_buffer<bf16> head16_;  //!< the head when its values are bf16 (else head_, fp32)
  runtime::device_buffer<float> head_, hf_, logits_, logits_part_, entry_pre_, a_pre_, a_post_, a_comb_, f_pre_, f_post_, f_comb_;
  runtime::pinned_buffer<float> logits_host_;  //!< the logits' way back (an asynchronous copy needs pinned memory)
  bool logits_stay_ = false;                   //!< decode_on_device: exit_logits copies nothing back
  long long logit_rows_ready_ = 0;             //!< rows of logits_ the last call left (sample)
  std::chrono::steady_clock::time_point call_began_{};  //!< when the last begin_* started
  double last_issue_s_ = 0;                             //!< last_issue_seconds()
  std::optional<kernels::sampling::device_sampler> sampler_;
  //! limits::ced_appends: per sequence slot, the first decoder layer's input of its last `window`
  //! positions ([slot, position mod window] rows), and the current call's row maps into it.
  runtime::device_buffer<bf16> tail_x_, tail_h_;
  runtime::device_buffer<float> tail_pre_, tail_post_, tail_comb_;
  const std::int32_t* tail_push_ = nullptr;
  const std::int32_t* tail_gather_ = nullptr;
  runtime::upload_arena inputs_;               //!< a call's token ids and Engram hashes
  std::optional<kernels::mhc::mhc_workspace> mhc_ws_;
  std::optional<kernels::moe::moe_workspace> moe_ws_;
  cublasHandle_t blas_ = nullptr;
  runtime::device_buffer<std::uint8_t> blas_workspace_;  //!< blas_'s own (gemm::detail::owned_workspace_bytes)
  bool moe_host_sync_ = false;  //!< the MoE may synchronize (prefill / append calls, not decode; start())
  //! A call begun (begin_*) and not yet finished.
  struct pending_call {
    enum class kind { normal, ced, ced_append } what = kind::normal;
    std::vector<int> slots;
    std::vector<std::int32_t> ids;  //!< every slot's tokens, in slot order
    std::vector<int> tokens;        //!< per slot
    bool one_sequence = true;       //!< a prefill or append of slots[0]: logits of the last row
    bool decode = false;            //!< a decode step (one token per slot)
    bool all_rows = false;          //!< append_all: every row's logits
  };
  std::optional<pending_call> pending_;
  layer_observer observe_;
  int logit_rows_ = 0;    //!< rows of logits_ (limits::logit_rows)
  bool capture_ = false;  //!< capture_main_hidden
  runtime::device_buffer<bf16> main_hidden_;
  long long main_hidden_rows_ = 0;
  std::vector<std::vector<std::vector<std::int64_t>>> histories_;  //!< [slot][engram] compressed-id history

  void check_idle() const {
    if (pending_) throw error("device_model: a begun call was neither finished nor cancelled");
  }
  //! Every begin_*'s start: no call pending, and the last call's logits no longer drawable
  //! (sample() must not read them after this call fails or is cancelled).
  void begin_call() {
    check_idle();
    logit_rows_ready_ = 0;
    call_began_ = std::chrono::steady_clock::now();
  }
  void check_ids(std::span<const std::int32_t> ids) const {
    if (ids.empty()) throw error("device_model: no tokens");
    for (std::int32_t id : ids)
      if (id < 0 || id >= c.vocab_size)
        throw error("device_model: token id " + std::to_string(id) + " outside the vocabulary of " + std::to_string(c.vocab_size));
  }

  //! One mHC boundary: Y = hc_post(F, X) (F null: Y = X), h = norm(hc_pre(Y, pre)), next mixes
  //! (fn null: none).
  //! `into` (the next sublayer's kind; numerics::fused_act_quant(act_quant_site::boundaries) on): the
  //! boundary also writes h's act_quant into h_codes_ / h_scales_ (with the f16 copy the MoE's grouped GEMMs
  //! read, for the MoE up to its f16 call size), which the sublayer then reads instead of quantizing h itself
  //! (act_of).
  enum class act_quant_for { none, attention, moe };
  void boundary(long long rows, const bf16* x, const bf16* f, const float* post, const float* comb,
                const float* pre, const bf16* norm_w, bf16* y, const float* fn, const float* base,
                const float* scale, float* next_pre, float* next_post, float* next_comb,
                act_quant_for into = act_quant_for::none) {
    const bool q =
        into != act_quant_for::none && numerics::fused_act_quant(numerics::act_quant_site::boundaries);
    const bool f16 = q && into == act_quant_for::moe && rows <= moe_ws_->f16_tokens();
    device_detail::mhc_boundary(device_detail::mhc_constants_of<Model>(), rows, x, f, post, comb, pre, norm_w,
                                y, h_.data(), fn, base, scale, next_pre, next_post, next_comb, *mhc_ws_,
                                stream(), q ? h_codes_.data() : nullptr, q ? h_scales_.data() : nullptr,
                                f16 ? h_codes_f16_.data() : nullptr);
    h_act_rows_ = q ? rows : -1, h_act_f16_ = f16;
  }
  //! h's act_quant from the last boundary, for a sublayer over `rows` rows (none if it wrote none).
  numerics::act_quant_view act_of(long long rows) const {
    if (h_act_rows_ != rows) return {};
    return {h_codes_.data(), h_scales_.data(), h_act_f16_ ? h_codes_f16_.data() : nullptr};
  }
  long long h_act_rows_ = -1;
  bool h_act_f16_ = false;

  // The forward in pieces (shared by run and prefill_ced). X_ / Y_ point at the streams entering
  // the next boundary and the spare buffer; engram_row0_ is the call row of the streams' first row.
  bf16* X_ = nullptr;
  bf16* Y_ = nullptr;
  long long engram_row0_ = 0;

  //! Engram hash ids of every module from each sequence's compressed-token history, the embedding.
  //! tokens[b]: slots[b]'s rows of the call (consecutive, in slot order). `gather`: a CED
  //! append's replay rows in the tail (uploaded with the call's inputs).
  void start(const std::vector<int>& slots, std::span<const std::int32_t> ids, std::span<const int> tokens, bool decode,
             std::span<const std::int32_t> gather = {}) {
    using namespace device_detail;
    const long long R = static_cast<long long>(ids.size());
    // Prefill and appended chunks may take the MoE's routed cuBLAS path (it synchronizes the
    // stream once per layer); a decode batch never does, whatever its size, so a decode step
    // stays free of host waits (and capturable, docs/decode-graph.md).
    moe_host_sync_ = !decode;
    std::vector<long long> first_row(slots.size() + 1, 0);  // slots[b]'s rows: [first_row[b], first_row[b + 1])
    for (std::size_t b = 0; b < slots.size(); ++b) first_row[b + 1] = first_row[b] + tokens[b];
    inputs_.begin_pack();
    const std::int32_t* ids_d = inputs_.put(ids, std::size_t(R), "token ids");
    tail_push_ = tail_gather_ = nullptr;
    if (lim_.ced_appends) {
      // Where each row's first-decoder-layer input goes in its sequence's tail (position p at
      // p mod window); rows a later row of the call overwrites are skipped.
      const long long W = c.attn.window_size;
      std::vector<std::int32_t> push(std::size_t(R), -1);
      for (std::size_t b = 0; b < slots.size(); ++b)
        for (long long r = std::max(first_row[b], first_row[b + 1] - W); r < first_row[b + 1]; ++r) {
          const long long pos = stack_->length(slots[b]) + (r - first_row[b]);
          push[std::size_t(r)] = std::int32_t(slots[b] * W + pos % W);
        }
      tail_push_ = inputs_.put(std::span<const std::int32_t>(push), std::size_t(R), "encoder tail rows");
      if (!gather.empty()) tail_gather_ = inputs_.put(gather, std::size_t(lim_.max_rows), "replay rows");
    }
    for (std::size_t j = 0; j < engrams_.size(); ++j) {
      const auto& mult = Model::engram_multipliers[j];
      const std::vector<std::int64_t> mv(mult.begin(), mult.end());
      std::vector<std::int64_t> all;
      for (std::size_t b = 0; b < slots.size(); ++b) {
        const auto seq_ids = ids.subspan(std::size_t(first_row[b]), std::size_t(tokens[b]));
        const auto h = engram::hash_tokens(hashes_, int(j), mv, seq_ids, {}, token_map_, c.engram.engram_pad_id,
                                           histories_[std::size_t(slots[b])][j], stack_->length(slots[b]));
        all.insert(all.end(), h.begin(), h.end());
      }
      engrams_[j].hashes =
          inputs_.put(std::span<const std::int64_t>(all), std::size_t(R) * std::size_t(engrams_[j].view.columns), "Engram hashes");
      // Host tables: the rows start on their way now, while the layers before this module run.
      if (engrams_[j].fetch) engrams_[j].fetch->start(all, stream());
    }
    inputs_.upload(stream());
    if (!comm_) {
      runtime::launch_programmatic(embed_kernel, dim3(blocks_for(R * hc * c.dim)), dim3(256), 0, stream(), embed_.data(), 0LL,
                                   vocab_part_, ids_d, R, c.dim, hc, x_.data());
      DSV4_CUDA_CHECK_LAUNCH();
    } else {  // ParallelEmbedding: the rank's rows, zeros for other ids, summed over the ranks (bf16)
      runtime::launch_programmatic(embed_kernel, dim3(blocks_for(R * c.dim)), dim3(256), 0, stream(), embed_.data(), vocab_first_,
                                   vocab_part_, ids_d, R, c.dim, 1, sub_.data());
      DSV4_CUDA_CHECK_LAUNCH();
      comm_->all_reduce_sum(sub_.data(), std::size_t(R) * c.dim, stream());
      runtime::launch_programmatic(spread_kernel, dim3(blocks_for(R * hc * c.dim)), dim3(256), 0, stream(),
                                   static_cast<const bf16*>(sub_.data()), R, c.dim, hc, x_.data());
      DSV4_CUDA_CHECK_LAUNCH();
    }
    X_ = x_.data(), Y_ = y_.data(), engram_row0_ = 0;
  }

  //! The boundary into block l: the previous FFN applied (l > 0), Engram, hc_pre + attn_norm into
  //! h_, the attention mixes into a_*; X_ becomes block l's input streams.
  void enter_block(int l, long long R) {
    device_block& b = blocks_[std::size_t(l)];
    int engram_slot = -1;
    for (std::size_t j = 0; j < engrams_.size(); ++j)
      if (sched::engram::values[j] == l) engram_slot = int(j);
    const float* pre = l == 0 ? entry_pre_.data() : f_pre_.data();
    if (l > 0 && engram_slot >= 0) {  // apply the previous FFN, then Engram, then read the streams
      boundary(R, X_, sub_.data(), f_post_.data(), f_comb_.data(), pre, b.attn_norm.data(), Y_, nullptr, nullptr, nullptr,
               nullptr, nullptr, nullptr);
      std::swap(X_, Y_);
    }
    if (engram_slot >= 0) {
      auto& e = engrams_[std::size_t(engram_slot)];
      if (e.fetch) {  // the pack of this call's rows, indexed like the hash ids it replaces
        // (The wait joins a host thread and an event of this call: outside any captured segment.)
        if (segments_) segments_->end_segment();
        e.fetch->wait(stream());
        engram::engram_forward(X_, e.fetch->ids() + engram_row0_ * e.view.columns, nullptr, R, e.fetch->view(e.view), *e.ws,
                               blas_, stream());
        if (segments_) segments_->begin_segment();
      } else {
        engram::gathered_row_sum sum;
        if (comm_) sum = [this](bf16* v, std::size_t n, cudaStream_t st) { comm_->all_reduce_sum(v, n, st); };
        engram::engram_forward(X_, e.hashes + engram_row0_ * e.view.columns, nullptr, R, e.view, *e.ws, blas_, stream(), sum);
      }
    }
    if (l == 0 || engram_slot >= 0) {
      boundary(R, X_, nullptr, nullptr, nullptr, pre, b.attn_norm.data(), nullptr, b.attn_fn.data(),
               b.attn_base.data(), b.attn_scale.data(), a_pre_.data(), a_post_.data(), a_comb_.data(),
               act_quant_for::attention);
    } else {
      boundary(R, X_, sub_.data(), f_post_.data(), f_comb_.data(), pre, b.attn_norm.data(), Y_,
               b.attn_fn.data(), b.attn_base.data(), b.attn_scale.data(), a_pre_.data(), a_post_.data(),
               a_comb_.data(), act_quant_for::attention);
      std::swap(X_, Y_);
    }
  }

  //! Block l's attention, the boundary into its FFN, the MoE (sub_ holds its output).
  void finish_block(int l, long long R) {
    device_block& b = blocks_[std::size_t(l)];
    observe(l, "attn_in", h_.data(), R);
    stack_->forward(l, h_.data(), sub_.data(), act_of(R));
    // RowParallelLinear wo_b: the ranks' bf16 partials summed in fp32, rounded once (hf_ is free
    // until the head).
    if (comm_) comm_->all_reduce_partials(sub_.data(), hf_.data(), sub_.data(), std::size_t(R) * c.dim, stream());
    observe(l, "attn_out", sub_.data(), R);
    boundary(R, X_, sub_.data(), a_post_.data(), a_comb_.data(), a_pre_.data(), b.ffn_norm.data(), Y_,
             b.ffn_fn.data(), b.ffn_base.data(), b.ffn_scale.data(), f_pre_.data(), f_post_.data(),
             f_comb_.data(), act_quant_for::moe);
    std::swap(X_, Y_);
    const kernels::moe::moe_weights mw = b.moe();
    observe(l, "ffn_in", h_.data(), R);
    if (!comm_) {
      kernels::moe::moe_forward(h_.data(), R, nullptr, mw, sub_.data(), *moe_ws_, stream(), blas_,
                                moe_host_sync_, {}, act_of(R));
    } else {  // the rank's experts into fp32 (hf_), summed over the ranks, then the shared expert
      const kernels::moe::expert_slice slice{expert_first_, expert_count_, hf_.data()};
      kernels::moe::moe_forward(h_.data(), R, nullptr, mw, sub_.data(), *moe_ws_, stream(), blas_,
                                moe_host_sync_, slice, act_of(R));
      comm_->all_reduce_sum(hf_.data(), std::size_t(R) * c.dim, stream());
      kernels::moe::moe_add_shared(hf_.data(), R, *moe_ws_, sub_.data(), stream());
    }
    observe(l, "ffn_out", sub_.data(), R);
  }

  //! Calls f(tail buffer, its sequence_snapshot member, values per row) for each CED tail buffer
  //! (every sequence holds window_size rows of each): the one list of them.
  template <class F>
  void for_each_tail(F&& f) {
    const std::size_t D = std::size_t(c.dim);
    f(tail_x_, &sequence_snapshot::tail_x, std::size_t(hc) * D), f(tail_h_, &sequence_snapshot::tail_h, D);
    f(tail_pre_, &sequence_snapshot::tail_pre, std::size_t(hc)), f(tail_post_, &sequence_snapshot::tail_post, std::size_t(hc));
    f(tail_comb_, &sequence_snapshot::tail_comb, std::size_t(hc) * hc);
  }

  //! The CED tail rows of `slot` into a snapshot (`into`) or back from one (`from`).
  void tail_copy(int slot, sequence_snapshot* into, const sequence_snapshot* from) {
    const std::size_t W = std::size_t(c.attn.window_size), first = std::size_t(slot) * W;
    for_each_tail([&](auto& tail, auto member, std::size_t width) {
      using T = std::remove_reference_t<decltype(*tail.data())>;
      T* live = tail.data() + first * width;
      const std::size_t bytes = W * width * sizeof(T);
      if (into) {
        auto& keep = into->*member;
        if (keep.size() != W * width) keep = runtime::device_buffer<T>(W * width);
        DSV4_CUDA_CHECK(cudaMemcpyAsync(keep.data(), live, bytes, cudaMemcpyDeviceToDevice, stream()));
      } else {
        DSV4_CUDA_CHECK(cudaMemcpyAsync(live, (from->*member).data(), bytes, cudaMemcpyDeviceToDevice, stream()));
      }
    });
  }

  //! Sequence `from`'s CED tail rows into sequence `to`'s (copy_sequence).
  void tail_copy_between(int from, int to) {
    const std::size_t W = std::size_t(c.attn.window_size);
    for_each_tail([&](auto& tail, auto, std::size_t width) {
      using T = std::remove_reference_t<decltype(*tail.data())>;
      DSV4_CUDA_CHECK(cudaMemcpyAsync(tail.data() + std::size_t(to) * W * width, tail.data() + std::size_t(from) * W * width,
                                      W * width * sizeof(T), cudaMemcpyDeviceToDevice, stream()));
    });
  }

  //! fp32 logits of bf16 rows through the head (`vocab`: the rows held): from the bf16 head
  //! directly, else through an fp32 copy (hf_, rows <= max_rows).
  void head_gemm(const bf16* h, long long rows, float* out, int vocab) {
    const int D = c.dim;
    if (head16_.size()) {
      kernels::gemm::linear_bf16_f32out(blas_, h, head16_.data(), out, int(rows), vocab, D, stream());
    } else {
      numerics::widen_to_fp32(h, hf_.data(), rows * D, stream());
      kernels::gemm::linear_fp32(blas_, hf_.data(), head_.data(), out, int(rows), vocab, D, stream());
    }
  }

  //! With capture_main_hidden: rows [first, first + rows) of the streams entering layer l (X_) into
  //! main_hidden_ when l is a DSpark target. `one_sequence`: only the call's last `window` rows.
  void capture(int l, long long first, long long rows, bool one_sequence) {
    if constexpr (sched::drafter::stages > 0) {
      if (!capture_) return;
      using targets = typename sched::drafter::targets;
      if (one_sequence && rows > c.attn.window_size) first += rows - c.attn.window_size, rows = c.attn.window_size;
      for (std::size_t j = 0; j < targets::values.size(); ++j) {
        if (targets::values[j] != l) continue;
        const long long stride = 1LL * targets::size * c.dim;
        runtime::launch_programmatic(device_detail::stream_mean_kernel, dim3(blocks_for(rows * c.dim)), dim3(256), 0, stream(),
                                     static_cast<const bf16*>(X_), first, rows, c.dim, hc, main_hidden_.data() + j * c.dim, stride);
        DSV4_CUDA_CHECK_LAUNCH();
        main_hidden_rows_ = rows;
      }
    }
  }

  //! Exit: the last FFN, the collapse with its pre, the final norm; the head on the last row
  //! (`last_only`) or on every row.
  std::vector<float> exit_logits(long long R, bool last_only) {
    using namespace device_detail;
    const int D = c.dim;
    boundary(R, X_, sub_.data(), f_post_.data(), f_comb_.data(), f_pre_.data(), norm_.data(), Y_, nullptr, nullptr, nullptr,
             nullptr, nullptr, nullptr);
    const long long first = last_only ? R - 1 : 0, rows = R - first;
    const std::size_t n = std::size_t(rows) * c.vocab_size;
    if (!comm_) {
      head_gemm(h_.data() + first * D, rows, logits_.data(), c.vocab_size);
    } else {  // ParallelHead: the rank's vocabulary rows, gathered in rank order ([ranks, rows, part])
      head_gemm(h_.data() + first * D, rows, logits_part_.data(), int(vocab_part_));
      comm_->all_gather(logits_part_.data(), std::size_t(rows) * std::size_t(vocab_part_), logits_.data(), stream());
    }
    if (segments_) segments_->end_step();  // (no step in progress: nothing; the copy below is no launch)
    logit_rows_ready_ = rows;
    last_issue_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - call_began_).count();
    if (logits_stay_) return {};  // decode_on_device: sample() reads them there
    DSV4_CUDA_CHECK(cudaMemcpyAsync(logits_host_.data(), logits_.data(), n * sizeof(float), cudaMemcpyDeviceToHost, stream()));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream()));  // the call's one wait for the device
    if (!comm_) return std::vector<float>(logits_host_.data(), logits_host_.data() + n);
    std::vector<float> out(n);  // [ranks, rows, part] -> [rows, vocab]
    const std::size_t part = std::size_t(vocab_part_), W = std::size_t(world());
    for (std::size_t w = 0; w < W; ++w)
      for (std::size_t r = 0; r < std::size_t(rows); ++r)
        std::copy_n(logits_host_.data() + (w * std::size_t(rows) + r) * part, part, out.data() + r * std::size_t(c.vocab_size) + w * part);
    return out;
  }

  //! A begun call (not CED): logits of the last row for a prefill or append of one sequence
  //! (p.one_sequence) unless p.all_rows, otherwise of every row.
  std::vector<float> run(const pending_call& p) {
    const long long R = static_cast<long long>(p.ids.size());
    try {
      start(p.slots, p.ids, p.tokens, p.decode);
      main_hidden_rows_ = 0;
      // (A batch whose MoE dispatch sorts with CUB stays plain: its launches bypass the log.)
      const bool graphs = segments_ && p.decode && !observe_ && !comm_ &&
                          kernels::moe::dispatch_in_one_launch(moe_ws_->shape(), R);
      stack_->set_segments(graphs ? &*segments_ : nullptr);
      if (graphs) segments_->begin_step(R), segments_->begin_segment();
      for (int l = 0; l < sched::num_layers; ++l) {
        enter_block(l, R);
        capture(l, 0, R, p.one_sequence);
        if (l == sched::encoder_layers) push_tail(R);
        finish_block(l, R);
      }
      auto out = exit_logits(R, p.one_sequence && !p.all_rows);
      stack_->set_segments(nullptr);
      stack_->end_call();
      return out;
    } catch (...) {
      if (segments_) segments_->abandon();
      stack_->set_segments(nullptr);
      fail_call();
      throw;
    }
  }

  //! A call failed: the stack forgets it, and a rank releases the others from its collectives.
  void fail_call() {
    main_hidden_rows_ = 0;  // (a capture the failed call began is not the call's)
    logit_rows_ready_ = 0;  // (logits_ may hold a part of the failed call's)
    stack_->abort_call();
    if (comm_) comm_->abandon();
  }

  //! Moves rows [first, first + rows) of a [*, width] device array to its front (through Y_'s spare room).
  template <class T>
  void keep_rows(T* data, long long first, long long rows, long long width, T* scratch) {
    const std::size_t bytes = std::size_t(rows * width) * sizeof(T);
    DSV4_CUDA_CHECK(cudaMemcpyAsync(scratch, data + first * width, bytes, cudaMemcpyDeviceToDevice, stream()));
    DSV4_CUDA_CHECK(cudaMemcpyAsync(data, scratch, bytes, cudaMemcpyDeviceToDevice, stream()));
  }

  //! out[out_rows[r]] = in[in_rows[r]], rows of `width` values (device_detail::copy_rows_kernel).
  template <class T>
  void copy_rows(const T* in, const std::int32_t* in_rows, T* out, const std::int32_t* out_rows, long long rows, long long width) {
    runtime::launch_programmatic(device_detail::copy_rows_kernel<T>, dim3(blocks_for(rows * width)), dim3(256), 0, stream(), in,
                                 in_rows, out, out_rows, rows, width);
    DSV4_CUDA_CHECK_LAUNCH();
  }
  //! With limits::ced_appends: the call's rows of the first decoder layer's input (streams X_,
  //! attention input h_, mixes a_*) into their sequences' tails, after enter_block(E).
  void push_tail(long long R) {
    if (!tail_push_) return;
    copy_rows(X_, nullptr, tail_x_.data(), tail_push_, R, 1LL * hc * c.dim);
    copy_rows(h_.data(), nullptr, tail_h_.data(), tail_push_, R, c.dim);
    copy_rows(a_pre_.data(), nullptr, tail_pre_.data(), tail_push_, R, hc);
    copy_rows(a_post_.data(), nullptr, tail_post_.data(), tail_push_, R, hc);
    copy_rows(a_comb_.data(), nullptr, tail_comb_.data(), tail_push_, R, 1LL * hc * hc);
  }
  //! The replay rows of a CED append out of the tail, in position order, into X_, h_ and a_*.
  void gather_tail(long long rows) {
    copy_rows(static_cast<const bf16*>(tail_x_.data()), tail_gather_, X_, nullptr, rows, 1LL * hc * c.dim);
    copy_rows(static_cast<const bf16*>(tail_h_.data()), tail_gather_, h_.data(), nullptr, rows, c.dim);
    copy_rows(static_cast<const float*>(tail_pre_.data()), tail_gather_, a_pre_.data(), nullptr, rows, hc);
    copy_rows(static_cast<const float*>(tail_post_.data()), tail_gather_, a_post_.data(), nullptr, rows, hc);
    copy_rows(static_cast<const float*>(tail_comb_.data()), tail_gather_, a_comb_.data(), nullptr, rows, 1LL * hc * hc);
  }

 public:
  //! The CED prefill of a new sequence (model_reference.hpp forward_ced): encoder layers over the
  //! prompt, the first decoder layer's cache from the encoder output over every token, the decoder
  //! layers over the last `window` tokens (a replay whose windows start there). Logits [vocab] of
  //! the last position.
  std::vector<float> prefill_ced(int slot, std::span<const std::int32_t> ids) {
    begin_prefill_ced(slot, ids);
    return finish_call();
  }
  //! A CED append (model_reference.hpp forward_ced on a sequence that holds tokens; needs
  //! limits::ced_appends): the encoder layers over the chunk, the first decoder layer's cache grown
  //! by it, the decoder layers over the sequence's last `window` positions as a replay (from the
  //! tail every call keeps). Equal to an exact append while the sequence fits the window, the
  //! article's layer-token work beyond it. Logits [vocab] of the last position.
  std::vector<float> append_ced(int slot, std::span<const std::int32_t> ids) {
    begin_append_ced(slot, ids);
    return finish_call();
  }

 private:
  //! The CED prefill after begin_prefill_ced.
  std::vector<float> run_ced(int slot, std::span<const std::int32_t> ids) {
    const long long N = static_cast<long long>(ids.size());
    run_encoder(slot, ids);
    const long long first = std::max<long long>(0, N - c.attn.window_size), R = N - first;
    return replay_decoder(slot, first, R, [&] {
      if (first > 0) {  // the replay rows to the front: streams, attention input, mixes
        bf16* spare = Y_;
        keep_rows(X_, first, R, 1LL * hc * c.dim, spare);
        keep_rows(h_.data(), first, R, c.dim, spare);
        float* fspare = hf_.data();
        keep_rows(a_pre_.data(), first, R, hc, fspare), keep_rows(a_post_.data(), first, R, hc, fspare);
        keep_rows(a_comb_.data(), first, R, hc * hc, fspare);
        engram_row0_ = first;  // (no built-in model has an Engram module in its decoder; kept general)
      }
    });
  }

  //! The CED append after begin_append_ced (model_reference.hpp forward_ced on a sequence that
  //! holds tokens): the encoder over the chunk (an exact append), the owner's cache grown by it,
  //! then the decoder replays the sequence's last `window` positions from the tail.
  std::vector<float> run_ced_append(int slot, std::span<const std::int32_t> ids) {
    const long long s = static_cast<long long>(ids.size()), before = stack_->length(slot), len = before + s;
    const long long W = c.attn.window_size, R = std::min(len, W), first = len - R;
    std::vector<std::int32_t> gather(static_cast<std::size_t>(R));
    for (long long r = 0; r < R; ++r) gather[std::size_t(r)] = std::int32_t(slot * W + (first + r) % W);
    run_encoder(slot, ids, gather);
    return replay_decoder(slot, first, R, [&] {
      gather_tail(R);
      engram_row0_ = std::max<long long>(0, first - before);  // (begin_append_ced refused decoder Engram rows before the chunk)
    });
  }

  //! The encoder layers over a CED call's tokens (a prefill or an appended chunk), the tail, the
  //! first decoder layer's owner cache; ends the stack's call.
  void run_encoder(int slot, std::span<const std::int32_t> ids, std::span<const std::int32_t> gather = {}) {
    constexpr int E = sched::encoder_layers;
    const long long N = static_cast<long long>(ids.size());
    try {
      const int n = int(N);
      start({slot}, ids, std::span<const int>(&n, 1), false, gather);
      main_hidden_rows_ = 0;
      for (int l = 0; l < E; ++l) enter_block(l, N), capture(l, 0, N, true), finish_block(l, N);
      enter_block(E, N);  // h_ = the first decoder layer's input over every token of the call
      push_tail(N);
      if (sched::role(E) == schedule::attn_role::full) stack_->fill_owner_cache(E, h_.data());
      stack_->end_call();
    } catch (...) {
      fail_call();
      throw;
    }
  }

  //! The decoder layers over positions [first, first + R) of a sequence as a replay; `place` puts
  //! their first-decoder-layer input rows into X_, h_ and a_*. Logits of the last position.
  template <class Place>
  std::vector<float> replay_decoder(int slot, long long first, long long R, Place place) {
    constexpr int E = sched::encoder_layers;
    try {
      stack_->begin_replay(slot, first, int(R), E);
      place();
      h_act_rows_ = -1;  // place() moved or replaced h_'s rows: the last boundary's act_quant is stale
      capture(E, 0, R, true);
      finish_block(E, R);
      for (int l = E + 1; l < sched::num_layers; ++l) enter_block(l, R), capture(l, 0, R, true), finish_block(l, R);
      auto out = exit_logits(R, true);
      stack_->end_call();
      return out;
    } catch (...) {
      fail_call();
      throw;
    }
  }

 private:
  static unsigned blocks_for(long long n) { return unsigned((n + 255) / 256); }
  void observe(int layer, std::string_view stage, const bf16* values, long long rows) {
    if (!observe_) return;
    std::vector<bf16> host(std::size_t(rows) * c.dim);
    // On the model's stream (a legacy-stream cudaMemcpy is not ordered after it), then wait.
    DSV4_CUDA_CHECK(cudaMemcpyAsync(host.data(), values, host.size() * sizeof(bf16), cudaMemcpyDeviceToHost, stream()));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream()));
    observe_(layer, stage, host);
  }
};

}  // namespace dsv4::model
