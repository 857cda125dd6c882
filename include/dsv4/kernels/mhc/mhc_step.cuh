#pragma once
//! \file
//! CUDA mHC sublayer boundary, fused (spec §8): one pass over the four streams computes
//!   Y = hc_post(F, X, post, comb), h = rmsnorm(hc_pre(Y, pre), w), next = hc_coefficients(Y)
//! for every token (host reference: reference.hpp `boundary_step_reference`). The streams are
//! read once and written once: X (4d) and F (d) in, Y (4d) and h (d) out, the article's (2n+2)d
//! (h is also written unnormalized once and read back, 2d more, because its RMS statistic is only
//! known after the pass). The 24 x 4d fp32 projection weight is read once per token slice
//! (from L2 after the first).
//!
//! Work split: a CTA takes a slice of 128 positions of d (all four streams) for a group of tokens
//! (one at decode, by default up to 16 tokens a call; then 2, 4, and from 65 tokens 8 or 16:
//! set_one_token_ctas_up_to, set_small_token_groups, set_prefill_token_group). It computes
//! Y and h there (Y kept in shared memory), then the slice's share of the 24 projections, each
//! weight row read once per group and used for all its tokens. Partial sums (the squares of Y and
//! of h in double, like the host reference, so the RMS statistics match it bit for bit in practice;
//! the 24 projections in fp32 over 16 products per lane, then double) go to a workspace; the last
//! CTA of a group to arrive adds the slices, runs the Sinkhorn split and normalizes h. Every sum
//! has an order fixed by the shape, so results do not depend on arrival order.
//!
//! Decode latency (docs/decisions.md, "mhc_step at decode"): the weight slice is requested before
//! the programmatic wait (straight into registers, or by bulk copies into shared memory:
//! set_decode_weights_in_registers), phase 1 gives each of the 128 threads
//! one position, the warps' 6 projection rows run side by side, and the last CTA loads the
//! partials in one round trip. What is left at one token (~7 us a step on the H200) is mostly
//! the Sinkhorn split's 39 dependent normalizations (~2.8 us) and the hand-off to the last CTA.

#include <cuda_runtime.h>  // provides cudaStream_t, uint4

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "dsv4/core/error.hpp"
#include "dsv4/core/process_switch.hpp"
#include "dsv4/kernels/bulk_copy.cuh"
#include "dsv4/kernels/mhc/sinkhorn.cuh"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/quantize.cuh"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "dsv4/runtime/device_info.cuh"
#include "dsv4/runtime/pdl.cuh"

namespace dsv4::kernels::mhc {

struct mhc_step_args {
  const numerics::bf16* x = nullptr;  //!< [tokens, 4, dim] streams the sublayer consumed
  const numerics::bf16* f = nullptr;  //!< [tokens, dim] sublayer output; null: Y = X (model entry)
  const float* post = nullptr;        //!< [tokens, 4] coefficients that apply F (unused without F)
  const float* comb = nullptr;        //!< [tokens, 4, 4]
  const float* pre = nullptr;         //!< [tokens, 4] pre-mix of the next sublayer's input
  const numerics::bf16* norm_w = nullptr;  //!< [dim] RMSNorm weight of the next sublayer
  float norm_eps = 1e-20f;
  numerics::bf16* y = nullptr;        //!< [tokens, 4, dim] new streams (unused without F)
  numerics::bf16* h = nullptr;        //!< [tokens, dim] normalized input of the next sublayer
  // Coefficients of the next sublayer, from Y; skipped when fn is null (the model's exit).
  const float* fn = nullptr;          //!< [24, 4 * dim]
  const float* base = nullptr;        //!< [24]
  const float* scale = nullptr;       //!< [3]
  int iters = 20;
  float hc_eps = 1e-6f;
  float mix_norm_eps = 1e-20f;
  float* next_pre = nullptr;          //!< [tokens, 4]
  float* next_post = nullptr;         //!< [tokens, 4]
  float* next_comb = nullptr;         //!< [tokens, 4, 4]
  //! Optional (codes and scales both or neither; dim a multiple of 32): h's act_quant (E4M3,
  //! UE8M0 per 32), byte for byte what numerics::quantize<fp8_act_format> makes of the stored h,
  //! so the next sublayer's FP8 linears skip their own quantize launch. codes [tokens, dim],
  //! scales [tokens, dim / 32]; codes_f16 (optional) the codes' values as f16 bits [tokens, dim]
  //! (quantize_args::codes_f16: the MoE's streamed expert GEMMs read them).
  std::uint8_t* h_codes = nullptr;
  std::uint8_t* h_scales = nullptr;
  std::uint16_t* h_codes_f16 = nullptr;
  long long tokens = 0;
  int dim = 0;
};

//! Partial sums per (token, d slice) and one arrival counter per token group, for up to
//! `max_tokens` tokens of width up to `max_dim`. The constructor zeroes the counters; every step
//! leaves them at zero.
class mhc_workspace {
 public:
  static constexpr int partial_count = 2 + mix_count;  // squares of Y, squares of h, 24 projections
  static constexpr int slice = 128;                     // positions of d per CTA
  //! Dynamic shared memory of a step's CTA: the slice of the projection weight (24 x 4 x slice
  //! fp32), whose memory the last CTA then reuses for its stage of partial sums (stage_bytes).
  static constexpr int weight_slice_bytes = mix_count * 4 * slice * 4;
  static constexpr int stage_bytes = 16 * 128 * 8;  // 16 loads a thread in flight
  static_assert(stage_bytes <= weight_slice_bytes,
                "mhc_workspace: the stage lives in the weight slice's memory");
  mhc_workspace(long long max_tokens, int max_dim)
      : max_tokens_(max_tokens), max_dim_(max_dim),
        partials_(std::size_t(std::max(1LL, max_tokens)) * std::size_t((max_dim + slice - 1) / slice) * partial_count),
        counters_(std::size_t(std::max(1LL, max_tokens))) {
    counters_.fill_bytes(0);
    // The memset runs on the legacy stream; a non-blocking stream is not ordered after it.
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  }
  long long max_tokens() const { return max_tokens_; }
  int max_dim() const { return max_dim_; }
  double* partials() { return partials_.data(); }
  unsigned* counters() { return counters_.data(); }

 private:
  long long max_tokens_;
  int max_dim_;
  runtime::device_buffer<double> partials_;
  runtime::device_buffer<unsigned> counters_;
};

namespace detail {
inline constexpr int mhc_threads = 128;

DSV4_DEVICE void unpack8(const uint4& v, float (&out)[8]) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = __uint_as_float((w[i / 2] >> (16 * (i % 2))) << 16);
}

DSV4_DEVICE uint4 pack8(const float (&v)[8]) {
  unsigned w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = unsigned(numerics::bf16::from_float(v[2 * i]).bits) | (unsigned(numerics::bf16::from_float(v[2 * i + 1]).bits) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

//! W consecutive bf16 values (W = 1, 2, 4 or 8: one 2-, 4-, 8- or 16-byte access) to fp32, and back.
template <int W>
struct bf16_run {
  static_assert(W == 1 || W == 2 || W == 4 || W == 8, "mhc_step: an item covers 1, 2, 4 or 8 positions");
  using raw_t = std::conditional_t<
      W == 8, uint4, std::conditional_t<W == 4, uint2, std::conditional_t<W == 2, unsigned, unsigned short>>>;
  raw_t raw;
  DSV4_DEVICE void load(const numerics::bf16* p) { raw = *reinterpret_cast<const raw_t*>(p); }
  DSV4_DEVICE void unpack(float (&out)[W]) const {
    if constexpr (W == 8) {
      unpack8(raw, out);
    } else if constexpr (W == 1) {
      out[0] = __uint_as_float(unsigned(raw) << 16);
    } else {
      const unsigned* w = reinterpret_cast<const unsigned*>(&raw);
#pragma unroll
      for (int i = 0; i < W; ++i) out[i] = __uint_as_float((w[i / 2] >> (16 * (i % 2))) << 16);
    }
  }
  DSV4_DEVICE static void store(numerics::bf16* p, const float (&v)[W]) {
    if constexpr (W == 8) {
      *reinterpret_cast<uint4*>(p) = pack8(v);
    } else if constexpr (W == 1) {
      p->bits = numerics::bf16::from_float(v[0]).bits;
    } else {
      raw_t r;
      unsigned* w = reinterpret_cast<unsigned*>(&r);
#pragma unroll
      for (int i = 0; i < W / 2; ++i)
        w[i] = unsigned(numerics::bf16::from_float(v[2 * i]).bits) |
               (unsigned(numerics::bf16::from_float(v[2 * i + 1]).bits) << 16);
      *reinterpret_cast<raw_t*>(p) = r;
    }
  }
};

//! Sum of `v` over aligned groups of G lanes (a power of two up to 32), every lane getting its
//! group's sum; the order is a fixed tree, so the result does not depend on timing.
template <int G>
DSV4_DEVICE double group_sum(double v) {
#pragma unroll
  for (int off = G / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

//! Barrier over the `count` threads (a multiple of 32) that call it with the same `id` (1..15;
//! 0 is __syncthreads').
DSV4_DEVICE void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

//! TB: tokens a CTA. kWeightsEarly (one token a CTA only): each warp loads its projection rows'
//! slice straight into registers before the programmatic wait (24 16-byte loads a lane, every one
//! in flight at once) instead of one thread's 96 bulk copies into shared memory
//! (set_decode_weights_in_registers).
template <int TB, bool kWeightsEarly = false>
DSV4_KERNEL void __launch_bounds__(mhc_threads, TB <= 4   ? 1
                                                : TB == 8 ? 4
                                                          : 3)
    mhc_step_kernel(mhc_step_args a, double* partials, unsigned* counters) {
  constexpr int P = mhc_workspace::partial_count, S = mhc_workspace::slice;
  constexpr int kWarps = mhc_threads / 32, kRows = mix_count / kWarps;
  static_assert(mix_count % kWarps == 0 && S % 32 == 0,
                "mhc_step: 24 rows over the warps, 32 lanes per slice row");
  // Phase 1 gives each thread items of W positions of one token: at decode (one token a CTA) a
  // position each, so that all four warps share the work (one warp doing 8 positions a thread
  // was the kernel's longest phase); with groups of 2 or 4 tokens 2 or 4 positions, one item a
  // thread; with 8 or 16 tokens 8 positions (16-byte accesses), one or two items a thread.
  static_assert(TB == 1 || TB == 2 || TB == 4 || TB == 8 || TB == 16,
                "mhc_step: token groups of 1, 2, 4, 8 or 16");
  constexpr int W = TB < 8 ? TB : 8, kItems = S / W;  // items per token
  constexpr int kRounds = TB * kItems / mhc_threads;  // items per thread
  static_assert(kRounds * mhc_threads == TB * kItems, "mhc_step: whole rounds of phase-1 items");
  constexpr int G = kItems < 32 ? kItems : 32, kGroups = kItems / G;  // lane groups per token
  // At decode (kWeightsEarly, the default) each warp's rows of the projection weight's slice are
  // loaded into registers before the programmatic wait; otherwise at decode and in groups of up to
  // 4 tokens the slice comes through shared memory by bulk copies (below); in groups of 8 or 16 it
  // is loaded into registers after phase 1 (the load is shared by the group's tokens there, and
  // 48 KB of shared memory a CTA would cost occupancy at prefill).
  static_assert(!kWeightsEarly || TB == 1,
                "mhc_step: the projection rows in registers are for one token a CTA");
  constexpr bool kWeightsInShared = TB <= 4 && DSV4_BULK_COPY_PASS && !kWeightsEarly;
  const int dim = a.dim, splits = (dim + S - 1) / S, split = blockIdx.x;
  const long long group = blockIdx.y, tok0 = group * TB;
  const int toks = a.tokens - tok0 < TB ? int(a.tokens - tok0) : TB;
  const int d_base = split * S, valid = min(S, dim - d_base);
  const bool has_f = a.f != nullptr, has_next = a.fn != nullptr;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  __shared__ __align__(16) float ys[TB][hc][S];
  __shared__ double group_ss[TB][kGroups][2];
  __shared__ double dots[TB][mix_count];
  __shared__ float split_base[mix_count], split_scale[3], split_mixes[kWarps][2][mix_count];
  __shared__ std::uint64_t weight_bar;
  // Dynamic: the weight slice [24][hc][S] at decode on sm_90, then (in the last CTA) the stage of
  // partial sums; mhc_step sizes it.
  extern __shared__ __align__(16) float dynamic_smem[];

  // The slice of the projection weight is a weight, which no kernel writes, so at decode it is
  // requested before the wait and arrives while the kernel before this one finishes (pdl.cuh):
  // 96 bulk copies (24 rows x 4 streams, 128 positions each) issued by one thread, no registers;
  // or (kWeightsEarly) phase 2's own register loads, issued here. Positions past `dim` in the last
  // slice are not read, and phase 2 does not use them.
  // Lane l takes positions 4l..4l+3 of each stream's slice (16-byte accesses, conflict-free).
  static_assert(S == 32 * 4, "mhc_step: a slice row is one float4 per lane");
  float4 wv[kRows][hc];
  auto load_weight_rows = [&] {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int i = 0; i < hc; ++i) {
        const int row = warp + kWarps * r, dd = 4 * lane;
        if (dd >= valid)
          wv[r][i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        else if constexpr (kWeightsInShared)
          wv[r][i] = *reinterpret_cast<const float4*>(dynamic_smem + (row * hc + i) * S + dd);
        else
          wv[r][i] = __ldg(reinterpret_cast<const float4*>(a.fn + (long long)row * 4 * dim +
                                                           (long long)i * dim + d_base + dd));
      }
  };
  if (has_next) {
    if constexpr (kWeightsEarly) load_weight_rows();
    if constexpr (kWeightsInShared) {
      if (threadIdx.x == 0) {
        bulk_copy::init(&weight_bar, 1);
        bulk_copy::init_fence();
        const unsigned bytes = unsigned(valid) * sizeof(float);  // a multiple of 32: dim % 8 == 0
        bulk_copy::expect_bytes(&weight_bar, bytes * mix_count * hc);
        const std::uint64_t policy = bulk_copy::l2_policy(bulk_copy::l2_eviction::normal);
        for (int row = 0; row < mix_count * hc; ++row)
          bulk_copy::copy(dynamic_smem + row * S, a.fn + (long long)row * dim + d_base, bytes, &weight_bar,
                          policy);
      }
    }
    if (threadIdx.x < mix_count) split_base[threadIdx.x] = a.base[threadIdx.x];
    if (threadIdx.x < 3) split_scale[threadIdx.x] = a.scale[threadIdx.x];
  }
  runtime::start_after_previous_grid();

  // Phase 1: Y and (unnormalized) h for the thread's items. Every input of an item is requested
  // before any is used (one memory round trip).
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    const unsigned item = threadIdx.x + unsigned(round * mhc_threads);
    const int t = int(item / kItems), c = int(item % kItems), d0 = d_base + c * W;
    double ss_y = 0, ss_h = 0;
    float y[hc][W] = {};
    if (t < toks && d0 < dim) {
      const long long tok = tok0 + t;
      const numerics::bf16* x = a.x + tok * 4 * dim;
      bf16_run<W> xraw[hc], fraw{};
      float post[hc] = {}, comb[hc * hc] = {}, pre[hc];
#pragma unroll
      for (int i = 0; i < hc; ++i) xraw[i].load(x + (long long)i * dim + d0);
#pragma unroll
      for (int i = 0; i < hc; ++i) pre[i] = a.pre[tok * hc + i];
      if (has_f) {
        fraw.load(a.f + tok * dim + d0);
#pragma unroll
        for (int i = 0; i < hc; ++i) post[i] = a.post[tok * hc + i];
#pragma unroll
        for (int i = 0; i < hc * hc; ++i) comb[i] = a.comb[tok * hc * hc + i];
      }
      float xs[hc][W];
#pragma unroll
      for (int i = 0; i < hc; ++i) xraw[i].unpack(xs[i]);
      if (has_f) {
        float fv[W];
        fraw.unpack(fv);
#pragma unroll
        for (int j = 0; j < hc; ++j) {
#pragma unroll
          for (int e = 0; e < W; ++e) {
            float mix = 0.0f;  // sum over the input streams first, in stream order, then post * F
#pragma unroll
            for (int i = 0; i < hc; ++i) mix = __fadd_rn(mix, __fmul_rn(comb[i * hc + j], xs[i][e]));
            y[j][e] = numerics::round_to_bf16(__fadd_rn(__fmul_rn(post[j], fv[e]), mix));
          }
          bf16_run<W>::store(a.y + (tok * 4 + j) * dim + d0, y[j]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < hc; ++j)
#pragma unroll
          for (int e = 0; e < W; ++e) y[j][e] = xs[j][e];
      }
      float hv[W];
#pragma unroll
      for (int e = 0; e < W; ++e) {
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < hc; ++i) sum = __fadd_rn(sum, __fmul_rn(pre[i], y[i][e]));
        hv[e] = numerics::round_to_bf16(sum);
        ss_h += double(hv[e]) * double(hv[e]);
      }
      bf16_run<W>::store(a.h + tok * dim + d0, hv);  // unnormalized for now
#pragma unroll
      for (int i = 0; i < hc; ++i)
#pragma unroll
        for (int e = 0; e < W; ++e) ss_y += double(y[i][e]) * double(y[i][e]);
    }
#pragma unroll
    for (int i = 0; i < hc; ++i)
#pragma unroll
      for (int e = 0; e < W; ++e) ys[t][i][c * W + e] = y[i][e];
    // The squares in double, like the host reference, so the RMS statistics match it bit for
    // bit in practice (sums of squares of bf16 values are exact in double unless their range is
    // extreme); a fixed tree over the token's lanes, then its groups in order (below).
    ss_y = group_sum<G>(ss_y);
    ss_h = group_sum<G>(ss_h);
    if (c % G == 0) group_ss[t][c / G][0] = ss_y, group_ss[t][c / G][1] = ss_h;
  }
  __syncthreads();

  // Phase 2: the slice's share of the 24 projections; warp w takes rows w, w + 4, ... and uses
  // each row for every token of the group. (At decode, the barrier's initialization is ordered
  // before this wait by phase 1's __syncthreads.)
  if (has_next) {
    if constexpr (kWeightsInShared) bulk_copy::wait(&weight_bar, 0);
    if constexpr (!kWeightsEarly) load_weight_rows();
      // A lane's 16 products are summed in fp32 (as precise as the reference's own fp32 GEMM;
      // double here would cost a conversion per product, the kernel's bottleneck at prefill),
      // the lanes' sums then in double by a fixed tree. The loops run the warp's rows side by side
      // (row innermost) so that their dependent chains (16 FMAs, 5 shuffle levels) overlap.
#pragma unroll
    for (int t = 0; t < TB; ++t) {
      float lane_sum[kRows] = {};
#pragma unroll
      for (int i = 0; i < hc; ++i) {
        const float4 yv = *reinterpret_cast<const float4*>(&ys[t][i][4 * lane]);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          lane_sum[r] = __fmaf_rn(wv[r][i].x, yv.x, lane_sum[r]);
          lane_sum[r] = __fmaf_rn(wv[r][i].y, yv.y, lane_sum[r]);
          lane_sum[r] = __fmaf_rn(wv[r][i].z, yv.z, lane_sum[r]);
          lane_sum[r] = __fmaf_rn(wv[r][i].w, yv.w, lane_sum[r]);
        }
      }
      double v[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) v[r] = lane_sum[r];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
#pragma unroll
        for (int r = 0; r < kRows; ++r) v[r] += __shfl_xor_sync(0xffffffffu, v[r], off);
      if (lane == 0)
#pragma unroll
        for (int r = 0; r < kRows; ++r) dots[t][warp + kWarps * r] = v[r];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < toks * P; idx += mhc_threads) {
    const int t = idx / P, k = idx % P;
    double v = 0;
    if (k < 2)
      for (int g = 0; g < kGroups; ++g) v += group_ss[t][g][k];
    else
      v = has_next ? dots[t][k - 2] : 0.0;
    partials[((tok0 + t) * splits + split) * P + k] = v;
  }
  // The last CTA of the group to arrive finishes it. One thread publishes the CTA's partials
  // (the barrier orders the block's stores before its fence and ticket) and, in the last CTA,
  // acquires the others' before the barrier releases the block to read them.
  __syncthreads();
  __shared__ unsigned ticket;
  if (threadIdx.x == 0) {
    __threadfence();
    ticket = atomicAdd(counters + group, 1u);
    if (ticket == unsigned(splits - 1)) __threadfence();
  }
  __syncthreads();
  if (ticket != unsigned(splits - 1)) return;

  // Totals, in an order fixed by the shape. The group's partials are one contiguous run [toks][splits][P]:
  // all threads load a stage of it at once (one round trip a stage; one stage holds a decode token's 40 x
  // 26), and the owner of each (token, partial) adds its values. The stage reuses the dynamic shared memory
  // (phase 2 is done with the weight slice).
  constexpr int kStage = mhc_workspace::stage_bytes / sizeof(double);
  static_assert(kStage % mhc_threads == 0, "mhc_step: the stage is loaded in whole rounds of the block");
  double* stage = reinterpret_cast<double*>(dynamic_smem);
  __shared__ double total[TB][P];
  __shared__ float inv_rms_h[TB];
  const double* group_partials = partials + tok0 * splits * P;
  const int run = toks * splits * P;
  double sums[(TB * P + mhc_threads - 1) / mhc_threads] = {};
  for (int base = 0; base < run; base += kStage) {
    double buf[kStage / mhc_threads];
#pragma unroll
    for (int u = 0; u < kStage / mhc_threads; ++u) {
      const int o = base + int(threadIdx.x) + u * mhc_threads;
      buf[u] = o < run ? __ldcg(group_partials + o) : 0.0;
    }
#pragma unroll
    for (int u = 0; u < kStage / mhc_threads; ++u) stage[int(threadIdx.x) + u * mhc_threads] = buf[u];
    __syncthreads();
#pragma unroll
    for (int q = 0; q < int(sizeof(sums) / sizeof(double)); ++q) {
      const int idx = int(threadIdx.x) + q * mhc_threads;
      if (idx >= toks * P) break;
      const int t = idx / P, k = idx % P, first = (t * splits) * P + k;  // offset of slice 0
      // the slices s with base <= first + s * P < base + kStage, in increasing order
      const int s_lo = base > first ? (base - first + P - 1) / P : 0;
      const int s_end = min(splits, (base + kStage - first + P - 1) / P);
      // four interleaved accumulators (a chain of 40 dependent adds was 0.4 us at decode),
      // met in a fixed order: the sum does not depend on timing
      const double* src = stage + first - base;
      double p0 = 0, p1 = 0, p2 = 0, p3 = 0;
      int s = s_lo;
      for (; s + 4 <= s_end; s += 4)
        p0 += src[s * P], p1 += src[(s + 1) * P], p2 += src[(s + 2) * P], p3 += src[(s + 3) * P];
      for (; s < s_end; ++s) p0 += src[s * P];
      sums[q] += (p0 + p1) + (p2 + p3);
    }
    __syncthreads();
  }
#pragma unroll
  for (int q = 0; q < int(sizeof(sums) / sizeof(double)); ++q) {
    const int idx = int(threadIdx.x) + q * mhc_threads;
    if (idx < toks * P) total[idx / P][idx % P] = sums[q];
  }
  __syncthreads();
  if (threadIdx.x == 0) counters[group] = 0;  // ready for the next step

  // The Sinkhorn split (a long dependent chain) runs a token per half warp, two a warp (one at
  // decode); the warps left over normalize h meanwhile, synchronized among themselves only. With
  // as many token pairs as warps or more, every warp splits first, then all normalize. (Each value
  // is computed as before; only which thread does what changes.)
  const int pairs = TB == 1 ? toks : (toks + 1) / 2;
  const int sinkhorn_warps = has_next ? min(pairs, kWarps) : 0;
  const bool overlap = sinkhorn_warps < kWarps;
  if (warp < sinkhorn_warps)
    for (int pair = warp; pair < pairs; pair += sinkhorn_warps) {
      const int t0 = TB == 1 ? pair : 2 * pair;
      // Each half's mixes: the projections over the RMS of Y, lane k of the warp computes k and 24 + k
      // (at decode the one token's only).
      for (int k = lane; k < (TB == 1 ? 1 : 2) * mix_count; k += 32) {
        const int t = min(t0 + k / mix_count, toks - 1);  // a half without a token repeats the last
        const float mean_y = float(total[t][0] / double(4 * dim));
        const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_y, a.mix_norm_eps)));
        split_mixes[warp][k / mix_count][k % mix_count] = __fmul_rn(float(total[t][2 + k % mix_count]), r);
      }
      __syncwarp();
      const int half = TB == 1 ? 0 : lane / 16, t = min(t0 + half, toks - 1);
      const long long tok = tok0 + t;
      split_sinkhorn_warp(split_mixes[warp][half], split_scale, split_base, a.iters, a.hc_eps,
                          a.next_pre + tok * hc, a.next_post + tok * hc, a.next_comb + tok * hc * hc,
                          TB == 1 ? lane < 16 : t0 + half < toks);
      __syncwarp();  // the warp's mixes are read before its next pair overwrites them
    }
  if (!overlap) __syncthreads();
  const int first = overlap ? sinkhorn_warps * 32 : 0, workers = mhc_threads - first;
  if (int(threadIdx.x) < first) return;
  const int me = int(threadIdx.x) - first;
  if (me < toks) {
    const float mean_h = float(total[me][1] / double(dim));
    inv_rms_h[me] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_h, a.norm_eps)));
  }
  named_barrier(1, workers);
  // A thread takes chunks of 8 positions, `workers` apart. The bounds are tested per warp
  // (`workers` and the warps' first `me` are multiples of 32), so every lane of a warp reaches the
  // act_quant's shuffles together: with dim a multiple of 32 the quantizer's block of 32 is four
  // adjacent lanes of one token. Lanes past the end pass zeros and write nothing.
  const int chunks = dim / 8, n_chunks = toks * chunks, warp_first = me - lane;
  constexpr int kBatch = 8;  // chunks per thread whose loads are issued together
  for (int idx0 = warp_first; idx0 < n_chunks; idx0 += kBatch * workers) {
    uint4 raw[kBatch], wraw[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = idx0 + lane + u * workers;
      if (idx >= n_chunks) break;
      const int t = idx / chunks, c = idx % chunks;
      raw[u] = __ldcg(reinterpret_cast<const uint4*>(a.h + (tok0 + t) * dim + c * 8));
      wraw[u] = *reinterpret_cast<const uint4*>(a.norm_w + c * 8);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (idx0 + u * workers >= n_chunks) break;  // the whole warp
      const int idx = idx0 + lane + u * workers;
      const bool active = idx < n_chunks;
      const int t = active ? idx / chunks : 0, c = active ? idx % chunks : 0;
      float hv[8] = {}, wv8[8];
      if (active) {
        unpack8(raw[u], hv);
        unpack8(wraw[u], wv8);
        const float r = inv_rms_h[t];
#pragma unroll
        for (int e = 0; e < 8; ++e) hv[e] = __fmul_rn(wv8[e], __fmul_rn(hv[e], r));
        *reinterpret_cast<uint4*>(a.h + (tok0 + t) * dim + c * 8) = pack8(hv);
      }
      if (a.h_codes) {  // the act_quant of the stored h (the same bf16 values)
        numerics::bf16 v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = numerics::bf16::from_float(hv[e]);
        const long long row = tok0 + t;
        numerics::detail::quantize_chunk8<numerics::fp8_act_format>(
            v, active, a.h_codes + row * dim, a.h_scales + row * (dim / 32), c,
            a.h_codes_f16 ? a.h_codes_f16 + row * dim : nullptr);
      }
    }
  }
}

struct decode_weights_in_registers_tag;

inline std::atomic<int>& prefill_token_group() {
  static std::atomic<int> tokens{8};
  return tokens;
}
//! The call sizes of each shape (thirty-fifth session, H100, V4.1 widths): one token a CTA up to 16
//! tokens, two tokens a CTA up to 48, four up to 64, then the prefill groups. bench_mhc: 12 tokens
//! 12.0 us one a CTA or in twos; 16 tokens 15.9 against 12.8 in twos, but the decode step at batch
//! 16 was 17.5 ms one a CTA against 17.7 in twos (the step's boundaries read their weights from
//! HBM), so the decode shape keeps 16; 32 tokens 21.8 in twos (step at batch 32: 28.3 -> 26.3 ms);
//! 64 tokens 33.2 in fours against 37.2 in eights; 96 tokens 35.4 in eights against 40.1 in fours.
inline constexpr int default_one_token_ctas = 16;
inline std::atomic<int>& one_token_ctas_up_to() {
  static std::atomic<int> tokens{default_one_token_ctas};
  return tokens;
}
//! Small token groups (2 or 4 tokens a CTA, the weight slice in shared memory as at decode): up to
//! how many tokens a call each runs (set_small_token_groups).
inline constexpr int default_twos_up_to = 48, default_fours_up_to = 64;
inline std::atomic<int>& twos_up_to() {
  static std::atomic<int> tokens{default_twos_up_to};
  return tokens;
}
inline std::atomic<int>& fours_up_to() {
  static std::atomic<int> tokens{default_fours_up_to};
  return tokens;
}
}  // namespace detail

//! Process-wide: up to how many tokens a call runs one token a CTA (the decode variant: a CTA per
//! token and slice, the weight slice bulk-copied into each, one Sinkhorn warp per token beside three
//! warps normalizing h), 16 by default (detail::default_one_token_ctas); above it, the small token
//! groups (set_small_token_groups), then groups of prefill_token_group() tokens a CTA. bench_mhc
//! times every shape from 4 to 128 tokens. 1 to 4096; anything else is an error.
inline void set_one_token_ctas_up_to(int tokens) {
  if (tokens < 1 || tokens > 4096)
    throw error("mhc_step: one token a CTA is for 1 to 4096 tokens a call, not " + std::to_string(tokens));
  detail::one_token_ctas_up_to().store(tokens);
}
inline int one_token_ctas_up_to() {
  return detail::one_token_ctas_up_to().load();
}

//! Process-wide: how the one-token-a-CTA variant (decode) gets its slice of the 24 x 4d projection
//! weight: each warp's 24 16-byte loads a lane straight into the registers phase 2 uses, all
//! issued before the programmatic wait (on, the default), or 96 bulk copies into shared memory
//! issued by one thread (off, the earlier form). The same results either way. On an H100
//! (forty-first session, docs/perf.md) bench_mhc took 7.8 / 9.7 / 13.4 us at 1 / 8 / 16 tokens
//! with the registers against 8.1 / 10.5-10.9 / 16.9 with the bulk copies (alike with the weight
//! in L2 and from HBM), and a V4.1-width decode step 10.2 ms against 10.4 at batch 1
//! (bench_model --ab-mhc).
inline void set_decode_weights_in_registers(bool on) {
  process_switch<detail::decode_weights_in_registers_tag, true>::set(on);
}
inline bool decode_weights_in_registers() {
  return process_switch<detail::decode_weights_in_registers_tag, true>::on();
}

//! Process-wide: how many tokens one CTA takes above one_token_ctas_up_to() tokens a call
//! (prefill), 8 (the default) or 16. Larger groups read the 24 x 4d projection weight (from L2)
//! half as often and run half the CTAs, with twice the shared memory for Y a CTA; bench_mhc
//! measures both (16 is slower at every size: docs/perf.md). Anything else is an error naming the
//! choices.
inline void set_prefill_token_group(int tokens) {
  if (tokens != 8 && tokens != 16)
    throw error("mhc_step: the prefill token group is 8 or 16 tokens a CTA, not " + std::to_string(tokens));
  detail::prefill_token_group().store(tokens);
}
inline int prefill_token_group() {
  return detail::prefill_token_group().load();
}

//! Process-wide: calls of more than one_token_ctas_up_to() tokens and at most `twos_up_to` run two
//! tokens a CTA, then up to `fours_up_to` four tokens a CTA, with the projection weight's slice
//! bulk-copied into shared memory as at decode and two tokens a Sinkhorn warp; larger calls take
//! the prefill token groups. 0 turns a size off. Defaults: detail::default_twos_up_to (48) and
//! detail::default_fours_up_to (64); bench_mhc times every size. 0 to 4096 each; anything else is an error.
inline void set_small_token_groups(int twos_up_to, int fours_up_to) {
  for (const int v : {twos_up_to, fours_up_to})
    if (v < 0 || v > 4096)
      throw error("mhc_step: a small token group's limit lies in 0 to 4096 tokens a call, not " +
                  std::to_string(v));
  detail::twos_up_to().store(twos_up_to);
  detail::fours_up_to().store(fours_up_to);
}
inline int twos_up_to() {
  return detail::twos_up_to().load();
}
inline int fours_up_to() {
  return detail::fours_up_to().load();
}

inline void mhc_step(const mhc_step_args& a, mhc_workspace& ws, cudaStream_t stream = nullptr) {
  const std::string where = "mhc_step (tokens " + std::to_string(a.tokens) + ", dim " + std::to_string(a.dim) + "): ";
  if (a.tokens < 0 || a.dim <= 0 || a.dim % 8 != 0) throw error(where + "need tokens >= 0 and dim a positive multiple of 8");
  if (a.tokens > ws.max_tokens() || a.dim > ws.max_dim())
    throw error(where + "the workspace holds " + std::to_string(ws.max_tokens()) + " tokens of width " +
                std::to_string(ws.max_dim()));
  if (a.tokens == 0) return;
  if (!a.x || !a.pre || !a.norm_w || !a.h) throw error(where + "null x, pre, norm_w or h");
  if (a.f && (!a.post || !a.comb || !a.y)) throw error(where + "with F, post, comb and y are required");
  if (a.fn && (!a.base || !a.scale || !a.next_pre || !a.next_post || !a.next_comb || a.iters < 1))
    throw error(where + "with fn, base, scale, next_pre/post/comb and iters >= 1 are required");
  if (bool(a.h_codes) != bool(a.h_scales) || (a.h_codes_f16 && !a.h_codes))
    throw error(where + "h's act_quant needs both codes and scales (and codes_f16 only beside them)");
  if (a.h_codes && a.dim % 32 != 0)
    throw error(where + "h's act_quant needs dim a multiple of its block of 32");
  if (reinterpret_cast<std::uintptr_t>(a.h_codes) % 8 || reinterpret_cast<std::uintptr_t>(a.h_codes_f16) % 16)
    throw error(where + "h's act_quant codes must be 8-byte aligned, their f16 copy 16-byte aligned");
  for (const void* p : {(const void*)a.x, (const void*)a.f, (const void*)a.y, (const void*)a.h, (const void*)a.norm_w,
                        (const void*)a.fn})
    if (reinterpret_cast<std::uintptr_t>(p) % 16) throw error(where + "tensors must be 16-byte aligned");
  const unsigned splits = unsigned((a.dim + mhc_workspace::slice - 1) / mhc_workspace::slice);
  // Dynamic shared memory: the weight slice at decode (when there is a next sublayer), else the
  // last CTA's stage only.
  const int smem_decode = a.fn ? mhc_workspace::weight_slice_bytes : mhc_workspace::stage_bytes;
  // The shared-memory opt-in is per device and per kernel copy (kernels have internal linkage),
  // so it is made here, beside the launch, once per device and variant.
  static runtime::per_device_ints ready[6] = {};
  auto go = [&](auto kernel, int variant, long long groups, int smem) {
    if (groups > 65535) throw error(where + "too many tokens for one launch");
    runtime::cached_per_device(ready[variant], [&](int) {
      DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           mhc_workspace::weight_slice_bytes));
      return 1;
    });
    runtime::launch_programmatic(kernel, dim3(splits, unsigned(groups)), dim3(detail::mhc_threads),
                                 std::size_t(smem), stream, a, ws.partials(), ws.counters());
  };
  // One token per CTA at decode (more CTAs), small groups of 2 or 4 where set, groups of 8 or 16
  // when there are many tokens (the weight is then read once per group).
  if (a.tokens <= one_token_ctas_up_to()) {
    if (decode_weights_in_registers())  // (no weight slice in shared memory: the last CTA's stage only)
      go(detail::mhc_step_kernel<1, true>, 5, a.tokens, mhc_workspace::stage_bytes);
    else
      go(detail::mhc_step_kernel<1>, 0, a.tokens, smem_decode);
  } else if (a.tokens <= twos_up_to())
    go(detail::mhc_step_kernel<2>, 3, (a.tokens + 1) / 2, smem_decode);
  else if (a.tokens <= fours_up_to())
    go(detail::mhc_step_kernel<4>, 4, (a.tokens + 3) / 4, smem_decode);
  else if (prefill_token_group() == 16)
    go(detail::mhc_step_kernel<16>, 2, (a.tokens + 15) / 16, mhc_workspace::stage_bytes);
  else
    go(detail::mhc_step_kernel<8>, 1, (a.tokens + 7) / 8, mhc_workspace::stage_bytes);
  DSV4_CUDA_CHECK_LAUNCH();
}

}  // namespace dsv4::kernels::mhc
