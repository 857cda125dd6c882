#pragma once
//! \file
//! The MoE layer on CUDA (spec §9; host reference: reference.hpp `moe_layer_reference`):
//!
//!  1. gate logits, fp32 results of double sums (as the host reference) of bf16 x and bf16 W;
//!  2. per token, one warp: sqrtsoftplus, top-k on score + bias (bias_vl for image tokens) in
//!     torch.topk's order (NaN above +inf; ties to the lower expert id: `numerics::topk_order_key`,
//!     shared with the host), weights from the unbiased scores, normalized, x route_scale;
//!  3. dispatch: the (token, slot) pairs in a stable order by expert, then a tile list (runs of
//!     at most 8, 16 or 32 rows of one expert) for the grouped GEMMs, or, on the prefill path of
//!     step 4, each expert's first sorted row (copied to the host). Up to dispatch_max_pairs
//!     pairs (decode) one CTA does all of it (dispatch_kernel); larger calls sort with CUB's
//!     radix sort, then build the tile list and the row maps;
//!  4. act_quant of x once; w1 and w3 as one launch of grouped FP4 GEMMs that read x's rows
//!     through the sort (no gather copy); the clamped SwiGLU times the routing weight, fused
//!     with act_quant (h is not stored); w2 grouped.
//!     Prefill-sized calls given a cuBLAS handle (>= dense_min_rows_per_expert rows per expert)
//!     instead run each expert's rows through bf16 copies and one cuBLAS GEMM per expert and
//!     projection (dense_expert_projection), tensor-core GEMMs at full tile height;
//!  5. the shared expert (FP8) on all tokens (gemm::block_scaled_linear: the dequantize + cuBLAS
//!     path from gemm::dequant_min_tokens tokens when a handle is given); off that path it runs
//!     on the workspace's second stream beside steps 1-4 (forked after act_quant, joined before 6);
//!  6. per token: its experts' bf16 outputs added in ascending expert id into an fp32 sum that
//!     starts at 0, then the shared expert's, one rounding (deterministic: no atomics anywhere).
//! Works for the backbone (384 experts, top-6) and the DSpark stages (128, top-3) alike.
//!
//! Expert parallelism (issue 7; model.py's MoE on W ranks, parallel/tensor_parallel_reference.hpp):
//! given an `expert_slice`, the rank runs only its experts [first, first + count) (the weights
//! point at the first of them) and step 6 writes the fp32 sum of its experts' outputs (ascending
//! id, from 0) instead of y; after the all-reduce of that sum over the ranks, `moe_add_shared`
//! adds the shared expert's output with one rounding. Over all experts on one rank this is the
//! unsliced layer bit for bit (the same sequence of additions).

#include <cuda_pipeline.h>  // __pipeline_memcpy_async (cp.async)
#include <cuda_runtime.h>   // provides cudaStream_t, uint4
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstdint>
#include <string>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/gemm/block_scaled_gemm.cuh"
#include "dsv4/kernels/gemm/dequant_gemm.cuh"
#include "dsv4/kernels/gemm/wgmma_gemm.cuh"
#include "dsv4/kernels/gemm/weight_tiles.hpp"
#include "dsv4/kernels/moe/reference.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.cuh"
#include "dsv4/runtime/cuda_check.cuh"
#include "dsv4/runtime/device_buffer.cuh"
#include "dsv4/runtime/pdl.cuh"
#include "dsv4/runtime/pinned_buffer.cuh"
#include "dsv4/runtime/stream.cuh"

namespace dsv4::kernels::moe {

using numerics::bf16;

inline constexpr int max_experts = 512;
//! The most experts a token may take (moe_shape::k): the routing kernel's slot arrays and the
//! combine kernel's rows are this long, and the combine's warp ranks the slots with one lane each.
inline constexpr int max_top_k = 16;
static_assert(max_top_k <= 32, "the combine kernel ranks a token's slots with one lane of a warp each");
//! The grouped expert GEMMs read f16 copies of their activations (block_scaled_gemm_args::a_f16)
//! for calls of up to this many tokens, and the E4M3 codes above (the same values, more
//! instructions a block, same results). Why a cap: the copies are 2 bytes per activation, sized
//! for the workspace's tokens; a prefill-sized workspace (thousands of tokens) held hundreds of
//! MB of them, and the copies' saving was measured at decode sizes only (1-64 tokens).
inline constexpr long long f16_copy_max_tokens = 256;

//! Shapes and routing constants of one MoE layer.
struct moe_shape {
  int experts = 0, k = 0, dim = 0, inter = 0;
  float route_scale = 1.5f, gate_temp = 1.0f, swiglu_limit = 10.0f;
  bool norm_topk_prob = true;
};

//! With a cuBLAS handle, moe_forward runs the routed experts through bf16 copies and cuBLAS (the
//! prefill path) when the sorted pairs give this many rows per expert on average or more; the
//! shared expert takes that path from gemm::dequant_min_tokens tokens on.
inline constexpr int dense_min_rows_per_expert = 32;

//! bf16 scratch of the prefill path for up to `max_tokens` tokens (0 below dequant_min_tokens):
//! a window of max_tokens activation rows at most max(dim, inter) wide, then one weight
//! (dim x inter elements). It also covers the shared expert's dequant_gemm ((m + n) k with
//! m <= max_tokens and n k = dim x inter).
inline std::size_t dense_dequant_elems(const moe_shape& s, long long max_tokens) {
  if (max_tokens < gemm::dequant_min_tokens) return 0;
  return std::size_t(max_tokens) * std::size_t(std::max(s.dim, s.inter)) +
         std::size_t(s.dim) * std::size_t(s.inter);
}

//! Device weights of one MoE layer. Expert weights are in the MMA-tile layout
//! (gemm/weight_tiles.hpp), expert after expert.
struct moe_weights {
  const bf16* gate = nullptr;      //!< [experts, dim]
  const float* bias = nullptr;     //!< [experts]
  const float* bias_vl = nullptr;  //!< [experts], used for tokens flagged as image tokens (optional)
  const std::uint8_t *w1 = nullptr, *w1_s = nullptr;  //!< FP4 [inter, dim] per expert
  const std::uint8_t *w3 = nullptr, *w3_s = nullptr;  //!< FP4 [inter, dim] per expert
  const std::uint8_t *w2 = nullptr, *w2_s = nullptr;  //!< FP4 [dim, inter] per expert
  const std::uint8_t *s1 = nullptr, *s1_s = nullptr;  //!< shared expert, FP8 [inter, dim]
  const std::uint8_t *s3 = nullptr, *s3_s = nullptr;  //!< FP8 [inter, dim]
  const std::uint8_t *s2 = nullptr, *s2_s = nullptr;  //!< FP8 [dim, inter]
};

//! The experts one rank of an expert-parallel layer holds (see the file comment).
struct expert_slice {
  int first = 0;            //!< first expert held
  int count = 0;            //!< experts held, >= 1; 0: no slice (every expert, y is written; first 0, routed null)
  float* routed = nullptr;  //!< [tokens, dim] fp32 out when slicing: the rank's routed sum (y is not written)
};

//! Every intermediate of the layer for up to `max_tokens` tokens (allocated once).
class moe_workspace {
 public:
  moe_workspace(const moe_shape& s, long long max_tokens)
      : shape_(s),
        max_tokens_(max_tokens),
        logits(n(s.experts)),
        sel_expert(n(s.k)),
        sel_weight(n(s.k)),
        pair_index(n(s.k)),
        sorted_expert(n(s.k)),
        sorted_pair(n(s.k)),
        row_token(n(s.k)),
        pair_row(n(s.k)),
        tile_group(tiles_bound()),
        tile_row0(tiles_bound()),
        tile_rows(tiles_bound()),
        tile_count(1),
        xq(n(s.dim)),
        xs(n(s.dim / 32)),
        xh(n(s.dim, f16_tokens())),
        g(n(std::size_t(s.k) * s.inter)),
        u(g.size()),
        hq(g.size()),
        hs(g.size() / 32),
        hh(n(std::size_t(s.k) * s.inter, f16_tokens())),
        expert_out(n(std::size_t(s.k) * s.dim)),
        sg(n(s.inter)),
        su(sg.size()),
        shq(sg.size()),
        shs(sg.size() / 32),
        shared_out(n(s.dim)),
        expert_offsets(std::size_t(s.experts) + 1),
        expert_offsets_host(std::size_t(s.experts) + 1),
        gemm(std::size_t(1) << 20, dense_dequant_elems(s, max_tokens),
             gemm::folded_bytes_for(max_tokens, std::max<long long>(s.dim, s.inter))),
        shared_stream(runtime::owned_stream::non_blocking()),
        forked(runtime::owned_event::ordering()),
        joined(runtime::owned_event::ordering()) {
    std::size_t bytes = 0;
    DSV4_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, sorted_expert.data(),
                                                    sorted_expert.data(), pair_index.data(),
                                                    sorted_pair.data(), int(max_tokens * s.k), 0, 10));
    sort_temp = runtime::device_buffer<unsigned char>(std::max<std::size_t>(1, bytes));
    // An expert slice leaves the rows of other ranks' experts unwritten, yet the elementwise
    // steps (SwiGLU, act_quant) run over every row: they read zeros (or an earlier call's values).
    for (auto* b : {&g, &u}) b->fill_bytes(0);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());  // the memsets run on the legacy stream
  }
  const moe_shape& shape() const { return shape_; }
  long long max_tokens() const { return max_tokens_; }
  //! Calls of up to this many tokens give the grouped GEMMs f16 activations (xh, hh).
  long long f16_tokens() const { return std::min(max_tokens_, f16_copy_max_tokens); }
  //! Tile-list length bound for max_tokens: sum over experts of ceil(count / 8).
  int tiles_bound() const {
    const long long pairs = max_tokens_ * shape_.k;
    return int((pairs + 7 * std::min<long long>(shape_.experts, pairs)) / 8 + 1);
  }

 private:
  //! Elements of a buffer of `per_token` per token for `tokens` tokens (one argument: max_tokens).
  std::size_t n(std::size_t per_token, long long tokens) const {
    return std::max<std::size_t>(1, std::size_t(tokens) * per_token);
  }
  std::size_t n(std::size_t per_token) const { return n(per_token, max_tokens_); }
  moe_shape shape_;
  long long max_tokens_;

 public:
  runtime::device_buffer<float> logits;
  runtime::device_buffer<int> sel_expert;     //!< [T, k], descending biased score
  runtime::device_buffer<float> sel_weight;   //!< [T, k]
  runtime::device_buffer<int> pair_index;     //!< [T, k] = t * k + j
  runtime::device_buffer<int> sorted_expert;  //!< the pairs' experts, ascending (stable)
  runtime::device_buffer<int> sorted_pair;    //!< the pairs, in that order
  runtime::device_buffer<int> row_token;      //!< [T k]: token of each sorted row
  runtime::device_buffer<int> pair_row;       //!< [T k]: sorted row of each pair
  runtime::device_buffer<int> tile_group, tile_row0, tile_rows, tile_count;
  runtime::device_buffer<std::uint8_t> xq, xs;
  runtime::device_buffer<std::uint16_t> xh;  //!< xq's codes as f16 (the streamed expert GEMMs' B operand)
  runtime::device_buffer<bf16> g, u;
  runtime::device_buffer<std::uint8_t> hq, hs;
  runtime::device_buffer<std::uint16_t> hh;  //!< hq's codes as f16
  runtime::device_buffer<bf16> expert_out;
  runtime::device_buffer<bf16> sg, su;
  runtime::device_buffer<std::uint8_t> shq, shs;
  runtime::device_buffer<bf16> shared_out;
  runtime::device_buffer<unsigned char> sort_temp;
  runtime::device_buffer<int> expert_offsets;       //!< [experts + 1]: first sorted row of each expert
  runtime::pinned_buffer<int> expert_offsets_host;  //!< their copy for the prefill path's launches
  gemm::gemm_workspace gemm;
  //! Where the shared expert runs at decode, beside the routing (moe_forward), and the events of
  //! its fork from and join to the caller's stream.
  runtime::owned_stream shared_stream;
  runtime::owned_event forked, joined;
};

namespace detail {

inline constexpr int gate_threads = 256;
inline constexpr int gate_tokens_per_cta = gate_threads / 32;  //!< one warp per token
//! Shared memory a gate-logits CTA may stage (a gate row and its tokens' x rows): two CTAs of
//! this size fit on an sm_90 SM. 96 KB holds the row and 8 tokens at dim 5120.
inline constexpr int gate_smem_budget = 96 * 1024;

//! Gate logits, one CTA per (expert, group of up to 8 tokens), one warp per token.
//! The summation order is that of the kernel this one replaced (one warp per expert and 4
//! tokens), so the bits are the same: lane l adds, in order, the 8 products of each of its
//! 8-channel chunks l, l + 32, l + 64, ... into one double, then the 32 lane sums meet in an xor
//! butterfly. Each lane's sum is a dependent chain, so a token cannot use more than 32 threads of
//! arithmetic without changing the bits; what made that kernel slow at decode was memory latency
//! (each lane's 20 loads at dim 5120 waited one after another, on 48 CTAs at 384 experts and one
//! token, 2 CTAs at 16). Here the CTA's 256 threads first copy the expert's gate row and the
//! group's x rows into shared memory with asynchronous copies, all in flight at once, and the
//! chains then read shared memory. The gate row is staged once for all the groups a CTA walks
//! (grid y stops at 65535 groups).
//! With `q` (its codes and scales set), the same launch writes the act_quant of x (E4M3, UE8M0 per
//! 32; the f16 copy too where q.codes_f16 is set) from the staged rows: the warps of all the
//! group's CTAs take a 32-chunk slice each, so the work is spread over the grid and no quantize
//! launch of its own stands between the layer's input and its routing. The bytes are those of
//! numerics::quantize (the same per-thread step, quantize_chunk8).
struct gate_act_quant {
  std::uint8_t* codes = nullptr;       //!< [tokens, dim]
  std::uint8_t* scales = nullptr;      //!< [tokens, dim / 32]
  std::uint16_t* codes_f16 = nullptr;  //!< [tokens, dim] or null
};
DSV4_KERNEL void __launch_bounds__(gate_threads)
    gate_logits_kernel(const bf16* x, long long tokens, int dim, const bf16* w, int experts, int per_cta,
                       float gate_temp, float* logits, gate_act_quant q) {
  extern __shared__ uint4 staged[];  // [1 + per_cta][dim / 8]: the gate row, then the group's x rows
  const int e = blockIdx.x, chunks = dim / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The gate row (a weight: no kernel writes it) is asked for before the wait, while the kernel
  // before still runs; the first group's commit covers it.
  const uint4* row = reinterpret_cast<const uint4*>(w + (long long)e * dim);
  for (int c = threadIdx.x; c < chunks; c += gate_threads)
    __pipeline_memcpy_async(staged + c, row + c, sizeof(uint4));
  runtime::start_after_previous_grid();
  for (long long t0 = (long long)blockIdx.y * per_cta; t0 < tokens; t0 += (long long)gridDim.y * per_cta) {
    const int n = int(min((long long)per_cta, tokens - t0));
    const uint4* xr = reinterpret_cast<const uint4*>(x + t0 * dim);  // the group's n rows, contiguous
    uint4* xs = staged + chunks;
    for (int i = threadIdx.x; i < n * chunks; i += gate_threads)
      __pipeline_memcpy_async(xs + i, xr + i, sizeof(uint4));
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads();
    if (warp < n) {
      const uint4* xt = xs + warp * chunks;
      double acc = 0;
      for (int c = lane; c < chunks; c += 32) {
        const uint4 wr = staged[c], xv = xt[c];
        const unsigned ww[4] = {wr.x, wr.y, wr.z, wr.w}, xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
        for (int i = 0; i < 8; ++i)
          acc += double(__uint_as_float((xw[i / 2] >> (16 * (i % 2))) << 16)) *
                 double(__uint_as_float((ww[i / 2] >> (16 * (i % 2))) << 16));
      }
      for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
      if (lane == 0) logits[(t0 + warp) * experts + e] = __fdiv_rn(float(acc), gate_temp);
    }
    if (q.codes) {  // this warp's slices of the group's n * chunks chunks; every lane of a warp takes part
      const int warps = int(gridDim.x) * (gate_threads / 32);
      for (int c0 = (e * (gate_threads / 32) + warp) * 32; c0 < n * chunks; c0 += warps * 32) {
        const int c = c0 + lane;
        const bool active = c < n * chunks;
        bf16 v[8];
        numerics::detail::bf16x8_of(active ? xs[c] : make_uint4(0, 0, 0, 0), v);
        const long long t = t0 + c / chunks;
        numerics::detail::quantize_chunk8<numerics::fp8_act_format>(
            v, active, q.codes + t * dim, q.scales + t * (dim / 32), c % chunks,
            q.codes_f16 ? q.codes_f16 + t * dim : nullptr);
      }
    }
    __syncthreads();  // the next group's rows overwrite these
  }
}

//! Launches gate_logits_kernel: experts x ceil(tokens / per_cta) CTAs (384 at one token for the
//! backbone), per_cta = min(8, tokens) or fewer where the staged rows would not fit the budget.
inline void gate_logits(const bf16* x, long long tokens, int dim, const bf16* w, int experts, float gate_temp,
                        float* logits, cudaStream_t stream, const gate_act_quant& q = {}) {
  if (q.codes && (!q.scales || dim % 32 != 0))
    throw error("moe gate logits: the act_quant of x needs its scales and dim a multiple of 32 (dim " +
                std::to_string(dim) + ")");
  const long long row_bytes = (long long)dim * sizeof(bf16);
  const int per_cta =
      int(std::min<long long>({tokens, gate_tokens_per_cta, gate_smem_budget / row_bytes - 1}));
  if (per_cta < 1)
    throw error("moe gate logits: dim " + std::to_string(dim) +
                " is too wide to stage a gate row and an x row in " + std::to_string(gate_smem_budget) +
                " bytes of shared memory");
  const int smem = int((1 + per_cta) * row_bytes);
  if (smem > 48 * 1024)  // above the default limit of dynamic shared memory: opt in
    DSV4_CUDA_CHECK(
        cudaFuncSetAttribute(gate_logits_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(unsigned(experts), unsigned(std::min<long long>((tokens + per_cta - 1) / per_cta, 65535)));
  runtime::launch_programmatic(gate_logits_kernel, grid, dim3(gate_threads), std::size_t(smem), stream, x,
                               tokens, dim, w, experts, per_cta, gate_temp, logits, q);
  DSV4_CUDA_CHECK_LAUNCH();
}

DSV4_DEVICE float softplus_torch(float s) {
  return s > 20.0f ? s : log1pf(expf(s));
}

//! Expert e's unbiased score sqrt(softplus(logit)) and its rank key: topk_order_key(score + bias)
//! above, ~e below, so the largest key is the highest biased score (NaN above +inf) and, among
//! equal scores, the lowest id. Keys are distinct, and 0 is below every one of them.
struct route_entry {
  float score;
  unsigned long long key;
};
DSV4_DEVICE route_entry route_entry_of(const float* logits_row, const float* bias, int e) {
  const float score = __fsqrt_rn(softplus_torch(logits_row[e]));
  const unsigned long long key =
      (static_cast<unsigned long long>(numerics::topk_order_key(__fadd_rn(score, bias[e]))) << 32) |
      static_cast<unsigned>(~e);
  return {score, key};
}

//! Slot j < k of token t from the chosen experts' ids and unbiased scores in rank order: the weight
//! normalized by the sum over the slots in rank order (the reference's order), times route_scale.
DSV4_DEVICE void write_route_slot(long long t, int j, const moe_shape& s, int expert, float score, float sum,
                                  int* sel_expert, float* sel_weight, int* pair_index) {
  float wv = score;
  if (s.norm_topk_prob && s.k > 1) wv = __fdiv_rn(wv, __fadd_rn(sum, 1e-20f));
  wv = __fmul_rn(wv, s.route_scale);
  sel_expert[t * s.k + j] = expert;
  sel_weight[t * s.k + j] = wv;
  pair_index[t * s.k + j] = int(t * s.k + j);
}

//! One warp per token (many tokens: prefill): scores, top-k, weights; also the pair indices the
//! sort carries. A chosen expert's key becomes 0, below every score's, so every slot gets a valid
//! expert whatever the scores hold (k <= experts), NaN included: no slot is left at a sentinel.
DSV4_KERNEL void __launch_bounds__(256)
    route_kernel(const float* logits, long long tokens, moe_shape s, const float* bias, const float* bias_vl,
                 const std::uint8_t* is_image, int* sel_expert, float* sel_weight, int* pair_index) {
  runtime::start_after_previous_grid();
  constexpr int kPerLane = max_experts / 32;
  const long long t = (long long)blockIdx.x * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= tokens) return;
  const float* b = is_image && bias_vl && is_image[t] ? bias_vl : bias;
  float score[kPerLane];
  unsigned long long rank[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    const route_entry r = e < s.experts ? route_entry_of(logits + t * s.experts, b, e) : route_entry{0.0f, 0ull};
    score[i] = r.score, rank[i] = r.key;
  }
  float sum = 0.0f, chosen_score = 0.0f;
  int chosen = 0;
  for (int j = 0; j < s.k; ++j) {
    // This lane's best remaining expert, then the warp's.
    unsigned long long best = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) best = rank[i] > best ? rank[i] : best;
    for (int off = 16; off > 0; off >>= 1) {
      const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, off);
      best = other > best ? other : best;
    }
    const int best_e = int(~static_cast<unsigned>(best));  // best != 0: fewer than k <= experts were retired
    // The owner lane retires the expert and broadcasts its unbiased score.
    float sc = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (lane + 32 * i == best_e) sc = score[i], rank[i] = 0;
    sc = __shfl_sync(0xffffffffu, sc, best_e % 32);
    sum = __fadd_rn(sum, sc);
    if (lane == j) chosen = best_e, chosen_score = sc;
  }
  if (lane < s.k) write_route_slot(t, lane, s, chosen, chosen_score, sum, sel_expert, sel_weight, pair_index);
}

//! Calls of up to this many tokens (decode) route with one CTA per token (route_cta_kernel).
inline constexpr long long route_cta_max_tokens = 32;

//! The slots of token t, computed by one CTA of max_experts threads, a thread per expert: the same
//! slots as route_kernel. Why: route_kernel's single warp per token is a chain of dependent steps
//! (k rounds of a 16-step maximum and five shuffles), about 2,000 instructions at 12 to 14 cycles
//! each (ncu: 14.2 us for one token, the longest kernel of the MoE layer after its GEMMs). Here
//! each expert's rank is the count of larger keys (keys are distinct), in parallel over the
//! experts, and the slots are the experts of rank < k: the same choice and order as k rounds of
//! taking the maximum. A CTA that routes several tokens in turn separates them by a barrier.
DSV4_DEVICE void route_token_in_cta(long long t, const float* logits, const moe_shape& s, const float* bias,
                                    const float* bias_vl, const std::uint8_t* is_image, int* sel_expert,
                                    float* sel_weight, int* pair_index) {
  __shared__ __align__(16) unsigned long long keys[max_experts];
  __shared__ int slot_expert[max_top_k];
  __shared__ float slot_score[max_top_k];
  const int e = threadIdx.x;
  const float* b = is_image && bias_vl && is_image[t] ? bias_vl : bias;
  const route_entry r = e < s.experts ? route_entry_of(logits + t * s.experts, b, e) : route_entry{0.0f, 0ull};
  keys[e] = r.key;
  __syncthreads();
  if (e < s.experts) {
    // Two keys a load (s.experts is not always even: the key past the last expert is 0).
    int rank = 0;
#pragma unroll 4
    for (int i = 0; i < s.experts; i += 2) {
      const ulonglong2 two = *reinterpret_cast<const ulonglong2*>(keys + i);
      rank += int(two.x > r.key) + int(two.y > r.key);
    }
    if (rank < s.k) slot_expert[rank] = e, slot_score[rank] = r.score;
  }
  __syncthreads();
  if (e < s.k) {
    float sum = 0.0f;
    for (int j = 0; j < s.k; ++j) sum = __fadd_rn(sum, slot_score[j]);
    write_route_slot(t, e, s, slot_expert[e], slot_score[e], sum, sel_expert, sel_weight, pair_index);
  }
}

//! One CTA per token (few tokens: decode): route_token_in_cta.
DSV4_KERNEL void __launch_bounds__(max_experts)
    route_cta_kernel(const float* logits, moe_shape s, const float* bias, const float* bias_vl,
                     const std::uint8_t* is_image, int* sel_expert, float* sel_weight, int* pair_index) {
  runtime::start_after_previous_grid();
  route_token_in_cta(blockIdx.x, logits, s, bias, bias_vl, is_image, sel_expert, sel_weight, pair_index);
}

//! Which route kernel runs (tests compare them; `automatic`: by token count).
enum class route_impl { automatic, per_warp, per_cta };

//! The routing of `tokens` tokens: sel_expert / sel_weight / pair_index [tokens, k].
inline void route(const float* logits, long long tokens, const moe_shape& s, const float* bias, const float* bias_vl,
                  const std::uint8_t* is_image, int* sel_expert, float* sel_weight, int* pair_index,
                  cudaStream_t stream, route_impl impl = route_impl::automatic) {
  if (tokens <= 0) return;
  const bool per_cta = impl == route_impl::per_cta || (impl == route_impl::automatic && tokens <= route_cta_max_tokens);
  if (per_cta) {
    if (tokens > 65535) throw error("moe route: one CTA per token takes at most 65,535 tokens");
    runtime::launch_programmatic(route_cta_kernel, dim3(unsigned(tokens)), dim3(max_experts), 0, stream, logits, s,
                                 bias, bias_vl, is_image, sel_expert, sel_weight, pair_index);
  } else {
    runtime::launch_programmatic(route_kernel, dim3(unsigned((tokens + 7) / 8)), dim3(256), 0, stream, logits, tokens,
                                 s, bias, bias_vl, is_image, sel_expert, sel_weight, pair_index);
  }
  DSV4_CUDA_CHECK_LAUNCH();
}

//! One CTA: each expert's run in the sorted pairs becomes tiles of at most `tile` rows.
//! Only experts [first, first + count) get tiles; a tile's group is the expert's index in that
//! range (its weights' position).
DSV4_KERNEL void __launch_bounds__(max_experts)
    tile_list_kernel(const int* sorted_expert, int pairs, int first, int count, int tile, int* tile_group,
                     int* tile_row0, int* tile_rows, int* tile_count) {
  runtime::start_after_previous_grid();
  using scan = cub::BlockScan<int, max_experts>;
  __shared__ typename scan::TempStorage temp;
  const int local = threadIdx.x, e = first + local;
  auto lower_bound = [&](int key) {
    int lo = 0, hi = pairs;
    while (lo < hi) {
      const int mid = lo + (hi - lo) / 2;
      if (sorted_expert[mid] < key)
        lo = mid + 1;
      else
        hi = mid;
    }
    return lo;
  };
  const int begin = local < count ? lower_bound(e) : 0, end = local < count ? lower_bound(e + 1) : 0;
  const int tiles = (end - begin + tile - 1) / tile;
  int at = 0, total = 0;
  scan(temp).ExclusiveSum(tiles, at, total);
  for (int i = 0; i < tiles; ++i) {
    tile_group[at + i] = local;
    tile_row0[at + i] = begin + i * tile;
    tile_rows[at + i] = min(tile, end - begin - i * tile);
  }
  if (threadIdx.x == 0) *tile_count = total;
}

//! For each sorted row: its token (A's row for w1 / w3) and, per pair, its row (for the combine).
DSV4_KERNEL void rows_kernel(const int* sorted_pair, int pairs, int k, int* row_token, int* pair_row) {
  runtime::start_after_previous_grid();
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= pairs) return;
  const int p = sorted_pair[r];
  row_token[r] = p / k;
  pair_row[p] = r;
}

//! Pairs up to which a call dispatches in one CTA (dispatch_kernel) instead of CUB's sort, the
//! tile list and the row maps (three launches): every decode batch up to 85 tokens at k = 6.
inline constexpr int dispatch_max_pairs = max_experts;

//! What a dispatch writes (moe_workspace's buffers): the pairs' order by expert, the row maps and
//! the tile list of the grouped GEMMs.
struct dispatch_outputs {
  int* sorted_expert = nullptr;  //!< [pairs] the expert of each sorted row
  int* sorted_pair = nullptr;    //!< [pairs] the pair of each sorted row
  int* row_token = nullptr;      //!< [pairs] the token of each sorted row
  int* pair_row = nullptr;       //!< [pairs] the sorted row of each pair
  int* tile_group = nullptr;     //!< [tiles] the expert of each tile, within the slice
  int* tile_row0 = nullptr;      //!< [tiles] each tile's first sorted row
  int* tile_rows = nullptr;      //!< [tiles] each tile's rows
  int* tile_count = nullptr;     //!< [1] the number of tiles
};

//! The dispatch of a small call by one CTA of max_experts threads: the pairs' stable order by
//! expert (a pair's sorted row is its expert's first row, a scan of the per-expert counts, plus
//! the number of earlier pairs with the same expert: the order of the stable radix sort), the
//! row maps of rows_kernel and the tile list of tile_list_kernel, the same values as those
//! three. Needs pairs <= dispatch_max_pairs and experts <= max_experts (every expert id below it).
DSV4_DEVICE void dispatch_in_cta(const int* sel_expert, int pairs, int k, int first, int count, int tile,
                                 const dispatch_outputs& out) {
  using scan = cub::BlockScan<int, max_experts>;
  __shared__ typename scan::TempStorage temp;
  __shared__ int expert_of[dispatch_max_pairs], rows_of[max_experts], begin_of[max_experts];
  const int tid = threadIdx.x;
  rows_of[tid] = 0;
  if (tid < pairs) expert_of[tid] = sel_expert[tid];
  __syncthreads();
  if (tid < pairs) atomicAdd(&rows_of[expert_of[tid]], 1);
  __syncthreads();
  int begin = 0;
  scan(temp).ExclusiveSum(rows_of[tid], begin);
  begin_of[tid] = begin;
  __syncthreads();
  if (tid < pairs) {
    const int e = expert_of[tid];
    int r = begin_of[e];
    for (int q = 0; q < tid; ++q) r += expert_of[q] == e;
    out.sorted_expert[r] = e;
    out.sorted_pair[r] = tid;
    out.row_token[r] = tid / k;
    out.pair_row[tid] = r;
  }
  // Tiles of the slice's experts [first, first + count), in expert order.
  const int rows = tid < count ? rows_of[first + tid] : 0, row0 = tid < count ? begin_of[first + tid] : 0;
  const int tiles = (rows + tile - 1) / tile;
  int at = 0, total = 0;
  __syncthreads();  // temp is reused
  scan(temp).ExclusiveSum(tiles, at, total);
  for (int i = 0; i < tiles; ++i) {
    out.tile_group[at + i] = tid;
    out.tile_row0[at + i] = row0 + i * tile;
    out.tile_rows[at + i] = min(tile, rows - i * tile);
  }
  if (tid == 0) *out.tile_count = total;
}

DSV4_KERNEL void __launch_bounds__(max_experts)
    dispatch_kernel(const int* sel_expert, int pairs, int k, int first, int count, int tile,
                    dispatch_outputs out) {
  runtime::start_after_previous_grid();
  dispatch_in_cta(sel_expert, pairs, k, first, count, tile, out);
}

//! Calls of up to this many tokens route and dispatch in one CTA (route_dispatch_kernel): one
//! launch boundary fewer a layer, where a launch boundary costs a decode step about 2.5 us (one
//! launch fewer a layer made a V4.1-width step 0.1 ms faster at batch 1, docs/perf.md, forty-second
//! session) and one more token's routing in the same CTA about 1.6 us at 384 experts (its rank
//! count: 192 key-pair loads a thread).
inline constexpr long long route_in_dispatch_max_tokens = 2;

//! route_cta_kernel's slots for each of the call's tokens in turn, then dispatch_in_cta: one
//! launch for routing and dispatch of a call of a token or two (the values of the two launches).
DSV4_KERNEL void __launch_bounds__(max_experts)
    route_dispatch_kernel(const float* logits, int tokens, moe_shape s, const float* bias,
                          const float* bias_vl, const std::uint8_t* is_image, int* sel_expert,
                          float* sel_weight, int* pair_index, int first, int count, int tile,
                          dispatch_outputs out) {
  runtime::start_after_previous_grid();
  for (int t = 0; t < tokens; ++t) {
    route_token_in_cta(t, logits, s, bias, bias_vl, is_image, sel_expert, sel_weight, pair_index);
    __syncthreads();  // the next token's keys overwrite these; the slots are written for the dispatch
  }
  dispatch_in_cta(sel_expert, tokens * s.k, s.k, first, count, tile, out);
}

//! weight * (silu(min(g, L)) * clamp(u, -L, L)) in fp32, the value SwiGLU rounds to bf16.
DSV4_DEVICE float swiglu_value(float g, float u, float limit, float weight) {
  const float gv = fminf(g, limit);
  const float uv = fminf(fmaxf(u, -limit), limit);
  const float silu = __fdiv_rn(gv, __fadd_rn(1.0f, expf(-gv)));
  return __fmul_rn(weight, __fmul_rn(silu, uv));
}

//! h = bf16(swiglu_value(g, u)) with the row's route weight (1 if `sel_weight` is null), then
//! act_quant of h (E4M3, UE8M0 per 32) into `hq` / `hs`: 8 values per thread, the quantizer's own
//! per-thread step (numerics quantize_chunk8), so the bytes are those of quantizing a stored h,
//! without storing it or a second launch.
DSV4_KERNEL void swiglu_quantize_kernel(const bf16* g, const bf16* u, long long rows, int inter, float limit,
                                        const float* sel_weight, const int* sorted_pair, std::uint8_t* hq,
                                        std::uint8_t* hs, std::uint16_t* h16) {
  runtime::start_after_previous_grid();
  constexpr int kElems = numerics::detail::quant_elems_per_thread;
  const long long chunks_per_row = inter / kElems;  // inter % 32 == 0: a scale block never spans rows
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const bool active = t < rows * chunks_per_row;
  const long long r = active ? t / chunks_per_row : 0, chunk = active ? t % chunks_per_row : 0;
  bf16 h[kElems];
  if (active) {
    const float w = sel_weight ? sel_weight[sorted_pair[r]] : 1.0f;
    const uint4 graw = *reinterpret_cast<const uint4*>(g + r * inter + chunk * kElems);
    const uint4 uraw = *reinterpret_cast<const uint4*>(u + r * inter + chunk * kElems);
    const std::uint32_t gw[4] = {graw.x, graw.y, graw.z, graw.w}, uw[4] = {uraw.x, uraw.y, uraw.z, uraw.w};
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      const float gv = __uint_as_float((gw[e / 2] >> (16 * (e % 2))) << 16);
      const float uv = __uint_as_float((uw[e / 2] >> (16 * (e % 2))) << 16);
      h[e] = bf16::from_float(swiglu_value(gv, uv, limit, w));
    }
  }
  numerics::detail::quantize_chunk8<numerics::fp8_act_format>(h, active, hq + r * inter, hs + r * (inter / 32), chunk,
                                                              h16 ? h16 + r * inter : nullptr);
}

//! SwiGLU + act_quant of `rows` rows (swiglu_quantize_kernel).
inline void swiglu_quantize(const bf16* g, const bf16* u, long long rows, int inter, float limit,
                            const float* sel_weight, const int* sorted_pair, std::uint8_t* hq, std::uint8_t* hs,
                            std::uint16_t* h16, cudaStream_t stream) {
  const long long threads = rows * (inter / numerics::detail::quant_elems_per_thread);
  if (threads == 0) return;
  runtime::launch_programmatic(swiglu_quantize_kernel, dim3(unsigned((threads + 255) / 256)), dim3(256), 0, stream,
                               g, u, rows, inter, limit, sel_weight, sorted_pair, hq, hs, h16);
  DSV4_CUDA_CHECK_LAUNCH();
}

//! Per token: experts' outputs in ascending expert id into fp32 from 0, then the shared output.
//! Grid (tokens, channel blocks of 128 x 8): each thread eight consecutive channels of one token
//! (16-byte loads and stores), so that a decode step's few tokens still spread over the SMs (one
//! CTA per token walked 4,096+ channels serially: 41 us a layer at batch 1). The token's slots
//! are put in expert order once per CTA (k lanes of warp 0 rank their experts by counting, the
//! experts of a token being distinct) instead of per thread (an insertion sort in local memory
//! and k dependent index loads per channel: 6.6 us at one token, ncu), and each thread issues all
//! of its rows' loads before adding. The sum per channel is the same sequence of additions.
//! With an expert slice ([first, first + count), `routed` non-null): only those experts, the fp32
//! sum written to `routed`, no shared output, y untouched.
inline constexpr int combine_threads = 128, combine_channels_per_thread = 8;
DSV4_KERNEL void __launch_bounds__(combine_threads)
    combine_kernel(const bf16* expert_out, const bf16* shared_out, const int* sel_expert, const int* pair_row,
                   long long tokens, int k, int dim, int first, int count, float* routed, bf16* y) {
  __shared__ int rows_in_order[max_top_k];  // the sorted rows of the token's slots in the slice, by expert id
  __shared__ int slice_slots;
  runtime::start_after_previous_grid();
  const long long t = blockIdx.x;
  if (t >= tokens) return;
  if (threadIdx.x < 32) {
    const int j = int(threadIdx.x);
    const int e = j < k ? sel_expert[t * k + j] : 0x7fffffff;
    const bool in_slice = j < k && e >= first && e < first + count;
    int rank = 0;  // slots of the slice with a lower expert id
    for (int i = 0; i < k; ++i) {
      const int other = __shfl_sync(0xffffffffu, e, i);
      rank += int(other >= first && other < first + count && other < e);
    }
    if (in_slice) rows_in_order[rank] = pair_row[t * k + j];
    const unsigned held = __ballot_sync(0xffffffffu, in_slice);
    if (j == 0) slice_slots = __popc(held);
  }
  __syncthreads();
  const int d0 = (int(blockIdx.y) * combine_threads + int(threadIdx.x)) * combine_channels_per_thread;
  if (d0 >= dim) return;  // (dim is a multiple of 32: a thread's eight channels are all inside)
  const int n = slice_slots;
  uint4 part[max_top_k];
#pragma unroll
  for (int j = 0; j < max_top_k; ++j)
    if (j < n) part[j] = *reinterpret_cast<const uint4*>(expert_out + (long long)rows_in_order[j] * dim + d0);
  float acc[combine_channels_per_thread] = {};
#pragma unroll
  for (int j = 0; j < max_top_k; ++j)
    if (j < n) {
      const bf16* v = reinterpret_cast<const bf16*>(&part[j]);
#pragma unroll
      for (int c = 0; c < combine_channels_per_thread; ++c) acc[c] = __fadd_rn(acc[c], v[c].to_float());
    }
  if (routed) {
    float4* out = reinterpret_cast<float4*>(routed + t * dim + d0);
    out[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    out[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    return;
  }
  const uint4 sh = *reinterpret_cast<const uint4*>(shared_out + t * dim + d0);
  const bf16* shv = reinterpret_cast<const bf16*>(&sh);
  uint4 result;
  bf16* r = reinterpret_cast<bf16*>(&result);
#pragma unroll
  for (int c = 0; c < combine_channels_per_thread; ++c) r[c] = bf16::from_float(__fadd_rn(acc[c], shv[c].to_float()));
  *reinterpret_cast<uint4*>(y + t * dim + d0) = result;
}

//! y = bf16(routed + shared_out): an expert-parallel layer's last step, after the all-reduce.
DSV4_KERNEL void add_shared_kernel(const float* routed, const bf16* shared_out, long long n, bf16* y) {
  runtime::start_after_previous_grid();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = bf16::from_float(__fadd_rn(routed[i], shared_out[i].to_float()));
}

//! offsets[e] = the first sorted row whose expert is >= e, for e = 0 .. experts (a binary search
//! of the ascending expert column per thread).
DSV4_KERNEL void expert_offsets_kernel(const int* sorted_expert, int pairs, int experts, int* offsets) {
  runtime::start_after_previous_grid();
  const int e = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (e > experts) return;
  int lo = 0, hi = pairs;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (sorted_expert[mid] < e)
      lo = mid + 1;
    else
      hi = mid;
  }
  offsets[e] = lo;
}

//! The prefill path of one routed projection (w1 or w3 from x, or w2 from h): the sorted rows are
//! taken in windows of max_tokens rows; each window's activations are dequantized to bf16 once
//! (gathered through `row_index` for x), then every expert with rows in the window has its weight
//! dequantized to bf16 and one cuBLAS GEMM computes its rows (fp32 accumulation; only the
//! summation order differs from the block-wise reference, as in gemm::dequant_gemm). Needs
//! ws.expert_offsets_host filled.
inline void dense_expert_projection(const std::uint8_t* a, const std::uint8_t* a_s, const int* row_index,
                                    int k, const std::uint8_t* w, const std::uint8_t* w_s, int n, bf16* out,
                                    int first, int count, moe_workspace& ws, cublasHandle_t blas,
                                    cudaStream_t stream) {
  const moe_shape& s = ws.shape();
  const gemm::weight_tile_shape shape{n, k, gemm::weight_format::fp4_row32};
  const long long window = ws.max_tokens();
  const std::size_t wide = std::size_t(std::max(s.dim, s.inter));
  bf16* a16 = ws.gemm.dequant();
  bf16* w16 = a16 + std::size_t(window) * wide;
  const int* offsets = ws.expert_offsets_host.data();
  if (offsets[first] == offsets[first + count]) return;  // no row of the slice's experts in this call
  const gemm::detail::blas_call call(blas, stream, gemm::detail::bf16_math);
  // Only the windows that hold the slice's rows (a contiguous run: the rows are sorted by
  // expert), cut where an unsliced call cuts them, so each expert's GEMMs are the same calls.
  for (long long r0 = offsets[first] / window * window; r0 < offsets[first + count]; r0 += window) {
    const long long r1 = std::min<long long>(offsets[first + count], r0 + window);
    gemm::detail::dequantize_activation_rows(a, a_s, row_index, r0, r1 - r0, k, a16, stream);
    for (int e = first; e < first + count; ++e) {
      const long long b = std::max<long long>(r0, offsets[e]), end = std::min<long long>(r1, offsets[e + 1]);
      if (b >= end) continue;
      gemm::detail::dequantize_weight(gemm::weight_format::fp4_row32,
                                      w + (e - first) * (long long)shape.code_bytes(),
                                      w_s + (e - first) * (long long)shape.scale_bytes(), n, k, w16, stream);
      gemm::detail::bf16_gemm_nt(blas, a16 + std::size_t(b - r0) * k, w16, out + std::size_t(b) * n,
                                 int(end - b), n, k, "moe_forward: expert GEMM (cublasGemmEx)");
    }
  }
}

}  // namespace detail

//! Whether a moe_forward over `tokens` tokens without the host sync (a decode call) dispatches
//! in one launch: then it issues only kernel launches (runtime::launch_ex) and cuBLAS GEMMs
//! (issue_blas), as a captured decode segment needs (runtime/segment_graph.cuh); larger calls
//! sort with CUB, whose launches no launch_log sees.
inline bool dispatch_in_one_launch(const moe_shape& s, long long tokens) {
  return tokens * s.k <= detail::dispatch_max_pairs;
}

//! y = MoE(x) for `tokens` tokens (x: the bf16 ffn_norm output). `is_image` (optional, one byte
//! per token) picks bias_vl for image-span tokens. With a cuBLAS handle (`blas`), the shared
//! expert takes the dequantize + cuBLAS path from gemm::dequant_min_tokens tokens, and, when
//! `allow_host_sync`, prefill-sized calls take it for the routed experts too
//! (dense_min_rows_per_expert, see dense_expert_projection), which copies the per-expert row
//! counts to the host and waits for them: such a call synchronizes its stream once and cannot be
//! captured in a CUDA graph. Decode steps pass allow_host_sync = false (device_model does).
//! With a `slice` (expert parallelism, file comment) the routed sum goes to slice.routed and y
//! may be null. Throws dsv4::error on bad shapes.
inline void moe_forward(const bf16* x, long long tokens, const std::uint8_t* is_image, const moe_weights& w,
                        bf16* y, moe_workspace& ws, cudaStream_t stream = nullptr,
                        cublasHandle_t blas = nullptr, bool allow_host_sync = true,
                        const expert_slice& slice = {}, const numerics::act_quant_view& x_act = {}) {
  const moe_shape& s = ws.shape();
  const std::string where = "moe_forward (tokens " + std::to_string(tokens) + "): ";
  if (tokens < 0 || tokens > ws.max_tokens())
    throw error(where + "the workspace holds " + std::to_string(ws.max_tokens()) + " tokens");
  if (s.experts < 1 || s.experts > max_experts || s.k < 1 || s.k > max_top_k || s.k > s.experts)
    throw error(where + "need 1 <= k <= min(" + std::to_string(max_top_k) +
                ", experts) and experts <= " + std::to_string(max_experts));
  if (s.dim % 32 || s.inter % 32) throw error(where + "dim and inter must be multiples of 32");
  if (slice.count < 0 || slice.first < 0 ||
      (slice.count > 0 && (slice.first > s.experts - slice.count || !slice.routed)) ||
      (slice.count == 0 && (slice.first != 0 || slice.routed)))
    throw error(where + "the expert slice (first " + std::to_string(slice.first) + ", count " +
                std::to_string(slice.count) + ") must lie within the layer's " + std::to_string(s.experts) +
                " experts and name an fp32 output for its routed sum (count 0: no slice, no output)");
  const int first = slice.count ? slice.first : 0, count = slice.count ? slice.count : s.experts;
  if (!x || (!y && !slice.routed) || !w.gate || !w.bias || !w.w1 || !w.w3 || !w.w2 || !w.s1 || !w.s3 ||
      !w.s2 || !w.w1_s || !w.w3_s || !w.w2_s || !w.s1_s || !w.s3_s || !w.s2_s)
    throw error(where + "null input, output, weight or weight scale");
  if (is_image && !w.bias_vl) throw error(where + "image tokens are flagged but the layer has no bias_vl");
  if (bool(x_act.codes) != bool(x_act.scales) || (x_act.codes_f16 && !x_act.codes))
    throw error(where + "x's act_quant needs both codes and scales (and its f16 copy only beside them)");
  auto misaligned = [](const void* p, std::size_t a) { return reinterpret_cast<std::uintptr_t>(p) % a != 0; };
  if (misaligned(x, 16) || misaligned(w.gate, 16) || misaligned(y, 16) || misaligned(slice.routed, 16))
    throw error(where + "x, y, the routed sum and the gate weight must be 16-byte aligned");
  if (misaligned(w.w1, 8) || misaligned(w.w3, 8) || misaligned(w.w2, 8) || misaligned(w.s1, 16) ||
      misaligned(w.s3, 16) || misaligned(w.s2, 16))
    throw error(where + "expert weights (MMA tiles) must be 8-byte (FP4) / 16-byte (FP8) aligned");
  if (tokens == 0) return;
  const int pairs = int(tokens * s.k);

  // The routed experts' path: the prefill one (dense) or the grouped GEMMs.
  const bool dense = blas && allow_host_sync && pairs >= dense_min_rows_per_expert * s.experts &&
                     dense_dequant_elems(s, ws.max_tokens()) > 0 &&
                     ws.gemm.dequant_elems() >= dense_dequant_elems(s, ws.max_tokens());
  // act_quant of x once, for the routed and the shared experts (and, up to f16_copy_max_tokens,
  // the codes as f16 for the grouped GEMMs' streamed kernel: block_scaled_gemm_args::a_f16).
  // The caller's act_quant of x (x_act: mhc_step writes it beside h) stands in for this one where
  // it holds all that the call reads (the f16 copy where the grouped GEMMs take it).
  const bool f16 = !dense && tokens <= ws.f16_tokens();
  std::uint16_t* const hh = f16 ? ws.hh.data() : nullptr;
  const bool given = x_act.codes && (!f16 || x_act.codes_f16);
  const std::uint8_t* const xq = given ? x_act.codes : ws.xq.data();
  const std::uint8_t* const xs = given ? x_act.scales : ws.xs.data();
  const std::uint16_t* const xh = !f16 ? nullptr : given ? x_act.codes_f16 : ws.xh.data();
  // 1. Gate logits, with the act_quant of x where the caller gave none (the gate's launch stages
  // x anyway: gate_act_quant).
  detail::gate_logits(x, tokens, s.dim, w.gate, s.experts, s.gate_temp, ws.logits.data(), stream,
                      given
                          ? detail::gate_act_quant{}
                          : detail::gate_act_quant{ws.xq.data(), ws.xs.data(), f16 ? ws.xh.data() : nullptr});
  // 5. The shared expert (FP8), all tokens. It does not depend on the routing: at decode it runs
  // on the workspace's second stream, beside steps 2-4, whose first kernels (route and dispatch,
  // then the grouped GEMMs' ramp) leave most SMs idle; joined before step 6. Where one of
  // its GEMMs would take the dequantize + cuBLAS path (gemm::takes_dequant_path) it stays on
  // `stream`: that path's scratch and cuBLAS handle are the routed experts' too.
  const int m = int(tokens);
  const bool shared_beside = !gemm::takes_dequant_path({m, s.inter, s.dim}, &ws.gemm, blas) &&
                             !gemm::takes_dequant_path({m, s.dim, s.inter}, &ws.gemm, blas);
  auto shared_expert = [&](cudaStream_t st) {
    // (w1 and w3 in one launch at decode: block_scaled_linear_pair.)
    gemm::block_scaled_linear_pair({{m, s.inter, s.dim}, xq, xs, w.s1, w.s1_s, ws.sg.data()},
                                   {{m, s.inter, s.dim}, xq, xs, w.s3, w.s3_s, ws.su.data()},
                                   gemm::weight_format::fp8_tile32, &ws.gemm, blas, st);
    detail::swiglu_quantize(ws.sg.data(), ws.su.data(), tokens, s.inter, s.swiglu_limit, nullptr, nullptr,
                            ws.shq.data(), ws.shs.data(), nullptr, st);
    gemm::block_scaled_linear({{m, s.dim, s.inter}, ws.shq.data(), ws.shs.data(), w.s2, w.s2_s, ws.shared_out.data()},
                              gemm::weight_format::fp8_tile32, &ws.gemm, blas, st);
  };
  if (shared_beside) {
    runtime::order_after(ws.shared_stream.get(), stream, ws.forked);
    shared_expert(ws.shared_stream.get());
  }

  // 2-3. Routing, then the dispatch: stable sort by expert, tile list, row maps.
  // Rows per tile: 8, or 16 where the experts average 8 rows or more. 32-row tiles (the grouped
  // kernels take them) were measured no faster: bench_model's 16-expert V4.1 at batch 64 (24 rows
  // an expert) 47.6 ms a step against 46.4 with 16 (docs/decisions.md, "MoE tiles of 32 rows").
  const int tile = pairs / s.experts >= 8 ? 16 : 8;
  const bool small = !dense && pairs <= detail::dispatch_max_pairs;
  const detail::dispatch_outputs dispatched{
      ws.sorted_expert.data(), ws.sorted_pair.data(), ws.row_token.data(), ws.pair_row.data(),
      ws.tile_group.data(),    ws.tile_row0.data(),   ws.tile_rows.data(), ws.tile_count.data()};
  const bool routed_in_dispatch = small && tokens <= detail::route_in_dispatch_max_tokens;
  if (routed_in_dispatch) {  // decode of a token or two: one launch
    runtime::launch_programmatic(detail::route_dispatch_kernel, dim3(1), dim3(max_experts), 0, stream,
                                 ws.logits.data(), int(tokens), s, w.bias, w.bias_vl, is_image,
                                 ws.sel_expert.data(), ws.sel_weight.data(), ws.pair_index.data(), first,
                                 count, tile, dispatched);
    DSV4_CUDA_CHECK_LAUNCH();
  } else {
    detail::route(ws.logits.data(), tokens, s, w.bias, w.bias_vl, is_image, ws.sel_expert.data(),
                  ws.sel_weight.data(), ws.pair_index.data(), stream);
  }
  if (small && !routed_in_dispatch) {  // decode: all of the dispatch in one launch
    runtime::launch_programmatic(detail::dispatch_kernel, dim3(1), dim3(max_experts), 0, stream,
                                 ws.sel_expert.data(), pairs, s.k, first, count, tile, dispatched);
    DSV4_CUDA_CHECK_LAUNCH();
  } else if (!small) {
    std::size_t temp_bytes = ws.sort_temp.size();
    DSV4_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws.sort_temp.data(), temp_bytes, ws.sel_expert.data(),
                                                    ws.sorted_expert.data(), ws.pair_index.data(),
                                                    ws.sorted_pair.data(), pairs, 0, 10, stream));
    if (dense) {
      runtime::launch_programmatic(detail::expert_offsets_kernel, dim3(unsigned((s.experts + 256) / 256)),
                                   dim3(256), 0, stream, ws.sorted_expert.data(), pairs, s.experts,
                                   ws.expert_offsets.data());
      DSV4_CUDA_CHECK_LAUNCH();
      DSV4_CUDA_CHECK(cudaMemcpyAsync(ws.expert_offsets_host.data(), ws.expert_offsets.data(),
                                      sizeof(int) * (std::size_t(s.experts) + 1), cudaMemcpyDeviceToHost,
                                      stream));
    } else {
      runtime::launch_programmatic(detail::tile_list_kernel, dim3(1), dim3(max_experts), 0, stream,
                                   ws.sorted_expert.data(), pairs, first, count, tile, ws.tile_group.data(),
                                   ws.tile_row0.data(), ws.tile_rows.data(), ws.tile_count.data());
      DSV4_CUDA_CHECK_LAUNCH();
    }
    runtime::launch_programmatic(detail::rows_kernel, dim3(unsigned((pairs + 255) / 256)), dim3(256), 0, stream,
                                 ws.sorted_pair.data(), pairs, s.k, ws.row_token.data(), ws.pair_row.data());
    DSV4_CUDA_CHECK_LAUNCH();
  }
  // 4. Routed experts.
  const gemm::weight_tile_shape up{s.inter, s.dim, gemm::weight_format::fp4_row32};
  const gemm::weight_tile_shape down{s.dim, s.inter, gemm::weight_format::fp4_row32};
  const long long pairs_bound = (long long)tokens * s.k;
  const int max_tiles =
      int((pairs_bound + (tile - 1) * std::min<long long>(s.experts, pairs_bound)) / tile + 1);
  gemm::gemm_groups groups{ws.tile_group.data(),       ws.tile_row0.data(), ws.tile_rows.data(),
                           ws.tile_count.data(),       ws.row_token.data(), (long long)up.code_bytes(),
                           (long long)up.scale_bytes()};
  const int token_tiles = tile / 8;
  if (dense) {
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));  // the row counts, for the per-expert launches
    detail::dense_expert_projection(xq, xs, ws.row_token.data(), s.dim, w.w1, w.w1_s, s.inter, ws.g.data(),
                                    first, count, ws, blas, stream);
    detail::dense_expert_projection(xq, xs, ws.row_token.data(), s.dim, w.w3, w.w3_s, s.inter, ws.u.data(),
                                    first, count, ws, blas, stream);
  } else {
    const gemm::block_scaled_gemm_args up3{{pairs, s.inter, s.dim}, xq, xs, w.w3, w.w3_s, ws.u.data(), xh};
    gemm::decode_grouped_gemm({{pairs, s.inter, s.dim}, xq, xs, w.w1, w.w1_s, ws.g.data(), xh}, groups,
                              gemm::weight_format::fp4_row32, max_tiles, token_tiles, stream,
                              &up3);  // w1 and w3 in one launch
  }
  detail::swiglu_quantize(ws.g.data(), ws.u.data(), pairs, s.inter, s.swiglu_limit, ws.sel_weight.data(),
                          ws.sorted_pair.data(), ws.hq.data(), ws.hs.data(), hh, stream);
  groups.a_row_index = nullptr;  // w2 reads the activations in sorted order
  // The tile list is the routing's, two launches back (w1 + w3, SwiGLU): w2 may read it and start
  // its weights before SwiGLU is done (where set_early_expert_stream is on).
  groups.list_settled = gemm::early_expert_stream();
  groups.w_group_bytes = (long long)down.code_bytes();
  groups.ws_group_bytes = (long long)down.scale_bytes();
  if (dense)
    detail::dense_expert_projection(ws.hq.data(), ws.hs.data(), nullptr, s.inter, w.w2, w.w2_s, s.dim,
                                    ws.expert_out.data(), first, count, ws, blas, stream);
  else
    gemm::decode_grouped_gemm(
        {{pairs, s.dim, s.inter}, ws.hq.data(), ws.hs.data(), w.w2, w.w2_s, ws.expert_out.data(), hh}, groups,
        gemm::weight_format::fp4_row32, max_tiles, token_tiles, stream);
  // 5 (end). The shared expert joins here, or runs here where it cannot run beside.
  if (shared_beside)
    runtime::order_after(stream, ws.shared_stream.get(), ws.joined);
  else
    shared_expert(stream);
  // 6. Combine.
  constexpr int per_cta = detail::combine_threads * detail::combine_channels_per_thread;
  const dim3 combine_grid(unsigned(tokens), unsigned((s.dim + per_cta - 1) / per_cta));
  runtime::launch_programmatic(detail::combine_kernel, combine_grid, dim3(detail::combine_threads), 0, stream,
                               ws.expert_out.data(), ws.shared_out.data(), ws.sel_expert.data(),
                               ws.pair_row.data(), tokens, s.k, s.dim, first, count, slice.routed, y);
  DSV4_CUDA_CHECK_LAUNCH();
}

//! The last step of an expert-parallel layer: y = bf16(routed + shared), `routed` [tokens, dim]
//! the all-reduced sum of the ranks' routed sums and the shared expert's output the one the same
//! rank's moe_forward left in `ws` (replicated: every rank computes it).
inline void moe_add_shared(const float* routed, long long tokens, moe_workspace& ws, bf16* y,
                           cudaStream_t stream = nullptr) {
  if (tokens < 0 || tokens > ws.max_tokens())
    throw error("moe_add_shared: " + std::to_string(tokens) + " tokens, the workspace holds " +
                std::to_string(ws.max_tokens()));
  if (!routed || !y) throw error("moe_add_shared: null routed sum or output");
  const long long n = tokens * ws.shape().dim;
  if (n == 0) return;
  runtime::launch_programmatic(detail::add_shared_kernel, dim3(unsigned((n + 255) / 256)), dim3(256), 0,
                               stream, routed, static_cast<const bf16*>(ws.shared_out.data()), n, y);
  DSV4_CUDA_CHECK_LAUNCH();
}

}  // namespace dsv4::kernels::moe
