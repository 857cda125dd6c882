#pragma once
//! \file
//! Host reference of the CSA2 compressor and of the global entries it feeds (spec §6, §7).
//!
//! The compressor turns every `ratio` consecutive tokens of a KV-owner layer's attention input
//! into one latent (pre-RoPE, bf16, `head_dim` wide):
//! - ratio 1: latent_t = RMSNorm(bf16(W_kv x_t)), a plain bf16 projection;
//! - ratio >= 2: k_t = W_kv x_t and z_t = W_gate x_t in fp32; per channel, a softmax of z over the
//!   group's tokens weights k; the fp32 sum is rounded to bf16 once, then RMSNorm.
//! Prefill (from position 0) emits only complete groups and leaves the tail's fp32 k, z in the
//! decode state at slot position % ratio; decode writes each token's k, z there and pools when
//! the group completes. Entry g stands for position g * ratio (RoPE) and becomes visible to
//! queries at positions >= g * ratio + ratio - 1.
//!
//! From a latent, `make_entries` builds the two cached entries: the main KV entry (RoPE on the
//! last rope_dim channels at the group's first position, then E2M1/E4M3-16 quantization) and the
//! index key (k = RMSNorm(W_k latent) from the pre-RoPE latent, RoPE on its last rope_dim channels,
//! then MXFP4 quantization).

#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/kernels/linear/reference.hpp"
#include "dsv4/kernels/norm/reference.hpp"
#include "dsv4/kernels/rope/rope.hpp"
#include "dsv4/numerics/formats.hpp"
#include "dsv4/numerics/quantize.hpp"

namespace dsv4::kernels::compressor {

using numerics::bf16;

struct compressor_weights {
  int dim = 0;       //!< model width (input)
  int head_dim = 0;  //!< latent width (512 for V4.1)
  int ratio = 1;
  std::vector<float> wkv;    //!< [head_dim, dim]: bf16 values at ratio 1, fp32 at ratio >= 2
  std::vector<float> wgate;  //!< [head_dim, dim], fp32, ratio >= 2 only
  std::vector<float> norm;   //!< [head_dim], RMSNorm weight
  float eps = 1e-20f;

  void check() const {
    const std::size_t w = std::size_t(dim) * std::size_t(head_dim);
    if (ratio < 1) throw error("compressor: ratio must be >= 1");
    if (wkv.size() != w) throw error("compressor: wkv must be [head_dim, dim] = [" + std::to_string(head_dim) + ", " + std::to_string(dim) + "]");
    if (ratio > 1 && wgate.size() != w) throw error("compressor: wgate must be [head_dim, dim] at ratio > 1");
    if (norm.size() != std::size_t(head_dim)) throw error("compressor: norm must have head_dim entries");
  }
};

//! Per sequence decode state of one compressor: fp32 k and z of the pending group's tokens.
struct compressor_state {
  std::vector<float> kv, score;  //!< [ratio, head_dim]; score starts at -inf (never read unset)
  explicit compressor_state(const compressor_weights& w)
      : kv(std::size_t(w.ratio) * w.head_dim, 0.0f), score(std::size_t(w.ratio) * w.head_dim, -INFINITY) {}
};

namespace detail {
inline std::vector<bf16> finish(const compressor_weights& w, std::span<const float> pooled) {
  std::vector<float> rounded(pooled.size());
  for (std::size_t i = 0; i < pooled.size(); ++i) rounded[i] = numerics::round_to_bf16(pooled[i]);
  std::vector<bf16> out(pooled.size());
  norm::rmsnorm_reference(rounded, w.norm, w.eps, out);
  return out;
}
//! Softmax over the group's tokens per channel, then the weighted sum of k (all fp32).
inline std::vector<bf16> pool(const compressor_weights& w, std::span<const float> kv, std::span<const float> score) {
  std::vector<float> c(std::size_t(w.head_dim));
  for (int ch = 0; ch < w.head_dim; ++ch) {
    float mx = -INFINITY;
    for (int t = 0; t < w.ratio; ++t) mx = std::max(mx, score[std::size_t(t) * w.head_dim + ch]);
    float sum = 0;
    std::vector<float> e(std::size_t(w.ratio));
    for (int t = 0; t < w.ratio; ++t) sum += e[std::size_t(t)] = std::exp(score[std::size_t(t) * w.head_dim + ch] - mx);
    float acc = 0;
    for (int t = 0; t < w.ratio; ++t) acc += numerics::mul_rn(e[std::size_t(t)] / sum, kv[std::size_t(t) * w.head_dim + ch]);
    c[std::size_t(ch)] = acc;
  }
  return finish(w, c);
}
}  // namespace detail

//! Prefill from position 0 over `tokens` rows of x [tokens, dim]: returns tokens / ratio latents
//! [n, head_dim] and leaves the trailing tokens % ratio tokens in `state`.
inline std::vector<bf16> compress_prefill(const compressor_weights& w, std::span<const bf16> x, int tokens,
                                          compressor_state& state) {
  w.check();
  if (x.size() != std::size_t(tokens) * w.dim) throw error("compress_prefill: x must be [tokens, dim]");
  std::vector<bf16> latents;
  if (w.ratio == 1) {
    for (int t = 0; t < tokens; ++t) {
      const auto xf = linear::widen(x.subspan(std::size_t(t) * w.dim, w.dim));
      const auto proj = linear::linear_bf16_reference(xf, w.wkv, w.head_dim);
      const auto lat = detail::finish(w, linear::widen(proj));
      latents.insert(latents.end(), lat.begin(), lat.end());
    }
    return latents;
  }
  std::vector<float> kv(std::size_t(w.ratio) * w.head_dim), score(kv.size());
  for (int t = 0; t < tokens; ++t) {
    const auto xf = linear::widen(x.subspan(std::size_t(t) * w.dim, w.dim));
    const auto k = linear::linear_fp32_reference(xf, w.wkv, w.head_dim);
    const auto z = linear::linear_fp32_reference(xf, w.wgate, w.head_dim);
    const int slot = t % w.ratio;
    const bool complete_group = t / w.ratio < tokens / w.ratio;
    float* kd = complete_group ? kv.data() : state.kv.data();
    float* zd = complete_group ? score.data() : state.score.data();
    std::copy(k.begin(), k.end(), kd + std::size_t(slot) * w.head_dim);
    std::copy(z.begin(), z.end(), zd + std::size_t(slot) * w.head_dim);
    if (complete_group && slot == w.ratio - 1) {
      const auto lat = detail::pool(w, kv, score);
      latents.insert(latents.end(), lat.begin(), lat.end());
    }
  }
  return latents;
}

//! One decode step at position `pos`: returns the latent when this token completes a group.
inline std::optional<std::vector<bf16>> compress_decode(const compressor_weights& w, std::span<const bf16> x,
                                                        long long pos, compressor_state& state) {
  w.check();
  if (x.size() != std::size_t(w.dim)) throw error("compress_decode: x must have dim values");
  const auto xf = linear::widen(x);
  if (w.ratio == 1) return detail::finish(w, linear::widen(linear::linear_bf16_reference(xf, w.wkv, w.head_dim)));
  const int slot = int(pos % w.ratio);
  const auto k = linear::linear_fp32_reference(xf, w.wkv, w.head_dim);
  const auto z = linear::linear_fp32_reference(xf, w.wgate, w.head_dim);
  std::copy(k.begin(), k.end(), state.kv.begin() + std::ptrdiff_t(slot) * w.head_dim);
  std::copy(z.begin(), z.end(), state.score.begin() + std::ptrdiff_t(slot) * w.head_dim);
  if ((pos + 1) % w.ratio != 0) return std::nullopt;
  return detail::pool(w, state.kv, state.score);
}

//! Index-key projection of a KV owner's indexer (spec §7): wk [index_dim, head_dim] bf16 values.
struct index_key_weights {
  int index_dim = 0;
  std::vector<float> wk;    //!< [index_dim, head_dim]
  std::vector<float> norm;  //!< [index_dim]
  float eps = 1e-20f;
};

//! The index key of a latent before quantization (spec §7): RMSNorm(W_k latent) from the
//! pre-RoPE latent, RoPE on its last rope_dim channels at the group's first position.
inline std::vector<bf16> index_key_of(std::span<const bf16> latent, const index_key_weights& ik,
                                      std::span<const float> freqs, long long position) {
  const std::int64_t pos[1] = {position};
  const std::vector<bf16> key = linear::linear_bf16_reference(linear::widen(latent), ik.wk, ik.index_dim);
  std::vector<bf16> key_n(key.size());
  norm::rmsnorm_reference(linear::widen(key), ik.norm, ik.eps, key_n);
  rope::apply_rope_reference(key_n, ik.index_dim, 1, pos, freqs, false);
  return key_n;
}

template <int HeadDim, int IndexDim>
struct global_entry {
  using main_layout = numerics::packed_vector<numerics::main_kv_format, HeadDim>;
  using index_layout = numerics::packed_vector<numerics::index_key_format, IndexDim>;
  std::uint8_t main[main_layout::bytes];
  std::uint8_t index[index_layout::bytes];
};

//! The cached entries of latent group g: RoPE at `position` (g * ratio in prefill,
//! pos + 1 - ratio in decode) with the compressed-layer frequencies, then quantization.
template <int HeadDim, int IndexDim>
global_entry<HeadDim, IndexDim> make_entries(std::span<const bf16> latent, const index_key_weights& ik,
                                             std::span<const float> freqs, long long position) {
  using entry = global_entry<HeadDim, IndexDim>;
  if (latent.size() != std::size_t(HeadDim) || ik.index_dim != IndexDim)
    throw error("make_entries: latent must have head_dim values and the index key index_dim channels");
  entry e{};
  const std::int64_t pos[1] = {position};
  // Index key first: it is built from the pre-RoPE latent.
  const std::vector<bf16> key_n = index_key_of(latent, ik, freqs, position);
  numerics::quantize_vector<numerics::index_key_format>(key_n, {e.index, entry::index_layout::code_bytes},
                                                        {e.index + entry::index_layout::scale_offset, entry::index_layout::scale_bytes});
  std::vector<bf16> main(latent.begin(), latent.end());
  rope::apply_rope_reference(main, HeadDim, 1, pos, freqs, false);
  numerics::quantize_vector<numerics::main_kv_format>(main, {e.main, entry::main_layout::code_bytes},
                                                      {e.main + entry::main_layout::scale_offset, entry::main_layout::scale_bytes});
  return e;
}

}  // namespace dsv4::kernels::compressor
