#pragma once
//! \file
//! The CSA2 attention sublayer on CUDA (spec §5, §6, §7): the composition that
//! layer_reference.hpp describes, over device caches in their packed formats.
//!
//! `attention_stack<HeadDim, IndexDim>` owns, for a list of layers (their wiring and weights):
//! - every layer's window ring per sequence slot (FP8, UE8M0 per 32);
//! - the global caches of the KV owners in one page pool (FP4 main entries, MXFP4 index keys;
//!   regions per owner as cache/paged_cache.hpp lays them out) with a block table per sequence;
//! - the ratio >= 2 compressors' decode states per sequence slot;
//! - the scratch of one call and the slots that index sources publish to the layers after them
//!   (top-k lists, the candidate pool).
//! A call is a prefill of one sequence from position 0, one decode token for each of a batch of
//! sequences, or a chunk appended to one sequence after its prefill (exact mode: every row as the
//! decode step of its position; the operand is the ring, then the chunk's rows, and the chunk
//! enters the ring only after the attention). `begin_prefill` / `begin_decode` / `begin_append`
//! describe it (positions, pages), `forward(layer, x, out)` runs each layer in order with its
//! attention input x (the attn_norm output) and writes the sublayer output, `end_call` commits
//! the new lengths (every layer must have run).
//! Streams and synchronization: the stack works on one stream, given at construction (the legacy
//! default stream if none): every launch, cuBLAS call and copy of a call is issued there, so x
//! must be ready in that stream's order and out is ready in it. A call's metadata (positions,
//! block tables, latents' positions, ...) goes into a persistent arena sized for the limits:
//! begin_* packs it into pinned staging and issues one cudaMemcpyAsync on the stream; nothing in
//! a call allocates, frees or waits for the device, except that begin_* first waits for the
//! previous call's upload to have left the staging buffer (runtime/upload_arena.cuh).
//! The CED prefill is two calls: begin_prefill, the encoder layers, `fill_owner_cache` for the
//! first decoder layer (its cache over every token), end_call; then `begin_replay` of the last
//! `window` tokens from the first decoder layer on (windows start at the replay start, owners do
//! not compress again), the decoder layers, end_call. The sequence takes no other call between.
//! A CED append is the same with begin_append in place of begin_prefill (the replay then starts
//! before the chunk when the chunk is shorter than the window).
//!
//! Per layer: act_quant(x) feeds wq_a and wkv; q = RoPE(wq_b(act_quant(q_norm(wq_a x)))); the
//! window entry RoPE(kv_norm(wkv x)) is packed as FP8 into the call's rows (prefill) and the ring;
//! a KV owner compresses x (ratio 1: RMSNorm(W_kv x) in bf16; ratio 2: fp32 projections, pooled
//! with the decode state), packs index keys and main entries into its pages; an index source
//! scores its MXFP4 queries against its owner's keys (a Reindex layer only the candidate pool),
//! selects top-k and publishes it; sparse attention over window + selected entries with the sink;
//! the output path.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dsv4/cache/paged_cache.hpp"
#include "dsv4/core/error.hpp"
#include "dsv4/kernels/attention/layer_reference.hpp"
#include "dsv4/kernels/attention/sparse_attention.cuh"
#include "dsv4/kernels/compressor/compressor.cuh"
#include "dsv4/kernels/gemm/dense.cuh"
#include "dsv4/kernels/gemm/dequant_gemm.cuh"
#include "dsv4/kernels/gemm/weight_tiles.hpp"
#include "dsv4/kernels/indexer/indexer.cuh"
#include "dsv4/kernels/norm/rmsnorm.cuh"
#include "dsv4/kernels/output/output.cuh"
#include "dsv4/kernels/rope/rope.cuh"
#include "dsv4/numerics/convert.cuh"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "dsv4/runtime/pdl.cuh"
#include "dsv4/runtime/prepare_ahead.hpp"
#include "dsv4/runtime/segment_graph.cuh"
#include "dsv4/runtime/upload_arena.cuh"

namespace dsv4::kernels::attention {

namespace device_detail {
using runtime::device_buffer;

template <class T>
device_buffer<T> upload(const std::vector<T>& v) {
  return device_buffer<T>{std::span<const T>(v)};
}

//! An FP8 linear layer in the GEMM's MMA-tile layout.
struct fp8_weight {
  int n = 0, k = 0;
  device_buffer<std::uint8_t> codes, scales;
  //! The tiles on the host (empty for an absent layer, n == 0).
  static gemm::tiled_weight tile(const fp8_linear& l) {
    if (l.n == 0) return {};
    return gemm::tile_weight(gemm::weight_format::fp8_tile32, l.n, l.k, l.codes, l.scales);
  }
  static fp8_weight upload(const gemm::tiled_weight& t) {
    fp8_weight w;
    if (t.shape.n == 0) return w;
    w.n = t.shape.n, w.k = t.shape.k;
    w.codes = device_detail::upload(t.codes), w.scales = device_detail::upload(t.scales);
    return w;
  }
  static fp8_weight upload(const fp8_linear& l) { return upload(tile(l)); }
};

//! Multiplies bf16 values by a power of two in fp32 and rounds back (weights_proj x 2^-6).
DSV4_KERNEL void scale_bf16_kernel(bf16* x, long long n, float factor) {
  runtime::start_after_previous_grid();
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = bf16::from_float(__fmul_rn(x[i].to_float(), factor));
}

//! Row r's index list: the window part, then the published top-k (already offset).
struct index_list_args {
  std::int32_t* idx = nullptr;        //!< [rows, window_width + topk_width]
  const std::int32_t* topk = nullptr; //!< [rows, topk_width] or null
  const std::int64_t* positions = nullptr;
  int rows = 0, window_width = 0, topk_width = 0, window = 0;
  bool prefill = false;               //!< prefill: operand = the call's rows; decode: the ring
  bool append = false;                //!< appended chunks: the ring, then the chunk's rows
  const std::int32_t* row_first = nullptr;  //!< append: [rows] the call row of each row's chunk start
  //! The queries' RoPE, done by this launch's blocks from `list_blocks` on (one launch fewer a
  //! layer than a rope launch of its own: the queries are read only by the attention after it).
  rope::rope_args q_rope;
  unsigned list_blocks = 0;  //!< blocks of the index lists; then the rope's, then the window pack's
  unsigned rope_blocks = 0;
  //! A decode step's window entries (kv_norm, RoPE, FP8 into the ring), packed by the blocks past
  //! the rope's, a warp per row (compressor::detail::pack_row; no rows: none): one more launch
  //! fewer a layer. The ring is read only by the attention after this launch.
  compressor::pack_args<bf16> window_pack;
};
inline constexpr int index_list_threads = 256;

template <class WindowFormat, int HeadDim>
DSV4_KERNEL void __launch_bounds__(index_list_threads) index_list_kernel(index_list_args a) {
  const bool packs = blockIdx.x >= a.list_blocks + a.rope_blocks;
  if (packs) {  // the norm's row and the rope table (no kernel writes them), asked for before the wait
    runtime::prefetch_l2(a.window_pack.norm, sizeof(bf16) * std::size_t(HeadDim));
    runtime::prefetch_l2(a.window_pack.freqs, sizeof(float) * std::size_t(a.window_pack.rope_pairs));
  }
  runtime::start_after_previous_grid();
  if (packs) {  // the window pack: a warp per row
    const long long i =
        static_cast<long long>(blockIdx.x - a.list_blocks - a.rope_blocks) * (index_list_threads / 32) +
        threadIdx.x / 32;
    if (i < a.window_pack.rows) compressor::detail::pack_row<WindowFormat, HeadDim, bf16>(a.window_pack, i);
    return;
  }
  if (blockIdx.x >= a.list_blocks) {
    const long long p = static_cast<long long>(blockIdx.x - a.list_blocks) * blockDim.x + threadIdx.x;
    if (p < rope::pairs_of(a.q_rope))
      rope::detail::rotate_pair_at(a.q_rope, p, a.q_rope.freqs[p % a.q_rope.pairs]);
    return;
  }
  const int width = a.window_width + a.topk_width;
  const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= static_cast<long long>(a.rows) * width) return;
  const int r = int(t / width), j = int(t % width);
  std::int32_t v;
  if (j >= a.window_width) {
    v = a.topk[static_cast<long long>(r) * a.topk_width + (j - a.window_width)];
  } else if (a.prefill) {  // the row's last `window` positions of the chunk, oldest first, -1 past it
    const int e = max(r - a.window + 1, 0) + j;
    v = e > r ? -1 : e;
  } else if (a.append) {  // positions p - window + 1 .. p, oldest first: the ring before the chunk, then its rows
    const long long q = a.positions[r] - a.window + 1 + j, chunk_start = a.positions[a.row_first[r]];
    v = q < 0 ? -1 : q < chunk_start ? int(q % a.window) : a.window + int(q - chunk_start);
  } else {  // ring slots oldest first: slot + 1 .. window - 1, then 0 .. slot; unwritten slots -1
    const long long pos = a.positions[r];
    const int slot = int(pos % a.window);
    const int e = (slot + j + 1) % a.window;
    v = e > pos ? -1 : e;
  }
  a.idx[t] = v;
}

inline unsigned blocks_for(long long n, int threads = 256) { return unsigned((n + threads - 1) / threads); }

//! wo_a's FP8 form on the device (output/wo_a_fp8.hpp), which decode calls read instead of the
//! bf16 wo_a (half the bytes); empty where wo_a's values have none. Kept beside the bf16 weight,
//! which larger calls read through cuBLAS (33.5 MB more a layer at V4.1 widths).
struct wo_a_fp8_buffers {
  runtime::device_buffer<std::uint8_t> codes, scales;
  //! The FP8 form of wo_a's values [rows = groups * o_lora, group width], if it has one.
  static std::optional<output::fp8_tiles> find(const std::vector<float>& wo_a, int rows) {
    if (rows <= 0 || wo_a.size() % std::size_t(rows)) return std::nullopt;
    return output::exact_fp8_tiles(wo_a, rows, int(wo_a.size() / std::size_t(rows)));
  }
  static wo_a_fp8_buffers upload(const std::optional<output::fp8_tiles>& f8) {
    wo_a_fp8_buffers b;
    if (f8) b.codes = device_detail::upload(f8->codes), b.scales = device_detail::upload(f8->scales);
    return b;
  }
  static wo_a_fp8_buffers upload(const std::vector<float>& wo_a, int rows) {
    return upload(find(wo_a, rows));
  }
  output::wo_a_fp8_weight view() const {
    if (!codes.size()) return {};
    return {codes.data(), scales.data()};
  }
};
}  // namespace device_detail

//! One layer's weights on the device.
struct device_layer_weights {
  device_detail::fp8_weight wq_a, wq_b, wkv, wo_b, idx_wq_b;
  runtime::device_buffer<bf16> q_norm, kv_norm, wo_a, comp_wkv16, comp_norm, index_wk, index_norm, weights_proj;
  runtime::device_buffer<float> comp_wkv32, comp_wgate, attn_sink;
  device_detail::wo_a_fp8_buffers wo_a_fp8;

  //! A layer's weights converted on the host, ready to copy (to_device). The conversions touch
  //! no device, so they run on runtime::prepare_ahead's workers.
  struct host_form {
    gemm::tiled_weight wq_a, wq_b, wkv, wo_b, idx_wq_b;
    std::vector<bf16> q_norm, kv_norm, wo_a, comp_wkv16, comp_norm, index_wk, index_norm, weights_proj;
    std::optional<output::fp8_tiles> wo_a_fp8;
  };
  static host_form convert(const layer_weights& w, const layer_wiring& wr) {
    using namespace device_detail;
    host_form h;
    h.wq_a = fp8_weight::tile(w.wq_a), h.wq_b = fp8_weight::tile(w.wq_b), h.wkv = fp8_weight::tile(w.wkv);
    h.wo_b = fp8_weight::tile(w.wo_b);
    h.q_norm = numerics::to_bf16(w.q_norm), h.kv_norm = numerics::to_bf16(w.kv_norm),
    h.wo_a = numerics::to_bf16(w.wo_a);
    h.wo_a_fp8 = wo_a_fp8_buffers::find(w.wo_a, w.wo_b.k);
    if (wr.role == schedule::attn_role::full) {
      if (wr.ratio == 1) h.comp_wkv16 = numerics::to_bf16(w.compressor.wkv);
      h.comp_norm = numerics::to_bf16(w.compressor.norm);
      h.index_wk = numerics::to_bf16(w.index_key.wk), h.index_norm = numerics::to_bf16(w.index_key.norm);
    }
    if (wr.role == schedule::attn_role::full || wr.role == schedule::attn_role::reindex) {
      h.idx_wq_b = fp8_weight::tile(w.idx_wq_b);
      h.weights_proj = numerics::to_bf16(w.weights_proj);
    }
    return h;
  }
  //! `h` (convert(w, wr)) and w's fp32 tensors on the device.
  static device_layer_weights to_device(const host_form& h, const layer_weights& w, const layer_wiring& wr) {
    using namespace device_detail;
    device_layer_weights d;
    d.wq_a = fp8_weight::upload(h.wq_a), d.wq_b = fp8_weight::upload(h.wq_b),
    d.wkv = fp8_weight::upload(h.wkv);
    d.wo_b = fp8_weight::upload(h.wo_b), d.idx_wq_b = fp8_weight::upload(h.idx_wq_b);
    d.q_norm = upload(h.q_norm), d.kv_norm = upload(h.kv_norm), d.wo_a = upload(h.wo_a);
    d.wo_a_fp8 = wo_a_fp8_buffers::upload(h.wo_a_fp8);
    d.attn_sink = upload(w.attn_sink);
    d.comp_wkv16 = upload(h.comp_wkv16), d.comp_norm = upload(h.comp_norm);
    d.index_wk = upload(h.index_wk), d.index_norm = upload(h.index_norm),
    d.weights_proj = upload(h.weights_proj);
    if (wr.role == schedule::attn_role::full && wr.ratio != 1)
      d.comp_wkv32 = upload(w.compressor.wkv), d.comp_wgate = upload(w.compressor.wgate);
    return d;
  }
};

template <int HeadDim, int IndexDim>
class attention_stack {
 public:
  using window_format = numerics::fp8_act_format;
  using window_layout = numerics::packed_vector<window_format, HeadDim>;
  using main_layout = numerics::packed_vector<numerics::main_kv_format, HeadDim>;
  using key_layout = numerics::packed_vector<numerics::index_key_format, IndexDim>;
  //! Bytes from one index key to the next: the kernels read keys as 4-byte words, so a key of a
  //! width that is not a multiple of 4 bytes (34 B for tiny's 64 channels) is padded. V4.1's keys
  //! (68 B) are not, and its pages hold exactly 890 bytes per token.
  static constexpr int key_stride = (key_layout::bytes + 3) / 4 * 4;

  struct limits {
    int max_seqs = 1;        //!< sequence slots (rings, compressor states, block tables)
    int max_rows = 1;        //!< rows of one call (prefill tokens or decode batch)
    long long max_tokens = 1;  //!< tokens per sequence
    int page_tokens = 64;
    long long pages = 0;     //!< 0: max_seqs x pages for max_tokens
    int load_threads = 0;    //!< host threads converting weights at construction (runtime::prepare_threads)
  };

  //! `stream`: where every call's work runs (null: the legacy default stream); the caller keeps it
  //! alive for the stack's lifetime.
  attention_stack(const layer_shape& shape, std::vector<layer_wiring> wiring, const std::vector<layer_weights>& weights,
                  std::span<const float> freqs_local, std::span<const float> freqs_compressed, const limits& lim,
                  cudaStream_t stream = nullptr)
      : shape_(shape), wiring_(std::move(wiring)), lim_(lim), stream_(stream) {
    const std::string where = "attention_stack: ";
    if (shape.head_dim != HeadDim || shape.index_dim != IndexDim)
      throw error(where + "the shape's head_dim / index_dim (" + std::to_string(shape.head_dim) + ", " +
                  std::to_string(shape.index_dim) + ") differ from the instantiation's (" + std::to_string(HeadDim) +
                  ", " + std::to_string(IndexDim) + ")");
    if (weights.size() != wiring_.size()) throw error(where + "one weights entry per layer is needed");
    if (lim.max_seqs <= 0 || lim.max_rows <= 0 || lim.max_tokens <= 0 || lim.page_tokens <= 0)
      throw error(where + "limits must be positive");
    if (lim.max_rows > 65535)
      throw error(where + "max_rows is " + std::to_string(lim.max_rows) + "; the indexer launches take at most 65535 rows per call "
                  "(split longer prefills into chunks)");
    for (std::size_t l = 0; l < wiring_.size(); ++l) {
      const auto& wr = wiring_[l];
      if (wr.ratio > 0 && (wr.kv_owner < 0 || wr.kv_owner > int(l) || wiring_[std::size_t(wr.kv_owner)].role != schedule::attn_role::full))
        throw error(where + "layer " + std::to_string(l) + " names KV owner " + std::to_string(wr.kv_owner) +
                    ", which is not an earlier Full layer");
      if (wr.ratio < 0 || wr.ratio > 2)
        throw error(where + "layer " + std::to_string(l) + " has compression ratio " + std::to_string(wr.ratio) +
                    "; this stack supports 0 (local), 1 and 2");
      if (wr.role == schedule::attn_role::full && lim.page_tokens % wr.ratio)
        throw error(where + "page_tokens must be a multiple of every owner's ratio");
    }
    // Page layout: per owner, its main entries then its keys (cache/paged_cache.hpp's order).
    for (std::size_t l = 0; l < wiring_.size(); ++l)
      if (wiring_[l].role == schedule::attn_role::full) {
        cache::owner_region r;
        r.layer = int(l), r.ratio = wiring_[l].ratio, r.entries_per_page = lim.page_tokens / r.ratio;
        r.main_offset = page_bytes_;
        page_bytes_ += 1LL * r.entries_per_page * main_layout::bytes;
        r.key_offset = page_bytes_;
        page_bytes_ += 1LL * r.entries_per_page * key_stride;
        regions_[int(l)] = r;
      }
    max_pages_ = int((lim.max_tokens + lim.page_tokens - 1) / lim.page_tokens);
    const long long pages = lim.pages > 0 ? lim.pages : 1LL * lim.max_seqs * max_pages_;
    alloc_.emplace(pages, lim.page_tokens, std::max<long long>(page_bytes_, 1));
    pool_ = runtime::device_buffer<std::uint8_t>(std::size_t(std::max<long long>(pages * page_bytes_, 1)));
    slot_seq_.assign(std::size_t(lim.max_seqs), -1);
    lengths_.assign(std::size_t(lim.max_seqs), -1);
    ced_pending_.assign(std::size_t(lim.max_seqs), -1);

    for (std::size_t l = 0; l < wiring_.size(); ++l) check_weights(int(l), weights[l]);
    // Each layer's weights converted on worker threads ahead of its copies (prepare_ahead).
    runtime::prepare_ahead(
        int(wiring_.size()), runtime::prepare_threads(lim.load_threads),
        [&](int l) {
          return device_layer_weights::convert(weights[std::size_t(l)], wiring_[std::size_t(l)]);
        },
        [&](int l, const device_layer_weights::host_form& h) {
          w_.push_back(device_layer_weights::to_device(h, weights[std::size_t(l)], wiring_[std::size_t(l)]));
        });
    for (std::size_t l = 0; l < wiring_.size(); ++l) {
      rings_.emplace_back(std::size_t(lim.max_seqs) * shape.window * window_layout::bytes);
      if (wiring_[l].role == schedule::attn_role::full && wiring_[l].ratio > 1) {
        states_k_[int(l)] = runtime::device_buffer<float>(std::size_t(lim.max_seqs) * wiring_[l].ratio * HeadDim);
        states_z_[int(l)] = runtime::device_buffer<float>(std::size_t(lim.max_seqs) * wiring_[l].ratio * HeadDim);
      }
    }
    freqs_local_ = runtime::device_buffer<float>{freqs_local};
    freqs_compressed_ = runtime::device_buffer<float>{freqs_compressed};
    allocate_scratch();
    allocate_metadata();
    gemm::detail::blas_check(cublasCreate(&blas_), "attention_stack: cublasCreate");
    // Once here rather than per call: blas_call (dense.cuh) then finds the stream already set.
    gemm::detail::blas_check(cublasSetStream(blas_, stream_), "attention_stack: cublasSetStream");
    blas_workspace_ = runtime::device_buffer<std::uint8_t>(gemm::detail::owned_workspace_bytes);
    gemm::detail::blas_check(cublasSetWorkspace(blas_, blas_workspace_.data(), blas_workspace_.size()),
                             "attention_stack: cublasSetWorkspace");
    // The weights and caches above were written by legacy-stream copies (device_buffer), which a
    // non-blocking stream is not ordered after.
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  }
  ~attention_stack() {
    cudaStreamSynchronize(stream_);  // the call's kernels may still read the buffers freed next
    if (blas_) cublasDestroy(blas_);
  }
  attention_stack(const attention_stack&) = delete;
  attention_stack& operator=(const attention_stack&) = delete;

  //! A new, empty sequence; returns its slot.
  int add_sequence() {
    for (int s = 0; s < lim_.max_seqs; ++s)
      if (slot_seq_[std::size_t(s)] < 0) {
        slot_seq_[std::size_t(s)] = alloc_->add_sequence();
        lengths_[std::size_t(s)] = 0;
        return s;
      }
    throw error("attention_stack: all " + std::to_string(lim_.max_seqs) + " sequence slots are in use");
  }
  void release_sequence(int slot) {
    if (slot < 0 || slot >= lim_.max_seqs || slot_seq_[std::size_t(slot)] < 0)
      throw error("attention_stack: no live sequence in slot " + std::to_string(slot));
    if (call_ && std::count(call_->slots.begin(), call_->slots.end(), slot))
      throw error("attention_stack: sequence slot " + std::to_string(slot) + " is part of the call in progress");
    alloc_->release(slot_seq_[std::size_t(slot)]);
    slot_seq_[std::size_t(slot)] = -1, lengths_[std::size_t(slot)] = -1, ced_pending_[std::size_t(slot)] = -1;
  }
  long long length(int slot) const { return lengths_.at(std::size_t(slot)); }
  long long page_bytes() const { return page_bytes_; }

  //! A new sequence holding a copy of sequence `from`: its pages (every owner's global entries and
  //! index keys), window rings, compressor states and length, device copies on the stack's stream;
  //! returns its slot. The two then go on independently (several samples of one prompt, the
  //! branches of a conversation). Between calls only; the pages come from the pool (checked first:
  //! nothing changes when they are not there).
  int copy_sequence(int from) {
    check_slot(from);
    if (call_) throw error("attention_stack::copy_sequence: a call is in progress");
    if (ced_pending_[std::size_t(from)] >= 0)
      throw error("attention_stack::copy_sequence: sequence slot " + std::to_string(from) + " waits for its CED replay");
    const int seq_from = slot_seq_[std::size_t(from)];
    const long long pages = static_cast<long long>(alloc_->block_table(seq_from).size());
    if (pages > alloc_->free_pages())
      throw error("attention_stack::copy_sequence: the page pool is exhausted: the copy needs " + std::to_string(pages) +
                  " pages, " + std::to_string(alloc_->free_pages()) + " are free");
    const int to = add_sequence();  // throws when every slot is in use, before anything changes
    try {
      alloc_->append(slot_seq_[std::size_t(to)], alloc_->tokens(seq_from));
      const auto& src = alloc_->block_table(seq_from);
      const auto& dst = alloc_->block_table(slot_seq_[std::size_t(to)]);
      // One copy per run of pages that are consecutive in both tables (the free list hands out
      // ascending runs).
      for (std::size_t i = 0; i < src.size();) {
        std::size_t n = 1;
        while (i + n < src.size() && src[i + n] == src[i] + std::int32_t(n) && dst[i + n] == dst[i] + std::int32_t(n)) ++n;
        DSV4_CUDA_CHECK(cudaMemcpyAsync(pool_.data() + std::size_t(dst[i]) * std::size_t(page_bytes_),
                                        pool_.data() + std::size_t(src[i]) * std::size_t(page_bytes_),
                                        n * std::size_t(page_bytes_), cudaMemcpyDeviceToDevice, stream_));
        i += n;
      }
      const std::size_t ring_bytes = std::size_t(shape_.window) * window_layout::bytes;
      for (auto& ring : rings_)
        DSV4_CUDA_CHECK(cudaMemcpyAsync(ring.data() + std::size_t(to) * ring_bytes, ring.data() + std::size_t(from) * ring_bytes,
                                        ring_bytes, cudaMemcpyDeviceToDevice, stream_));
      for (auto* states : {&states_k_, &states_z_})
        for (auto& [l, buf] : *states) {
          const std::size_t n = std::size_t(wiring_[std::size_t(l)].ratio) * HeadDim;
          DSV4_CUDA_CHECK(cudaMemcpyAsync(buf.data() + std::size_t(to) * n, buf.data() + std::size_t(from) * n,
                                          n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
        }
    } catch (...) {
      release_sequence(to);  // a half-made copy gives its slot and pages back
      throw;
    }
    lengths_[std::size_t(to)] = lengths_[std::size_t(from)];
    return to;
  }

  //! What a sequence's later calls can change and not recompute: its length, its window rings
  //! (slots are overwritten modulo the window) and its ratio-2 compressors' decode states. Global
  //! entries and index keys past the length are never read, so they need no copy.
  struct sequence_snapshot {
    long long length = -1;
    std::vector<runtime::device_buffer<std::uint8_t>> rings;  //!< per layer: the slot's window entries
    std::map<int, runtime::device_buffer<float>> states_k, states_z;
  };
  //! Saves sequence `slot` into `into` (device copies on the stack's stream; buffers allocated on
  //! first use and reused). Between calls only.
  void save(int slot, sequence_snapshot& into) {
    check_slot(slot);
    if (call_) throw error("attention_stack::save: a call is in progress");
    if (ced_pending_[std::size_t(slot)] >= 0)
      throw error("attention_stack::save: sequence slot " + std::to_string(slot) + " waits for its CED replay");
    const std::size_t ring_bytes = std::size_t(shape_.window) * window_layout::bytes;
    into.rings.resize(rings_.size());
    for (std::size_t l = 0; l < rings_.size(); ++l) {
      if (into.rings[l].size() != ring_bytes) into.rings[l] = runtime::device_buffer<std::uint8_t>(ring_bytes);
      DSV4_CUDA_CHECK(cudaMemcpyAsync(into.rings[l].data(), rings_[l].data() + std::size_t(slot) * ring_bytes, ring_bytes,
                                      cudaMemcpyDeviceToDevice, stream_));
    }
    auto states = [&](std::map<int, runtime::device_buffer<float>>& from, std::map<int, runtime::device_buffer<float>>& to) {
      for (auto& [l, buf] : from) {
        const std::size_t n = std::size_t(wiring_[std::size_t(l)].ratio) * HeadDim;
        auto& dst = to[l];
        if (dst.size() != n) dst = runtime::device_buffer<float>(n);
        DSV4_CUDA_CHECK(cudaMemcpyAsync(dst.data(), buf.data() + std::size_t(slot) * n, n * sizeof(float), cudaMemcpyDeviceToDevice,
                                        stream_));
      }
    };
    states(states_k_, into.states_k), states(states_z_, into.states_z);
    into.length = lengths_[std::size_t(slot)];
  }
  //! Returns sequence `slot` to a state saved from it (its length may only have grown since, by
  //! appends or decode steps: the rolled-back positions' pages go back to the pool).
  void restore(int slot, const sequence_snapshot& from) {
    check_slot(slot);
    if (call_) throw error("attention_stack::restore: a call is in progress");
    const long long len = lengths_[std::size_t(slot)];
    if (from.length < 0 || from.length > len || from.rings.size() != rings_.size())
      throw error("attention_stack::restore: the snapshot (" + std::to_string(from.length) + " tokens) is not from sequence slot " +
                  std::to_string(slot) + " (" + std::to_string(len) + " tokens) before its later calls");
    if (ced_pending_[std::size_t(slot)] >= 0)
      throw error("attention_stack::restore: sequence slot " + std::to_string(slot) + " waits for its CED replay");
    const std::size_t ring_bytes = std::size_t(shape_.window) * window_layout::bytes;
    for (std::size_t l = 0; l < rings_.size(); ++l)
      DSV4_CUDA_CHECK(cudaMemcpyAsync(rings_[l].data() + std::size_t(slot) * ring_bytes, from.rings[l].data(), ring_bytes,
                                      cudaMemcpyDeviceToDevice, stream_));
    auto states = [&](const std::map<int, runtime::device_buffer<float>>& saved, std::map<int, runtime::device_buffer<float>>& to) {
      for (auto& [l, buf] : to) {
        const std::size_t n = std::size_t(wiring_[std::size_t(l)].ratio) * HeadDim;
        DSV4_CUDA_CHECK(cudaMemcpyAsync(buf.data() + std::size_t(slot) * n, saved.at(l).data(), n * sizeof(float),
                                        cudaMemcpyDeviceToDevice, stream_));
      }
    };
    states(from.states_k, states_k_), states(from.states_z, states_z_);
    alloc_->truncate(slot_seq_[std::size_t(slot)], from.length);
    lengths_[std::size_t(slot)] = from.length;
  }
  //! A tensor-parallel rank's sum of the index scores over the ranks' index heads (model.py's
  //! all_reduce of index_score, bf16): called on the stack's stream with an index source's bf16
  //! scores [n] of the call's rows (a Full layer's [rows, visible width], a Reindex layer's
  //! [rows, candidates]) before the candidate pool or the top-k reads them. Every rank computes
  //! the same visibility and candidates, so masked scores are -inf on every rank. Empty: the
  //! whole model on one rank.
  using index_score_sum = std::function<void(bf16* scores, std::size_t n, cudaStream_t stream)>;
  void set_index_score_sum(index_score_sum f) { sum_scores_ = std::move(f); }
  //! The caller's captured decode segments (runtime/segment_graph.cuh), or null: forward ends the
  //! segment in progress before the part of a layer whose launches follow the sequences' lengths
  //! (the global branch, the index list, sparse attention) and begins the next after it; inside
  //! the global branch, the indexer's queries and weights (rows only) are a segment of their own.
  void set_segments(runtime::segment_graphs* segments) { segments_ = segments; }
  //! The stream every call's work runs on.
  cudaStream_t stream() const { return stream_; }
  cache::cache_usage usage() const { return alloc_->usage(); }

  //! A prefill of `tokens` tokens of an empty sequence.
  void begin_prefill(int slot, int tokens) {
    check_slot(slot);
    if (lengths_[std::size_t(slot)] != 0)
      throw error("attention_stack::begin_prefill: sequence slot " + std::to_string(slot) + " already holds " +
                  std::to_string(lengths_[std::size_t(slot)]) + " tokens (append with begin_append)");
    if (tokens <= 0 || tokens > lim_.max_rows || tokens > lim_.max_tokens)
      throw error("attention_stack::begin_prefill: " + std::to_string(tokens) + " tokens, the limits allow " +
                  std::to_string(std::min<long long>(lim_.max_rows, lim_.max_tokens)));
    begin({slot}, {tokens}, true);
  }
  //! A chunk of `tokens` tokens appended to a sequence after its prefill (a tool result, a new
  //! turn), in exact mode: each row as the decode step of its position would compute it.
  void begin_append(int slot, int tokens) { begin_appends({slot}, {tokens}); }
  //! Chunks appended to several sequences in one call (`slots` distinct, tokens[b] for
  //! slots[b]; the call's rows are the chunks in that order), each as begin_append's: a batch of
  //! speculative rounds' verifications. With more than one sequence a chunk may hold at most
  //! `window` tokens (each then enters its ring whole after the attention).
  void begin_appends(const std::vector<int>& slots, const std::vector<int>& tokens) {
    const std::string where = "attention_stack::begin_append" + std::string(slots.size() > 1 ? "s" : "") + ": ";
    if (slots.empty() || slots.size() != tokens.size())
      throw error(where + std::to_string(slots.size()) + " sequences and " + std::to_string(tokens.size()) +
                  " token counts (one count per sequence, at least one sequence)");
    long long rows = 0;
    for (std::size_t b = 0; b < slots.size(); ++b) {
      const int slot = slots[b], n = tokens[b];
      check_slot(slot);
      const long long len = lengths_[std::size_t(slot)];
      if (len <= 0) throw error(where + "sequence slot " + std::to_string(slot) + " has no prefill");
      if (ced_pending_[std::size_t(slot)] >= 0)
        throw error(where + "sequence slot " + std::to_string(slot) + " waits for its CED replay");
      if (std::count(slots.begin(), slots.end(), slot) > 1) throw error(where + "sequence slot " + std::to_string(slot) + " appears twice");
      if (n <= 0 || n > lim_.max_rows || len + n > lim_.max_tokens)
        throw error(where + std::to_string(n) + " tokens after " + std::to_string(len) + " in sequence slot " +
                    std::to_string(slot) + "; the limits allow " + std::to_string(lim_.max_rows) + " per call and " +
                    std::to_string(lim_.max_tokens) + " per sequence");
      if (slots.size() > 1 && n > shape_.window)
        throw error(where + "a chunk of " + std::to_string(n) + " tokens for sequence slot " + std::to_string(slot) +
                    " in a call of several sequences; each may hold at most the window (" + std::to_string(shape_.window) +
                    " tokens): append longer chunks alone");
      rows += n;
    }
    if (rows > lim_.max_rows)
      throw error(where + std::to_string(rows) + " tokens in one call, beyond limits::max_rows (" + std::to_string(lim_.max_rows) + ")");
    begin(slots, tokens, false);
    call_->append = true;
  }

  //! CED prefill or append, step 1 (after begin_prefill or begin_append and the encoder layers):
  //! the KV owner `layer` (a Full layer, the first decoder layer) compresses x [rows, dim] (its
  //! attention input over the call's tokens) into its cache, without attention.
  void fill_owner_cache(int layer, const bf16* x) {
    const std::string where = "attention_stack::fill_owner_cache (layer " + std::to_string(layer) + "): ";
    if (!call_ || !(call_->prefill || call_->append)) throw error(where + "needs a prefill or appended-chunk call in progress");
    if (layer < 0 || layer >= int(wiring_.size()) || wiring_[std::size_t(layer)].role != schedule::attn_role::full)
      throw error(where + "only a KV owner (a Full layer) fills a cache on its own");
    if (!x) throw error(where + "null x");
    if (layer < call_->next_layer) throw error(where + "the layer already ran in this call");
    compress_owner(layer, x, stream_);
    call_->filled.push_back(layer);
  }
  //! CED prefill or append, step 2: the last `tokens` positions of a sequence (from `from`, which
  //! may lie before the appended chunk) through layers first_layer.. as a replay: a prefill whose
  //! window starts at `from`; owners do not compress again (their caches hold every token). The
  //! sequence's length does not change.
  void begin_replay(int slot, long long from, int tokens, int first_layer) {
    check_slot(slot);
    const long long len = lengths_[std::size_t(slot)];
    if (from < 0 || tokens <= 0 || from + tokens != len || tokens > lim_.max_rows)
      throw error("attention_stack::begin_replay: replay the last tokens of the sequence (" + std::to_string(len) +
                  " long), at most " + std::to_string(lim_.max_rows) + " of them; got " + std::to_string(tokens) + " from " +
                  std::to_string(from));
    if (first_layer < 0 || first_layer >= int(wiring_.size())) throw error("attention_stack::begin_replay: no layer " + std::to_string(first_layer));
    if (ced_pending_[std::size_t(slot)] != first_layer)
      throw error("attention_stack::begin_replay: sequence slot " + std::to_string(slot) +
                  " has no CED prefill or append that stopped before layer " + std::to_string(first_layer) +
                  " (begin_prefill or begin_append, the earlier layers, fill_owner_cache for the later owners, end_call)");
    begin({slot}, {tokens}, false, from);
    call_->replay = true;
    call_->next_layer = first_layer;
  }

  //! One token for each of `slots` (distinct, each after its prefill).
  void begin_decode(const std::vector<int>& slots) {
    if (slots.empty() || int(slots.size()) > lim_.max_rows)
      throw error("attention_stack::begin_decode: " + std::to_string(slots.size()) + " sequences, at most " +
                  std::to_string(lim_.max_rows) + " per call");
    for (int s : slots) {
      check_slot(s);
      if (lengths_[std::size_t(s)] <= 0) throw error("attention_stack::begin_decode: sequence slot " + std::to_string(s) + " has no prefill");
      if (ced_pending_[std::size_t(s)] >= 0)
        throw error("attention_stack::begin_decode: sequence slot " + std::to_string(s) + " waits for its CED replay");
      if (lengths_[std::size_t(s)] + 1 > lim_.max_tokens) throw error("attention_stack::begin_decode: sequence slot " + std::to_string(s) + " is full");
      if (std::count(slots.begin(), slots.end(), s) > 1) throw error("attention_stack::begin_decode: a slot appears twice");
    }
    begin(slots, std::vector<int>(slots.size(), 1), false);
  }

  //! Layer `layer` over the call's rows: x [rows, dim] (device), out [rows, dim] (device), on the
  //! stack's stream. `x_act` (optional): x's act_quant (fp8_act_format, codes [rows, dim] and
  //! scales [rows, dim / 32], both or neither) where the caller already has it, byte for byte what
  //! numerics::quantize makes of x (mhc_step writes it beside h): the layer's own quantize of x
  //! is then skipped.
  void forward(int layer, const bf16* x, bf16* out, const numerics::act_quant_view& x_act = {});

  //! Abandons a call that failed part-way: its sequences' caches may hold part of the call, so
  //! they are marked unusable (every later call on them is an error) until released.
  void abort_call() {
    if (!call_) return;
    for (int s : call_->slots) lengths_[std::size_t(s)] = broken;
    call_.reset();
  }

  //! Commits the call: the sequences' lengths grow by their tokens.
  void end_call() {
    if (!call_) throw error("attention_stack::end_call: no call in progress");
    const int layers = int(wiring_.size());
    if (call_->next_layer != layers) {
      // Only a CED prefill or append may stop early: the encoder ran, and every owner after it
      // filled its cache.
      bool owners_filled = (call_->prefill || call_->append) && !call_->filled.empty();
      for (int l = call_->next_layer; l < layers && owners_filled; ++l)
        if (wiring_[std::size_t(l)].role == schedule::attn_role::full)
          owners_filled = std::count(call_->filled.begin(), call_->filled.end(), l) > 0;
      if (!owners_filled)
        throw error("attention_stack::end_call: layers " + std::to_string(call_->next_layer) + ".." + std::to_string(layers - 1) +
                    " have not run (only a CED prefill or append, whose later owners filled their caches, may end early)");
      ced_pending_[std::size_t(call_->slots[0])] = call_->next_layer;
    } else if (call_->replay) {
      ced_pending_[std::size_t(call_->slots[0])] = -1;
    }
    if (!call_->replay)
      for (std::size_t b = 0; b < call_->slots.size(); ++b) lengths_[std::size_t(call_->slots[b])] += call_->tokens[b];
    call_.reset();
  }

 private:
  struct call_state {
    std::vector<int> slots, tokens;
    std::vector<long long> start;
    bool prefill = false, append = false, replay = false;
    std::vector<int> filled;  //!< owners that fill_owner_cache ran for (a CED prefill)
    int rows = 0;
    int next_layer = 0;
    // device metadata: slots of meta_ (valid from the call's upload on, in stream order)
    const std::int64_t* positions = nullptr;                      //!< [rows]
    const std::int32_t* row_batch = nullptr;                      //!< [rows] batch entry of each row
    const std::int32_t* row_slot = nullptr;                       //!< [rows] sequence slot of each row
    const std::int32_t* row_first = nullptr;                      //!< [rows] call row of each row's batch entry's first row
    int chunk_width = 0;                                          //!< the most tokens of one batch entry
    const std::int32_t* batch_slot = nullptr;                     //!< [batch]
    const std::int32_t* block_tables = nullptr;                   //!< [batch, max_pages]
    // per compressed ratio r in {1, 2} (index r): latents of this call
    std::array<const std::int64_t*, 3> visible_by_ratio{};        //!< [rows] (position + 1) / r
    std::array<const compressor::pool_sequence*, 3> pool_seqs{};  //!< [batch]
    std::array<const std::int64_t*, 3> latent_pos{};              //!< [latents[r]]
    std::array<const std::int32_t*, 3> latent_batch{};            //!< [latents[r]]
    std::map<int, int> latents, max_groups;
    std::map<int, long long> width;  //!< compressed entries visible to the call's last row, max over the batch
    // published by index sources for the layers after them
    int topk_width = 0, candidate_cols = 0;
  };

  layer_shape shape_;
  std::vector<layer_wiring> wiring_;
  limits lim_;
  std::vector<device_layer_weights> w_;
  std::vector<runtime::device_buffer<std::uint8_t>> rings_;
  std::map<int, runtime::device_buffer<float>> states_k_, states_z_;
  std::map<int, cache::owner_region> regions_;
  long long page_bytes_ = 0;
  int max_pages_ = 0;
  std::optional<cache::page_allocator> alloc_;
  runtime::device_buffer<std::uint8_t> pool_;
  std::vector<int> slot_seq_;
  std::vector<long long> lengths_;
  std::vector<int> ced_pending_;  //!< per slot: the layer a CED replay must start at, or -1
  runtime::segment_graphs* segments_ = nullptr;  //!< set_segments
  runtime::device_buffer<float> freqs_local_, freqs_compressed_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  runtime::device_buffer<std::uint8_t> blas_workspace_;  //!< blas_'s own (gemm::detail::owned_workspace_bytes)
  std::optional<call_state> call_;
  runtime::upload_arena meta_;  //!< the call metadata (call_state's device pointers point here)

  // scratch (sized for max_rows)
  runtime::device_buffer<std::uint8_t> x_codes_, x_scales_, qr_codes_, qr_scales_, chunk_kv_, iq_codes_, iq_scales_;
  runtime::device_buffer<bf16> qr_, q_, kv_, o_, latents_, keys_, iq_, wp_;
  runtime::device_buffer<float> xf_, ck_, cz_;
  runtime::device_buffer<std::int32_t> topk_, idx_, cand_pos_, block_ids_;
  runtime::device_buffer<bf16> scores_, gathered_scores_, block_scores_;
  runtime::device_buffer<unsigned> topk_scratch_;  // long rows' top-k over several CTAs
  std::optional<gemm::gemm_workspace> gemm_ws_;
  std::optional<output::output_workspace> out_ws_;
  std::optional<sparse_attention_workspace> attn_ws_;
  index_score_sum sum_scores_;

  //! Layer `l`'s weights against the shape (a tensor-parallel rank's shape has its local heads,
  //! groups and index heads, so a shard of another world size fails here, by name).
  void check_weights(int l, const layer_weights& w) const {
    const auto& s = shape_;
    const auto& wr = wiring_[std::size_t(l)];
    const std::string where = "attention_stack: layer " + std::to_string(l) + ": ";
    auto linear = [&](const fp8_linear& f, const char* name, long long n, long long k) {
      if (f.n != n || f.k != k)
        throw error(where + name + " is [" + std::to_string(f.n) + ", " + std::to_string(f.k) + "], the shape (" +
                    std::to_string(s.heads) + " heads, " + std::to_string(s.groups) + " groups, " +
                    std::to_string(s.index_heads) + " index heads) needs [" + std::to_string(n) + ", " + std::to_string(k) + "]");
    };
    auto sized = [&](const std::vector<float>& v, const char* name, long long n) {
      if (static_cast<long long>(v.size()) != n)
        throw error(where + name + " holds " + std::to_string(v.size()) + " values, the shape needs " + std::to_string(n));
    };
    if (s.heads <= 0 || s.groups <= 0 || s.heads % s.groups)
      throw error(where + "the shape's heads (" + std::to_string(s.heads) + ") must be a positive multiple of its groups (" +
                  std::to_string(s.groups) + ")");
    linear(w.wq_a, "wq_a", s.q_lora, s.dim);
    linear(w.wq_b, "wq_b", 1LL * s.heads * HeadDim, s.q_lora);
    linear(w.wkv, "wkv", HeadDim, s.dim);
    linear(w.wo_b, "wo_b", s.dim, 1LL * s.groups * s.o_lora);
    sized(w.attn_sink, "attn_sink", s.heads);
    sized(w.wo_a, "wo_a", 1LL * s.groups * s.o_lora * (s.heads / s.groups) * HeadDim);
    if (wr.role == schedule::attn_role::full || wr.role == schedule::attn_role::reindex) {
      linear(w.idx_wq_b, "indexer.wq_b", 1LL * s.index_heads * IndexDim, s.q_lora);
      sized(w.weights_proj, "indexer.weights_proj", 1LL * s.index_heads * s.dim);
    }
  }

  long long max_keys() const { return lim_.max_tokens; }
  int candidate_width() const { return shape_.pool_blocks * shape_.pool_block; }

  static constexpr long long broken = -2;
  void check_slot(int slot) const {
    if (slot < 0 || slot >= lim_.max_seqs || slot_seq_[std::size_t(slot)] < 0)
      throw error("attention_stack: no live sequence in slot " + std::to_string(slot));
    if (lengths_[std::size_t(slot)] == broken)
      throw error("attention_stack: sequence slot " + std::to_string(slot) +
                  " was left inconsistent by a failed call; release it and start again");
  }

  void allocate_scratch() {
    const auto& s = shape_;
    const std::size_t R = std::size_t(lim_.max_rows);
    x_codes_ = decltype(x_codes_)(R * s.dim), x_scales_ = decltype(x_scales_)(R * s.dim / 32);
    qr_ = decltype(qr_)(R * s.q_lora), qr_codes_ = decltype(qr_codes_)(R * s.q_lora), qr_scales_ = decltype(qr_scales_)(R * s.q_lora / 32);
    q_ = decltype(q_)(R * s.heads * HeadDim), o_ = decltype(o_)(R * s.heads * HeadDim);
    kv_ = decltype(kv_)(R * HeadDim), chunk_kv_ = decltype(chunk_kv_)(R * window_layout::bytes);
    latents_ = decltype(latents_)(R * HeadDim), keys_ = decltype(keys_)(R * IndexDim);
    xf_ = decltype(xf_)(R * s.dim), ck_ = decltype(ck_)(R * HeadDim), cz_ = decltype(cz_)(R * HeadDim);
    iq_ = decltype(iq_)(R * s.index_heads * IndexDim), iq_codes_ = decltype(iq_codes_)(R * s.index_heads * IndexDim / 2);
    iq_scales_ = decltype(iq_scales_)(R * s.index_heads * IndexDim / 32), wp_ = decltype(wp_)(R * s.index_heads);
    topk_ = decltype(topk_)(R * std::max(s.topk, 1));
    idx_ = decltype(idx_)(R * std::size_t(std::max(s.window, lim_.max_rows) + s.topk));
    scores_ = decltype(scores_)(R * std::size_t(max_keys()));
    // Several CTAs per row pay off for decode-sized calls (few long rows); a prefill's many rows
    // keep one CTA each, so the scratch covers 64 rows (8.4 MB at V4.1's longest rows).
    topk_scratch_ = decltype(topk_scratch_)(
        std::max<std::size_t>(1, indexer::topk_scratch_words(int(std::min<std::size_t>(R, 64)), max_keys())));
    gathered_scores_ = decltype(gathered_scores_)(R * std::size_t(candidate_width()));
    cand_pos_ = decltype(cand_pos_)(R * std::size_t(candidate_width()));
    const long long blocks = (max_keys() + s.pool_block - 1) / std::max(s.pool_block, 1);
    block_scores_ = decltype(block_scores_)(R * std::size_t(blocks));
    block_ids_ = decltype(block_ids_)(R * std::size_t(std::max(s.pool_blocks, 1)));
    // The FP8 linears' prefill path (dequantize + cuBLAS from gemm::dequant_min_tokens rows):
    // without this scratch an 8K prefill ran them on the decode kernel, 8.8 ms per wq_b call at
    // V4.1 widths (ncu, docs/perf.md). Capped (64 MB): larger calls go in passes.
    const long long n_q = 1LL * s.heads * HeadDim, n_iq = 1LL * s.index_heads * IndexDim;
    gemm_ws_.emplace(std::size_t(1) << 22,
                     gemm::dequant_elems_for(lim_.max_rows, {{s.q_lora, s.dim}, {n_q, s.q_lora}, {HeadDim, s.dim}, {n_iq, s.q_lora}}),
                     gemm::folded_bytes_for(lim_.max_rows, std::max<long long>(s.dim, s.q_lora)));
    out_ws_.emplace(output::output_shape{s.heads, HeadDim, s.groups, s.o_lora, s.dim}, lim_.max_rows);
    attn_ws_.emplace(sparse_attention_workspace::for_device<HeadDim>());
  }

  //! The call metadata arena, for the most a call may put: rows <= max_rows; batch <=
  //! min(max_rows, max_seqs) (a decode batch is distinct live slots, the other calls one);
  //! latents <= rows per ratio (completed_groups(start, t, r) <= t for r >= 1). begin() reserves
  //! the same slots from its own rows and batch, in any order.
  void allocate_metadata() {
    using A = runtime::upload_arena;
    const std::size_t rows = std::size_t(lim_.max_rows), batch = std::size_t(std::min(lim_.max_rows, lim_.max_seqs));
    std::size_t bytes = A::space<std::int64_t>(rows) + 3 * A::space<std::int32_t>(rows) + A::space<std::int32_t>(batch) +
                        A::space<std::int32_t>(batch * std::size_t(max_pages_));
    for (int ratios = 0; ratios < 2; ++ratios)  // r = 1, 2
      bytes += A::space<std::int64_t>(rows) + A::space<compressor::pool_sequence>(batch) + A::space<std::int64_t>(rows) +
               A::space<std::int32_t>(rows);
    meta_ = A(bytes, "attention_stack call metadata");
  }

  //! `replay_from` >= 0: one sequence's last tokens again (positions from there; no new pages).
  void begin(const std::vector<int>& slots, const std::vector<int>& tokens, bool prefill, long long replay_from = -1) {
    if (call_) throw error("attention_stack: a call is already in progress (end_call first)");
    call_state c;
    c.slots = slots, c.tokens = tokens, c.prefill = prefill;
    std::vector<std::int64_t> pos;
    std::vector<std::int32_t> row_batch, row_slot, row_first, batch_slot(slots.begin(), slots.end());
    std::vector<std::int32_t> tables(slots.size() * std::size_t(max_pages_), 0);
    if (replay_from < 0) {  // pages for the new tokens of the whole batch, or none (checked before any is taken)
      long long need = 0;
      for (std::size_t b = 0; b < slots.size(); ++b) {
        const int seq = slot_seq_[std::size_t(slots[b])];
        const long long have = static_cast<long long>(alloc_->block_table(seq).size());
        need += (alloc_->tokens(seq) + tokens[b] + lim_.page_tokens - 1) / lim_.page_tokens - have;
      }
      if (need > alloc_->free_pages())
        throw error("attention_stack: the page pool is exhausted: this call needs " + std::to_string(need) + " more pages, " +
                    std::to_string(alloc_->free_pages()) + " are free; release sequences or allocate a larger pool");
      for (std::size_t b = 0; b < slots.size(); ++b) alloc_->append(slot_seq_[std::size_t(slots[b])], tokens[b]);
    }
    // From here a failure leaves the allocator ahead of the lengths: the sequences become unusable.
    struct mark_on_failure {
      attention_stack* self;
      const std::vector<int>& slots;
      bool armed = true;
      ~mark_on_failure() {
        if (armed)
          for (int s : slots) self->lengths_[std::size_t(s)] = broken;
      }
    } guard{this, slots};
    for (std::size_t b = 0; b < slots.size(); ++b) {
      const long long start = replay_from >= 0 ? replay_from : lengths_[std::size_t(slots[b])];
      c.start.push_back(start);
      const int first_row = int(pos.size());
      for (int t = 0; t < tokens[b]; ++t)
        pos.push_back(start + t), row_batch.push_back(int(b)), row_slot.push_back(slots[b]), row_first.push_back(first_row);
      c.chunk_width = std::max(c.chunk_width, tokens[b]);
      const auto& bt = alloc_->block_table(slot_seq_[std::size_t(slots[b])]);
      if (bt.size() > std::size_t(max_pages_)) throw error("attention_stack: a block table outgrew max_pages (internal error)");
      std::copy(bt.begin(), bt.end(), tables.begin() + std::ptrdiff_t(b) * max_pages_);
    }
    c.rows = int(pos.size());
    // Every slot is reserved for this call's rows or batch (not for the latents' count), so calls
    // of one shape see the same device pointers (runtime/upload_arena.cuh).
    const std::size_t rows = pos.size(), batch = slots.size();
    meta_.begin_pack();
    c.positions = meta_.put(std::span<const std::int64_t>(pos), rows, "positions");
    c.row_batch = meta_.put(std::span<const std::int32_t>(row_batch), rows, "row_batch");
    c.row_slot = meta_.put(std::span<const std::int32_t>(row_slot), rows, "row_slot");
    c.row_first = meta_.put(std::span<const std::int32_t>(row_first), rows, "row_first");
    c.batch_slot = meta_.put(std::span<const std::int32_t>(batch_slot), batch, "batch_slot");
    c.block_tables = meta_.put(std::span<const std::int32_t>(tables), batch * std::size_t(max_pages_), "block_tables");
    for (int r : {1, 2}) {
      std::vector<std::int64_t> vis(pos.size());
      for (std::size_t i = 0; i < pos.size(); ++i) vis[i] = (pos[i] + 1) / r;
      c.visible_by_ratio[std::size_t(r)] = meta_.put(std::span<const std::int64_t>(vis), rows, "visible_by_ratio");
      std::vector<compressor::pool_sequence> ps;
      std::vector<std::int64_t> lp;
      std::vector<std::int32_t> lb;
      int out_row = 0, row = 0, max_groups = 0;
      long long width = 0;
      for (std::size_t b = 0; b < slots.size(); ++b) {
        const long long start = c.start[b];
        ps.push_back({start, tokens[b], row, slots[b], out_row});
        const long long g0 = compressor::first_completed_group(start, r);
        const int n = int(compressor::completed_groups(start, tokens[b], r));
        for (int j = 0; j < n; ++j) lp.push_back((g0 + j) * r), lb.push_back(int(b));
        out_row += n, row += tokens[b], max_groups = std::max(max_groups, n);
        width = std::max(width, (start + tokens[b]) / r);
      }
      c.pool_seqs[std::size_t(r)] = meta_.put(std::span<const compressor::pool_sequence>(ps), batch, "pool_seqs");
      c.latent_pos[std::size_t(r)] = meta_.put(std::span<const std::int64_t>(lp), rows, "latent_pos");
      c.latent_batch[std::size_t(r)] = meta_.put(std::span<const std::int32_t>(lb), rows, "latent_batch");
      c.latents[r] = out_row, c.max_groups[r] = max_groups, c.width[r] = width;
    }
    meta_.upload(stream_);  // one copy for the whole call
    call_.emplace(std::move(c));
    guard.armed = false;
  }

  //! A KV owner's compression of the call's rows: latents (ratio 1: RMSNorm of the bf16
  //! projection; ratio 2: pooled with the decode state), then index keys and main entries into pages.
  void compress_owner(int layer, const bf16* x, cudaStream_t stream) {
    using namespace device_detail;
    call_state& c = *call_;
    const auto& s = shape_;
    const auto& wr = wiring_[std::size_t(layer)];
    auto& w = w_[std::size_t(layer)];
    const int R = c.rows, r = wr.ratio, pairs = s.rope_dim / 2;
    const float* freqs = freqs_compressed_.data();
    const cache::owner_region& region = regions_.at(layer);
    const int n = c.latents.at(r);
    if (r == 1) {
      gemm::linear_bf16(blas_, x, w.comp_wkv16.data(), latents_.data(), R, HeadDim, s.dim, stream);
      norm::rmsnorm<bf16>({latents_.data(), HeadDim, w.comp_norm.data(), latents_.data(), HeadDim, R, HeadDim, s.norm_eps}, stream);
    } else {
      numerics::widen_to_fp32(x, xf_.data(), 1LL * R * s.dim, stream);
      gemm::linear_fp32(blas_, xf_.data(), w.comp_wkv32.data(), ck_.data(), R, HeadDim, s.dim, stream);
      gemm::linear_fp32(blas_, xf_.data(), w.comp_wgate.data(), cz_.data(), R, HeadDim, s.dim, stream);
      compressor::compress_pool<HeadDim, bf16>({ck_.data(), cz_.data(), c.pool_seqs.at(std::size_t(r)), int(c.slots.size()),
                                                c.max_groups.at(r), states_k_.at(layer).data(), states_z_.at(layer).data(),
                                                w.comp_norm.data(), s.norm_eps, latents_.data(), nullptr, r, HeadDim},
                                               stream);
    }
    if (n > 0) {
      // Index keys from the pre-RoPE latents, then the main entries.
      gemm::linear_bf16(blas_, latents_.data(), w.index_wk.data(), keys_.data(), n, IndexDim, HeadDim, stream);
      compressor::pack_entries<numerics::index_key_format, IndexDim, bf16>(
          {keys_.data(), IndexDim, n, w.index_norm.data(), s.norm_eps, c.latent_pos.at(std::size_t(r)), c.latent_batch.at(std::size_t(r)),
           freqs, pairs, page_destination(region, true)},
          stream);
      compressor::pack_entries<numerics::main_kv_format, HeadDim, bf16>(
          {latents_.data(), HeadDim, n, nullptr, s.norm_eps, c.latent_pos.at(std::size_t(r)), c.latent_batch.at(std::size_t(r)), freqs,
           pairs, page_destination(region, false)},
          stream);
    }
  }

  compressor::entry_destination page_destination(const cache::owner_region& r, bool keys) {
    compressor::entry_destination d;
    d.mode = compressor::entry_store::pages;
    d.base = pool_.data();
    d.entry_stride = keys ? key_stride : main_layout::bytes;
    d.block_tables = call_->block_tables;
    d.max_pages = max_pages_;
    d.page_bytes = page_bytes_;
    d.region_offset = keys ? r.key_offset : r.main_offset;
    d.entries_per_page = r.entries_per_page;
    d.ratio = r.ratio;
    return d;
  }
};

template <int HeadDim, int IndexDim>
void attention_stack<HeadDim, IndexDim>::forward(int layer, const bf16* x, bf16* out,
                                                 const numerics::act_quant_view& x_act) {
  using namespace device_detail;
  const cudaStream_t stream = stream_;
  using schedule::attn_role;
  const std::string where = "attention_stack::forward (layer " + std::to_string(layer) + "): ";
  if (!call_) throw error(where + "no call in progress (begin_prefill / begin_decode first)");
  if (call_->next_layer == int(wiring_.size())) throw error(where + "every layer of this call has run; end_call first");
  if (layer != call_->next_layer) throw error(where + "layers run in order; expected layer " + std::to_string(call_->next_layer));
  if (!x || !out) throw error(where + "null x or out");
  if (bool(x_act.codes) != bool(x_act.scales))
    throw error(where + "x's act_quant needs both codes and scales, or neither");
  call_state& c = *call_;
  const auto& s = shape_;
  const auto& wr = wiring_[std::size_t(layer)];
  auto& w = w_[std::size_t(layer)];
  const int R = c.rows;
  const float* freqs = wr.ratio > 0 ? freqs_compressed_.data() : freqs_local_.data();
  const int pairs = s.rope_dim / 2;
  auto gemm_args = [&](const fp8_weight& wt, const std::uint8_t* a, const std::uint8_t* as, bf16* y) {
    return gemm::block_scaled_gemm_args{{R, wt.n, wt.k}, a, as, wt.codes.data(), wt.scales.data(), y};
  };
  auto linear = [&](const fp8_weight& wt, const std::uint8_t* a, const std::uint8_t* as, bf16* y) {
    gemm::block_scaled_linear(gemm_args(wt, a, as, y), gemm::weight_format::fp8_tile32, &*gemm_ws_, blas_, stream);
  };

  // Queries and the window entries.
  const std::uint8_t* xc = x_act.codes ? x_act.codes : x_codes_.data();
  const std::uint8_t* xs = x_act.codes ? x_act.scales : x_scales_.data();
  if (!x_act.codes)
    numerics::quantize<numerics::fp8_act_format>(
        {x, R, s.dim, s.dim, x_codes_.data(), s.dim, x_scales_.data(), s.dim / 32}, stream);
  // wq_a and wkv read the same input: one launch where both take the few-token kernel.
  gemm::block_scaled_linear_pair(gemm_args(w.wq_a, xc, xs, qr_.data()), gemm_args(w.wkv, xc, xs, kv_.data()),
                                 gemm::weight_format::fp8_tile32, &*gemm_ws_, blas_, stream);
  // q_norm and the act_quant wq_b (and the indexer's wq_b) read, in one launch.
  norm::rmsnorm_args<bf16> qn{qr_.data(), s.q_lora, w.q_norm.data(), qr_.data(),
                              s.q_lora,   R,        s.q_lora,        s.norm_eps};
  qn.codes = qr_codes_.data(), qn.codes_stride = s.q_lora, qn.scales = qr_scales_.data(),
  qn.scales_stride = s.q_lora / 32;
  norm::rmsnorm_quantized(qn, stream);
  linear(w.wq_b, qr_codes_.data(), qr_scales_.data(), q_.data());
  // (The queries' RoPE runs in the index lists' launch, below.)
  auto& ring = rings_[std::size_t(layer)];
  compressor::entry_destination ring_dst;
  ring_dst.mode = compressor::entry_store::ring;
  ring_dst.base = ring.data();
  ring_dst.entry_stride = window_layout::bytes;
  ring_dst.seq_stride = 1LL * s.window * window_layout::bytes;
  ring_dst.ring_rows = s.window;
  compressor::entry_destination rows_dst;  // the call's own rows: the operand of a prefill, replay or append
  rows_dst.mode = compressor::entry_store::rows;
  rows_dst.base = chunk_kv_.data();
  rows_dst.entry_stride = window_layout::bytes;
  auto pack_window = [&](int first, int rows, const compressor::entry_destination& dst, const std::int32_t* slots) {
    compressor::pack_entries<window_format, HeadDim, bf16>(
        {kv_.data() + std::size_t(first) * HeadDim, HeadDim, rows, w.kv_norm.data(), s.norm_eps, c.positions + first,
         slots ? slots + first : nullptr, freqs, pairs, dst},
        stream);
  };
  const bool own_rows = c.prefill || c.replay;  // the window operand is the call's own rows
  // The call's last positions are what the ring keeps: of one sequence's rows the last `window`;
  // appends to several sequences hold at most `window` rows each (begin_appends), all kept.
  const int ring_first = c.slots.size() > 1 ? 0 : std::max(0, R - s.window);
  if (own_rows || c.append) pack_window(0, R, rows_dst, nullptr);
  if (own_rows) pack_window(ring_first, R - ring_first, ring_dst, c.row_slot);
  // Decode: straight into the ring, in the index lists' launch below (nothing before it reads the
  // ring). An appended chunk enters the ring after the attention, which still reads the old slots.
  compressor::pack_args<bf16> decode_pack;
  if (!own_rows && !c.append) {
    decode_pack = {kv_.data(), HeadDim, R,     w.kv_norm.data(), s.norm_eps, c.positions,
                   c.row_slot, freqs,   pairs, ring_dst};
    if (const std::string why = compressor::can_pack<window_format, HeadDim>(decode_pack); !why.empty())
      throw error(where + "the window entries: " + why);
  }
  const int window_width = own_rows ? std::min(R, s.window) : s.window;
  const int operand_rows = own_rows ? R : c.append ? s.window + c.chunk_width : s.window;

  // Global branch. From here to the output projection the launches follow the sequences'
  // lengths (widths, top-k, candidate counts, the split of the attention): never in a segment.
  if (segments_) segments_->end_segment();
  int topk_width = 0;
  if (wr.ratio > 0) {
    const bool owner = wr.role == attn_role::full, source = owner || wr.role == attn_role::reindex;
    const cache::owner_region& region = regions_.at(wr.kv_owner);
    const int r = wr.ratio;
    const long long width = c.width.at(r);
    if (owner && !c.replay) compress_owner(layer, x, stream);
    if (source) {
      c.topk_width = int(std::min<long long>(s.topk, width));
      if (width > 0) {
        const int ih = s.index_heads;
        // The indexer's queries and weights depend only on the rows: a segment of their own.
        if (segments_) segments_->begin_segment();
        linear(w.idx_wq_b, qr_codes_.data(), qr_scales_.data(), iq_.data());
        rope::apply_rope({iq_.data(), c.positions, freqs, R, ih, IndexDim, pairs, false}, stream);
        const int qn = ih * IndexDim;
        numerics::quantize<numerics::index_key_format>({iq_.data(), R, qn, qn, iq_codes_.data(), qn / 2, iq_scales_.data(), qn / 32}, stream);
        numerics::dequantize<numerics::index_key_format>({iq_codes_.data(), qn / 2, iq_scales_.data(), qn / 32, R, qn, iq_.data(), qn}, stream);
        gemm::linear_bf16(blas_, x, w.weights_proj.data(), wp_.data(), R, ih, s.dim, stream);
        runtime::launch_programmatic(scale_bf16_kernel, dim3(blocks_for(1LL * R * ih)), dim3(256), 0, stream, wp_.data(),
                                     1LL * R * ih, 0x1p-6f);
        DSV4_CUDA_CHECK_LAUNCH();
        if (segments_) segments_->end_segment();
        indexer::index_scan_args scan;
        scan.q = iq_.data(), scan.w = wp_.data();
        scan.keys = pool_.data() + region.key_offset, scan.key_stride = key_stride;
        scan.scores = scores_.data(), scan.visible = reinterpret_cast<const long long*>(c.visible_by_ratio[std::size_t(r)]);
        scan.rows = R, scan.heads = ih, scan.n_keys = width;
        scan.block_tables = c.block_tables, scan.row_batch = c.row_batch;
        scan.max_pages = max_pages_, scan.entries_per_page = region.entries_per_page, scan.page_bytes = page_bytes_;
        if (wr.role == attn_role::reindex) {
          if (c.candidate_cols <= 0) throw error(where + "a Reindex layer needs the candidate pool of an earlier layer of this call");
          indexer::index_scan_args g = scan;
          g.scores = gathered_scores_.data(), g.n_keys = c.candidate_cols;
          indexer::index_scan_gathered<IndexDim>({g, cand_pos_.data()}, stream);
          if (sum_scores_) sum_scores_(gathered_scores_.data(), std::size_t(R) * std::size_t(c.candidate_cols), stream);
          indexer::topk_args t;
          t.scores = gathered_scores_.data(), t.n = c.candidate_cols, t.rows = R, t.k = c.topk_width;
          t.visible = scan.visible, t.offset = operand_rows, t.out = topk_.data(), t.positions = cand_pos_.data();
          indexer::select_topk(t, stream);
        } else {
          indexer::index_scan<IndexDim>(scan, stream);
          if (sum_scores_) sum_scores_(scores_.data(), std::size_t(R) * std::size_t(width), stream);
          if (wr.candidate_source) {
            indexer::candidate_args ca;
            ca.scores = scores_.data(), ca.n = width, ca.rows = R, ca.block = s.pool_block, ca.topk_blocks = s.pool_blocks;
            ca.visible = scan.visible, ca.block_scores = block_scores_.data(), ca.block_ids = block_ids_.data();
            ca.positions = cand_pos_.data();
            c.candidate_cols = int(indexer::candidate_pool(ca, stream));
          }
          indexer::topk_args t;
          t.scores = scores_.data(), t.n = width, t.rows = R, t.k = c.topk_width;
          t.visible = scan.visible, t.offset = operand_rows, t.out = topk_.data();
          t.scratch = topk_scratch_.data(), t.scratch_words = topk_scratch_.size();
          indexer::select_topk(t, stream);
        }
      }
    }
    topk_width = c.topk_width;
  }

  // Index lists, attention, output.
  const int width = window_width + topk_width;
  index_list_args il;
  il.idx = idx_.data(), il.topk = topk_.data(), il.positions = c.positions, il.rows = R;
  il.window_width = window_width, il.topk_width = topk_width, il.window = s.window;
  il.prefill = own_rows, il.append = c.append, il.row_first = c.row_first;
  il.q_rope = {q_.data(), c.positions, freqs, R, s.heads, HeadDim, pairs, false};
  il.list_blocks = blocks_for(1LL * R * width, index_list_threads);
  il.rope_blocks = blocks_for(rope::pairs_of(il.q_rope), index_list_threads);
  il.window_pack = decode_pack;
  const unsigned pack_blocks = blocks_for(decode_pack.rows, index_list_threads / 32);
  runtime::launch_programmatic(index_list_kernel<window_format, HeadDim>,
                               dim3(il.list_blocks + il.rope_blocks + pack_blocks), dim3(index_list_threads),
                               0, stream, il);
  DSV4_CUDA_CHECK_LAUNCH();
  sparse_attention_args sa;
  sa.q = q_.data(), sa.idx = idx_.data(), sa.sink = w.attn_sink.data(), sa.out = o_.data();
  sa.batch = own_rows ? 1 : R, sa.rows = own_rows ? R : 1, sa.heads = s.heads, sa.topk = width;  // append: below
  sa.scale = float(std::pow(double(HeadDim), -0.5));
  // The operand: the call's rows (prefill), the ring (decode), or the ring then the call's rows
  // (append), followed by the owner's global entries on compressed layers.
  window_ring<window_format, HeadDim> win;
  win.stride = window_layout::bytes;
  if (own_rows) {
    win.base = chunk_kv_.data(), win.seq_stride = 0, win.rows = R;
  } else {
    win.base = ring.data(), win.seq_stride = 1LL * s.window * window_layout::bytes, win.rows = s.window;
    win.slots = c.batch_slot;
  }
  const cache::owner_region* region = wr.ratio > 0 ? &regions_.at(wr.kv_owner) : nullptr;
  if (c.append) {
    // Every row a batch entry of its own (decode's grid: a CTA per row and head group either
    // way), mapped to its sequence's ring, chunk and block table.
    sa.batch = R, sa.rows = 1;
    appended_kv<window_format, numerics::main_kv_format, HeadDim> kv;
    kv.window = win, kv.window.slots = c.row_slot;
    kv.chunk = chunk_kv_.data(), kv.chunk_rows = c.chunk_width, kv.chunk_first = c.row_first, kv.table_row = c.row_batch;
    if (region) {
      kv.pool = pool_.data(), kv.block_tables = c.block_tables, kv.max_pages = max_pages_;
      kv.page_bytes = page_bytes_, kv.region_offset = region->main_offset, kv.entries_per_page = region->entries_per_page;
    }
    sparse_attention<HeadDim>(sa, kv, stream, &*attn_ws_);
    pack_window(ring_first, R - ring_first, ring_dst, c.row_slot);  // only now may the chunk enter the ring
  } else if (region) {
    paged_kv<window_format, numerics::main_kv_format, HeadDim> kv;
    kv.window = win, kv.pool = pool_.data(), kv.block_tables = c.block_tables, kv.max_pages = max_pages_;
    kv.page_bytes = page_bytes_, kv.region_offset = region->main_offset, kv.entries_per_page = region->entries_per_page;
    sparse_attention<HeadDim>(sa, kv, stream, &*attn_ws_);
  } else {
    packed_kv<window_format, numerics::main_kv_format, HeadDim> kv;
    kv.window = win;
    sparse_attention<HeadDim>(sa, kv, stream, &*attn_ws_);
  }
  if (segments_) segments_->begin_segment();
  output::attention_output(o_.data(), c.positions, R, freqs, s.rope_dim, w.wo_a.data(), w.wo_b.codes.data(),
                           w.wo_b.scales.data(), out, *out_ws_, blas_, stream, w.wo_a_fp8.view());
  ++c.next_layer;
}

}  // namespace dsv4::kernels::attention
