#pragma once
//! \file
//! Host reference of the MoE routing and combination (spec §9).
//!
//! Gate (fp32 throughout): s = fp32(x) . fp32(W)^T / gate_temp; sqrtsoftplus s = sqrt(softplus(s))
//! with softplus(s) = s for s > 20; the bias (bias_vl inside image spans) only chooses the top-k
//! experts (descending biased score in torch.topk's order, NaN above +inf; ties toward the lower
//! expert id: `numerics::topk_order_key`); the weights are the unbiased scores of the chosen experts,
//! normalized by (sum + 1e-20) when k > 1, times route_scale.
//!
//! Expert activation: u clamped to [-limit, limit], g clamped above at limit only, h = silu(g) u
//! times the routing weight, in fp32, rounded to bf16 before w2.
//!
//! Combination: an fp32 buffer starting at 0 adds each chosen expert's bf16 output in ascending
//! expert id (not top-k rank order), then the shared expert's bf16 output, then rounds once.

#include <algorithm>
#include <cstdint>
#include <utility>
#include <cmath>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "dsv4/config.hpp"
#include "dsv4/core/error.hpp"
#include "dsv4/kernels/gemm/reference.hpp"
#include "dsv4/numerics/bits.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/order_key.hpp"
#include "dsv4/numerics/quantize.hpp"

namespace dsv4::kernels::moe {

using numerics::bf16;

struct gate_params {
  int experts = 0, k = 0, dim = 0;
  std::vector<float> weight;  //!< [experts, dim], bf16 values
  std::vector<float> bias;    //!< [experts], fp32
  float route_scale = 1.5f, gate_temp = 1.0f;
  bool norm_topk_prob = true;
};

struct routing {
  std::vector<int> experts;     //!< in descending biased-score order
  std::vector<float> weights;   //!< same order
};

inline float softplus_torch(float s) { return s > 20.0f ? s : std::log1p(std::exp(s)); }

//! Routing ranks each biased score in the top-k, in the host reference and the CUDA route kernel
//! alike, by `numerics::topk_order_key` (numerics/order_key.hpp), torch.topk's order: larger key =
//! chosen first, equal keys go to the lower expert id; every NaN ranks above +inf (and NaNs tie),
//! -inf lowest. It is PyTorch's radix key for fp32 (`TopKTypeConfig<float>::convert` in ATen's
//! SortingRadixSelect.cuh) except that every NaN ranks first (the radix key ranks a negative NaN
//! last); -0 ranks below +0 as there, though a biased score is never -0 (it is +0 or above, or
//! NaN, and x + (-x) is +0). A NaN biased score (a NaN logit, from NaN in
//! x or a gate row, or a NaN bias) therefore picks its expert first, as the reference does; the
//! expert's weight is its unbiased score, so a NaN score makes the token's weights and output NaN,
//! as in the reference, and a NaN bias alone changes only the choice. The keys of all floats are
//! at least 0x007fffff (-inf), so 0 is free to mark an expert already chosen.

inline routing route_reference(std::span<const bf16> x, const gate_params& g) {
  if (x.size() != std::size_t(g.dim) || g.weight.size() != std::size_t(g.experts) * g.dim ||
      g.bias.size() != std::size_t(g.experts) || g.k < 1 || g.k > g.experts)
    throw error("route_reference: x [dim], weight [experts, dim], bias [experts] and 1 <= k <= experts required");
  std::vector<float> s(static_cast<std::size_t>(g.experts));
  std::vector<std::uint32_t> key(s.size());
  for (int e = 0; e < g.experts; ++e) {
    double dot = 0;
    for (int d = 0; d < g.dim; ++d) dot += double(x[std::size_t(d)].to_float()) * g.weight[std::size_t(e) * g.dim + d];
    const float logit = float(dot) / g.gate_temp;
    s[std::size_t(e)] = std::sqrt(softplus_torch(logit));
    key[std::size_t(e)] = numerics::topk_order_key(s[std::size_t(e)] + g.bias[std::size_t(e)]);
  }
  // A total order (integer keys, then ids), so NaN scores cannot break the sort's contract.
  std::vector<int> order(s.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + g.k, order.end(), [&](int a, int b) {
    const std::uint32_t ka = key[std::size_t(a)], kb = key[std::size_t(b)];
    return ka != kb ? ka > kb : a < b;
  });
  routing r;
  r.experts.assign(order.begin(), order.begin() + g.k);
  float sum = 0.0f;
  for (int e : r.experts) {
    r.weights.push_back(s[std::size_t(e)]);
    sum += s[std::size_t(e)];
  }
  if (g.norm_topk_prob && g.k > 1)
    for (float& w : r.weights) w = w / (sum + 1e-20f);
  for (float& w : r.weights) w *= g.route_scale;
  return r;
}

//! The clamped SwiGLU activation times the routing weight, rounded to bf16 (the input of w2).
inline std::vector<bf16> expert_activation(std::span<const bf16> gate_out, std::span<const bf16> up_out, float route_weight,
                                           float limit) {
  if (gate_out.size() != up_out.size()) throw error("expert_activation: w1 and w3 outputs differ in length");
  std::vector<bf16> h(gate_out.size());
  for (std::size_t i = 0; i < h.size(); ++i) {
    const float g = std::min(gate_out[i].to_float(), limit);
    const float u = std::clamp(up_out[i].to_float(), -limit, limit);
    const float silu = g / (1.0f + std::exp(-g));
    h[i] = bf16::from_float(route_weight * (silu * u));
  }
  return h;
}

//! ((0 + e_{i1}) + ... + e_{ik}) + shared in fp32, with i1 < ... < ik (before the one rounding).
inline std::vector<float> combine_fp32(const std::vector<int>& experts, const std::vector<std::vector<bf16>>& outputs,
                                       std::span<const bf16> shared) {
  if (experts.size() != outputs.size()) throw error("combine_reference: one output per chosen expert");
  std::vector<std::size_t> order(experts.size());
  std::iota(order.begin(), order.end(), std::size_t(0));
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return experts[a] < experts[b]; });
  std::vector<float> acc(shared.size(), 0.0f);
  for (std::size_t o : order) {
    if (outputs[o].size() != shared.size()) throw error("combine_reference: expert outputs differ in width");
    for (std::size_t d = 0; d < acc.size(); ++d) acc[d] += outputs[o][d].to_float();
  }
  for (std::size_t d = 0; d < acc.size(); ++d) acc[d] += shared[d].to_float();
  return acc;
}

//! The MoE output: combine_fp32 rounded once to bf16.
inline std::vector<bf16> combine_reference(const std::vector<int>& experts, const std::vector<std::vector<bf16>>& outputs,
                                           std::span<const bf16> shared) {
  const std::vector<float> acc = combine_fp32(experts, outputs, shared);
  std::vector<bf16> y(acc.size());
  for (std::size_t d = 0; d < acc.size(); ++d) y[d] = bf16::from_float(acc[d]);
  return y;
}

//! One expert's weights in the checkpoint layout: w1 and w3 [inter, dim], w2 [dim, inter], with
//! their scales (FP4 routed experts: spec fp4_gemm; the FP8 shared expert: spec fp8_gemm).
struct expert_weights {
  std::vector<std::uint8_t> w1, w1_s, w3, w3_s, w2, w2_s;
};

using gemm::act_quant_reference;

//! One expert on one token: w2(act_quant(swiglu(w1 x, w3 x) * route_weight)), bf16 out.
inline std::vector<bf16> expert_reference(std::span<const std::uint8_t> xq, std::span<const std::uint8_t> xs,
                                          const expert_weights& e, int dim, int inter, bool fp4, float route_weight,
                                          float limit) {
  const gemm::gemm_shape up{1, inter, dim};
  auto gemm = [&](const gemm::gemm_shape& s, std::span<const std::uint8_t> a, std::span<const std::uint8_t> a_s,
                  const std::vector<std::uint8_t>& w, const std::vector<std::uint8_t>& w_s) {
    return fp4 ? gemm::fp4_gemm_reference(s, a, a_s, w, w_s) : gemm::fp8_gemm_reference(s, a, a_s, w, w_s);
  };
  const auto g = gemm(up, xq, xs, e.w1, e.w1_s), u = gemm(up, xq, xs, e.w3, e.w3_s);
  return gemm::block_scaled_linear_reference(expert_activation(g, u, route_weight, limit), dim, e.w2, e.w2_s, fp4);
}

//! The MoE layer for `x` = [tokens, dim] bf16 (the ffn_norm output): routing, the chosen FP4
//! experts, the FP8 shared expert, the combination. Writes each token's routing if asked.
inline std::vector<bf16> moe_layer_reference(std::span<const bf16> x, const gate_params& g,
                                             const std::vector<expert_weights>& experts, const expert_weights& shared,
                                             int inter, float limit, std::vector<routing>* routes = nullptr) {
  if (x.size() % std::size_t(g.dim) || experts.size() != std::size_t(g.experts))
    throw error("moe_layer_reference: x must be [tokens, dim] and one weight set per expert");
  const std::size_t tokens = x.size() / std::size_t(g.dim);
  std::vector<bf16> y;
  y.reserve(x.size());
  for (std::size_t t = 0; t < tokens; ++t) {
    const auto xt = x.subspan(t * std::size_t(g.dim), std::size_t(g.dim));
    const routing r = route_reference(xt, g);
    const auto [xq, xs] = act_quant_reference(xt);
    std::vector<std::vector<bf16>> outs;
    for (std::size_t j = 0; j < r.experts.size(); ++j)
      outs.push_back(expert_reference(xq, xs, experts[std::size_t(r.experts[j])], g.dim, inter, true, r.weights[j], limit));
    const auto sh = expert_reference(xq, xs, shared, g.dim, inter, false, 1.0f, limit);
    const auto yt = combine_reference(r.experts, outs, sh);
    y.insert(y.end(), yt.begin(), yt.end());
    if (routes) routes->push_back(r);
  }
  return y;
}

}  // namespace dsv4::kernels::moe
