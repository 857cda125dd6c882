#pragma once
//! \file
//! The block-scaled GEMMs of block_scaled_gemm.cuh (same arguments, weights in the same MMA-tile
//! layout; the same results up to the sum inside each 32-block, which the FP8 tensor core adds at
//! its own reduced precision, and fp32 summation order across split K) on Hopper's warpgroup MMA: the FP8
//! tensor cores that `mma.sync` cannot reach on sm_90 (it is emulated there by two f16 MMAs, see
//! docs/decisions.md 2026-12-01). For the decode and middle regime (1 to ~128 tokens), below the
//! dequantize + cuBLAS path of dequant_gemm.cuh. Opt-in (`set_decode_gemm`) until measured.
//!
//! Method:
//! - One warpgroup per CTA: 64 weight rows (the four warps' 16-row tiles, the MMA's M side, as in
//!   the mma.sync kernel) x 8 / 16 / 32 / 64 tokens (N), one K slice. Weights stream from global
//!   memory straight into the A registers: a warp's MMA-tile bytes of one K block are exactly
//!   wgmma's A fragment of its 16 rows (FP4 converted to E4M3 on the way, exactly), prefetched one
//!   step ahead and requested before the wait for the kernel before (runtime/pdl.cuh).
//! - Activations (B) go through shared memory, eight K blocks at a time in two alternating
//!   buffers, as wgmma's K-major core matrices (kernels/wgmma.cuh), with the same K permutation
//!   inside every 32-block as the weight tiles (thread q of a quad holds elements 8q .. 8q + 7,
//!   which the MMA sees as K positions 4q .. and 16 + 4q ..): each block's dot product is
//!   unchanged.
//! - Every K block is one wgmma from a zero accumulator, so each block's sum comes out of the
//!   tensor core on its own and is scaled and added in fp32 in K order, as the reference does
//!   (the official kernel promotes per block the same way); the scale product of the two UE8M0
//!   scales is exact, so acc += d * (a_scale * w_scale) is one rounding, as in the mma.sync kernel.
//! - Split K and the last-CTA reduction as in block_scaled_gemm.cuh (`finish_split_k`).

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/gemm/block_scaled_gemm.cuh"
#include "dsv4/kernels/gemm/streamed_gemm.cuh"
#include "dsv4/kernels/wgmma.cuh"
#include "dsv4/runtime/device_info.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::gemm {

//! Which kernel runs the block-scaled GEMMs below the dequantize + cuBLAS path.
enum class decode_gemm {
  mma_sync,  //!< block_scaled_gemm.cuh (the default: measured on the H200)
  wgmma,     //!< this file's kernel
};

//! The default of set_wgmma_max_tokens: dequant_gemm.cuh's dequant_min_tokens - 1 (that header
//! includes this one), so wgmma mode starts on the mma.sync path's threshold.
inline constexpr int wgmma_default_max_tokens = 63;

namespace detail {
inline std::atomic<decode_gemm>& decode_gemm_choice() {
  static std::atomic<decode_gemm> choice{decode_gemm::mma_sync};
  return choice;
}
inline std::atomic<int>& wgmma_max_tokens_value() {
  static std::atomic<int> tokens{wgmma_default_max_tokens};
  return tokens;
}
inline std::atomic<unsigned long long>& wgmma_gemm_launches() {
  static std::atomic<unsigned long long> launches{0};
  return launches;
}
}  // namespace detail

//! Whether the current device can run this file's kernels (wgmma::supported()).
inline bool wgmma_supported() {
  return wgmma::supported();
}

namespace detail {
inline void require_wgmma(const char* who) {
  if (!wgmma_supported())
    throw error(std::string(who) +
                ": wgmma needs a Hopper (sm_90) device and device code built for sm_90a; this device has "
                "compute capability " +
                std::to_string(runtime::compute_capability_major()) +
                ".x or the build targets another architecture (use decode_gemm::mma_sync)");
}
}  // namespace detail

//! Process-wide: the kernel block_scaled_linear uses for few-token GEMMs and the MoE for its
//! grouped expert GEMMs (bench_model --gemm). Choosing wgmma where it cannot run is an error.
inline void set_decode_gemm(decode_gemm k) {
  if (k == decode_gemm::wgmma) detail::require_wgmma("set_decode_gemm");
  detail::decode_gemm_choice().store(k);
}
inline decode_gemm current_decode_gemm() {
  return detail::decode_gemm_choice().load();
}

//! With decode_gemm::wgmma: the most tokens block_scaled_linear gives the wgmma kernel before it
//! takes the dequantize + cuBLAS path (wgmma_default_max_tokens, as for mma.sync: where
//! wgmma overtakes that path is for the device to measure; bench_model --gemm-max-tokens).
inline void set_wgmma_max_tokens(int tokens) {
  if (tokens < 1) throw error("set_wgmma_max_tokens: need at least 1 token, not " + std::to_string(tokens));
  detail::wgmma_max_tokens_value().store(tokens);
}
inline int wgmma_max_tokens() { return detail::wgmma_max_tokens_value().load(); }
//! wgmma GEMMs launched so far in this process (tests check that a path was taken).
inline unsigned long long wgmma_gemm_calls() {
  return detail::wgmma_gemm_launches().load();
}

namespace detail {

inline constexpr int wgmma_rows_per_cta = 64;  // one warpgroup: four 16-row weight tiles
inline constexpr int wgmma_chunk_blocks = 8;   // K blocks of activations staged per buffer
inline constexpr int wgmma_unroll = 2;         // K blocks per batch of wgmmas
inline constexpr int wgmma_depth = 4;          // batches of weights in flight per warp
static_assert(wgmma_chunk_blocks % wgmma_unroll == 0, "a chunk holds whole batches of K blocks");

template <int Tokens>
struct wgmma_smem {
  // Per buffer and K block: the B tile (Tokens x 32 E4M3 as core matrices) and the decoded
  // activation scales; 128-byte aligned for the matrix descriptor.
  alignas(128) std::uint8_t b[2][wgmma_chunk_blocks][Tokens * 32];
  float a_scale[2][wgmma_chunk_blocks][Tokens];
};

//! One CTA: one warpgroup, 64 weight rows (warp w: row tile 4 z + w) x Tokens tokens, one K
//! slice of `kbps` blocks. Grid: x = token groups (a grouped GEMM: entries of the tile list),
//! y = K slices, z = row groups (from `second_z` on: the second GEMM of a pair, the MoE's w3 beside
//! w1). Grouped (`groups.tile_group` set): entry x's group selects the weights, its rows of A
//! (through `groups.a_row_index` when given) and C; never split.
template <weight_format WF, int Tokens>
DSV4_KERNEL void __launch_bounds__(128)
    wgmma_gemm_kernel(block_scaled_gemm_args g, gemm_groups groups, int kbps, int slices, float* partials,
                      unsigned* counters, block_scaled_gemm_args g_second, unsigned second_z) {
  static_assert(Tokens == 8 || Tokens == 16 || Tokens == 32 || Tokens == 64,
                "wgmma N is 8, 16, 32 or 64 here");
  constexpr bool kFp8 = WF == weight_format::fp8_tile32;
  constexpr int kTileBytes = tile_code_bytes(WF), kAcc = Tokens / 2, kC = wgmma_chunk_blocks,
                kU = wgmma_unroll;
  __shared__ wgmma_smem<Tokens> sm;
  const int M = g.shape.m, N = g.shape.n, K = g.shape.k, KB = K / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, quad = lane % 4;
  unsigned z = blockIdx.z;
  if (second_z != 0 && z >= second_z) g.w = g_second.w, g.w_s = g_second.w_s, g.c = g_second.c, z -= second_z;
  const int rt = int(z) * 4 + warp;  // this warp's 16-row weight tile
  const bool tile_ok = rt < (N + 15) / 16;
  int tok_base = int(blockIdx.x) * Tokens, tok_end = M;
  const bool grouped = groups.tile_group != nullptr;
  if (grouped) {  // the tile list comes from the kernel before: wait for it first
    runtime::start_after_previous_grid();
    if (int(blockIdx.x) >= *groups.tile_count) return;  // the whole CTA: no wgmma is left half-issued
    const int group = groups.tile_group[blockIdx.x];
    tok_base = groups.tile_row0[blockIdx.x];
    tok_end = tok_base + groups.tile_rows[blockIdx.x];
    g.w += group * groups.w_group_bytes;
    g.w_s += group * groups.ws_group_bytes;
  }
  auto a_index = [&](int r) { return groups.a_row_index ? groups.a_row_index[r] : r; };
  const int kb_begin = int(blockIdx.y) * kbps, kb_end = min(KB, kb_begin + kbps);
  const std::uint8_t* w_tile =
      g.w + (long long)(tile_ok ? rt : 0) * KB * kTileBytes + lane * (kTileBytes / 32);
  // FP8: one scale per 32 x 32 tile (a 16-row tile lies in one); FP4: one per row, rows g, g + 8.
  const std::uint8_t* ws_row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
    ws_row[h] = kFp8 ? g.w_s + (long long)((tile_ok ? rt : 0) / 2) * KB
                     : g.w_s + (long long)(tile_ok ? rt : 0) * KB * 16 + gid + 8 * h;
  const int ws_step = kFp8 ? 1 : 16;

  // A batch of kU K blocks of this warp's weights; wgmma_depth batches are in flight.
  struct weights {
    std::uint32_t code[kU][4];
    std::uint32_t scale[kU][2];
  };
  auto load_weights = [&](weights& w, int kb0) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int kb = kb0 + u;
      const bool go = tile_ok && kb < kb_end;
      if constexpr (kFp8) {
        const uint4 v = go ? __ldg(reinterpret_cast<const uint4*>(w_tile + (long long)kb * kTileBytes))
                           : make_uint4(0, 0, 0, 0);
        // Lane bytes: row g elements 0..3, 4..7, row g + 8 elements 0..3, 4..7 (weight_tiles.hpp);
        // A registers: (g, K 4q..), (g + 8, 4q..), (g, 16 + 4q..), (g + 8, 16 + 4q..).
        w.code[u][0] = v.x, w.code[u][2] = v.y, w.code[u][1] = v.z, w.code[u][3] = v.w;
      } else {
        const uint2 v = go ? __ldg(reinterpret_cast<const uint2*>(w_tile + (long long)kb * kTileBytes))
                           : make_uint2(0, 0);
        w.code[u][0] = v.x, w.code[u][1] = v.y;  // lane words of rows g and g + 8, converted below
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)
        w.scale[u][h] = go && (h == 0 || !kFp8) ? __ldg(ws_row[h] + kb * ws_step) : 127u;
    }
  };
  // Stages K blocks kb0 .. kb0 + kC - 1 of the CTA's tokens into buffer `buf`: each thread moves
  // 8 activation bytes (elements 8q .. 8q + 7 of one token and block) as two 4-byte rows of the
  // token's two core matrices; missing tokens and blocks are zeros with scale 0.
  auto stage_activations = [&](int buf, int kb0) {
    for (int i = threadIdx.x; i < kC * Tokens * 4; i += blockDim.x) {
      const int q = i % 4, t = (i / 4) % Tokens, u = i / (4 * Tokens), kb = kb0 + u, tok = tok_base + t;
      uint2 v = make_uint2(0, 0);
      if (kb < kb_end && tok < tok_end)
        v = *reinterpret_cast<const uint2*>(g.a + (long long)a_index(tok) * K + kb * 32 + q * 8);
      std::uint8_t* tile = sm.b[buf][u] + (t % 8) * 16 + 4 * q;
      *reinterpret_cast<std::uint32_t*>(tile + wgmma::b_core_offset(t / 8, 0)) = v.x;
      *reinterpret_cast<std::uint32_t*>(tile + wgmma::b_core_offset(t / 8, 1)) = v.y;
    }
    for (int i = threadIdx.x; i < kC * Tokens; i += blockDim.x) {
      const int t = i % Tokens, u = i / Tokens, kb = kb0 + u, tok = tok_base + t;
      sm.a_scale[buf][u][t] =
          kb < kb_end && tok < tok_end ? ue8m0_value(g.a_s[(long long)a_index(tok) * KB + kb]) : 0.0f;
    }
  };

  float acc[kAcc] = {};
  float d[kU][kAcc] = {};
  // One batch: stage the next chunk of activations when it starts, convert the weights, issue kU
  // wgmmas, wait, scale and add in K order; then refill the weights' slot wgmma_depth batches on.
  auto batch = [&](weights& w, int kb0) {
    const int step = kb0 - kb_begin, buf = (step / kC) % 2, at = step % kC;
    if (at == 0) {
      // Buffer `buf` was last read two chunks ago, before every thread passed the barrier of the
      // chunk in between: one barrier per chunk suffices.
      stage_activations(buf, kb0);
      wgmma::fence_shared_for_async();
      __syncthreads();
    }
    std::uint32_t frag[kU][4];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if constexpr (kFp8) {
#pragma unroll
        for (int i = 0; i < 4; ++i) frag[u][i] = w.code[u][i];
      } else {
        fp4_lane_word_to_e4m3(w.code[u][0], frag[u][0], frag[u][2]);
        fp4_lane_word_to_e4m3(w.code[u][1], frag[u][1], frag[u][3]);
      }
    }
    float ws[kU][2];
#pragma unroll
    for (int u = 0; u < kU; ++u)
      ws[u][0] = ue8m0_value(w.scale[u][0]), ws[u][1] = kFp8 ? ws[u][0] : ue8m0_value(w.scale[u][1]);
    if (kb0 + wgmma_depth * kU < kb_end) load_weights(w, kb0 + wgmma_depth * kU);  // the slot is free again
    std::uint64_t desc[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      desc[u] = wgmma::smem_descriptor(sm.b[buf][at + u], wgmma::b_leading_byte_offset,
                                       wgmma::b_stride_byte_offset);
#pragma unroll
      for (int i = 0; i < 4; ++i) wgmma::fence_operand(frag[u][i]);
#pragma unroll
      for (int i = 0; i < kAcc; ++i) wgmma::fence_operand(d[u][i]);
    }
    // Every block of the batch is issued, also one past the slice's end: its staged activations
    // and weights are zeros, and its product is not added (no branch between the wgmmas, which
    // would make ptxas insert fences of its own).
    wgmma::fence();
#pragma unroll
    for (int u = 0; u < kU; ++u) wgmma::mma_e4m3<Tokens>(d[u], frag[u], desc[u], false);
    wgmma::commit_group();
    wgmma::wait_group<0>();
#pragma unroll
    for (int u = 0; u < kU; ++u) {
#pragma unroll
      for (int i = 0; i < kAcc; ++i) wgmma::fence_operand(d[u][i]);
      if (kb0 + u >= kb_end) break;
#pragma unroll
      for (int j = 0; j < Tokens / 8; ++j) {
        const float as0 = sm.a_scale[buf][at + u][8 * j + 2 * quad],
                    as1 = sm.a_scale[buf][at + u][8 * j + 2 * quad + 1];
        // acc += d * (a_scale * w_scale): the scale product is exact (powers of two), one rounding.
        acc[4 * j + 0] = __fmaf_rn(d[u][4 * j + 0], __fmul_rn(as0, ws[u][0]), acc[4 * j + 0]);
        acc[4 * j + 1] = __fmaf_rn(d[u][4 * j + 1], __fmul_rn(as1, ws[u][0]), acc[4 * j + 1]);
        acc[4 * j + 2] = __fmaf_rn(d[u][4 * j + 2], __fmul_rn(as0, ws[u][1]), acc[4 * j + 2]);
        acc[4 * j + 3] = __fmaf_rn(d[u][4 * j + 3], __fmul_rn(as1, ws[u][1]), acc[4 * j + 3]);
      }
    }
  };
  // wgmma_depth slots of weights, requested before the wait for the kernel before (a plain GEMM:
  // weights do not depend on it), then used in turn; named slots keep them in registers.
  static_assert(wgmma_depth == 4, "the loop below names four weight slots");
  weights w0, w1, w2, w3;
  load_weights(w0, kb_begin);
  load_weights(w1, kb_begin + kU);
  load_weights(w2, kb_begin + 2 * kU);
  load_weights(w3, kb_begin + 3 * kU);
  if (!grouped) runtime::start_after_previous_grid();
  for (int kb0 = kb_begin; kb0 < kb_end;) {
    batch(w0, kb0);
    if ((kb0 += kU) >= kb_end) break;
    batch(w1, kb0);
    if ((kb0 += kU) >= kb_end) break;
    batch(w2, kb0);
    if ((kb0 += kU) >= kb_end) break;
    batch(w3, kb0);
    kb0 += kU;
  }

#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const int row = rt * 16 + gid + 8 * ((i % 4) / 2), tok = tok_base + 8 * (i / 4) + 2 * quad + i % 2;
    if (!tile_ok || row >= N || tok >= tok_end) continue;
    if (slices == 1)
      g.c[(long long)tok * N + row] = numerics::bf16::from_float(acc[i]);
    else
      partials[((long long)blockIdx.y * M + tok) * N + row] = acc[i];
  }
  if (slices == 1) return;
  const int row0 = int(z) * wgmma_rows_per_cta;
  finish_split_k(g.c, partials, counters + z * gridDim.x + blockIdx.x, slices, M, N, row0,
                 min(wgmma_rows_per_cta, N - row0), tok_base,
                 min(Tokens, M - tok_base));  // (split K: never grouped)
}

struct wgmma_plan {
  int tokens = 8;  // the MMA's N: tokens per CTA
  int slices = 1;
  int kbps = 0;  // K blocks per slice
  unsigned token_groups = 0, row_groups = 0;
};

//! What bench_gemm --wgmma-plans sweeps; the defaults are make_wgmma_plan's choices.
struct wgmma_plan_options {
  int ctas_per_sm = 3;     //!< K is split until about this many CTAs per SM stream weights
  int reduce_loads = 128;  //!< cap on the partials one thread of the last CTA reads (>= 1)
};

//! Tokens per CTA: the smallest wgmma N that holds the GEMM's tokens, 64 beyond. K is split as
//! make_plan does (about three CTAs per SM), at least one staged chunk per slice, the last CTA's
//! reduction capped at `reduce_loads` partials per thread, and as far as the workspace holds them.
inline wgmma_plan make_wgmma_plan(const gemm_shape& s, int sms, std::size_t partial_floats,
                                  const wgmma_plan_options& o = {}) {
  if (o.ctas_per_sm < 1 || o.reduce_loads < 1)
    throw error("wgmma_gemm: plan options need ctas_per_sm >= 1 and reduce_loads >= 1, not " +
                std::to_string(o.ctas_per_sm) + " and " + std::to_string(o.reduce_loads));
  wgmma_plan p;
  const int kb = s.k / 32;
  p.tokens = s.m <= 8 ? 8 : s.m <= 16 ? 16 : s.m <= 32 ? 32 : 64;
  p.row_groups = unsigned((s.n + wgmma_rows_per_cta - 1) / wgmma_rows_per_cta);
  p.token_groups = unsigned((s.m + p.tokens - 1) / p.tokens);
  const long long tiles = (long long)p.row_groups * p.token_groups, target = (long long)o.ctas_per_sm * sms;
  long long slices = 1;
  if (tiles < target && tiles <= (long long)gemm_workspace::max_tiles) {
    slices = std::min<long long>((target + tiles - 1) / tiles, std::max(1, kb / wgmma_chunk_blocks));
    const long long tile_outputs = (long long)wgmma_rows_per_cta * std::min(s.m, p.tokens);
    slices =
        std::min<long long>(slices, std::max<long long>(1, (long long)o.reduce_loads * 128 / tile_outputs));
  }
  const std::size_t per_slice = std::size_t(s.m) * std::size_t(s.n);
  if (per_slice)
    slices = std::min<long long>(slices, (long long)std::max<std::size_t>(1, partial_floats / per_slice));
  p.kbps = int((kb + slices - 1) / slices);
  p.slices = p.kbps ? (kb + p.kbps - 1) / p.kbps : 1;  // no empty slice
  return p;
}

template <weight_format WF>
void launch_wgmma(const block_scaled_gemm_args& g, const wgmma_plan& p, gemm_workspace* ws,
                  cudaStream_t stream) {
  const dim3 grid(p.token_groups, unsigned(p.slices), p.row_groups);
  float* partials = ws ? ws->partials() : nullptr;
  unsigned* counters = ws ? ws->counters() : nullptr;
  auto go = [&](auto kernel) {
    runtime::launch_programmatic(kernel, grid, dim3(128), 0, stream, g, gemm_groups{}, p.kbps, p.slices,
                                 partials, counters, block_scaled_gemm_args{}, 0u);
  };
  switch (p.tokens) {
    case 8:
      return go(wgmma_gemm_kernel<WF, 8>);
    case 16:
      return go(wgmma_gemm_kernel<WF, 16>);
    case 32:
      return go(wgmma_gemm_kernel<WF, 32>);
    case 64:
      return go(wgmma_gemm_kernel<WF, 64>);
    default:
      throw error("wgmma_gemm: a plan's tokens per CTA must be 8, 16, 32 or 64, not " +
                  std::to_string(p.tokens));
  }
}

}  // namespace detail

//! Partial floats a workspace needs for this shape's full split on wgmma (0: it never splits).
inline std::size_t wgmma_partial_floats(const gemm_shape& s) {
  if (s.m <= 0 || s.n <= 0 || s.k < 32) return 0;
  const auto p = detail::make_wgmma_plan(s, detail::sm_count(), ~std::size_t(0) / 8);
  return p.slices > 1 ? std::size_t(p.slices) * s.m * s.n : 0;
}

//! C = A W^T on wgmma (bf16 out); arguments, errors and workspace as block_scaled_gemm.
inline void wgmma_gemm(const block_scaled_gemm_args& g, weight_format wf, gemm_workspace* workspace = nullptr,
                       cudaStream_t stream = nullptr) {
  if (auto why = detail::check_args(g, wf); !why.empty()) throw error("wgmma_gemm: " + why);
  if (g.shape.m == 0 || g.shape.n == 0) return;
  detail::require_wgmma("wgmma_gemm");
  const auto p =
      detail::make_wgmma_plan(g.shape, detail::sm_count(), workspace ? workspace->partial_floats() : 0);
  if (wf == weight_format::fp8_tile32)
    detail::launch_wgmma<weight_format::fp8_tile32>(g, p, workspace, stream);
  else
    detail::launch_wgmma<weight_format::fp4_row32>(g, p, workspace, stream);
  DSV4_CUDA_CHECK_LAUNCH();
  detail::wgmma_gemm_launches().fetch_add(1);
}

//! The grouped GEMM of block_scaled_gemm.cuh (the MoE's experts: a device-built tile list, each
//! tile up to 8 x `token_tiles` rows of one group) on wgmma: one CTA per (tile, 64 weight rows),
//! the whole K per CTA; with `second`, the pair (w1 and w3) in one launch. Arguments and errors
//! as grouped_block_scaled_gemm.
inline void grouped_wgmma_gemm(const block_scaled_gemm_args& g, const gemm_groups& groups, weight_format wf,
                               int max_tiles, int token_tiles, cudaStream_t stream = nullptr,
                               const block_scaled_gemm_args* second = nullptr) {
  detail::check_grouped_args("grouped_wgmma_gemm", g, groups, wf, token_tiles, second,
                             detail::wgmma_rows_per_cta);
  if (max_tiles <= 0 || g.shape.n == 0) return;
  detail::require_wgmma("grouped_wgmma_gemm");
  const unsigned row_groups =
      unsigned((g.shape.n + detail::wgmma_rows_per_cta - 1) / detail::wgmma_rows_per_cta);
  const dim3 grid(unsigned(max_tiles), 1, second ? 2 * row_groups : row_groups);
  auto go = [&](auto kernel) {
    runtime::launch_programmatic(kernel, grid, dim3(128), 0, stream, g, groups, g.shape.k / 32, 1,
                                 static_cast<float*>(nullptr), static_cast<unsigned*>(nullptr),
                                 second ? *second : block_scaled_gemm_args{}, second ? row_groups : 0u);
  };
  if (wf == weight_format::fp8_tile32)
    token_tiles == 1   ? go(detail::wgmma_gemm_kernel<weight_format::fp8_tile32, 8>)
    : token_tiles == 2 ? go(detail::wgmma_gemm_kernel<weight_format::fp8_tile32, 16>)
                       : go(detail::wgmma_gemm_kernel<weight_format::fp8_tile32, 32>);
  else
    token_tiles == 1   ? go(detail::wgmma_gemm_kernel<weight_format::fp4_row32, 8>)
    : token_tiles == 2 ? go(detail::wgmma_gemm_kernel<weight_format::fp4_row32, 16>)
                       : go(detail::wgmma_gemm_kernel<weight_format::fp4_row32, 32>);
  DSV4_CUDA_CHECK_LAUNCH();
  detail::wgmma_gemm_launches().fetch_add(1);
}

//! The grouped GEMM as chosen by set_decode_gemm and, on the mma.sync path, set_expert_gemm.
inline void decode_grouped_gemm(const block_scaled_gemm_args& g, const gemm_groups& groups, weight_format wf,
                                int max_tiles, int token_tiles, cudaStream_t stream = nullptr,
                                const block_scaled_gemm_args* second = nullptr) {
  if (current_decode_gemm() == decode_gemm::wgmma)
    return grouped_wgmma_gemm(g, groups, wf, max_tiles, token_tiles, stream, second);
  if (current_expert_gemm() == expert_gemm::streamed &&
      detail::streamed_grouped_gemm_if_fit(g, groups, wf, max_tiles, token_tiles, stream, second).empty())
    return;  // launched (or nothing to do); otherwise the per-tile kernel takes it
  grouped_block_scaled_gemm(g, groups, wf, max_tiles, token_tiles, stream, second);
}

//! The few-token GEMM as chosen by set_decode_gemm: mma.sync (the default) or wgmma.
inline void decode_block_scaled_gemm(const block_scaled_gemm_args& g, weight_format wf,
                                     gemm_workspace* workspace, cudaStream_t stream = nullptr) {
  if (current_decode_gemm() == decode_gemm::wgmma) return wgmma_gemm(g, wf, workspace, stream);
  block_scaled_gemm(g, wf, workspace, stream);
}

}  // namespace dsv4::kernels::gemm
