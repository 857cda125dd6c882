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
//! - Each warp has a ring of `stream_stages` (6) stages of 2 KB of weight codes (8 FP4 / 4 FP8 K
//!   blocks; FP4 scales beside them). One lane keeps the ring full with bulk copies, across unit
//!   boundaries, so a warp has five stages (10 KB) in flight and an SM up to 160 KB: enough to
//!   cover DRAM latency at full bandwidth, without registers. Two CTAs of 8 warps per SM.
//! - The loop is compact: full stages are unrolled with no per-block branch, the last partial
//!   one runs block by block, and all bookkeeping is 32-bit and incremental (a first version's
//!   64-bit divisions per stage cost as many instructions as the math, ncu: 121 a K block).
//! - The activations (a few rows, read by every warp of the tile) come from L1 / L2 with ordinary
//!   loads, issued for a whole stage before waiting on its barrier. Where the caller has them as
//!   f16 (block_scaled_gemm_args::a_f16, the codes' exact values: the MoE's act_quants write them,
//!   FP4 kernels only) a token's B fragment is one 16-byte load instead of an 8-byte load and six
//!   instructions (four E4M3 -> f16 conversions and two shifts) that all 144 warps of a tile repeat.
//! - Per K block: FP8 weights as the per-tile kernel's m16n8k32 E4M3 product (two f16 MMAs);
//!   FP4 weights converted straight to f16 times 2^-14 (fp4_f16_fragment: 12 logic instructions
//!   and 10 shifts for the lane's 16 codes, exact) and two f16 MMAs. Then
//!   acc += (d * a_scale) * w_scale as the reference computes it: one FMA with the scales' exact
//!   product (FP4: times 2^14) where that rounds the same, the reference's three roundings
//!   otherwise (`accumulate`). One warp adds a unit's blocks in increasing K order, the host
//!   reference's order (reference.hpp), so the result equals the reference bit for bit wherever
//!   the tensor core's block sum is exact.
//! - Measured (docs/perf.md): bound by instruction issue, not by the stream. The FP4 -> f16
//!   conversion (twenty-third session) took a lean stage of 8 blocks from 411 to 330 warp
//!   instructions (the ALU pipe's share from about 220 to 110), and the MoE layer from 41 / 52 /
//!   53% of copy to 47 / 64 / 65% at 1 / 8 / 64 tokens.

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "dsv4/core/error.hpp"
#include "dsv4/core/process_switch.hpp"
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
inline constexpr int stream_stages = 6;               // per warp
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

template <weight_format WF, int TokenTiles, bool AF16>
DSV4_KERNEL void __launch_bounds__(stream_warps * 32, 2)
    streamed_grouped_gemm_kernel(block_scaled_gemm_args g, gemm_groups groups, int max_tiles,
                                 block_scaled_gemm_args g_second, int gemms) {
  using L = stream_layout<WF>;
  constexpr bool kFp8 = L::fp8;
  // A token's activations of one K block for this lane: 8 E4M3 codes, or (AF16) their f16 values.
  using act_frag = std::conditional_t<AF16, uint4, uint2>;
  static_assert(!(AF16 && L::fp8), "f16 activations pair with FP4 weights only (fp4_f16_fragment)");
  constexpr int kStageBlocks = L::stage_blocks, kS = stream_stages;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, quad = lane % 4;
  std::uint64_t* bars = reinterpret_cast<std::uint64_t*>(smem) + warp * kS;
  unsigned char* ring = smem + L::barrier_bytes + warp * kS * L::stage_bytes;
  if (lane == 0)
    for (int s = 0; s < kS; ++s) bulk_copy::init(bars + s, 1);
  bulk_copy::init_fence();
  __syncwarp();
  // The tile list comes from the kernels before (runtime/pdl.cuh). Where it is older than the
  // kernel just before (gemm_groups::list_settled: the MoE's w2), the list is read and the weight
  // stream started first, beside that kernel, and the wait comes before the activations. The list
  // is read past L1 (ld.global.cg) before the wait and by the producer throughout.
  const bool early = groups.list_settled;
  if (!early) runtime::start_after_previous_grid();

  // 32-bit bookkeeping throughout (the host checks that the units fit): a 64-bit division is a
  // hundred-instruction subroutine, and the producer's used to cost as much as the math.
  const int N = g.shape.n, KB = g.shape.k / 32, row_tiles = (N + 15) / 16;
  const int tiles = min(__ldcg(groups.tile_count), max_tiles);
  const int per_gemm = tiles * row_tiles, units = gemms * per_gemm;
  const int warps_total = int(gridDim.x) * stream_warps;
  const int first_unit = warp * int(gridDim.x) + int(blockIdx.x);
  if (first_unit >= units || KB == 0) {  // (the host launches no K = 0 GEMM; never issue an empty stage)
    if (early) runtime::start_after_previous_grid();  // every thread waits (runtime/pdl.cuh's rule)
    return;
  }
  const int chunks = (KB + kStageBlocks - 1) / kStageBlocks;

  struct unit {
    int gemm, tile, rt;
  };
  auto unit_at = [&](int u) {
    const int r = u % per_gemm;
    return unit{u / per_gemm, r / row_tiles, r % row_tiles};
  };
  const std::uint64_t policy = bulk_copy::l2_policy(bulk_copy::l2_eviction::first);
  // The producer (lane 0): the next chunk to copy is chunk p_chunk of unit p_unit (a unit index of
  // the whole grid), into stage p_stage; p_codes / p_scales point at that unit's first K block.
  int p_unit = first_unit, p_chunk = 0, p_stage = 0;
  const std::uint8_t *p_codes = nullptr, *p_scales = nullptr;
  auto issue_next = [&] {
    if (p_unit >= units) return;
    if (p_chunk == 0) {
      const unit un = unit_at(p_unit);
      const long long group = __ldcg(groups.tile_group + un.tile);
      p_codes = (un.gemm ? g_second.w : g.w) + group * groups.w_group_bytes +
                (long long)un.rt * KB * L::block_bytes;
      p_scales = (un.gemm ? g_second.w_s : g.w_s) + group * groups.ws_group_bytes +
                 (long long)un.rt * KB * L::block_scale_bytes;
    }
    const int kb0 = p_chunk * kStageBlocks, nkb = min(kStageBlocks, KB - kb0);
    unsigned char* stage = ring + p_stage * L::stage_bytes;
    std::uint64_t* bar = bars + p_stage;
    bulk_copy::expect_bytes(bar, unsigned(nkb * (L::block_bytes + L::block_scale_bytes)));
    bulk_copy::copy(stage, p_codes + (long long)kb0 * L::block_bytes, unsigned(nkb * L::block_bytes), bar,
                    policy);
    if constexpr (!kFp8)
      bulk_copy::copy(stage + stream_stage_code_bytes, p_scales + (long long)kb0 * L::block_scale_bytes,
                      unsigned(nkb * L::block_scale_bytes), bar, policy);
    p_stage = p_stage + 1 == kS ? 0 : p_stage + 1;
    if (++p_chunk == chunks) p_chunk = 0, p_unit += warps_total;
  };
  if (lane == 0)
    for (int s = 0; s < kS; ++s) issue_next();
  if (early) runtime::start_after_previous_grid();

  int c_stage = 0;
  unsigned c_parity = 0;  // the consumer's stage and the phase it waits for
  for (int u = first_unit; u < units; u += warps_total) {
    const unit un = unit_at(u);
    // (Fields picked one by one: a reference to either parameter struct would copy both to the stack.)
    numerics::bf16* const c_out = un.gemm ? g_second.c : g.c;
    const std::uint8_t* const w_s = un.gemm ? g_second.w_s : g.w_s;
    const int group = groups.tile_group[un.tile];
    const int tok_base = groups.tile_row0[un.tile], tok_end = tok_base + groups.tile_rows[un.tile];
    auto a_index = [&](int r) { return groups.a_row_index ? groups.a_row_index[r] : r; };
    // Rows gid and gid + 8 of the tile; token gid of each token tile (B), tokens 2q, 2q + 1 (C).
    const std::uint8_t* a_row[TokenTiles];
    const std::uint16_t* a16_row[TokenTiles];  // (AF16: the same elements as f16)
    const std::uint8_t* as_row[TokenTiles][2];
#pragma unroll
    for (int t = 0; t < TokenTiles; ++t) {
      const int tok = tok_base + t * 8 + gid;
      const long long a_off = (long long)a_index(tok < tok_end ? tok : tok_base) * g.shape.k + quad * 8;
      a_row[t] = g.a + a_off;
      a16_row[t] = AF16 ? g.a_f16 + a_off : nullptr;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int ct = tok_base + t * 8 + quad * 2 + h;
        as_row[t][h] = g.a_s + (long long)a_index(ct < tok_end ? ct : tok_base) * KB;
      }
    }
    // FP8: one scale per 32 x 32 tile (rows gid and gid + 8 share it), read from global memory.
    const std::uint8_t* ws8 = w_s + (long long)group * groups.ws_group_bytes + (long long)(un.rt / 2) * KB;
    float acc[TokenTiles][4] = {};

    // One K block from stage slot j: the weight fragment from shared memory, the activations'
    // fragments and scales as loaded by the caller, added with the fast scale arithmetic or, for
    // a stage where that could round differently (`unsafe`, rare: extreme or NaN scales), redone
    // with the exact one (see `accumulate`).
    bool unsafe = false;
    // Whether every weight scale code of an FP4 stage (16 per K block, `nkb` blocks: four bytes a
    // lane) lies in [80, 174], where the fast path needs no check per product (see `accumulate`).
    auto fp4_stage_scales_safe = [&](const unsigned char* stage, int nkb) {
      if (lane * 4 >= nkb * L::block_scale_bytes) return true;
      const std::uint32_t w = *reinterpret_cast<const std::uint32_t*>(stage + stream_stage_code_bytes + lane * 4);
      return (__vcmpltu4(w, 0x50505050u) | __vcmpgtu4(w, 0xAEAEAEAEu)) == 0u;
    };
    auto block = [&](const unsigned char* stage, int j, const act_frag (&af)[TokenTiles],
                     const std::uint32_t (&asc)[TokenTiles][2], std::uint32_t ws8c, auto lean, auto exact) {
      constexpr bool kLean = decltype(lean)::value, kExact = decltype(exact)::value;
      // The weight block: FP8 as E4M3 fragments; FP4 straight to f16 times 2^-14, which the
      // scale arithmetic below takes back (kOffset).
      std::uint32_t wc0, wc1;
      using fragment = std::conditional_t<kFp8, e4m3_fragment, fp4_f16_fragment>;
      auto load_fragment = [&]() -> fragment {
        if constexpr (kFp8) {
          const uint4 v = *reinterpret_cast<const uint4*>(stage + j * L::block_bytes + lane * 16);
          const std::uint32_t frag[4] = {v.x, v.z, v.y, v.w};
          return e4m3_fragment(frag);
        } else {
          const uint2 v = *reinterpret_cast<const uint2*>(stage + j * L::block_bytes + lane * 8);
          return fp4_f16_fragment(v.x, v.y);
        }
      };
      const fragment a16 = load_fragment();
      if constexpr (kFp8) {
        wc0 = wc1 = ws8c;
      } else {
        (void)ws8c;
        const unsigned char* sc = stage + stream_stage_code_bytes + j * L::block_scale_bytes;
        wc0 = sc[gid], wc1 = sc[gid + 8];
      }
      constexpr std::uint32_t kOffset = kFp8 ? 0u : std::uint32_t(-fp4_f16_exponent_offset);
      // acc += (d * a_scale) * w_scale, the reference's order (reference.hpp), d the block's true
      // sum (FP4: the MMA's times 2^14). Exact path: that formula on decoded scales (three
      // roundings, as the reference). Fast path: one FMA with
      // 2^(ca + cw - 254) = bits (ca + cw - 127) << 23 (FP4: 14 more, for the MMA's 2^-14), which
      // rounds once to the same value where neither multiply rounds: a nonzero block sum has |d|
      // in [2^-18, 2^23] (E4M3 x E4M3; E2M1 weights: [2^-10, 2^17]), so ca in [19, 231] keeps
      // d * a_scale normal and finite, and ca + cw - 127 in [19, 231] keeps the product so (and
      // the FMA's factor, 14 higher for FP4, normal); cw 255 (NaN) goes the exact way too.
      // FP4 stages have their weight scales checked as a whole (fp4_stage_scales_safe: every code
      // in [80, 174]), so that with ca in [66, 184] the exponent sum stays in [19, 231] with no
      // check per product; FP8 checks each product.
      auto accumulate = [&](float& sum, float d, std::uint32_t ca, std::uint32_t cw) {
        if constexpr (kExact) {
          if constexpr (!kFp8) d = __fmul_rn(d, fp4_f16_rescale);  // exact: |d| >= 2^-24 when nonzero
          sum = __fadd_rn(sum, __fmul_rn(__fmul_rn(d, ue8m0_value(ca)), ue8m0_value(cw)));
        } else {
          const std::uint32_t e = ca + cw - 127u;
          if constexpr (kFp8) unsafe |= (e - 19u > 212u) | (cw > 254u);
          sum = __fmaf_rn(d, __uint_as_float((e + kOffset) << 23), sum);
        }
      };
#pragma unroll
      for (int t = 0; t < TokenTiles; ++t) {
        float d[4];
        if constexpr (kFp8)
          mma_e4m3(a16, af[t].x, af[t].y, d);
        else
          mma_fp4_f16(a16, af[t], d);  // (B as f16 when AF16, else as E4M3 codes)
        constexpr std::uint32_t kLo = kFp8 ? 19u : 66u, kSpan = kFp8 ? 212u : 118u;  // ca in [lo, lo + span]
        if constexpr (!kExact) unsafe |= (asc[t][0] - kLo > kSpan) || (!kLean && asc[t][1] - kLo > kSpan);
        accumulate(acc[t][0], d[0], asc[t][0], wc0);
        accumulate(acc[t][2], d[2], asc[t][0], wc1);
        if constexpr (!kLean) {
          accumulate(acc[t][1], d[1], asc[t][1], wc0);
          accumulate(acc[t][3], d[3], asc[t][1], wc1);
        }
      }
    };
    // The activations of K block kb. Addresses are always valid: B columns past the tile read the
    // tile's first row, and what they compute lands in C columns (tokens) that are never written
    // (an MMA's columns do not mix), so the loads need neither a branch nor a select.
    auto load_activations = [&](int kb, act_frag(&af)[TokenTiles], std::uint32_t(&asc)[TokenTiles][2],
                                std::uint32_t& ws8c, auto lean) {
      constexpr int kTokScales = decltype(lean)::value ? 1 : 2;
#pragma unroll
      for (int t = 0; t < TokenTiles; ++t) {
        if constexpr (AF16)
          af[t] = *reinterpret_cast<const uint4*>(a16_row[t] + kb * 32);
        else
          af[t] = *reinterpret_cast<const uint2*>(a_row[t] + kb * 32);
#pragma unroll
        for (int h = 0; h < 2; ++h) asc[t][h] = h < kTokScales ? std::uint32_t(as_row[t][h][kb]) : 127u;
      }
      ws8c = kFp8 ? std::uint32_t(__ldg(ws8 + kb)) : 127u;
    };
    // Blocks [kb0, kb0 + n) of the stage one at a time, each loading its own activations.
    auto blocks_one_by_one = [&](const unsigned char* stage, int kb0, int n, auto lean, auto exact) {
#pragma unroll 1
      for (int j = 0; j < n; ++j) {
        act_frag af[TokenTiles];
        std::uint32_t asc[TokenTiles][2], ws8c;
        load_activations(kb0 + j, af, asc, ws8c, lean);
        block(stage, j, af, asc, ws8c, lean, exact);
      }
    };
    auto run = [&](auto lean) {
      using fast = std::false_type;
      for (int c = 0; c < chunks; ++c) {
        const int kb0 = c * kStageBlocks, nkb = min(kStageBlocks, KB - kb0);
        const unsigned char* stage = ring + c_stage * L::stage_bytes;
        float saved[TokenTiles][4];  // the sums before the stage, for a redo with exact scales
#pragma unroll
        for (int t = 0; t < TokenTiles; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) saved[t][e] = acc[t][e];
        unsafe = false;
        if (nkb == kStageBlocks) {
          // A full stage, unrolled: its activations are loaded before the wait for its weights
          // (in parts, to stay within the registers: halves with two token tiles, and again
          // halves with f16 activations, twice the bytes of the codes).
          constexpr int kPart = kStageBlocks / TokenTiles / (AF16 && kStageBlocks >= 2 * TokenTiles ? 2 : 1);
#pragma unroll
          for (int p = 0; p < kStageBlocks; p += kPart) {
            act_frag af[kPart][TokenTiles];
            std::uint32_t asc[kPart][TokenTiles][2], ws8c[kPart];
#pragma unroll
            for (int j = 0; j < kPart; ++j) load_activations(kb0 + p + j, af[j], asc[j], ws8c[j], lean);
            if (p == 0) {
              bulk_copy::wait(bars + c_stage, c_parity);
              if constexpr (!kFp8) unsafe |= !fp4_stage_scales_safe(stage, nkb);
            }
#pragma unroll
            for (int j = 0; j < kPart; ++j) block(stage, p + j, af[j], asc[j], ws8c[j], lean, fast{});
          }
        } else {
          // The last, partial stage: one block at a time.
          bulk_copy::wait(bars + c_stage, c_parity);
          if constexpr (!kFp8) unsafe |= !fp4_stage_scales_safe(stage, nkb);
          blocks_one_by_one(stage, kb0, nkb, lean, fast{});
        }
        if (__any_sync(0xFFFFFFFFu, unsafe)) {  // rare: redo the stage with exactly decoded scales
#pragma unroll
          for (int t = 0; t < TokenTiles; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[t][e] = saved[t][e];
          blocks_one_by_one(stage, kb0, nkb, lean, std::true_type{});
        }
        // The stage is read: refill it with the chunk kS ahead (possibly the next unit's).
        __syncwarp();
        if (lane == 0) {
          bulk_copy::fence_before_refill();
          issue_next();
        }
        if (++c_stage == kS) c_stage = 0, c_parity ^= 1u;
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

//! Whether the streamed kernels can run on the current device: this build's device code is for
//! sm_90 or newer and the device is one (bulk copies and transaction barriers are Hopper's).
//! Asked once per device (a pure query: any translation unit's kernel copy gives the same answer).
inline bool streamed_kernels_run_here() {
  static runtime::per_device_ints known = {};
  return runtime::cached_per_device(known, [](int) {
           cudaFuncAttributes attr{};
           const bool yes =
               runtime::compute_capability_major() >= 9 &&
               cudaFuncGetAttributes(&attr, streamed_grouped_gemm_kernel<weight_format::fp4_row32, 1, false>) ==
                   cudaSuccess &&
               attr.ptxVersion >= 90;
           if (!yes) (void)cudaGetLastError();  // a refused query is an answer here, not a later launch's error
           return yes ? 1 : 0;
         }) == 1;
}

struct early_expert_stream_tag {};

}  // namespace detail

//! Process-wide: whether the MoE's w2 (whose tile list the routing wrote two launches before)
//! starts its weight stream before waiting for the SwiGLU launch before it
//! (gemm_groups::list_settled). Off by default until bench_moe --ab-early-stream has measured it.
inline void set_early_expert_stream(bool on) { process_switch<detail::early_expert_stream_tag, false>::set(on); }
inline bool early_expert_stream() { return process_switch<detail::early_expert_stream_tag, false>::on(); }

//! Process-wide: the kernel of the grouped expert GEMMs (bench_moe compares them). With
//! `streamed`, arguments the streamed kernel cannot take (streamed_grouped_gemm_unfit) still run
//! on the per-tile kernel.
inline void set_expert_gemm(expert_gemm k) {
  detail::expert_gemm_choice().store(k);
}
inline expert_gemm current_expert_gemm() {
  return detail::expert_gemm_choice().load();
}

//! Why the streamed grouped GEMM cannot take these arguments (empty: it can). Besides the checks
//! of grouped_block_scaled_gemm it needs a Hopper device and build (bulk copies) and 16-byte
//! aligned weight codes, FP4 scales and group strides (the copies' granule).
inline std::string streamed_grouped_gemm_unfit(const block_scaled_gemm_args& g, const gemm_groups& groups,
                                               weight_format wf, int token_tiles,
                                               const block_scaled_gemm_args* second = nullptr) {
  if (token_tiles != 1 && token_tiles != 2 && token_tiles != 4)
    return "tiles are 8, 16 or 32 rows (token tiles 1, 2 or 4)";
  if (!detail::streamed_kernels_run_here())
    return "bulk copies need a Hopper (sm_90) device and device code built for sm_90 or newer";
  auto misaligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 != 0; };
  const bool fp4 = wf == weight_format::fp4_row32;
  for (const block_scaled_gemm_args* a : {&g, second}) {
    const std::string which = a == second ? " of the second GEMM" : "";
    if (a && misaligned(a->w)) return "the weight codes" + which + " must be 16-byte aligned";
    if (a && fp4 && misaligned(a->w_s)) return "the weight scales" + which + " must be 16-byte aligned";
  }
  // (Both GEMMs of a pair read the first one's f16 activations: check_grouped_args has them equal.)
  if (g.a_f16 && misaligned(g.a_f16)) return "the f16 activations must be 16-byte aligned";
  if (groups.w_group_bytes % 16 != 0 || (fp4 && groups.ws_group_bytes % 16 != 0))
    return "the weight strides between groups must be multiples of 16 bytes";
  return {};
}

namespace detail {
//! streamed_grouped_gemm, or, where streamed_grouped_gemm_unfit gives a reason, nothing: returns
//! that reason (empty: launched, or nothing to do). Bad arguments throw. decode_grouped_gemm falls
//! back on the reason; streamed_grouped_gemm throws it.
inline std::string streamed_grouped_gemm_if_fit(const block_scaled_gemm_args& g, const gemm_groups& groups,
                                                weight_format wf, int max_tiles, int token_tiles,
                                                cudaStream_t stream, const block_scaled_gemm_args* second) {
  detail::check_grouped_args("streamed_grouped_gemm", g, groups, wf, token_tiles, second, 1 << 24);
  // No work (K = 0 is allowed with M = 0): nothing to launch, whatever the device (the kernel
  // must not run with K = 0: its producer's stage count would be zero).
  if (max_tiles <= 0 || g.shape.m == 0 || g.shape.n == 0 || g.shape.k == 0) return {};
  if (auto why = streamed_grouped_gemm_unfit(g, groups, wf, token_tiles, second); !why.empty()) return why;
  const int gemms = second ? 2 : 1;
  const long long max_units = (long long)gemms * max_tiles * ((g.shape.n + 15) / 16);
  if (max_units >= (1LL << 31) - 1LL * detail::stream_warps * 65536)
    throw error("streamed_grouped_gemm: " + std::to_string(max_units) +
                " units of work (GEMMs x tiles x 16-row tiles) exceed the kernel's 32-bit count");
  // The kernel's shared-memory opt-in is an attribute of the current device and of this kernel
  // copy (kernels have internal linkage: each translation unit has its own), so it is made here,
  // beside the launch, once per device and variant: a process driving several GPUs (parallel/, a
  // thread per GPU) makes it on each, and whichever copy of this inline function the program
  // keeps sets up the kernels it launches.
  static runtime::per_device_ints ready[9] = {};  // per variant: CTAs per SM
  auto go = [&](auto kernel, int variant, int smem) {
    const int ctas = runtime::cached_per_device(ready[variant], [&](int) {
      int n = 0;
      DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      DSV4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, detail::stream_warps * 32, smem));
      return n;
    });
    const long long fill = (long long)std::max(1, ctas) * detail::sm_count();
    const unsigned grid = unsigned(std::min(fill, max_units));
    runtime::launch_programmatic(kernel, dim3(grid), dim3(detail::stream_warps * 32), std::size_t(smem),
                                 stream, g, groups, max_tiles, second ? *second : block_scaled_gemm_args{},
                                 gemms);
  };
  // With f16 activations (g.a_f16) the FP4 kernels only: the MoE's routed experts, which have them.
  constexpr weight_format f8 = weight_format::fp8_tile32, f4 = weight_format::fp4_row32;
  // One variant per (format, token tiles, f16 activations); `variant` indexes `ready`.
  auto pick = [&](auto kernel1, auto kernel2, auto kernel4, int variant0, int smem) {
    token_tiles == 1   ? go(kernel1, variant0, smem)
    : token_tiles == 2 ? go(kernel2, variant0 + 1, smem)
                       : go(kernel4, variant0 + 2, smem);
  };
  if (wf == f8) {
    pick(streamed_grouped_gemm_kernel<f8, 1, false>, streamed_grouped_gemm_kernel<f8, 2, false>,
         streamed_grouped_gemm_kernel<f8, 4, false>, 0, stream_layout<f8>::bytes);
  } else if (g.a_f16) {
    pick(streamed_grouped_gemm_kernel<f4, 1, true>, streamed_grouped_gemm_kernel<f4, 2, true>,
         streamed_grouped_gemm_kernel<f4, 4, true>, 3, stream_layout<f4>::bytes);
  } else {
    pick(streamed_grouped_gemm_kernel<f4, 1, false>, streamed_grouped_gemm_kernel<f4, 2, false>,
         streamed_grouped_gemm_kernel<f4, 4, false>, 6, stream_layout<f4>::bytes);
  }
  DSV4_CUDA_CHECK_LAUNCH();
  return {};
}
}  // namespace detail

//! grouped_block_scaled_gemm's GEMM (same arguments and results up to fp32 summation order: here
//! a unit's K blocks are added in K order, as the host reference does) with the weights streamed
//! by bulk copies. Throws dsv4::error on bad arguments or where streamed_grouped_gemm_unfit says why.
inline void streamed_grouped_gemm(const block_scaled_gemm_args& g, const gemm_groups& groups,
                                  weight_format wf, int max_tiles, int token_tiles,
                                  cudaStream_t stream = nullptr,
                                  const block_scaled_gemm_args* second = nullptr) {
  if (auto why = detail::streamed_grouped_gemm_if_fit(g, groups, wf, max_tiles, token_tiles, stream, second);
      !why.empty())
    throw error("streamed_grouped_gemm: " + why);
}

}  // namespace dsv4::kernels::gemm
