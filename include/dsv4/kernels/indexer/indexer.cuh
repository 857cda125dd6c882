#pragma once
//! \file
//! CUDA lightning-indexer scan and top-k selection (spec §7), same results as reference.hpp.
//!
//! Scan (two kernels, the same scores): q [heads, dim] times the keys on the tensor cores (bf16
//! MMA: the exact dot product, as the host's), then per (head, key) bf16(relu(bf16(dot)) * w) and
//! a head-ordered fp32 sum per key; scores stored as bf16 (-inf where not visible). The tiled
//! kernel (one CTA per 64 keys and 4 query rows, the keys dequantized into shared memory) keeps one
//! fp32 accumulator per 32-channel block and adds the blocks in double; the streamed kernel (the
//! default) does too, except for tiles whose query and key block scales lie close enough for one
//! fp32 accumulator over all channels to be exact (one_accumulator_exact).
//!
//! Top-k: one CTA per row (several for long rows given scratch), in torch.topk's order
//! (numerics/order_key.hpp: -0 below +0, NaN above +inf, NaNs tied). Two histogram passes over the orderable 16-bit keys (per-warp bins,
//! 16-byte reads) find the k-th largest score T and how many scores exceed it; an ordered pass
//! then keeps every score > T and the lowest-index scores == T, each thread owning 16 consecutive
//! indices and a block prefix sum placing them, so the output comes out in ascending index order
//! as the reference returns it.

#include <cub/block/block_scan.cuh>  // provides cub::BlockScan
#include <cuda_runtime.h>            // provides cudaStream_t

#include <algorithm>
#include <cstdint>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/tensor_core.cuh"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/fast_codec.cuh"
#include "dsv4/numerics/order_key.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_info.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::indexer {

using numerics::bf16;

//! Which scan kernel runs: `tiled` (one CTA per 64 keys and 4 rows, the keys dequantized into
//! shared memory once for the rows), `streamed` (warps streaming 16-key tiles into registers over
//! a grid sized to the GPU), or `automatic` (detail::plan_index_scan's choice). Same scores, bit
//! for bit.
enum class scan_method { automatic, tiled, streamed };

struct index_scan_args {
  const bf16* q = nullptr;           //!< [rows, heads, Dim], MXFP4 QDQ'd queries (RoPE applied):
                                     //!< E2M1 values times a power of two per 32 channels, which the
                                     //!< scans' exactness needs (other bf16 values: not exact)
  const bf16* w = nullptr;           //!< [rows, heads], weights_proj output already scaled by 2^-6
  const std::uint8_t* keys = nullptr;  //!< [n_keys] packed MXFP4 index keys
  long long key_stride = 0;          //!< bytes between keys
  bf16* scores = nullptr;            //!< [rows, n_keys]
  const long long* visible = nullptr;  //!< [rows]: keys t >= visible[row] score -inf
  int rows = 0, heads = 0;
  long long n_keys = 0;
  //! Paged keys (the owner's key region of the page pool, cache/paged_cache.hpp), when
  //! block_tables is set: key t of row r lives in page block_tables[row_batch[r] * max_pages +
  //! t / entries_per_page], at keys + page * page_bytes + (t % entries_per_page) * key_stride,
  //! where `keys` points at the region's start within page 0. row_batch null: every row is 0.
  const std::int32_t* block_tables = nullptr;
  const std::int32_t* row_batch = nullptr;
  int max_pages = 0, entries_per_page = 0;
  long long page_bytes = 0;
  scan_method method = scan_method::automatic;

  DSV4_HOST_DEVICE const std::uint8_t* key(int row, long long t) const {
    if (!block_tables) return keys + t * key_stride;
    const long long b = row_batch ? row_batch[row] : 0;
    const long long page = block_tables[b * max_pages + t / entries_per_page];
    return keys + page * page_bytes + (t % entries_per_page) * key_stride;
  }
};

struct topk_args {
  const bf16* scores = nullptr;      //!< [rows, n]
  long long n = 0;
  int rows = 0, k = 0;
  const long long* visible = nullptr;  //!< [rows]; selected t >= visible[row] become -1
  int offset = 0;                    //!< added to the other selected indices (window operand length)
  std::int32_t* out = nullptr;       //!< [rows, k]
  //! Optional [rows, n]: score column i stands for position positions[i] (ascending, -1 = hole),
  //! as in a gathered candidate scan; the output then holds positions, not columns.
  const std::int32_t* positions = nullptr;
  //! Optional device scratch of topk_scratch_words(rows, n) words: with it, rows of
  //! topk_split_min_n scores and more are selected by several CTAs each (the same result, less
  //! latency when a few long rows would leave most SMs idle).
  unsigned* scratch = nullptr;
  std::size_t scratch_words = 0;
};

//! Scan of a gathered list of key positions (a Reindex layer scoring only its candidate pool):
//! column i scores key positions[row, i]; -1 holes and positions >= visible score -inf.
struct gathered_scan_args {
  index_scan_args scan;                   //!< scan.n_keys = columns per row
  const std::int32_t* positions = nullptr;  //!< [rows, columns]
};

//! Candidate pool of the candidate-source layer (spec §7): from its scores [rows, n], block
//! maxima over `block` positions with the newest visible block forced in, the top `topk_blocks`
//! blocks with a finite maximum, expanded to an ascending position list [rows, topk_blocks x block]
//! with -1 holes (blocks with no finite score, positions past n).
struct candidate_args {
  const bf16* scores = nullptr;       //!< [rows, n], the candidate source's masked scores
  long long n = 0;
  int rows = 0, block = 8, topk_blocks = 2048;
  const long long* visible = nullptr; //!< [rows]
  bf16* block_scores = nullptr;       //!< workspace [rows, ceil(n / block)]
  std::int32_t* block_ids = nullptr;  //!< workspace [rows, min(topk_blocks, ceil(n / block))]
  std::int32_t* positions = nullptr;  //!< [rows, min(topk_blocks, blocks) x block]
};

namespace detail {
inline constexpr int scan_threads = 128;  // four warps
inline constexpr int scan_keys = 64;      // keys per CTA: 16 per warp, two MMA n-tiles
inline constexpr int scan_rows = 4;       // query rows per CTA: they share its dequantized keys
inline constexpr int max_index_heads = 64;

//! The (head, key) term of a score as the host reference rounds it: bf16(relu(bf16(dot)) * w),
//! from the exact dot product summed in double. relu as std::max(d, 0.0f): a NaN dot product stays
//! NaN (as torch.relu keeps it; fmaxf would give 0). The roundings are the hardware's bf16
//! conversions (numerics::fast_round_to_bf16: the host's value, a NaN's bits aside, which the
//! score's final bf16::from_float makes canonical); `index_term_pair` rounds two terms per
//! conversion.
DSV4_DEVICE float index_relu(float d) { return d < 0.0f ? 0.0f : d; }
DSV4_DEVICE float index_term(double dot, float w) {
  const float d = numerics::fast_round_to_bf16(__double2float_rn(dot));
  return numerics::fast_round_to_bf16(__fmul_rn(index_relu(d), w));
}
DSV4_DEVICE float index_dot_to_float(double dot) { return __double2float_rn(dot); }
DSV4_DEVICE float index_dot_to_float(float dot) { return dot; }
template <class Acc>
DSV4_DEVICE float2 index_term_pair(Acc dot0, Acc dot1, float w0, float w1) {
  const float2 d = numerics::fast_round_to_bf16x2(index_dot_to_float(dot0), index_dot_to_float(dot1));
  return numerics::fast_round_to_bf16x2(__fmul_rn(index_relu(d.x), w0), __fmul_rn(index_relu(d.y), w1));
}

//! Which key list a scan row reads (gathered rows each their own, paged rows their sequence's,
//! -1: the one list of an unpaged call) and the key position its column t stands for.
DSV4_DEVICE long long scan_key_source(const index_scan_args& a, const std::int32_t* positions, int row) {
  if (positions) return row;
  return a.block_tables && a.row_batch ? a.row_batch[row] : -1;
}
DSV4_DEVICE long long scan_position(const index_scan_args& a, const std::int32_t* positions, int row, long long t) {
  return positions ? positions[static_cast<long long>(row) * a.n_keys + t] : t;
}

//! Shared memory of a scan CTA: the dequantized keys [scan_keys][Dim + 8] and the current row's
//! queries [head tiles x 16][Dim + 8] in bf16 (rows padded by 16 bytes for ldmatrix), the row's
//! weights [64] and each (key, head) term [scan_keys][heads + 1] in fp32.
template <int Dim>
struct scan_smem {
  static constexpr int row = Dim + 8;
  static constexpr int keys_elems = scan_keys * row;
  DSV4_HOST_DEVICE static int q_elems(int heads) { return (heads + 15) / 16 * 16 * row; }
  static int bytes(int heads) {
    return (keys_elems + q_elems(heads)) * int(sizeof(bf16)) + (max_index_heads + scan_keys * (heads + 1)) * int(sizeof(float));
  }
};

//! One CTA: keys [64 blockIdx.x, + 64) for query rows [4 blockIdx.y, + 4). The keys are dequantized
//! once into shared memory (again only when a row reads other keys: another sequence's pages, or
//! its own gathered positions); per row, every warp multiplies all head tiles by its 16 keys on
//! the tensor cores (QK^T as an m16n8k16 bf16 MMA with fp32 accumulation), then each (head, key)
//! term bf16(relu(bf16(dot)) * w_h) goes to shared memory and one thread per key adds the heads'
//! terms in head order. A block's MXFP4 products are exact and so is their tensor-core sum; the
//! blocks' sums in double give the exact dot product while the blocks' products lie within 2^40 of
//! each other (test: scan_is_exact_for_far_apart_block_scales; fp32 accumulation across blocks
//! differed from the host at 2^32), so scores equal the host reference's bit for bit.
template <int Dim>
DSV4_KERNEL void __launch_bounds__(scan_threads) index_scan_kernel(index_scan_args a, const std::int32_t* positions) {
  using F = numerics::index_key_format;
  using layout = scan_smem<Dim>;
  constexpr int kRow = layout::row, kChunks = Dim / 8;
  runtime::start_after_previous_grid();
  extern __shared__ __align__(16) unsigned char scan_smem_raw[];
  bf16* keys_s = reinterpret_cast<bf16*>(scan_smem_raw);
  bf16* q_s = keys_s + layout::keys_elems;
  float* w_s = reinterpret_cast<float*>(q_s + layout::q_elems(a.heads));
  float* terms = w_s + max_index_heads;
  const int heads = a.heads, head_tiles = (heads + 15) / 16, tstride = heads + 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, quad = lane % 4;
  const long long key0 = static_cast<long long>(blockIdx.x) * scan_keys;
  const int row0 = int(blockIdx.y) * scan_rows, row_end = min(a.rows, row0 + scan_rows);

  auto key_source = [&](int row) { return scan_key_source(a, positions, row); };
  auto position = [&](int row, long long t) { return scan_position(a, positions, row, t); };
  // Dequantizes the keys of rows [row, until) (one source) that any of them can see; the others
  // are zero (their scores are -inf whatever the product).
  auto load_keys = [&](int row, int until) {
    long long visible = 0;
    for (int r = row; r < until; ++r) visible = max(visible, a.visible[r]);
    for (int i = threadIdx.x; i < scan_keys * kChunks; i += scan_threads) {
      const int k = i / kChunks, c0 = (i % kChunks) * 8;
      const long long t = key0 + k;
      uint4 v = make_uint4(0, 0, 0, 0);
      const long long pos = t < a.n_keys ? position(row, t) : -1;
      if (pos >= 0 && pos < visible) {
        bf16 k8[8];
        numerics::dequantize8<F, Dim>(a.key(row, pos), c0, k8);
        v = make_uint4(std::uint32_t(k8[0].bits) | std::uint32_t(k8[1].bits) << 16,
                       std::uint32_t(k8[2].bits) | std::uint32_t(k8[3].bits) << 16,
                       std::uint32_t(k8[4].bits) | std::uint32_t(k8[5].bits) << 16,
                       std::uint32_t(k8[6].bits) | std::uint32_t(k8[7].bits) << 16);
      }
      *reinterpret_cast<uint4*>(keys_s + k * kRow + c0) = v;
    }
  };

  long long loaded = -2;  // the key source in shared memory (-2: none yet)
  for (int row = row0; row < row_end; ++row) {
    __syncthreads();  // the previous row's MMAs and sums are done with shared memory
    // A row that sees none of this CTA's keys (in a causal prefill, about half of all row x key
    // block pairs): its scores are -inf as below, without the products. CTA-uniform (row, key0).
    if (!positions && key0 >= a.visible[row]) {
      const long long t = key0 + threadIdx.x;
      if (threadIdx.x < scan_keys && t < a.n_keys) a.scores[static_cast<long long>(row) * a.n_keys + t] = bf16::from_bits(0xFF80);
      continue;
    }
    if (key_source(row) != loaded || positions) {
      int until = row + 1;
      while (!positions && until < row_end && key_source(until) == key_source(row)) ++until;
      load_keys(row, until);
      loaded = key_source(row);
    }
    // The row's queries (padding head rows zero) and weights.
    const bf16* q = a.q + static_cast<long long>(row) * heads * Dim;
    for (int i = threadIdx.x; i < head_tiles * 16 * kChunks; i += scan_threads) {
      const int h = i / kChunks, c0 = (i % kChunks) * 8;
      *reinterpret_cast<uint4*>(q_s + h * kRow + c0) =
          h < heads ? *reinterpret_cast<const uint4*>(q + h * Dim + c0) : make_uint4(0, 0, 0, 0);
    }
    for (int h = threadIdx.x; h < heads; h += scan_threads) w_s[h] = a.w[static_cast<long long>(row) * heads + h].to_float();
    __syncthreads();

    // Each 32-channel block (one MXFP4 scale of q and one of the key) on its own accumulator: its
    // products are multiples of a quarter of the two scales' product and its sum stays within 13
    // bits of them, so the tensor core's sum is exact whatever its internal alignment and rounding.
    // The blocks' sums are added in double: exact as the host reference's double sum is, so both
    // round the same dot product to fp32 and bf16 even when the blocks' scales are far apart.
    double acc[max_index_heads / 16][2][4] = {};
#pragma unroll
    for (int kb = 0; kb < Dim; kb += 32) {
      float part[max_index_heads / 16][2][4] = {};
#pragma unroll
      for (int k = kb; k < kb + 32; k += 16) {
        std::uint32_t kf[4];
        tensor_core::ldmatrix_x4<false>(kf, keys_s + ((2 * warp + lane / 16) * 8 + lane % 8) * kRow + k + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int ht = 0; ht < max_index_heads / 16; ++ht) {
          if (ht >= head_tiles) break;
          std::uint32_t qa[4];
          tensor_core::ldmatrix_x4<false>(qa, q_s + (ht * 16 + lane % 16) * kRow + k + (lane / 16) * 8);
          tensor_core::mma_bf16(part[ht][0], qa, kf[0], kf[1]);
          tensor_core::mma_bf16(part[ht][1], qa, kf[2], kf[3]);
        }
      }
#pragma unroll
      for (int ht = 0; ht < max_index_heads / 16; ++ht) {
        if (ht >= head_tiles) break;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[ht][nt][i] += double(part[ht][nt][i]);
      }
    }
#pragma unroll
    for (int ht = 0; ht < max_index_heads / 16; ++ht) {
      if (ht >= head_tiles) break;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int h = ht * 16 + gid + 8 * (i / 2), key = warp * 16 + nt * 8 + quad * 2 + i % 2;
          if (h >= heads) continue;
          terms[key * tstride + h] = index_term(acc[ht][nt][i], w_s[h]);
        }
    }
    __syncthreads();
    if (threadIdx.x < scan_keys) {
      const long long t = key0 + threadIdx.x;
      if (t < a.n_keys) {
        const long long pos = position(row, t);
        bf16* out = a.scores + static_cast<long long>(row) * a.n_keys + t;
        if (pos < 0 || pos >= a.visible[row]) {
          *out = bf16::from_bits(0xFF80);  // -inf
        } else {
          float sum = 0.0f;  // fp32, heads in order (as the host reference)
          for (int h = 0; h < heads; ++h) sum += terms[threadIdx.x * tstride + h];
          *out = bf16::from_float(sum);
        }
      }
    }
  }
}

//! The streamed scan (`scan_method::streamed`): warps that each stream their own 16-key tiles
//! straight from global memory into MMA B fragments, with no block-wide barrier after the queries
//! are staged, in a grid sized to the GPU (each CTA strides over the key tiles). The tiled kernel
//! above is one short CTA per 64 keys: at decode (one to a few rows) it ran at 4% of the copy
//! bound, its time going to the staging of q and keys, barriers and one-wave tails rather than to
//! bytes or products.
//!
//! Exactness is the tiled kernel's: the keys are the MXFP4 values times their block scale in bf16
//! (the values F::dequantize gives), each 32-channel block's products summed on its own
//! tensor-core accumulator, the blocks added in double. The K order inside a block is permuted so
//! that each lane's fragment registers come from one 4-byte word of the key: lane (gid, quad) holds
//! key gid's channels 32b + 8 quad + [0, 8) of block b, as k-steps 2b (channels +0..3) and 2b + 1
//! (+4..7); the queries are staged in the same order (a block's sum does not depend on the order of
//! its products, all exact).
inline constexpr int stream_warps = 4;
inline constexpr int stream_keys = 16;  // keys per warp tile: two MMA n-tiles
inline constexpr int stream_rows = 4;   // query rows per CTA: they share a tile's key fragments
static_assert(stream_rows == scan_rows, "index scan: both kernels' grids hold 4 rows per CTA (the launcher's row limit)");

//! Binary exponents of a set of MXFP4 blocks, for the streamed scan's one-accumulator path: `spread`
//! the largest difference within one vector (a query head or a key), `lo` / `hi` the smallest and
//! largest over all of them. Queries: the bf16 exponent field of each nonzero block's largest
//! magnitude (blocks of zeros left out); keys: the UE8M0 scale codes.
struct scale_range {
  int spread = 0, lo = 255, hi = 0;
};

//! Whether the dot products of a row's queries (`q`) with a tile's keys (`k`) are exact in one fp32
//! accumulator over all `Dim` channels, added in any order (so bit-equal to the host's per-block
//! sums added in double). A query block with largest exponent E has its elements on multiples of
//! 2^(E - 3) below 2^(E + 1) (E2M1 values times 2^e, with E <= e + 2); a key block with code c on
//! multiples of 2^(c - 128) up to 12 of them. A block's 32 products are then multiples of its unit
//! u below 2^13 u, and every partial sum over the blocks a multiple of the smallest unit below
//! blocks x 2^13 x the largest: exact in fp32's 24 bits while the units lie within 2^(11 -
//! log2 blocks) of each other (the query's plus the key's spread), every unit is a normal fp32
//! (E + c >= 132, biased) and nothing overflows (E + c < 373 - log2 blocks: 371 at 128 channels);
//! query maxima normal and finite (E within
//! 1..254: a subnormal maximum breaks the unit's bound), key codes within 8..250 (finite, normal
//! elements). Otherwise the scan keeps a tensor-core accumulator per block, added in double.
DSV4_HOST_DEVICE constexpr int ceil_log2(int n) {
  int l = 0;
  while ((1 << l) < n) ++l;
  return l;
}
template <int Dim>
DSV4_DEVICE bool one_accumulator_exact(const scale_range& q, const scale_range& k) {
  constexpr int log2_blocks = ceil_log2(Dim / 32);
  // Units 2^(E + c - 258) (biased E and c): the smallest normal, the largest times blocks x 2^13
  // below 2^128, and blocks x 2^13 x the largest within 2^24 x the smallest.
  return q.spread + k.spread <= 11 - log2_blocks && q.lo >= 1 && q.hi <= 254 && k.lo >= 8 && k.hi <= 250 &&
         q.lo + k.lo >= 132 && q.hi + k.hi < 373 - log2_blocks;
}

//! Shared memory of a streamed-scan CTA: the rows' query fragments [rows][head tiles][k-steps][32
//! lanes] (16 bytes per lane), their weights [rows][heads] and each warp's (key, head) terms
//! [warps][16][heads + 1] in fp32.
template <int Dim>
struct stream_smem {
  static constexpr int ksteps = Dim / 16;
  DSV4_HOST_DEVICE static int q_frags(int heads) { return stream_rows * ((heads + 15) / 16) * ksteps * 32; }
  static int bytes(int heads) {
    return q_frags(heads) * 16 + (stream_rows * heads + stream_warps * stream_keys * (heads + 1)) * int(sizeof(float)) +
           stream_rows * int(sizeof(scale_range));
  }
};

//! Two E2M1 codes (one byte, element 0 in the low nibble) times scale value s, as F::dequantize
//! rounds them, packed as bf16x2: the path for block scales whose products could leave bf16's
//! normal range (codes below 8 or above 250, and the NaN code).
template <class F>
DSV4_DEVICE std::uint32_t dequantize_pair_slow(std::uint32_t byte, float s) {
  return std::uint32_t(numerics::fast_dequantize<F>(std::uint8_t(byte & 0xF), s).bits) |
         std::uint32_t(numerics::fast_dequantize<F>(std::uint8_t((byte >> 4) & 0xF), s).bits) << 16;
}

//! A warp's packed bits of one tile's keys for one row (lane (gid, quad): key 8j + gid of n-tile
//! j, the quad-th word of each block and the scale words), loaded a work item ahead of their use.
template <int Dim>
struct stream_key_bits {
  static constexpr int blocks = Dim / 32, scale_words = (Dim / 32 + 3) / 4;
  std::uint32_t words[2][blocks];
  std::uint32_t scales[2][scale_words];
};

//! The MMA B fragments of stream_key_bits: per block b, k-steps 2b (channels 32b + 8 quad + 0..3)
//! and 2b + 1 (+4..7), each element times its block scale as F::dequantize rounds it.
template <int Dim>
DSV4_DEVICE void stream_key_fragments(const stream_key_bits<Dim>& bits, std::uint32_t (&kf)[2][Dim / 16][2]) {
  using F = numerics::index_key_format;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int b = 0; b < Dim / 32; ++b) {
      const std::uint32_t w = bits.words[j][b], code = (bits.scales[j][b / 4] >> (8 * (b % 4))) & 0xFFu;
      std::uint32_t lo01, lo23, hi01, hi23;
      numerics::e2m1x4_to_bf16x4(w & 0xFFFFu, lo01, lo23);
      numerics::e2m1x4_to_bf16x4(w >> 16, hi01, hi23);
      if (code >= 8 && code <= 250) {  // every product a normal bf16: exact, as dequantize's rounding
        const std::uint32_t s2 = code << 7 | code << 23;  // bf16x2 of 2^(code - 127)
        kf[j][2 * b][0] = numerics::bf16x2_mul(lo01, s2), kf[j][2 * b][1] = numerics::bf16x2_mul(lo23, s2);
        kf[j][2 * b + 1][0] = numerics::bf16x2_mul(hi01, s2), kf[j][2 * b + 1][1] = numerics::bf16x2_mul(hi23, s2);
      } else {
        const float sv = numerics::decode<typename F::scale>(std::uint8_t(code));
        kf[j][2 * b][0] = dequantize_pair_slow<F>(w, sv), kf[j][2 * b][1] = dequantize_pair_slow<F>(w >> 8, sv);
        kf[j][2 * b + 1][0] = dequantize_pair_slow<F>(w >> 16, sv);
        kf[j][2 * b + 1][1] = dequantize_pair_slow<F>(w >> 24, sv);
      }
    }
}

//! The scale range of a warp's tile of keys (every lane's two keys; keys not loaded hold code 127),
//! the same in every lane.
template <int Dim>
DSV4_DEVICE scale_range stream_key_scale_range(const stream_key_bits<Dim>& bits) {
  int spread = 0, lo = 255, hi = 0;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    int kl = 255, kh = 0;
#pragma unroll
    for (int b = 0; b < Dim / 32; ++b) {
      const int code = int((bits.scales[j][b / 4] >> (8 * (b % 4))) & 0xFFu);
      kl = min(kl, code), kh = max(kh, code);
    }
    spread = max(spread, kh - kl), lo = min(lo, kl), hi = max(hi, kh);
  }
  return {int(__reduce_max_sync(0xFFFFFFFFu, unsigned(spread))), int(__reduce_min_sync(0xFFFFFFFFu, unsigned(lo))),
          int(__reduce_max_sync(0xFFFFFFFFu, unsigned(hi)))};
}

//! Work items are (tile, row) pairs, rows inner; each warp walks its own tiles. An item whose row
//! sees none of the tile is written -inf on the way; an item whose keys are not already in the
//! fragments (a new tile, another sequence's pages, a gathered row) has them loaded while the
//! item before it is computed, so a warp waits for memory only at its first item.
template <int Dim>
DSV4_KERNEL void __launch_bounds__(stream_warps * 32, 4) index_scan_streamed_kernel(index_scan_args a,
                                                                                    const std::int32_t* positions) {
  constexpr int kSteps = Dim / 16;
  runtime::start_after_previous_grid();
  extern __shared__ __align__(16) unsigned char stream_smem_raw[];
  const int heads = a.heads, head_tiles = (heads + 15) / 16, tstride = heads + 1;
  uint4* q_f = reinterpret_cast<uint4*>(stream_smem_raw);
  float* w_s = reinterpret_cast<float*>(q_f + stream_smem<Dim>::q_frags(heads));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, quad = lane % 4;
  float* terms = w_s + stream_rows * heads + warp * stream_keys * tstride;
  scale_range* q_range = reinterpret_cast<scale_range*>(w_s + stream_rows * heads + stream_warps * stream_keys * tstride);
  const int row0 = int(blockIdx.y) * stream_rows, nrows = min(a.rows - row0, stream_rows);

  // The rows' queries in fragment order: lane (gid, quad) of k-step s = 2b + half holds heads gid
  // and gid + 8 of its head tile at channels c, c + 1 (a0, a1) and c + 2, c + 3 (a2, a3), c = 32b +
  // 8 quad + 4 half. Padding heads are zero.
  for (int i = threadIdx.x; i < nrows * head_tiles * kSteps * 32; i += blockDim.x) {
    const int l = i % 32, s = (i / 32) % kSteps, ht = (i / 32 / kSteps) % head_tiles, r = i / 32 / kSteps / head_tiles;
    const int c = 32 * (s / 2) + 8 * (l % 4) + 4 * (s % 2), h0 = ht * 16 + l / 4, h1 = h0 + 8;
    const bf16* q = a.q + static_cast<long long>(row0 + r) * heads * Dim;
    auto pair = [&](int h, int ch) -> std::uint32_t {
      return h < heads ? *reinterpret_cast<const std::uint32_t*>(q + h * Dim + ch) : 0u;
    };
    q_f[i] = make_uint4(pair(h0, c), pair(h1, c), pair(h0, c + 2), pair(h1, c + 2));
  }
  for (int i = threadIdx.x; i < nrows * heads; i += blockDim.x)
    w_s[i] = a.w[static_cast<long long>(row0) * heads + i].to_float();
  // Each row's query scale range (one_accumulator_exact): a thread per (row, head) finds the
  // exponent field of each block's largest magnitude (16-byte loads: eight channels each), then
  // shared-memory atomics per row.
  if (threadIdx.x < stream_rows) q_range[threadIdx.x] = scale_range{};
  __syncthreads();
  for (int i = threadIdx.x; i < nrows * heads; i += blockDim.x) {
    const auto* q = reinterpret_cast<const uint4*>(a.q + (static_cast<long long>(row0) * heads + i) * Dim);
    int hl = 255, hh = 0;
    for (int b = 0; b < Dim / 32; ++b) {
      unsigned m = 0;  // the largest |bf16| bits of the block: max over the halves of each word
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const uint4 u = q[4 * b + v];
        for (const unsigned word : {u.x, u.y, u.z, u.w}) m = max(m, max(word & 0x7FFFu, (word >> 16) & 0x7FFFu));
      }
      if (m == 0) continue;  // a block of zeros adds exact zeros
      const int e = int(m >> 7);
      hl = min(hl, e), hh = max(hh, e);
    }
    scale_range& rr = q_range[i / heads];
    atomicMax(&rr.spread, hh >= hl ? hh - hl : 0), atomicMin(&rr.lo, hl), atomicMax(&rr.hi, hh);
  }
  __syncthreads();

  auto key_source = [&](int row) { return scan_key_source(a, positions, row); };
  auto position = [&](int row, long long t) { return scan_position(a, positions, row, t); };
  const bf16 neg_inf = bf16::from_bits(0xFF80);
  const long long tiles = (a.n_keys + stream_keys - 1) / stream_keys, stride = static_cast<long long>(gridDim.x) * stream_warps;

  // Issues the loads of row r's keys in `tile` (those any later row of its source can see; the
  // others are zero).
  auto fetch = [&](long long tile, int r, stream_key_bits<Dim>& bits) {
    const int row = row0 + r;
    const long long source = key_source(row);
    long long limit = a.visible[row];
    if (!positions)
      for (int r2 = r + 1; r2 < nrows; ++r2)
        if (key_source(row0 + r2) == source) limit = max(limit, a.visible[row0 + r2]);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const long long t = tile * stream_keys + 8 * j + gid;
      const long long pos = t < a.n_keys ? position(row, t) : -1;
#pragma unroll
      for (int b = 0; b < stream_key_bits<Dim>::blocks; ++b) bits.words[j][b] = 0;
#pragma unroll
      for (int i = 0; i < stream_key_bits<Dim>::scale_words; ++i) bits.scales[j][i] = 0x7F7F7F7Fu;  // 2^0: zeros stay zero
      if (pos >= 0 && pos < limit) {
        const auto* p = reinterpret_cast<const std::uint32_t*>(a.key(row, pos));
#pragma unroll
        for (int b = 0; b < stream_key_bits<Dim>::blocks; ++b) bits.words[j][b] = __ldg(p + 4 * b + quad);
#pragma unroll
        for (int i = 0; i < stream_key_bits<Dim>::scale_words; ++i) bits.scales[j][i] = __ldg(p + Dim / 8 + i);
      }
    }
  };
  // The work item after (tile, r), skipping (and writing -inf for) rows that see none of their
  // tile; `need_load`: its keys are not those of the fragments, whose source is `loaded` (-2: a
  // new tile). tile >= tiles: no more items.
  auto advance = [&](long long& tile, int& r, long long& loaded, bool& need_load) {
    for (;;) {
      if (++r >= nrows) r = 0, tile += stride, loaded = -2;
      if (tile >= tiles) return;
      const int row = row0 + r;
      const long long key0 = tile * stream_keys;
      if (!positions && key0 >= a.visible[row]) {
        if (lane < stream_keys && key0 + lane < a.n_keys) a.scores[static_cast<long long>(row) * a.n_keys + key0 + lane] = neg_inf;
        continue;
      }
      need_load = positions || key_source(row) != loaded;
      if (need_load) loaded = key_source(row);
      return;
    }
  };

  std::uint32_t kf[2][kSteps][2];  // B fragments of the current item's keys
  scale_range k_range;             // and their scale range
  stream_key_bits<Dim> next_bits;
  long long tile = static_cast<long long>(blockIdx.x) * stream_warps + warp - stride, loaded = -2;
  int r = nrows - 1;
  bool need_load = false;
  advance(tile, r, loaded, need_load);  // the warp's first item
  if (tile < tiles) {
    fetch(tile, r, next_bits);
    stream_key_fragments<Dim>(next_bits, kf);
    k_range = stream_key_scale_range<Dim>(next_bits);
  }
  while (tile < tiles) {
    long long next_tile = tile, next_loaded = loaded;
    int next_r = r;
    bool next_load = false;
    advance(next_tile, next_r, next_loaded, next_load);
    if (next_tile < tiles && next_load) fetch(next_tile, next_r, next_bits);  // in flight while this item computes

    const int row = row0 + r;
    const long long key0 = tile * stream_keys, visible = a.visible[row];
    const uint4* qr = q_f + r * head_tiles * kSteps * 32;
    const float* wr = w_s + r * heads;
    // Accumulator elements (i, i + 1) are one head's terms for keys 2 quad and 2 quad + 1.
    auto write_terms = [&](int ht, const auto& acc) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 4; i += 2) {
          const int h = ht * 16 + gid + 8 * (i / 2), key = 8 * j + 2 * quad;
          if (h >= heads) continue;
          const float2 t = index_term_pair(acc[j][i], acc[j][i + 1], wr[h], wr[h]);
          terms[key * tstride + h] = t.x;
          terms[(key + 1) * tstride + h] = t.y;
        }
    };
    auto mma_step = [&](int ht, int step, float (&acc)[2][4]) {
      const uint4 f = qr[(ht * kSteps + step) * 32 + lane];
      const std::uint32_t qa[4] = {f.x, f.y, f.z, f.w};
      tensor_core::mma_bf16(acc[0], qa, kf[0][step][0], kf[0][step][1]);
      tensor_core::mma_bf16(acc[1], qa, kf[1][step][0], kf[1][step][1]);
    };
    if (one_accumulator_exact<Dim>(q_range[r], k_range)) {  // warp-uniform
      for (int ht = 0; ht < head_tiles; ++ht) {
        float acc[2][4] = {};
#pragma unroll
        for (int step = 0; step < kSteps; ++step) mma_step(ht, step, acc);
        write_terms(ht, acc);
      }
    } else {
      for (int ht = 0; ht < head_tiles; ++ht) {
        double acc[2][4] = {};
#pragma unroll
        for (int b = 0; b < Dim / 32; ++b) {
          float part[2][4] = {};
          mma_step(ht, 2 * b, part), mma_step(ht, 2 * b + 1, part);
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][i] += double(part[j][i]);
        }
        write_terms(ht, acc);
      }
    }
    __syncwarp();
    if (lane < stream_keys && key0 + lane < a.n_keys) {
      const long long pos = position(row, key0 + lane);
      bf16* out = a.scores + static_cast<long long>(row) * a.n_keys + key0 + lane;
      if (pos < 0 || pos >= visible) {
        *out = neg_inf;
      } else {
        // fp32, heads in order (as the host reference); eight loads in flight before their adds.
        const float* t = terms + lane * tstride;
        float sum = 0.0f;
        int h = 0;
        for (; h + 8 <= heads; h += 8) {
          float v[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] = t[h + i];
#pragma unroll
          for (int i = 0; i < 8; ++i) sum += v[i];
        }
        for (; h < heads; ++h) sum += t[h];
        *out = bf16::from_float(sum);
      }
    }
    __syncwarp();  // the sums are read before the next item's terms overwrite them

    if (next_tile < tiles && next_load) {
      stream_key_fragments<Dim>(next_bits, kf);
      k_range = stream_key_scale_range<Dim>(next_bits);
    }
    tile = next_tile, r = next_r, loaded = next_loaded;
  }
}

//! bf16 bits -> 16-bit key in torch.topk's order (`numerics::topk_order_key_bf16`, shared with the
//! host reference): -inf lowest (0x007f), -0 below +0, every NaN above +inf and all NaNs equal
//! (0xffff). Scores from index_scan are never NaN or -0; the order matters for other inputs.
DSV4_DEVICE unsigned order_key(std::uint16_t b) { return numerics::topk_order_key_bf16(b); }

inline constexpr int topk_threads = 512;

//! The bucket holding the `need`-th largest key of a 256-bin histogram (bins scanned from 255
//! down; bin 0 takes whatever is left) and how many keys are still needed from it.
DSV4_DEVICE void find_bucket(const unsigned* hist, unsigned need, unsigned& bucket, unsigned& still_needed) {
  unsigned above = 0;
  int b = 255;
  for (; b > 0; --b) {
    if (above + hist[b] >= need) break;
    above += hist[b];
  }
  bucket = unsigned(b);
  still_needed = need - above;
}

//! Histogram of the keys of sc[begin, end) into per-warp bins: the high byte (select_hi false),
//! or the low byte of the keys whose high byte is `hi` (select_hi true). Reads 8 scores (16
//! bytes) per thread per step where the run is 16-byte aligned. Returns how many keys have a high
//! byte above `hi` (select_hi only).
template <int Threads>
DSV4_DEVICE unsigned histogram_keys(const std::uint16_t* sc, long long begin, long long end, bool select_hi,
                                    unsigned hi, unsigned (*warp_hist)[256]) {
  const int warp = threadIdx.x / 32;
  unsigned above = 0;
  auto count = [&](unsigned key) {
    if (!select_hi) atomicAdd(&warp_hist[warp][key >> 8], 1u);
    else if ((key >> 8) == hi) atomicAdd(&warp_hist[warp][key & 0xFF], 1u);
    else above += (key >> 8) > hi;
  };
  const bool vec = reinterpret_cast<std::uintptr_t>(sc + begin) % 16 == 0;
  const long long nvec = vec ? (end - begin) / 8 : 0;
  for (long long v = threadIdx.x; v < nvec; v += Threads) {
    const uint4 w = *reinterpret_cast<const uint4*>(sc + begin + v * 8);
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
    for (int j = 0; j < 8; ++j) count(order_key(std::uint16_t(words[j / 2] >> (16 * (j % 2)))));
  }
  for (long long i = begin + nvec * 8 + threadIdx.x; i < end; i += Threads) count(order_key(sc[i]));
  return above;
}

//! out[b] = the per-warp bins' sum for bin b (thread b of the block, strided).
template <int Warps>
DSV4_DEVICE void sum_warp_bins(const unsigned (*warp_hist)[256], unsigned* out) {
  for (int b = threadIdx.x; b < 256; b += blockDim.x) {
    unsigned total = 0;
    for (int w = 0; w < Warps; ++w) total += warp_hist[w][b];
    out[b] = total;
  }
}

//! The ordered pass over sc[begin, end): keeps every key > T and the keys == T whose rank among
//! equal keys (from `eq_base` at `begin`) is below need_eq, writing them in ascending index order
//! from out[base]. Each thread owns `items` consecutive indices of a tile, so a block prefix sum
//! of per-thread counts places every selected index.
template <int Threads>
DSV4_DEVICE void ordered_take(const topk_args& a, int row, const std::uint16_t* sc, long long begin, long long end,
                              unsigned T, unsigned need_eq, int base, int eq_base,
                              typename cub::BlockScan<int, Threads>::TempStorage& scan_storage) {
  using scan_t = cub::BlockScan<int, Threads>;
  constexpr int items = 16;
  std::int32_t* out = a.out + static_cast<long long>(row) * a.k;
  const long long vis = a.visible ? a.visible[row] : a.n;
  for (long long start = begin; start < end; start += static_cast<long long>(Threads) * items) {
    const long long first = start + static_cast<long long>(threadIdx.x) * items;
    unsigned keys[items];
    int n_eq = 0, n_gt = 0;
#pragma unroll
    for (int j = 0; j < items; ++j) {
      const bool valid = first + j < end;
      keys[j] = valid ? order_key(sc[first + j]) : 0u;
      n_eq += (valid && keys[j] == T) ? 1 : 0;
      n_gt += (valid && keys[j] > T) ? 1 : 0;
    }
    int eq_before, eq_total;
    scan_t(scan_storage).ExclusiveSum(n_eq, eq_before, eq_total);
    __syncthreads();
    // Equal keys this thread may take: those whose rank among equals is below need_eq.
    const int eq_rank0 = eq_base + eq_before;
    const int eq_take = max(0, min(n_eq, int(need_eq) - eq_rank0));
    int pos, total;
    scan_t(scan_storage).ExclusiveSum(n_gt + eq_take, pos, total);
    __syncthreads();
    int out_pos = base + pos, eq_seen = 0;
#pragma unroll
    for (int j = 0; j < items; ++j) {
      const long long i = first + j;
      if (i >= end) break;
      bool take = keys[j] > T;
      if (keys[j] == T) take = eq_seen++ < eq_take;
      if (take) {
        const long long p = a.positions ? a.positions[static_cast<long long>(row) * a.n + i] : i;
        out[out_pos++] = (p >= 0 && p < vis) ? std::int32_t(p) + a.offset : -1;
      }
    }
    base += total;
    eq_base += eq_total;
  }
}

//! One CTA per row: two histogram passes find the k-th largest key T (high byte, then low byte)
//! and how many keys equal to T to take; the ordered pass writes the selection.
DSV4_KERNEL void __launch_bounds__(topk_threads) topk_kernel(topk_args a) {
  runtime::start_after_previous_grid();
  __shared__ typename cub::BlockScan<int, topk_threads>::TempStorage scan_storage;
  constexpr int warps = topk_threads / 32;
  __shared__ unsigned hist[256];
  __shared__ unsigned warp_hist[warps][256];  // per-warp bins: ties pile into one bin otherwise
  __shared__ unsigned s_hi, s_need_hi, s_threshold, s_need_eq;
  const int row = blockIdx.x;
  const std::uint16_t* sc = reinterpret_cast<const std::uint16_t*>(a.scores) + static_cast<long long>(row) * a.n;
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = threadIdx.x; i < warps * 256; i += blockDim.x) warp_hist[i / 256][i % 256] = 0;
    __syncthreads();
    histogram_keys<topk_threads>(sc, 0, a.n, pass == 1, pass == 0 ? 0u : s_hi, warp_hist);
    __syncthreads();
    sum_warp_bins<warps>(warp_hist, hist);
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned bucket, rest;
      find_bucket(hist, pass == 0 ? unsigned(a.k) : s_need_hi, bucket, rest);
      if (pass == 0)
        s_hi = bucket, s_need_hi = rest;
      else
        s_threshold = (s_hi << 8) | bucket, s_need_eq = rest;
    }
    __syncthreads();
  }
  ordered_take<topk_threads>(a, row, sc, 0, a.n, s_threshold, s_need_eq, 0, 0, scan_storage);
}

//! Several CTAs per row (rows of topk_split_min_n scores and more, with scratch): the row is cut
//! into `slices` runs of whole 4,096-score tiles (as even as the tiles allow), one CTA each, and three launches compute what
//! topk_kernel computes: (1) each slice's histogram of high bytes; (2) every CTA of the row adds
//! them up in slice order and finds the high byte of the k-th largest key (topk_kernel's first
//! pass), then histograms its slice's low bytes under that high byte and counts its keys above
//! it; (3) every CTA adds those up into the threshold T and the number of keys equal to T to take
//! (the second pass), counts what the slices before its own keep (keys above T; keys equal to T,
//! which go lowest index first), and runs the ordered pass over its slice from there. Scratch:
//! per row and slice 256 + 256 + 1 words (high-byte bins, low-byte bins, keys above).
inline constexpr int topk_slice_threads = 256;
inline constexpr long long topk_tile = 16LL * topk_slice_threads;  // a slice thread's 16 items
inline constexpr long long topk_split_min_n = 32768;
inline constexpr int topk_max_slices = 64;  // each CTA re-reads every slice's bins: keep that short

struct topk_split {
  int slices = 1;
  long long tiles = 0;  // 4,096-score tiles of a row; slice j takes tiles [tiles j / slices, tiles (j + 1) / slices)
  DSV4_HOST_DEVICE long long begin(int j) const { return tiles * j / slices * topk_tile; }
};

//! About two CTAs per SM over all rows, at most topk_max_slices per row and one tile per slice.
inline topk_split plan_topk_split(int rows, long long n, int sms) {
  const long long tiles = (n + topk_tile - 1) / topk_tile;
  const long long want = std::max<long long>(1, 2LL * sms / std::max(rows, 1));
  return {int(std::max<long long>(1, std::min<long long>({tiles, want, topk_max_slices}))), tiles};
}

struct topk_split_scratch {
  unsigned* hi_bins;    // [rows, slices, 256]
  unsigned* lo_bins;    // [rows, slices, 256]
  unsigned* above_hi;   // [rows, slices]
  DSV4_HOST_DEVICE topk_split_scratch(unsigned* base, int rows, int slices)
      : hi_bins(base), lo_bins(base + std::size_t(rows) * slices * 256),
        above_hi(base + 2 * std::size_t(rows) * slices * 256) {}
};

//! Adds a row's per-slice bins up in slice order into hist[256] (thread b: bin b).
DSV4_DEVICE void sum_slice_bins(const unsigned* bins, int slices, unsigned* hist) {
  for (int b = threadIdx.x; b < 256; b += blockDim.x) {
    unsigned total = 0;
    for (int j = 0; j < slices; ++j) total += __ldcg(bins + std::size_t(j) * 256 + b);
    hist[b] = total;
  }
}

DSV4_KERNEL void __launch_bounds__(topk_slice_threads) topk_hi_kernel(topk_args a, topk_split sp) {
  runtime::start_after_previous_grid();
  constexpr int warps = topk_slice_threads / 32;
  __shared__ unsigned warp_hist[warps][256];
  const int row = blockIdx.y, slice = blockIdx.x;
  const topk_split_scratch scr(a.scratch, a.rows, sp.slices);
  const std::uint16_t* sc = reinterpret_cast<const std::uint16_t*>(a.scores) + static_cast<long long>(row) * a.n;
  const long long begin = sp.begin(slice), end = min(a.n, sp.begin(slice + 1));
  for (int i = threadIdx.x; i < warps * 256; i += blockDim.x) warp_hist[i / 256][i % 256] = 0;
  __syncthreads();
  histogram_keys<topk_slice_threads>(sc, begin, end, false, 0u, warp_hist);
  __syncthreads();
  sum_warp_bins<warps>(warp_hist, scr.hi_bins + (std::size_t(row) * sp.slices + slice) * 256);
}

DSV4_KERNEL void __launch_bounds__(topk_slice_threads) topk_lo_kernel(topk_args a, topk_split sp) {
  runtime::start_after_previous_grid();
  constexpr int warps = topk_slice_threads / 32;
  __shared__ unsigned hist[256], warp_hist[warps][256], s_hi, s_above;
  const int row = blockIdx.y, slice = blockIdx.x;
  const topk_split_scratch scr(a.scratch, a.rows, sp.slices);
  const std::uint16_t* sc = reinterpret_cast<const std::uint16_t*>(a.scores) + static_cast<long long>(row) * a.n;
  const long long begin = sp.begin(slice), end = min(a.n, sp.begin(slice + 1));
  sum_slice_bins(scr.hi_bins + std::size_t(row) * sp.slices * 256, sp.slices, hist);
  for (int i = threadIdx.x; i < warps * 256; i += blockDim.x) warp_hist[i / 256][i % 256] = 0;
  if (threadIdx.x == 0) s_above = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned rest;
    find_bucket(hist, unsigned(a.k), s_hi, rest);
  }
  __syncthreads();
  const unsigned above = histogram_keys<topk_slice_threads>(sc, begin, end, true, s_hi, warp_hist);
  atomicAdd(&s_above, above);  // an integer count: the order of the additions does not matter
  __syncthreads();
  sum_warp_bins<warps>(warp_hist, scr.lo_bins + (std::size_t(row) * sp.slices + slice) * 256);
  if (threadIdx.x == 0) scr.above_hi[std::size_t(row) * sp.slices + slice] = s_above;
}

DSV4_KERNEL void __launch_bounds__(topk_slice_threads) topk_take_kernel(topk_args a, topk_split sp) {
  runtime::start_after_previous_grid();
  __shared__ typename cub::BlockScan<int, topk_slice_threads>::TempStorage scan_storage;
  __shared__ unsigned hist[256], before[256], s_threshold, s_need_eq;
  __shared__ int s_base, s_eq_base;
  const int row = blockIdx.y, slice = blockIdx.x;
  const topk_split_scratch scr(a.scratch, a.rows, sp.slices);
  const std::uint16_t* sc = reinterpret_cast<const std::uint16_t*>(a.scores) + static_cast<long long>(row) * a.n;
  const long long begin = sp.begin(slice), end = min(a.n, sp.begin(slice + 1));
  sum_slice_bins(scr.hi_bins + std::size_t(row) * sp.slices * 256, sp.slices, hist);
  __syncthreads();
  __shared__ unsigned s_hi, s_need_hi;
  if (threadIdx.x == 0) find_bucket(hist, unsigned(a.k), s_hi, s_need_hi);
  __syncthreads();
  // The row's low-byte bins (all slices) and those of the slices before this one.
  const unsigned* lo = scr.lo_bins + std::size_t(row) * sp.slices * 256;
  for (int b = threadIdx.x; b < 256; b += blockDim.x) {
    unsigned total = 0, prior = 0;
    for (int j = 0; j < sp.slices; ++j) {
      const unsigned v = __ldcg(lo + std::size_t(j) * 256 + b);
      total += v;
      prior += j < slice ? v : 0u;
    }
    hist[b] = total;
    before[b] = prior;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned low, need_eq;
    find_bucket(hist, s_need_hi, low, need_eq);
    // What the slices before this one keep: every key above T (a higher high byte, or the same
    // high byte and a higher low byte), and the first need_eq keys equal to T.
    unsigned above = 0;
    for (int j = 0; j < slice; ++j) above += __ldcg(scr.above_hi + std::size_t(row) * sp.slices + j);
    for (unsigned b = low + 1; b < 256; ++b) above += before[b];
    s_threshold = (s_hi << 8) | low;
    s_need_eq = need_eq;
    s_eq_base = int(before[low]);
    s_base = int(above) + int(min(before[low], need_eq));
  }
  __syncthreads();
  ordered_take<topk_slice_threads>(a, row, sc, begin, end, s_threshold, s_need_eq, s_base, s_eq_base, scan_storage);
}

//! Block maxima of one row's scores, the newest visible block forced to +inf.
DSV4_KERNEL void block_max_kernel(candidate_args a) {
  runtime::start_after_previous_grid();
  const long long blocks = (a.n + a.block - 1) / a.block;
  const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int row = blockIdx.y;
  if (t >= blocks) return;
  const std::uint16_t* sc = reinterpret_cast<const std::uint16_t*>(a.scores) + static_cast<long long>(row) * a.n;
  unsigned best = 0;  // order keys: 0 is below -inf's key
  std::uint16_t best_bits = 0xFF80;
  for (long long i = t * a.block; i < min(a.n, (t + 1) * a.block); ++i) {
    const unsigned k = order_key(sc[i]);
    if (k > best) {
      best = k;
      best_bits = sc[i];
    }
  }
  const long long vis = a.visible[row];
  if (vis > 0 && t == (vis - 1) / a.block) best_bits = 0x7F80;  // +inf: always kept
  a.block_scores[static_cast<long long>(row) * blocks + t] = bf16::from_bits(best_bits);
}

//! Expands the selected blocks (ascending) into positions; blocks with a -inf maximum are holes.
DSV4_KERNEL void expand_blocks_kernel(candidate_args a, int kb) {
  runtime::start_after_previous_grid();
  const long long blocks = (a.n + a.block - 1) / a.block;
  const int row = blockIdx.y;
  const long long slot = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (slot >= static_cast<long long>(kb) * a.block) return;
  const int b = a.block_ids[static_cast<long long>(row) * kb + slot / a.block];
  const std::uint16_t bmax = a.block_scores[static_cast<long long>(row) * blocks + b].bits;
  const long long p = static_cast<long long>(b) * a.block + slot % a.block;
  a.positions[static_cast<long long>(row) * kb * a.block + slot] = (bmax == 0xFF80 || p >= a.n) ? -1 : std::int32_t(p);
}
}  // namespace detail

namespace detail {
//! The scan kernel a call runs. `automatic`: the streamed one, faster than the tiled one at every
//! shape bench_indexer measures (1 to 64 decode rows over 128K and 1M keys, gathered Reindex rows,
//! a 4,096-row causal prefill; docs/perf.md, thirty-second session). The tiled kernel stays as
//! the benchmark's baseline and the tests' second implementation.
inline scan_method plan_index_scan(scan_method asked) {
  return asked == scan_method::automatic ? scan_method::streamed : asked;
}

//! Checks and launches the scan; `positions` (null for a plain scan) lists the keys to score.
template <int Dim>
void launch_index_scan(const char* op, const index_scan_args& a, const std::int32_t* positions, bool gathered,
                       cudaStream_t stream) {
  static_assert(Dim % 32 == 0, "index_scan<Dim>: Dim must be a multiple of the MXFP4 block (32)");
  const std::string name(op);
  if (a.rows < 0 || a.n_keys < 0 || a.heads <= 0 || a.heads > max_index_heads)
    throw error(name + ": need rows, n_keys >= 0 and 0 < heads <= 64 (got heads " + std::to_string(a.heads) + ")");
  if (a.rows == 0 || a.n_keys == 0) return;
  if (a.rows > 65535LL * scan_rows)
    throw error(name + ": at most " + std::to_string(65535 * scan_rows) + " query rows per launch (grid y); split the rows");
  if (!a.q || !a.w || !a.keys || !a.scores || !a.visible || (gathered && !positions))
    throw error(name + ": null pointer argument");
  if (reinterpret_cast<std::uintptr_t>(a.q) % 16)
    throw error(name + ": the queries must be 16-byte aligned (rows are read 8 values at a time)");
  if (a.key_stride % 4 || reinterpret_cast<std::uintptr_t>(a.keys) % 4)
    throw error(name + ": keys must be 4-byte aligned with a stride that is a multiple of 4 bytes");
  if (a.block_tables && (a.max_pages <= 0 || a.entries_per_page <= 0 || a.page_bytes % 4))
    throw error(name + ": paged keys need max_pages > 0, entries_per_page > 0 and page_bytes a multiple of 4");
  if ((a.n_keys + scan_keys - 1) / scan_keys > 0x7FFFFFFFLL)
    throw error(name + ": too many keys for one launch (grid x)");
  if (plan_index_scan(a.method) == scan_method::tiled) {
    const int smem = scan_smem<Dim>::bytes(a.heads);
    auto kernel = index_scan_kernel<Dim>;
    DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const dim3 grid(unsigned((a.n_keys + scan_keys - 1) / scan_keys), unsigned((a.rows + scan_rows - 1) / scan_rows));
    runtime::launch_programmatic(kernel, grid, dim3(scan_threads), std::size_t(smem), stream, a, positions);
    DSV4_CUDA_CHECK_LAUNCH();
    return;
  }
  // Streamed: as many CTAs as fit on the GPU at once, shared out over the row groups; each CTA's
  // warps stride over the key tiles. The shared-memory opt-in and the occupancy are asked once
  // per device (and head count): host calls that cost microseconds, as much as a decode row's scan.
  const int smem = stream_smem<Dim>::bytes(a.heads);
  auto kernel = index_scan_streamed_kernel<Dim>;
  static runtime::per_device_ints ctas_per_sm[max_index_heads + 1] = {};
  static runtime::per_device_ints opted_in = {};
  runtime::cached_per_device(opted_in, [&](int) {  // the most any head count needs
    DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         stream_smem<Dim>::bytes(max_index_heads)));
    return 1;
  });
  const int per_sm = runtime::cached_per_device(ctas_per_sm[a.heads], [&](int) {
    int n = 0;
    DSV4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, stream_warps * 32, std::size_t(smem)));
    return n;
  });
  const long long groups = (a.rows + stream_rows - 1) / stream_rows;
  const long long ctas_for_keys = (a.n_keys + stream_keys * stream_warps - 1) / (stream_keys * stream_warps);
  const long long resident = static_cast<long long>(std::max(per_sm, 1)) * runtime::sm_count();
  const long long x = std::clamp<long long>(resident / groups, 1, ctas_for_keys);
  runtime::launch_programmatic(kernel, dim3(unsigned(x), unsigned(groups)), dim3(stream_warps * 32), std::size_t(smem),
                               stream, a, positions);
  DSV4_CUDA_CHECK_LAUNCH();
}
}  // namespace detail

//! Scores every key [0, n_keys) for each query row.
template <int Dim>
void index_scan(const index_scan_args& a, cudaStream_t stream = nullptr) {
  detail::launch_index_scan<Dim>("index_scan", a, nullptr, false, stream);
}

//! Scores only the listed key positions (a Reindex layer inside its candidate pool).
template <int Dim>
void index_scan_gathered(const gathered_scan_args& g, cudaStream_t stream = nullptr) {
  detail::launch_index_scan<Dim>("index_scan_gathered", g.scan, g.positions, true, stream);
}

inline void select_topk(const topk_args& a, cudaStream_t stream = nullptr);

//! Builds the candidate position lists (three launches: block maxima, top blocks, expansion).
//! Returns the number of positions per row, min(topk_blocks, blocks) x block.
inline long long candidate_pool(const candidate_args& a, cudaStream_t stream = nullptr) {
  if (a.rows < 0 || a.n < 0 || a.block <= 0 || a.topk_blocks <= 0)
    throw error("candidate_pool: need rows, n >= 0 and positive block and topk_blocks");
  const long long blocks = (a.n + a.block - 1) / a.block;
  const int kb = int(std::min<long long>(a.topk_blocks, blocks));
  if (a.rows == 0 || a.n == 0) return 0;
  if (a.rows > 65535) throw error("candidate_pool: at most 65535 rows per launch (grid y); split the rows");
  if (!a.scores || !a.visible || !a.block_scores || !a.block_ids || !a.positions)
    throw error("candidate_pool: null pointer argument");
  runtime::launch_programmatic(detail::block_max_kernel, dim3(unsigned((blocks + 255) / 256), unsigned(a.rows)), dim3(256), 0,
                               stream, a);
  DSV4_CUDA_CHECK_LAUNCH();
  // Visible = all blocks: the expansion, not the selection, turns unusable blocks into holes.
  // The visible counts must live on the device; the block count is the same for every row.
  topk_args t;
  t.scores = a.block_scores;
  t.n = blocks;
  t.rows = a.rows;
  t.k = kb;
  t.visible = nullptr;  // all columns count as visible
  t.offset = 0;
  t.out = a.block_ids;
  select_topk(t, stream);
  runtime::launch_programmatic(detail::expand_blocks_kernel,
                               dim3(unsigned((static_cast<long long>(kb) * a.block + 255) / 256), unsigned(a.rows)), dim3(256),
                               0, stream, a, kb);
  DSV4_CUDA_CHECK_LAUNCH();
  return static_cast<long long>(kb) * a.block;
}

//! Selects min(k, n) indices per row; `a.k` must already be min(topk, n). With `visible` null,
//! every column counts as visible.
inline void select_topk(const topk_args& a, cudaStream_t stream) {
  if (a.rows < 0 || a.n < 0 || a.k < 0 || a.k > a.n)
    throw error("select_topk: need rows >= 0 and 0 <= k <= n (got k " + std::to_string(a.k) + ", n " +
                std::to_string(a.n) + ")");
  if (a.rows == 0 || a.k == 0) return;
  if (!a.scores || !a.out) throw error("select_topk: null pointer argument");
  const auto split = detail::plan_topk_split(a.rows, a.n, runtime::sm_count());
  const bool several = a.scratch && a.n >= detail::topk_split_min_n && split.slices > 1 && a.rows <= 65535 &&
                       a.scratch_words >= std::size_t(a.rows) * std::size_t(split.slices) * (2 * 256 + 1);
  if (!several) {
    runtime::launch_programmatic(detail::topk_kernel, dim3(unsigned(a.rows)), dim3(detail::topk_threads), 0, stream, a);
    DSV4_CUDA_CHECK_LAUNCH();
    return;
  }
  const dim3 grid(unsigned(split.slices), unsigned(a.rows)), block(detail::topk_slice_threads);
  for (auto kernel : {detail::topk_hi_kernel, detail::topk_lo_kernel, detail::topk_take_kernel}) {
    runtime::launch_programmatic(kernel, grid, block, 0, stream, a, split);
    DSV4_CUDA_CHECK_LAUNCH();
  }
}

//! Scratch words select_topk needs to take rows of up to `n` scores with several CTAs each.
inline std::size_t topk_scratch_words(int rows, long long n) {
  if (rows <= 0 || n < detail::topk_split_min_n) return 0;
  const long long tiles = (n + detail::topk_tile - 1) / detail::topk_tile;
  return std::size_t(rows) * std::size_t(std::min<long long>(tiles, detail::topk_max_slices)) * (2 * 256 + 1);
}

}  // namespace dsv4::kernels::indexer
