#pragma once
//! \file
//! One decoder block of a variant on the host (spec §8 Block.forward), over a chunk of tokens of
//! one sequence, and the binding of its non-attention tensors from a checkpoint:
//!   a  = hc_mixes(X)                                  (attention mixes, per token)
//!   X1 = hc_post(Attn(attn_norm(hc_pre(X, pre_mix))), X, a)
//!   f  = hc_mixes(X1)                                 (FFN mixes)
//!   X2 = hc_post(MoE(ffn_norm(hc_pre(X1, a.pre))), X1, f);  pre_mix <- f.pre
//! The attention sublayer is the host reference of layer_reference.hpp (with the sequence's
//! state); the MoE is moe_layer_reference (routed FP4 experts, FP8 shared expert).

#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/checkpoint.hpp"
#include "dsv4/kernels/mhc/reference.hpp"
#include "dsv4/kernels/moe/reference.hpp"
#include "dsv4/kernels/norm/reference.hpp"
#include "dsv4/model/attention_weights.hpp"

namespace dsv4::model {

using numerics::bf16;

//! Sees a block's intermediates as they are computed, for parity work (host and CUDA models call
//! it at the same points): stage "attn_in" (attn_norm output), "attn_out", "ffn_in" (ffn_norm
//! output), "ffn_out"; values are the call's rows, [rows, dim] bf16.
using layer_observer = std::function<void(int layer, std::string_view stage, std::span<const bf16> values)>;

struct block_weights {
  kernels::attention::layer_weights attn;
  std::vector<float> attn_norm, ffn_norm;
  kernels::mhc::mix_params attn_mix, ffn_mix;
  kernels::moe::gate_params gate;
  std::vector<kernels::moe::expert_weights> experts;  //!< FP4, checkpoint layout
  kernels::moe::expert_weights shared;                 //!< FP8, checkpoint layout
  int inter = 0;
  float swiglu_limit = 10.0f;
};

//! The non-attention tensors of a block stored under `p` ("layers.N." or "mtp.N."), with
//! `experts` routed experts of which `k` are active, and the given attention weights. A
//! tensor-parallel rank (parallel/tensor_parallel_reference.hpp) holds only the routed experts
//! [first_expert, first_expert + held_experts) (held_experts < 0: all of them), stored from
//! index 0 of `experts`; the gate still routes over all `experts`.
template <class Model>
block_weights block_weights_at(io::checkpoint& ck, const std::string& p, kernels::attention::layer_weights attn, int experts,
                               int k, int first_expert = 0, int held_experts = -1) {
  constexpr models::model_config c = Model::dims;
  block_weights b;
  b.attn = std::move(attn);
  b.attn_norm = detail::floats(ck, p + "attn_norm.weight", {c.dim});
  b.ffn_norm = detail::floats(ck, p + "ffn_norm.weight", {c.dim});
  const long long mix = c.mhc.mix_hc(), width = 1ll * c.mhc.hc_mult * c.dim;
  for (auto [name, m] : {std::pair{"attn", &b.attn_mix}, std::pair{"ffn", &b.ffn_mix}}) {
    m->fn = detail::floats(ck, p + "hc_" + name + "_fn", {mix, width});
    m->base = detail::floats(ck, p + "hc_" + name + "_base", {mix});
    m->scale = detail::floats(ck, p + "hc_" + name + "_scale", {3});
    m->iters = c.mhc.hc_sinkhorn_iters;
    m->hc_eps = c.mhc.hc_eps;
    m->norm_eps = c.norm_eps;
  }
  const int inter = c.moe.moe_inter_dim;
  b.inter = inter;
  b.swiglu_limit = c.moe.swiglu_limit;
  b.gate.experts = experts;
  b.gate.k = k;
  b.gate.dim = c.dim;
  b.gate.weight = detail::floats(ck, p + "ffn.gate.weight", {experts, c.dim});
  b.gate.bias = detail::floats(ck, p + "ffn.gate.bias", {experts});
  b.gate.route_scale = c.moe.route_scale;
  b.gate.gate_temp = c.moe.gate_temp;
  b.gate.norm_topk_prob = c.moe.norm_topk_prob;
  auto fp4 = [&](const std::string& name, int n, int k, std::vector<std::uint8_t>& w, std::vector<std::uint8_t>& s) {
    w = detail::bytes(ck, name + ".weight", {n, k / 2}, io::st_dtype::I8);
    // E2M1 has no NaN code; its UE8M0 scales can.
    s = detail::finite_codes(ck, name + ".scale", {n, k / 32}, io::st_dtype::F8_E8M0);
  };
  if (held_experts < 0) held_experts = experts - first_expert;
  if (first_expert < 0 || first_expert + held_experts > experts)
    throw error("block_weights_at: experts [" + std::to_string(first_expert) + ", " + std::to_string(first_expert + held_experts) +
                ") outside the " + std::to_string(experts) + " routed experts of " + p);
  for (int e = first_expert; e < first_expert + held_experts; ++e) {
    const std::string ex = p + "ffn.experts." + std::to_string(e) + ".";
    kernels::moe::expert_weights w;
    fp4(ex + "w1", inter, c.dim, w.w1, w.w1_s);
    fp4(ex + "w3", inter, c.dim, w.w3, w.w3_s);
    fp4(ex + "w2", c.dim, inter, w.w2, w.w2_s);
    b.experts.push_back(std::move(w));
  }
  auto fp8 = [&](const std::string& name, int n, int k, std::vector<std::uint8_t>& w, std::vector<std::uint8_t>& s) {
    auto l = detail::fp8(ck, name, n, k);
    w = std::move(l.codes), s = std::move(l.scales);
  };
  const std::string sh = p + "ffn.shared_experts.";
  fp8(sh + "w1", inter, c.dim, b.shared.w1, b.shared.w1_s);
  fp8(sh + "w3", inter, c.dim, b.shared.w3, b.shared.w3_s);
  fp8(sh + "w2", c.dim, inter, b.shared.w2, b.shared.w2_s);
  return b;
}

//! Every tensor of block `layer` of `Model`, read from `ck` (errors name the tensor and file).
template <class Model>
block_weights block_weights_of(io::checkpoint& ck, int layer) {
  constexpr models::model_config c = Model::dims;
  auto attn = attention_weights<Model>(ck, layer);  // also checks the layer index
  return block_weights_at<Model>(ck, "layers." + std::to_string(layer) + ".", std::move(attn), c.moe.n_routed_experts,
                                 c.moe.n_activated_experts);
}

//! Block.forward over `s` tokens with the attention sublayer given as `attention(attn_in)`
//! ([s, dim] attn_norm output -> [s, dim]) and the FFN as `ffn(ffn_in)` (the same shapes, the
//! call's rows at once): the backbone's CSA2 sublayer (block_forward_chunk) or a DSpark stage's
//! (dspark_reference.hpp), and the MoE of one process (block_forward_with) or of a
//! tensor-parallel rank (parallel/tensor_parallel_reference.hpp). Streams x [s, hc, dim] ->
//! returned streams; pre_mix [s, hc] holds the previous sublayer's pre on entry and this block's
//! f.pre on return.
template <class Attention, class Ffn>
std::vector<bf16> block_forward_with_ffn(int layer, const block_weights& w, int model_dim, float norm_eps, std::span<const bf16> x,
                                         std::vector<float>& pre_mix, Attention&& attention, Ffn&& ffn,
                                         const layer_observer* observe = nullptr) {
  namespace mhc = kernels::mhc;
  constexpr int hc = mhc::hc;
  const std::size_t dim = std::size_t(model_dim), width = hc * dim;
  if (x.empty() || x.size() % width) throw error("block_forward: x must be [s, 4, dim]");
  const std::size_t s = x.size() / width;
  if (pre_mix.size() != s * hc) throw error("block_forward: pre_mix must be [s, 4]");
  auto normed = [&](const std::vector<bf16>& v, const std::vector<float>& nw) {
    return kernels::norm::rmsnorm_bf16_reference(v, nw, norm_eps);
  };
  auto pre_of = [](const float* p, float (&a)[hc]) {
    for (int c = 0; c < hc; ++c) a[c] = p[c];
  };
  // Attention sublayer.
  std::vector<mhc::coefficients> a(s);
  std::vector<bf16> attn_in;
  for (std::size_t t = 0; t < s; ++t) {
    const auto xt = x.subspan(t * width, width);
    a[t] = mhc::hc_coefficients(xt, int(dim), w.attn_mix);
    float pm[hc];
    pre_of(&pre_mix[t * hc], pm);
    const auto in = normed(mhc::hc_pre(xt, int(dim), pm), w.attn_norm);
    attn_in.insert(attn_in.end(), in.begin(), in.end());
  }
  if (observe) (*observe)(layer, "attn_in", attn_in);
  const std::vector<bf16> attn_out = attention(std::span<const bf16>(attn_in));
  if (attn_out.size() != attn_in.size()) throw error("block_forward: the attention sublayer must return [s, dim]");
  if (observe) (*observe)(layer, "attn_out", attn_out);
  // FFN sublayer: the mixes and inputs of every row, the FFN over the rows (each row's MoE output
  // depends on that row only), then the residual update.
  std::vector<bf16> x1s, ffn_ins;
  x1s.reserve(x.size());
  ffn_ins.reserve(s * dim);
  std::vector<mhc::coefficients> f(s);
  for (std::size_t t = 0; t < s; ++t) {
    const auto x1 = mhc::hc_post(std::span<const bf16>(attn_out).subspan(t * dim, dim), x.subspan(t * width, width), int(dim), a[t]);
    f[t] = mhc::hc_coefficients(x1, int(dim), w.ffn_mix);
    const auto ffn_in = normed(mhc::hc_pre(x1, int(dim), a[t].pre), w.ffn_norm);
    x1s.insert(x1s.end(), x1.begin(), x1.end());
    ffn_ins.insert(ffn_ins.end(), ffn_in.begin(), ffn_in.end());
  }
  const std::vector<bf16> ffn_outs = ffn(std::span<const bf16>(ffn_ins));
  if (ffn_outs.size() != ffn_ins.size()) throw error("block_forward: the FFN sublayer must return [s, dim]");
  std::vector<bf16> out;
  out.reserve(x.size());
  for (std::size_t t = 0; t < s; ++t) {
    const auto x2 = mhc::hc_post(std::span<const bf16>(ffn_outs).subspan(t * dim, dim), std::span<const bf16>(x1s).subspan(t * width, width),
                                 int(dim), f[t]);
    out.insert(out.end(), x2.begin(), x2.end());
    for (int c = 0; c < hc; ++c) pre_mix[t * hc + c] = f[t].pre[c];
  }
  if (observe) (*observe)(layer, "ffn_in", ffn_ins), (*observe)(layer, "ffn_out", ffn_outs);
  return out;
}

//! block_forward_with_ffn with the block's own MoE (every routed expert in this process).
template <class Attention>
std::vector<bf16> block_forward_with(int layer, const block_weights& w, int model_dim, float norm_eps, std::span<const bf16> x,
                                     std::vector<float>& pre_mix, Attention&& attention, const layer_observer* observe = nullptr) {
  return block_forward_with_ffn(
      layer, w, model_dim, norm_eps, x, pre_mix, std::forward<Attention>(attention),
      [&](std::span<const bf16> ffn_in) {
        return kernels::moe::moe_layer_reference(ffn_in, w.gate, w.experts, w.shared, w.inter, w.swiglu_limit);
      },
      observe);
}

//! Block.forward of backbone layer `layer` over `s` tokens (block_forward_with and the CSA2
//! attention sublayer with the sequence's state).
inline std::vector<bf16> block_forward_chunk(int layer, const kernels::attention::layer_wiring& wiring,
                                             const block_weights& w, const kernels::attention::layer_shape& shape,
                                             std::span<const float> freqs, std::span<const bf16> x,
                                             std::vector<float>& pre_mix, long long start_pos,
                                             kernels::attention::sequence_state& state,
                                             const layer_observer* observe = nullptr,
                                             kernels::attention::layer_call call = kernels::attention::layer_call::normal) {
  return block_forward_with(
      layer, w, shape.dim, shape.norm_eps, x, pre_mix,
      [&](std::span<const bf16> attn_in) {
        return kernels::attention::attention_layer_reference(layer, wiring, w.attn, shape, freqs, attn_in, start_pos, state, call);
      },
      observe);
}

}  // namespace dsv4::model
