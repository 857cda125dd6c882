#pragma once
//! \file
//! One block's non-attention weights on the device (the mHC norms and mixes, the MoE gate and
//! experts in the GEMMs' MMA-tile layout) and the mHC boundary between sublayers: what
//! device_model's backbone blocks and device_dspark's drafter stages share.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/gemm/weight_tiles.hpp"
#include "dsv4/kernels/mhc/mhc_step.cuh"
#include "dsv4/kernels/moe/moe.cuh"
#include "dsv4/model/block_reference.hpp"
#include "dsv4/runtime/device_buffer.cuh"

namespace dsv4::model::device_detail {

using numerics::bf16;
using runtime::device_buffer;

template <class T>
device_buffer<T> upload(std::span<const T> v) {
  return device_buffer<T>{v};
}
template <class T>
device_buffer<T> upload(const std::vector<T>& v) {
  return upload(std::span<const T>(v));
}
inline device_buffer<bf16> upload_bf16(const std::vector<float>& v) {
  return upload(numerics::to_bf16(v));
}

//! Whether every value of `v` is a bf16 value (NaN included). The CUDA MoE gate and the bf16
//! layers take bf16 weights; a checkpoint may store some of them in F32 (the schema accepts both),
//! which the host model keeps exact: the device models refuse rather than round.
inline bool holds_bf16_values(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(),
                     [](float f) { return f != f || bf16::from_float(f).to_float() == f; });
}
//! Throws, naming `what` and `who`, unless holds_bf16_values(v).
inline void require_bf16(const std::vector<float>& v, const std::string& who, const std::string& what) {
  if (!holds_bf16_values(v))
    throw error(who + ": " + what +
                " holds F32 values that bf16 cannot represent; the CUDA path takes bf16 there");
}

//! Matrices of several experts, each tiled, one after the other.
struct tiled_stack {
  std::vector<std::uint8_t> codes, scales;
  void add(kernels::gemm::weight_format wf, int n, int k, const std::vector<std::uint8_t>& c,
           const std::vector<std::uint8_t>& s) {
    const auto t = kernels::gemm::tile_weight(wf, n, k, c, s);
    codes.insert(codes.end(), t.codes.begin(), t.codes.end());
    scales.insert(scales.end(), t.scales.begin(), t.scales.end());
  }
};

//! A block's mHC and MoE weights on the device.
struct device_block {
  device_buffer<bf16> attn_norm, ffn_norm, gate;
  device_buffer<float> attn_fn, attn_base, attn_scale, ffn_fn, ffn_base, ffn_scale, bias;
  device_buffer<std::uint8_t> w1[2], w3[2], w2[2], s1[2], s3[2], s2[2];  //!< codes, scales (MMA tiles)

  //! A block's weights converted on the host, ready to copy (no device work: convert runs on
  //! runtime::prepare_ahead's workers).
  struct host_form {
    std::vector<bf16> attn_norm, ffn_norm, gate;
    tiled_stack w1, w3, w2, s1, s3, s2;
  };
  static host_form convert(const block_weights& b, int dim) {
    namespace gm = kernels::gemm;
    host_form h;
    h.attn_norm = numerics::to_bf16(b.attn_norm), h.ffn_norm = numerics::to_bf16(b.ffn_norm),
    h.gate = numerics::to_bf16(b.gate.weight);
    for (const auto& e : b.experts) {
      h.w1.add(gm::weight_format::fp4_row32, b.inter, dim, e.w1, e.w1_s);
      h.w3.add(gm::weight_format::fp4_row32, b.inter, dim, e.w3, e.w3_s);
      h.w2.add(gm::weight_format::fp4_row32, dim, b.inter, e.w2, e.w2_s);
    }
    h.s1.add(gm::weight_format::fp8_tile32, b.inter, dim, b.shared.w1, b.shared.w1_s);
    h.s3.add(gm::weight_format::fp8_tile32, b.inter, dim, b.shared.w3, b.shared.w3_s);
    h.s2.add(gm::weight_format::fp8_tile32, dim, b.inter, b.shared.w2, b.shared.w2_s);
    return h;
  }
  //! `h` (convert(b, dim)) and b's fp32 tensors on the device.
  static device_block to_device(const host_form& h, const block_weights& b) {
    device_block d;
    d.attn_norm = upload(h.attn_norm), d.ffn_norm = upload(h.ffn_norm), d.gate = upload(h.gate);
    d.attn_fn = upload(b.attn_mix.fn), d.attn_base = upload(b.attn_mix.base),
    d.attn_scale = upload(b.attn_mix.scale);
    d.ffn_fn = upload(b.ffn_mix.fn), d.ffn_base = upload(b.ffn_mix.base),
    d.ffn_scale = upload(b.ffn_mix.scale);
    d.bias = upload(b.gate.bias);
    auto put = [](device_buffer<std::uint8_t>(&dst)[2], const tiled_stack& src) {
      dst[0] = upload(src.codes), dst[1] = upload(src.scales);
    };
    put(d.w1, h.w1), put(d.w3, h.w3), put(d.w2, h.w2), put(d.s1, h.s1), put(d.s3, h.s3), put(d.s2, h.s2);
    return d;
  }
  //! Uploads `b` (its routed experts as held: a tensor-parallel rank's slice or all of them).
  static device_block upload_from(const block_weights& b, int dim) { return to_device(convert(b, dim), b); }

  //! The MoE kernels' view of these weights.
  kernels::moe::moe_weights moe() const {
    kernels::moe::moe_weights mw;
    mw.gate = gate.data(), mw.bias = bias.data();
    mw.w1 = w1[0].data(), mw.w1_s = w1[1].data(), mw.w3 = w3[0].data(), mw.w3_s = w3[1].data();
    mw.w2 = w2[0].data(), mw.w2_s = w2[1].data(), mw.s1 = s1[0].data(), mw.s1_s = s1[1].data();
    mw.s3 = s3[0].data(), mw.s3_s = s3[1].data(), mw.s2 = s2[0].data(), mw.s2_s = s2[1].data();
    return mw;
  }
};

//! The mHC constants of a model (spec §10).
struct mhc_constants {
  float norm_eps = 1e-20f, hc_eps = 1e-6f;
  int iters = 20;
  int dim = 0;
};

template <class Model>
constexpr mhc_constants mhc_constants_of() {
  return {Model::dims.norm_eps, Model::dims.mhc.hc_eps, Model::dims.mhc.hc_sinkhorn_iters, Model::dims.dim};
}

//! One mHC boundary: Y = hc_post(F, X) (F null: Y = X), h = norm(hc_pre(Y, pre)), the next
//! sublayer's mixes (fn null: none), and optionally h's act_quant (mhc_step_args::h_codes).
inline void mhc_boundary(const mhc_constants& k, long long rows, const bf16* x, const bf16* f,
                         const float* post, const float* comb, const float* pre, const bf16* norm_w, bf16* y,
                         bf16* h, const float* fn, const float* base, const float* scale, float* next_pre,
                         float* next_post, float* next_comb, kernels::mhc::mhc_workspace& ws,
                         cudaStream_t stream, std::uint8_t* h_codes = nullptr,
                         std::uint8_t* h_scales = nullptr, std::uint16_t* h_codes_f16 = nullptr) {
  kernels::mhc::mhc_step_args a;
  a.h_codes = h_codes, a.h_scales = h_scales, a.h_codes_f16 = h_codes_f16;
  a.x = x, a.f = f, a.post = post, a.comb = comb, a.pre = pre, a.norm_w = norm_w, a.norm_eps = k.norm_eps;
  a.y = y, a.h = h, a.fn = fn, a.base = base, a.scale = scale, a.iters = k.iters;
  a.hc_eps = k.hc_eps, a.mix_norm_eps = k.norm_eps, a.next_pre = next_pre, a.next_post = next_post;
  a.next_comb = next_comb, a.tokens = rows, a.dim = k.dim;
  kernels::mhc::mhc_step(a, ws, stream);
}

}  // namespace dsv4::model::device_detail
