#pragma once
//! \file
//! CUDA sparse attention with a sink: the recurrence of reference.hpp (chunks of 64 indices in
//! list order, online softmax, probabilities rounded to bf16 before they weight the values, sink
//! in the denominator), reading its KV operand either as bf16 rows or straight from the packed
//! caches (FP8 window entries and FP4 global entries, dequantized in the kernel).
//!
//! Work split (CUDA cores; see docs/perf.md for where it stands): one CTA per (query row, group of
//! 8 heads, KV split), one warp per head. Each chunk of 64 indexed entries is dequantized once into
//! shared memory and shared by the CTA's heads. A lane owns channels g * 128 + 4 * lane + (0..3)
//! for g < Dim / 128, so a warp's shared-memory reads of one entry are contiguous (no bank
//! conflicts).
//!
//! Split KV (decode): with few rows the (row, head group) grid leaves most SMs idle (8 CTAs for
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

#include <cuda_runtime.h>  // provides cudaFuncSetAttribute

#include <algorithm>
#include <cstdint>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/attention/reference.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/fast_codec.cuh"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "dsv4/runtime/device_info.cuh"
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

  DSV4_DEVICE void load8(int seq, int e, int c0, bf16 (&out)[8]) const {
    const uint4 w = __ldg(reinterpret_cast<const uint4*>(kv + seq * seq_stride + e * row_stride + c0));
    const std::uint32_t words[4] = {w.x, w.y, w.z, w.w};
    for (int i = 0; i < 8; ++i) out[i] = bf16::from_bits(std::uint16_t(words[i / 2] >> (16 * (i % 2))));
  }
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

  DSV4_DEVICE void load8(int seq, int e, int c0, bf16 (&out)[8]) const {
    const long long ring = slots ? slots[seq] : seq;
    numerics::dequantize8<WindowFormat, Dim>(base + ring * seq_stride + e * stride, c0, out);
  }
  std::string check() const {
    if (rows > 0 && (!base || reinterpret_cast<std::uintptr_t>(base) % 4 || stride % 4 || seq_stride % 4))
      return "window cache must be 4-byte aligned with strides that are multiples of 4 bytes";
    return {};
  }
};

//! The packed caches of each sequence, as the reference concatenates them (spec §5 combine):
//! index j < window.rows reads window row j, and j >= window.rows reads global entry
//! j - window.rows (GlobalFormat, FP4 288 B at Dim 512), contiguous per sequence.
template <class WindowFormat, class GlobalFormat, int Dim>
struct packed_kv {
  using global_layout = numerics::packed_vector<GlobalFormat, Dim>;
  window_ring<WindowFormat, Dim> window;
  const std::uint8_t* global = nullptr;
  long long global_stride = global_layout::bytes;
  long long global_seq_stride = 0;  //!< bytes from one sequence's global entries to the next
  int global_rows = 0;

  int entries() const { return window.rows + global_rows; }
  DSV4_DEVICE void load8(int seq, int e, int c0, bf16 (&out)[8]) const {
    if (e < window.rows)
      window.load8(seq, e, c0, out);
    else
      numerics::dequantize8<GlobalFormat, Dim>(global + seq * global_seq_stride + (e - window.rows) * global_stride,
                                               c0, out);
  }
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
struct paged_kv {
  using global_layout = numerics::packed_vector<GlobalFormat, Dim>;
  window_ring<WindowFormat, Dim> window;
  const std::uint8_t* pool = nullptr;           //!< page pool base
  const std::int32_t* block_tables = nullptr;   //!< [batch, max_pages]
  int max_pages = 0;                            //!< row length of block_tables
  long long page_bytes = 0;
  long long region_offset = 0;                  //!< the owner's main-KV region in a page
  int entries_per_page = 0;

  DSV4_DEVICE void load8(int seq, int e, int c0, bf16 (&out)[8]) const {
    if (e < window.rows) {
      window.load8(seq, e, c0, out);
      return;
    }
    const int g = e - window.rows;
    const long long page = block_tables[static_cast<long long>(seq) * max_pages + g / entries_per_page];
    numerics::dequantize8<GlobalFormat, Dim>(
        pool + page * page_bytes + region_offset + static_cast<long long>(g % entries_per_page) * global_layout::bytes, c0, out);
  }
  std::string check() const {
    if (!pool || !block_tables || entries_per_page <= 0 || reinterpret_cast<std::uintptr_t>(pool) % 4 ||
        page_bytes % 4 || region_offset % 4)
      return "paged cache needs a 4-byte aligned pool, block tables, and positive entries per page";
    return window.check();
  }
};

//! A chunk appended after the prefill (exact mode): index j < window.rows reads the sequence's
//! ring (positions before the chunk), j < window.rows + chunk_rows reads the chunk's own window
//! entries (one sequence per call), and the rest reads global entries through the block table,
//! when there is a global cache (pool not null).
template <class WindowFormat, class GlobalFormat, int Dim>
struct appended_kv {
  using window_layout = numerics::packed_vector<WindowFormat, Dim>;
  using global_layout = numerics::packed_vector<GlobalFormat, Dim>;
  window_ring<WindowFormat, Dim> window;
  const std::uint8_t* chunk = nullptr;          //!< [chunk_rows] window entries of the chunk
  long long chunk_stride = window_layout::bytes;
  int chunk_rows = 0;
  const std::uint8_t* pool = nullptr;           //!< page pool base, or null (a local layer)
  const std::int32_t* block_tables = nullptr;   //!< [batch, max_pages]
  int max_pages = 0;
  long long page_bytes = 0;
  long long region_offset = 0;
  int entries_per_page = 0;

  DSV4_DEVICE void load8(int seq, int e, int c0, bf16 (&out)[8]) const {
    if (e < window.rows) {
      window.load8(seq, e, c0, out);
      return;
    }
    if (e < window.rows + chunk_rows) {
      numerics::dequantize8<WindowFormat, Dim>(chunk + static_cast<long long>(e - window.rows) * chunk_stride, c0, out);
      return;
    }
    const int g = e - window.rows - chunk_rows;
    const long long page = block_tables[static_cast<long long>(seq) * max_pages + g / entries_per_page];
    numerics::dequantize8<GlobalFormat, Dim>(
        pool + page * page_bytes + region_offset + static_cast<long long>(g % entries_per_page) * global_layout::bytes, c0, out);
  }
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
};

//! Scratch of split-KV launches: per (row, head, split) the unnormalized fp32 accumulator and the
//! split's running maximum and denominator, and per (row, head, chunk) the chunk's maximum
//! score. One workspace serves any number of launches on one stream, one at a time (each
//! launch's merge has read it before the next writes it).
class sparse_attention_workspace {
 public:
  sparse_attention_workspace() = default;
  explicit sparse_attention_workspace(std::size_t floats) : partials_(floats) {}
  //! Enough for the splits the launcher chooses on this device at any batch (one wave of CTAs of
  //! eight heads each) with up to 256 chunks (16,384 indices) a row.
  template <int Dim>
  static sparse_attention_workspace for_device() {
    return sparse_attention_workspace(std::size_t(runtime::sm_count()) * 8 * (Dim + 4 + 256));
  }
  float* data() { return partials_.data(); }
  std::size_t floats() const { return partials_.size(); }

 private:
  runtime::device_buffer<float> partials_;
};

namespace detail {
inline constexpr int heads_per_cta = 8;

//! How a launch cuts each row's index list: `splits` pieces of `chunks_per_split` 64-entry chunks.
struct kv_split {
  float* partials = nullptr;   //!< [batch * rows, heads, splits, Dim + 4]: acc[Dim], m, l; null = unsplit
  float* chunk_max = nullptr;  //!< [batch * rows, heads, chunks]: each chunk's maximum score
  int splits = 1;
  int chunks_per_split = 0;
  int chunks = 0;
  bool max_pass = false;       //!< this launch only writes chunk_max (grid z = chunks)
};

DSV4_DEVICE float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
//! A lane's Dim/32 channels of one bf16 vector (g * 128 + 4 * lane + i), widened to fp32, one
//! 8-byte load per group of four: a warp reads 256 contiguous bytes per group.
template <int Dim>
DSV4_DEVICE void load_lane_channels(const bf16* v, int lane, float (&out)[Dim / 32]) {
#pragma unroll
  for (int g = 0; g < Dim / 128; ++g) {
    const uint2 w = *reinterpret_cast<const uint2*>(v + g * 128 + 4 * lane);
    out[4 * g + 0] = __uint_as_float(w.x << 16);
    out[4 * g + 1] = __uint_as_float(w.x & 0xffff0000u);
    out[4 * g + 2] = __uint_as_float(w.y << 16);
    out[4 * g + 3] = __uint_as_float(w.y & 0xffff0000u);
  }
}
//! The channel a lane's i-th value stands for.
template <int Dim>
DSV4_DEVICE int lane_channel(int lane, int i) {
  return (i / 4) * 128 + 4 * lane + i % 4;
}

//! One step of the score butterfly: lanes with `Bit` set keep the upper `Half` partial sums.
template <int Half, int Bit>
DSV4_DEVICE void butterfly_step(float (&part)[32], int lane) {
  const bool upper = lane & Bit;
#pragma unroll
  for (int i = 0; i < Half; ++i) {
    const float send = upper ? part[i] : part[i + Half];
    const float keep = upper ? part[i + Half] : part[i];
    part[i] = keep + __shfl_xor_sync(0xffffffffu, send, Bit);
  }
}

DSV4_DEVICE float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <int Dim, class KV>
DSV4_KERNEL void __launch_bounds__(heads_per_cta * 32, 2) sparse_attention_kernel(sparse_attention_args a, KV kv, kv_split sp) {
  runtime::start_after_previous_grid();
  constexpr int kLaneCh = Dim / 32;
  extern __shared__ uint4 dyn_smem[];
  bf16* tile = reinterpret_cast<bf16*>(dyn_smem);  // [sparse_chunk][Dim]
  __shared__ std::int32_t chunk_idx[sparse_chunk];
  __shared__ float probs[heads_per_cta][sparse_chunk];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row = blockIdx.x;  // flattened (sequence, row)
  const int seq = row / a.rows;
  const int head = blockIdx.y * heads_per_cta + warp;
  const bool head_ok = head < a.heads;
  const int split = blockIdx.z;
  // The max pass: chunk z alone. A split: its chunks. Unsplit: the whole list.
  const int first = sp.max_pass ? split * sparse_chunk : sp.partials ? split * sp.chunks_per_split * sparse_chunk : 0;
  const int last = sp.max_pass ? min(a.topk, first + sparse_chunk)
                   : sp.partials ? min(a.topk, first + sp.chunks_per_split * sparse_chunk)
                                 : a.topk;

  float q[kLaneCh], acc[kLaneCh];
  load_lane_channels<Dim>(a.q + (static_cast<long long>(row) * a.heads + (head_ok ? head : 0)) * Dim, lane, q);
  for (int k = 0; k < kLaneCh; ++k) {
    if (!head_ok) q[k] = 0.0f;
    acc[k] = 0.0f;
  }
  float m = -1e30f, l = 0.0f;
  if (sp.partials && !sp.max_pass && head_ok)  // the running maximum the unsplit recurrence has here
    for (int c = 0; c < split * sp.chunks_per_split; ++c)
      m = fmaxf(m, sp.chunk_max[(static_cast<long long>(row) * a.heads + head) * sp.chunks + c]);
  const std::int32_t* row_idx = a.idx + static_cast<long long>(row) * a.topk;

  for (int c0 = first; c0 < last; c0 += sparse_chunk) {
    const int n = min(sparse_chunk, last - c0);
    __syncthreads();  // the previous chunk's tile is no longer read
    if (threadIdx.x < sparse_chunk) chunk_idx[threadIdx.x] = threadIdx.x < n ? row_idx[c0 + threadIdx.x] : -1;
    __syncthreads();
#pragma unroll 4
    for (int t = threadIdx.x; t < sparse_chunk * (Dim / 8); t += blockDim.x) {
      const int e = t / (Dim / 8), c = (t % (Dim / 8)) * 8;
      const int j = chunk_idx[e];
      bf16 v[8];
      if (j >= 0) {
        kv.load8(seq, j, c, v);
      } else {
        for (int i = 0; i < 8; ++i) v[i] = bf16{};  // empty slots must not feed NaN garbage to 0 * x
      }
      std::uint32_t w[4];
      for (int i = 0; i < 4; ++i) w[i] = std::uint32_t(v[2 * i].bits) | (std::uint32_t(v[2 * i + 1].bits) << 16);
      *reinterpret_cast<uint4*>(tile + e * Dim + c) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    __syncthreads();
    if (!head_ok) continue;

    // Scores, 32 entries at a time. Each lane forms partial dot products over its Dim/32
    // channels for the 32 entries, then a butterfly reduce-scatter (5 steps, 31 independent
    // shuffles) leaves lane i with the full score of entry i of the half (step `bit` keeps the
    // upper half of the remaining entries in lanes with that bit set). Two halves rather than
    // one 64-entry butterfly keep the kernel under 128 registers, so two CTAs share an SM and
    // one's loads overlap the other's arithmetic.
    static_assert(sparse_chunk == 64, "the score butterfly below is written for 64-entry chunks");
    float half_score[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float part[32];
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        float k[kLaneCh];
        load_lane_channels<Dim>(tile + (32 * h + e) * Dim, lane, k);
        float acc_e = 0.0f;
#pragma unroll
        for (int c = 0; c < kLaneCh; ++c) acc_e = fmaf(q[c], k[c], acc_e);
        part[e] = acc_e;
      }
      butterfly_step<16, 16>(part, lane);
      butterfly_step<8, 8>(part, lane);
      butterfly_step<4, 4>(part, lane);
      butterfly_step<2, 2>(part, lane);
      butterfly_step<1, 1>(part, lane);
      half_score[h] = part[0];
    }
    const int e0 = lane, e1 = lane + 32;
    const float s0 = chunk_idx[e0] >= 0 ? half_score[0] * a.scale : -INFINITY;
    const float s1 = chunk_idx[e1] >= 0 ? half_score[1] * a.scale : -INFINITY;
    const float chunk_max = warp_max(fmaxf(s0, s1));
    if (sp.max_pass) {
      if (lane == 0) sp.chunk_max[(static_cast<long long>(row) * a.heads + head) * sp.chunks + split] = chunk_max;
      continue;
    }
    const float m_new = fmaxf(m, chunk_max);
    const float alpha = expf(m - m_new);
    const float p0 = expf(s0 - m_new), p1 = expf(s1 - m_new);
    l = l * alpha + warp_sum(p0 + p1);
    float* pw = probs[warp];
    pw[e0] = numerics::round_to_bf16(p0);  // bf16 probabilities weight the values
    pw[e1] = numerics::round_to_bf16(p1);
    __syncwarp();
    // acc <- acc * alpha + (the chunk's sum of bf16(p_j) kv_j, formed first), rounded as the host
    // reference rounds it.
    float sum[kLaneCh];
#pragma unroll
    for (int c = 0; c < kLaneCh; ++c) sum[c] = 0.0f;
    for (int e = 0; e < sparse_chunk; ++e) {
      const float p = pw[e];
      if (p == 0.0f) continue;  // warp-uniform: every lane reads the same value
      float v[kLaneCh];
      load_lane_channels<Dim>(tile + e * Dim, lane, v);
#pragma unroll
      for (int c = 0; c < kLaneCh; ++c) sum[c] = __fadd_rn(sum[c], __fmul_rn(p, v[c]));
    }
#pragma unroll
    for (int c = 0; c < kLaneCh; ++c) acc[c] = __fadd_rn(__fmul_rn(acc[c], alpha), sum[c]);
    __syncwarp();  // pw is rewritten by the next chunk
    m = m_new;
  }
  if (!head_ok || sp.max_pass) return;
  if (sp.partials) {  // the split's share; the merge adds the sink
    float* part_out = sp.partials + ((static_cast<long long>(row) * a.heads + head) * sp.splits + split) * (Dim + 4);
#pragma unroll
    for (int g = 0; g < Dim / 128; ++g)
      *reinterpret_cast<float4*>(part_out + g * 128 + 4 * lane) =
          make_float4(acc[4 * g], acc[4 * g + 1], acc[4 * g + 2], acc[4 * g + 3]);
    if (lane == 0) part_out[Dim] = m, part_out[Dim + 1] = l;
    return;
  }
  l += expf(a.sink[head] - m);
  bf16* o = a.out + (static_cast<long long>(row) * a.heads + head) * Dim;
  for (int c = 0; c < kLaneCh; ++c) o[lane_channel<Dim>(lane, c)] = bf16::from_float(__fdiv_rn(acc[c], l));
}

//! Merges the splits of one (row, head): M = max m_s, out = sum_s acc_s e^(m_s - M) /
//! (sum_s l_s e^(m_s - M) + e^(sink - M)), splits in order. A split without a valid index has
//! m = -1e30 and l = 0, so it weighs nothing unless every split is empty (then out = 0, as unsplit).
template <int Dim>
DSV4_KERNEL void __launch_bounds__(Dim / 4) sparse_attention_merge_kernel(sparse_attention_args a, kv_split sp) {
  runtime::start_after_previous_grid();
  const int row = blockIdx.x, head = blockIdx.y, c = 4 * threadIdx.x;
  const float* base = sp.partials + (static_cast<long long>(row) * a.heads + head) * sp.splits * (Dim + 4);
  float mx = -1e30f;
  for (int s = 0; s < sp.splits; ++s) mx = fmaxf(mx, base[s * (Dim + 4) + Dim]);
  float l = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int s = 0; s < sp.splits; ++s) {
    const float* ps = base + s * (Dim + 4);
    const float w = expf(ps[Dim] - mx);
    l = fmaf(ps[Dim + 1], w, l);
    const float4 v = *reinterpret_cast<const float4*>(ps + c);
    acc[0] = fmaf(v.x, w, acc[0]), acc[1] = fmaf(v.y, w, acc[1]), acc[2] = fmaf(v.z, w, acc[2]), acc[3] = fmaf(v.w, w, acc[3]);
  }
  l += expf(a.sink[head] - mx);
  bf16* o = a.out + (static_cast<long long>(row) * a.heads + head) * Dim + c;
  for (int i = 0; i < 4; ++i) o[i] = bf16::from_float(__fdiv_rn(acc[i], l));
}

//! The split for a launch: none when the (row, head group) grid fills half the SMs or more, the
//! list has one chunk, or no workspace is given; else as many splits as fit the grid into one
//! CTA per SM (every split beyond the first also adds its chunks to the maximum pass, so more
//! splits are not free), whole chunks each, as far as the workspace holds the partials.
template <int Dim>
kv_split choose_split(const sparse_attention_args& a, sparse_attention_workspace* ws, int sms) {
  kv_split sp;
  const int chunks = (a.topk + sparse_chunk - 1) / sparse_chunk;
  const long long rows = static_cast<long long>(a.batch) * a.rows;
  const long long ctas = rows * ((a.heads + heads_per_cta - 1) / heads_per_cta);
  if (!ws || chunks < 2 || ctas == 0 || 2 * ctas > sms) return sp;
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
}  // namespace detail

//! Empty when the launch can proceed, else why not.
template <int Dim, class KV>
std::string can_implement(const sparse_attention_args& a, const KV& kv) {
  static_assert(Dim % 128 == 0,
                "sparse_attention<Dim>: Dim must be a multiple of 128 (a lane owns four channels in each 128)");
  if (a.batch < 0 || a.rows < 0 || a.heads <= 0 || a.topk < 0) return "batch, rows, topk must be >= 0 and heads > 0";
  if (static_cast<long long>(a.batch) * a.rows > 0x7fffffffll) return "batch * rows exceeds the grid limit";
  if (a.heads > 65535) return "heads exceed the grid limit (65535)";
  if (a.rows == 0 || a.batch == 0) return {};
  if (!a.q || !a.out || !a.sink || (a.topk > 0 && !a.idx)) return "null pointer argument";
  if (reinterpret_cast<std::uintptr_t>(a.q) % 8 || reinterpret_cast<std::uintptr_t>(a.out) % 4)
    return "q must be 8-byte and out 4-byte aligned";
  return kv.check();
}

//! out = sparse_attention(q, kv, sink, idx). Indices must lie in [-1, entries) (not checked on
//! the device: the index producers guarantee it, and the host reference checks it). With a
//! workspace, grids of few rows split the index list (see the file comment).
template <int Dim, class KV>
void sparse_attention(const sparse_attention_args& a, const KV& kv, cudaStream_t stream = nullptr,
                      sparse_attention_workspace* workspace = nullptr) {
  if (const std::string why = can_implement<Dim>(a, kv); !why.empty()) throw error("sparse_attention: " + why);
  if (a.rows == 0 || a.batch == 0) return;
  constexpr int smem = sparse_chunk * Dim * int(sizeof(bf16));
  auto kernel = detail::sparse_attention_kernel<Dim, KV>;
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const detail::kv_split sp = detail::choose_split<Dim>(a, workspace, runtime::sm_count());
  const unsigned rows = unsigned(a.batch * a.rows), groups = unsigned((a.heads + detail::heads_per_cta - 1) / detail::heads_per_cta);
  if (sp.partials) {  // the chunk maxima the splits start from (the last split's chunks are not needed)
    detail::kv_split max_pass = sp;
    max_pass.max_pass = true;
    runtime::launch_programmatic(kernel, dim3(rows, groups, unsigned((sp.splits - 1) * sp.chunks_per_split)),
                                 dim3(detail::heads_per_cta * 32), smem, stream, a, kv, max_pass);
    DSV4_CUDA_CHECK_LAUNCH();
  }
  runtime::launch_programmatic(kernel, dim3(rows, groups, unsigned(sp.splits)), dim3(detail::heads_per_cta * 32), smem, stream,
                               a, kv, sp);
  DSV4_CUDA_CHECK_LAUNCH();
  if (!sp.partials) return;
  runtime::launch_programmatic(detail::sparse_attention_merge_kernel<Dim>, dim3(rows, unsigned(a.heads)), dim3(Dim / 4), 0,
                               stream, a, sp);
  DSV4_CUDA_CHECK_LAUNCH();
}

}  // namespace dsv4::kernels::attention
