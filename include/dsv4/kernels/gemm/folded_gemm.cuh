#pragma once
//! \file
//! The FP8 linear layers of the middle regime (tens to a few hundred tokens: batched decode,
//! speculative verification, short prefill chunks) on Hopper's bf16 warpgroup MMA with the block
//! scales folded into the operands: C[M, N] = A[M, K] W[N, K]^T, the arguments and weight tiles of
//! block_scaled_gemm.cuh (FP8 weights only), bf16 out.
//!
//! Why: below this range the mma.sync kernel streams the weight once per 8 tokens and is bound by
//! the instructions it issues per weight byte; above it the dequantize + cuBLAS path rewrites the
//! whole weight as bf16 at every call (5 bytes moved per weight element). Both stood at 2-3x
//! cuBLAS's own time on bf16 weights at 32-64 tokens (docs/perf.md). Here each CTA reads its
//! weight rows once for all of its tokens, straight from the FP8 tiles, and the tensor core sums
//! the whole K slice without stopping per 32-block.
//!
//! Numerics: the dequantize + cuBLAS path's, not the per-block promotion of the reference. An
//! E4M3 code times its UE8M0 scale is exact in bf16 (4 significant bits, bf16 has fp32's exponent
//! range), so every product is exact and only the order of the fp32 sum differs from the
//! reference (it adds per-32 block sums), as with cuBLAS or split K. Weight codes are decoded by
//! bit placement (`e4m3x4_to_bf16_pairs`), which reads the E4M3 NaN code (S.1111.111) as 480:
//! the checkpoint loader refuses NaN weight codes and scales (model/attention_weights.hpp,
//! reject_nan_codes); activations come from act_quant, which never writes NaN.
//!
//! Method:
//! - One warpgroup per CTA: 64 weight rows (four 16-row tiles, the MMA's M side, as in the other
//!   kernels) x 16 / 32 / 64 / 128 tokens (N) x one K slice. A warp's 16 weight bytes of one K
//!   block per lane are two k16 A fragments once decoded: weights stream from global memory
//!   into registers, four batches of two blocks in flight, requested before the wait for the
//!   kernel before (runtime/pdl.cuh).
//! - Inside every 32-block both operands see the same K permutation: lane q of a quad holds
//!   elements 8q .. 8q + 7, decoded into the pairs (0, 2), (1, 3), (4, 6), (5, 7) that the MMA
//!   sees as K (2q, 2q + 1) and (8 + 2q, 9 + 2q) of two k16 steps; the dot product is unchanged.
//! - Activations are decoded and scaled the same way into shared memory as wgmma's K-major core
//!   matrices, 16 KB of them a chunk in a ring of three: a chunk is staged while the MMAs read
//!   the one before, and with one batch of MMAs left in flight per warp (wait_group 1) the
//!   chunk two back is never still being read (one barrier per chunk suffices).
//! - Split K and the last-CTA reduction as in block_scaled_gemm.cuh (`finish_split_k`).

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/core/process_switch.hpp"
#include "dsv4/kernels/bulk_copy.cuh"
#include "dsv4/kernels/gemm/block_scaled_gemm.cuh"
#include "dsv4/kernels/gemm/wgmma_gemm.cuh"
#include "dsv4/kernels/wgmma.cuh"
#include "dsv4/runtime/device_info.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::gemm {

//! Where block_scaled_linear gives FP8 GEMMs to this kernel (where it can run: wgmma_supported()):
//! folded_min_tokens .. folded_max_tokens tokens for weights of at least folded_min_rows output
//! features, and folded_min_tokens .. folded_large_max_tokens for any weight of at least
//! folded_min_elements (N x K). Measured on an H100 (bench_gemm, thirty-seventh session, 1656f41:
//! the scales under one branch a batch) against the mma.sync kernel below 64 tokens and the
//! dequantize + cuBLAS path from 64: wq_b (32768 x 1280) at 16 / 32 / 64 / 128 / 256 tokens
//! 22.9 / 25.2 / 33.3 / 49.5 / 79.7 us against 24.5 / 44.2 / 79.7 / 81.3 / 87.2; wo_b (5120 x 8192,
//! its K split) 27.4 / 34.7 / 50.4 / 68.4 against 30.4 / 60.7 / 82.1 / 81.2 up to 128 tokens, and
//! 115.9 against 86.5 at 256. Smaller weights lose at most counts (wq_a, wkv, the indexer's wq_b,
//! the shared expert's w2: 1.1-1.9x the other path's time; the shared expert's w1 wins 20.7 against
//! 22.5 at 32 tokens alone, but runs as a pair with w3 there, one launch). CTAs of two warpgroups
//! and activation chunks requested further ahead did not help (docs/decisions.md, thirty-sixth
//! session).
inline constexpr int folded_min_tokens = 16;
inline constexpr int folded_max_tokens = 256;
inline constexpr int folded_min_rows = 8192;
inline constexpr long long folded_min_elements = 1LL << 25;
inline constexpr int folded_large_max_tokens = 128;

namespace detail {

inline constexpr int folded_rows_per_cta = 64;    // one warpgroup: four 16-row weight tiles
inline constexpr int folded_chunk_bytes = 16384;  // staged activations per ring slot
inline constexpr int folded_ring = 3;             // ring slots (see the file comment)
inline constexpr int folded_unroll = 2;           // K blocks per batch of wgmmas
inline constexpr int folded_weight_depth = 12;    // K blocks of weights in flight per thread (cp.async)
inline constexpr int folded_depth = folded_weight_depth / folded_unroll;  // batches of them

struct folded_linears_tag;
inline std::atomic<unsigned long long>& folded_gemm_launches() {
  static std::atomic<unsigned long long> launches{0};
  return launches;
}

//! Four E4M3 codes (lowest byte first) as two bf16 pairs holding each value times 2^-120: the
//! code's 7 magnitude bits placed at bf16's exponent-and-mantissa bits 4..10 (normals and
//! subnormals alike: E4M3's exponent bias is 7, bf16's 127) and its sign at bit 15. `even` holds
//! codes 0 and 2 (low, high half), `odd` codes 1 and 3. Six integer instructions for four codes.
DSV4_DEVICE void e4m3x4_to_bf16_pairs(std::uint32_t w, std::uint32_t& even, std::uint32_t& odd) {
  constexpr std::uint32_t magnitude = 0x07F007F0u;  // bits 4..10 of each half
  const std::uint32_t sign = w & 0x80808080u;
  even = ((w << 4) & magnitude) | ((sign << 8) & ~magnitude);  // one LOP3 each after the shifts
  odd = ((w >> 4) & magnitude) | (sign & ~magnitude);
}

//! Scaling e4m3x4_to_bf16_pairs's values into code x 2^(s - 127) (UE8M0 scale code s): one exact
//! multiply by 2^(s - 7) where that is a bf16 normal (s <= fold_one_multiply_max: every scale a
//! trained weight or act_quant has), else two (`fold_scale_wide`; 255 is UE8M0's NaN). The caller
//! picks the form per warp (a vote), so the common path has no branch per pair.
inline constexpr std::uint32_t fold_one_multiply_max = 134;
DSV4_DEVICE std::uint32_t bf16_pair(std::uint32_t bits16) {
  return bits16 | bits16 << 16;
}
DSV4_DEVICE std::uint32_t bf16x2_mul(std::uint32_t a, std::uint32_t b) {
  std::uint32_t r;
  // a * b + (-0): exact for powers of two; -0 keeps a product's sign when it is zero.
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
  return r;
}
DSV4_DEVICE std::uint32_t fold_multiplier(std::uint32_t s) {
  return bf16_pair((s + 120u) << 7);
}
DSV4_DEVICE std::uint32_t fold_scale_wide(std::uint32_t x, std::uint32_t s) {
  if (s <= fold_one_multiply_max) return bf16x2_mul(x, fold_multiplier(s));
  return bf16x2_mul(bf16x2_mul(x, bf16_pair(247u << 7)), bf16_pair(s == 255u ? 0x7FC0u : s << 7));
}

template <int Tokens>
struct folded_smem {
  static constexpr int blocks = folded_chunk_bytes / (2 * Tokens * 32);  // K blocks per slot
  // Per slot, K block and k16 step: the B tile (Tokens x 16 bf16 as core matrices).
  alignas(128) std::uint8_t b[folded_ring][blocks][2][Tokens * 32];
  // Per K block in flight and thread: its 16 weight bytes (the A fragments of two k16 steps).
  alignas(16) std::uint8_t w[folded_weight_depth][128][16];
  std::uint64_t bar[folded_ring];  // the slots' bulk copies
  // Followed by the warps' weight scales of the slice (folded_scale_bytes).
};

//! Per warp, the weight scales of a slice of `kbps` K blocks and two past it (127: the last batch
//! of an odd count reads one).
DSV4_HOST_DEVICE constexpr int folded_scale_stride(int kbps) {
  return kbps + 2;
}
//! Bytes after folded_smem for the four warps' scales.
inline constexpr std::size_t folded_scale_bytes(int kbps) {
  return (std::size_t(4) * folded_scale_stride(kbps) + 15) / 16 * 16;
}

//! Bytes of one K block of one token group's folded activations: two k16 steps of B tiles.
DSV4_HOST_DEVICE constexpr int folded_block_bytes(int tokens) {
  return 2 * tokens * 32;
}

//! The activations of a folded GEMM, decoded and scaled once into exactly the shared-memory tiles
//! the MMAs read ([token group][K block][k16 step][Tokens x 16 bf16 as core matrices]; tokens past
//! M are zeros), so each CTA only copies them. One thread per 8 codes (elements 8q .. 8q + 7 of
//! one token and block): four bf16 pairs, one row of four core matrices.
DSV4_KERNEL void fold_activations_kernel(const std::uint8_t* a, const std::uint8_t* a_s, int M, int K,
                                         int tokens, long long runs, std::uint8_t* out) {
  runtime::start_after_previous_grid();  // the activations come from the kernel before
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= runs) return;
  const int KB = K / 32, q = int(i % 4), t = int((i / 4) % tokens), kb = int((i / (4 * tokens)) % KB);
  const long long group = i / (4LL * tokens * KB);
  const long long tok = group * tokens + t;
  std::uint32_t p[4] = {0, 0, 0, 0};  // step 0 K halves 0 / 1, step 1 K halves 0 / 1
  if (tok < M) {
    const uint2 v = *reinterpret_cast<const uint2*>(a + tok * K + kb * 32 + q * 8);
    const std::uint32_t sc = a_s[tok * KB + kb];
    e4m3x4_to_bf16_pairs(v.x, p[0], p[1]);
    e4m3x4_to_bf16_pairs(v.y, p[2], p[3]);
#pragma unroll
    for (int h = 0; h < 4; ++h) p[h] = fold_scale_wide(p[h], sc);
  }
  std::uint8_t* block = out + (group * KB + kb) * folded_block_bytes(tokens);
#pragma unroll
  for (int step = 0; step < 2; ++step) {
    std::uint8_t* row = block + step * tokens * 32 + (t % 8) * 16 + 4 * q;
    *reinterpret_cast<std::uint32_t*>(row + wgmma::b_core_offset(t / 8, 0)) = p[2 * step];
    *reinterpret_cast<std::uint32_t*>(row + wgmma::b_core_offset(t / 8, 1)) = p[2 * step + 1];
  }
}

//! One CTA: one warpgroup, 64 weight rows (warp w: row tile 4 z + w) x Tokens tokens, one K slice
//! of `kbps` blocks. Grid: x = token groups, y = K slices, z = row groups.
template <int Tokens>
DSV4_KERNEL void __launch_bounds__(128, 3)  // three CTAs an SM, as shared memory allows
    folded_gemm_kernel(block_scaled_gemm_args g, const std::uint8_t* folded_a, int kbps, int slices,
                       float* partials, unsigned* counters) {
  static_assert(Tokens == 16 || Tokens == 32 || Tokens == 64 || Tokens == 128,
                "the folded kernel's N is 16, 32, 64 or 128 tokens");
  using smem_t = folded_smem<Tokens>;
  constexpr int kC = smem_t::blocks, kU = folded_unroll, kAcc = Tokens / 2,
                kTileBytes = tile_code_bytes(weight_format::fp8_tile32);
  static_assert(kU == 2, "decode_weights votes on both blocks' scales");
  static_assert(kC % kU == 0, "a chunk holds whole batches of K blocks");
  extern __shared__ __align__(128) unsigned char folded_smem_bytes[];
  smem_t& sm = *reinterpret_cast<smem_t*>(folded_smem_bytes);
  const int M = g.shape.m, N = g.shape.n, K = g.shape.k, KB = K / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, quad = lane % 4;
  const int rt = int(blockIdx.z) * 4 + warp;  // this warp's 16-row weight tile
  const bool tile_ok = rt < (N + 15) / 16;
  const int tok_base = int(blockIdx.x) * Tokens;
  const int kb_begin = int(blockIdx.y) * kbps, kb_end = min(KB, kb_begin + kbps);
  const std::uint8_t* w_tile =
      g.w + (long long)(tile_ok ? rt : 0) * KB * kTileBytes + lane * (kTileBytes / 32);
  const std::uint8_t* w_scale = g.w_s + (long long)((tile_ok ? rt : 0) / 2) * KB;  // one per 32 x 32 tile

  // This warp's weight scales, by kb - kb_begin.
  std::uint8_t* const scales = folded_smem_bytes + sizeof(smem_t) + warp * folded_scale_stride(kbps);
  // Weights: each thread copies its own 16 bytes of each K block into its slot of the ring
  // (cp.async, one group per batch, zero-filled past the slice or the rows), folded_depth batches
  // ahead.
  // A batch's ring slots: `slot` and slot + 1 (slot = (kb0 - kb_begin) % folded_weight_depth, even,
  // computed once a batch: the refill folded_weight_depth blocks on takes the same two slots).
  static_assert(folded_weight_depth % kU == 0, "a batch's slots are consecutive");
  auto copy_weights = [&](int kb0, int slot) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int kb = kb0 + u;
      const bool go = tile_ok && kb < kb_end;
      const auto dst = static_cast<std::uint32_t>(
          __cvta_generic_to_shared(sm.w[slot + u][threadIdx.x]));
      // (An L2::cache_hint operand here made the H200 fault: illegal instruction at the LDGSTS.)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                   "l"(w_tile + (long long)(go ? kb : 0) * kTileBytes), "r"(go ? 16 : 0)
                   : "memory");
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  // Activations: one bulk copy per chunk (K blocks kb0 .. kb0 + kC - 1 of the CTA's folded
  // activations, contiguous) onto the slot's barrier, issued by thread 0; blocks past the slice's
  // end are zeroed by everyone instead (they meet zero weights, and stale or never-written shared
  // memory could hold NaN), made visible at the chunk's barrier.
  const std::uint8_t* a_tiles = folded_a + (long long)blockIdx.x * KB * folded_block_bytes(Tokens);
  auto copy_chunk = [&](int slot, int kb0) {
    const int valid = max(0, min(kC, kb_end - kb0));
    if (threadIdx.x == 0 && valid > 0) {
      bulk_copy::fence_before_refill();
      const unsigned bytes = unsigned(valid * folded_block_bytes(Tokens));
      bulk_copy::expect_bytes(&sm.bar[slot], bytes);
      bulk_copy::copy(sm.b[slot], a_tiles + (long long)kb0 * folded_block_bytes(Tokens), bytes, &sm.bar[slot],
                      bulk_copy::l2_policy(bulk_copy::l2_eviction::normal));
    }
    for (int at = valid * folded_block_bytes(Tokens) + int(threadIdx.x) * 16; at < folded_chunk_bytes;
         at += 128 * 16)
      *reinterpret_cast<uint4*>(&sm.b[slot][0][0][0] + at) = make_uint4(0, 0, 0, 0);
  };
  // A fragments of one batch: per block two k16 steps (elements 0..3, then 4..7 of each lane).
  struct fragments {
    std::uint32_t a[kU][2][4];
  };
  auto decode_weights = [&](int kb0, int slot, fragments& f) {
    std::uint32_t scale[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) scale[u] = scales[kb0 + u - kb_begin];
    // A warp's scales are one 32 x 32 tile's: the vote only makes the branch provably uniform.
    const bool narrow =
        __all_sync(0xFFFFFFFFu, scale[0] <= fold_one_multiply_max && scale[kU - 1] <= fold_one_multiply_max);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint4 code =
          *reinterpret_cast<const uint4*>(sm.w[slot + u][threadIdx.x]);
      // Lane bytes: row g elements 8q .. 8q + 3, + 4 .., row g + 8 the same.
      const std::uint32_t words[4] = {code.x, code.y, code.z, code.w};
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        auto& p = f.a[u][step];
        e4m3x4_to_bf16_pairs(words[step], p[0], p[2]);      // row g: K (2q, 2q + 1), (8 + 2q, ..)
        e4m3x4_to_bf16_pairs(words[2 + step], p[1], p[3]);  // row g + 8
      }
    }
    // Then the scales, under one branch for the whole batch: a branch per pair (the choice
    // written inside the loop) split the decoding into 16 small blocks a batch in the PTX.
    if (narrow) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const std::uint32_t m = fold_multiplier(scale[u]);
#pragma unroll
        for (int step = 0; step < 2; ++step)
#pragma unroll
          for (int h = 0; h < 4; ++h) f.a[u][step][h] = bf16x2_mul(f.a[u][step][h], m);
      }
    } else {
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int step = 0; step < 2; ++step)
#pragma unroll
          for (int h = 0; h < 4; ++h) f.a[u][step][h] = fold_scale_wide(f.a[u][step][h], scale[u]);
    }
  };

  float acc[kAcc] = {};
  // One batch: when a chunk starts, wait for its activations and start the next chunk's; wait
  // for the batch's weights, decode them into the fragment set `f` (its last MMAs, two batches
  // back, are complete), issue the batch's 2 kU wgmmas (left in flight until the next batch is
  // issued), then refill the weights' ring slots folded_depth batches on.
  auto batch = [&](fragments& f, int kb0) {
    const int step = kb0 - kb_begin, chunk = step / kC, slot = chunk % folded_ring, at = step % kC;
    if (at == 0) {
      // The slot's bulk copy has landed (and this thread's zero fill is handed to the async
      // proxy); after the barrier the next chunk's slot is free: it was last read two chunks
      // back, whose MMAs every warp completed (wait_group 1) before reaching this barrier.
      bulk_copy::wait(&sm.bar[slot], unsigned(chunk / folded_ring) & 1u);
      wgmma::fence_shared_for_async();
      __syncthreads();
      if (kb0 + kC < kb_end) copy_chunk((chunk + 1) % folded_ring, kb0 + kC);
    }
    asm volatile("cp.async.wait_group %0;\n" ::"n"(folded_depth - 1) : "memory");
    const int wslot = step % folded_weight_depth;
    decode_weights(kb0, wslot, f);
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) wgmma::fence_operand(f.a[u][s][i]);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) wgmma::fence_operand(acc[i]);
    // Blocks past the slice's end (the last batch of an odd count) have zero weights and zero
    // activations: they add zeros, and no branch sits between the wgmmas. The warp reconverges
    // first (thread 0's copies, the barrier waits): wgmma is `.aligned`.
    __syncwarp();
    wgmma::fence();
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int s = 0; s < 2; ++s)
        wgmma::mma_bf16<Tokens>(acc, f.a[u][s],
                                wgmma::smem_descriptor(sm.b[slot][at + u][s], wgmma::b_leading_byte_offset,
                                                       wgmma::b_stride_byte_offset),
                                true);
    wgmma::commit_group();
    // The fragments were read from the ring slots before the wgmmas that use them were issued:
    // the slots can take the next copies.
    copy_weights(kb0 + folded_weight_depth, wslot);
    wgmma::wait_group<1>();
#pragma unroll
    for (int i = 0; i < kAcc; ++i) wgmma::fence_operand(acc[i]);
  };

  if (threadIdx.x == 0) {
    for (int i = 0; i < folded_ring; ++i) bulk_copy::init(&sm.bar[i], 1);
    bulk_copy::init_fence();
  }
  // The first weights and the slice's scales do not depend on the kernel before: requested
  // before waiting for it.
  for (int d = 0; d < folded_depth; ++d) copy_weights(kb_begin + kU * d, kU * d);
  for (int i = lane; i < folded_scale_stride(kbps); i += 32)
    scales[i] = tile_ok && kb_begin + i < kb_end ? w_scale[kb_begin + i] : std::uint8_t(127);
  __syncthreads();  // the barriers' initialisation
  runtime::start_after_previous_grid();
  copy_chunk(0, kb_begin);
  fragments f0, f1;
  for (int kb0 = kb_begin; kb0 < kb_end;) {
    batch(f0, kb0);
    if ((kb0 += kU) >= kb_end) break;
    batch(f1, kb0);
    kb0 += kU;
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives the CTA
  wgmma::wait_group<0>();
#pragma unroll
  for (int i = 0; i < kAcc; ++i) wgmma::fence_operand(acc[i]);

#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const int row = rt * 16 + gid + 8 * ((i % 4) / 2), tok = tok_base + 8 * (i / 4) + 2 * quad + i % 2;
    if (!tile_ok || row >= N || tok >= M) continue;
    if (slices == 1)
      g.c[(long long)tok * N + row] = numerics::bf16::from_float(acc[i]);
    else
      partials[((long long)blockIdx.y * M + tok) * N + row] = acc[i];
  }
  if (slices == 1) return;
  const int row0 = int(blockIdx.z) * folded_rows_per_cta;
  finish_split_k(g.c, partials, counters + blockIdx.z * gridDim.x + blockIdx.x, slices, M, N, row0,
                 min(folded_rows_per_cta, N - row0), tok_base, min(Tokens, M - tok_base));
}

struct folded_plan {
  int tokens = 16;  // the MMA's N: tokens per CTA
  int slices = 1;
  int kbps = 0;  // K blocks per slice
  unsigned token_groups = 0, row_groups = 0;
};

//! The most tokens per CTA a plan for M tokens takes: the smallest N that holds them (128 at most).
inline int folded_first_tokens(int m) {
  return m <= 16 ? 16 : m <= 32 ? 32 : m <= 64 ? 64 : 128;
}

//! `options` override make_folded_plan's choices (bench_gemm --folded-plans sweeps them; 0 keeps
//! the default): tokens per CTA (16, 32, 64 or 128, at most folded_first_tokens(M)) and K slices
//! (at most one per K block; the workspace's partials still cap them).
struct folded_plan_options {
  int tokens = 0;
  int slices = 0;
};

//! Tokens per CTA: the smallest N that holds the GEMM's tokens (128 at most: more token groups).
//! K is split until about three CTAs per SM stream weights, each slice at least folded_depth
//! batches, the last CTA's reduction at most 128 partials per thread, rounded down to a power of
//! two, and as far as the workspace holds the partials. Where those caps leave the grid below
//! three quarters of that, fewer tokens per CTA (more token groups, which read the same weights
//! mostly from L2) are taken first. The rounding and the three quarters are measured (bench_gemm
//! --folded-plans, thirty-seventh session, H100): wo_b (5120 x 8192) at 32 / 64 / 128 tokens ran
//! fastest at 32 x 4, 64 x 4 and 64 x 2 (tokens x slices: 40.1 / 55.9 / 79.3 us) where the plan
//! before took 32 x 5, 32 x 3 and 64 x 3 (46.8 / 67.5 / 91.3 us); wq_b's 512 tiles take no split
//! (one slice was the fastest at every width: a split's partials cost more than its parallelism).
inline folded_plan make_folded_plan(const gemm_shape& s, int sms, std::size_t partial_floats,
                                    const folded_plan_options& o = {}) {
  const int kb = s.k / 32;
  if ((o.tokens != 0 && o.tokens != 16 && o.tokens != 32 && o.tokens != 64 && o.tokens != 128) ||
      o.tokens > folded_first_tokens(std::max(1, s.m)) || o.slices < 0)
    throw error("folded_gemm: plan options need tokens 0 (default), 16, 32, 64 or 128 up to " +
                std::to_string(folded_first_tokens(std::max(1, s.m))) + " and slices >= 0, not " +
                std::to_string(o.tokens) + " and " + std::to_string(o.slices));
  const long long target = 3LL * sms;
  const std::size_t per_slice = std::size_t(s.m) * std::size_t(s.n);
  auto plan_for = [&](int tokens) {
    folded_plan p;
    p.tokens = tokens;
    p.row_groups = unsigned((s.n + folded_rows_per_cta - 1) / folded_rows_per_cta);
    p.token_groups = unsigned((s.m + tokens - 1) / tokens);
    const long long tiles = (long long)p.row_groups * p.token_groups;
    long long slices = 1;
    if (tiles <= (long long)gemm_workspace::max_tiles) {
      if (o.slices) {
        slices = std::min(o.slices, std::max(1, kb));
      } else if (tiles < target) {
        slices = std::min<long long>((target + tiles - 1) / tiles,
                                     std::max(1, kb / (folded_depth * folded_unroll)));
        const long long tile_outputs = (long long)folded_rows_per_cta * std::min(s.m, tokens);
        slices = std::min<long long>(slices, std::max<long long>(1, 128LL * 128 / tile_outputs));
        slices = std::bit_floor(std::uint64_t(slices));  // a power of two (see the comment above)
      }
    }
    if (per_slice)
      slices = std::min<long long>(slices, (long long)std::max<std::size_t>(1, partial_floats / per_slice));
    p.kbps = int((kb + slices - 1) / slices);
    p.slices = p.kbps ? (kb + p.kbps - 1) / p.kbps : 1;  // no empty slice
    return p;
  };
  if (o.tokens) return plan_for(o.tokens);
  int tokens = folded_first_tokens(s.m);
  folded_plan p = plan_for(tokens);
  while (tokens > 16 && (long long)p.row_groups * p.token_groups * p.slices < target * 3 / 4)
    p = plan_for(tokens /= 2);
  return p;
}

}  // namespace detail

//! Partial floats a workspace needs for this shape's full split on the folded kernel (0: none).
inline std::size_t folded_partial_floats(const gemm_shape& s) {
  if (s.m <= 0 || s.n <= 0 || s.k < 32) return 0;
  const auto p = detail::make_folded_plan(s, detail::sm_count(), ~std::size_t(0) / 8);
  return p.slices > 1 ? std::size_t(p.slices) * s.m * s.n : 0;
}

//! Bytes of decoded activations a folded GEMM of this shape needs in its workspace: its tokens
//! rounded up to whole token groups, K bf16 each. Whatever the plan (its tokens per CTA depend
//! on the workspace's partials), they are at most folded_first_tokens and divide it, so rounding
//! up to that covers every plan.
inline std::size_t folded_scratch_bytes(const gemm_shape& s) {
  if (s.m <= 0 || s.k < 32) return 0;
  const long long t = detail::folded_first_tokens(s.m);
  return std::size_t((s.m + t - 1) / t * t) * std::size_t(s.k) * 2;
}

//! Workspace bytes (gemm_workspace's `folded_bytes`) for folded GEMMs of up to `max_m` tokens and
//! `max_k` input features: none below folded_min_tokens; tokens past folded_max_tokens never
//! fold, and any plan's token groups fit in the tokens rounded up to 128.
inline std::size_t folded_bytes_for(long long max_m, long long max_k) {
  if (max_m < folded_min_tokens || max_k < 32) return 0;
  const long long rows = (std::min<long long>(max_m, folded_max_tokens) + 127) / 128 * 128;
  return std::size_t(rows) * std::size_t(max_k) * 2;
}

//! Folded GEMMs launched so far in this process (tests check that a path was taken).
inline unsigned long long folded_gemm_calls() {
  return detail::folded_gemm_launches().load();
}

namespace detail {

//! folded_gemm's launches under plan `p` (make_folded_plan's, or bench_gemm's sweep of options).
inline void launch_folded(const block_scaled_gemm_args& g, const folded_plan& p, gemm_workspace& workspace,
                          cudaStream_t stream) {
  const std::size_t scratch = folded_scratch_bytes(g.shape);
  if (std::size_t(p.token_groups) * std::size_t(p.tokens) * std::size_t(g.shape.k) * 2 > scratch)
    throw error("folded_gemm: internal: a plan of " + std::to_string(p.token_groups) + " x " +
                std::to_string(p.tokens) + " tokens outgrows folded_scratch_bytes");
  if (std::size_t(p.token_groups) * std::size_t(p.tokens) * std::size_t(g.shape.k) * 2 >
      workspace.folded_bytes())
    throw error("folded_gemm: a plan of " + std::to_string(p.token_groups) + " x " +
                std::to_string(p.tokens) + " tokens outgrows the workspace's " +
                std::to_string(workspace.folded_bytes()) + " bytes of folded activations");
  if (p.slices > 1 &&
      (std::size_t(p.slices) * std::size_t(g.shape.m) * std::size_t(g.shape.n) > workspace.partial_floats() ||
       std::size_t(p.row_groups) * p.token_groups > gemm_workspace::max_tiles))
    throw error("folded_gemm: internal: a plan of " + std::to_string(p.slices) +
                " K slices outgrows the workspace's partials or counters");
  const long long runs = (long long)p.token_groups * p.tokens * (g.shape.k / 32) * 4;
  runtime::launch_programmatic(detail::fold_activations_kernel, dim3(unsigned((runs + 255) / 256)), dim3(256),
                               0, stream, g.a, g.a_s, g.shape.m, g.shape.k, p.tokens, runs,
                               static_cast<std::uint8_t*>(workspace.folded()));
  DSV4_CUDA_CHECK_LAUNCH();
  const dim3 grid(p.token_groups, unsigned(p.slices), p.row_groups);
  const std::uint8_t* folded_a = workspace.folded();
  float* partials = workspace.partials();
  unsigned* counters = workspace.counters();
  // 48 KB of ring: above the static limit, so a dynamic-shared-memory opt-in, made once per
  // device and width beside the launch (as streamed_gemm.cuh does, for the same reasons).
  // The opt-in is the most the device allows (the scales' bytes grow with K).
  static runtime::per_device_ints ready[4] = {};
  auto go = [&](auto kernel, int variant, std::size_t ring) {
    const int most = runtime::cached_per_device(ready[variant], [&](int device) {
      int optin = 0;
      DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
      cudaFuncAttributes attr{};
      DSV4_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
      const int dynamic = optin - int(attr.sharedSizeBytes);  // the kernel's static bytes count too
      DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic));
      return dynamic;
    });
    const std::size_t smem = ring + detail::folded_scale_bytes(p.kbps);
    if (smem > std::size_t(most))
      throw error("folded_gemm: a K slice of " + std::to_string(p.kbps) + " blocks needs " +
                  std::to_string(smem) + " bytes of shared memory, the device allows " +
                  std::to_string(most));
    runtime::launch_programmatic(kernel, grid, dim3(128), smem, stream, g, folded_a, p.kbps, p.slices,
                                 partials, counters);
  };
  switch (p.tokens) {
    case 16:
      go(detail::folded_gemm_kernel<16>, 0, sizeof(detail::folded_smem<16>));
      break;
    case 32:
      go(detail::folded_gemm_kernel<32>, 1, sizeof(detail::folded_smem<32>));
      break;
    case 64:
      go(detail::folded_gemm_kernel<64>, 2, sizeof(detail::folded_smem<64>));
      break;
    default:
      go(detail::folded_gemm_kernel<128>, 3, sizeof(detail::folded_smem<128>));
      break;
  }
  DSV4_CUDA_CHECK_LAUNCH();
  folded_gemm_launches().fetch_add(1);
}

}  // namespace detail

//! C = A W^T for an FP8 weight on the folded kernel (bf16 out); arguments and errors as
//! block_scaled_gemm. The workspace holds the decoded activations (folded_scratch_bytes: too
//! small is an error that names both sizes) and the split-K partials (too few: a narrower split).
//! Two launches: the activations' decoding, then the GEMM, which requests its first weights
//! while the decoding runs (runtime/pdl.cuh).
inline void folded_gemm(const block_scaled_gemm_args& g, gemm_workspace& workspace,
                        cudaStream_t stream = nullptr) {
  if (auto why = detail::check_args(g, weight_format::fp8_tile32); !why.empty())
    throw error("folded_gemm: " + why);
  if (g.shape.m == 0 || g.shape.n == 0) return;
  detail::require_wgmma("folded_gemm");
  const std::size_t scratch = folded_scratch_bytes(g.shape);
  if (workspace.folded_bytes() < scratch)
    throw error("folded_gemm: the workspace holds " + std::to_string(workspace.folded_bytes()) +
                " bytes of folded activations, M " + std::to_string(g.shape.m) + " x K " +
                std::to_string(g.shape.k) + " needs " + std::to_string(scratch) +
                " (gemm_workspace's folded_bytes, folded_bytes_for)");
  detail::launch_folded(g, detail::make_folded_plan(g.shape, detail::sm_count(), workspace.partial_floats()),
                        workspace, stream);
}

//! Process-wide: whether block_scaled_linear may take the folded kernel (the default; off: the
//! mma.sync kernel and the dequantize + cuBLAS path as before it, for comparisons such as
//! bench_model --no-folded). Read when a linear layer is launched (or a graph captured).
inline void set_folded_linears(bool on) {
  process_switch<detail::folded_linears_tag>::set(on);
}
inline bool folded_linears() {
  return process_switch<detail::folded_linears_tag>::on();
}

//! Whether a weight of this shape folds at its token count (the measured range above).
inline bool folded_shape(const gemm_shape& s) {
  if (s.m < folded_min_tokens) return false;
  if (s.n >= folded_min_rows) return s.m <= folded_max_tokens;
  return (long long)s.n * s.k >= folded_min_elements && s.m <= folded_large_max_tokens;
}

//! Whether block_scaled_linear gives this GEMM to the folded kernel (folded_linears() on): FP8
//! weights of a shape folded_shape takes, a workspace with room for the activations and a device
//! that runs wgmma.
inline bool takes_folded_path(const gemm_shape& s, weight_format wf, const gemm_workspace* workspace) {
  return folded_linears() && wf == weight_format::fp8_tile32 && folded_shape(s) && workspace &&
         workspace->folded_bytes() >= folded_scratch_bytes(s) && wgmma_supported();
}

}  // namespace dsv4::kernels::gemm
