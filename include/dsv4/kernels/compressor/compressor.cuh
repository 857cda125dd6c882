#pragma once
//! \file
//! CUDA side of the CSA2 compressor (spec §6) and of the cache entries that it and the local
//! window feed (issue 3, item 2). Host reference: reference.hpp (compress_prefill /
//! compress_decode, index_key_of, make_entries) and, for the window entries,
//! attention/layer_reference.hpp.
//!
//! Two kernels; the projections between them are the GEMMs of kernels/gemm:
//! - `compress_pool` (ratio >= 2): from the fp32 k = W_kv x and z = W_gate x of a call's tokens
//!   and each sequence's decode state (the fp32 k, z of its pending group), every group that the
//!   call completes becomes one latent: per channel a softmax of z over the group's tokens
//!   weights k, the fp32 sum is rounded to bf16 once, then RMSNorm. The call's trailing tokens of
//!   an incomplete group go to the state. Calls may start anywhere (prefill from 0, one-token
//!   decode, an appended chunk), and sequences of one call may sit at different positions.
//!   (Ratio 1 needs no kernel of its own: the latent is RMSNorm(bf16(W_kv x)), norm/rmsnorm.cuh.)
//! - `pack_entries<Format, Dim>`: bf16 vectors to cache entries in one pass: optional RMSNorm
//!   (window KV: kv_norm; index keys: the indexer's k_norm), RoPE of the last rope channels at the
//!   vector's position, block quantization, store at the entry's address: plain rows, a sequence's
//!   window ring (slot = position mod rows), or a page of the global cache through the sequence's
//!   block table (entry = position / ratio). Main entries (FP4, E4M3 per 16), index keys (MXFP4)
//!   and window entries (FP8, UE8M0 per 32) are the three instantiations.
//!
//! Work split: one warp per group (pool) or per vector (pack); lane l owns Dim / 32 consecutive
//! channels, so RMSNorm is one warp reduction (in double, as the host reference sums) and a
//! quantization block spans one lane or a few adjacent ones. Both kernels move a few KB per
//! entry and are launch-bound at decode; they are not worth more machinery.

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/norm/rmsnorm.cuh"
#include "dsv4/kernels/rope/rope.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/fast_codec.cuh"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.cuh"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::compressor {

using numerics::bf16;

namespace detail {
inline constexpr int warps_per_cta = 4;

//! Sum over the warp in double, the same value in every lane.
DSV4_DEVICE double warp_sum(double v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

//! 1 / sqrt(mean(x^2) + eps) from the warp's sum of squares, rounded as the host reference does.
DSV4_DEVICE float inverse_rms(double sum_of_squares, int dim, float eps) {
  const float mean = float(sum_of_squares / double(dim));
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
}
}  // namespace detail

// ------------------------------------------------------------------------------------------------
// Pooling (ratio >= 2)
// ------------------------------------------------------------------------------------------------

//! One sequence's share of a compressor call.
struct pool_sequence {
  long long start_pos = 0;  //!< position of the call's first token of this sequence
  int tokens = 0;           //!< the call's tokens of this sequence (>= 0)
  int row = 0;              //!< row of the first of them in k / z
  int state = 0;            //!< the sequence's decode-state slot
  int out_row = 0;          //!< output row of its first completed group
};

//! Groups that a call of `tokens` tokens from `start_pos` completes (ratio r): the groups g with
//! g r + r - 1 in [start_pos, start_pos + tokens - 1].
DSV4_HOST_DEVICE long long first_completed_group(long long start_pos, int ratio) { return start_pos / ratio; }
DSV4_HOST_DEVICE long long completed_groups(long long start_pos, int tokens, int ratio) {
  return (start_pos + tokens) / ratio - start_pos / ratio;
}

template <class Weight>
struct pool_args {
  const float* k = nullptr;      //!< [rows, head_dim] fp32 W_kv x of the call's tokens
  const float* z = nullptr;      //!< [rows, head_dim] fp32 W_gate x
  const pool_sequence* seqs = nullptr;  //!< [batch] (device memory)
  int batch = 0;
  int max_groups = 0;            //!< at least the largest completed_groups() of the batch
  float* state_k = nullptr;      //!< [states, ratio, head_dim]: k of the pending group, slot = position % ratio
  float* state_z = nullptr;      //!< [states, ratio, head_dim]
  const Weight* norm = nullptr;  //!< [head_dim] RMSNorm weight
  float eps = 1e-20f;
  bf16* latents = nullptr;       //!< [out rows, head_dim]
  std::int64_t* positions = nullptr;  //!< [out rows] or null: each latent's RoPE position g * ratio
  int ratio = 2;
  int head_dim = 0;
};

namespace detail {
template <int Dim, class Weight>
DSV4_KERNEL void __launch_bounds__(warps_per_cta * 32) pool_kernel(pool_args<Weight> a) {
  runtime::start_after_previous_grid();
  constexpr int E = Dim / 32;
  const int lane = threadIdx.x % 32;
  const int j = blockIdx.x * warps_per_cta + threadIdx.x / 32;  // this warp's group, from the first completed
  const pool_sequence sq = a.seqs[blockIdx.y];
  const int r = a.ratio;
  const long long g0 = first_completed_group(sq.start_pos, r);
  const long long n = completed_groups(sq.start_pos, sq.tokens, r);
  const std::size_t state_base = std::size_t(sq.state) * std::size_t(r) * Dim;
  const int c0 = lane * E;

  if (j < n) {
    const long long g = g0 + j;
    float mx[E], sum[E], acc[E];
    for (int e = 0; e < E; ++e) mx[e] = -INFINITY, sum[e] = 0.0f, acc[e] = 0.0f;
    // A token's k, z come from the call's rows, or from the state for positions before the call.
    auto row_of = [&](int t, const float* call, const float* state) {
      const long long p = g * r + t;
      return p < sq.start_pos ? state + state_base + std::size_t(p % r) * Dim
                              : call + (std::size_t(sq.row) + std::size_t(p - sq.start_pos)) * Dim;
    };
    for (int t = 0; t < r; ++t) {
      const float* zr = row_of(t, a.z, a.state_z) + c0;
      for (int e = 0; e < E; ++e) mx[e] = fmaxf(mx[e], zr[e]);
    }
    // The host reference's order: the exponentials summed in token order, then each weight
    // e_t / sum times k_t accumulated in token order (separate roundings).
    for (int t = 0; t < r; ++t) {
      const float* zr = row_of(t, a.z, a.state_z) + c0;
      for (int e = 0; e < E; ++e) sum[e] = __fadd_rn(sum[e], expf(__fsub_rn(zr[e], mx[e])));
    }
    for (int t = 0; t < r; ++t) {
      const float* zr = row_of(t, a.z, a.state_z) + c0;
      const float* kr = row_of(t, a.k, a.state_k) + c0;
      for (int e = 0; e < E; ++e)
        acc[e] = __fadd_rn(acc[e], __fmul_rn(__fdiv_rn(expf(__fsub_rn(zr[e], mx[e])), sum[e]), kr[e]));
    }
    double ss = 0;
    for (int e = 0; e < E; ++e) {
      acc[e] = bf16::from_float(acc[e]).to_float();
      ss += double(acc[e]) * double(acc[e]);
    }
    const float inv = inverse_rms(warp_sum(ss), Dim, a.eps);
    bf16* out = a.latents + (std::size_t(sq.out_row) + std::size_t(j)) * Dim + c0;
    for (int e = 0; e < E; ++e)
      out[e] = bf16::from_float(__fmul_rn(norm::detail::weight_value(a.norm, c0 + e), __fmul_rn(acc[e], inv)));
    if (a.positions && lane == 0) a.positions[sq.out_row + j] = g * r;
  }

  // The trailing tokens of an incomplete group go to the state. Only group g0 can read the state
  // (it is the one that may begin before the call), and its lanes write the same channels they
  // read, so warp 0 of CTA 0 stores the tail after its own reads, in program order.
  if (j == 0) {
    const long long end = sq.start_pos + sq.tokens;
    long long from = end / r * r;
    if (from < sq.start_pos) from = sq.start_pos;
    for (long long p = from; p < end; ++p) {
      const std::size_t src = (std::size_t(sq.row) + std::size_t(p - sq.start_pos)) * Dim + c0;
      const std::size_t dst = state_base + std::size_t(p % r) * Dim + c0;
      for (int e = 0; e < E; ++e) a.state_k[dst + e] = a.k[src + e], a.state_z[dst + e] = a.z[src + e];
    }
  }
}
}  // namespace detail

//! Pools the groups completed by a call (see the file comment). The state of a new sequence needs
//! no initialisation: every slot is written before a group reads it.
template <int Dim, class Weight>
void compress_pool(const pool_args<Weight>& a, cudaStream_t stream = nullptr) {
  static_assert(Dim % 32 == 0 && Dim >= 32, "compress_pool<Dim>: the latent width must be a positive multiple of 32");
  static_assert(std::is_same_v<Weight, float> || std::is_same_v<Weight, bf16>, "compress_pool: weight is bf16 or float");
  const std::string where = "compress_pool (ratio " + std::to_string(a.ratio) + ", head_dim " + std::to_string(a.head_dim) + "): ";
  if (a.head_dim != Dim) throw error(where + "head_dim must equal the kernel's Dim " + std::to_string(Dim));
  if (a.ratio < 2) throw error(where + "ratio must be >= 2 (ratio 1 is RMSNorm of the bf16 projection)");
  if (a.batch < 0 || a.max_groups < 0 || a.batch > 65535) throw error(where + "need 0 <= batch <= 65535 and max_groups >= 0");
  if (a.batch == 0) return;
  if (!a.k || !a.z || !a.seqs || !a.state_k || !a.state_z || !a.norm || (a.max_groups > 0 && !a.latents))
    throw error(where + "null pointer argument");
  // At least one CTA per sequence: warp 0 of CTA 0 stores the state even when no group completes.
  const int ctas = (a.max_groups + detail::warps_per_cta - 1) / detail::warps_per_cta;
  const dim3 grid(unsigned(ctas > 0 ? ctas : 1), unsigned(a.batch));
  runtime::launch_programmatic(detail::pool_kernel<Dim, Weight>, grid, dim3(detail::warps_per_cta * 32), 0, stream, a);
  DSV4_CUDA_CHECK_LAUNCH();
}

// ------------------------------------------------------------------------------------------------
// Packing vectors into cache entries
// ------------------------------------------------------------------------------------------------

enum class entry_store {
  rows,   //!< entry i of the call at base + i * entry_stride
  ring,   //!< sequence s's ring at base + s * seq_stride, slot position % ring_rows
  pages,  //!< the global cache: entry position / ratio of sequence s, through its block table
};

struct entry_destination {
  entry_store mode = entry_store::rows;
  std::uint8_t* base = nullptr;  //!< rows, ring: the first entry; pages: the page pool
  long long entry_stride = 0;    //!< rows, ring: bytes from one entry to the next
  long long seq_stride = 0;      //!< ring: bytes from one sequence's ring to the next
  int ring_rows = 0;             //!< ring: slots per sequence
  const std::int32_t* block_tables = nullptr;  //!< pages: [sequences, max_pages]
  int max_pages = 0;
  long long page_bytes = 0;
  long long region_offset = 0;   //!< pages: the owner's main or key region within a page
  int entries_per_page = 0;
  int ratio = 1;                 //!< pages: tokens per entry

  DSV4_HOST_DEVICE std::uint8_t* address(long long i, int seq, long long position) const {
    if (mode == entry_store::rows) return base + i * entry_stride;
    if (mode == entry_store::ring) return base + seq * seq_stride + (position % ring_rows) * entry_stride;
    const long long g = position / ratio;
    const long long page = block_tables[static_cast<long long>(seq) * max_pages + g / entries_per_page];
    return base + page * page_bytes + region_offset + (g % entries_per_page) * entry_stride;
  }
};

template <class Weight>
struct pack_args {
  const bf16* x = nullptr;        //!< [rows, Dim], row stride x_stride elements
  long long x_stride = 0;
  long long rows = 0;
  const Weight* norm = nullptr;   //!< [Dim] RMSNorm weight, or null for none
  float eps = 1e-20f;
  const std::int64_t* positions = nullptr;  //!< [rows]: RoPE position (and ring slot / page entry)
  const std::int32_t* seq = nullptr;        //!< [rows] sequence of each vector, or null for all 0
  const float* freqs = nullptr;   //!< rope_pairs frequencies (device memory)
  int rope_pairs = 0;             //!< RoPE on the last 2 * rope_pairs channels (0: none)
  entry_destination dst;
  bf16* staged = nullptr;         //!< optional [rows, Dim]: the values quantized (tests, debugging)
};

namespace detail {
//! Packs row i of `a` (i < a.rows), by one whole warp: every lane calls it with the same i.
//! pack_kernel runs it a warp per row; other launches may run it for their share of rows (the
//! attention layer's index-list launch packs a decode step's window entries).
template <class F, int Dim, class Weight>
DSV4_DEVICE void pack_row(const pack_args<Weight>& a, long long i) {
  using layout = numerics::packed_vector<F, Dim>;
  using Elem = typename F::element;
  constexpr int E = Dim / 32;
  constexpr int B = F::block_size;
  const int lane = threadIdx.x % 32;
  const int c0 = lane * E;
  const bf16* x = a.x + i * a.x_stride + c0;
  float v[E];
  for (int e = 0; e < E; ++e) v[e] = x[e].to_float();

  if (a.norm) {
    double ss = 0;
    for (int e = 0; e < E; ++e) ss += double(v[e]) * double(v[e]);
    const float inv = inverse_rms(warp_sum(ss), Dim, a.eps);
    for (int e = 0; e < E; ++e)
      v[e] = bf16::from_float(__fmul_rn(norm::detail::weight_value(a.norm, c0 + e), __fmul_rn(v[e], inv))).to_float();
  }
  const long long position = a.positions[i];
  const int rope_from = Dim - 2 * a.rope_pairs;
  for (int e = 0; e < E; e += 2) {
    const int c = c0 + e;
    if (c < rope_from) continue;
    const float theta = __fmul_rn(float(position), a.freqs[(c - rope_from) / 2]);
    float s, cs;
    sincosf(theta, &s, &cs);
    bf16 re = bf16::from_float(v[e]), im = bf16::from_float(v[e + 1]);
    rope::rotate_pair(re, im, cs, s);
    v[e] = re.to_float(), v[e + 1] = im.to_float();
  }
  if (a.staged)
    for (int e = 0; e < E; ++e) a.staged[i * Dim + c0 + e] = bf16::from_float(v[e]);

  std::uint8_t* entry = a.dst.address(i, a.seq ? a.seq[i] : 0, position);
  // Scales: a block is either inside one lane (E >= B) or spread over B / E adjacent lanes, which
  // agree on its amax by xor-shuffles of the bit patterns (NaN ranks above +inf).
  constexpr int blocks_per_lane = E >= B ? E / B : 1;
  constexpr int lanes_per_block = E >= B ? 1 : B / E;
  std::uint8_t codes[E];
  for (int b = 0; b < blocks_per_lane; ++b) {
    const int span = E >= B ? B : E;
    std::uint32_t amax = 0;
    for (int e = 0; e < span; ++e) amax = max(amax, numerics::abs_bits(bf16::from_float(v[b * span + e])));
    for (int off = lanes_per_block / 2; off > 0; off >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const std::uint8_t sc = F::scale_code(numerics::bits_to_float(amax));
    const numerics::detail::device_block_encoder<F> enc(sc);
    for (int e = 0; e < span; ++e) codes[b * span + e] = enc(v[b * span + e]);
    const int block = c0 / B + b;
    if (E >= B || lane % lanes_per_block == 0) entry[layout::scale_offset + block] = sc;
  }
  if constexpr (Elem::storage_bits == 8) {
    for (int e = 0; e < E; ++e) entry[c0 + e] = codes[e];
  } else {
    static_assert(E % 2 == 0, "pack_entries: FP4 codes need an even number of channels per lane");
    for (int e = 0; e < E; e += 2) entry[(c0 + e) / 2] = std::uint8_t(codes[e] | (codes[e + 1] << 4));
  }
}

template <class F, int Dim, class Weight>
DSV4_KERNEL void __launch_bounds__(warps_per_cta * 32) pack_kernel(pack_args<Weight> a) {
  // The norm's row and the rope table (no kernel writes them), asked for while the kernel before runs.
  if (a.norm) runtime::prefetch_l2(a.norm, sizeof(Weight) * std::size_t(Dim));
  runtime::prefetch_l2(a.freqs, sizeof(float) * std::size_t(a.rope_pairs));
  runtime::start_after_previous_grid();
  const long long i = static_cast<long long>(blockIdx.x) * warps_per_cta + threadIdx.x / 32;
  if (i < a.rows) pack_row<F, Dim, Weight>(a, i);  // whole warps together
}
}  // namespace detail

//! Empty when `pack_entries<F, Dim>(a)` can run, else why not.
template <numerics::BlockFormat F, int Dim, class Weight>
std::string can_pack(const pack_args<Weight>& a) {
  using layout = numerics::packed_vector<F, Dim>;
  if (a.rows < 0) return "rows must be >= 0";
  if (a.rope_pairs < 0 || 2 * a.rope_pairs > Dim) return "rope_pairs must lie in [0, Dim / 2]";
  if (a.rows == 0) return {};
  if (!a.x || !a.positions || !a.dst.base || (a.rope_pairs > 0 && !a.freqs)) return "null pointer argument";
  if (a.x_stride < Dim) return "the row stride of x must be at least Dim";
  switch (a.dst.mode) {
    case entry_store::rows:
      if (a.dst.entry_stride < layout::bytes) return "entry_stride is smaller than an entry";
      break;
    case entry_store::ring:
      if (a.dst.ring_rows <= 0 || a.dst.entry_stride < layout::bytes) return "a ring needs ring_rows > 0 and room for an entry per slot";
      break;
    case entry_store::pages:
      if (!a.dst.block_tables || a.dst.max_pages <= 0 || a.dst.entries_per_page <= 0 || a.dst.ratio <= 0 ||
          a.dst.entry_stride < layout::bytes)
        return "a paged destination needs block tables, max_pages, entries_per_page, ratio and an entry stride";
      break;
  }
  return {};
}

//! Packs `rows` bf16 vectors into cache entries of format F (see the file comment). Positions
//! must be non-negative, and paged destinations must have their pages allocated (the block
//! tables come from cache::page_allocator); neither is checked on the device.
template <numerics::BlockFormat F, int Dim, class Weight = bf16>
void pack_entries(const pack_args<Weight>& a, cudaStream_t stream = nullptr) {
  static_assert(Dim % 32 == 0 && (Dim / 32) % 2 == 0,
                "pack_entries<F, Dim>: Dim must be a multiple of 64 (each lane owns an even number of channels)");
  static_assert((Dim / 32) % F::block_size == 0 || F::block_size % (Dim / 32) == 0,
                "pack_entries<F, Dim>: a quantization block must cover whole lanes (Dim / 32 channels each)");
  static_assert(std::is_same_v<Weight, float> || std::is_same_v<Weight, bf16>, "pack_entries: weight is bf16 or float");
  if (const std::string why = can_pack<F, Dim>(a); !why.empty())
    throw error("pack_entries<" + numerics::detail::format_name<F>() + ", " + std::to_string(Dim) + ">: " + why);
  if (a.rows == 0) return;
  const long long ctas = (a.rows + detail::warps_per_cta - 1) / detail::warps_per_cta;
  if (ctas > 0x7fffffffLL) throw error("pack_entries: too many rows for one launch");
  runtime::launch_programmatic(detail::pack_kernel<F, Dim, Weight>, dim3(unsigned(ctas)), dim3(detail::warps_per_cta * 32), 0,
                               stream, a);
  DSV4_CUDA_CHECK_LAUNCH();
}

}  // namespace dsv4::kernels::compressor
