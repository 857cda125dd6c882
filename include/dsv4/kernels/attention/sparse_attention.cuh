#pragma once
//! \file
//! CUDA sparse attention with a sink: the recurrence of reference.hpp (chunks of 64 indices in
//! list order, online softmax, probabilities rounded to bf16 before they weight the values, sink
//! in the denominator), reading its KV operand either as bf16 rows or straight from the packed
//! caches (FP8 window entries and FP4 global entries, dequantized in the kernel).
//!
//! Work split (tensor cores, mma.sync bf16; the kernel's comment has the details): one CTA per
//! (query row, up to 64 heads, KV split), up to sixteen warps: one to four head tiles of 16 (as
//! the heads fill them) x four quarters (of a chunk's entries for the scores, of the channels
//! for the values). Each chunk of 64 indexed entries is dequantized once into shared memory and
//! serves all of the CTA's heads; its packed bytes are copied in (bulk copies on sm_90, one per
//! entry) while the chunk before it is computed.
//!
//! Split KV (decode): with few rows the (row, head group) grid leaves most SMs idle (one CTA for
//! one decode row of 64 heads), so the index list is cut at chunk boundaries into splits that run
//! side by side, each writing its unnormalized accumulator, running maximum and denominator to a
//! workspace; a merge kernel adds them with the sink (flash-decoding). The reference rounds each
//! probability to bf16 relative to the running maximum of all chunks so far, so a split that
//! started from its own maximum would round differently (measured: a few outputs per thousand
//! rows beyond 1 bf16 ulp where values cancel). A first pass therefore computes every chunk's
//! maximum score, and each split starts from the maximum of the chunks before it: every
//! probability and every running maximum is then the unsplit recurrence's, bit for bit, and only
//! the fp32 sums differ (the merge rescales each split's sum once instead of carrying one
//! accumulator through every chunk). Without a workspace the kernel runs unsplit.

#include <cuda_pipeline.h>  // __pipeline_memcpy_async (cp.async)
#include <cuda_runtime.h>   // provides cudaFuncSetAttribute

#include <algorithm>
#include <cstdint>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/core/process_switch.hpp"
#include "dsv4/kernels/attention/reference.hpp"
#include "dsv4/kernels/bulk_copy.cuh"
#include "dsv4/kernels/tensor_core.cuh"
#include "dsv4/kernels/wgmma.cuh"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/fast_codec.cuh"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "dsv4/runtime/device_info.cuh"
#include "dsv4/runtime/grid_barrier.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::attention {

using numerics::bf16;

//! The reference's operand: per sequence, `entries` rows of `Dim` bf16 values, `row_stride`
//! elements apart; sequence b starts `seq_stride` elements after sequence b - 1.
template <int Dim>
struct bf16_kv {
  const bf16* kv = nullptr;
  int entries = 0;
  long long row_stride = Dim;
  long long seq_stride = 0;

  //! Where entry e of sequence seq lies; load8 then reads channels [c0, c0 + 8) of it as four
  //! bf16x2 words (the lower channel in the low half). Every KV operand below has this pair: the
  //! kernel locates a chunk's entries once (ring slots, block tables) and then streams their bytes.
  using entry_ref = const bf16*;
  //! Bytes of an entry's staging slot in shared memory; 0: the kernel reads entries in place (a
  //! bf16 row is 1 KB at Dim 512, too large to stage two chunks of).
  static constexpr int stage_bytes = 0;
  DSV4_DEVICE entry_ref locate(int seq, int e) const { return kv + seq * seq_stride + e * row_stride; }
  DSV4_DEVICE uint4 load8(entry_ref p, int /*e*/, int c0) const { return __ldg(reinterpret_cast<const uint4*>(p + c0)); }
  std::string check() const {
    if (entries > 0 && (!kv || reinterpret_cast<std::uintptr_t>(kv) % 16 || row_stride % 8 || seq_stride % 8))
      return "bf16 kv must be 16-byte aligned with a row stride that is a multiple of 8";
    return {};
  }
};

//! Each sequence's local window ring: `rows` entries of WindowFormat (FP8, 528 B at Dim 512).
template <class WindowFormat, int Dim>
struct window_ring {
  using layout = numerics::packed_vector<WindowFormat, Dim>;
  const std::uint8_t* base = nullptr;
  long long stride = layout::bytes;
  long long seq_stride = 0;  //!< bytes from one sequence's ring to the next
  int rows = 0;
  //! Optional [batch]: the ring of batch entry b is ring slots[b] (sequences keep their ring
  //! while the batch around them changes); null: ring b.
  const std::int32_t* slots = nullptr;

  using entry_ref = const std::uint8_t*;
  DSV4_DEVICE entry_ref locate(int seq, int e) const {
    const long long ring = slots ? slots[seq] : seq;
    return base + ring * seq_stride + e * stride;
  }
  std::string check() const {
    if (rows > 0 && (!base || reinterpret_cast<std::uintptr_t>(base) % 4 || stride % 4 || seq_stride % 4))
      return "window cache must be 4-byte aligned with strides that are multiples of 4 bytes";
    return {};
  }
};

//! What the packed operands below share: entry e is a WindowFormat vector where the operand's
//! `windowed(e)` says so, else a GlobalFormat one. The kernel stages each chunk's packed bytes in
//! shared memory (bulk copies or cp.async, `entry_bytes` each, in slots of `stage_bytes`) while it
//! computes the chunk before, then dequantizes them from there (`load_staged8`, `decode_staged8`);
//! `load8` reads an entry in place (launches that do not stage: one head tile, wide Dims).
template <class WindowFormat, class GlobalFormat, int Dim, class Operand>
struct two_format_entries {
  using window_layout = numerics::packed_vector<WindowFormat, Dim>;
  using global_layout = numerics::packed_vector<GlobalFormat, Dim>;
  static constexpr int stage_bytes = (std::max(window_layout::bytes, global_layout::bytes) + 15) / 16 * 16;
  DSV4_DEVICE int entry_bytes(int e) const {
    return static_cast<const Operand*>(this)->windowed(e) ? int(window_layout::bytes) : int(global_layout::bytes);
  }
  DSV4_DEVICE uint4 load8(const std::uint8_t* p, int e, int c0) const {
    return static_cast<const Operand*>(this)->windowed(e)
               ? numerics::dequantize8_packed<WindowFormat, Dim>(p, c0)
               : numerics::dequantize8_packed<GlobalFormat, Dim>(p, c0);
  }
  //! load8 from a staged copy in two steps, so that the kernel can issue the loads of several
  //! entries before it converts the first: the bits of channels [c0, c0 + 8) of entry e at p
  //! (any address that holds entry_bytes(e) bytes: an empty slot's garbage is never decoded into
  //! the result the kernel keeps), then their bf16 values.
  struct staged8 {
    numerics::packed8_bits bits;
    bool window;
  };
  DSV4_DEVICE staged8 load_staged8(const std::uint8_t* p, int e, int c0) const {
    static_assert(
        numerics::has_fast_packed8<WindowFormat> && numerics::has_fast_packed8<GlobalFormat>,
        "two_format_entries: the staged path needs the fast codecs of both formats (fast_codec.cuh)");
    constexpr auto any = numerics::packed_source::any;
    const bool window = static_cast<const Operand*>(this)->windowed(e);
    return {window ? numerics::load_packed8<WindowFormat, Dim, any>(p, c0)
                   : numerics::load_packed8<GlobalFormat, Dim, any>(p, c0),
            window};
  }
  DSV4_DEVICE uint4 decode_staged8(const staged8& s) const {
    return s.window ? numerics::decode_packed8<WindowFormat>(s.bits)
                    : numerics::decode_packed8<GlobalFormat>(s.bits);
  }
};

//! The packed caches of each sequence, as the reference concatenates them (spec §5 combine):
//! index j < window.rows reads window row j, and j >= window.rows reads global entry
//! j - window.rows (GlobalFormat, FP4 288 B at Dim 512), contiguous per sequence.
template <class WindowFormat, class GlobalFormat, int Dim>
struct packed_kv : two_format_entries<WindowFormat, GlobalFormat, Dim, packed_kv<WindowFormat, GlobalFormat, Dim>> {
  using global_layout = numerics::packed_vector<GlobalFormat, Dim>;
  window_ring<WindowFormat, Dim> window;
  const std::uint8_t* global = nullptr;
  long long global_stride = global_layout::bytes;
  long long global_seq_stride = 0;  //!< bytes from one sequence's global entries to the next
  int global_rows = 0;

  int entries() const { return window.rows + global_rows; }
  using entry_ref = const std::uint8_t*;
  DSV4_DEVICE entry_ref locate(int seq, int e) const {
    if (e < window.rows) return window.locate(seq, e);
    return global + seq * global_seq_stride + (e - window.rows) * global_stride;
  }
  DSV4_DEVICE bool windowed(int e) const { return e < window.rows; }
  std::string check() const {
    if (global_rows > 0 &&
        (!global || reinterpret_cast<std::uintptr_t>(global) % 4 || global_stride % 4 || global_seq_stride % 4))
      return "global cache must be 4-byte aligned with strides that are multiples of 4 bytes";
    return window.check();
  }
};

//! The production layout: each sequence's window ring and its global entries in the shared page
//! pool (cache/paged_cache.hpp), found through the sequence's block table. Index j < window.rows
//! reads the ring; j >= window.rows reads global entry j - window.rows of the owner's region.
template <class WindowFormat, class GlobalFormat, int Dim>
struct paged_kv : two_format_entries<WindowFormat, GlobalFormat, Dim, paged_kv<WindowFormat, GlobalFormat, Dim>> {
  using global_layout = numerics::packed_vector<GlobalFormat, Dim>;
  window_ring<WindowFormat, Dim> window;
  const std::uint8_t* pool = nullptr;           //!< page pool base
  const std::int32_t* block_tables = nullptr;   //!< [batch, max_pages]
  int max_pages = 0;                            //!< row length of block_tables
  long long page_bytes = 0;
  long long region_offset = 0;                  //!< the owner's main-KV region in a page
  int entries_per_page = 0;

  using entry_ref = const std::uint8_t*;
  DSV4_DEVICE entry_ref locate(int seq, int e) const {
    if (e < window.rows) return window.locate(seq, e);
    const int g = e - window.rows;
    const long long page = block_tables[static_cast<long long>(seq) * max_pages + g / entries_per_page];
    return pool + page * page_bytes + region_offset + static_cast<long long>(g % entries_per_page) * global_layout::bytes;
  }
  DSV4_DEVICE bool windowed(int e) const { return e < window.rows; }
  std::string check() const {
    if (!pool || !block_tables || entries_per_page <= 0 || reinterpret_cast<std::uintptr_t>(pool) % 4 ||
        page_bytes % 4 || region_offset % 4)
      return "paged cache needs a 4-byte aligned pool, block tables, and positive entries per page";
    return window.check();
  }
};

//! A chunk appended after the prefill (exact mode): index j < window.rows reads the sequence's
//! ring (positions before the chunk), j < window.rows + chunk_rows reads the chunk's own window
//! entries, and the rest reads global entries through the block table, when there is a global
//! cache (pool not null). One sequence's chunk (chunk_first and table_row null), or several
//! sequences' chunks of one call with every query row a batch entry of its own (the attention
//! stack's appends: window.slots, chunk_first and table_row then map a row to its sequence).
template <class WindowFormat, class GlobalFormat, int Dim>
struct appended_kv : two_format_entries<WindowFormat, GlobalFormat, Dim, appended_kv<WindowFormat, GlobalFormat, Dim>> {
  using window_layout = numerics::packed_vector<WindowFormat, Dim>;
  using global_layout = numerics::packed_vector<GlobalFormat, Dim>;
  window_ring<WindowFormat, Dim> window;
  const std::uint8_t* chunk = nullptr;          //!< window entries of the chunks (below)
  long long chunk_stride = window_layout::bytes;
  //! The chunk part's width in the operand: entries window.rows .. window.rows + chunk_rows - 1
  //! are chunk rows (an entry list of a shorter chunk never reaches past its own rows).
  int chunk_rows = 0;
  //! Optional [batch]: where batch entry b's chunk starts among `chunk`'s rows (several
  //! sequences' chunks in one call, each query row its own batch entry); null: row 0.
  const std::int32_t* chunk_first = nullptr;
  //! Optional [batch]: the block-table row of batch entry b; null: row b.
  const std::int32_t* table_row = nullptr;
  const std::uint8_t* pool = nullptr;           //!< page pool base, or null (a local layer)
  const std::int32_t* block_tables = nullptr;   //!< [table rows, max_pages]
  int max_pages = 0;
  long long page_bytes = 0;
  long long region_offset = 0;
  int entries_per_page = 0;

  using entry_ref = const std::uint8_t*;
  DSV4_DEVICE entry_ref locate(int seq, int e) const {
    if (e < window.rows) return window.locate(seq, e);
    if (e < window.rows + chunk_rows) {
      const long long first = chunk_first ? chunk_first[seq] : 0;
      return chunk + (first + (e - window.rows)) * chunk_stride;
    }
    const int g = e - window.rows - chunk_rows;
    const long long table = table_row ? table_row[seq] : seq;
    const long long page = block_tables[table * max_pages + g / entries_per_page];
    return pool + page * page_bytes + region_offset + static_cast<long long>(g % entries_per_page) * global_layout::bytes;
  }
  DSV4_DEVICE bool windowed(int e) const { return e < window.rows + chunk_rows; }
  std::string check() const {
    if (chunk_rows > 0 && (!chunk || reinterpret_cast<std::uintptr_t>(chunk) % 4 || chunk_stride % 4))
      return "the chunk's window entries must be 4-byte aligned with a stride that is a multiple of 4 bytes";
    if (pool && (!block_tables || entries_per_page <= 0 || reinterpret_cast<std::uintptr_t>(pool) % 4 || page_bytes % 4 ||
                 region_offset % 4))
      return "paged cache needs a 4-byte aligned pool, block tables, and positive entries per page";
    return window.check();
  }
};

//! `batch` sequences of `rows` query rows each (decode: 1 to 6 rows per sequence; prefill: the
//! chunk's tokens), all with `heads` heads and `topk` indices per row.
struct sparse_attention_args {
  const bf16* q = nullptr;            //!< [batch, rows, heads, dim]
  const std::int32_t* idx = nullptr;  //!< [batch, rows, topk], -1 = none, else an entry of the operand
  const float* sink = nullptr;        //!< [heads]
  bf16* out = nullptr;                //!< [batch, rows, heads, dim]
  int batch = 1, rows = 0, heads = 0, topk = 0;
  float scale = 0;
  //! Whether CTAs of 64 heads at Dim 512 (V4.1's attention) may run on warpgroup MMAs (sm_90a,
  //! where the device has them); false: mma.sync everywhere (tests and bench_attention compare).
  bool allow_wgmma = true;
  //! Head tiles of 16 per CTA: 0 lets the launcher choose (launch_head_tiles), 1, 2 or 4 force
  //! it (tests and bench_attention compare). Heads are independent softmaxes, so the tile count
  //! changes no head's arithmetic: the mma.sync kernels give the same bits at every count.
  int head_tiles = 0;
};

//! Scratch of split-KV launches: per (row, head, split) the unnormalized fp32 accumulator and the
//! split's running maximum and denominator, per (row, head, chunk) the chunk's maximum score,
//! and the barrier counters of the single-launch form (one set per (row, head group), zero
//! between launches). One workspace serves any number of launches on one stream, one at a time
//! (each launch's merge has read it before the next writes it).
class sparse_attention_workspace {
 public:
  static constexpr int counters_per_group = 3;  // the maxima's barrier, the partials' barrier, the exit count
  sparse_attention_workspace() = default;
  explicit sparse_attention_workspace(std::size_t floats)
      : partials_(floats), counters_(std::size_t(counters_per_group) * std::max(1, runtime::sm_count())) {
    counters_.fill_bytes(0);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());  // the memset runs on the legacy stream
  }
  //! Enough for the splits the launcher chooses on this device at any batch (one wave of CTAs of
  //! up to 64 heads each) with up to 256 chunks (16,384 indices) a row.
  template <int Dim>
  static sparse_attention_workspace for_device() {
    return sparse_attention_workspace(std::size_t(runtime::sm_count()) * 64 * (Dim + 4 + 256));
  }
  float* data() { return partials_.data(); }
  std::size_t floats() const { return partials_.size(); }
  unsigned* counters() { return counters_.data(); }
  //! (row, head group) pairs whose splits can meet in one launch.
  long long counter_groups() const { return static_cast<long long>(counters_.size()) / counters_per_group; }
  //! Whether a split launch whose splits hold one chunk each may run as one cooperative launch
  //! (chunk maxima, split sums and merge behind in-kernel barriers) instead of three; on by
  //! default. Both give the same bits; tests and benchmarks switch it off to compare.
  void set_single_launch(bool on) { single_launch_ = on; }
  bool single_launch() const { return single_launch_; }

 private:
  runtime::device_buffer<float> partials_;
  runtime::device_buffer<unsigned> counters_;
  bool single_launch_ = true;
};

namespace detail {
inline constexpr int head_tile = 16;      // query heads per MMA tile (the MMA's M side)
inline constexpr int channel_parts = 4;   // warps that share a head tile, each a quarter of the channels
inline constexpr int max_head_tiles = 4;  // 64 heads per CTA: each dequantized chunk serves them all

//! Head tiles per CTA for `heads` query heads: as many as the heads fill, at most four.
inline int head_tiles_for(int heads) { return heads <= head_tile ? 1 : heads <= 2 * head_tile ? 2 : max_head_tiles; }
inline int heads_per_cta(int heads) { return head_tile * head_tiles_for(heads); }
//! Calls of up to this many query rows (batch x rows) run 64 heads as two CTAs of 32: each CTA
//! computes half of a chunk's scores, values and merge (and dequantizes the whole chunk), which
//! shortens the chain of chunks where SMs are idle anyway. bench_attention --head-tiles (H100,
//! 64 heads x 640 indices): 18.8 / 19.1 / 21.6 / 30.1 us at 1 / 2 / 4 / 8 rows against 26.2 /
//! 26.6 / 27.1 / 31.4 with 64-head CTAs; from 16 rows the doubled dequantization costs more
//! (48.4 against 39.8 us).
inline constexpr long long half_tiles_max_rows = 8;
struct half_tiles_tag {};
//! The head tiles a launch of `a` runs with: the caller's (sparse_attention_args::head_tiles), or
//! as many as the heads fill (head_tiles_for), halved for 64 heads in small decode calls.
inline int launch_head_tiles(const sparse_attention_args& a) {
  if (a.head_tiles > 0) return a.head_tiles;
  const int fill = head_tiles_for(a.heads);
  const long long rows = static_cast<long long>(a.batch) * a.rows;
  const bool halve = fill == max_head_tiles && rows <= half_tiles_max_rows && process_switch<half_tiles_tag>::on();
  return halve ? fill / 2 : fill;
}
inline int launch_heads_per_cta(const sparse_attention_args& a) {
  return head_tile * launch_head_tiles(a);
}
//! CTAs a query row takes (head groups) in a launch of `a`.
inline int launch_head_groups(const sparse_attention_args& a) {
  return (a.heads + launch_heads_per_cta(a) - 1) / launch_heads_per_cta(a);
}

//! How a launch cuts each row's index list: `splits` pieces of `chunks_per_split` 64-entry chunks.
struct kv_split {
  float* partials = nullptr;   //!< [batch * rows, heads, splits, Dim + 4]: acc[Dim], m, l; null = unsplit
  float* chunk_max = nullptr;  //!< [batch * rows, heads, chunks]: each chunk's maximum score
  int splits = 1;
  int chunks_per_split = 0;
  int chunks = 0;
  bool max_pass = false;       //!< this launch only writes chunk_max (grid z = the chunks before the last split)
  //! One cooperative launch (one chunk per split): each split publishes its chunk's maximum and
  //! waits for the others' at a barrier of its (row, head group), and after a second barrier the
  //! splits merge the group's heads between them. Null: the maximum pass, the split pass and the
  //! merge are three launches.
  unsigned* barriers = nullptr;  //!< [rows * head groups][counters_per_group]
};

using tensor_core::ldmatrix_x4;
using tensor_core::mma_bf16;

DSV4_DEVICE std::uint32_t bf16x2_bits(float lo, float hi) {
  return std::uint32_t(bf16::from_float(lo).bits) | (std::uint32_t(bf16::from_float(hi).bits) << 16);
}

//! Shared memory of one CTA: the chunk's dequantized entries, the CTA's query heads, the chunk's
//! probabilities (bf16, the A operand of the value product), each entry quarter's per-head maxima
//! and sums, and two slots per entry for the packed bytes of the next chunks (StageBytes each; 0:
//! the operand is read in place). Rows of bf16 are padded by 16 bytes so that the eight row
//! addresses of an ldmatrix fall in different banks.
template <int Dim, int HeadTiles, int StageBytes>
struct mma_smem {
  static constexpr int row = Dim + 8;                     // bf16 elements per entry / head row
  static constexpr int p_row = sparse_chunk + 8;          // bf16 probabilities per head row
  static constexpr int heads = HeadTiles * head_tile;
  static constexpr std::size_t kv_bytes = std::size_t(sparse_chunk) * row * sizeof(bf16);
  static constexpr std::size_t q_bytes = std::size_t(heads) * row * sizeof(bf16);
  static constexpr std::size_t p_bytes = std::size_t(heads) * p_row * sizeof(bf16);
  static constexpr std::size_t reduce_bytes = std::size_t(2) * channel_parts * heads * sizeof(float);
  static constexpr std::size_t stage_bytes = std::size_t(2) * sparse_chunk * StageBytes;
  static constexpr std::size_t bytes = kv_bytes + q_bytes + p_bytes + reduce_bytes + stage_bytes;
};

//! The maximum of init and `count` floats `stride` apart from p (maxima other CTAs wrote: L2
//! loads), sixteen loads in flight at a time: a loop that used each value as it arrived cost one
//! L2 round trip per value.
DSV4_DEVICE float max_of(const float* p, int count, float init, long long stride = 1) {
  constexpr int kBatch = 16;
  for (int i0 = 0; i0 < count; i0 += kBatch) {
    float v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) v[k] = i0 + k < count ? __ldcg(p + (i0 + k) * stride) : init;
#pragma unroll
    for (int k = 0; k < kBatch; ++k) init = fmaxf(init, v[k]);
  }
  return init;
}

//! Merges channels [c, c + Width) of one (row, head) from the splits' shares (see the merge kernel
//! below). The shares may come from other CTAs of the same launch, hence the L2 loads; eight
//! splits' loads are in flight at a time and then added in split order: the order, and so the
//! bits, of a loop over the splits one at a time, without its L2 round trip per split.
template <int Dim, int Width = 4>
DSV4_DEVICE void merge_channels(const sparse_attention_args& a, const kv_split& sp, int row, int head,
                                int c) {
  static_assert(Width % 4 == 0, "merge_channels: whole float4 loads");
  constexpr int kBatch = 8, kVec = Width / 4;
  const float* base = sp.partials + (static_cast<long long>(row) * a.heads + head) * sp.splits * (Dim + 4);
  const float mx = max_of(base + Dim, sp.splits, -1e30f, Dim + 4);
  float l = 0.0f, acc[Width] = {};
  for (int s0 = 0; s0 < sp.splits; s0 += kBatch) {
    float ms[kBatch], ls[kBatch];
    float4 v[kBatch][kVec];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (s0 + k >= sp.splits) continue;
      const float* ps = base + (s0 + k) * (Dim + 4);
      ms[k] = __ldcg(ps + Dim), ls[k] = __ldcg(ps + Dim + 1);
#pragma unroll
      for (int u = 0; u < kVec; ++u) v[k][u] = __ldcg(reinterpret_cast<const float4*>(ps + c) + u);
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (s0 + k >= sp.splits) continue;
      const float w = expf(ms[k] - mx);
      l = fmaf(ls[k], w, l);
#pragma unroll
      for (int u = 0; u < kVec; ++u) {
        const float x[4] = {v[k][u].x, v[k][u].y, v[k][u].z, v[k][u].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[4 * u + i] = fmaf(x[i], w, acc[4 * u + i]);
      }
    }
  }
  l += expf(a.sink[head] - mx);
  bf16* o = a.out + (static_cast<long long>(row) * a.heads + head) * Dim + c;
#pragma unroll
  for (int i = 0; i < Width; i += 2)
    *reinterpret_cast<std::uint32_t*>(o + i) = bf16x2_bits(__fdiv_rn(acc[i], l), __fdiv_rn(acc[i + 1], l));
}

//! The first barrier counter of this CTA's (row, head group) in a single launch.
DSV4_DEVICE long long group_barriers(int row) {
  return (static_cast<long long>(row) * gridDim.y + blockIdx.y) * sparse_attention_workspace::counters_per_group;
}

//! The staging slot a launch with operand KV uses: KV's own where two chunks of slots fit the
//! CTA's shared memory beside the rest and the static index lists (~1.5 KB), else 0: the entries
//! are read in place (bf16 operands; Dims beyond V4.1's 512). Not for one head tile either: its
//! 128 threads leave room for a second CTA on the SM (registers and, unstaged, shared memory: 101.6
//! KB against 153.6 KB staged at Dim 512), which hides the loads instead; from two tiles on the
//! registers hold one CTA per SM (ptxas: 244 / 128 registers a thread), so staging costs nothing.
template <int Dim, int HeadTiles, class KV>
inline constexpr int stage_bytes_for =
    HeadTiles >= 2 && mma_smem<Dim, HeadTiles, KV::stage_bytes>::bytes + 2048 <= 227 * 1024 ? KV::stage_bytes : 0;

//! Sparse attention on the tensor cores. One CTA per (query row, 16 x HeadTiles heads, KV split);
//! warp (t, p) owns head tile t, entries [16 p, 16 p + 16) of each chunk for the scores and value
//! channels [p Dim/4, (p + 1) Dim/4). Per 64-entry chunk:
//! - its packed bytes were copied into shared memory (cp.async) while the chunk before was
//!   computed, and its index list and entry locations read one chunk earlier still: the loads of
//!   the cache, the index list and the block tables overlap the tensor-core work (the sixteenth
//!   session's ncu profile put 47% of the stall samples on these loads when they did not);
//! - the CTA dequantizes the chunk's entries once into a bf16 tile (exact);
//! - each warp forms its 16 heads' scores against its 16 entries over all channels (mma
//!   m16n8k16, fp32 accumulation, one chain per score: every score is computed once, so the
//!   maximum pass of a split launch sees the main pass's scores bit for bit);
//! - the online softmax of the reference, per head: chunk maximum (the four entry quarters'
//!   maxima through shared memory), running maximum m, alpha = e^(m_old - m), probabilities
//!   rounded to bf16 into shared memory, where they are the A operand of the value product;
//! - the chunk's value sum is formed first (an MMA chain from zero over the 64 entries, 8
//!   channels at a time) and then added to the rescaled accumulator: acc = acc alpha + sum, as
//!   the reference orders it.
//! The sums inside the tensor core run in the hardware's order (as in the official kernel); the
//! host reference's differ by fp32 rounding only (docs/decisions.md).
//!
//! Wgmma (64 heads at Dim 512, sm_90a): the same CTA, chunks, softmax and splits, but the two
//! products run on warpgroup MMAs that read their shared operands through descriptors instead of
//! each warp loading fragments with ldmatrix (which made the mma.sync kernel shared-memory bound:
//! every warp re-read the chunk's whole tile and its heads' queries). Warpgroup p is entry
//! quarter p for the scores (m64n16k16, queries and entries both from shared memory) and channel
//! quarter p for the values (m64n128k16, probabilities from registers, entries read N-major from
//! the very tile the scores read K-major); warp t of a warpgroup holds head tile t, so every
//! fragment is where the mma.sync kernel has it. The tiles are stored as 8 x 8 core matrices
//! (tile_offset) without padding. One order differs from the reference's: the accumulator is
//! rescaled first and the chunk's products then added to it inside the tensor core (acc alpha +
//! p kv, fp32 rounding only; a separate sum would need 64 more registers than 512 threads have).
template <int Dim, int HeadTiles, class KV, bool Wgmma = false>
DSV4_KERNEL void __launch_bounds__(HeadTiles * channel_parts * 32, 1)
    sparse_attention_kernel(sparse_attention_args a, KV kv, kv_split sp) {
  static_assert(!Wgmma || (HeadTiles == max_head_tiles && Dim == 512),
                "sparse_attention: the wgmma form needs CTAs of 64 heads (M = 64) and Dim 512 (a warpgroup's "
                "channel quarter is one m64n128 product); launch other shapes with Wgmma = false");
  constexpr int kStage = stage_bytes_for<Dim, HeadTiles, KV>;
  using smem_t = mma_smem<Dim, HeadTiles, kStage>;
  constexpr int kThreads = HeadTiles * channel_parts * 32, kWarps = kThreads / 32;
  constexpr int kRow = smem_t::row, kPRow = smem_t::p_row, kHeads = smem_t::heads;
  constexpr int kPartCh = Dim / channel_parts, kPartEntries = sparse_chunk / channel_parts;
  static_assert(kPartCh % 16 == 0, "sparse_attention: Dim / 4 must be a multiple of 16 (MMA k-steps and ldmatrix pairs)");
  static_assert(kPartEntries == 16, "sparse_attention: each warp scores 16 entries of a chunk (two 8-entry MMA tiles)");
  static_assert((smem_t::kv_bytes + smem_t::q_bytes + smem_t::p_bytes + smem_t::reduce_bytes) % 16 == 0,
                "sparse_attention: the staging slots must start 16-byte aligned (cp.async)");
  extern __shared__ uint4 dyn_smem[];
  bf16* kv_tile = reinterpret_cast<bf16*>(dyn_smem);                    // [64][kRow]
  bf16* q_tile = kv_tile + sparse_chunk * kRow;                         // [kHeads][kRow]
  bf16* p_tile = q_tile + kHeads * kRow;                                // [kHeads][kPRow]
  float* part_max = reinterpret_cast<float*>(p_tile + kHeads * kPRow);  // [parts][kHeads]
  float* part_sum = part_max + channel_parts * kHeads;                  // [parts][kHeads]
  std::uint8_t* stage = reinterpret_cast<std::uint8_t*>(part_sum + channel_parts * kHeads);  // [2][64][kStage]
  // Two chunks' index lists and entry locations: the chunk being computed and the next.
  __shared__ std::int32_t chunk_idx[2][sparse_chunk];
  __shared__ typename KV::entry_ref chunk_at[2][sparse_chunk];

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, gid = lane / 4, quad = lane % 4;
  // mma.sync: four consecutive warps share a head tile; wgmma: a warpgroup's four warps are the
  // four head tiles of one quarter (the wgmma's 64 rows).
  const int ht = Wgmma ? warp % channel_parts : warp / channel_parts;
  const int part = Wgmma ? warp / channel_parts : warp % channel_parts;
  const int row = blockIdx.x;  // flattened (sequence, row)
  const int seq = row / a.rows;
  const int head0 = blockIdx.y * kHeads;
  const int tile_head0 = head0 + ht * head_tile;
  // Warp-uniform: a tile past the last head skips the math (not under wgmma, where every warp of
  // a warpgroup issues its MMAs: those heads are zero query rows whose results are never stored).
  const bool tile_live = Wgmma || tile_head0 < a.heads;
  // This thread's two heads: fragment rows gid and gid + 8 of its tile (rows of the CTA's tiles).
  const int my_head[2] = {tile_head0 + gid, tile_head0 + gid + 8};
  const int my_row[2] = {ht * head_tile + gid, ht * head_tile + gid + 8};
  const bool head_ok[2] = {my_head[0] < a.heads, my_head[1] < a.heads};
  const int split = blockIdx.z;
  const int first = sp.max_pass ? split * sparse_chunk : sp.partials ? split * sp.chunks_per_split * sparse_chunk : 0;
  const int last = sp.max_pass ? min(a.topk, first + sparse_chunk)
                   : sp.partials ? min(a.topk, first + sp.chunks_per_split * sparse_chunk)
                                 : a.topk;
  runtime::start_after_previous_grid();
  // Where element (r, c) of a kv or query tile lies (bf16 units): padded rows for mma.sync (see
  // mma_smem); for wgmma 8 x 8 core matrices, 128 contiguous bytes each, row groups of 8 one after
  // the other and, inside one, the channel groups of 8.
  auto tile_offset = [](int r, int c) {
    if constexpr (Wgmma)
      return ((r / 8) * (Dim / 8) + c / 8) * 64 + (r % 8) * 8 + c % 8;
    else
      return r * kRow + c;
  };
  // Byte distances between core matrices of these tiles (wgmma descriptors' offsets), and a
  // descriptor's address step (its start address counts 16-byte units).
  constexpr std::uint32_t kNextChannels = wgmma::core_matrix_bytes;          // channel group -> the next
  constexpr std::uint32_t kNextRows = (Dim / 8) * wgmma::core_matrix_bytes;  // row group -> the next
  constexpr auto desc_step = [](std::uint32_t bytes) { return std::uint64_t(bytes / 16); };

  const std::int32_t* row_idx = a.idx + static_cast<long long>(row) * a.topk;

  // Threads < 64: entry t of the chunk at c0 (-1 past the list), and where it lies. Each entry is
  // located once (its ring slot or page: a dependent load), by one thread, rather than by every
  // thread that reads a part of it.
  auto read_index = [&](int c0) {
    return threadIdx.x < sparse_chunk && c0 + int(threadIdx.x) < last ? row_idx[c0 + threadIdx.x] : -1;
  };
  auto locate = [&](int j) { return j >= 0 ? kv.locate(seq, j) : typename KV::entry_ref{}; };
  // The first two chunks' indices, read before the queries are copied: the index list is the
  // start of the longest chain of dependent loads (index, location, entry bytes).
  const int first_index[2] = {read_index(first), read_index(first + sparse_chunk)};

  // The CTA's queries (heads past the last are zero rows: their scores are 0 and never stored),
  // with every thread's loads issued before its stores: one memory round trip, not one per load
  // (at one decode row this copy was a chain of 16 dependent-looking trips at the kernel's start).
  auto copy_queries = [&](auto word) {
    using W = decltype(word);
    constexpr int kPer = int(sizeof(W) / sizeof(bf16)), kSteps = kHeads * (Dim / kPer) / kThreads;
    static_assert(kHeads * (Dim / kPer) % kThreads == 0, "sparse_attention: the query copy must divide over the CTA");
    W v[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int t = threadIdx.x + u * kThreads, h = t / (Dim / kPer), c = (t % (Dim / kPer)) * kPer;
      v[u] = head0 + h < a.heads ? *reinterpret_cast<const W*>(a.q + (static_cast<long long>(row) * a.heads + head0 + h) * Dim + c)
                                 : W{};
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int t = threadIdx.x + u * kThreads, h = t / (Dim / kPer), c = (t % (Dim / kPer)) * kPer;
      *reinterpret_cast<W*>(q_tile + tile_offset(h, c)) = v[u];
    }
  };
  if (reinterpret_cast<std::uintptr_t>(a.q) % 16 == 0)
    copy_queries(uint4{});
  else
    copy_queries(uint2{});  // q need only be 8-byte aligned (can_implement)
  // (The first chunk's dequantization fences the query stores for the wgmma reads with its own.)

  float m[2] = {-1e30f, -1e30f}, l[2] = {0.0f, 0.0f};
  if (sp.partials && !sp.max_pass && !sp.barriers)  // the running maximum the unsplit recurrence has here
#pragma unroll
    for (int i = 0; i < 2; ++i)
      if (head_ok[i])
        m[i] = max_of(sp.chunk_max + (static_cast<long long>(row) * a.heads + my_head[i]) * sp.chunks,
                      split * sp.chunks_per_split, m[i]);
  float acc[kPartCh / 8][4];
#pragma unroll
  for (int n = 0; n < kPartCh / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  const int ch0 = part * kPartCh, e0 = part * kPartEntries;

  // Starts copying buffer b's entries into its staging slots. On sm_90: thread e < 64 copies entry
  // e with one bulk copy onto the buffer's transaction barrier (the loop's top waits for its
  // phase), or, where the entry is not 16-byte aligned, with plain loads and stores before its
  // arrival (which releases them); an empty slot arrives with no bytes. (Before: every warp
  // issued 16-byte cp.async for four entries in turn, an eighth of the stall samples at batch 64.)
  // Elsewhere: a warp per entry at a time, 16-byte cp.async where the entry allows it, else
  // 4-byte ones (check() guarantees 4-byte aligned entries), else (a size that is not a multiple
  // of 4: narrow Dims) plain loads and stores, which the next barrier makes visible.
#if DSV4_BULK_COPY_PASS
  constexpr bool kBulk = kStage > 0;
#else
  constexpr bool kBulk = false;
#endif
  __shared__ std::uint64_t stage_landed[2];  // the staging buffers' transaction barriers (kBulk)
  if constexpr (kBulk) {
    if (threadIdx.x == 0) {
      for (auto& bar : stage_landed) bulk_copy::init(&bar, sparse_chunk);
      bulk_copy::init_fence();  // before the barrier that precedes the first copy
    }
  }
  auto stage_chunk = [&](int b) {
    if constexpr (kBulk) {
      if (threadIdx.x < sparse_chunk) {
        const int e = threadIdx.x, j = chunk_idx[b][e], bytes = j >= 0 ? kv.entry_bytes(j) : 0;
        const std::uint8_t* src = chunk_at[b][e];
        std::uint8_t* dst = stage + (b * sparse_chunk + e) * kStage;
        if (bytes > 0 && bytes % 16 == 0 && reinterpret_cast<std::uintptr_t>(src) % 16 == 0) {
          bulk_copy::fence_before_refill();  // the previous chunk's reads of this slot come first
          bulk_copy::expect_bytes(&stage_landed[b], unsigned(bytes));
          bulk_copy::copy(dst, src, unsigned(bytes), &stage_landed[b],
                          bulk_copy::l2_policy(bulk_copy::l2_eviction::normal));
        } else {
          if (bytes % 4 == 0)
            for (int o = 0; o < bytes; o += 4)
              *reinterpret_cast<std::uint32_t*>(dst + o) = *reinterpret_cast<const std::uint32_t*>(src + o);
          else
            for (int o = 0; o < bytes; ++o) dst[o] = src[o];
          bulk_copy::expect_bytes(&stage_landed[b], 0);
        }
      }
    } else if constexpr (kStage > 0) {
      for (int e = warp; e < sparse_chunk; e += kWarps) {
        const int j = chunk_idx[b][e];
        if (j < 0) continue;
        const std::uint8_t* src = chunk_at[b][e];
        std::uint8_t* dst = stage + (b * sparse_chunk + e) * kStage;
        const int bytes = kv.entry_bytes(j);
        if (bytes % 16 == 0 && reinterpret_cast<std::uintptr_t>(src) % 16 == 0)
          for (int o = 16 * lane; o < bytes; o += 16 * 32) __pipeline_memcpy_async(dst + o, src + o, 16);
        else if (bytes % 4 == 0)
          for (int o = 4 * lane; o < bytes; o += 4 * 32) __pipeline_memcpy_async(dst + o, src + o, 4);
        else
          for (int o = lane; o < bytes; o += 32) dst[o] = src[o];
      }
      __pipeline_commit();
    }
  };
  // Waits until buffer b's copies of its use-th staging (0, 1, 2, ...) have landed (this thread's
  // for cp.async: the barrier after it covers the others').
  auto wait_staged = [&](int b, int use) {
    if constexpr (kBulk)
      bulk_copy::wait(&stage_landed[b], unsigned(use & 1));
    else if constexpr (kStage > 0)
      __pipeline_wait_prior(0);
  };
  // Buffer b's entries as bf16 into the tile; empty slots are zeros: they must not feed NaN
  // garbage to 0 * x. Item t of a chunk is 8 channels of one entry: mma.sync a warp per entry
  // row; wgmma eight entries at a time (one core matrix column), so that each quarter warp's eight
  // 16-byte stores fall in different banks. Thread i converts items i, i + kThreads, ...
  constexpr int kItems = sparse_chunk * (Dim / 8), kItemsPerThread = kItems / kThreads;
  static_assert(kItems % kThreads == 0,
                "sparse_attention: a chunk's 8-channel items must divide over the CTA");
  auto item_entry = [](unsigned t) { return int(Wgmma ? (t / (8 * (Dim / 8))) * 8 + t % 8 : t / (Dim / 8)); };
  auto item_channel = [](unsigned t) { return int(Wgmma ? ((t / 8) % (Dim / 8)) * 8 : (t % (Dim / 8)) * 8); };
  auto dequantize_chunk = [&](int b) {
    if constexpr (kStage > 0) {
      // Staged: a batch of items' indices, then their packed bits, then their values, so that the
      // shared loads of a batch are in flight together (converting item by item, each behind its
      // own branches, made this loop half of the kernel's stall samples at batch 64).
      constexpr int kBatch = 4;
#pragma unroll
      for (int u0 = 0; u0 < kItemsPerThread; u0 += kBatch) {
        int j[kBatch];
        typename KV::staged8 bits[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k)
          if (u0 + k < kItemsPerThread) j[k] = chunk_idx[b][item_entry(threadIdx.x + (u0 + k) * kThreads)];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const unsigned t = threadIdx.x + (u0 + k) * kThreads;
          if (u0 + k < kItemsPerThread)
            bits[k] =
                kv.load_staged8(stage + (b * sparse_chunk + item_entry(t)) * kStage, j[k], item_channel(t));
        }
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const unsigned t = threadIdx.x + (u0 + k) * kThreads;
          if (u0 + k < kItemsPerThread)
            *reinterpret_cast<uint4*>(kv_tile + tile_offset(item_entry(t), item_channel(t))) =
                j[k] >= 0 ? kv.decode_staged8(bits[k]) : make_uint4(0, 0, 0, 0);
        }
      }
    } else {
      constexpr int kInFlight = Dim > 512 ? 2 : 4;  // beyond V4.1's 512 channels the registers run short
#pragma unroll kInFlight
      for (int u = 0; u < kItemsPerThread; ++u) {
        const unsigned t = threadIdx.x + u * kThreads;
        const int e = item_entry(t), c = item_channel(t), j = chunk_idx[b][e];
        *reinterpret_cast<uint4*>(kv_tile + tile_offset(e, c)) =
            j >= 0 ? kv.load8(chunk_at[b][e], j, c) : make_uint4(0, 0, 0, 0);
      }
    }
    if constexpr (Wgmma)
      wgmma::fence_shared_for_async();  // these stores, before the barrier, to the MMAs' reads
  };

  // The pipeline's start: the first two chunks located (both lookups in flight at once), the
  // first one's copy started.
  if (threadIdx.x < sparse_chunk) {
    const typename KV::entry_ref at[2] = {locate(first_index[0]), locate(first_index[1])};
#pragma unroll
    for (int i = 0; i < 2; ++i) chunk_idx[i][threadIdx.x] = first_index[i], chunk_at[i][threadIdx.x] = at[i];
  }
  __syncthreads();
  stage_chunk(0);

  int b = 0;  // the buffer of the chunk at c0
  for (int c0 = first; c0 < last; c0 += sparse_chunk, b ^= 1) {
    wait_staged(b, (c0 - first) / (2 * sparse_chunk));
    // This chunk's bytes have landed (every thread's copies), the next chunk is located, and the
    // previous chunk's tile and probabilities are no longer read.
    __syncthreads();
    stage_chunk(b ^ 1);                                       // the next chunk travels meanwhile
    const int after_next = read_index(c0 + 2 * sparse_chunk);  // in flight until it is located below
    dequantize_chunk(b);
    __syncthreads();

    // Scores of this warp's 16 heads x 16 entries over all channels, in two chains (even and odd
    // k-steps) per 8-entry tile, added at the end: half the MMA latency chain of one. Each step's
    // fragments are loaded one step ahead (the ldmatrix latency behind the MMAs before).
    float s[2][4] = {};
    if constexpr (Wgmma) {
      // The warpgroup's 64 heads x 16 entries: one chain of 32 m64n16k16 steps over the channels.
      // K-major operands: leading offset along the channels (K), stride along the rows.
      float d[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) d[i] = 0.0f, wgmma::fence_operand(d[i]);
      const std::uint64_t qd = wgmma::smem_descriptor(q_tile, kNextChannels, kNextRows);
      const std::uint64_t kd = wgmma::smem_descriptor(kv_tile + tile_offset(e0, 0), kNextChannels, kNextRows);
      wgmma::fence();
#pragma unroll
      for (int step = 0; step < Dim / 16; ++step) {  // 16 channels (two core matrices) per step
        const std::uint64_t advance = desc_step(2 * kNextChannels) * step;
        wgmma::mma_bf16_ss16(d, qd + advance, kd + advance, step > 0);
      }
      wgmma::commit_group();
      wgmma::wait_group<0>();
#pragma unroll
      for (int i = 0; i < 8; ++i) wgmma::fence_operand(d[i]), s[i / 4][i % 4] = d[i];
    } else if (tile_live) {
      float s_odd[2][4] = {};
      std::uint32_t qa[2][4], kb[2][4];  // rows lane % 16, channels k + 8 (lane / 16) ..; entries e0 ..
      auto load_step = [&](int k, int slot) {
        ldmatrix_x4<false>(qa[slot], q_tile + (ht * head_tile + lane % 16) * kRow + k + (lane / 16) * 8);
        ldmatrix_x4<false>(kb[slot], kv_tile + (e0 + (lane / 16) * 8 + lane % 8) * kRow + k + ((lane / 8) % 2) * 8);
      };
      load_step(0, 0);
#pragma unroll
      for (int step = 0; step < Dim / 16; ++step) {
        const int slot = step % 2;
        if (step + 1 < Dim / 16) load_step(16 * (step + 1), 1 - slot);
        mma_bf16(slot ? s_odd[0] : s[0], qa[slot], kb[slot][0], kb[slot][1]);
        mma_bf16(slot ? s_odd[1] : s[1], qa[slot], kb[slot][2], kb[slot][3]);
      }
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[t][i] += s_odd[t][i];
    }
    // Scaled scores (empty slots -inf) and this quarter's maxima; then the chunk's maxima.
    float cmax[2] = {-INFINITY, -INFINITY};
    if (tile_live) {
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // fragment element i: head row gid + 8 (i / 2), entry e0 + 8 t + 2 quad + i % 2
          s[t][i] = chunk_idx[b][e0 + 8 * t + 2 * quad + i % 2] >= 0 ? s[t][i] * a.scale : -INFINITY;
          cmax[i / 2] = fmaxf(cmax[i / 2], s[t][i]);
        }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        cmax[i] = fmaxf(cmax[i], __shfl_xor_sync(0xffffffffu, cmax[i], 1));
        cmax[i] = fmaxf(cmax[i], __shfl_xor_sync(0xffffffffu, cmax[i], 2));
        if (quad == 0) part_max[part * kHeads + my_row[i]] = cmax[i];
      }
    }
    __syncthreads();
    if (tile_live)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        cmax[i] = part_max[my_row[i]];
#pragma unroll
        for (int p = 1; p < channel_parts; ++p) cmax[i] = fmaxf(cmax[i], part_max[p * kHeads + my_row[i]]);
      }
    if (sp.max_pass || sp.barriers) {  // this chunk's maximum for the splits after it
      if (tile_live && part == 0 && quad == 0)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          if (head_ok[i]) sp.chunk_max[(static_cast<long long>(row) * a.heads + my_head[i]) * sp.chunks + split] = cmax[i];
      if (sp.max_pass) continue;  // one chunk per CTA in the maximum pass: the loop ends here
      // Single launch (one chunk per split): wait for every split's maximum, then start from the
      // maximum of the chunks before this one, as the split pass of the three-launch form does.
      // Every thread of the CTA arrives here, dead tiles too.
      runtime::group_arrive_and_wait(sp.barriers + group_barriers(row), unsigned(sp.splits));
      if (tile_live)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          if (head_ok[i])
            m[i] = max_of(sp.chunk_max + (static_cast<long long>(row) * a.heads + my_head[i]) * sp.chunks,
                          split, m[i]);
    }
    // Probabilities: fp32 for the denominator (each quarter's sum through shared memory), bf16 into
    // the tile that is the value product's A operand.
    float alpha[2] = {1.0f, 1.0f};
    if (tile_live) {
      float psum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float m_new = fmaxf(m[i], cmax[i]);
        alpha[i] = expf(m[i] - m_new);
        m[i] = m_new;
      }
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        float p[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          p[i] = expf(s[t][i] - m[i / 2]);  // exp(-inf) = 0 for empty slots
          psum[i / 2] += p[i];
        }
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<std::uint32_t*>(p_tile + my_row[h] * kPRow + e0 + 8 * t + 2 * quad) = bf16x2_bits(p[2 * h], p[2 * h + 1]);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        psum[i] += __shfl_xor_sync(0xffffffffu, psum[i], 1);
        psum[i] += __shfl_xor_sync(0xffffffffu, psum[i], 2);
        if (quad == 0) part_sum[part * kHeads + my_row[i]] = psum[i];
      }
    }
    __syncthreads();
    // The chunk after next: located now (the index arrived during the scores; a page lookup is one
    // more load), stored after the value product, before the next iteration's barrier.
    const typename KV::entry_ref after_next_at = threadIdx.x < sparse_chunk ? locate(after_next) : typename KV::entry_ref{};
    if (tile_live) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float psum = part_sum[my_row[i]];
#pragma unroll
        for (int p = 1; p < channel_parts; ++p) psum += part_sum[p * kHeads + my_row[i]];
        l[i] = l[i] * alpha[i] + psum;
      }
      std::uint32_t pa[sparse_chunk / 16][4];  // heads x entries 16 k .. 16 k + 15
#pragma unroll
      for (int k = 0; k < sparse_chunk / 16; ++k)
        ldmatrix_x4<false>(pa[k], p_tile + (ht * head_tile + lane % 16) * kPRow + 16 * k + (lane / 16) * 8);
      if constexpr (Wgmma) {
        // acc <- acc alpha, then + the chunk's bf16(p_j) kv_j over its 64 entries, 16 a step, this
        // warpgroup's 128 channels: B N-major (leading offset along the entries, K; stride along
        // the channels, N). acc[n][i] is the wgmma's d[4 n + i].
        float(&d)[kPartCh / 2] = reinterpret_cast<float(&)[kPartCh / 2]>(acc);
#pragma unroll
        for (int n = 0; n < kPartCh / 8; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[n][i] = __fmul_rn(acc[n][i], alpha[i / 2]);
#pragma unroll
        for (int i = 0; i < kPartCh / 2; ++i) wgmma::fence_operand(d[i]);
#pragma unroll
        for (int k = 0; k < sparse_chunk / 16; ++k)
#pragma unroll
          for (int r = 0; r < 4; ++r) wgmma::fence_operand(pa[k][r]);
        const std::uint64_t vd =
            wgmma::smem_descriptor(kv_tile + tile_offset(0, ch0), kNextRows, kNextChannels);
        wgmma::fence();
#pragma unroll
        for (int k = 0; k < sparse_chunk / 16; ++k)  // + two rows of core matrices per step
          wgmma::mma_bf16_nmajor128(d, pa[k], vd + desc_step(2 * kNextRows) * k, true);
        wgmma::commit_group();
        wgmma::wait_group<0>();
#pragma unroll
        for (int i = 0; i < kPartCh / 2; ++i) wgmma::fence_operand(d[i]);
      } else {
        // acc <- acc alpha + (the chunk's sum of bf16(p_j) kv_j), 16 channels at a time.
#pragma unroll
        for (int nb = 0; nb < kPartCh / 16; ++nb) {
          float sum[2][4] = {};
#pragma unroll
          for (int k = 0; k < sparse_chunk / 16; ++k) {
            std::uint32_t vb[4];  // entries 16k .. 16k + 15, channels ch0 + 16 nb .. + 15, transposed
            ldmatrix_x4<true>(vb, kv_tile + (16 * k + ((lane / 8) % 2) * 8 + lane % 8) * kRow + ch0 + 16 * nb + (lane / 16) * 8);
            mma_bf16(sum[0], pa[k], vb[0], vb[1]);
            mma_bf16(sum[1], pa[k], vb[2], vb[3]);
          }
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[2 * nb + h][i] = __fadd_rn(__fmul_rn(acc[2 * nb + h][i], alpha[i / 2]), sum[h][i]);
        }
      }
    }
    if (threadIdx.x < sparse_chunk) chunk_idx[b][threadIdx.x] = after_next, chunk_at[b][threadIdx.x] = after_next_at;
  }
  // Nothing is in flight here (the last chunk's successor lies past `last`: no copies; the maximum
  // pass has one chunk), but a copy must never outlive the CTA's shared memory.
  if constexpr (kStage > 0 && !kBulk) __pipeline_wait_prior(0);
  if (sp.max_pass) return;
  // Fragment element i of channel tile n: head my_head[i / 2], channel ch0 + 8 n + 2 quad + i % 2.
  if (sp.partials && tile_live) {  // the split's share; the merge adds the sink
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!head_ok[i]) continue;
      float* part_out = sp.partials + ((static_cast<long long>(row) * a.heads + my_head[i]) * sp.splits + split) * (Dim + 4);
#pragma unroll
      for (int n = 0; n < kPartCh / 8; ++n)
        *reinterpret_cast<float2*>(part_out + ch0 + 8 * n + 2 * quad) = make_float2(acc[n][2 * i], acc[n][2 * i + 1]);
      if (part == 0 && quad == 0) part_out[Dim] = m[i], part_out[Dim + 1] = l[i];
    }
  }
  if (sp.barriers) {  // single launch: once every split's share is written, the splits merge the group's heads
    unsigned* barriers = sp.barriers + group_barriers(row);
    runtime::group_arrive_and_wait(barriers + 1, unsigned(sp.splits));
    const int items = min(kHeads, a.heads - head0) * (Dim / 8);  // eight channels each: one pass at 8+ splits
    for (int item = split * kThreads + int(threadIdx.x); item < items; item += sp.splits * kThreads)
      merge_channels<Dim, 8>(a, sp, row, head0 + item / (Dim / 8), 8 * (item % (Dim / 8)));
    if (threadIdx.x == 0) runtime::leave_group(barriers, sparse_attention_workspace::counters_per_group, unsigned(sp.splits));
    return;
  }
  if (sp.partials || !tile_live) return;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!head_ok[i]) continue;
    const float li = l[i] + expf(a.sink[my_head[i]] - m[i]);
    bf16* o = a.out + (static_cast<long long>(row) * a.heads + my_head[i]) * Dim + ch0 + 2 * quad;
#pragma unroll
    for (int n = 0; n < kPartCh / 8; ++n)
      *reinterpret_cast<std::uint32_t*>(o + 8 * n) = bf16x2_bits(__fdiv_rn(acc[n][2 * i], li), __fdiv_rn(acc[n][2 * i + 1], li));
  }
}

//! Merges the splits of one (row, head): M = max m_s, out = sum_s acc_s e^(m_s - M) /
//! (sum_s l_s e^(m_s - M) + e^(sink - M)), splits in order. A split without a valid index has
//! l = 0 and acc = 0 (its m is the maximum of the chunks before it, -1e30 if none), so it weighs
//! nothing unless every split is empty (then out = 0, as unsplit).
template <int Dim>
DSV4_KERNEL void __launch_bounds__(Dim / 4) sparse_attention_merge_kernel(sparse_attention_args a, kv_split sp) {
  runtime::start_after_previous_grid();
  merge_channels<Dim>(a, sp, blockIdx.x, blockIdx.y, 4 * threadIdx.x);
}

//! The split for a launch: none when the list has one chunk, no workspace is given, or fewer than
//! three splits would fit the (row, head group) grid into one CTA per SM (two where the list has
//! only two chunks); else as many splits as fit (every split beyond the first also adds its
//! chunks to the maximum pass, so more splits are not free), whole chunks each, as far as the
//! workspace holds the partials. Why not two splits of a longer list: at 64 decode rows of 640
//! indices two splits of five chunks took 134 us on the H200 and the unsplit launch 122 us
//! (bench_attention, thirteenth session): the maximum pass and the merge cost more than half the
//! grid's idle SMs give back.
template <int Dim>
kv_split choose_split(const sparse_attention_args& a, sparse_attention_workspace* ws, int sms) {
  kv_split sp;
  const int chunks = (a.topk + sparse_chunk - 1) / sparse_chunk;
  const long long rows = static_cast<long long>(a.batch) * a.rows;
  const long long ctas = rows * launch_head_groups(a);
  if (!ws || chunks < 2 || ctas == 0 || sms / ctas < std::min(3, chunks)) return sp;
  long long splits = std::min<long long>(chunks, sms / ctas);
  const long long per_split_floats = rows * a.heads * (Dim + 4), max_floats = rows * a.heads * chunks;
  splits = std::min<long long>(splits, (static_cast<long long>(ws->floats()) - max_floats) / std::max(per_split_floats, 1LL));
  if (splits < 2) return sp;
  sp.chunks_per_split = int((chunks + splits - 1) / splits);
  sp.splits = (chunks + sp.chunks_per_split - 1) / sp.chunks_per_split;  // no empty split
  if (sp.splits < 2) return kv_split{};
  sp.chunks = chunks;
  sp.partials = ws->data();
  sp.chunk_max = ws->data() + sp.splits * per_split_floats;
  return sp;
}
//! Whether a split launch runs as one cooperative launch (kv_split::barriers): one chunk per
//! split and counters for its (row, head group) pairs in the workspace.
inline bool single_launch(const kv_split& sp, long long row_groups, const sparse_attention_workspace* ws) {
  return sp.partials && sp.chunks_per_split == 1 && sp.splits == sp.chunks && ws && ws->single_launch() &&
         row_groups <= ws->counter_groups();
}
}  // namespace detail

//! Empty when the launch can proceed, else why not.
template <int Dim, class KV>
std::string can_implement(const sparse_attention_args& a, const KV& kv) {
  static_assert(Dim % 64 == 0,
                "sparse_attention<Dim>: Dim must be a multiple of 64 (four warps share the channels, 16 at a time)");
  static_assert(detail::mma_smem<Dim, detail::max_head_tiles, 0>::bytes <= 227 * 1024,
                "sparse_attention<Dim>: a CTA of 64 heads would need more shared memory than an sm_90 block can have "
                "(227 KB): Dim is too large for this kernel (at most 576, reading the entries in place)");
  if (a.batch < 0 || a.rows < 0 || a.heads <= 0 || a.topk < 0) return "batch, rows, topk must be >= 0 and heads > 0";
  if (static_cast<long long>(a.batch) * a.rows > 0x7fffffffll) return "batch * rows exceeds the grid limit";
  if (a.heads > 65535) return "heads exceed the grid limit (65535)";
  if (a.head_tiles != 0 && a.head_tiles != 1 && a.head_tiles != 2 && a.head_tiles != detail::max_head_tiles)
    return "head_tiles is " + std::to_string(a.head_tiles) +
           ": it must be 0 (the launcher's choice), 1, 2 or 4";
  if (a.rows == 0 || a.batch == 0) return {};
  if (!a.q || !a.out || !a.sink || (a.topk > 0 && !a.idx)) return "null pointer argument";
  if (reinterpret_cast<std::uintptr_t>(a.q) % 8 || reinterpret_cast<std::uintptr_t>(a.out) % 4)
    return "q must be 8-byte and out 4-byte aligned";
  return kv.check();
}

//! Process-wide: whether calls of up to detail::half_tiles_max_rows rows run 64 heads as two CTAs
//! of 32 (the default; off: one CTA of 64, as before, for bench_model --ab-decode-defaults). Read
//! when a launch is made (or a graph captured).
inline void set_decode_head_halves(bool on) { process_switch<detail::half_tiles_tag>::set(on); }
inline bool decode_head_halves() { return process_switch<detail::half_tiles_tag>::on(); }

//! out = sparse_attention(q, kv, sink, idx). Indices must lie in [-1, entries) (not checked on
//! the device: the index producers guarantee it, and the host reference checks it). With a
//! workspace, grids of few rows split the index list (see the file comment).
template <int Dim, class KV>
void sparse_attention(const sparse_attention_args& a, const KV& kv, cudaStream_t stream = nullptr,
                      sparse_attention_workspace* workspace = nullptr) {
  if (const std::string why = can_implement<Dim>(a, kv); !why.empty()) throw error("sparse_attention: " + why);
  if (a.rows == 0 || a.batch == 0) return;
  const int tiles = detail::launch_head_tiles(a);
  auto run = [&](auto kernel, auto smem_layout) {
    using smem_t = decltype(smem_layout);
    constexpr int smem = int(smem_t::bytes);
    static const int static_smem = [&] {  // the kernel's static shared memory (index list, entry refs), asked once
      cudaFuncAttributes attr{};
      DSV4_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
      return int(attr.sharedSizeBytes);
    }();
    if (smem + static_smem > runtime::max_shared_per_block_optin())
      throw error("sparse_attention: Dim " + std::to_string(Dim) + " with " + std::to_string(smem_t::heads) +
                  " heads per CTA needs " + std::to_string(smem + static_smem) +
                  " bytes of shared memory per block; this device allows " +
                  std::to_string(runtime::max_shared_per_block_optin()) + " (the kernel is sized for Hopper's 227 KB)");
    DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const detail::kv_split sp = detail::choose_split<Dim>(a, workspace, runtime::sm_count());
    const unsigned rows = unsigned(a.batch * a.rows), groups = unsigned((a.heads + smem_t::heads - 1) / smem_t::heads);
    const dim3 block(smem_t::heads / detail::head_tile * detail::channel_parts * 32);
    // One chunk per split (decode up to ~13 rows at 640 indices): one cooperative launch whose
    // splits meet at barriers, instead of the maximum pass, the split pass and the merge. Every
    // split must reach both barriers, so each must hold a chunk: choose_split makes no empty split.
    if (detail::single_launch(sp, static_cast<long long>(rows) * groups, workspace)) {
      detail::kv_split one = sp;
      one.barriers = workspace->counters();
      if (runtime::launch_cooperative(kernel, dim3(rows, groups, unsigned(sp.splits)), block, smem, stream, a, kv, one) ==
          cudaSuccess)
        return;
      // Refused (the grid cannot be resident at once here, e.g. a partitioned GPU): three launches.
    }
    if (sp.partials) {  // the chunk maxima the splits start from (the last split's chunks are not needed)
      detail::kv_split max_pass = sp;
      max_pass.max_pass = true;
      runtime::launch_programmatic(kernel, dim3(rows, groups, unsigned((sp.splits - 1) * sp.chunks_per_split)), block, smem,
                                   stream, a, kv, max_pass);
      DSV4_CUDA_CHECK_LAUNCH();
    }
    runtime::launch_programmatic(kernel, dim3(rows, groups, unsigned(sp.splits)), block, smem, stream, a, kv, sp);
    DSV4_CUDA_CHECK_LAUNCH();
    if (!sp.partials) return;
    runtime::launch_programmatic(detail::sparse_attention_merge_kernel<Dim>, dim3(rows, unsigned(a.heads)), dim3(Dim / 4), 0,
                                 stream, a, sp);
    DSV4_CUDA_CHECK_LAUNCH();
  };
  using detail::mma_smem, detail::stage_bytes_for, detail::max_head_tiles;
  if constexpr (Dim == 512) {
    if (tiles == max_head_tiles && a.allow_wgmma && wgmma::supported())
      return run(detail::sparse_attention_kernel<Dim, max_head_tiles, KV, true>,
                 mma_smem<Dim, max_head_tiles, stage_bytes_for<Dim, max_head_tiles, KV>>{});
  }
  if (tiles == 1) return run(detail::sparse_attention_kernel<Dim, 1, KV>, mma_smem<Dim, 1, stage_bytes_for<Dim, 1, KV>>{});
  if (tiles == 2) return run(detail::sparse_attention_kernel<Dim, 2, KV>, mma_smem<Dim, 2, stage_bytes_for<Dim, 2, KV>>{});
  run(detail::sparse_attention_kernel<Dim, max_head_tiles, KV>,
      mma_smem<Dim, max_head_tiles, stage_bytes_for<Dim, max_head_tiles, KV>>{});
}

}  // namespace dsv4::kernels::attention
