#pragma once
//! \file
//! CUDA block-scaled GEMMs (spec §3 `fp8_gemm`, `fp4_gemm`): C[M, N] = A[M, K] W[N, K]^T with A in
//! E4M3 plus one UE8M0 scale per 32 activations, W either E4M3 with one UE8M0 scale per 32 x 32
//! tile or packed E2M1 with one UE8M0 scale per 32 along K; bf16 out. Weights are in the MMA-tile
//! layout of weight_tiles.hpp (tile_weight repacks a checkpoint weight). Host reference:
//! reference.hpp (checkpoint layout).
//!
//! Method (measured in bench/bench_gemm.cu, docs/perf.md; reasons in docs/decisions.md):
//! - Tensor cores through the m16n8k32 E4M3 x E4M3 -> fp32 product (on sm_90 two f16 MMAs, see
//!   `mma_e4m3`). One product covers exactly one 32-wide K block, so every block's dot product
//!   comes out of the tensor core on its own and is scaled and added to an fp32 accumulator in
//!   increasing K order, as the reference does (the sum inside a block is the tensor core's, as
//!   in the official kernel).
//! - The MMA runs "swapped": the weight rows are the MMA's M side (16 per fragment) and the
//!   tokens its N side (8 per fragment), so a decode step with one token wastes no weight bytes.
//!   Both operands are read straight from global memory into registers: inside each 32-block the
//!   K positions are permuted identically for both operands (thread t of a quad takes the 8
//!   consecutive elements 8t..8t+7), which leaves each block's dot product unchanged and makes
//!   an activation fragment one 8-byte load and a weight fragment one 16-byte (FP4: 8-byte) load
//!   from a contiguous 512-byte (256) run per warp.
//! - sm_90 has no FP8 mma.sync (Hopper's FP8 tensor cores are wgmma's): the m16n8k32 E4M3 product
//!   is two f16 m16n8k16 MMAs on exactly converted operands, written out here (`mma_e4m3`).
//! - FP4 weights go straight to f16 in registers, each value times 2^-14 (a mask or two and a
//!   shift or two per pair of codes, from a lane word laid out for it: weight_tiles.hpp), which is
//!   exact, as are the products; the block sum is scaled back by 2^14 (`fp4_f16_fragment`).
//! - Decode shapes (few tokens, weights streamed once) split K across CTAs so that every SM
//!   streams; the last CTA of each output tile to finish sums the slices' fp32 partials in slice
//!   order (deterministic; the order differs from the reference's by a few fp32 ulp), so one
//!   launch does it all.
//! - Each block's partial is scaled and accumulated with one FMA by the product of the two
//!   power-of-two scales (exact; see the kernel), so the fp32 pipe keeps up with the MMAs.
//! - Launched programmatically (runtime/pdl.cuh): a GEMM starts while the kernel before it (the
//!   activation quantizer) finishes, and requests its first weights before waiting for it.

#include <cuda_runtime.h>  // provides cudaStream_t, uint2

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "dsv4/core/error.hpp"
#include "dsv4/core/process_switch.hpp"
#include "dsv4/kernels/gemm/reference.hpp"
#include "dsv4/kernels/gemm/weight_tiles.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/bits.hpp"
#include "dsv4/numerics/minifloat.hpp"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "dsv4/runtime/device_info.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::gemm {

struct block_scaled_gemm_args {
  gemm_shape shape;                    //!< m tokens, n output features, k input features
  const std::uint8_t* a = nullptr;     //!< [M, K] E4M3 codes, rows contiguous
  const std::uint8_t* a_s = nullptr;   //!< [M, K/32] UE8M0 codes
  const std::uint8_t* w = nullptr;     //!< weight codes, MMA-tile layout (weight_tiles.hpp)
  const std::uint8_t* w_s = nullptr;   //!< weight scales, MMA-tile layout (weight_tiles.hpp)
  numerics::bf16* c = nullptr;         //!< [M, N] bf16 out
  //! Optional: [M, K] A's codes as f16 bits (numerics::quantize_args::codes_f16). Only the
  //! streamed grouped GEMM reads it (its B operand then needs no conversion); the rest ignore it.
  const std::uint16_t* a_f16 = nullptr;
};

//! Scratch of the GEMMs. For split-K: fp32 partials of the K slices and one arrival counter per
//! output tile; the counters start at zero (the constructor clears them) and every GEMM leaves
//! them at zero, so one workspace serves any number of GEMMs on one stream, one at a time. For
//! the prefill path (dequant_gemm.cuh): bf16 copies of the dequantized operands; for the folded
//! kernel (folded_gemm.cuh): the decoded activations.
class gemm_workspace {
 public:
  static constexpr std::size_t max_tiles = 8192;
  //! `folded_bytes`: the folded kernel's decoded activations (folded_gemm.cuh, folded_bytes_for).
  explicit gemm_workspace(std::size_t partial_floats = std::size_t(1) << 22, std::size_t dequant_elems = 0,
                          std::size_t folded_bytes = 0)
      : counters_(max_tiles),
        partials_(std::max<std::size_t>(1, partial_floats)),
        dequant_(dequant_elems),
        folded_(folded_bytes) {
    counters_.fill_bytes(0);
    // The memset runs on the legacy stream; a non-blocking stream is not ordered after it.
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  }
  unsigned* counters() { return counters_.data(); }
  float* partials() { return partials_.data(); }
  std::size_t partial_floats() const { return partials_.size(); }
  numerics::bf16* dequant() { return dequant_.data(); }
  std::size_t dequant_elems() const { return dequant_.size(); }
  std::uint8_t* folded() { return folded_.data(); }
  std::size_t folded_bytes() const { return folded_.size(); }

 private:
  runtime::device_buffer<unsigned> counters_;
  runtime::device_buffer<float> partials_;
  runtime::device_buffer<numerics::bf16> dequant_;
  runtime::device_buffer<std::uint8_t> folded_;
};

//! A grouped GEMM (the MoE's experts): a device-built list of tiles, each a run of at most
//! 8 x token_tiles rows of A and C that all use one group's weight. Groups' weights are
//! `w_group_bytes` (`ws_group_bytes` for scales) apart. Built by moe.cuh.
struct gemm_groups {
  const int* tile_group = nullptr;   //!< [max tiles] group (expert) of each tile; null: not grouped
  const int* tile_row0 = nullptr;    //!< [max tiles] first row of the tile in A / C
  const int* tile_rows = nullptr;    //!< [max tiles] rows in the tile
  const int* tile_count = nullptr;   //!< device scalar: tiles in use
  const int* a_row_index = nullptr;  //!< optional: A (and a_s) row of each C row
  long long w_group_bytes = 0, ws_group_bytes = 0;
  //! The tile list (tile_group, tile_row0, tile_rows, tile_count) was written two or more launches
  //! before this one on the stream (the MoE's w2: routing, then w1 + w3 and SwiGLU), so that a
  //! programmatic launch may read it, and start its weight stream, before waiting for the kernel
  //! just before it: every kernel waits for its predecessor before it lets its successor start
  //! (runtime/pdl.cuh), so a kernel that has started has a predecessor past its wait and everything
  //! older complete. Only the streamed kernel uses it (streamed_gemm.cuh).
  bool list_settled = false;
};

namespace detail {

inline constexpr int gemm_warps = 4;  // per CTA; each warp owns its own weight rows

//! Two E4M3 codes (bits 0..15 of `v` when `High` is false, else 16..31) -> f16x2, exact.
template <bool High>
DSV4_DEVICE std::uint32_t e4m3x2_to_f16x2(std::uint32_t v) {
  std::uint32_t out = 0;
#if DSV4_DEVICE_PASS
  const unsigned short half = static_cast<unsigned short>(High ? v >> 16 : v & 0xFFFFu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(out) : "h"(half));
#endif
  return out;
}

DSV4_DEVICE void mma_f16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
#if DSV4_DEVICE_PASS
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

//! An E4M3 A fragment as f16: converted once per weight fragment, it serves every token tile.
struct e4m3_fragment {
  std::uint32_t lo[4], hi[4];  // f16x2 of the low and the high byte pair of each register
  DSV4_DEVICE explicit e4m3_fragment(const std::uint32_t (&a)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) lo[i] = e4m3x2_to_f16x2<false>(a[i]), hi[i] = e4m3x2_to_f16x2<true>(a[i]);
  }
};

//! d = the m16n8k32 E4M3 product of one 32-wide K block, from zero. sm_90 has no FP8 mma.sync
//! (its FP8 tensor cores are wgmma's): ptxas lowers `mma.m16n8k32.e4m3` to exactly this, two
//! f16 MMAs over the low and the high byte pairs of every register (E4M3 -> f16 is exact, the
//! products are exact in fp32), and then adds the zero accumulator in one more instruction per
//! element. Written out, that addition (which only turns -0 into +0) is gone.
DSV4_DEVICE void mma_e4m3(const e4m3_fragment& a, std::uint32_t b0, std::uint32_t b1, float (&d)[4]) {
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  mma_f16(d, a.lo, e4m3x2_to_f16x2<false>(b0), e4m3x2_to_f16x2<false>(b1));
  mma_f16(d, a.hi, e4m3x2_to_f16x2<true>(b0), e4m3x2_to_f16x2<true>(b1));
}

//! f16x2 <- two f16 halves: `lo` in bits 0..15.
DSV4_DEVICE std::uint32_t pack_halves(std::uint32_t lo, std::uint32_t hi) {
  return __byte_perm(lo, hi, 0x5410);
}

//! A 16-row x 32-wide FP4 weight block of one lane as the A operands of two m16n8k16 f16 MMAs,
//! from the lane words of rows g and g + 8 (weight_tiles.hpp): every value times 2^-14
//! (fp4_f16_exponent_offset), exactly. `first` holds elements 0..3 of the lane's 8 (rows g and
//! g + 8), `second` elements 4..7; the B operands pair with them in the same order (mma_fp4_f16).
//! The pairing differs from e4m3_fragment's so that f16 activations load straight into B's
//! register pairs (no moves).
struct fp4_f16_fragment {
  std::uint32_t first[4], second[4];
  DSV4_DEVICE fp4_f16_fragment(std::uint32_t row_g, std::uint32_t row_g8) {
    std::uint32_t p[4], q[4];
    fp4_lane_word_to_f16x2(row_g, p);
    fp4_lane_word_to_f16x2(row_g8, q);
    first[0] = p[0], first[1] = q[0], first[2] = p[1], first[3] = q[1];
    second[0] = p[2], second[1] = q[2], second[2] = p[3], second[3] = q[3];
  }
};

//! d = the product of one 32-wide K block from zero, times 2^-14 (the fragment's offset), with
//! the B operand as f16 (`b`: the lane's 8 elements, pairs (0,1), (2,3), (4,5), (6,7)).
DSV4_DEVICE void mma_fp4_f16(const fp4_f16_fragment& a, const uint4& b, float (&d)[4]) {
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  mma_f16(d, a.first, b.x, b.y);
  mma_f16(d, a.second, b.z, b.w);
}
//! The same with B as E4M3 codes (`b.x` elements 0..3, `b.y` 4..7), converted here (exact).
DSV4_DEVICE void mma_fp4_f16(const fp4_f16_fragment& a, const uint2& b, float (&d)[4]) {
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  mma_f16(d, a.first, e4m3x2_to_f16x2<false>(b.x), e4m3x2_to_f16x2<true>(b.x));
  mma_f16(d, a.second, e4m3x2_to_f16x2<false>(b.y), e4m3x2_to_f16x2<true>(b.y));
}

//! One row's 8 FP4 codes of a lane word (weight_tiles.hpp) -> the E4M3 bytes of elements 0..3
//! (`lo`, byte i = element i) and 4..7 (`hi`), exact (every E2M1 value is an E4M3 value), for
//! the FP8 tensor cores of wgmma_gemm.cuh. Through the f16 values: times 2^14 (exact), then two
//! to E4M3 at a time. Costlier than the f16 route alone, which the decode kernels take; wgmma
//! runs at prefill-like token counts, where a conversion serves many tokens.
DSV4_DEVICE void fp4_lane_word_to_e4m3(std::uint32_t w, std::uint32_t& lo, std::uint32_t& hi) {
  std::uint32_t p[4], e[4] = {};
  fp4_lane_word_to_f16x2(w, p);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#if DSV4_DEVICE_PASS
    std::uint32_t scaled = 0;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(scaled) : "r"(p[j]), "r"(0x74007400u));  // 2^14 in both halves
    unsigned short pair = 0;
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;\n" : "=h"(pair) : "r"(scaled));
    e[j] = pair;
#else
    (void)p;
#endif
  }
  lo = pack_halves(e[0], e[1]);
  hi = pack_halves(e[2], e[3]);
}

using numerics::ue8m0_value;

//! The end of a split-K CTA whose slice's fp32 partials are written: releases them, takes a ticket
//! on the output tile's counter, and if it is the last slice to arrive sums the tile's partials
//! (`rows` x `toks` outputs from (row0, tok_base)) in slice order, so the result does not depend
//! on arrival order, writes them to C as bf16 and zeroes the counter for the next GEMM.
DSV4_DEVICE void finish_split_k(numerics::bf16* c, const float* partials, unsigned* counter, int slices, int M, int N,
                                int row0, int rows, int tok_base, int toks) {
  __threadfence();
  __syncthreads();
  __shared__ unsigned ticket;
  if (threadIdx.x == 0) ticket = atomicAdd(counter, 1u);
  __syncthreads();
  if (ticket != unsigned(slices - 1)) return;
  __threadfence();
  for (int idx = threadIdx.x; idx < rows * toks; idx += blockDim.x) {
    const int row = row0 + idx % rows, tok = tok_base + idx / rows;
    const long long at = (long long)tok * N + row;
    // Up to 16 partials in flight at a time, added in slice order (the first one starts the sum).
    float sum = 0.0f;
    for (int s0 = 0; s0 < slices; s0 += 16) {
      float buf[16];
#pragma unroll
      for (int u = 0; u < 16; ++u) buf[u] = s0 + u < slices ? __ldcg(partials + (long long)(s0 + u) * M * N + at) : 0.0f;
#pragma unroll
      for (int u = 0; u < 16; ++u)
        if (s0 + u < slices) sum = (s0 + u == 0) ? buf[u] : sum + buf[u];
    }
    c[at] = numerics::bf16::from_float(sum);
  }
  if (threadIdx.x == 0) *counter = 0;  // ready for the next GEMM
}

//! One CTA: gemm_warps warps x RowTiles x 16 weight rows, TokenTiles x 8 tokens, one K slice of
//! `kbps` blocks. Grid: x = token groups (fastest, so CTAs that share weights run together and
//! find them in L2), y = K slices, z = row groups. With one slice the CTA
//! writes bf16 to C. With several, each CTA writes its fp32 partial, and the last CTA of a tile
//! to arrive sums the slices in slice order (so the result does not depend on arrival order).
//! CTAs an SM each variant is compiled for (its register cap). Deeper stages (decode: 6 or 8 K
//! blocks, more weight bytes in flight a warp) are held to three CTAs an SM (6) or two (8). The
//! 4-block stages keep what they had with no minimum given (`__launch_bounds__(128)` alone,
//! before 17988c2): one token tile four CTAs an SM (115-124 registers), two or four token tiles
//! three (155-170; with K split across warps two, FP4's two token tiles three), eight two. An
//! explicit minimum of one (17988c2 .. 3d1ceb1) let ptxas take 125-134 registers at one token
//! tile, three CTAs an SM, so the plans of 9-128 tokens, which aim at three CTAs an SM and a bit
//! (wo_b: 400 CTAs), ran a second wave (found in the forty-sixth session by comparing ptxas -v
//! of both builds; every variant here has no spill beyond what it had before).
constexpr int min_ctas_for(int unroll, int token_tiles, int k_split, bool fp8) {
  if (token_tiles == 1) {
    if (unroll >= 8) return 2;
    return unroll >= 6 ? 3 : 4;
  }
  if (k_split > 1) return token_tiles == 2 && !fp8 ? 3 : 2;
  return token_tiles == 8 ? 2 : 3;
}
template <weight_format WF, int TokenTiles, int RowTiles, int Unroll, int KSplit>
DSV4_KERNEL void __launch_bounds__(gemm_warps * 32, min_ctas_for(Unroll, TokenTiles, KSplit, WF == weight_format::fp8_tile32))
    block_scaled_gemm_kernel(block_scaled_gemm_args g, gemm_groups groups, int kbps, int slices,
                             float* partials, unsigned* counters, block_scaled_gemm_args g_second,
                             unsigned second_z) {
  constexpr bool kFp8 = WF == weight_format::fp8_tile32;
  // KSplit warps share each row tile, each taking a contiguous part of the CTA's K range; their
  // sums are added in part order at the end (more warps per weight byte in flight at decode).
  static_assert(gemm_warps % KSplit == 0, "KSplit must divide the warps of a CTA");
  constexpr int kRowsPerCta = gemm_warps / KSplit * RowTiles * 16, kToksPerCta = TokenTiles * 8;
  constexpr int kTileBytes = tile_code_bytes(WF);
  // A pair of GEMMs in one launch (second_z > 0: the MoE's w1 and w3, the shared expert's, or the
  // attention's wq_a and wkv, one input): row groups from second_z on compute the second one (its
  // own N); split K, its partials follow the first's (slices x M x N1 later) and its counters are
  // those of its own z.
  unsigned z = blockIdx.z;
  if (second_z != 0 && z >= second_z) {
    if (partials) partials += (long long)slices * g.shape.m * g.shape.n;
    g.w = g_second.w, g.w_s = g_second.w_s, g.c = g_second.c, g.shape.n = g_second.shape.n, z -= second_z;
  }
  const int M = g.shape.m, N = g.shape.n, KB = g.shape.k / 32;
  const int row_tiles = (N + 15) / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, quad = lane % 4;
  const int rt_base = int(z * kRowsPerCta) / 16 + (warp / KSplit) * RowTiles;
  // Grouped (MoE): token group x is entry x of the tile list: one group's weights, a run of
  // rows of A and C (A's rows possibly through an index).
  int tok_base = blockIdx.x * kToksPerCta, tok_end = M;
  // Launched programmatically (runtime/pdl.cuh). A grouped GEMM's tile list comes from the
  // kernel before, so it waits first; a plain GEMM starts loading its weights, then waits.
  const bool grouped = groups.tile_group != nullptr;
  if (grouped) {
    runtime::start_after_previous_grid();
    if (int(blockIdx.x) >= *groups.tile_count) return;
    const int group = groups.tile_group[blockIdx.x];
    tok_base = groups.tile_row0[blockIdx.x];
    tok_end = tok_base + groups.tile_rows[blockIdx.x];
    g.w += group * groups.w_group_bytes;
    g.w_s += group * groups.ws_group_bytes;
  }
  auto a_index = [&](int r) { return groups.a_row_index ? groups.a_row_index[r] : r; };
  const int slice_begin = blockIdx.y * kbps, slice_end = min(KB, slice_begin + kbps);
  const int part = warp % KSplit, per_part = (slice_end - slice_begin + KSplit - 1) / KSplit;
  const int kb_begin = min(slice_end, slice_begin + part * per_part);
  const int kb_end = min(slice_end, kb_begin + per_part);

  // Per thread: rows gid and gid+8 of each of its row tiles (tiles past N are skipped), token gid
  // of each token tile for the B fragment, tokens 2q and 2q+1 for the C fragment's scales.
  bool tile_ok[RowTiles];
  const std::uint8_t* w_tile[RowTiles];
  const std::uint8_t* ws_row[RowTiles][2];
#pragma unroll
  for (int r = 0; r < RowTiles; ++r) {
    const int rt = rt_base + r;
    tile_ok[r] = rt < row_tiles;
    const int rts = tile_ok[r] ? rt : 0;
    w_tile[r] = g.w + (long long)rts * KB * kTileBytes + lane * (kTileBytes / 32);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = rts * 16 + gid + 8 * h;
      ws_row[r][h] = kFp8 ? g.w_s + (long long)(row / 32) * KB : g.w_s + (long long)rts * KB * 16 + gid + 8 * h;
    }
  }
  const std::uint8_t* a_row[TokenTiles];
  const std::uint8_t* as_row[TokenTiles][2];
  bool tok_ok[TokenTiles];
#pragma unroll
  for (int t = 0; t < TokenTiles; ++t) {
    const int tok = tok_base + t * 8 + gid;
    tok_ok[t] = tok < tok_end;
    a_row[t] = g.a + (long long)a_index(tok < tok_end ? tok : tok_base) * g.shape.k + quad * 8;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ct = tok_base + t * 8 + quad * 2 + h;
      as_row[t][h] = g.a_s + (long long)a_index(ct < tok_end ? ct : tok_base) * KB;
    }
  }
  const int ws_step = kFp8 ? 1 : 16;  // bytes between consecutive K blocks' scales of one row
  // An FP8 weight has one scale per 32 x 32 tile: rows g and g + 8 of a 16-row tile share it (16-row
  // tiles never straddle a 32-row tile), so it is loaded and decoded once. FP4: one per row.
  constexpr int kWScales = kFp8 ? 1 : 2;

  // The loads of Unroll blocks (codes and scales) form a stage; two stages alternate so that the
  // next stage's loads are in flight while the current one is multiplied.
  struct stage {
    std::uint32_t wf[Unroll][RowTiles][4];
    uint2 af[Unroll][TokenTiles];
    std::uint32_t wsc[Unroll][RowTiles][kWScales], asc[Unroll][TokenTiles][2];
  };
  // Weight codes and scales do not depend on the kernel before; activations and their scales do.
  auto load_weights = [&](stage& st, int kb0) {
#pragma unroll
    for (int u = 0; u < Unroll; ++u) {
      const int kb = kb0 + u;
      const bool ok = kb < kb_end;
#pragma unroll
      for (int r = 0; r < RowTiles; ++r) {
        const bool go = ok && tile_ok[r];
        if constexpr (kFp8) {
          const uint4 v = go ? __ldg(reinterpret_cast<const uint4*>(w_tile[r] + (long long)kb * kTileBytes))
                             : make_uint4(0, 0, 0, 0);
          // a0 = row g, elements 0..3; a1 = row g+8, 0..3; a2 = row g, 4..7; a3 = row g+8, 4..7.
          st.wf[u][r][0] = v.x, st.wf[u][r][2] = v.y, st.wf[u][r][1] = v.z, st.wf[u][r][3] = v.w;
        } else {
          const uint2 v = go ? __ldg(reinterpret_cast<const uint2*>(w_tile[r] + (long long)kb * kTileBytes))
                             : make_uint2(0, 0);
          st.wf[u][r][0] = v.x, st.wf[u][r][1] = v.y;
        }
#pragma unroll
        for (int h = 0; h < kWScales; ++h) st.wsc[u][r][h] = go ? __ldg(ws_row[r][h] + kb * ws_step) : 127u;
      }
    }
  };
  // The activations and their scales come from the kernel before: read only after waiting for it
  // (ordinary loads, as for any data another grid wrote while this one was resident).
  // `lean` (a CTA with one token, so only the fragments' even token columns matter; see below)
  // skips the odd columns' scales.
  auto load_activations = [&](stage& st, int kb0, auto lean) {
    constexpr int kTokScales = decltype(lean)::value ? 1 : 2;
#pragma unroll
    for (int u = 0; u < Unroll; ++u) {
      const int kb = kb0 + u;
      const bool ok = kb < kb_end;
#pragma unroll
      for (int t = 0; t < TokenTiles; ++t) {
        st.af[u][t] = ok && tok_ok[t] ? *reinterpret_cast<const uint2*>(a_row[t] + kb * 32) : make_uint2(0, 0);
#pragma unroll
        for (int h = 0; h < kTokScales; ++h) st.asc[u][t][h] = ok ? *(as_row[t][h] + kb) : 127u;
      }
    }
  };
  auto load = [&](stage& st, int kb0, auto lean) {
    load_weights(st, kb0);
    load_activations(st, kb0, lean);
  };
  float acc[RowTiles][TokenTiles][4] = {};
  auto multiply = [&](const stage& st, int kb0, auto lean) {
    constexpr bool kLean = decltype(lean)::value;
#pragma unroll
    for (int u = 0; u < Unroll; ++u) {
      if (kb0 + u >= kb_end) break;
      float as[TokenTiles][2];
#pragma unroll
      for (int t = 0; t < TokenTiles; ++t)
        as[t][0] = ue8m0_value(st.asc[u][t][0]), as[t][1] = kLean ? 0.0f : ue8m0_value(st.asc[u][t][kLean ? 0 : 1]);
#pragma unroll
      for (int r = 0; r < RowTiles; ++r) {
        const float ws0 = ue8m0_value(st.wsc[u][r][0]),
                    ws1 = kFp8 ? ws0 : ue8m0_value(st.wsc[u][r][kWScales - 1]);
        // acc += (d * a_scale) * w_scale of the reference, as one FMA with the product of the
        // two power-of-two scales: d * s is exact, so the FMA rounds once like the reference's
        // add (the same value unless the scales' product leaves the normal fp32 range).
        auto add = [&](float(&a)[4], const float(&d)[4], int t) {
          a[0] = __fmaf_rn(d[0], __fmul_rn(as[t][0], ws0), a[0]);
          a[2] = __fmaf_rn(d[2], __fmul_rn(as[t][0], ws1), a[2]);
          if constexpr (!kLean) {
            a[1] = __fmaf_rn(d[1], __fmul_rn(as[t][1], ws0), a[1]);
            a[3] = __fmaf_rn(d[3], __fmul_rn(as[t][1], ws1), a[3]);
          }
        };
        if constexpr (kFp8) {
          const e4m3_fragment a16(st.wf[u][r]);
#pragma unroll
          for (int t = 0; t < TokenTiles; ++t) {
            float d[4];
            mma_e4m3(a16, st.af[u][t].x, st.af[u][t].y, d);
            add(acc[r][t], d, t);
          }
        } else {
          // FP4 -> f16 times 2^-14, exact (rows g and g + 8); the block sum is scaled back
          // (exactly: a power of two, far from the fp32 range's ends) before the reference's math.
          const fp4_f16_fragment a16(st.wf[u][r][0], st.wf[u][r][1]);
#pragma unroll
          for (int t = 0; t < TokenTiles; ++t) {
            float d[4];
            mma_fp4_f16(a16, st.af[u][t], d);
#pragma unroll
            for (int e = 0; e < 4; ++e) d[e] = __fmul_rn(d[e], fp4_f16_rescale);
            add(acc[r][t], d, t);
          }
        }
      }
    }
  };
  // Both stages' weights are requested before waiting for the kernel before (a plain GEMM), so
  // the first DRAM round trip overlaps that kernel's tail; then one stage is multiplied while
  // the other loads.
  stage even, odd;
  if (kb_begin < kb_end) load_weights(even, kb_begin);
  if (kb_begin + Unroll < kb_end) load_weights(odd, kb_begin + Unroll);
  if (!grouped) runtime::start_after_previous_grid();
  auto run = [&](auto lean) {
    if (kb_begin < kb_end) load_activations(even, kb_begin, lean);
    if (kb_begin + Unroll < kb_end) load_activations(odd, kb_begin + Unroll, lean);
    for (int kb0 = kb_begin; kb0 < kb_end;) {
      multiply(even, kb0, lean);
      if (kb0 + 2 * Unroll < kb_end) load(even, kb0 + 2 * Unroll, lean);
      kb0 += Unroll;
      if (kb0 >= kb_end) break;
      multiply(odd, kb0, lean);
      if (kb0 + 2 * Unroll < kb_end) load(odd, kb0 + 2 * Unroll, lean);
      kb0 += Unroll;
    }
  };
  // A CTA with one token (a decode step at batch 1; an expert's tile with one row) needs only the
  // C fragment's even token columns (column 0 holds its token; columns 2, 4, 6 hold nothing and are
  // not written): half the scale products and accumulations, the same values for that token.
  if (TokenTiles == 1 && tok_end - tok_base <= 1)
    run(std::true_type{});
  else
    run(std::false_type{});

  if constexpr (KSplit > 1) {
    __shared__ float parts[gemm_warps][RowTiles * TokenTiles * 4][32];
#pragma unroll
    for (int r = 0; r < RowTiles; ++r)
#pragma unroll
      for (int t = 0; t < TokenTiles; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) parts[warp][(r * TokenTiles + t) * 4 + i][lane] = acc[r][t][i];
    __syncthreads();
    if (part == 0)
#pragma unroll
    for (int r = 0; r < RowTiles; ++r)
#pragma unroll
      for (int t = 0; t < TokenTiles; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float sum = parts[warp][(r * TokenTiles + t) * 4 + i][lane];
#pragma unroll
          for (int q = 1; q < KSplit; ++q) sum += parts[warp + q][(r * TokenTiles + t) * 4 + i][lane];
          acc[r][t][i] = sum;
        }
  }

#pragma unroll
  for (int r = 0; r < RowTiles; ++r)
#pragma unroll
    for (int t = 0; t < TokenTiles; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = (rt_base + r) * 16 + gid + 8 * (i / 2), tok = tok_base + t * 8 + quad * 2 + (i % 2);
        if (part != 0 || row >= N || tok >= tok_end) continue;  // part 0's warp holds the sum
        if (slices == 1)
          g.c[(long long)tok * N + row] = numerics::bf16::from_float(acc[r][t][i]);
        else
          partials[((long long)blockIdx.y * M + tok) * N + row] = acc[r][t][i];
      }
  if (slices == 1) return;
  const int row0 = int(z) * kRowsPerCta;
  finish_split_k(g.c, partials, counters + blockIdx.z * gridDim.x + blockIdx.x, slices, M, N, row0,
                 min(kRowsPerCta, N - row0), tok_base, min(kToksPerCta, M - tok_base));
}

//! The launch shape chosen for a problem.
struct gemm_plan {
  int token_tiles = 1;  // tokens per CTA / 8
  int row_tiles = 1;    // rows per warp / 16
  int k_split = 1;      // warps that share a row tile, each a part of K
  int unroll = 4;       // K blocks a stage of loads (two stages alternate)
  int slices = 1;
  int kbps = 0;         // K blocks per slice
  unsigned token_groups = 0, row_groups = 0;
};

using runtime::sm_count;

//! 16 rows per warp; 8 tokens per CTA up to 128 tokens (token groups run side by side and re-read
//! the weights from L2), 64 beyond (the fallback when the dequantize + cuBLAS path is not taken).
//! bench_gemm --plans at M = 16, 32, 64 on the nine V4.1 shapes: 8 tokens per CTA was the fastest
//! plan in 21 of 27 cases and within 12% of it in all (16 per CTA, the old default: 1.25x slower
//! on geometric mean). More tokens per CTA cost registers and CTAs in flight, and the kernel is
//! bound by instruction issue and latency, not by re-reading weights from L2. K is split until about three CTAs per SM stream weights (a sweep of the split on the
//! V4.1 shapes: fewer slices lose parallelism, more pay for partials and the reduction),
//! as far as the workspace holds the partials and the last CTA's reduction stays short.
//! `options` override the choices (bench_gemm sweeps them; 0 keeps the default).
//! Decode plans (up to 8 tokens) split K for two CTAs an SM, not three: bench_gemm --decode-plans
//! (H100, M = 1): wq_a 7.5 -> 5.1 us, wq_b 20.5 -> 17.5, idx.wq_b 6.3 -> 4.8, wo_b 24.7 -> 18.4,
//! shared.w2 9.6 -> 7.2 (with 6 / 8-block stages); the old split put wo_b at 400 CTAs for 396
//! places, a second wave. shared.w1 alone lost (7.3 -> 8.0); in the model it runs paired with w3.
inline constexpr int decode_ctas_per_sm = 2;
struct decode_plans_tag {};
struct plan_options {
  int token_tiles = 0;   //!< 1, 2, 4 or 8; 0: make_plan's choice
  int reduce_loads = 64; //!< cap on the partials one thread of the last CTA reads (>= 1)
  int unroll = 0;        //!< K blocks a stage: 4, or 6 or 8 with one token tile; 0: make_plan's choice
                         //!< (decode: 6, 8 where K is not split; else 4)
  int ctas_per_sm = 0;   //!< CTAs per SM the K split aims at (1 .. 16); 0: make_plan's choice
                         //!< (decode: decode_ctas_per_sm; else 3)
};
inline gemm_plan make_plan(const gemm_shape& s, int sms, std::size_t partial_floats, const plan_options& o = {}) {
  if ((o.token_tiles != 0 && o.token_tiles != 1 && o.token_tiles != 2 && o.token_tiles != 4 && o.token_tiles != 8) ||
      o.reduce_loads < 1)
    throw error("block_scaled_gemm: plan options need token tiles 0 (default), 1, 2, 4 or 8 and a reduction cap >= 1, not " +
                std::to_string(o.token_tiles) + " and " + std::to_string(o.reduce_loads));
  if (o.ctas_per_sm < 0 || o.ctas_per_sm > 16)
    throw error("block_scaled_gemm: plan options need 0 (default) to 16 CTAs per SM, not " +
                std::to_string(o.ctas_per_sm));
  gemm_plan p;
  const int kb = s.k / 32;
  p.token_tiles = o.token_tiles ? o.token_tiles : s.m <= 128 ? 1 : 8;
  if (o.unroll != 0 && o.unroll != 4 && !((o.unroll == 6 || o.unroll == 8) && p.token_tiles == 1))
    throw error(
        "block_scaled_gemm: plan options need 0 (default) or 4 K blocks a stage, or 6 or 8 with one "
        "token tile (8 tokens per CTA), not " +
        std::to_string(o.unroll) + " with " + std::to_string(p.token_tiles) + " token tiles");
  // Decode (up to 8 tokens, one token tile): 6-block stages keep half again as many weight bytes
  // in flight per warp (160 registers, still three CTAs an SM); 8-block ones where K is not
  // split (set after the split, at the end).
  const bool decode = p.token_tiles == 1 && s.m <= 8 && process_switch<decode_plans_tag>::on();
  p.unroll = o.unroll ? o.unroll : decode ? 6 : 4;
  p.row_tiles = 1;
  p.k_split = 1;  // measured: sharing row tiles across warps (as the grouped GEMM does) was 5-30% slower here
  const int rows_per_cta = gemm_warps / p.k_split * p.row_tiles * 16, toks_per_cta = p.token_tiles * 8;
  p.row_groups = unsigned((s.n + rows_per_cta - 1) / rows_per_cta);
  p.token_groups = unsigned((s.m + toks_per_cta - 1) / toks_per_cta);
  const long long tiles = (long long)p.row_groups * p.token_groups,
                  target = (long long)(o.ctas_per_sm ? o.ctas_per_sm : decode ? decode_ctas_per_sm : 3) * sms;
  long long slices = 1;
  if (tiles < target && tiles <= (long long)gemm_workspace::max_tiles) {
    slices = std::min<long long>((target + tiles - 1) / tiles, std::max(1, kb / 4));
    // The last CTA of a tile reads slices x (its outputs): keep that to ~64 loads per thread.
    const long long tile_outputs = (long long)rows_per_cta * std::min(s.m, toks_per_cta);
    slices = std::min<long long>(slices, std::max<long long>(1, (long long)o.reduce_loads * gemm_warps * 32 / tile_outputs));
  }
  const std::size_t per_slice = std::size_t(s.m) * std::size_t(s.n);
  if (per_slice) slices = std::min<long long>(slices, (long long)std::max<std::size_t>(1, partial_floats / per_slice));
  p.kbps = int((kb + slices - 1) / slices);
  p.slices = p.kbps ? (kb + p.kbps - 1) / p.kbps : 1;  // no empty slice
  if (decode && !o.unroll && p.slices == 1) p.unroll = 8;
  return p;
}

inline std::string check_args(const block_scaled_gemm_args& g, weight_format wf) {
  const auto& s = g.shape;
  const std::string dims = " (M " + std::to_string(s.m) + ", N " + std::to_string(s.n) + ", K " + std::to_string(s.k) + ")";
  if (s.m < 0 || s.n < 0 || s.k < 0) return "negative dimension" + dims;
  if (s.k % 32 != 0) return "K must be a multiple of 32 (one activation scale per 32)" + dims;
  if (s.n > 65535LL * 64) return "N is too large for one launch" + dims;
  if (s.m == 0 || s.n == 0) return {};
  if (s.k == 0) return "K is 0 (an empty sum)" + dims;
  if (!g.a || !g.a_s || !g.w || !g.w_s || !g.c) return "null pointer argument";
  auto misaligned = [](const void* p, std::size_t a) { return reinterpret_cast<std::uintptr_t>(p) % a != 0; };
  if (misaligned(g.a, 8)) return "the activations must be 8-byte aligned";
  if (misaligned(g.w, wf == weight_format::fp8_tile32 ? 16 : 8))
    return std::string("the weight codes (MMA tiles) must be ") + (wf == weight_format::fp8_tile32 ? "16" : "8") +
           "-byte aligned";
  return {};
}

//! `second`: a pair (block_scaled_gemm_pair), p.row_groups being the first GEMM's; the second's
//! follow from its own N.
template <weight_format WF>
void launch(const block_scaled_gemm_args& g, const gemm_plan& p, gemm_workspace* ws, cudaStream_t stream,
            const block_scaled_gemm_args* second = nullptr) {
  const int rows_per_cta = gemm_warps / p.k_split * p.row_tiles * 16;
  const unsigned second_groups = second ? unsigned((second->shape.n + rows_per_cta - 1) / rows_per_cta) : 0u;
  const dim3 grid(p.token_groups, unsigned(p.slices), p.row_groups + second_groups);
  float* partials = ws ? ws->partials() : nullptr;
  unsigned* counters = ws ? ws->counters() : nullptr;
  auto go = [&](auto kernel) {
    runtime::launch_programmatic(kernel, grid, dim3(gemm_warps * 32), 0, stream, g, gemm_groups{}, p.kbps, p.slices,
                                 partials, counters, second ? *second : block_scaled_gemm_args{},
                                 second ? p.row_groups : 0u);
  };
  if (p.unroll != 4) {  // (one token tile only: make_plan)
    if (p.token_tiles != 1 || (p.unroll != 6 && p.unroll != 8))
      throw error("block_scaled_gemm: stages of 6 or 8 K blocks run with one token tile only");
    return p.unroll == 6 ? go(block_scaled_gemm_kernel<WF, 1, 1, 6, 1>)
                         : go(block_scaled_gemm_kernel<WF, 1, 1, 8, 1>);
  }
  switch (p.token_tiles) {
    case 1: return go(block_scaled_gemm_kernel<WF, 1, 1, 4, 1>);
    case 2: return go(block_scaled_gemm_kernel<WF, 2, 1, 4, 1>);
    case 4: return go(block_scaled_gemm_kernel<WF, 4, 1, 2, 1>);
    case 8: return go(block_scaled_gemm_kernel<WF, 8, 1, 1, 1>);
    default: throw error("block_scaled_gemm: a plan's token tiles must be 1, 2, 4 or 8, not " + std::to_string(p.token_tiles));
  }
}

//! launch<WF> for a weight format known at run time.
inline void launch(weight_format wf, const block_scaled_gemm_args& g, const gemm_plan& p, gemm_workspace* ws,
                   cudaStream_t stream, const block_scaled_gemm_args* second = nullptr) {
  if (wf == weight_format::fp8_tile32)
    launch<weight_format::fp8_tile32>(g, p, ws, stream, second);
  else
    launch<weight_format::fp4_row32>(g, p, ws, stream, second);
}

}  // namespace detail

namespace detail {
//! The checks of a grouped GEMM (or pair) whose CTAs cover `rows_per_cta` weight rows; throws
//! dsv4::error prefixed with `who`.
inline void check_grouped_args(const char* who, const block_scaled_gemm_args& g, const gemm_groups& groups,
                               weight_format wf, int token_tiles, const block_scaled_gemm_args* second,
                               int rows_per_cta) {
  const std::string w = who;
  if (auto why = check_args(g, wf); !why.empty()) throw error(w + ": " + why);
  if (second) {
    if (auto why = check_args(*second, wf); !why.empty()) throw error(w + " (second GEMM): " + why);
    const auto &a = g.shape, &b = second->shape;
    if (a.m != b.m || a.n != b.n || a.k != b.k || g.a != second->a || g.a_s != second->a_s ||
        g.a_f16 != second->a_f16)
      throw error(w +
                  ": a pair of GEMMs must share the shape and the activations (codes, scales and f16 copy)");
  }
  if (!groups.tile_group || !groups.tile_row0 || !groups.tile_rows || !groups.tile_count)
    throw error(w + ": the tile list is incomplete");
  if (token_tiles != 1 && token_tiles != 2 && token_tiles != 4)
    throw error(w + ": tiles are 8, 16 or 32 rows");
  const long long n_bound = second ? 65535LL / 2 * rows_per_cta : 65535LL * rows_per_cta;
  if (g.shape.n > n_bound)
    throw error(w + ": N " + std::to_string(g.shape.n) + " exceeds " + std::to_string(n_bound) +
                (second ? " (a pair of GEMMs)" : ""));
  const long long align = wf == weight_format::fp8_tile32 ? 16 : 8;
  if (groups.w_group_bytes % align != 0 || groups.w_group_bytes < 0 || groups.ws_group_bytes < 0)
    throw error(w + ": the weight stride between groups (" + std::to_string(groups.w_group_bytes) +
                " bytes) must be a non-negative multiple of " + std::to_string(align));
}
}  // namespace detail

//! The grouped GEMM: C[r] = A[a_row_index(r)] W_group^T for every tile of the list; `max_tiles`
//! bounds the list's length (the grid), `token_tiles` (1 or 2) is the list's tile height / 8.
//! One 16-row weight tile per CTA, its K range split over the four warps (a tile list has few
//! entries at decode: one token touches 6 experts), partial sums added in warp order.
//! With `second` (same shape and activations, its own weights and output: the MoE's w3 beside
//! w1), both GEMMs run in one launch over one tile list, each CTA computing what it would alone
//! (one launch and one tail instead of two at decode).
inline void grouped_block_scaled_gemm(const block_scaled_gemm_args& g, const gemm_groups& groups, weight_format wf,
                                      int max_tiles, int token_tiles, cudaStream_t stream = nullptr,
                                      const block_scaled_gemm_args* second = nullptr) {
  detail::check_grouped_args("grouped_block_scaled_gemm", g, groups, wf, token_tiles, second, 16);
  if (max_tiles <= 0 || g.shape.n == 0) return;
  const unsigned row_groups = unsigned((g.shape.n + 15) / 16);  // one 16-row tile per CTA, K over the warps
  const dim3 grid(unsigned(max_tiles), 1, second ? 2 * row_groups : row_groups);
  const int kb = g.shape.k / 32;
  auto go = [&](auto kernel) {
    runtime::launch_programmatic(kernel, grid, dim3(detail::gemm_warps * 32), 0, stream, g, groups, kb, 1,
                                 static_cast<float*>(nullptr), static_cast<unsigned*>(nullptr),
                                 second ? *second : block_scaled_gemm_args{}, second ? row_groups : 0u);
  };
  if (wf == weight_format::fp8_tile32)
    token_tiles == 1
        ? go(detail::block_scaled_gemm_kernel<weight_format::fp8_tile32, 1, 1, 4, detail::gemm_warps>)
    : token_tiles == 2
        ? go(detail::block_scaled_gemm_kernel<weight_format::fp8_tile32, 2, 1, 4, detail::gemm_warps>)
        : go(detail::block_scaled_gemm_kernel<weight_format::fp8_tile32, 4, 1, 4, detail::gemm_warps>);
  else
    token_tiles == 1
        ? go(detail::block_scaled_gemm_kernel<weight_format::fp4_row32, 1, 1, 4, detail::gemm_warps>)
    : token_tiles == 2
        ? go(detail::block_scaled_gemm_kernel<weight_format::fp4_row32, 2, 1, 4, detail::gemm_warps>)
        : go(detail::block_scaled_gemm_kernel<weight_format::fp4_row32, 4, 1, 4, detail::gemm_warps>);
  DSV4_CUDA_CHECK_LAUNCH();
}

//! Process-wide: whether make_plan gives decode calls (up to 8 tokens) their own plans (the
//! default: two CTAs an SM, 6 / 8-block stages; off: three an SM and 4-block stages, as before,
//! for bench_model --ab-decode-defaults). Read when a GEMM is launched (or a graph captured).
inline void set_decode_plans(bool on) { process_switch<detail::decode_plans_tag>::set(on); }
inline bool decode_plans() { return process_switch<detail::decode_plans_tag>::on(); }

//! Partial floats a workspace needs for this shape's full split (0: it never splits).
inline std::size_t gemm_partial_floats(const gemm_shape& s) {
  if (s.m <= 0 || s.n <= 0 || s.k < 32) return 0;
  const auto p = detail::make_plan(s, detail::sm_count(), ~std::size_t(0) / 8);
  return p.slices > 1 ? std::size_t(p.slices) * s.m * s.n : 0;
}

//! C = A W^T on the tensor cores (bf16 out). With a workspace, few-token shapes split K across
//! CTAs; without one they run unsplit (same result up to fp32 summation order, slower).
//! Throws dsv4::error on bad shapes or pointers, before any launch.
inline void block_scaled_gemm(const block_scaled_gemm_args& g, weight_format wf, gemm_workspace* workspace = nullptr,
                              cudaStream_t stream = nullptr) {
  if (auto why = detail::check_args(g, wf); !why.empty()) throw error("block_scaled_gemm: " + why);
  if (g.shape.m == 0 || g.shape.n == 0) return;
  const auto p = detail::make_plan(g.shape, detail::sm_count(), workspace ? workspace->partial_floats() : 0);
  detail::launch(wf, g, p, workspace, stream);
  DSV4_CUDA_CHECK_LAUNCH();
}

//! Two GEMMs of one input in one launch (the shared expert's w1 and w3; the attention's wq_a and
//! wkv, whose N differ): c1 = A W1^T, c2 = A W2^T, each bit for bit what block_scaled_gemm gives it
//! alone with a plan for the pair (K is split as for one GEMM of both weights' rows; their
//! partials share the workspace). Why: at decode each launch of a small GEMM costs its own
//! latency (ncu, one token: 9.4 us each for the shared expert's pair). Where the workspace cannot
//! hold the pair's split-K state, the two run one after the other.
inline void block_scaled_gemm_pair(const block_scaled_gemm_args& g1, const block_scaled_gemm_args& g2,
                                   weight_format wf, gemm_workspace* workspace = nullptr, cudaStream_t stream = nullptr) {
  if (auto why = detail::check_args(g1, wf); !why.empty()) throw error("block_scaled_gemm_pair (first): " + why);
  if (auto why = detail::check_args(g2, wf); !why.empty()) throw error("block_scaled_gemm_pair (second): " + why);
  const gemm_shape &a = g1.shape, &b = g2.shape;
  if (a.m != b.m || a.k != b.k || g1.a != g2.a || g1.a_s != g2.a_s)
    throw error("block_scaled_gemm_pair: the two GEMMs must have one input (M " + std::to_string(a.m) + " / " +
                std::to_string(b.m) + ", K " + std::to_string(a.k) + " / " + std::to_string(b.k) +
                ", the same activation codes and scales)");
  if (a.m == 0 || (a.n == 0 && b.n == 0)) return;
  if (a.n == 0 || b.n == 0) {  // one GEMM left
    block_scaled_gemm(a.n ? g1 : g2, wf, workspace, stream);
    return;
  }
  // Slices as for one GEMM of both weights' rows (the same CTAs in flight, partials for both).
  detail::gemm_plan p = detail::make_plan({a.m, a.n + b.n, a.k}, detail::sm_count(),
                                          workspace ? workspace->partial_floats() : 0);
  const int rows_per_cta = detail::gemm_warps / p.k_split * p.row_tiles * 16;
  p.row_groups = unsigned((a.n + rows_per_cta - 1) / rows_per_cta);  // the first's; launch adds the second's
  const long long groups = (long long)p.row_groups + (b.n + rows_per_cta - 1) / rows_per_cta;
  const bool fits = groups <= 65535 &&
                    (p.slices == 1 || (long long)p.token_groups * groups <= (long long)gemm_workspace::max_tiles);
  if (!fits) {
    block_scaled_gemm(g1, wf, workspace, stream);
    return block_scaled_gemm(g2, wf, workspace, stream);
  }
  detail::launch(wf, g1, p, workspace, stream, &g2);
  DSV4_CUDA_CHECK_LAUNCH();
}

}  // namespace dsv4::kernels::gemm
