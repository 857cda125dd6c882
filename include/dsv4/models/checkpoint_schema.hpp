#pragma once
//! \file
//! The tensors a checkpoint of a model variant holds (spec §16): names, shapes and dtypes, all
//! derived from the variant's types. For V4.1 Flash it lists exactly the 96,085 tensors of the
//! official model.safetensors.index.json.
//!
//! Conventions (spec §16): names are the module parameter names with no "model." prefix; an FP8
//! linear is `<name>.weight` (F8_E4M3, [N, K]) plus `<name>.scale` (F8_E8M0, one per 32 x 32
//! tile); an FP4 expert linear is `<name>.weight` (I8 holding two E2M1 codes per byte, [N, K/2])
//! plus `<name>.scale` (F8_E8M0, [N, K/32]). Where the spec is unsure of a stored dtype, every
//! plausible one is accepted (`dtypes` has several entries); `wo_a.scale` may use 32 x 32 or
//! 128 x 128 tiles (convert.py accepts both), so its shape is checked by the loader, not here.

#include <string>
#include <vector>

#include "dsv4/io/tensor_spec.hpp"
#include "dsv4/models/model_traits.hpp"

namespace dsv4::models {

using io::tensor_spec;

namespace detail {
class schema_builder {
 public:
  std::vector<tensor_spec> out;
  void add(std::string name, std::vector<long long> shape, std::vector<io::st_dtype> dtypes, bool optional = false) {
    out.push_back({std::move(name), std::move(shape), std::move(dtypes), optional});
  }
  void bf16(const std::string& name, std::vector<long long> shape) { add(name, std::move(shape), {io::st_dtype::BF16}); }
  void f32(const std::string& name, std::vector<long long> shape) { add(name, std::move(shape), {io::st_dtype::F32}); }
  //! RMSNorm weights: bf16 in the backbone module; stored dtype not pinned by the spec.
  void norm(const std::string& name, long long dim) { add(name + ".weight", {dim}, {io::st_dtype::BF16, io::st_dtype::F32}); }
  void fp8_linear(const std::string& name, long long n, long long k) {
    add(name + ".weight", {n, k}, {io::st_dtype::F8_E4M3});
    add(name + ".scale", {(n + 31) / 32, (k + 31) / 32}, {io::st_dtype::F8_E8M0});
  }
  void fp4_linear(const std::string& name, long long n, long long k) {
    add(name + ".weight", {n, k / 2}, {io::st_dtype::I8});
    add(name + ".scale", {n, k / 32}, {io::st_dtype::F8_E8M0});
  }
};

template <class Model>
void block_tensors(schema_builder& b, const std::string& p, int experts, bool owner, int ratio, bool producer) {
  constexpr model_config c = Model::dims;
  const auto& a = c.attn;
  const long long hd = a.head_dim, dim = c.dim;
  const std::string at = p + "attn.";
  b.fp8_linear(at + "wq_a", a.q_lora_rank, dim);
  b.norm(at + "q_norm", a.q_lora_rank);
  b.fp8_linear(at + "wq_b", 1ll * a.n_heads * hd, a.q_lora_rank);
  b.fp8_linear(at + "wkv", hd, dim);
  b.norm(at + "kv_norm", hd);
  b.add(at + "wo_a.weight", {1ll * a.o_groups * a.o_lora_rank, 1ll * a.n_heads / a.o_groups * hd}, {io::st_dtype::F8_E4M3});
  b.add(at + "wo_a.scale", {}, {io::st_dtype::F8_E8M0});  // 32 x 32 or 128 x 128 tiles
  b.fp8_linear(at + "wo_b", dim, 1ll * a.o_groups * a.o_lora_rank);
  b.f32(at + "attn_sink", {a.n_heads});
  if (owner) {
    b.add(at + "compressor.wkv.weight", {hd, dim}, {io::st_dtype::BF16, io::st_dtype::F32});
    if (ratio > 1) b.add(at + "compressor.wgate.weight", {hd, dim}, {io::st_dtype::BF16, io::st_dtype::F32});
    b.norm(at + "compressor.norm", hd);
    b.bf16(at + "indexer.wk.weight", {c.indexer.index_head_dim, hd});
    b.norm(at + "indexer.k_norm", c.indexer.index_head_dim);
  }
  if (producer) {
    b.fp8_linear(at + "indexer.wq_b", 1ll * c.indexer.index_n_heads * c.indexer.index_head_dim, a.q_lora_rank);
    b.bf16(at + "indexer.weights_proj.weight", {c.indexer.index_n_heads, dim});
  }
  b.norm(p + "attn_norm", dim);
  b.norm(p + "ffn_norm", dim);
  const long long mix = c.mhc.mix_hc(), hc_dim = 1ll * c.mhc.hc_mult * dim;
  for (const char* s : {"attn", "ffn"}) {
    b.f32(p + "hc_" + s + "_fn", {mix, hc_dim});
    b.f32(p + "hc_" + s + "_base", {mix});
    b.f32(p + "hc_" + s + "_scale", {3});
  }
  const std::string ffn = p + "ffn.";
  b.add(ffn + "gate.weight", {experts, dim}, {io::st_dtype::BF16, io::st_dtype::F32});
  b.f32(ffn + "gate.bias", {experts});
  b.add(ffn + "gate.bias_vl", {experts}, {io::st_dtype::F32}, /*optional=*/true);
  const long long inter = c.moe.moe_inter_dim;
  for (int e = 0; e < experts; ++e) {
    const std::string ex = ffn + "experts." + std::to_string(e) + ".";
    b.fp4_linear(ex + "w1", inter, dim);
    b.fp4_linear(ex + "w3", inter, dim);
    b.fp4_linear(ex + "w2", dim, inter);
  }
  b.fp8_linear(ffn + "shared_experts.w1", inter, dim);
  b.fp8_linear(ffn + "shared_experts.w3", inter, dim);
  b.fp8_linear(ffn + "shared_experts.w2", dim, inter);
}
}  // namespace detail

//! Every tensor of the variant's checkpoint, in a stable order (top level, layers, Engram, DSpark,
//! vision).
template <class Model>
std::vector<tensor_spec> checkpoint_schema() {
  using traits = model_traits<Model>;
  using sched = typename traits::schedule;
  constexpr model_config c = Model::dims;
  const long long dim = c.dim, vocab = c.vocab_size;
  detail::schema_builder b;
  b.bf16("embed.weight", {vocab, dim});
  b.add("head.weight", {vocab, dim}, {io::st_dtype::BF16, io::st_dtype::F32});
  b.norm("norm", dim);
  for (const char* s : {"image_start", "image_end", "image_newline"}) b.bf16(s, {dim});
  for (int i = 0; i < sched::num_layers; ++i) {
    const auto role = sched::role(i);
    detail::block_tensors<Model>(b, "layers." + std::to_string(i) + ".", c.moe.n_routed_experts,
                                 role == schedule::attn_role::full, sched::ratio(i),
                                 role == schedule::attn_role::full || role == schedule::attn_role::reindex);
  }
  const auto& eg = c.engram;
  const long long columns = 1ll * (eg.engram_max_ngram_size - 1) * eg.engram_n_heads;
  for (std::size_t j = 0; j < sched::engram::values.size(); ++j) {
    const std::string p = "layers." + std::to_string(sched::engram::values[j]) + ".engram.";
    const long long rows = Model::engram_num_embeddings[j];
    b.add(p + "embed.weight", {rows, eg.engram_head_dim}, {io::st_dtype::F8_E4M3});
    b.add(p + "embed.scale", {rows, eg.engram_head_dim / 32}, {io::st_dtype::F8_E8M0});
    b.fp8_linear(p + "wkv", dim * (c.mhc.hc_mult + 1), columns * eg.engram_head_dim);
    b.bf16(p + "q_weight", {c.mhc.hc_mult, dim});
    b.bf16(p + "k_weight", {c.mhc.hc_mult, dim});
  }
  const int stages = sched::drafter::stages;
  for (int s = 0; s < stages; ++s) {
    const std::string p = "mtp." + std::to_string(s) + ".";
    detail::block_tensors<Model>(b, p, c.dspark.dspark_n_routed_experts, false, 0, false);
    if (s == 0) {
      b.fp8_linear(p + "main_proj", dim, 1ll * sched::drafter::targets::size * dim);
      b.norm(p + "main_norm", dim);
    }
    if (s == stages - 1) {
      b.norm(p + "norm", dim);
      b.add(p + "markov_head.embed.weight", {vocab, c.dspark.dspark_markov_rank}, {io::st_dtype::BF16});
      b.add(p + "markov_head.head.weight", {vocab, c.dspark.dspark_markov_rank}, {io::st_dtype::BF16, io::st_dtype::F32});
      b.add(p + "confidence_head.proj.weight", {1, dim + c.dspark.dspark_markov_rank}, {io::st_dtype::BF16, io::st_dtype::F32});
    }
  }
  const auto& v = c.vision;
  const long long vd = v.vision_dim, patch = 3ll * v.vision_patch_size * v.vision_patch_size;
  const std::vector<io::st_dtype> vdt = {io::st_dtype::BF16, io::st_dtype::F32};
  b.add("vision.patch_embed.proj.weight", {vd, patch}, vdt);
  b.add("vision.patch_embed.proj.bias", {vd}, vdt);
  for (int i = 0; i < v.vision_n_layers; ++i) {
    const std::string p = "vision.blocks." + std::to_string(i) + ".";
    b.add(p + "norm1.weight", {vd}, vdt);
    b.add(p + "norm2.weight", {vd}, vdt);
    b.add(p + "attn.wqkv.weight", {3 * vd, vd}, vdt);
    b.add(p + "attn.wqkv.bias", {3 * vd}, vdt);
    b.add(p + "attn.wo.weight", {vd, vd}, vdt);
    b.add(p + "attn.wo.bias", {vd}, vdt);
    b.add(p + "mlp.w1.weight", {2ll * v.vision_inter_dim, vd}, vdt);
    b.add(p + "mlp.w2.weight", {vd, v.vision_inter_dim}, vdt);
  }
  b.add("vision.norm.weight", {vd}, vdt);
  const long long unshuffle = vd * v.vision_downsample_ratio * v.vision_downsample_ratio;
  b.add("aligner.w1.weight", {dim, unshuffle}, vdt);
  b.add("aligner.w1.bias", {dim}, vdt);
  b.add("aligner.w2.weight", {dim, dim}, vdt);
  b.add("aligner.w2.bias", {dim}, vdt);
  return b.out;
}

}  // namespace dsv4::models
