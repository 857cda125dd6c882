#pragma once
//! \file
//! Binds a checkpoint's tensors (official names, spec §16) to the host attention sublayer of one
//! layer of a model variant: its wiring from the schedule type, its shape from the config, and
//! its weights converted to what the host reference consumes (FP8 linears as codes and scales;
//! bf16 / fp32 tensors as float values; wo_a dequantized to bf16 values, as convert.py does).
//! Every problem names the tensor: a missing tensor, a dtype the spec does not allow, a shape
//! that does not match the variant.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "dsv4/core/error.hpp"
#include "dsv4/io/checkpoint.hpp"
#include "dsv4/kernels/attention/layer_reference.hpp"
#include "dsv4/models/model_traits.hpp"
#include "dsv4/numerics/bf16.hpp"
#include "dsv4/numerics/minifloat.hpp"

namespace dsv4::model {

using kernels::attention::fp8_linear;
using kernels::attention::layer_shape;
using kernels::attention::layer_weights;
using kernels::attention::layer_wiring;

//! The attention widths of a variant (spec §5, §7).
template <class Model>
constexpr layer_shape attention_shape() {
  constexpr models::model_config c = Model::dims;
  return {.dim = c.dim, .heads = c.attn.n_heads, .head_dim = c.attn.head_dim, .rope_dim = c.attn.rope_head_dim,
          .q_lora = c.attn.q_lora_rank, .groups = c.attn.o_groups, .o_lora = c.attn.o_lora_rank,
          .window = c.attn.window_size, .index_heads = c.indexer.index_n_heads, .index_dim = c.indexer.index_head_dim,
          .topk = c.indexer.index_topk, .pool_blocks = c.indexer.candidate_topk_blocks,
          .pool_block = c.indexer.candidate_block_size, .norm_eps = c.norm_eps};
}

//! Layer `layer`'s place in the schedule (layer in [0, num_layers)).
template <class Model>
constexpr layer_wiring attention_wiring(int layer) {
  using sched = typename models::model_traits<Model>::schedule;
  if (layer < 0 || layer >= sched::num_layers) throw error("attention_wiring: no layer " + std::to_string(layer));
  return {sched::role(layer), sched::ratio(layer), sched::kv_owner[std::size_t(layer)], layer == sched::candidate_source};
}

//! The RoPE frequencies layer `layer` uses for q, its window KV, its compressed entries and its
//! index keys (spec §4): compressed layers share one YaRN table, ratio-0 layers a plain one.
template <class Model>
std::vector<float> attention_rope_frequencies(int layer) {
  using sched = typename models::model_traits<Model>::schedule;
  if (layer < 0 || layer >= sched::num_layers) throw error("attention_rope_frequencies: no layer " + std::to_string(layer));
  constexpr models::model_config c = Model::dims;
  if (sched::ratio(layer) == 0) return kernels::rope::frequencies({c.attn.rope_head_dim, c.rope.rope_theta});
  return kernels::rope::frequencies({c.attn.rope_head_dim, c.rope.compress_rope_theta, c.rope.original_seq_len,
                                     c.rope.rope_factor, c.rope.beta_fast, c.rope.beta_slow});
}

namespace detail {
// Returns a copy (a name, a shape and a span: cheap next to reading the tensor): a reference bound
// to a call with temporary arguments trips GCC 13's -Wdangling-reference.
inline io::tensor_view need(io::checkpoint& ck, const std::string& name, std::vector<long long> shape) {
  if (!ck.contains(name)) throw error("checkpoint: missing tensor '" + name + "'");
  const io::tensor_view& t = ck.tensor(name);
  if (!shape.empty() && t.shape != shape) {
    std::string want, got;
    for (long long v : shape) want += (want.empty() ? "" : ", ") + std::to_string(v);
    for (long long v : t.shape) got += (got.empty() ? "" : ", ") + std::to_string(v);
    throw error("checkpoint: tensor '" + name + "' in " + ck.file_of(name) + " has shape [" + got + "], expected [" + want + "]");
  }
  return t;
}

//! A bf16 or fp32 tensor as float values.
inline std::vector<float> floats(io::checkpoint& ck, const std::string& name, std::vector<long long> shape) {
  const io::tensor_view t = need(ck, name, std::move(shape));
  if (t.dtype == io::st_dtype::F32) return io::copy_as<float>(t);
  if (t.dtype == io::st_dtype::BF16) {
    const auto raw = io::copy_as<std::uint16_t>(t);
    std::vector<float> v(raw.size());
    for (std::size_t i = 0; i < raw.size(); ++i) v[i] = numerics::bf16::from_bits(raw[i]).to_float();
    return v;
  }
  throw error("checkpoint: tensor '" + name + "' in " + ck.file_of(name) + " is " + io::dtype_name(t.dtype) +
              ", expected BF16 or F32");
}

//! The bytes of tensor `name` in place (valid while `ck` lives), checked for shape and dtype.
inline std::span<const std::uint8_t> bytes_view(io::checkpoint& ck, const std::string& name, std::vector<long long> shape,
                                                io::st_dtype dtype) {
  const io::tensor_view t = need(ck, name, std::move(shape));
  if (t.dtype != dtype)
    throw error("checkpoint: tensor '" + name + "' in " + ck.file_of(name) + " is " + io::dtype_name(t.dtype) +
                ", expected " + io::dtype_name(dtype));
  return {reinterpret_cast<const std::uint8_t*>(t.bytes.data()), t.bytes.size()};
}

//! A copy of bytes_view's bytes.
inline std::vector<std::uint8_t> bytes(io::checkpoint& ck, const std::string& name, std::vector<long long> shape,
                                       io::st_dtype dtype) {
  const auto v = bytes_view(ck, name, std::move(shape), dtype);
  return {v.begin(), v.end()};
}

//! Throws if the codes of tensor `name` (rows of `cols` codes of Code: E4M3 elements or UE8M0
//! scales) hold NaN, as numerics::decode reads them. The reference computes NaN from such
//! weights; the CUDA kernels decode weight codes by bit placement (gemm/folded_gemm.cuh: the E4M3
//! NaN reads as 480, a NaN scale as infinity) and would compute something else. A checkpoint
//! holding them is corrupt: refuse it, naming the tensor, the file and the first such element.
template <class Code>
void reject_nan_codes(io::checkpoint& ck, const std::string& name, std::span<const std::uint8_t> codes,
                      long long cols) {
  static const std::array<bool, 256> is_nan = [] {
    std::array<bool, 256> t{};
    for (int c = 0; c < 256; ++c) t[std::size_t(c)] = std::isnan(numerics::decode<Code>(std::uint8_t(c)));
    return t;
  }();
  std::size_t count = 0, first = 0;
  for (std::size_t i = 0; i < codes.size(); ++i)
    if (is_nan[codes[i]] && count++ == 0) first = i;
  if (count == 0) return;
  constexpr bool scales = std::is_same_v<Code, numerics::ue8m0>;
  const long long c = std::max(1LL, cols);
  throw error("checkpoint: tensor '" + name + "' in " + ck.file_of(name) + " holds " + std::to_string(count) +
              (scales ? " NaN UE8M0 scale(s) (0xFF)" : " NaN E4M3 code(s) (0x7F / 0xFF)") +
              ", the first at [" + std::to_string(static_cast<long long>(first) / c) + ", " +
              std::to_string(static_cast<long long>(first) % c) + "]: the checkpoint is corrupt");
}

//! bytes() of an FP8 weight's E4M3 codes or UE8M0 scales, refused if any is NaN (reject_nan_codes).
inline std::vector<std::uint8_t> finite_codes(io::checkpoint& ck, const std::string& name,
                                              std::vector<long long> shape, io::st_dtype dtype) {
  const long long cols = shape.empty() ? 1 : shape.back();
  auto v = bytes(ck, name, std::move(shape), dtype);
  if (dtype == io::st_dtype::F8_E4M3)
    reject_nan_codes<numerics::e4m3>(ck, name, v, cols);
  else if (dtype == io::st_dtype::F8_E8M0)
    reject_nan_codes<numerics::ue8m0>(ck, name, v, cols);
  else
    throw error("finite_codes: '" + name + "' must be read as F8_E4M3 or F8_E8M0, not " +
                io::dtype_name(dtype));
  return v;
}

inline fp8_linear fp8(io::checkpoint& ck, const std::string& name, int n, int k) {
  return {n, k, finite_codes(ck, name + ".weight", {n, k}, io::st_dtype::F8_E4M3),
          finite_codes(ck, name + ".scale", {(n + 31) / 32, (k + 31) / 32}, io::st_dtype::F8_E8M0)};
}

//! wo_a: FP8 codes with 32 x 32 or 128 x 128 UE8M0 tiles (convert.py accepts both), dequantized
//! to bf16 values (exact: an E4M3 value times a power of two).
inline std::vector<float> dequantized_fp8(io::checkpoint& ck, const std::string& name, int n, int k) {
  const auto codes = finite_codes(ck, name + ".weight", {n, k}, io::st_dtype::F8_E4M3);
  const io::tensor_view s = need(ck, name + ".scale", {});
  int tile = 0;
  for (int t : {32, 128})
    if (s.shape == std::vector<long long>{(n + t - 1) / t, (k + t - 1) / t}) tile = t;
  if (tile == 0 || s.dtype != io::st_dtype::F8_E8M0)
    throw error("checkpoint: tensor '" + name + ".scale' in " + ck.file_of(name + ".scale") +
                " must be F8_E8M0 with 32 x 32 or 128 x 128 tiles of [" + std::to_string(n) + ", " + std::to_string(k) + "]");
  const auto scales = io::copy_as<std::uint8_t>(s);
  const int tiles_k = (k + tile - 1) / tile;
  reject_nan_codes<numerics::ue8m0>(ck, name + ".scale", scales, tiles_k);
  std::vector<float> v(codes.size());
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < k; ++c) {
      const float scale = numerics::decode<numerics::ue8m0>(scales[std::size_t(r / tile) * tiles_k + c / tile]);
      v[std::size_t(r) * k + c] =
          numerics::bf16::from_float(numerics::mul_rn(numerics::decode<numerics::e4m3>(codes[std::size_t(r) * k + c]), scale)).to_float();
    }
  return v;
}
}  // namespace detail

//! The tensors every attention sublayer has (q and kv paths, output path, sink), read from `ck`
//! under `p` ("layers.N.attn." in the backbone, "mtp.N.attn." for a DSpark stage). `s`: the
//! shapes to expect (a tensor-parallel rank's shard holds its heads, groups and index heads).
template <class Model>
layer_weights local_attention_weights(io::checkpoint& ck, const std::string& p,
                                      const layer_shape& s = attention_shape<Model>()) {
  layer_weights w;
  w.wq_a = detail::fp8(ck, p + "wq_a", s.q_lora, s.dim);
  w.q_norm = detail::floats(ck, p + "q_norm.weight", {s.q_lora});
  w.wq_b = detail::fp8(ck, p + "wq_b", s.heads * s.head_dim, s.q_lora);
  w.wkv = detail::fp8(ck, p + "wkv", s.head_dim, s.dim);
  w.kv_norm = detail::floats(ck, p + "kv_norm.weight", {s.head_dim});
  w.wo_a = detail::dequantized_fp8(ck, p + "wo_a", s.groups * s.o_lora, s.heads / s.groups * s.head_dim);
  w.wo_b = detail::fp8(ck, p + "wo_b", s.dim, s.groups * s.o_lora);
  w.attn_sink = detail::floats(ck, p + "attn_sink", {s.heads});
  return w;
}

//! The weights of layer `layer`'s attention sublayer, read from `ck`, in the shapes `s` (the
//! model's, or a tensor-parallel rank's: parallel/tensor_parallel_reference.hpp).
template <class Model>
layer_weights attention_weights(io::checkpoint& ck, int layer, const layer_shape& s = attention_shape<Model>()) {
  using schedule::attn_role;
  using sched = typename models::model_traits<Model>::schedule;
  if (layer < 0 || layer >= sched::num_layers)
    throw error("attention_weights: layer " + std::to_string(layer) + " outside [0, " + std::to_string(sched::num_layers) +
                ") of " + Model::name);
  const layer_wiring wr = attention_wiring<Model>(layer);
  const std::string p = "layers." + std::to_string(layer) + ".attn.";
  layer_weights w = local_attention_weights<Model>(ck, p, s);
  if (wr.role == attn_role::full) {
    w.compressor.dim = s.dim;
    w.compressor.head_dim = s.head_dim;
    w.compressor.ratio = wr.ratio;
    w.compressor.eps = s.norm_eps;
    w.compressor.wkv = detail::floats(ck, p + "compressor.wkv.weight", {s.head_dim, s.dim});
    if (wr.ratio > 1) w.compressor.wgate = detail::floats(ck, p + "compressor.wgate.weight", {s.head_dim, s.dim});
    w.compressor.norm = detail::floats(ck, p + "compressor.norm.weight", {s.head_dim});
    w.index_key.index_dim = s.index_dim;
    w.index_key.eps = s.norm_eps;
    w.index_key.wk = detail::floats(ck, p + "indexer.wk.weight", {s.index_dim, s.head_dim});
    w.index_key.norm = detail::floats(ck, p + "indexer.k_norm.weight", {s.index_dim});
  }
  if (wr.role == attn_role::full || wr.role == attn_role::reindex) {
    w.idx_wq_b = detail::fp8(ck, p + "indexer.wq_b", s.index_heads * s.index_dim, s.q_lora);
    w.weights_proj = detail::floats(ck, p + "indexer.weights_proj.weight", {s.index_heads, s.dim});
  }
  return w;
}

}  // namespace dsv4::model
