#pragma once
//! \file
//! The grouped block-scaled GEMM of the MoE's experts at decode (few rows per expert), with the
//! weights streamed through shared memory by bulk copies (kernels/bulk_copy.cuh): same arguments,
//! weight layout (weight_tiles.hpp) and per-block arithmetic as grouped_block_scaled_gemm
//! (block_scaled_gemm.cuh), built to keep the weight stream at HBM speed.
//!
//! Why: at one token a layer's six experts are 106 MB of FP4 weights that every decode step reads
//! once, and the per-tile kernel streamed them at 1.1-1.3 TB/s of 4.2 (docs/perf.md): each of its
//! CTAs reads one 16-row tile (40 KB) with eight loads of 8 bytes per lane in flight, so a CTA is
//! short-lived and spends most of its life waiting on its first and last round trips.
//!
//! Method:
//! - A unit of work is one (GEMM of a pair, tile of the list, 16-row weight tile) over the whole
//!   K range, owned by one warp. Units are dealt out warp-major over a grid that fills the GPU
//!   once (warp w of CTA b takes units w * grid + b, + warps * grid, ...), so every SM gets the same
//!   share whatever the tile count.
//! - Each warp has a ring of `stream_stages` stages of 2 KB of weight codes (8 FP4 / 4 FP8 K
//!   blocks; FP4 scales beside them). One lane keeps the ring full with bulk copies, across unit
//!   boundaries, so a warp always has three stages (6 KB) in flight and an SM about 80 KB: enough
//!   to cover DRAM latency at full bandwidth, without registers.
//! - The activations (a few rows, read by every warp of the tile) come from L1 / L2 with ordinary
//!   loads, issued for a whole stage before waiting on its barrier.
//! - Per K block: the m16n8k32 E4M3 product of the per-tile kernel (FP4 -> E4M3 exactly, two f16
//!   MMAs), scaled by the exact product of the two UE8M0 scales and added with one FMA. One warp
//!   adds a unit's blocks in increasing K order: the host reference's order (reference.hpp), so
//!   the result equals the reference bit for bit wherever the tensor core's block sum is exact.

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/bulk_copy.cuh"
#include "dsv4/kernels/gemm/block_scaled_gemm.cuh"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_info.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::gemm {

//! Which kernel runs the MoE's grouped expert GEMMs on the mma.sync path (decode_grouped_gemm).
enum class expert_gemm {
  streamed,  //!< this file's kernel (the default where it runs: measured on the H200)
  per_tile,  //!< grouped_block_scaled_gemm (block_scaled_gemm.cuh): one CTA per 16-row tile
};

namespace detail {

inline std::atomic<expert_gemm>& expert_gemm_choice() {
  static std::atomic<expert_gemm> choice{expert_gemm::streamed};
  return choice;
}

inline constexpr int stream_warps = 8;                // per CTA
inline constexpr int stream_stages = 4;               // per warp
inline constexpr int stream_stage_code_bytes = 2048;  // weight codes per stage

//! Shared-memory layout of the streamed kernel: the warps' barriers, then their rings.
template <weight_format WF>
struct stream_layout {
  static constexpr bool fp8 = WF == weight_format::fp8_tile32;
  static constexpr int block_bytes = tile_code_bytes(WF);                     // one K block of a tile
  static constexpr int stage_blocks = stream_stage_code_bytes / block_bytes;  // K blocks per stage
  static constexpr int block_scale_bytes = fp8 ? 0 : mma_tile_rows;           // FP4: one scale per row
  static constexpr int stage_bytes = stream_stage_code_bytes + stage_blocks * block_scale_bytes;
  static constexpr int barrier_bytes = stream_warps * stream_stages * 8;
  static constexpr int bytes = barrier_bytes + stream_warps * stream_stages * stage_bytes;
  static_assert(stage_bytes % 16 == 0 && barrier_bytes % 16 == 0, "bulk copies need 16-byte aligned stages");
};

template <weight_format WF, int TokenTiles>
DSV4_KERNEL void __launch_bounds__(stream_warps * 32, TokenTiles == 1 ? 3 : 2)
    streamed_grouped_gemm_kernel(block_scaled_gemm_args g, gemm_groups groups, int max_tiles,
                                 block_scaled_gemm_args g_second, int gemms) {
  using L = stream_layout<WF>;
  constexpr bool kFp8 = L::fp8;
  constexpr int kStageBlocks = L::stage_blocks, kS = stream_stages;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, quad = lane % 4;
  std::uint64_t* bars = reinterpret_cast<std::uint64_t*>(smem) + warp * kS;
  unsigned char* ring = smem + L::barrier_bytes + warp * kS * L::stage_bytes;
  if (lane == 0)
    for (int s = 0; s < kS; ++s) bulk_copy::init(bars + s, 1);
  bulk_copy::init_fence();
  __syncwarp();
  // The tile list comes from the kernels before (runtime/pdl.cuh).
  runtime::start_after_previous_grid();

  const int N = g.shape.n, KB = g.shape.k / 32, row_tiles = (N + 15) / 16;
  const int tiles = min(*groups.tile_count, max_tiles);
  const long long per_gemm = (long long)tiles * row_tiles, units = gemms * per_gemm;
  const long long warps_total = (long long)gridDim.x * stream_warps;
  const long long first_unit = (long long)warp * gridDim.x + blockIdx.x;
  if (first_unit >= units) return;
  const int chunks = (KB + kStageBlocks - 1) / kStageBlocks;
  const long long my_units = (units - first_unit + warps_total - 1) / warps_total;
  const long long my_chunks = my_units * chunks;

  struct unit {
    int gemm, tile, rt;
  };
  auto unit_of = [&](long long i) {  // the warp's i-th unit
    const long long u = first_unit + i * warps_total;
    const long long r = u % per_gemm;
    return unit{int(u / per_gemm), int(r / row_tiles), int(r % row_tiles)};
  };
  const std::uint64_t policy = bulk_copy::evict_first_policy();
  // Lane 0: the copies of the warp's chunk q (unit q / chunks, its K blocks from (q % chunks) * kStageBlocks).
  auto issue = [&](long long q) {
    const unit un = unit_of(q / chunks);
    const int kb0 = int(q % chunks) * kStageBlocks, nkb = min(kStageBlocks, KB - kb0);
    const long long group = groups.tile_group[un.tile];
    const std::uint8_t* w = (un.gemm ? g_second.w : g.w) + group * groups.w_group_bytes +
                            ((long long)un.rt * KB + kb0) * L::block_bytes;
    unsigned char* stage = ring + int(q % kS) * L::stage_bytes;
    std::uint64_t* bar = bars + int(q % kS);
    bulk_copy::expect_bytes(bar, unsigned(nkb * (L::block_bytes + L::block_scale_bytes)));
    bulk_copy::copy(stage, w, unsigned(nkb * L::block_bytes), bar, policy);
    if constexpr (!kFp8) {
      const std::uint8_t* ws = (un.gemm ? g_second.w_s : g.w_s) + group * groups.ws_group_bytes +
                               ((long long)un.rt * KB + kb0) * L::block_scale_bytes;
      bulk_copy::copy(stage + stream_stage_code_bytes, ws, unsigned(nkb * L::block_scale_bytes), bar, policy);
    }
  };
  if (lane == 0)
    for (long long q = 0; q < kS && q < my_chunks; ++q) issue(q);

  long long q = 0;  // the warp's next chunk to consume
  for (long long i = 0; i < my_units; ++i) {
    const unit un = unit_of(i);
    // (Fields picked one by one: a reference to either parameter struct would copy both to the stack.)
    numerics::bf16* const c_out = un.gemm ? g_second.c : g.c;
    const std::uint8_t* const w_s = un.gemm ? g_second.w_s : g.w_s;
    const int group = groups.tile_group[un.tile];
    const int tok_base = groups.tile_row0[un.tile], tok_end = tok_base + groups.tile_rows[un.tile];
    auto a_index = [&](int r) { return groups.a_row_index ? groups.a_row_index[r] : r; };
    // Rows gid and gid + 8 of the tile; token gid of each token tile (B), tokens 2q, 2q + 1 (C).
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
    // FP8: one scale per 32 x 32 tile (rows gid and gid + 8 share it), read from global memory.
    const std::uint8_t* ws8 = w_s + (long long)group * groups.ws_group_bytes + (long long)(un.rt / 2) * KB;
    float acc[TokenTiles][4] = {};

    auto run = [&](auto lean) {
      constexpr bool kLean = decltype(lean)::value;
      constexpr int kTokScales = kLean ? 1 : 2;
      for (int c = 0; c < chunks; ++c, ++q) {
        const int kb0 = c * kStageBlocks, nkb = min(kStageBlocks, KB - kb0);
        // The stage's activations first: their loads overlap the wait for the weights.
        uint2 af[kStageBlocks][TokenTiles];
        std::uint32_t asc[kStageBlocks][TokenTiles][2];
        [[maybe_unused]] std::uint32_t ws8c[kFp8 ? kStageBlocks : 1];
#pragma unroll
        for (int j = 0; j < kStageBlocks; ++j) {
          const bool ok = j < nkb;
#pragma unroll
          for (int t = 0; t < TokenTiles; ++t) {
            af[j][t] = ok && tok_ok[t] ? *reinterpret_cast<const uint2*>(a_row[t] + (kb0 + j) * 32) : make_uint2(0, 0);
#pragma unroll
            for (int h = 0; h < kTokScales; ++h) asc[j][t][h] = ok ? *(as_row[t][h] + kb0 + j) : 127u;
          }
          if constexpr (kFp8) ws8c[j] = ok ? __ldg(ws8 + kb0 + j) : 127u;
        }
        const int s = int(q % kS);
        bulk_copy::wait(bars + s, unsigned(q / kS) & 1u);
        const unsigned char* stage = ring + s * L::stage_bytes;
#pragma unroll
        for (int j = 0; j < kStageBlocks; ++j) {
          if (j >= nkb) break;
          std::uint32_t frag[4];
          float ws0, ws1;
          if constexpr (kFp8) {
            const uint4 v = *reinterpret_cast<const uint4*>(stage + j * L::block_bytes + lane * 16);
            frag[0] = v.x, frag[2] = v.y, frag[1] = v.z, frag[3] = v.w;
            ws0 = ws1 = ue8m0_value(ws8c[j]);
          } else {
            const uint2 v = *reinterpret_cast<const uint2*>(stage + j * L::block_bytes + lane * 8);
            fp4_lane_word_to_e4m3(v.x, frag[0], frag[2]);
            fp4_lane_word_to_e4m3(v.y, frag[1], frag[3]);
            const unsigned char* sc = stage + stream_stage_code_bytes + j * L::block_scale_bytes;
            ws0 = ue8m0_value(sc[gid]), ws1 = ue8m0_value(sc[gid + 8]);
          }
          const e4m3_fragment a16(frag);
#pragma unroll
          for (int t = 0; t < TokenTiles; ++t) {
            float d[4];
            mma_e4m3(a16, af[j][t].x, af[j][t].y, d);
            const float as0 = ue8m0_value(asc[j][t][0]);
            acc[t][0] = __fmaf_rn(d[0], __fmul_rn(as0, ws0), acc[t][0]);
            acc[t][2] = __fmaf_rn(d[2], __fmul_rn(as0, ws1), acc[t][2]);
            if constexpr (!kLean) {
              const float as1 = ue8m0_value(asc[j][t][1]);
              acc[t][1] = __fmaf_rn(d[1], __fmul_rn(as1, ws0), acc[t][1]);
              acc[t][3] = __fmaf_rn(d[3], __fmul_rn(as1, ws1), acc[t][3]);
            }
          }
        }
        // The stage is read: refill it with the chunk kS ahead (possibly the next unit's).
        __syncwarp();
        if (lane == 0 && q + kS < my_chunks) {
          bulk_copy::fence_before_refill();
          issue(q + kS);
        }
      }
    };
    // A tile of one row needs only the C fragment's even token columns (as in the per-tile kernel).
    if (TokenTiles == 1 && tok_end - tok_base <= 1)
      run(std::true_type{});
    else
      run(std::false_type{});

#pragma unroll
    for (int t = 0; t < TokenTiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = un.rt * 16 + gid + 8 * (e / 2), tok = tok_base + t * 8 + quad * 2 + (e % 2);
        if (row < N && tok < tok_end) c_out[(long long)tok * N + row] = numerics::bf16::from_float(acc[t][e]);
      }
  }
}

//! Whether this translation unit's streamed kernels were compiled for sm_90 or newer and the
//! current device is one (bulk copies and transaction barriers are Hopper's).
template <weight_format WF, int TokenTiles>
bool streamed_kernel_runs_here() {
  static const bool yes = [] {
    if (runtime::compute_capability_major() < 9) return false;
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, streamed_grouped_gemm_kernel<WF, TokenTiles>) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attr.ptxVersion >= 90;
  }();
  return yes;
}

//! CTAs of the streamed kernel resident per SM (asked once; the shared memory opted in first).
template <weight_format WF, int TokenTiles>
int streamed_ctas_per_sm() {
  static const int ctas = [] {
    auto kernel = streamed_grouped_gemm_kernel<WF, TokenTiles>;
    DSV4_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, stream_layout<WF>::bytes));
    int n = 0;
    DSV4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, stream_warps * 32, stream_layout<WF>::bytes));
    return n;
  }();
  return ctas;
}

}  // namespace detail

//! Process-wide: the kernel of the grouped expert GEMMs (bench_moe compares them). With
//! `streamed`, arguments the streamed kernel cannot take (streamed_grouped_gemm_unfit) still run
//! on the per-tile kernel.
inline void set_expert_gemm(expert_gemm k) { detail::expert_gemm_choice().store(k); }
inline expert_gemm current_expert_gemm() { return detail::expert_gemm_choice().load(); }

//! Why the streamed grouped GEMM cannot take these arguments (empty: it can). Besides the checks
//! of grouped_block_scaled_gemm it needs a Hopper device and build (bulk copies) and 16-byte
//! aligned weight codes, FP4 scales and group strides (the copies' granule).
inline std::string streamed_grouped_gemm_unfit(const block_scaled_gemm_args& g, const gemm_groups& groups,
                                               weight_format wf, int token_tiles,
                                               const block_scaled_gemm_args* second = nullptr) {
  const bool runs = wf == weight_format::fp8_tile32
                        ? (token_tiles == 1 ? detail::streamed_kernel_runs_here<weight_format::fp8_tile32, 1>()
                                            : detail::streamed_kernel_runs_here<weight_format::fp8_tile32, 2>())
                        : (token_tiles == 1 ? detail::streamed_kernel_runs_here<weight_format::fp4_row32, 1>()
                                            : detail::streamed_kernel_runs_here<weight_format::fp4_row32, 2>());
  if (!runs) return "bulk copies need a Hopper (sm_90) device and device code built for sm_90 or newer";
  auto misaligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 != 0; };
  const bool fp4 = wf == weight_format::fp4_row32;
  for (const block_scaled_gemm_args* a : {&g, second})
    if (a && (misaligned(a->w) || (fp4 && misaligned(a->w_s))))
      return fp4 ? "the weight codes and scales must be 16-byte aligned" : "the weight codes must be 16-byte aligned";
  if (groups.w_group_bytes % 16 != 0 || (fp4 && groups.ws_group_bytes % 16 != 0))
    return "the weight strides between groups must be multiples of 16 bytes";
  return {};
}

//! grouped_block_scaled_gemm's GEMM (same arguments and results up to fp32 summation order: here
//! a unit's K blocks are added in K order, as the host reference does) with the weights streamed
//! by bulk copies. Throws dsv4::error on bad arguments or where streamed_grouped_gemm_unfit says why.
inline void streamed_grouped_gemm(const block_scaled_gemm_args& g, const gemm_groups& groups, weight_format wf,
                                  int max_tiles, int token_tiles, cudaStream_t stream = nullptr,
                                  const block_scaled_gemm_args* second = nullptr) {
  detail::check_grouped_args("streamed_grouped_gemm", g, groups, wf, token_tiles, second, 1 << 24);
  if (auto why = streamed_grouped_gemm_unfit(g, groups, wf, token_tiles, second); !why.empty())
    throw error("streamed_grouped_gemm: " + why);
  if (max_tiles <= 0 || g.shape.n == 0) return;
  const int gemms = second ? 2 : 1;
  const long long max_units = (long long)gemms * max_tiles * ((g.shape.n + 15) / 16);
  auto go = [&](auto kernel, int ctas_per_sm, int smem) {
    const long long fill = (long long)std::max(1, ctas_per_sm) * detail::sm_count();
    const unsigned grid = unsigned(std::min(fill, max_units));
    runtime::launch_programmatic(kernel, dim3(grid), dim3(detail::stream_warps * 32), std::size_t(smem), stream, g,
                                 groups, max_tiles, second ? *second : block_scaled_gemm_args{}, gemms);
  };
  using detail::stream_layout;
  if (wf == weight_format::fp8_tile32) {
    constexpr int smem = stream_layout<weight_format::fp8_tile32>::bytes;
    token_tiles == 1 ? go(detail::streamed_grouped_gemm_kernel<weight_format::fp8_tile32, 1>,
                          detail::streamed_ctas_per_sm<weight_format::fp8_tile32, 1>(), smem)
                     : go(detail::streamed_grouped_gemm_kernel<weight_format::fp8_tile32, 2>,
                          detail::streamed_ctas_per_sm<weight_format::fp8_tile32, 2>(), smem);
  } else {
    constexpr int smem = stream_layout<weight_format::fp4_row32>::bytes;
    token_tiles == 1 ? go(detail::streamed_grouped_gemm_kernel<weight_format::fp4_row32, 1>,
                          detail::streamed_ctas_per_sm<weight_format::fp4_row32, 1>(), smem)
                     : go(detail::streamed_grouped_gemm_kernel<weight_format::fp4_row32, 2>,
                          detail::streamed_ctas_per_sm<weight_format::fp4_row32, 2>(), smem);
  }
  DSV4_CUDA_CHECK_LAUNCH();
}

}  // namespace dsv4::kernels::gemm
